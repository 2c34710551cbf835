#!/usr/bin/env bash
# Runs a compat check binary built by compat/build.sh on a GPU host with no Rust toolchain:
#
#   compat/run-gpu.sh target/compat/bin/stablebuf-candle-check
#
# The candle binary is linked (candle forces it) against libcuda.so.1 from the driver and the
# CUDA 13 libraries libcudart.so.13, libcublas.so.13, libcublasLt.so.13, libcurand.so.10 and
# libnvrtc.so.13. Each one the loader cannot find is looked for in /usr/local/cuda*/ and in the
# `nvidia` wheels of Python environments under /opt and /usr/local (PyTorch's cu13 wheels), and
# its folder is put on LD_LIBRARY_PATH. Ends with one line: `compat GPU check: passed` or
# `compat GPU check: failed (<why>)`, and the matching exit status.
set -uo pipefail

fail() {
  echo "compat GPU check: failed ($1)"
  exit 1
}

bin=${1:-}
[ -n "$bin" ] || fail "usage: compat/run-gpu.sh BINARY"
[ -x "$bin" ] || fail "$bin is not an executable file"

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1 |
  sed 's/^/device: /'

export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
missing() { ldd "$bin" 2>/dev/null | awk '/=> not found/ { print $1 }'; }
if command -v ldd >/dev/null 2>&1; then
  for lib in $(missing); do
    # Never a toolkit's stubs/ folder: its libcuda.so would shadow the driver's.
    found=$(find /usr/local/cuda* /opt /usr/local/lib /usr/lib/python3* -name "$lib" \
      -not -path '*/stubs/*' 2>/dev/null | head -1)
    if [ -n "$found" ]; then
      echo "found $lib in ${found%/*}"
      LD_LIBRARY_PATH="${found%/*}:$LD_LIBRARY_PATH"
    fi
  done
  still=$(missing | tr '\n' ' ')
  [ -z "$still" ] || fail "libraries not found: $still"
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
timeout 600 "$bin" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
if [ "$status" -eq 0 ] && grep -q 'check: passed$' "$log"; then
  echo "compat GPU check: passed"
else
  fail "$(basename "$bin") exited with status $status"
fi
