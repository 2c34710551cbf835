#!/usr/bin/env bash
# Ninth session, call 8 (nvidia-h200-x2, alone), after the final review: Trainer.tensors() now
# shares the set's one flat view with the twin's write, and the example's probes pick the free
# set through one helper. The two-GPU publish tests and the example at 1 GiB (every method it
# judges on two GPUs, --diagnose, --pre-copy) on that code.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TORCH_NCCL_ENABLE_MONITORING=0
L=/tmp/L; rm -rf $L; mkdir -p $L
pack() { tar czf "$OUT/logs.tgz" -C $L . 2>/dev/null; ls -la "$OUT/logs.tgz"; }
trap pack EXIT
T0=$(date +%s)
r() { local name=$1 t=$2; shift 2
  timeout -s INT -k 5 $t "$@" > $L/$name.log 2>&1; local rc=$?
  echo "[$(( $(date +%s) - T0 ))s] $name rc=$rc $(grep -hE '^=+ .*(passed|failed|error)' $L/$name.log | tail -1)" | tee -a $L/rc.txt; }
[ -d .bundle ] || tar xJf .bundle.tar.xz || exit 1
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee "$L/gpus.txt"
W=$(ls .bundle/wheels/stablebuf-*.whl | head -1)
python3 -m pip install -q --no-index --no-deps --target /tmp/sx "$W" >/dev/null 2>&1 || python3 -m zipfile -e "$W" /tmp/sx
export PYTHONPATH=/tmp/sx PYTHONUNBUFFERED=1
r pytwo 130 python3 -m pytest -v -rs -p no:cacheprovider --tb=short python/tests/test_publish.py python/tests/test_two_gpus.py
r rl2 90 python3 -u python/examples/rl_weight_sync.py --gib 1 --versions 3 --trainer-device 0 \
  --engine-device 1 --methods ipc-copy,stablebuf,pipelined,raw-copy --diagnose --pre-copy 0,1
cat $L/rc.txt
grep -hE "^(FAILED|ERROR) |^=+ .*(passed|failed)" $L/pytwo.log | tail -4
grep -hE "verdict: (item 3.*raw-copy|outputs)|diagnosis: the whole|Traceback|Error" $L/rl2.log | cut -c1-240
