#!/usr/bin/env bash
# Ninth session, call 6 (nvidia-h200-x2, alone), the code to land. h11: a raw copy of the
# whole twin into the set runs at 384-394 GB/s; timing events around it cost 3%; the library's
# path lost more in host steps around the copy. Now: no timing events unless asked
# (Trainer.gpu_timing), the twin's write cut once, one copy_, only the copying GPU
# synchronised; and item 3's floor at a publish's own moment (raw-copy: the trainer's plain
# copy_ of its twin into the idle set and a commit, after the same training step).
# 1. the two-GPU table at 1 and 8 GiB with raw-copy; 2. the two-GPU publish tests; 3. every
# failure test (one GPU, GPU 0); 4. the one-GPU example at 1 GiB (pipelined, pulled).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TORCH_NCCL_ENABLE_MONITORING=0
L=/tmp/L; rm -rf $L; mkdir -p $L
pack() { tar czf "$OUT/logs.tgz" -C $L . 2>/dev/null; ls -la "$OUT/logs.tgz"; }
trap pack EXIT
T0=$(date +%s); TOTAL=${TOTAL:-565}; left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
r() { local name=$1 t=$2; shift 2; [ "$t" -lt 10 ] && { echo "$name skipped (no time)" | tee -a $L/rc.txt; return; }
  timeout -s INT -k 5 $t "$@" > $L/$name.log 2>&1; local rc=$?
  echo "[$(( $(date +%s) - T0 ))s] $name rc=$rc $(grep -hE '^=+ .*(passed|failed|error)' $L/$name.log | tail -1)" | tee -a $L/rc.txt; }
[ -d .bundle ] || tar xJf .bundle.tar.xz || exit 1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$L/gpus.txt"
W=$(ls .bundle/wheels/stablebuf-*.whl | head -1)
python3 -m pip install -q --no-index --no-deps --target /tmp/sx "$W" >/dev/null 2>&1 || python3 -m zipfile -e "$W" /tmp/sx
export PYTHONPATH=/tmp/sx PYTHONUNBUFFERED=1
PYT="python3 -m pytest -v -rs -p no:cacheprovider --tb=short"
r rl2 240 python3 -u python/examples/rl_weight_sync.py --gib 1,8 --versions 20 --trainer-device 0 \
  --engine-device 1 --methods ipc-copy,ipc-buckets,stablebuf,pipelined,raw-copy --layout twin
r pytwo 150 $PYT python/tests/test_publish.py python/tests/test_two_gpus.py
t=$(( $(left) - 75 )); [ $t -gt 240 ] && t=240
CUDA_VISIBLE_DEVICES=0 r fail $t $PYT python/tests/test_publish_failures.py
CUDA_VISIBLE_DEVICES=0 r rl1 $(( $(left) - 3 )) python3 -u python/examples/rl_weight_sync.py --gib 1 \
  --versions 20 --methods ipc-copy,pipelined,pulled --chunk-mib 64
cat $L/rc.txt
grep -hE "verdict|cuda:0 -> set" $L/rl2.log | cut -c1-300
grep -hE "^(FAILED|ERROR) |^=+ .*(passed|failed)" $L/pytwo.log $L/fail.log | tail -8
grep -hE "verdict" $L/rl1.log | cut -c1-220
