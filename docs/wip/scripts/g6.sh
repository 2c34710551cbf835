#!/usr/bin/env bash
# Issue 41 on two GPUs (nvidia-h200-x2, alone): the trainer's weights in Trainer.twin() (a
# publish is one copy) against its own tensors, at 1 and 8 GiB: items 1-3 with the link probes.
# (Its first version also had a one-GPU part; no x2 was lent then, and that part ran as g5.sh.)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TORCH_NCCL_ENABLE_MONITORING=0
L=/tmp/L; rm -rf $L; mkdir -p $L
pack() { tar czf "$OUT/logs.tgz" -C $L . 2>/dev/null; ls -la "$OUT/logs.tgz"; }
trap pack EXIT
T0=$(date +%s); TOTAL=${TOTAL:-280}; left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
r() { local name=$1 t=$2; shift 2; [ "$t" -lt 10 ] && { echo "$name skipped (no time)" | tee -a $L/rc.txt; return; }
  timeout -s INT -k 5 $t "$@" > $L/$name.log 2>&1; local rc=$?
  echo "[$(( $(date +%s) - T0 ))s] $name rc=$rc $(grep -hE '^=+ .*(passed|failed|error)' $L/$name.log | tail -1)" | tee -a $L/rc.txt; }
[ -d .bundle ] || tar xJf .bundle.tar.xz || exit 1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$L/gpus.txt"
W=$(ls .bundle/wheels/stablebuf-*.whl | head -1)
python3 -m pip install -q --no-index --no-deps --target /tmp/sx "$W" >/dev/null 2>&1 || python3 -m zipfile -e "$W" /tmp/sx
for w in .bundle/wheels/*.whl; do case "$w" in *stablebuf-*) ;; *) python3 -m pip install -q --no-index --no-deps --target /tmp/sx "$w" >/dev/null 2>&1;; esac; done
export PYTHONPATH=/tmp/sx PYTHONUNBUFFERED=1
PYT="python3 -m pytest -v -rs -p no:cacheprovider --tb=short"
r rl2 ${RL_S:-260} python3 -u python/examples/rl_weight_sync.py --gib 1,8 --versions 20 \
  --trainer-device 0 --engine-device 1 --layout twin,own
cat $L/rc.txt
grep -hE "verdict|slowest switch|write by its parts|cuda:0 -> set|commit -> first launch|item 3 probe|^rl_weight_sync:   (stablebuf|pipelined|ipc)" $L/rl2.log | cut -c1-260
