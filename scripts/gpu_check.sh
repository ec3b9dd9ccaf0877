#!/usr/bin/env bash
# The whole GPU check in one or two long calls on a GPU machine with no network, whose python3 already has torch,
# torchvision, timm, transformers, pytest and pytest-timeout (no venv: the project is installed into that python3).
#
#   OUT=/some/dir scripts/gpu_check.sh [env] [tests] [trace] [bench]     # default: all four, in that order
#
# env    nvidia-smi, torch/CUDA versions, device properties            -> $OUT/env.txt
# tests  the CUDA tests (pytest -m cuda, per-test timeout, JUnit XML)   -> $OUT/tests.log, $OUT/junit.xml
# trace  a real profiler trace of googlenet's ops (CPU-test fixture)    -> $OUT/googlenet-trace.json.gz
# bench  benchmarks/gpu_latency.py with $BENCH_ARGS (default --quick)   -> $OUT/bench.log, $OUT/<device>-<date>.json
#
# Each stage's wall time is bounded ($TESTS_TIMEOUT_S, $BENCH_TIMEOUT_S) so that what was measured comes back even
# when a stage runs long. The exit status is the first failing stage's.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(env tests trace bench)
status=0

python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
    || { cat "$OUT/install.log"; exit 1; }
rm -f "$OUT/install.log"

for stage in "${stages[@]}"; do
    echo "== $stage ($(date -u +%H:%M:%S))"
    case $stage in
    env)
        { date -u; nvidia-smi; python3 - <<'PY'
import platform, torch
p = torch.cuda.get_device_properties(0)
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "cudnn", torch.backends.cudnn.version())
print("device", p.name, "SMs", p.multi_processor_count, "memory GiB", round(p.total_memory / 2**30, 1),
      "capability", f"{p.major}.{p.minor}")
PY
        } >"$OUT/env.txt" 2>&1 || status=1
        tail -3 "$OUT/env.txt" ;;
    tests)
        timeout "${TESTS_TIMEOUT_S:-420}" python3 -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider \
            --timeout "${TEST_TIMEOUT_S:-180}" --junitxml "$OUT/junit.xml" -rfE ${TESTS_ARGS:-} \
            >"$OUT/tests.log" 2>&1
        rc=$?; [ $rc -ne 0 ] && [ $status -eq 0 ] && status=$rc
        tail -25 "$OUT/tests.log" ;;
    trace)
        python3 scripts/dump_trace.py googlenet "$OUT/googlenet-trace.json.gz" || { [ $status -eq 0 ] && status=1; } ;;
    bench)
        # shellcheck disable=SC2086 - BENCH_ARGS is a list of arguments
        timeout "${BENCH_TIMEOUT_S:-420}" python3 benchmarks/gpu_latency.py ${BENCH_ARGS:---quick} --out "$OUT" \
            >"$OUT/bench.log" 2>&1
        rc=$?; [ $rc -ne 0 ] && [ $status -eq 0 ] && status=$rc
        tail -60 "$OUT/bench.log" ;;
    *) echo "unknown stage $stage (env, tests, trace, bench)"; exit 2 ;;
    esac
done
exit $status
