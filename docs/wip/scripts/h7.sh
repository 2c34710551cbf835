#!/usr/bin/env bash
# Ninth session, call 1 (nvidia-h200-x2, alone), issue 41 item 3 at 1 GiB: where the twin's
# one copy into the set loses against the peer copy (344 against 387 GB/s on the GPU, plus
# 0.35 ms of host). The probes print each write's first (cold) run and a copy in two halves on
# two streams; the publishes run with 1, 2 and 4 copy streams (the twin cut in page-aligned
# pieces), each with and without Trainer.warm_translations, and print the new "prepare" part
# (the set's flat view is now made once). Then the two-GPU publish tests.
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
r rl2 330 python3 -u python/examples/rl_weight_sync.py --gib 1,8 --versions 20 \
  --trainer-device 0 --engine-device 1 --methods ipc-copy,pipelined --layout twin \
  --copy-streams 1,2,4 --warm-translations 0,1
r pytwo 170 $PYT python/tests/test_publish.py python/tests/test_two_gpus.py
cat $L/rc.txt
grep -hE "verdict: item 3|cuda:0 -> set|item 3 probe|^rl_weight_sync:   pipelined.*views trainer" $L/rl2.log | cut -c1-330
grep -hE "verdict: (item 1|item 2|outputs)" $L/rl2.log | cut -c1-200
grep -hE "^(FAILED|ERROR) |^=+ .*(passed|failed)" $L/pytwo.log | tail -6
