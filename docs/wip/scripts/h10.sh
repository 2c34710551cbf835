#!/usr/bin/env bash
# Ninth session, call 4 (nvidia-h200-x2, alone), issue 41 item 3: with the write right after a
# training step (h9) the host part shrank (3.28-3.35 ms in all at 1 GiB) but the twin's copy
# still ran at 347 GB/s on the GPU, while a copy of a fresh buffer into the set runs at 380-393
# even cold. --diagnose now also times, into the set: the twin over the probe's range, the whole
# twin, a fresh buffer as long, the same bytes by SM stores, weight-like bf16 values in a fresh
# buffer, and random bytes in the twin (buffer or data?).
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
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$L/gpus.txt"
W=$(ls .bundle/wheels/stablebuf-*.whl | head -1)
python3 -m pip install -q --no-index --no-deps --target /tmp/sx "$W" >/dev/null 2>&1 || python3 -m zipfile -e "$W" /tmp/sx
export PYTHONPATH=/tmp/sx PYTHONUNBUFFERED=1
r rl2 200 python3 -u python/examples/rl_weight_sync.py --gib 1,8 --versions 20 \
  --trainer-device 0 --engine-device 1 --methods pipelined --layout twin --diagnose
cat $L/rc.txt
grep -hE "verdict: item 3|cuda:0 -> set|item 3 probe|diagnosis" $L/rl2.log | cut -c1-520
