#!/usr/bin/env bash
# Runs every GPU demo of the preload layer and prints what it found.
#
#   preload/demo/run-gpu.sh <path-to-libstablebuf_preload.so> [<wheel-dir>]
#
# <wheel-dir> holds torch_memory_saver-0.0.10-*.whl for the side-by-side comparison (installed
# into /tmp/site); without it that comparison is skipped. Logs, timelines (SVG) and JSON go to
# $OUT if set, else to a fresh directory under /tmp. Needs nvcc (CUDA 13), a GPU, and a Python
# with PyTorch ($PYTHON, else python3). No Rust, no network.
#
# Steps (each with a time limit; a failure prints the log's tail):
#   build         seed_scenarios.cu with nvcc -cudart shared (a statically linked runtime cannot
#                 be hooked by LD_PRELOAD)
#   seed-*        resize and fragmentation: without the layer, monitor, vmm, vmm + copy elision,
#                 and the fragmentation request in vmm without stitching or drain; one table
#   catch-*       every allocation path the layer claims to catch, and its error paths
#   conformance-* every pointer query and hand-built graph call on every kind of the layer's
#                 allocations (pointer_conformance.cu): without the layer, monitor, vmm, vmm +
#                 copy elision; conformance_diff.py compares the runs case by case (one line per
#                 case key) and every difference must be in pointer_conformance.allowed
#   elision-*     copy elision against no layer: every interleaving between the copy and the
#                 free (elision_interleavings.cu, legacy and per-thread default stream builds),
#                 then seeded random multi-threaded programs; every buffer's hash must match
#   torch-*       CUDA graph + pause/resume of the weights' tag; training with and without it
#   tms-compare   pause/resume against torch_memory_saver
#   dist-*        two GPUs (skipped, and said so, with fewer): torch_dist_graph.py under torchrun
#                 (all-reduces captured in a CUDA graph over tagged tensors, across pauses and
#                 resumes) without the layer, vmm, vmm + copy elision, outputs compared; and
#                 nccl_register_pause.py (one process, two GPUs, ncclCommRegister of the layer's
#                 memory across a pause and resume, and an all-reduce captured in a graph per
#                 GPU) without the layer and under vmm, whose REGISTRATION-CLAIM line is the
#                 verdict (under vmm: "handled by the layer", the layer renewing the
#                 registrations; README "NCCL registrations")
# Ends with "preload GPU demos: N passed, M failed"; exit status 1 if any step failed.
# ONLY="seed catch conformance elision torch tms dist" (any of them) runs only those groups
# (scripts/perf-check runs ONLY=seed for the resize ratio).

set -u -o pipefail

if [ $# -lt 1 ] || [ ! -f "$1" ]; then
    echo "usage: $0 <path-to-libstablebuf_preload.so> [<wheel-dir>]" >&2
    exit 2
fi
LIB=$(readlink -f "$1")
WHEELS=${2:-}
DEMO=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
INCLUDE=$(cd "$DEMO/../include" && pwd)
OUTDIR=${OUT:-$(mktemp -d /tmp/stablebuf-preload.XXXXXX)}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
NVCC=$(command -v nvcc || echo "$CUDA_HOME/bin/nvcc")
PY=${PYTHON:-python3}
SEED="$OUTDIR/seed_scenarios"
# The demo binary finds libcudart.so.13 in the toolkit (it is built with -cudart shared).
SEED_LIBS="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
PASSED=0
FAILED=0
FAILED_STEPS=""
STARTED=$(date +%s)
ONLY=${ONLY:-seed catch conformance elision torch tms dist}
# wants GROUP: whether ONLY names the group.
wants() { case " $ONLY " in *" $1 "*) return 0 ;; esac; return 1; }

echo "stablebuf-preload GPU demos"
echo "  library: $LIB ($(stat -c %s "$LIB") bytes)"
echo "  output:  $OUTDIR"
echo "  nvcc:    $NVCC"
echo "  python:  $PY"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader 2>/dev/null \
    | sed 's/^/  gpu:     /'

# step NAME TIMEOUT COMMAND...: runs COMMAND with its output in $OUTDIR/NAME.log.
step() {
    local name=$1 limit=$2
    shift 2
    local log="$OUTDIR/$name.log"
    local t0 t1 rc
    echo "=== $name"
    t0=$(date +%s.%N)
    if declare -F "$1" >/dev/null; then
        # A shell function: run it (with its arguments) in a child bash (exported below) so
        # timeout can kill it.
        timeout "$limit" bash -c '"$@"' _ "$@" >"$log" 2>&1
    else
        timeout "$limit" "$@" >"$log" 2>&1
    fi
    rc=$?
    t1=$(date +%s.%N)
    local seconds
    seconds=$(awk "BEGIN { printf \"%.1f\", $t1 - $t0 }")
    if [ $rc -eq 0 ]; then
        PASSED=$((PASSED + 1))
        echo "    ok (${seconds} s)"
        grep -E "^(RESULT|TARGET|FAILED|CHECK .*FAILED|REGISTRATION-CLAIM|GRAPH-CASE|LAYER-NCCL|stablebuf-preload (vmm|monitor):)" "$log" | cut -c1-400 | sed 's/^/    /'
    else
        FAILED=$((FAILED + 1))
        FAILED_STEPS="$FAILED_STEPS $name"
        if [ $rc -eq 124 ]; then
            echo "    FAILED: timed out after $limit s"
        else
            echo "    FAILED: exit status $rc after ${seconds} s"
        fi
        echo "    last lines of $log:"
        tail -n 40 "$log" | cut -c1-400 | sed 's/^/    | /'
        grep -hE "^(REGISTRATION-CLAIM|GRAPH-CASE|LAYER-NCCL)" "$log" | cut -c1-400 | sed 's/^/    /'
    fi
    return $rc
}

# ---- build --------------------------------------------------------------------------------
build() {
    local common=(-O2 -std=c++17 -cudart shared -arch=sm_90 -I"$INCLUDE" "$DEMO/seed_scenarios.cu" -o "$SEED" -ldl)
    "$NVCC" "${common[@]}" -lcuda ||
        "$NVCC" "${common[@]}" -L"$CUDA_HOME/lib64/stubs" -lcuda || return 1
    echo "linked runtime (must be the shared libcudart):"
    LD_LIBRARY_PATH="$SEED_LIBS" ldd "$SEED" | grep -E "libcudart|libcuda\." || true
    LD_LIBRARY_PATH="$SEED_LIBS" ldd "$SEED" | grep -q libcudart
}
# elision_interleavings.cu twice: the default (legacy) stream, and --default-stream per-thread
# (whose calls are the _ptsz/_ptds entry points).
ELIDE_BIN="$OUTDIR/elision_interleavings"
build_elision() {
    local mode
    for mode in legacy per-thread; do
        local extra=()
        [ "$mode" = per-thread ] && extra=(--default-stream per-thread)
        local common=(-O2 -std=c++17 -cudart shared -arch=sm_90 "${extra[@]}" -I"$INCLUDE"
            "$DEMO/elision_interleavings.cu" -o "$ELIDE_BIN-$mode" -ldl)
        "$NVCC" "${common[@]}" -lcuda ||
            "$NVCC" "${common[@]}" -L"$CUDA_HOME/lib64/stubs" -lcuda || return 1
        echo "built $ELIDE_BIN-$mode"
        nm -D "$ELIDE_BIN-$mode" | grep -E "__cudaLaunchKernel|_ptsz|_ptds" | head -5
    done
}
# compare_elision NAME: the HASH/RHASH lines of $OUTDIR/NAME-none.log and NAME-vmm.log must be
# identical and not empty; prints one RESULT line with the layer's elision counters.
compare_elision() {
    local name=$1 none="$OUTDIR/$1-none.log" vmm="$OUTDIR/$1-vmm.log"
    local lines differ
    lines=$(grep -cE "^R?HASH" "$none")
    differ=$(diff <(grep -E "^R?HASH" "$none") <(grep -E "^R?HASH" "$vmm") | grep -c "^[<>]")
    diff <(grep -E "^R?HASH" "$none") <(grep -E "^R?HASH" "$vmm") | head -n 20
    local stats
    stats=$(grep -E "^STATS (plain|random) " "$vmm" | head -n 1)
    echo "RESULT $name: $lines buffer hashes compared, $differ lines differ; vmm+elision ${stats#STATS }"
    grep -E "^STATS " "$vmm" | sed 's/^/    /'
    grep -h "copy elision is off" "$vmm" | head -n 2
    [ "$lines" -gt 0 ] && [ "$differ" -eq 0 ] || return 1
    # Elision must still happen in the plain grow-by-copy case.
    if [ "${name#elision-random}" = "$name" ]; then
        grep -qE "^STATS plain deferred=1 elided=1 " "$vmm" || {
            echo "FAILED: the plain resize was not elided"
            return 1
        }
    fi
}
SITE=${SITE:-/tmp/site} # SITE: another folder, for runs side by side
ELIDE_PROGRAMS=${ELIDE_PROGRAMS:-1000}
export LIB WHEELS DEMO INCLUDE OUTDIR CUDA_HOME NVCC PY SEED SEED_LIBS SITE ELIDE_BIN ELIDE_PROGRAMS
export -f build build_elision compare_elision
if step build 180 build; then
    BUILT=1
else
    BUILT=0
fi

# `env` runs the command; the layer is preloaded into that command only.
seed=(env LD_LIBRARY_PATH="$SEED_LIBS")
layer=(env LD_LIBRARY_PATH="$SEED_LIBS" LD_PRELOAD="$LIB")

# ---- seed scenarios -----------------------------------------------------------------------
if [ $BUILT -eq 1 ] && wants seed; then
    step seed-none 120 "${seed[@]}" "$SEED" all
    step seed-monitor 120 "${layer[@]}" STABLEBUF_PRELOAD_MODE=monitor \
        STABLEBUF_PRELOAD_TIMELINE="$OUTDIR/seed-monitor.svg" "$SEED" all
    step seed-vmm 120 "${layer[@]}" STABLEBUF_PRELOAD_MODE=vmm \
        STABLEBUF_PRELOAD_TIMELINE="$OUTDIR/seed-vmm.svg" "$SEED" all
    step seed-vmm-elision 120 "${layer[@]}" STABLEBUF_PRELOAD_MODE=vmm STABLEBUF_PRELOAD_ELIDE_COPIES=1 \
        STABLEBUF_PRELOAD_TIMELINE="$OUTDIR/seed-vmm-elision.svg" "$SEED" all
    step seed-vmm-no-stitching 120 "${layer[@]}" STABLEBUF_PRELOAD_MODE=vmm STABLEBUF_PRELOAD_STITCHING=0 \
        STABLEBUF_PRELOAD_DRAIN_ON_OOM=0 "$SEED" frag
    step seed-report 30 python3 "$DEMO/seed_report.py" \
        none="$OUTDIR/seed-none.log" monitor="$OUTDIR/seed-monitor.log" \
        vmm="$OUTDIR/seed-vmm.log" vmm+elision="$OUTDIR/seed-vmm-elision.log" \
        vmm-no-stitching="$OUTDIR/seed-vmm-no-stitching.log"
fi
if [ $BUILT -eq 1 ] && wants catch; then
    step catch-none 60 "${seed[@]}" "$SEED" catch
    step catch-monitor 60 "${layer[@]}" STABLEBUF_PRELOAD_MODE=monitor "$SEED" catch
    step catch-vmm 60 "${layer[@]}" STABLEBUF_PRELOAD_MODE=vmm "$SEED" catch
    step catch-vmm-elision 60 "${layer[@]}" STABLEBUF_PRELOAD_MODE=vmm STABLEBUF_PRELOAD_ELIDE_COPIES=1 "$SEED" catch
fi

# ---- pointer conformance: the layer answers as CUDA does ------------------------------------
CONFORMANCE="$OUTDIR/pointer_conformance"
build_conformance() {
    local common=(-O2 -std=c++17 -cudart shared -arch=sm_90 "$DEMO/pointer_conformance.cu"
        -o "$CONFORMANCE" -ldl)
    "$NVCC" "${common[@]}" -lcuda ||
        "$NVCC" "${common[@]}" -L"$CUDA_HOME/lib64/stubs" -lcuda
}
export CONFORMANCE
export -f build_conformance
if wants conformance && step conformance-build 180 build_conformance; then
    step conformance-none 120 "${seed[@]}" "$CONFORMANCE"
    step conformance-monitor 120 "${layer[@]}" STABLEBUF_PRELOAD_MODE=monitor "$CONFORMANCE"
    step conformance-vmm 120 "${layer[@]}" STABLEBUF_PRELOAD_MODE=vmm "$CONFORMANCE"
    step conformance-vmm-elision 120 "${layer[@]}" STABLEBUF_PRELOAD_MODE=vmm \
        STABLEBUF_PRELOAD_ELIDE_COPIES=1 "$CONFORMANCE"
    step conformance 30 python3 "$DEMO/conformance_diff.py" "$DEMO/pointer_conformance.allowed" \
        "$OUTDIR/conformance-none.log" monitor="$OUTDIR/conformance-monitor.log" \
        vmm="$OUTDIR/conformance-vmm.log" vmm+elide="$OUTDIR/conformance-vmm-elision.log"
fi

# ---- copy elision: every interleaving, then random programs -------------------------------
elide=(env LD_LIBRARY_PATH="$SEED_LIBS" LD_PRELOAD="$LIB" STABLEBUF_PRELOAD_MODE=vmm
    STABLEBUF_PRELOAD_ELIDE_COPIES=1 STABLEBUF_PRELOAD_ELIDE_MIN=1M)
if wants elision && step elision-build 240 build_elision; then
    for mode in legacy per-thread; do
        step elision-$mode-none 60 "${seed[@]}" "$ELIDE_BIN-$mode" all
        step elision-$mode-vmm 60 "${elide[@]}" "$ELIDE_BIN-$mode" all
        step elision-$mode 20 compare_elision elision-$mode
    done
    # ELIDE_SEEDS="s1 s2 s3": the random programs at each seed (a change they cover lands after
    # three fresh seeds passed); 2024 alone by default.
    for elide_seed in ${ELIDE_SEEDS:-2024}; do
        name=elision-random
        [ "${ELIDE_SEEDS:-2024}" = 2024 ] || name=elision-random-$elide_seed
        step $name-none 150 "${seed[@]}" "$ELIDE_BIN-legacy" random "$ELIDE_PROGRAMS" "$elide_seed"
        step $name-vmm 150 "${elide[@]}" "$ELIDE_BIN-legacy" random "$ELIDE_PROGRAMS" "$elide_seed"
        step $name 20 compare_elision $name
    done
fi

# ---- PyTorch ------------------------------------------------------------------------------
if wants torch; then
step torch-graph-pause 180 env LD_PRELOAD="$LIB" STABLEBUF_PRELOAD_MODE=vmm \
    STABLEBUF_PRELOAD_TIMELINE="$OUTDIR/torch-graph-pause.svg" "$PY" "$DEMO/torch_graph_pause.py"
step torch-train-plain 180 env CUBLAS_WORKSPACE_CONFIG=:4096:8 \
    "$PY" "$DEMO/torch_train.py" --out "$OUTDIR/train-plain.json"
step torch-train-vmm 180 env CUBLAS_WORKSPACE_CONFIG=:4096:8 LD_PRELOAD="$LIB" STABLEBUF_PRELOAD_MODE=vmm \
    "$PY" "$DEMO/torch_train.py" --out "$OUTDIR/train-vmm.json"
step torch-train-compare 60 "$PY" "$DEMO/torch_train.py" \
    --compare "$OUTDIR/train-plain.json" "$OUTDIR/train-vmm.json"
fi

# ---- torch_memory_saver -------------------------------------------------------------------
install_tms() {
    local wheel
    wheel=$(ls "$WHEELS"/torch_memory_saver-*.whl 2>/dev/null | head -n 1)
    if [ -z "$wheel" ]; then
        echo "no torch_memory_saver-*.whl in $WHEELS"
        return 1
    fi
    mkdir -p "$SITE"
    "$PY" -m pip install --no-index --no-deps --target "$SITE" "$wheel" ||
        "$PY" -m zipfile -e "$wheel" "$SITE"
    ls "$SITE" | grep -E "torch_memory_saver"
}
export -f install_tms
if ! wants tms; then
    :
elif [ -n "$WHEELS" ]; then
    if step tms-install 120 install_tms; then
        step tms-compare 400 "$PY" "$DEMO/tms_compare.py" --lib "$LIB" --tms-site "$SITE" --out "$OUTDIR"
    fi
elif ls "$SITE"/torch_memory_saver_hook_mode_preload*.so >/dev/null 2>&1; then
    step tms-compare 400 "$PY" "$DEMO/tms_compare.py" --lib "$LIB" --tms-site "$SITE" --out "$OUTDIR"
else
    echo "=== tms-compare: skipped (no <wheel-dir> given and nothing installed in $SITE)"
fi

# ---- several GPUs: torch.distributed and NCCL over the layer's memory ---------------------
# NVLink multicast stays off (NVLS on shared hosts; .bundle/run sets it too).
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
# run_dist LABEL [env assignments...]: torch_dist_graph.py on two GPUs under torchrun.
run_dist() {
    local label=$1
    shift
    rm -f "$OUTDIR"/dist-graph-"$label"-rank*.json "$OUTDIR"/dist-graph-"$label"-rank*-nccl.log
    env OMP_NUM_THREADS=1 "$@" "$PY" -m torch.distributed.run --standalone --nnodes=1 \
        --nproc_per_node=2 "$DEMO/torch_dist_graph.py" --label "$label" --out "$OUTDIR"
}
export -f run_dist
if wants dist; then
    GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null | tail -n 1)
    GPUS=${GPUS:-0}
    if [ "$GPUS" -ge 2 ] 2>/dev/null; then
        step dist-graph-none 300 run_dist none
        step dist-graph-vmm 300 run_dist vmm LD_PRELOAD="$LIB" STABLEBUF_PRELOAD_MODE=vmm
        step dist-graph-vmm-elision 300 run_dist vmm-elide LD_PRELOAD="$LIB" \
            STABLEBUF_PRELOAD_MODE=vmm STABLEBUF_PRELOAD_ELIDE_COPIES=1
        step dist-graph 60 "$PY" "$DEMO/torch_dist_graph.py" --compare --out "$OUTDIR" \
            none vmm vmm-elide
        step nccl-register-none 180 env CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0,1}" \
            "$PY" "$DEMO/nccl_register_pause.py" --label none --out "$OUTDIR"
        step nccl-register-vmm 180 env CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0,1}" \
            LD_PRELOAD="$LIB" STABLEBUF_PRELOAD_MODE=vmm \
            "$PY" "$DEMO/nccl_register_pause.py" --label vmm --out "$OUTDIR"
    else
        echo "=== dist: skipped (${GPUS} GPU(s) visible to PyTorch; needs 2)"
    fi
fi

# ---- summary ------------------------------------------------------------------------------
echo
echo "==================== summary ===================="
for report in seed-report tms-compare; do
    if [ -f "$OUTDIR/$report.log" ]; then
        echo "--- $report"
        grep -vE "^(---|    exit)" "$OUTDIR/$report.log" | grep -E "^\||TARGET|FAILED|GiB" | cut -c1-300
    fi
done
for log in catch-none catch-monitor catch-vmm catch-vmm-elision conformance elision-legacy elision-per-thread elision-random $(for s in ${ELIDE_SEEDS:-}; do echo elision-random-$s; done) torch-graph-pause torch-train-compare dist-graph nccl-register-none nccl-register-vmm; do
    [ -f "$OUTDIR/$log.log" ] && grep -hE "^(RESULT|REGISTRATION-CLAIM|GRAPH-CASE)" "$OUTDIR/$log.log" | cut -c1-300 | sed "s/^/$log: /"
done
echo "timelines: $(ls "$OUTDIR"/*.svg 2>/dev/null | tr '\n' ' ')"
echo "logs in $OUTDIR; total $(($(date +%s) - STARTED)) s"
[ -n "$FAILED_STEPS" ] && echo "failed steps:$FAILED_STEPS"
echo "preload GPU demos: $PASSED passed, $FAILED failed"
[ $FAILED -eq 0 ]
