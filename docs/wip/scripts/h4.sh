#!/usr/bin/env bash
# Session 8, call 4 (2 x H200): the submitted code's suites. GPU0: the Rust suite at 3 fresh
# seeds. GPU1 (both GPUs first): the two-GPU publish tests (test_publish.py, test_two_gpus.py:
# after Trainer.twin() changed publish), then the Python one-GPU suite (the failure tests of all
# three engines, WeightSet.memory(), upload, pulling) with the time left.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TORCH_NCCL_ENABLE_MONITORING=0
L=/tmp/L; rm -rf $L; mkdir -p $L
pack() { find $L -type f -size +600k | while read -r f; do
    grep -aE "^=== |test result|panicked|FAILED|PASSED|^failed|verdict|seed [0-9]+ \(set" "$f" | cut -c1-400 > "$f.summary"
    { head -c 150000 "$f"; printf '\n... [cut] ...\n'; tail -c 350000 "$f"; } > "$f.cut" && mv "$f.cut" "$f"; done
  tar czf "$OUT/logs.tgz" -C $L . 2>/dev/null; ls -la "$OUT/logs.tgz"; }
trap pack EXIT
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$L/stamps.txt"; }
[ -d .bundle ] || tar xJf .bundle.tar.xz || exit 1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$L/gpus.txt"
TOTAL=${TOTAL:-560}; left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
r() { local name=$1 t=$2; shift 2; [ "$t" -lt 10 ] && { echo "$name skipped (no time)" | tee -a $L/rc.txt; return; }
  timeout -s INT -k 5 $t "$@" > $L/$name.log 2>&1; local rc=$?
  echo "[$(( $(date +%s) - T0 ))s] $name rc=$rc $(grep -hE '^=+ .*(passed|failed|error)|GPU suite:' $L/$name.log | tail -2 | tr '\n' ' ')" | tee -a $L/rc.txt; }
W=$(ls .bundle/wheels/stablebuf-*.whl | head -1)
python3 -m pip install -q --no-index --no-deps --target /tmp/sx "$W" >/dev/null 2>&1 || python3 -m zipfile -e "$W" /tmp/sx
export PYTHONPATH=/tmp/sx PYTHONUNBUFFERED=1
PYT="python3 -m pytest -v -rs -p no:cacheprovider --tb=short"
( export CUDA_VISIBLE_DEVICES=0 STABLEBUF_STEPS=3000
  r rust $(( $(left) - 3 )) .bundle/run --seeds 3; stamp "GPU0 rust suite done" ) &
( r pytwo 200 $PYT python/tests/test_publish.py python/tests/test_two_gpus.py
  export CUDA_VISIBLE_DEVICES=1
  r pyone $(( $(left) - 3 )) $PYT python/tests --ignore python/tests/test_hf_cache.py \
      --ignore python/tests/test_tp_publish.py --ignore python/tests/test_tp_decode.py \
      --ignore python/tests/test_nccl_sync.py --ignore python/tests/test_publish.py \
      --ignore python/tests/test_two_gpus.py
  stamp "python done" ) &
wait
stamp end
cat $L/rc.txt
echo "--- rust"; grep -hE "^failed:|GPU suite:|^seeds|FAILED|panicked" $L/rust.log | cut -c1-300 | tail -12
echo "--- python"; grep -hE "^(FAILED|ERROR) |^=+ .*(passed|failed)" $L/pytwo.log $L/pyone.log | cut -c1-250 | tail -14
grep -hE "SKIPPED" $L/pytwo.log | cut -c1-200 | head -5
