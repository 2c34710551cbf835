#!/usr/bin/env bash
# Session 6, call 3 (nvidia-h200, alone): kv_serve quick with the new default (--gates = half
# the layers) at three seeds, --gates 1 at seed 1 (its known slow opening step) and --gates 4
# at seed 1 (the next step waits at its first gate: the under-gate accounting must see it),
# with the map-step verdict that charges a step only where the map was on its path.
set -uo pipefail
L=/tmp/L; rm -rf $L; mkdir -p $L
pack() { tar czf "$OUT/logs.tgz" -C $L . 2>/dev/null; ls -la "$OUT/logs.tgz"; }
trap pack EXIT
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$L/stamps.txt"; }
[ -d .bundle ] || tar xJf .bundle.tar.xz || exit 1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$L/gpus.txt"
r() { local name=$1 t=$2; shift 2
  timeout -s INT -k 5 $t "$@" > $L/$name.log 2>&1; echo "$name rc=$?" | tee -a $L/rc.txt; }
W=$(ls .bundle/wheels/stablebuf-*.whl | head -1)
python3 -m pip install -q --no-index --no-deps --target /tmp/sx "$W" >/dev/null 2>&1 || python3 -m zipfile -e "$W" /tmp/sx
# The pure-Python files of this tree over the wheel's (the bundle's wheel predates them).
cp python/stablebuf/*.py /tmp/sx/stablebuf/
export PYTHONPATH=/tmp/sx PYTHONUNBUFFERED=1
r kv0 90 python3 -u python/examples/kv_serve.py
r kv1 80 python3 -u python/examples/kv_serve.py --seed 1 --skip-probe
r kv2 80 python3 -u python/examples/kv_serve.py --seed 2 --skip-probe
r kvg1s1 80 python3 -u python/examples/kv_serve.py --gates 1 --seed 1 --skip-probe
r kvg4s1 80 python3 -u python/examples/kv_serve.py --gates 4 --seed 1 --skip-probe
stamp end
cat $L/rc.txt
for f in kv0 kv1 kv2 kvg1s1 kvg4s1; do echo "[$f]"; grep -hE "verdict|mapping steps|under a gate|^stable|^static" $L/$f.log | cut -c1-420; done
