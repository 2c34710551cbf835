#!/usr/bin/env bash
# Session 8, call 5 (one H200, alone): the one-GPU table again on the final code, 40 versions
# at 1 GiB (pulled beside pause-and-copy and the pipelined engine, and the copy calls a version
# takes), 20 at 8 GiB.
set -uo pipefail
L=/tmp/L; rm -rf $L; mkdir -p $L
pack() { tar czf "$OUT/logs.tgz" -C $L . 2>/dev/null; ls -la "$OUT/logs.tgz"; }
trap pack EXIT
T0=$(date +%s); TOTAL=${TOTAL:-560}; left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
r() { local name=$1 t=$2; shift 2; [ "$t" -lt 10 ] && { echo "$name skipped (no time)" | tee -a $L/rc.txt; return; }
  timeout -s INT -k 5 $t "$@" > $L/$name.log 2>&1; local rc=$?
  echo "[$(( $(date +%s) - T0 ))s] $name rc=$rc $(grep -hE '^=+ .*(passed|failed|error)' $L/$name.log | tail -1)" | tee -a $L/rc.txt; }
[ -d .bundle ] || tar xJf .bundle.tar.xz || exit 1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$L/gpus.txt"
W=$(ls .bundle/wheels/stablebuf-*.whl | head -1)
python3 -m pip install -q --no-index --no-deps --target /tmp/sx "$W" >/dev/null 2>&1 || python3 -m zipfile -e "$W" /tmp/sx
export PYTHONPATH=/tmp/sx PYTHONUNBUFFERED=1
PYT="python3 -m pytest -v -rs -p no:cacheprovider --tb=short"
r pull1 130 python3 -u python/examples/rl_weight_sync.py --gib 1 --versions 40 \
  --methods ipc-copy,pipelined,pulled --chunk-mib 64
r pull8 $(( $(left) - 5 )) python3 -u python/examples/rl_weight_sync.py --gib 8 --versions 20 \
  --methods ipc-copy,pulled --chunk-mib 64
cat $L/rc.txt
for f in pull1 pull8; do grep -hE "verdict|^rl_weight_sync:   (pulled|pipelined|ipc)" $L/$f.log | grep -v "cuda:nan\|item 3"; grep -h "copies of a version" $L/$f.log | cut -c1-230; done
