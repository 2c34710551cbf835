#!/usr/bin/env bash
# Session 5 plan, calls 2 and 3 (nvidia-h100-x1, then nvidia-h200; alone): kv_serve quick at two
# seeds with the probe (--gates 1, the default), --gates 2, and --gates 4 at two seeds; gpu_kv at 3 seeds; issue 43's
# rows at 3 rounds, resize and the perf check.
set -uo pipefail
L=/tmp/L; rm -rf $L; mkdir -p $L
pack() { find $L -type f -size +600k | while read -r f; do
    { head -c 150000 "$f"; printf '\n... [cut] ...\n'; tail -c 350000 "$f"; } > "$f.cut" && mv "$f.cut" "$f"; done
  tar czf "$OUT/logs.tgz" -C $L . 2>/dev/null; ls -la "$OUT/logs.tgz"; }
trap pack EXIT
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$L/stamps.txt"; }
[ -d .bundle ] || tar xJf .bundle.tar.xz || exit 1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$L/gpus.txt"
TOTAL=${TOTAL:-570}; left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
r() { local name=$1 t=$2; shift 2; [ "$t" -lt 10 ] && { echo "$name skipped (no time)" | tee -a $L/rc.txt; return; }
  timeout -s INT -k 5 $t "$@" > $L/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $(grep -hE '^=+ .*(passed|failed|error)|test result|GPU suite:' $L/$name.log | tail -2 | tr '\n' ' ')" | tee -a $L/rc.txt; }
W=$(ls .bundle/wheels/stablebuf-*.whl | head -1)
python3 -m pip install -q --no-index --no-deps --target /tmp/sx "$W" >/dev/null 2>&1 || python3 -m zipfile -e "$W" /tmp/sx
export PYTHONPATH=/tmp/sx PYTHONUNBUFFERED=1
r kv0 90 python3 -u python/examples/kv_serve.py
r kv1 80 python3 -u python/examples/kv_serve.py --seed 1 --skip-probe
r kvg2 80 python3 -u python/examples/kv_serve.py --gates 2 --skip-probe
r kvg4 80 python3 -u python/examples/kv_serve.py --gates 4 --skip-probe
r kvg4s1 80 python3 -u python/examples/kv_serve.py --gates 4 --seed 1 --skip-probe
stamp "kv_serve done"
d=/tmp/lane1; rm -rf $d; mkdir -p $d/.bundle/tests $d/.bundle/examples; cp .bundle/run $d/.bundle/
ln -s $PWD/.bundle/tests/gpu_kv $d/.bundle/tests/gpu_kv
r gpukv 70 $d/.bundle/run --seeds 3
mkdir -p $L/perf
r resize 30 .bundle/examples/resize; cp $L/resize.log $L/perf/resize.log
STABLEBUF_BIND_REPEAT=3 r bindcost $(( $(left) - 8 )) .bundle/tests/gpu_bind_cost --include-ignored --nocapture --test-threads=1 binds_through
grep -vE "^\s+(first bind calls|raw  )" $L/bindcost.log > $L/perf/gpu_bind_cost.log
scripts/perf-check $L/perf > $L/perfcheck.log 2>&1
stamp end
cat $L/rc.txt
echo "--- kvserve"; for f in kv0 kv1 kvg2 kvg4 kvg4s1; do echo "[$f]"; grep -hE "verdict|mapping steps|parts|  step " $L/$f.log | cut -c1-240; done
echo "--- gpu_kv"; grep -hE "^seeds|^failed|GPU suite" $L/gpukv.log | cut -c1-250 | head -6
echo "--- 43"; grep -hE "issue 43 rows|worst" $L/bindcost.log | cut -c1-220; grep -E "server-life|floor|met|within|regress|MISS" $L/perfcheck.log | head -8
grep -hE "^\| stablebuf grow|^\| cudaMalloc" $L/resize.log
