#!/usr/bin/env bash
# Session 6, call 6 (nvidia-h200, alone): kv_serve with its defaults (gates = half the layers, zeroed
# granules made at the start and topped up one per step that changes nothing) at three seeds.
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
r kv0 80 python3 -u python/examples/kv_serve.py --skip-probe
r kv1 80 python3 -u python/examples/kv_serve.py --seed 1 --skip-probe
r kv2 80 python3 -u python/examples/kv_serve.py --seed 2 --skip-probe
stamp "kv_serve done"
stamp end
cat $L/rc.txt
for f in kv0 kv1 kv2; do echo "[$f]"; grep -hE "verdict|mapping steps" $L/$f.log | cut -c1-420; done
for f in kv0 kv1 kv2; do grep -hE "^stable|^static|  step |parts" $L/$f.log | head -9 | cut -c1-260; done
