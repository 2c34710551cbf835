"""conformance_diff.py on hand-made runs (no GPU).

    python3 -m pytest preload/demo/test_conformance_diff.py
    python3 preload/demo/test_conformance_diff.py          (without pytest)
"""
import io
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import conformance_diff as cd  # noqa: E402

DEMO = os.path.dirname(os.path.abspath(__file__))

# A run without the layer: three phases of the real program's cases, INFO and END.
REFERENCE = """\
CASE small/cuMemGetAddressRange/inside: rc=0 base=start+0 size=1048576
CASE small/cuPointerGetAttribute/IS_LEGACY_CUDA_IPC_CAPABLE: rc=0 start=1 inside=1
CASE small/cuPointerGetAttribute/CONTEXT: rc=0 start=current inside=current
CASE small/cudaIpcGetMemHandle/start: rc=0
CASE tagged/cuPointerGetAttribute/CONTEXT: rc=0 start=current inside=current
CASE tagged/cudaIpcGetMemHandle/start: rc=0
CASE resumed/contents/kept: rc=0 contents=right
CASE resumed/cuPointerGetAttribute/CONTEXT: rc=0 start=current inside=current
CASE resumed/cuMemRetainAllocationHandle/inside: rc=1
CASE resumed/cudaGraphAddMemsetNode/start: rc=0
CASE resumed/graph-run/memset: rc=0 launch=0 sync=0 contents=right
CASE resumed/cudaMemcpy/default-in-out: rc=0 contents=right
INFO layer=none pause=absent resume=absent
END
"""

ALLOWED = """\
# comment
vmm,vmm+elide | */cuPointerGetAttribute/IS_LEGACY_CUDA_IPC_CAPABLE | rc=0 start=0 inside=0 | VMM memory is not legacy-IPC capable
vmm,vmm+elide | */cudaIpcGetMemHandle/start | rc=1 | refused on VMM memory
"""

VMM_INFO = "INFO layer=vmm pause=0 resume=0"
MONITOR_INFO = "INFO layer=monitor pause=4 resume=4"


def run(text):
    return cd.parse_run(io.StringIO(text))


def layer_run(info, edit=lambda lines: lines):
    """The reference with its INFO line replaced and `edit` applied to its lines."""
    lines = [l for l in REFERENCE.splitlines() if not l.startswith("INFO ")]
    lines = edit(lines)
    lines.insert(len(lines) - 1, info)  # before END
    return run("\n".join(lines) + "\n")


def replace(key, result):
    def edit(lines):
        return [f"CASE {key}: {result}" if l.startswith(f"CASE {key}: ") else l for l in lines]

    return edit


def diff(mode, layer, allowed=ALLOWED):
    out = io.StringIO()
    status, outcomes = cd.diff(
        cd.parse_allowed(io.StringIO(allowed)), run(REFERENCE), [(mode, layer)], out
    )
    return status, outcomes[0], out.getvalue()


def test_identical_runs_pass():
    status, outcome, text = diff("vmm", layer_run(VMM_INFO))
    assert status == 0, text
    assert outcome.result_line() == (
        "RESULT conformance vmm: 12 lines, 0 differ, 0 missing, 0 allowed differences"
    )


def test_one_missing_line_is_one_finding_not_a_cascade():
    # The run under the layer lacks one line in the middle (as issue 39's did): the lines after
    # it still match by their keys.
    drop = "CASE resumed/cuPointerGetAttribute/CONTEXT: "
    layer = layer_run(VMM_INFO, lambda lines: [l for l in lines if not l.startswith(drop)])
    status, outcome, text = diff("vmm", layer)
    assert status == 1
    assert outcome.missing == [
        ("resumed/cuPointerGetAttribute/CONTEXT", "rc=0 start=current inside=current", "layer")
    ]
    assert outcome.differ == []
    assert "RESULT conformance vmm: 12 lines, 0 differ, 1 missing, 0 allowed differences" in text
    assert "MISSING vmm: resumed/cuPointerGetAttribute/CONTEXT (only without the layer" in text


def test_a_line_only_under_the_layer_is_one_missing_finding():
    # An extra line (issue 39: the monitor run's NOTE line shifted the comparison by one).
    def edit(lines):
        at = lines.index("CASE resumed/contents/kept: rc=0 contents=right")
        return lines[:at] + ["CASE resumed/layer-only/extra: rc=0"] + lines[at:]

    status, outcome, text = diff("monitor", layer_run(MONITOR_INFO, edit))
    assert status == 1
    assert outcome.missing == [("resumed/layer-only/extra", "rc=0", "none")]
    assert outcome.differ == []
    assert "MISSING monitor: resumed/layer-only/extra (only under the layer: rc=0)" in text


def test_lines_that_are_not_cases_are_not_compared():
    # The layer's stderr (its notices, its exit summary lines, with or without its prefix) may
    # appear anywhere between whole lines.
    def edit(lines):
        return (
            ["stablebuf-preload: cuMemRetainAllocationHandle(0x7f..) refused"]
            + lines[:5]
            + ["stablebuf-preload vmm: 12 allocations ...", "device 0: pool: 1.0 GiB mapped"]
            + lines[5:]
        )

    status, outcome, text = diff("vmm", layer_run(VMM_INFO, edit))
    assert status == 0, text


def test_a_differing_line_is_reported_with_both_results():
    layer = layer_run(
        VMM_INFO, replace("tagged/cuPointerGetAttribute/CONTEXT", "rc=0 start=null inside=null")
    )
    status, outcome, text = diff("vmm", layer)
    assert status == 1
    assert outcome.differ == [
        (
            "tagged/cuPointerGetAttribute/CONTEXT",
            "rc=0 start=current inside=current",
            "rc=0 start=null inside=null",
        )
    ]
    assert outcome.missing == []
    assert (
        "DIFF vmm: tagged/cuPointerGetAttribute/CONTEXT\n"
        "    no layer: rc=0 start=current inside=current\n"
        "    layer:    rc=0 start=null inside=null"
    ) in text
    assert "1 differ, 0 missing" in text


def test_an_allowed_difference_names_its_case_and_reason():
    def edit(lines):
        lines = replace("small/cuPointerGetAttribute/IS_LEGACY_CUDA_IPC_CAPABLE", "rc=0 start=0 inside=0")(lines)
        lines = replace("small/cudaIpcGetMemHandle/start", "rc=1")(lines)
        return replace("tagged/cudaIpcGetMemHandle/start", "rc=1")(lines)

    status, outcome, text = diff("vmm+elide", layer_run(VMM_INFO, edit))
    assert status == 0, text
    assert [key for key, *_ in outcome.allowed] == [
        "small/cuPointerGetAttribute/IS_LEGACY_CUDA_IPC_CAPABLE",
        "small/cudaIpcGetMemHandle/start",
        "tagged/cudaIpcGetMemHandle/start",
    ]
    assert (
        "ALLOWED vmm+elide: small/cudaIpcGetMemHandle/start: no layer `rc=0`, layer `rc=1` "
        "(refused on VMM memory)"
    ) in text
    assert "RESULT conformance vmm+elide: 12 lines, 0 differ, 0 missing, 3 allowed differences" in text


def test_an_allowed_entry_excuses_only_the_result_it_names():
    # The entry for cudaIpcGetMemHandle says the layer prints rc=1; anything else still differs.
    layer = layer_run(VMM_INFO, replace("small/cudaIpcGetMemHandle/start", "rc=0 extra=1"))
    status, outcome, _ = diff("vmm", layer)
    assert status == 1
    assert [key for key, *_ in outcome.differ] == ["small/cudaIpcGetMemHandle/start"]


def test_monitor_with_an_allowed_entry_for_vmm_only_still_fails():
    layer = layer_run(MONITOR_INFO, replace("small/cudaIpcGetMemHandle/start", "rc=1"))
    status, outcome, text = diff("monitor", layer)
    assert status == 1
    assert outcome.allowed == []
    assert [key for key, *_ in outcome.differ] == ["small/cudaIpcGetMemHandle/start"]
    assert "RESULT conformance monitor: 12 lines, 1 differ, 0 missing, 0 allowed differences" in text


def test_an_allowed_entry_never_excuses_a_missing_case():
    drop = "CASE small/cudaIpcGetMemHandle/start: "
    layer = layer_run(VMM_INFO, lambda lines: [l for l in lines if not l.startswith(drop)])
    status, outcome, _ = diff("vmm", layer)
    assert status == 1
    assert len(outcome.missing) == 1 and outcome.allowed == []


def test_a_vmm_run_that_did_not_pause_fails():
    status, outcome, text = diff("vmm", layer_run("INFO layer=vmm pause=5 resume=0"))
    assert status == 1
    assert "FAILED vmm: INFO pause=5, expected pause=0 for mode vmm" in text


def test_a_run_without_the_layer_loaded_cannot_pass_as_vmm():
    status, _, text = diff("vmm", layer_run("INFO layer=none pause=absent resume=absent"))
    assert status == 1
    assert "expected layer=vmm" in text


def test_a_run_that_did_not_finish_fails_and_reports_what_it_lacks():
    lines = REFERENCE.splitlines()
    cut = lines[:6] + ["FATAL cudaMalloc(&tagged, 64 * MIB): out of memory (2) at line 400"]
    status, outcome, text = diff("vmm", run("\n".join(cut) + "\n"))
    assert status == 1
    assert "FAILED vmm: the run did not reach END" in text
    assert "FAILED vmm: program error: FATAL cudaMalloc" in text
    assert len(outcome.missing) == 6


def test_a_case_printed_twice_fails():
    def edit(lines):
        return lines[:2] + [lines[1]] + lines[2:]

    status, _, text = diff("vmm", layer_run(VMM_INFO, edit))
    assert status == 1
    assert "case printed twice: small/cuPointerGetAttribute/IS_LEGACY_CUDA_IPC_CAPABLE" in text


def test_a_glued_line_is_one_finding():
    # What a fully buffered stdout did in issue 39: the layer's exit line in the middle of a line.
    def edit(lines):
        at = lines.index("CASE resumed/cuPointerGetAttribute/CONTEXT: rc=0 start=current inside=current")
        return (
            lines[:at]
            + ["CASE resumed/cuPointerGetAttribute/CONTstablebuf-preload vmm: 9 allocations", "EXT: rc=0 start=current inside=current"]
            + lines[at + 1 :]
        )

    status, outcome, text = diff("vmm", layer_run(VMM_INFO, edit))
    assert status == 1
    assert [m[0] for m in outcome.missing] == ["resumed/cuPointerGetAttribute/CONTEXT"]
    assert "unreadable case line" in text
    assert outcome.differ == []


def test_the_shipped_allowed_file_parses_and_has_no_monitor_entry():
    with open(os.path.join(DEMO, "pointer_conformance.allowed")) as f:
        entries = cd.parse_allowed(f)
    assert entries
    for entry in entries:
        assert "monitor" not in entry.modes
        assert entry.why and entry.layer


def test_a_bad_allowed_line_is_refused():
    try:
        cd.parse_allowed(io.StringIO("vmm | */x | missing the reason\n"))
    except ValueError as error:
        assert "modes | case | layer result | why" in str(error)
    else:
        raise AssertionError("accepted an entry without a reason")


def test_the_command_line_reads_files_and_exits_with_the_verdict(tmp_path):
    allowed = tmp_path / "allowed"
    allowed.write_text(ALLOWED)
    none = tmp_path / "none.log"
    none.write_text(REFERENCE)
    monitor = tmp_path / "monitor.log"
    monitor.write_text(REFERENCE.replace("INFO layer=none pause=absent resume=absent", MONITOR_INFO))
    assert cd.main([str(allowed), str(none), f"monitor={monitor}"]) == 0
    broken = tmp_path / "broken.log"
    broken.write_text(monitor.read_text().replace("contents=right\nCASE resumed/cuPointer", "contents=WRONG\nCASE resumed/cuPointer"))
    assert cd.main([str(allowed), str(none), f"monitor={monitor}", f"monitor={broken}"]) == 1

