#!/usr/bin/env bash
# When the random copy-elision programs differ from the run without the layer: finds the
# programs whose hashes differ and prints each one's operations, step by step.
#
#   preload/demo/diagnose-elision.sh <path-to-libstablebuf_preload.so> [programs] [seed]
#
# Builds elision_interleavings.cu (legacy default stream), runs `random <programs> <seed>`
# without the layer and with vmm + copy elision, prints the differing hash lines, then replays
# the first three differing programs with ELIDE_TRACE (their operations, and the layer's
# elision decisions at STABLEBUF_PRELOAD_LOG=debug). Logs go to $OUT (else a fresh /tmp folder).
set -u -o pipefail
[ $# -ge 1 ] && [ -f "$1" ] || { echo "usage: $0 <libstablebuf_preload.so> [programs] [seed]" >&2; exit 2; }
LIB=$(readlink -f "$1")
PROGRAMS=${2:-1000}
SEED=${3:-2024}
DEMO=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
INCLUDE=$(cd "$DEMO/../include" && pwd)
OUTDIR=${OUT:-$(mktemp -d /tmp/stablebuf-elision.XXXXXX)}
mkdir -p "$OUTDIR"
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
NVCC=$(command -v nvcc || echo "$CUDA_HOME/bin/nvcc")
LIBS="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
BIN="$OUTDIR/elision_interleavings"
common=(-O2 -std=c++17 -cudart shared -arch=sm_90 -I"$INCLUDE" "$DEMO/elision_interleavings.cu" -o "$BIN" -ldl)
"$NVCC" "${common[@]}" -lcuda 2>"$OUTDIR/build.log" ||
    "$NVCC" "${common[@]}" -L"$CUDA_HOME/lib64/stubs" -lcuda 2>>"$OUTDIR/build.log" || {
    tail -20 "$OUTDIR/build.log"; exit 1; }
plain=(env LD_LIBRARY_PATH="$LIBS")
elide=(env LD_LIBRARY_PATH="$LIBS" LD_PRELOAD="$LIB" STABLEBUF_PRELOAD_MODE=vmm
    STABLEBUF_PRELOAD_ELIDE_COPIES=1 STABLEBUF_PRELOAD_ELIDE_MIN=1M)
"${plain[@]}" "$BIN" random "$PROGRAMS" "$SEED" >"$OUTDIR/none.log" 2>&1
"${elide[@]}" "$BIN" random "$PROGRAMS" "$SEED" >"$OUTDIR/vmm.log" 2>&1
diff <(grep -E "^RHASH" "$OUTDIR/none.log") <(grep -E "^RHASH" "$OUTDIR/vmm.log") >"$OUTDIR/diff.txt"
echo "differing hash lines: $(grep -c '^[<>]' "$OUTDIR/diff.txt") of $(grep -c '^RHASH' "$OUTDIR/none.log")"
grep -E "^STATS" "$OUTDIR/vmm.log"
head -n 24 "$OUTDIR/diff.txt"
for program in $(grep '^[<>]' "$OUTDIR/diff.txt" | awk '{print $3}' | sort -un | head -n 3); do
    echo "=== program $program"
    "${plain[@]}" ELIDE_TRACE="$program" "$BIN" random $((program + 1)) "$SEED" \
        >"$OUTDIR/p$program-none.log" 2>&1
    "${elide[@]}" ELIDE_TRACE="$program" STABLEBUF_PRELOAD_LOG=stablebuf_preload=debug \
        "$BIN" random $((program + 1)) "$SEED" >"$OUTDIR/p$program-vmm.log" 2>&1
    grep -E "^TRACE P$program " "$OUTDIR/p$program-none.log"
    echo "--- hashes without the layer / with it"
    grep -E "^RHASH $program " "$OUTDIR/p$program-none.log"
    grep -E "^RHASH $program " "$OUTDIR/p$program-vmm.log"
    echo "--- the layer's messages (last 30)"
    grep -vE "^(TRACE|RHASH|HASH)" "$OUTDIR/p$program-vmm.log" | tail -n 30 | cut -c1-300
done
