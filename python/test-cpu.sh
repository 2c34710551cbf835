#!/usr/bin/env bash
# The Python tests that need no GPU (CI): builds the wheel (or takes one), installs it into a
# temporary folder and runs pytest on python/tests; GPU tests report as skipped with the reason.
#
#   python/test-cpu.sh [--dev] [WHEEL]
#
# --dev (what scripts/test uses): build the wheel in the dev profile for this machine only
# (python/build-wheel.sh --dev), sharing the tests' compiled dependencies.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
build_args=()
if [ "${1:-}" = --dev ]; then
  build_args+=(--dev)
  shift
fi
wheel="${1:-}"
if [ -z "$wheel" ]; then
  wheel="$("$here/build-wheel.sh" "${build_args[@]}" | tee -a /dev/stderr | sed -n 's/^wheel: //p' | tail -1)"
fi
site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT
python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$site" "$wheel"
python3 -c "import pytest" 2>/dev/null ||
  python3 -m pip install --quiet --disable-pip-version-check --target "$site/.pytest" pytest
# Run from the repository root so that the source folder python/stablebuf (no extension) is
# not what `import stablebuf` finds.
cd "$root"
PYTHONPATH="$site:$site/.pytest${PYTHONPATH:+:$PYTHONPATH}" python3 -m pytest -q -rs python/tests
