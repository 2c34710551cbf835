#!/usr/bin/env bash
# Ninth session, call 3 (nvidia-h200-x2, alone), issue 41 on two GPUs, the code to land: the
# twin's write streamlined (cut once per set, one copy_, timing events reused, only the devices
# that copied synchronised) and the example's writes right after a training step with the
# trainer on another GPU (--write-after train). The full two-GPU table at 1 and 8 GiB; then
# the old protocol (the trainer idle before each write) at 1 GiB with the diagnosis probes,
# for comparison; then the two-GPU publish tests.
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
PYT="python3 -m pytest -v -rs -p no:cacheprovider --tb=short"
r rl2 270 python3 -u python/examples/rl_weight_sync.py --gib 1,8 --versions 20 \
  --trainer-device 0 --engine-device 1 --methods ipc-copy,ipc-buckets,stablebuf,pipelined --layout twin
r quiet 70 python3 -u python/examples/rl_weight_sync.py --gib 1 --versions 20 \
  --trainer-device 0 --engine-device 1 --methods pipelined --layout twin --write-after quiet --diagnose
r pytwo 170 $PYT python/tests/test_publish.py python/tests/test_two_gpus.py
cat $L/rc.txt
grep -hE "verdict|cuda:0 -> set|diagnosis" $L/rl2.log $L/quiet.log | cut -c1-330
grep -hE "^(FAILED|ERROR) |^=+ .*(passed|failed)" $L/pytwo.log | tail -6
