#!/usr/bin/env bash
# Next session, issue 41 (nvidia-h200-x2, alone): is the one ~4 ms graph launch in 20 at 8 GiB
# another thread's cuMemRelease? rl_weight_sync.py at 8 GiB, trainer on GPU 0 and engine on
# GPU 1, with the release policy background (the default), manual (nothing released during
# the run) and immediate, side by side; then the one-GPU run with the share. Compare the
# pipelined "commit -> first launch" p99 and the part table's `launch` row.
set -uo pipefail
L=/tmp/L; rm -rf $L; mkdir -p $L
pack() { tar czf "$OUT/logs.tgz" -C $L . 2>/dev/null; ls -la "$OUT/logs.tgz"; }
trap pack EXIT
[ -d .bundle ] || tar xJf .bundle.tar.xz || exit 1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$L/gpus.txt"
W=$(ls .bundle/wheels/stablebuf-*.whl | head -1)
python3 -m pip install -q --no-index --no-deps --target /tmp/sx "$W" >/dev/null 2>&1 || python3 -m zipfile -e "$W" /tmp/sx
export PYTHONPATH=/tmp/sx PYTHONUNBUFFERED=1
for mode in background manual immediate; do
  STABLEBUF_RELEASE=$mode timeout -s INT 150 python3 -u python/examples/rl_weight_sync.py --gib 8 --versions 20 \
    --trainer-device 0 --engine-device 1 > $L/rl_$mode.log 2>&1; echo "rl_$mode rc=$?"
done
timeout -s INT 200 python3 -u python/examples/rl_weight_sync.py --gib 1,8 --versions 20 --share 1,0.2 > $L/rl_one.log 2>&1; echo "rl_one rc=$?"
for f in $L/rl_*.log; do echo "[$f]"; grep -hE "PASS|MISS|launch|p99" $f | cut -c1-220 | head -14; done
