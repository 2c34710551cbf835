"""Compares pointer_conformance's output under the layer with its output without it.

    python3 conformance_diff.py ALLOWED NONE_LOG MODE=LOG [MODE=LOG ...]

Lines are compared in order (both runs print the same lines in the same order); a line that
differs must contain the text of an entry of ALLOWED for its mode. Prints one RESULT line and
every difference; exit status 1 if a difference is not allowed, a run did not reach END, or the
runs printed different numbers of lines.
"""
import sys


def entries(path):
    allowed = []
    for raw in open(path):
        raw = raw.strip()
        if not raw or raw.startswith("#"):
            continue
        modes, text, why = (part.strip() for part in raw.split("|", 2))
        allowed.append((set(modes.split(",")), text, why))
    return allowed


def lines(path):
    out = [l.rstrip("\n") for l in open(path, errors="replace")]
    # The layer's own stderr lines (notices, the summary at exit) are not the program's output.
    return [l for l in out if not l.startswith("stablebuf-preload")]


def main():
    allowed = entries(sys.argv[1])
    reference = lines(sys.argv[2])
    failed = "END" not in reference
    if failed:
        print("FAILED: the run without the layer did not finish")
    used = set()
    for pair in sys.argv[3:]:
        mode, path = pair.split("=", 1)
        got = lines(path)
        bad = 0
        excused = 0
        if "END" not in got:
            print(f"FAILED {mode}: the run did not finish")
            failed = True
        if len(got) != len(reference):
            print(f"FAILED {mode}: {len(got)} lines against {len(reference)} without the layer")
            failed = True
        for want, have in zip(reference, got):
            if want == have:
                continue
            reason = next(
                (e for e in allowed if mode in e[0] and e[1] in want and e[1] in have), None
            )
            if reason is None:
                bad += 1
                print(f"DIFF {mode}:\n    no layer: {want}\n    layer:    {have}")
            else:
                excused += 1
                used.add(reason[1])
        print(
            f"RESULT conformance {mode}: {len(reference)} lines, {bad} differ, "
            f"{excused} allowed differences"
        )
        failed = failed or bad > 0
    for _, text, why in allowed:
        if text not in used:
            print(f"NOTE allowed difference not seen: {text!r} ({why})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
