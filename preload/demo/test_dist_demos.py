"""The parts of nccl_register_pause.py and torch_dist_graph.py that need no GPU: reading NCCL's
log, the REGISTRATION-CLAIM verdict, and the comparison of the torchrun runs.

    python3 -m pytest preload/demo/test_dist_demos.py
    python3 preload/demo/test_dist_demos.py          (without pytest)
"""
import io
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import nccl_register_pause as nrp  # noqa: E402
import torch_dist_graph as tdg  # noqa: E402

# NCCL 2.27's wording (src/transport/p2p.cc, src/transport.cc), with its usual line prefix.
LOG_REGISTERED = """\
h100:4242:4242 [0] NCCL INFO Check P2P Type isAllDirectP2p 1 directMode 1
h100:4242:4250 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
h100:4242:4250 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via P2P/CUMEM/read
h100:4242:4242 [0] NCCL INFO register comm 0x55d0 buffer 0x7f1200000000 size 33554432
h100:4242:4242 [0] NCCL INFO rank 0 - IPC registering buffer 0x7f1200000000 size 33554432 (baseAddr 0x7f1200000000 size 33554432) to peer 1
h100:4242:4261 [1] NCCL INFO Proxy rank 1 register reqBuff 0x55e0 size 33554432 offset 0 legacyIpcCap 0 sameProcess 1, totalSize : 33554432
h100:4242:4261 [1] NCCL INFO Proxy rank 1 register success regAddr 0x7f3400000000 size 33554432 offset 0 legacyIpcCap 0 sameProcess 1
h100:4242:4242 [0] NCCL INFO rank 0 - IPC register buffer 0x7f1200000000 size 33554432 (baseAddr 0x7f1200000000 size 33554432) to peer 1 regAddr 0x7f3400000000 offsetOut 0
"""
LOG_REUSED = """\
h100:4242:4242 [0] NCCL INFO rank 0 - IPC reuse buffer 0x7f1200000000 size 33554432 (baseAddr 0x7f1200000000 size 33554432) to peer 1 regAddr 0x7f3400000000
"""
LOG_FAILED = """\
h100:4242:4242 [0] NCCL INFO rank 0 failed to IPC register userbuff 0x7f1200000000 buffSize 33554432 nPeers 1 isLegacyIpc 0 type POSIX_FD
h100:4242:4242 [0] NCCL INFO rank 0 - IPC deregistered buffer 0x7f1200000000 peer 1 ipc remote buffer 0x7f3400000000
"""
FACTS = {"transports": ["P2P/CUMEM/read"], "all_direct_p2p": "1"}


def test_registration_reads_successes_and_not_the_attempt_or_deregistration():
    found = nrp.registration(LOG_REGISTERED)
    assert found["registered"] == [0x7F1200000000]
    assert found["proxy_registered"] == 1
    assert found["failed"] == [] and found["reused"] == []
    assert nrp.did_register(found)
    failed = nrp.registration(LOG_FAILED)
    assert failed["failed"] == [0x7F1200000000]
    assert failed["registered"] == []
    assert not nrp.did_register(failed)
    assert nrp.registration(LOG_REUSED)["reused"] == [0x7F1200000000]


def test_older_wordings_count_as_registered():
    # 2.23: "IPC local register buffer"; 2.26: "IPC registered buffer"; 2.23: "register succeeds".
    for line in ("rank 0 - IPC local register buffer 0x10 size 4 (baseAddr 0x10 size 4) to peer 1",
                 "rank 0 - IPC registered buffer 0x10 size 4 (baseAddr 0x10 size 4) to peer 1",
                 "Proxy rank 1 register succeeds, regAddr 0x20 size 4 offset 0"):
        assert nrp.did_register(nrp.registration(line)), line


def test_machine_facts():
    facts = nrp.machine_facts(LOG_REGISTERED)
    assert facts == {"transports": ["P2P/CUMEM/read"], "all_direct_p2p": "1"}
    assert nrp.machine_facts("") == {"transports": [], "all_direct_p2p": "?"}


def test_verdict_confirmed_when_registered_and_wrong_after_the_resume():
    line = nrp.verdict(True, nrp.registration(LOG_REGISTERED), nrp.registration(LOG_REGISTERED),
                       False, 8388608, FACTS)
    assert line.startswith("REGISTRATION-CLAIM: confirmed (stale pages after resume")
    assert "8388608" in line


def test_verdict_when_registration_is_wrong_before_any_pause():
    line = nrp.verdict(True, nrp.registration(LOG_REGISTERED), nrp.registration(LOG_REGISTERED),
                       False, 7, FACTS, a0_right=False, a0_wrong_elements=5)
    assert line.startswith("REGISTRATION-CLAIM: confirmed, worse than stated")
    assert "before any pause, in 5 elements" in line and "wrong in 7 elements" in line


def test_verdict_refuted_when_registered_but_right():
    line = nrp.verdict(True, nrp.registration(LOG_REGISTERED), nrp.registration(LOG_REGISTERED),
                       True, 0, FACTS)
    assert line.startswith("REGISTRATION-CLAIM: refuted (NCCL registered the layer's buffers")


def test_verdict_refuted_when_nccl_registers_its_own_memory_but_not_the_layers():
    line = nrp.verdict(True, nrp.registration(LOG_REGISTERED), nrp.registration(LOG_FAILED),
                       True, 0, FACTS)
    assert line.startswith("REGISTRATION-CLAIM: refuted (NCCL registers its own cuMem memory")
    assert "failed to IPC register" in line
    wrong = nrp.verdict(True, nrp.registration(LOG_REGISTERED), nrp.registration(""), False, 12, FACTS)
    assert "WRONG in 12 elements without any registration" in wrong


def test_verdict_untested_when_nothing_registers_here():
    line = nrp.verdict(True, nrp.registration(""), nrp.registration(""), True, 0,
                       {"transports": ["SHM/direct/direct"], "all_direct_p2p": "0"})
    assert line.startswith("REGISTRATION-CLAIM: untested")
    assert "isAllDirectP2p 0" in line


def test_verdict_handled_when_the_layer_renewed_and_the_result_is_right():
    line = nrp.verdict(True, nrp.registration(LOG_REGISTERED), nrp.registration(LOG_REGISTERED),
                       True, 0, FACTS, renewed=4, released=(128 << 20, 128 << 20))
    assert line.startswith("REGISTRATION-CLAIM: handled by the layer"), line
    assert "4 registrations renewed" in line and "released 128 of the tag's 128 MiB" in line
    # Renewed but still wrong: confirmed, and it says the layer tried.
    wrong = nrp.verdict(True, nrp.registration(LOG_REGISTERED), nrp.registration(LOG_REGISTERED),
                        False, 99, FACTS, renewed=4)
    assert wrong.startswith("REGISTRATION-CLAIM: confirmed (stale pages after resume")
    assert "registered them again 4 times" in wrong
    # A layer without the count (abi_version 1): as before.
    old = nrp.verdict(True, nrp.registration(LOG_REGISTERED), nrp.registration(LOG_REGISTERED),
                      True, 0, FACTS, renewed=None)
    assert old.startswith("REGISTRATION-CLAIM: refuted")


def test_pauses_that_release_too_little_are_found():
    pauses = [{"name": "A", "released": 64 << 20, "tagged": 128 << 20},
              {"name": "B", "released": (128 << 20) - (1 << 20), "tagged": 128 << 20},
              {"name": "C", "skipped": "no layer in vmm mode"}]
    assert [p["name"] for p in nrp.release_problems(pauses)] == ["A"]


def test_graph_case_line():
    line = nrp.graph_case_line("0", nrp.registration(""), True, True)
    assert line == ("GRAPH-CASE: NCCL_GRAPH_REGISTER=0; NCCL registered 0 buffers while capturing "
                    "(proxy: 0); replay before the pause right, after the pause and resume right")
    graph_log = "rank 0 - IPC graph register buffer 0x10 size 4 (baseAddr 0x10 size 4) to peer 1"
    line = nrp.graph_case_line("1", nrp.registration(graph_log), True, False)
    assert "registered 1 buffers" in line and "after the pause and resume WRONG" in line
    assert "not run" in nrp.graph_case_line("0", nrp.registration(""), None, None)


def test_no_verdict_without_the_layer():
    assert nrp.verdict(False, nrp.registration(LOG_REGISTERED), nrp.registration(LOG_FAILED),
                       True, 0, FACTS) is None


# ---- torch_dist_graph --compare ---------------------------------------------------------------

def rank_report(label, rank, world=2, sha="a", right=True, layer=True, pauses=2):
    phases = [{"phase": p, "data": i, "right": right, "wrong_elements": 0 if right else 5,
               "out_sha256": f"{sha}{rank}{i}", "gathered_sha256": f"g{rank}{i}"}
              for i, p in enumerate(tdg.PHASES)]
    report = {"label": label, "rank": rank, "world": world, "phases": phases, "errors": [],
              "ok": right, "layer_loaded": label != "none", "nccl_registered": [],
              "nccl_registration_failed": []}
    if label == "none":
        report["pauses"] = [{"keep": 1, "skipped": "no layer"}, {"keep": 0, "skipped": "no layer"}]
        report["stats_after_alloc"] = report["stats_at_end"] = None
    else:
        report["pauses"] = [{"keep": k, "pause": 0, "resume": 0, "released_bytes": 96 << 20,
                             "tagged_bytes": 96 << 20} for k in (1, 0)][:pauses]
        stats = {"mode": 2 if layer else 1, "tagged_bytes": 96 << 20}
        report["stats_after_alloc"] = report["stats_at_end"] = stats
    return report


def write(tmp, reports):
    for r in reports:
        with open(tdg.result_path(str(tmp), r["label"], r["rank"]), "w") as f:
            json.dump(r, f)


def compare(tmp, labels=("none", "vmm", "vmm-elide")):
    out = io.StringIO()
    status = tdg.compare(str(tmp), list(labels), print_=lambda line: print(line, file=out))
    return status, out.getvalue()


def test_compare_passes_identical_right_runs(tmp_path):
    write(tmp_path, [rank_report(l, r) for l in ("none", "vmm", "vmm-elide") for r in (0, 1)])
    status, text = compare(tmp_path)
    assert status == 0, text
    assert "RESULT dist-graph: 2 ranks, 5 phases, runs none, vmm, vmm-elide: identical outputs" in text


def test_compare_fails_on_a_differing_output(tmp_path):
    reports = [rank_report(l, r) for l in ("none", "vmm", "vmm-elide") for r in (0, 1)]
    reports[3] = rank_report("vmm", 1, sha="b")
    write(tmp_path, reports)
    status, text = compare(tmp_path)
    assert status == 1
    assert "FAILED vmm rank 1 before-pause: out_sha256 differs from none" in text


def test_compare_fails_when_a_layer_run_did_not_pause_or_was_not_vmm(tmp_path):
    write(tmp_path, [rank_report("none", r) for r in (0, 1)]
          + [rank_report("vmm", r, pauses=1) for r in (0, 1)]
          + [rank_report("vmm-elide", r, layer=False) for r in (0, 1)])
    status, text = compare(tmp_path)
    assert status == 1
    assert "vmm rank 0: 1 of 2 pauses and resumes succeeded" in text
    assert "vmm-elide rank 0: not run under the layer in vmm mode" in text


def test_compare_fails_on_a_missing_rank_or_run(tmp_path):
    write(tmp_path, [rank_report("none", r) for r in (0, 1)] + [rank_report("vmm", 0)])
    status, text = compare(tmp_path)
    assert status == 1
    assert "vmm: 1 rank files for world 2" in text
    assert "vmm-elide: no result files" in text


def test_compare_fails_on_a_wrong_phase(tmp_path):
    reports = [rank_report(l, r) for l in ("none", "vmm", "vmm-elide") for r in (0, 1)]
    reports[4] = rank_report("vmm-elide", 0, right=False)
    write(tmp_path, reports)
    status, text = compare(tmp_path)
    assert status == 1
    assert "vmm-elide rank 0 before-pause: 5 elements wrong" in text

