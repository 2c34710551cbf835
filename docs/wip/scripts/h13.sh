#!/usr/bin/env bash
# Ninth session, call 7 (one H200): the new GPU test of a twin publish (Trainer.twin(), one
# copy of the whole layout, read by the engine's graph version after version against CPU
# references), with the versions test beside it.
set -uo pipefail
L=/tmp/L; rm -rf $L; mkdir -p $L
pack() { tar czf "$OUT/logs.tgz" -C $L . 2>/dev/null; ls -la "$OUT/logs.tgz"; }
trap pack EXIT
[ -d .bundle ] || tar xJf .bundle.tar.xz || exit 1
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee "$L/gpus.txt"
W=$(ls .bundle/wheels/stablebuf-*.whl | head -1)
python3 -m pip install -q --no-index --no-deps --target /tmp/sx "$W" >/dev/null 2>&1 || python3 -m zipfile -e "$W" /tmp/sx
export PYTHONPATH=/tmp/sx PYTHONUNBUFFERED=1
timeout -s INT -k 5 120 python3 -m pytest -v -rs -p no:cacheprovider --tb=short \
  python/tests/test_publish.py -k "twin or each_published" > $L/twin.log 2>&1; echo "rc=$?"
grep -hE "PASSED|FAILED|ERROR|SKIPPED|^=+ .*(passed|failed)" $L/twin.log | tail -8
