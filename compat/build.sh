#!/usr/bin/env bash
# Builds the downstream compatibility crates on a machine with no CUDA toolkit and no GPU:
#
#   compat/candle  stablebuf + candle-core (feature `cuda`)  -> target/compat/bin/stablebuf-candle-check
#   compat/cubecl  stablebuf + cubecl-cuda                   -> target/compat/bin/stablebuf-cubecl-check
#
#   compat/build.sh [--ci] [candle|cubecl]...   (both when none is named)
#
# --ci (what .ci/run uses): the dev profile and no stripped copies. Compiling and linking against
# candle and cubecl is the whole check on a machine without a GPU, and the release profile's
# optimisation of candle, gemm and cubecl is most of the Rust time. The release binaries for the
# GPU host come from the plain mode (`scripts/gpu-bundle --compat`).
#
# candle-core's `cuda` feature forces cudarc's `dynamic-linking` and compiles candle-kernels with
# nvcc, so the candle crate needs a CUDA toolkit at build time. This script installs the pieces
# from PyPI into .tools/cuda13 (git-ignored): nvcc, CUDA headers, and the libraries candle links
# (cudart, cuBLAS, cuRAND, NVRTC). libcuda comes with the driver, not with any wheel, so a
# link-time stub of it is generated here, as the toolkit's own lib/stubs/libcuda.so is; the real
# one is loaded at run time. Everything is CUDA 13.0 because the GPU host's driver is 13.0: PTX
# from a newer nvcc would not load there, and the binary names the `.so.13` libraries it has.
# Run the result on a GPU host with compat/run-gpu.sh.
#
# Env: CUDA_COMPUTE_CAP (default 90, the H100) picks the GPU architecture candle's kernels are
# compiled for; CARGO_TARGET_DIR (default target/compat).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

# Pinned together: one CUDA release (13.0), so headers, nvcc and libraries agree.
wheels=(
  "nvidia-cuda-nvcc==13.0.88" "nvidia-cuda-crt==13.0.88" "nvidia-nvvm==13.0.88"
  "nvidia-cuda-runtime==13.0.96" "nvidia-cuda-cccl==13.0.85" "nvidia-cuda-nvrtc==13.0.88"
  "nvidia-cublas==13.0.2.14" "nvidia-curand==10.4.0.35"
)
tools=$root/.tools/cuda13
cuda=$tools/nvidia/cu13
# Written last, so an interrupted install is detected and redone.
marker=$tools/.installed-$(printf '%s\n' "${wheels[@]}" | cksum | cut -d' ' -f1)

profile=release
crates=()
for arg in "$@"; do
  case $arg in
    --ci) profile=dev ;;
    *) crates+=("$arg") ;;
  esac
done
[ ${#crates[@]} -gt 0 ] || crates=(candle cubecl)
needs_toolkit=false
for crate in "${crates[@]}"; do
  case $crate in
    candle) needs_toolkit=true ;;
    cubecl) ;;
    *) echo "compat/build.sh: unknown crate '$crate' (candle or cubecl)" >&2; exit 2 ;;
  esac
done

install_toolkit() {
  if ! command -v python3 >/dev/null 2>&1 || ! python3 -m pip --version >/dev/null 2>&1; then
    echo "compat/build.sh: python3 with pip is needed to fetch the CUDA compiler from PyPI" >&2
    echo "  (Debian: apt-get install python3-pip)" >&2
    exit 1
  fi
  for tool in g++ cc; do
    command -v "$tool" >/dev/null 2>&1 || { echo "compat/build.sh: $tool is needed (nvcc's host compiler)" >&2; exit 1; }
  done
  echo "installing CUDA 13.0 from PyPI into ${tools#"$root"/}"
  rm -rf "$tools"
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$tools" "${wheels[@]}"
  # The wheels ship only versioned sonames; the linker looks for lib<name>.so.
  for lib in cudart:13 cublas:13 cublasLt:13 nvrtc:13 curand:10; do
    ln -sf "lib${lib%%:*}.so.${lib##*:}" "$cuda/lib/lib${lib%%:*}.so"
  done
  touch "$marker"
}

# The libcuda link stub: every driver function cudarc can call, each an empty body. The soname is
# the real driver's, so the binary loads the driver's libcuda.so.1 at run time.
make_libcuda_stub() { # $1 = cudarc's source folder
  local stubs=$cuda/lib/stubs
  mkdir -p "$stubs"
  grep -ohE '^pub unsafe fn cu[A-Za-z0-9_]+' "$1/src/driver/sys/mod.rs" | sed 's/^pub unsafe fn //' |
    sort -u | sed 's/.*/void &(void) {}/' > "$stubs/libcuda-stub.c"
  [ -s "$stubs/libcuda-stub.c" ] || { echo "compat/build.sh: no driver functions found in $1" >&2; exit 1; }
  cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$stubs/libcuda.so" "$stubs/libcuda-stub.c"
}

cudarc_source() { # $1 = manifest; prints the folder of the cudarc that cargo resolved
  cargo metadata --format-version 1 --manifest-path "$1" | python3 -c '
import json, os, sys
meta = json.load(sys.stdin)
print(next(os.path.dirname(p["manifest_path"]) for p in meta["packages"] if p["name"] == "cudarc"))'
}

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target/compat}
# Not --locked: the committed lock files pin candle and cubecl, and stablebuf's own new
# dependencies may be added to them.
for crate in "${crates[@]}"; do
  start=$SECONDS
  manifest=compat/$crate/Cargo.toml
  if [ "$crate" = candle ]; then
    [ -e "$marker" ] || install_toolkit
    make_libcuda_stub "$(cudarc_source "$manifest")"
    # cudarc and cudaforge (candle-kernels) find nvcc, headers and libraries from CUDA_HOME and
    # PATH; no GPU here, so the architecture is named.
    CUDA_HOME=$cuda PATH=$cuda/bin:$PATH CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90} \
      cargo build --profile "$profile" --manifest-path "$manifest"
  else
    # cubecl-cuda shares stablebuf's dynamically loaded cudarc: nothing to install.
    cargo build --profile "$profile" --manifest-path "$manifest"
  fi
  if [ "$profile" = dev ]; then
    echo "compat $crate: built (dev profile, --ci) in $((SECONDS - start)) s"
    continue
  fi
  # A stripped copy to carry to the GPU host (the candle one is ~40 MB: candle's kernels).
  mkdir -p "$CARGO_TARGET_DIR/bin"
  strip -o "$CARGO_TARGET_DIR/bin/stablebuf-$crate-check" "$CARGO_TARGET_DIR/release/stablebuf-$crate-check"
  echo "compat $crate: built in $((SECONDS - start)) s -> ${CARGO_TARGET_DIR#"$root"/}/bin/stablebuf-$crate-check"
done
