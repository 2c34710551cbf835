#!/usr/bin/env bash
# Next session (one H200, alone), with docs/wip/patches/issue41-pulling-engine.patch applied and
# the bundle rebuilt: the pulling engine's failure tests (trainer killed mid-write and after its
# commit, a socket closed, the engine killed; no leak), then rl_weight_sync.py on one GPU with
# the pulled method beside pause-and-copy and the pipelined engine at 1 and 8 GiB, chunks of 64
# and 16 MiB: is the longest step <= 1.2x, and what does the engine lose?
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
r fail 150 $PYT python/tests/test_publish_failures.py -k pulled
r pull1 150 python3 -u python/examples/rl_weight_sync.py --gib 1 --versions 20 \
  --methods ipc-copy,pipelined,pulled --chunk-mib 64,16
# At 8 GiB a step is ~8.5 ms: 16 MiB chunks would take 512 steps a version; 256 MiB is ~4%.
r pull8 $(( $(left) - 5 )) python3 -u python/examples/rl_weight_sync.py --gib 8 --versions 20 \
  --methods ipc-copy,pipelined,pulled --chunk-mib 64,256
cat $L/rc.txt
grep -hE "^(FAILED|ERROR) |^=+ .*(passed|failed)" $L/fail.log | tail -6
for f in pull1 pull8; do grep -hE "verdict|views -:|^rl_weight_sync:   (pulled|pipelined|ipc)" $L/$f.log | cut -c1-240; done
