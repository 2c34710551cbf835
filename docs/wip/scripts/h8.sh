#!/usr/bin/env bash
# Ninth session, call 2 (nvidia-h200-x2, alone), issue 41 item 3: h7 showed the first copy into
# a set is not slow (cold 378-389 GB/s), and that warming the translations or 2-4 copy streams
# change nothing (publish gpu 326-342 GB/s at 1 GiB). Is the publish's copy slow as the first
# after the trainer's training and the engine's quiet steps (25 ms idle)? --diagnose times the
# publish's own write path and a copy into the set after idle / training / both; --pre-copy 1
# writes the set once, untimed, right before each timed publish.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TORCH_NCCL_ENABLE_MONITORING=0
L=/tmp/L; rm -rf $L; mkdir -p $L
pack() { tar czf "$OUT/logs.tgz" -C $L . 2>/dev/null; ls -la "$OUT/logs.tgz"; }
trap pack EXIT
T0=$(date +%s)
r() { local name=$1 t=$2; shift 2; [ "$t" -lt 10 ] && { echo "$name skipped (no time)" | tee -a $L/rc.txt; return; }
  timeout -s INT -k 5 $t "$@" > $L/$name.log 2>&1; local rc=$?
  echo "[$(( $(date +%s) - T0 ))s] $name rc=$rc $(grep -hE '^=+ .*(passed|failed|error)' $L/$name.log | tail -1)" | tee -a $L/rc.txt; }
[ -d .bundle ] || tar xJf .bundle.tar.xz || exit 1
nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader | tee "$L/gpus.txt"
W=$(ls .bundle/wheels/stablebuf-*.whl | head -1)
python3 -m pip install -q --no-index --no-deps --target /tmp/sx "$W" >/dev/null 2>&1 || python3 -m zipfile -e "$W" /tmp/sx
export PYTHONPATH=/tmp/sx PYTHONUNBUFFERED=1
r rl2 240 python3 -u python/examples/rl_weight_sync.py --gib 1,8 --versions 20 \
  --trainer-device 0 --engine-device 1 --methods pipelined --layout twin --pre-copy 0,1 --diagnose
cat $L/rc.txt
grep -hE "verdict: item 3.*NVLink|cuda:0 -> set|item 3 probe|diagnosis" $L/rl2.log | cut -c1-420
