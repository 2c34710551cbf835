"""Reads the seed scenarios' logs of each mode and prints one table; checks that results are
identical and verified, and which targets were met. Exit status 1 if a check failed.

  python seed_report.py none=none.log monitor=monitor.log vmm=vmm.log vmm+elision=elide.log \
      vmm-no-stitching=nostitch.log
"""

import sys


def parse(path):
    results, pools = {}, {}
    with open(path) as f:
        for line in f:
            words = line.split()
            if not words or words[0] not in ("RESULT", "POOL"):
                continue
            if words[0] == "POOL":
                pools[words[1]] = dict(w.split("=", 1) for w in words[2:] if "=" in w)
                continue
            fields = dict(w.split("=", 1) for w in words[1:] if "=" in w)
            results[fields.get("scenario")] = fields
    return results, pools


def main(argv):
    runs = {}
    for arg in argv:
        name, path = arg.split("=", 1)
        try:
            runs[name] = parse(path)
        except OSError as error:
            print(f"cannot read {path}: {error}")
            runs[name] = ({}, {})
    failures = []

    print("| mode | resize mean (µs) | resize median (µs) | first round (µs) | later rounds (µs) "
          "| verified | checksum | fragmentation request | served | time (ms) | pool: stitched / creates / drains |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, (results, pools) in runs.items():
        r = results.get("resize")
        f = results.get("frag")
        p = pools.get("frag", {})
        cells = [name]
        if r:
            cells += [r["mean_us"], r["median_us"], r["first_us"], r["steady_us"],
                      "yes" if r["mismatches"] == "0" else f"NO ({r['mismatches']} wrong words)",
                      r["checksum"]]
        else:
            cells += ["-"] * 6
        if f:
            cells += [f"{int(f['ask']) / 2**30:.1f} GiB of {int(f['free_after']) / 2**30:.1f} free",
                      ("yes" if f["served"] == "1" else f"no (error {f['error']})")
                      + ("" if f["mismatches"] == "0" else f", {f['mismatches']} wrong words"),
                      f["ask_ms"]]
        else:
            cells += ["-"] * 3
        cells.append(f"{p.get('stitched', '-')} / {p.get('creates', '-')} / {p.get('drains', '-')}")
        print("| " + " | ".join(cells) + " |")

    # Every run that did the resize must have verified it, with the same checksum.
    checksums = {name: res["resize"]["checksum"] for name, (res, _) in runs.items() if "resize" in res}
    for name, (results, _) in runs.items():
        resize = results.get("resize")
        if resize and resize["mismatches"] != "0":
            failures.append(f"{name}: resize verification found {resize['mismatches']} wrong words")
        frag = results.get("frag")
        if frag and frag["mismatches"] != "0":
            failures.append(f"{name}: fragmentation block has {frag['mismatches']} wrong words")
    if len(set(checksums.values())) > 1:
        failures.append(f"resize checksums differ between modes: {checksums}")
    for name in ("none", "monitor", "vmm", "vmm+elision"):
        if name in runs and "resize" not in runs[name][0]:
            failures.append(f"{name}: no resize result (see its log)")

    print()
    monitor = runs.get("monitor", ({}, {}))[0].get("resize")
    elide = runs.get("vmm+elision", ({}, {}))[0].get("resize")
    if monitor and elide:
        speedup = float(monitor["mean_us"]) / float(elide["mean_us"])
        steady = float(monitor["steady_us"]) / float(elide["steady_us"])
        verdict = "met" if speedup >= 8 else "NOT met"
        if speedup >= 15:
            verdict += ", stretch 15x met too"
        print(f"TARGET resize, vmm + copy elision >= 8x faster than monitor (stretch 15x): "
              f"{speedup:.2f}x (later rounds {steady:.2f}x) {verdict}")
        pools = runs["vmm+elision"][1].get("resize", {})
        if pools.get("elided", "0") == "0":
            failures.append("vmm+elision: no copy was elided (POOL elided=0)")
    vmm_frag = runs.get("vmm", ({}, {}))[0].get("frag")
    no_stitch = runs.get("vmm-no-stitching", ({}, {}))[0].get("frag")
    if vmm_frag:
        served = vmm_frag["served"] == "1"
        if not served:
            failures.append("vmm: the fragmentation request was not served")
        if no_stitch:
            refused = no_stitch["served"] == "0"
            print(f"TARGET fragmentation request that fails without stitching is served: "
                  f"without stitching or drain {'refused' if refused else 'served'} "
                  f"(error {no_stitch['error']}); with stitching {'served' if served else 'REFUSED'} "
                  f"in {vmm_frag['ask_ms']} ms; "
                  f"{'met' if served and refused else 'NOT met'}")
    for failure in failures:
        print(f"FAILED: {failure}")
    print(f"seed scenarios: {'ok' if not failures else 'FAILED'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
