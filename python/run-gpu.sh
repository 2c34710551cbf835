#!/usr/bin/env bash
# The Python package's GPU suite, on the GPU machine (no Rust toolchain, no network needed):
#
#   python/run-gpu.sh <stablebuf wheel> [<folder of extra wheels, e.g. torch_memory_saver>]
#   python/run-gpu.sh --multi <stablebuf wheel>
#
# --multi (scripts/gpu-session runs it with every GPU visible): only the tests that need several
# GPUs (test_two_gpus.py, test_tp_decode.py at 2 and 4 ranks, test_tp_publish.py and
# test_nccl_sync.py where they exist, and the publish test from GPU 0 to GPU 1); a skipped test is a failed run here. Ends
# with `python distributed suite: N passed, M failed`.
#
# Installs the wheels into /tmp/site (pip --no-index --no-deps --target), then runs, with
# timings: the capture probe, pytest (CPU and GPU tests), examples/weight_swap.py,
# examples/serve_finetunes.py, examples/sleep_wake.py, examples/rl_weight_sync.py and (with
# transformers) examples/kv_serve.py. Logs go
# to $OUT when it is set (else /tmp/stablebuf-python-logs).
# Ends with `python GPU suite: N passed, M failed`; exits non-zero if anything failed.
# Python: $PYTHON if set, else python3; it must import torch. pytest runs the whole
# python/tests folder: test_cpu.py, test_gpu.py, test_compiled.py (torch.compile, a plain
# torch.cuda.CUDAGraph and a transformers Llama under the replay guard; the Llama test skips
# without transformers), test_guard_cpu.py, test_publish.py, test_random.py and
# test_two_gpus.py (regions on two GPUs; skips, with the reason, on one GPU).
set -uo pipefail
multi=0
if [ "${1:-}" = --multi ]; then
  multi=1
  shift
fi
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
wheel="${1:?usage: python/run-gpu.sh [--multi] <stablebuf wheel> [<extra wheel folder>]}"
extra="${2:-}"
logs="${OUT:-/tmp/stablebuf-python-logs}"
mkdir -p "$logs"
site="${SITE:-/tmp/site}" # SITE: another folder, for runs side by side
suite_start=$(date +%s)

python="${PYTHON:-python3}"
if ! "$python" -c "import torch" 2>/dev/null; then
  echo "run-gpu: $python does not import torch (set PYTHON to a python that does)"
  echo "python GPU suite: 0 passed, 1 failed"
  exit 1
fi

wheels=("$wheel")
if [ -n "$extra" ]; then
  for w in "$extra"/*.whl; do [ -e "$w" ] && wheels+=("$w"); done
fi
rm -rf "$site"
mkdir -p "$site"
echo "run-gpu: installing ${wheels[*]} into $site"
if ! "$python" -m pip install --quiet --no-index --no-deps --target "$site" "${wheels[@]}"; then
  # No pip in this interpreter: a wheel is a zip of the files to install.
  for w in "${wheels[@]}"; do "$python" -m zipfile -e "$w" "$site" || exit 1; done
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
cd "$root"

"$python" - <<'PY'
import torch, stablebuf
print(f"run-gpu: python {__import__('sys').version.split()[0]}, torch {torch.__version__} "
      f"(CUDA {torch.version.cuda}), stablebuf {stablebuf.__version__} from {stablebuf.__file__}")
print(f"run-gpu: device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'NONE'}")
PY

passed=0
failed=0
failures=()
step() { # name, log file, command...
  local name="$1" log="$2"
  shift 2
  echo
  echo "=== $name"
  local start status ms
  start=$(date +%s%N)
  "$@" 2>&1 | tee "$logs/$log"
  status=${PIPESTATUS[0]}
  ms=$((($(date +%s%N) - start) / 1000000))
  echo "=== $name: exit $status in $((ms / 1000)).$(printf '%03d' $((ms % 1000))) s"
  return "$status"
}
count() { # name, status
  if [ "$2" -eq 0 ]; then passed=$((passed + 1)); else failed=$((failed + 1)); failures+=("$1"); fi
}

if [ "$multi" = 1 ]; then
  tests=(python/tests/test_two_gpus.py python/tests/test_tp_decode.py)
  [ -f python/tests/test_tp_publish.py ] && tests+=(python/tests/test_tp_publish.py)
  [ -f python/tests/test_nccl_sync.py ] && tests+=(python/tests/test_nccl_sync.py)
  tests+=(python/tests/test_publish.py::test_a_trainer_on_gpu0_publishes_into_an_engine_on_gpu1_over_peer_access
    python/tests/test_publish.py::test_a_trainer_importing_the_sets_on_another_gpu_is_told_how_to_fix_it)
else
  step "capture probe" probe.log "$python" python/tests/probe_capture.py
  count "capture probe" $?
  tests=(python/tests)
fi

select=()
# The one-GPU cases of these files (tp_decode at 1 rank, tp_publish with every rank on one GPU)
# ran in the one-GPU suite already.
[ "$multi" = 1 ] && select=(-k "not 1-default and not one-gpu")
step "pytest" pytest.log "$python" -m pytest -v -rs -p no:cacheprovider "${select[@]}" "${tests[@]}"
status=$?
summary=$(grep -E '^=+ .*(passed|failed|error).* in [0-9.]+s' "$logs/pytest.log" | tail -1)
number_of() { echo "$summary" | grep -oE "[0-9]+ $1" | grep -oE '^[0-9]+' | head -1; }
tests_passed=$(number_of passed)
tests_failed=$(($(number_of failed || true) + $(number_of 'errors?' || true) + 0))
tests_skipped=$(number_of skipped)
passed=$((passed + ${tests_passed:-0}))
failed=$((failed + ${tests_failed:-0}))
if [ "$status" -ne 0 ] && [ "${tests_failed:-0}" -eq 0 ]; then
  failed=$((failed + 1))
  failures+=("pytest exited $status")
elif [ "${tests_failed:-0}" -gt 0 ]; then
  failures+=("pytest: $tests_failed failed")
fi
gpu_skipped=$(grep -cE '^SKIPPED .*GPU test' "$logs/pytest.log" || true)
if [ "${gpu_skipped:-0}" -gt 0 ]; then
  # This script is for the GPU machine: a skipped GPU test is a failed run.
  failed=$((failed + 1))
  failures+=("pytest skipped GPU tests (see the reasons above)")
elif [ "${tests_skipped:-0}" -gt 0 ] && [ "$multi" = 1 ]; then
  # The several-GPU tests are all this run is for. One that needs more GPUs than this machine
  # has did not run here (said, not failed); any other skip is a failed run.
  more_gpus=$(grep -cE '^SKIPPED .*needs ([0-9]+|two|three|four) (CUDA )?GPUs' "$logs/pytest.log" || true)
  if [ "${more_gpus:-0}" -gt 0 ]; then
    echo "run-gpu: $more_gpus tests need more GPUs than this machine has: not run here"
  fi
  if [ "$tests_skipped" -gt "${more_gpus:-0}" ]; then
    failed=$((failed + 1))
    failures+=("pytest skipped $((tests_skipped - ${more_gpus:-0})) several-GPU tests (see the reasons above)")
  fi
elif [ "${tests_skipped:-0}" -gt 0 ]; then
  echo "run-gpu: note: $tests_skipped tests skipped (see the reasons above)"
fi

if [ "$multi" = 1 ]; then
  {
    echo "run-gpu: finished in $(($(date +%s) - suite_start)) s"
    if [ ${#failures[@]} -gt 0 ]; then printf 'run-gpu: failed: %s\n' "${failures[@]}"; fi
    echo "python distributed suite: $passed passed, $failed failed"
  } | tee "$logs/summary.txt"
  [ "$failed" -eq 0 ]
  exit
fi

step "examples/weight_swap.py" weight_swap.log "$python" python/examples/weight_swap.py
count "weight_swap" $?

step "examples/serve_finetunes.py" serve_finetunes.log "$python" python/examples/serve_finetunes.py
count "serve_finetunes" $?

tms_flag=()
if "$python" -c "import torch_memory_saver" 2>/dev/null; then tms_flag=(--require-tms); fi
step "examples/sleep_wake.py" sleep_wake.log "$python" python/examples/sleep_wake.py "${tms_flag[@]}"
count "sleep_wake" $?

step "examples/rl_weight_sync.py" rl_weight_sync.log "$python" python/examples/rl_weight_sync.py
count "rl_weight_sync" $?

if [ ! -f python/examples/kv_serve.py ]; then
  :
elif "$python" -c "import transformers" 2>/dev/null; then
  step "examples/kv_serve.py" kv_serve.log "$python" python/examples/kv_serve.py
  count "kv_serve" $?
else
  echo "run-gpu: transformers is not installed: examples/kv_serve.py not run"
fi

elapsed=$(($(date +%s) - suite_start))
{
  echo "run-gpu: finished in ${elapsed} s"
  grep -h '^probe ' "$logs/probe.log" || true
  grep -h -E '^(weight_swap|serve_finetunes|sleep_wake):' "$logs/weight_swap.log" \
    "$logs/serve_finetunes.log" "$logs/sleep_wake.log" || true
  grep -h -E '^rl_weight_sync: verdict' "$logs/rl_weight_sync.log" || true
  grep -h -E '^verdict ' "$logs/kv_serve.log" 2>/dev/null || true
  if [ ${#failures[@]} -gt 0 ]; then printf 'run-gpu: failed: %s\n' "${failures[@]}"; fi
  echo "python GPU suite: $passed passed, $failed failed"
} | tee "$logs/summary.txt"
[ "$failed" -eq 0 ]
