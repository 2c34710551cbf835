#!/usr/bin/env bash
# Session 6, call 4 (nvidia-h200, alone): kv_serve with zero-ahead (default gates = half the
# layers) at three seeds and --gates 1 at seed 1; gpu_kv at 3 fresh seeds; the Python KV tests.
set -uo pipefail
L=/tmp/L; rm -rf $L; mkdir -p $L
pack() { tar czf "$OUT/logs.tgz" -C $L . 2>/dev/null; ls -la "$OUT/logs.tgz"; }
trap pack EXIT
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$L/stamps.txt"; }
[ -d .bundle ] || tar xJf .bundle.tar.xz || exit 1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$L/gpus.txt"
r() { local name=$1 t=$2; shift 2
  timeout -s INT -k 5 $t "$@" > $L/$name.log 2>&1; echo "$name rc=$? $(grep -hE '^=+ .*(passed|failed|error)|GPU suite:' $L/$name.log | tail -1)" | tee -a $L/rc.txt; }
W=$(ls .bundle/wheels/stablebuf-*.whl | head -1)
python3 -m pip install -q --no-index --no-deps --target /tmp/sx "$W" >/dev/null 2>&1 || python3 -m zipfile -e "$W" /tmp/sx
export PYTHONPATH=/tmp/sx PYTHONUNBUFFERED=1
r kv0 90 python3 -u python/examples/kv_serve.py
r kv1 80 python3 -u python/examples/kv_serve.py --seed 1 --skip-probe
r kv2 80 python3 -u python/examples/kv_serve.py --seed 2 --skip-probe
r kvg1s1 80 python3 -u python/examples/kv_serve.py --gates 1 --seed 1 --skip-probe
stamp "kv_serve done"
d=/tmp/lane1; rm -rf $d; mkdir -p $d/.bundle/tests $d/.bundle/examples; cp .bundle/run $d/.bundle/
ln -s $PWD/.bundle/tests/gpu_kv $d/.bundle/tests/gpu_kv; ln -s $PWD/.bundle/examples/kv_decode $d/.bundle/examples/kv_decode
r gpukv 90 $d/.bundle/run --seeds 3
r pykv 150 python3 -m pytest -v -rs -p no:cacheprovider --tb=short python/tests/test_hf_cache.py python/tests/test_kv_cpu.py
stamp end
cat $L/rc.txt
for f in kv0 kv1 kv2 kvg1s1; do echo "[$f]"; grep -hE "verdict|mapping steps" $L/$f.log | cut -c1-420; done
grep -hE "^seeds|^failed|GPU suite|RESULT" $L/gpukv.log | cut -c1-250 | head -8
grep -hE "^(FAILED|ERROR)" $L/pykv.log | head
