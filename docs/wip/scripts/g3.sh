#!/usr/bin/env bash
# Seventh session, call 3 (one H200, alone), issue 41 on one GPU: rl_weight_sync.py at 1 and
# 8 GiB, shares 1 and 0.2, the trainer's weights in Trainer.twin() and its own; then gpu_kv at 3
# fresh seeds (zero_ahead at random, rows past their lengths read zero), kv_decode, and the
# upload test.
set -uo pipefail
L=/tmp/L; rm -rf $L; mkdir -p $L
pack() { tar czf "$OUT/logs.tgz" -C $L . 2>/dev/null; ls -la "$OUT/logs.tgz"; }
trap pack EXIT
T0=$(date +%s); TOTAL=${TOTAL:-580}; left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
r() { local name=$1 t=$2; shift 2; [ "$t" -lt 10 ] && { echo "$name skipped (no time)" | tee -a $L/rc.txt; return; }
  timeout -s INT -k 5 $t "$@" > $L/$name.log 2>&1; local rc=$?
  echo "[$(( $(date +%s) - T0 ))s] $name rc=$rc $(grep -hE '^=+ .*(passed|failed|error)|GPU suite:' $L/$name.log | tail -1)" | tee -a $L/rc.txt; }
[ -d .bundle ] || tar xJf .bundle.tar.xz || exit 1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$L/gpus.txt"
W=$(ls .bundle/wheels/stablebuf-*.whl | head -1)
python3 -m pip install -q --no-index --no-deps --target /tmp/sx "$W" >/dev/null 2>&1 || python3 -m zipfile -e "$W" /tmp/sx
for w in .bundle/wheels/*.whl; do case "$w" in *stablebuf-*) ;; *) python3 -m pip install -q --no-index --no-deps --target /tmp/sx "$w" >/dev/null 2>&1;; esac; done
export PYTHONPATH=/tmp/sx PYTHONUNBUFFERED=1
PYT="python3 -m pytest -v -rs -p no:cacheprovider --tb=short"
r rl1 ${RL_S:-380} python3 -u python/examples/rl_weight_sync.py --gib 1,8 --versions 20 \
  --share 1,0.2 --layout twin,own
d=/tmp/lane1; rm -rf $d; mkdir -p $d/.bundle/tests $d/.bundle/examples; cp .bundle/run $d/.bundle/
ln -s $PWD/.bundle/tests/gpu_kv $d/.bundle/tests/gpu_kv
r gpukv 80 $d/.bundle/run --seeds 3
r kvdecode 40 .bundle/examples/kv_decode
r upload 40 $PYT python/tests/test_gpu.py -k upload
cat $L/rc.txt
grep -hE "verdict|slowest switch|cuda:0 -> set|commit -> first launch|commit -> the first launch call|bandwidth share|views -:|^rl_weight_sync:   (stablebuf|pipelined|ipc)" $L/rl1.log | cut -c1-260
grep -hE "^seeds|^failed|GPU suite|panicked" $L/gpukv.log | cut -c1-300 | head -8
grep -hE "RESULT|PASS|FAIL" $L/kvdecode.log | cut -c1-300 | tail -4
grep -hE "^(FAILED|ERROR) |^=+ .*(passed|failed)" $L/upload.log | tail -3
