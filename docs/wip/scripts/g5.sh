#!/usr/bin/env bash
# Seventh session, call 5 (one H200, alone; no x2 lent then), issue 41 on one GPU with the
# trainer's weights in Trainer.twin() (call 3's twin outputs were wrong: the example's order):
# 1 GiB at shares 1, 0.2 and 0.1 with chunks of 64 and 16 MiB; 8 GiB at shares 1 and 0.2.
set -uo pipefail
L=/tmp/L; rm -rf $L; mkdir -p $L
pack() { tar czf "$OUT/logs.tgz" -C $L . 2>/dev/null; ls -la "$OUT/logs.tgz"; }
trap pack EXIT
T0=$(date +%s); TOTAL=${TOTAL:-420}; left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
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
r rl1 ${RL_S:-170} python3 -u python/examples/rl_weight_sync.py --gib 1 --versions 20 \
  --share 1,0.2,0.1 --chunk-mib 64,16
r rl8 $(( $(left) - 5 )) python3 -u python/examples/rl_weight_sync.py --gib 8 --versions 20 --share 1,0.2
cat $L/rc.txt
for f in rl1 rl8; do grep -hE "verdict|commit -> first launch|commit -> the first launch call|views -:|cuda:0 -> set|^rl_weight_sync:   (stablebuf|pipelined|ipc)" $L/$f.log | cut -c1-240; done
