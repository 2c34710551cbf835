#!/usr/bin/env bash
# The Python tests that need no GPU (CI): installs the package into a temporary folder and runs
# pytest on python/tests (and the preload demos' CPU tests); GPU tests report as skipped with the reason.
#
#   python/test-cpu.sh [--dev | --test-build] [WHEEL]
#
# WHEEL: test this wheel. Without one:
# --test-build (what scripts/test uses, after `cargo test --workspace`): the package as the
#   pure-Python folder python/stablebuf plus the extension `cargo test` already built
#   (target/debug/deps/libstablebuf_py.so). A wheel's build compiles stablebuf and the extension again
#   with other features (maturin builds the extension crate alone), which on CI's two cores cost
#   ten minutes for the same code. That extension links libpython, as every `cargo test` build
#   of a PyO3 crate does; loaded into the python that owns that libpython it resolves to the
#   one already loaded. Where that does not hold (a python without a shared libpython, or a
#   different one), this falls back to --dev. The wheel's packaging is checked apart from this:
#   scripts/check-wheel-metadata (its metadata) and python/build-wheel.sh (its files).
# --dev: build the wheel in the dev profile for this machine only (python/build-wheel.sh --dev).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
mode=wheel
case "${1:-}" in
  --dev) mode=dev; shift ;;
  --test-build) mode=test-build; shift ;;
esac
wheel="${1:-}"
site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT

# Whether `$1` (an extension linked against libpython) can be loaded into python3: the
# libpython it needs is the one python3 itself runs on.
links_this_python() {
  local needed own
  needed="$(readelf -d "$1" 2>/dev/null | sed -n 's/.*Shared library: \[\(libpython[^]]*\)\].*/\1/p' | head -1)"
  [ -n "$needed" ] || return 0 # links no libpython at all: loads anywhere
  own="$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("INSTSONAME") or "")')"
  [ "$needed" = "$own" ]
}

if [ "$mode" = test-build ] && [ -z "$wheel" ]; then
  # cargo test leaves the library's cdylib in deps/ (only `cargo build` and maturin copy it up to
  # target/debug/, where an older build's copy may linger).
  extension="${CARGO_TARGET_DIR:-$root/target}/debug/deps/libstablebuf_py.so"
  if [ -f "$extension" ] && links_this_python "$extension"; then
    cp -r "$root/python/stablebuf" "$site/stablebuf"
    rm -rf "$site/stablebuf/__pycache__"
    cp "$extension" "$site/stablebuf/_native.abi3.so"
    echo "test-cpu: the package from python/stablebuf and $extension (the tests' build)"
  else
    if [ -f "$extension" ]; then why="needs another libpython than python3's"; else why="is missing"; fi
    echo "test-cpu: $extension $why; building the wheel instead (minutes)" >&2
    mode=dev
  fi
fi
if [ "$mode" != test-build ] || [ -n "$wheel" ]; then
  if [ -z "$wheel" ]; then
    build_args=()
    [ "$mode" = dev ] && build_args+=(--dev)
    wheel="$("$here/build-wheel.sh" "${build_args[@]}" | tee -a /dev/stderr | sed -n 's/^wheel: //p' | tail -1)"
  fi
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$site" "$wheel"
fi
python3 -c "import pytest" 2>/dev/null ||
  python3 -m pip install --quiet --disable-pip-version-check --target "$site/.pytest" pytest
# Run from the repository root so that the source folder python/stablebuf (no extension) is
# not what `import stablebuf` finds.
cd "$root"
PYTHONPATH="$site:$site/.pytest${PYTHONPATH:+:$PYTHONPATH}" python3 -m pytest -q -rs python/tests
# The preload layer's GPU-demo tooling that runs without a GPU: the conformance diff on
# hand-made inputs and the two-GPU demos' comparisons (they import no stablebuf).
PYTHONDONTWRITEBYTECODE=1 PYTHONPATH="$site/.pytest${PYTHONPATH:+:$PYTHONPATH}" \
  python3 -m pytest -q -rs -p no:cacheprovider preload/demo/test_conformance_diff.py \
  preload/demo/test_dist_demos.py
