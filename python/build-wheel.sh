#!/usr/bin/env bash
# Builds the stablebuf Python wheel: abi3 (one wheel for CPython >= 3.9), manylinux_2_28,
# x86-64. Works on a machine with no GPU and no CUDA toolkit: maturin and zig (for the
# manylinux glibc baseline) come from PyPI into .tools/wheel, and the core crate's kernels are
# compiled by NVRTC from PyPI (scripts/nvrtc-env), else taken from the committed PTX.
#
#   python/build-wheel.sh [--dev] [OUT_DIR]      (default: python/dist)
#
# --dev: a wheel for this machine only, for the CPU tests (python/test-cpu.sh --dev): the dev
# profile into target/debug, where `cargo test` already compiled its dependencies, tagged
# linux_x86_64 (no zig, no manylinux baseline). What ships is the default: release, manylinux.
#
# The last line printed is `wheel: <path>`.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
dev=false
if [ "${1:-}" = --dev ]; then
  dev=true
  shift
fi
out="${1:-$here/dist}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"

# shellcheck source=/dev/null
source "$root/scripts/nvrtc-env"

tools="$root/.tools/wheel"
# zig (for the manylinux wheel's glibc floor) only for the release wheel: the dev wheel is
# built for this machine, and zig is a large download CI need not make.
if [ ! -x "$tools/bin/maturin" ]; then
  echo "build-wheel: installing maturin into $tools"
  rm -rf "$tools"
  python3 -m venv "$tools"
  "$tools/bin/python" -m pip install --quiet --disable-pip-version-check "maturin==1.16.0"
fi
if ! $dev && ! "$tools/bin/python" -c "import ziglang" 2>/dev/null; then
  echo "build-wheel: installing zig into $tools"
  "$tools/bin/python" -m pip install --quiet --disable-pip-version-check "ziglang==0.17.1"
fi
# maturin finds zig through `python3 -m ziglang`: put the tools' python first.
export PATH="$tools/bin:$PATH"

rm -f "$out"/stablebuf-*.whl
if $dev; then
  (cd "$root" && maturin build --profile dev --manifest-path python/Cargo.toml \
    --compatibility linux --out "$out")
  wheel="$(ls "$out"/stablebuf-*-cp39-abi3-linux_x86_64.whl)"
else
  (cd "$root" && maturin build --release --manifest-path python/Cargo.toml \
    --zig --compatibility manylinux_2_28 --out "$out")
  wheel="$(ls "$out"/stablebuf-*-cp39-abi3-manylinux_2_28_x86_64.whl)"
fi
# The wheel must carry the extension, the pure-Python package, the stub and py.typed.
python3 - "$wheel" <<'PY'
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
need = ["stablebuf/__init__.py", "stablebuf/_regions.py", "stablebuf/_graph.py",
        "stablebuf/_guard.py", "stablebuf/_native.abi3.so", "stablebuf/_native.pyi",
        "stablebuf/py.typed"]
missing = [n for n in need if n not in names]
if missing:
    sys.exit(f"build-wheel: the wheel lacks {missing}")
PY
echo "wheel: $wheel"
