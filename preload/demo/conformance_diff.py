"""Compares pointer_conformance's output under the layer with its output without it, case by case.

    python3 conformance_diff.py ALLOWED NONE_LOG MODE=LOG [MODE=LOG ...]

Each run prints one line per case, `CASE <phase>/<call>/<argument>: <result>` (for example
`CASE resumed/cuPointerGetAttribute/CONTEXT: rc=0 start=current inside=current`), an
`INFO layer=... pause=... resume=...` line and `END`. Lines are matched by their case key, not by
position, so a line one run lacks is one finding, not a shift of every later line. Every other
line (the layer's own notices and exit summary on stderr) is not compared.

For each MODE this prints every finding and one line

    RESULT conformance MODE: N lines, D differ, M missing, A allowed differences

N: cases the run without the layer printed; D: cases whose results differ and that no entry of
ALLOWED excuses; M: cases printed by one run only (either side); A: differences ALLOWED excuses.

ALLOWED holds one entry per line, `modes | case | layer result | why`:
  modes         monitor, vmm, vmm+elide (names as given on the command line), comma-separated;
  case          a case key, or a pattern over keys (fnmatch: `*/cudaIpcGetMemHandle/start`);
  layer result  what the layer's run must print for that case (fnmatch pattern; `*`: anything);
  why           the reason, shown with every difference it excuses.
An entry excuses only a differing result, never a missing case. A mode passes when D = 0, M = 0,
it reached END, printed no case twice, and its INFO line says the run was what the mode names
(monitor: layer=monitor; vmm*: layer=vmm with pause=0 resume=0, so the `resumed` cases really
followed a pause). Exit status 1 if any mode fails or the run without the layer is unusable.
"""
import fnmatch
import re
import sys
from dataclasses import dataclass, field

CASE = re.compile(r"^CASE (\S+): (.*)$")


@dataclass
class Allowed:
    modes: frozenset
    case: str
    layer: str
    why: str
    line: int = 0

    def excuses(self, mode, key, layer_result):
        return (
            mode in self.modes
            and fnmatch.fnmatchcase(key, self.case)
            and fnmatch.fnmatchcase(layer_result, self.layer)
        )


@dataclass
class Run:
    """One run's output, keyed by case."""

    cases: dict = field(default_factory=dict)  # key -> result, in the order printed
    duplicates: list = field(default_factory=list)  # (key, first result, later result)
    malformed: list = field(default_factory=list)  # lines starting CASE that do not parse
    fatal: list = field(default_factory=list)  # FATAL lines of the program
    info: dict = field(default_factory=dict)
    ended: bool = False
    ignored: int = 0  # lines of anyone else (the layer's stderr)


def parse_allowed(lines):
    """ALLOWED's entries from an iterable of lines."""
    out = []
    for number, raw in enumerate(lines, 1):
        raw = raw.strip()
        if not raw or raw.startswith("#"):
            continue
        parts = [part.strip() for part in raw.split("|", 3)]
        if len(parts) != 4 or not all(parts):
            raise ValueError(f"allowed line {number}: want `modes | case | layer result | why`: {raw!r}")
        modes, case, layer, why = parts
        out.append(Allowed(frozenset(m.strip() for m in modes.split(",")), case, layer, why, number))
    return out


def parse_run(lines):
    """A run's output from an iterable of lines."""
    run = Run()
    for raw in lines:
        text = raw.rstrip("\n")
        if text.startswith("CASE "):
            match = CASE.match(text)
            if not match:
                run.malformed.append(text)
                continue
            key, result = match.group(1), match.group(2)
            if key in run.cases:
                run.duplicates.append((key, run.cases[key], result))
            else:
                run.cases[key] = result
        elif text == "END":
            run.ended = True
        elif text.startswith("INFO "):
            for word in text[5:].split():
                name, _, value = word.partition("=")
                run.info[name] = value
        elif text.startswith("FATAL"):
            run.fatal.append(text)
        else:
            run.ignored += 1
    return run


def expected_info(mode):
    """What a run's INFO line must say for `mode`: {name: value}."""
    if mode == "none":
        return {"layer": "none"}
    if mode == "monitor":
        return {"layer": "monitor"}
    if mode.startswith("vmm"):
        return {"layer": "vmm", "pause": "0", "resume": "0"}
    return {}


@dataclass
class Outcome:
    mode: str
    lines: int
    differ: list  # (key, reference result, layer result)
    missing: list  # (key, result, side): side "layer" = only without the layer, "none" = only with it
    allowed: list  # (key, reference result, layer result, Allowed)
    problems: list  # other reasons the mode fails

    @property
    def failed(self):
        return bool(self.differ or self.missing or self.problems)

    def result_line(self):
        return (
            f"RESULT conformance {self.mode}: {self.lines} lines, {len(self.differ)} differ, "
            f"{len(self.missing)} missing, {len(self.allowed)} allowed differences"
        )


def run_problems(run, mode):
    """Why a run cannot be compared as it is (the same checks for both sides)."""
    problems = []
    if not run.ended:
        problems.append("the run did not reach END")
    problems += [f"program error: {line}" for line in run.fatal]
    problems += [f"case printed twice: {k} ({a!r}, then {b!r})" for k, a, b in run.duplicates]
    problems += [f"unreadable case line: {line!r}" for line in run.malformed]
    for name, want in expected_info(mode).items():
        have = run.info.get(name)
        if have != want:
            problems.append(
                f"INFO {name}={have if have is not None else '(absent)'}, expected {name}={want} "
                f"for mode {mode}"
            )
    return problems


def compare(reference, run, mode, allowed):
    """The findings of one mode's run against the run without the layer."""
    differ, missing, excused = [], [], []
    for key, want in reference.cases.items():
        if key not in run.cases:
            missing.append((key, want, "layer"))
            continue
        have = run.cases[key]
        if have == want:
            continue
        entry = next((e for e in allowed if e.excuses(mode, key, have)), None)
        if entry is None:
            differ.append((key, want, have))
        else:
            excused.append((key, want, have, entry))
    for key, have in run.cases.items():
        if key not in reference.cases:
            missing.append((key, have, "none"))
    return Outcome(mode, len(reference.cases), differ, missing, excused, run_problems(run, mode))


def report(outcome, out):
    mode = outcome.mode
    for problem in outcome.problems:
        print(f"FAILED {mode}: {problem}", file=out)
    for key, result, side in outcome.missing:
        if side == "layer":
            print(f"MISSING {mode}: {key} (only without the layer: {result})", file=out)
        else:
            print(f"MISSING {mode}: {key} (only under the layer: {result})", file=out)
    for key, want, have in outcome.differ:
        print(f"DIFF {mode}: {key}\n    no layer: {want}\n    layer:    {have}", file=out)
    for key, want, have, entry in outcome.allowed:
        print(
            f"ALLOWED {mode}: {key}: no layer `{want}`, layer `{have}` ({entry.why})", file=out
        )
    print(outcome.result_line(), file=out)


def diff(allowed, reference, runs, out=sys.stdout):
    """Compares every (mode, run) of `runs` with `reference`; returns (exit status, outcomes)."""
    failed = False
    problems = run_problems(reference, "none")
    if not reference.cases:
        problems.append("no CASE lines")
    for problem in problems:
        print(f"FAILED no layer: {problem}", file=out)
        failed = True
    outcomes = []
    used = set()
    for mode, run in runs:
        outcome = compare(reference, run, mode, allowed)
        report(outcome, out)
        outcomes.append(outcome)
        failed = failed or outcome.failed
        used.update((mode, id(entry)) for _, _, _, entry in outcome.allowed)
    for mode, _ in runs:
        for entry in allowed:
            if mode in entry.modes and (mode, id(entry)) not in used:
                print(
                    f"NOTE {mode}: allowed difference not seen: {entry.case} ({entry.why})",
                    file=out,
                )
    return (1 if failed else 0), outcomes


def main(argv):
    if len(argv) < 3:
        print(__doc__)
        return 2
    with open(argv[0]) as f:
        allowed = parse_allowed(f)
    with open(argv[1], errors="replace") as f:
        reference = parse_run(f)
    runs = []
    for pair in argv[2:]:
        mode, path = pair.split("=", 1)
        with open(path, errors="replace") as f:
            runs.append((mode, parse_run(f)))
    status, _ = diff(allowed, reference, runs)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
