#!/usr/bin/env bash
# The whole GPU check, on a GPU machine with no network whose python3 already has torch, torchvision, timm,
# transformers, pytest and pytest-timeout (no venv: the project is installed into that python3, without its deps).
#
#   OUT=/some/dir scripts/gpu_check.sh [env] [tests] [more] [trace] [profile] [bench]   # default: all six, in order
#
# A device call is limited to 10 minutes, so run it in four calls, e.g.
#   OUT=$OUT scripts/gpu_check.sh env tests        (~6 min)
#   OUT=$OUT scripts/gpu_check.sh more             (~8 min)
#   OUT=$OUT scripts/gpu_check.sh trace profile    (~4 min)
#   OUT=$OUT scripts/gpu_check.sh bench            (--quick: ~8 min; BENCH_ARGS="..." for more)
#
# env      nvidia-smi, python/torch/CUDA/cuDNN versions, device properties, package versions
# tests    the CUDA tests: pytest -m cuda tests/test_cuda.py, a per-test timeout, JUnit XML  -> $OUT/junit.xml
#          (--noconftest: tests/conftest.py imports hypothesis, a dev extra the GPU machine may lack)
# more     the other CUDA tests: Inductor segments inside the CUDA graph (tests/test_fuse.py), the serving engine's
#          CudaExecutor (tests/test_serve_cuda.py), the README's CUDA lines (tests/test_readme.py) -> $OUT/junit-more.xml
# trace    a real profiler trace of googlenet's ops (the CPU tests' fixture; copy it to tests/data/)
#                                                                          -> $OUT/googlenet-trace.json.gz
# profile  opweave profile for googlenet and inception_v3 (per-op GPU time and kernels)
#                                                                          -> $OUT/<model>.profile.json
# bench    benchmarks/gpu_latency.py $BENCH_ARGS (default --quick)          -> $OUT/<device>-<date>.json
#
# Everything a stage prints goes to one log, $OUT/gpu_check.log (with a header per stage); at most 7 files come
# back, each well under 16 MiB, none in a subfolder. Every stage runs under its own time limit ($TESTS_TIMEOUT_S,
# $TRACE_TIMEOUT_S, $PROFILE_TIMEOUT_S per model, $BENCH_TIMEOUT_S) so that what was measured comes back even when
# a stage runs long, and ends with one summary line on stdout (also at the end of the log). The exit status is the
# first failing stage's.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
export PYTHONUNBUFFERED=1
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(env tests more trace profile bench)
for stage in "${stages[@]}"; do
    case $stage in env|tests|more|trace|profile|bench) ;;
    *) echo "unknown stage $stage (env tests more trace profile bench)"; exit 2 ;;
    esac
done
status=0
summaries=()

if ! python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1; then
    cat "$OUT/install.log" | tee -a "$LOG"
    exit 1
fi
rm -f "$OUT/install.log"
if command -v opweave >/dev/null 2>&1; then opweave=(opweave); else opweave=(python3 -c "from opweave.cli import app; app()"); fi

# run LIMIT_S COMMAND...: the command under a time limit, its output appended to the log; sets rc. The limit sends
# SIGINT, not SIGTERM: pytest then stops as on Ctrl-C, printing its summary of failures and writing its JUnit file.
run() {
    local limit=$1
    shift
    timeout -s INT -k 15 "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then echo "(stopped after ${limit}s)" >>"$LOG"; fi
    return $rc
}

# summary STAGE RC SECONDS TEXT: one line to stdout and the log
summary() {
    local verdict=ok
    [ "$2" -ne 0 ] && verdict="FAILED (exit $2)"
    [ "$2" -eq 124 ] || [ "$2" -eq 137 ] && verdict="TIMED OUT"
    local line="== $1: $verdict in ${3}s${4:+ | $4}"
    summaries+=("$line")
    echo "$line" | tee -a "$LOG"
    [ "$2" -ne 0 ] && [ $status -eq 0 ] && status=$2
    return 0
}

# junit_counts FILE: "N passed, F failed, E errors, S skipped of T" from a JUnit XML file
junit_counts() {
    python3 - "$1" <<'PY' 2>/dev/null || echo "no JUnit file"
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
s = root if root.tag == "testsuite" else root.find("testsuite")
n, f, e, k = (int(s.get(a, 0)) for a in ("tests", "failures", "errors", "skipped"))
print(f"{n - f - e - k} passed, {f} failed, {e} errors, {k} skipped of {n}")
PY
}

for stage in "${stages[@]}"; do
    printf '\n######## %s (%s UTC)\n' "$stage" "$(date -u +%H:%M:%S)" >>"$LOG"
    start=$SECONDS
    case $stage in
    env)
        run 120 bash -c 'nvidia-smi; echo "CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-unset}"
python3 - <<"PY"
import importlib.metadata as md, platform, torch
p = torch.cuda.get_device_properties(0)
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "cudnn", torch.backends.cudnn.version())
print("device", p.name, "SMs", p.multi_processor_count, "memory GiB", round(p.total_memory / 2**30, 1),
      "capability", f"{p.major}.{p.minor}")
import torch._inductor.graph as ig, torch._inductor.scheduler as isch  # backends/segments.py: "2.11 lacks it"
print("inductor stream annotations", hasattr(isch.Scheduler, "_populate_stream_assignments")
      and hasattr(ig.GraphLowering, "_get_node_stream"))
for name in ("torchvision", "timm", "transformers", "pytest", "pytest-timeout", "hypothesis", "numpy", "networkx",
             "rich", "typer"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
PY'
        summary env $rc $((SECONDS - start)) "$(grep -m1 '^device ' "$LOG" | cut -c1-100)" ;;
    tests)
        run "${TESTS_TIMEOUT_S:-480}" python3 -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider --noconftest \
            --timeout "${TEST_TIMEOUT_S:-240}" --junitxml "$OUT/junit.xml" -rfEs ${TESTS_ARGS:-}
        summary tests $rc $((SECONDS - start)) "$(junit_counts "$OUT/junit.xml")" ;;
    more)
        run "${MORE_TIMEOUT_S:-540}" python3 -m pytest -q -m cuda tests/test_fuse.py tests/test_serve_cuda.py \
            tests/test_readme.py -p no:cacheprovider --noconftest --timeout "${TEST_TIMEOUT_S:-240}" \
            --junitxml "$OUT/junit-more.xml" -rfEs ${TESTS_ARGS:-}
        summary more $rc $((SECONDS - start)) "$(junit_counts "$OUT/junit-more.xml")" ;;
    trace)
        run "${TRACE_TIMEOUT_S:-150}" python3 scripts/dump_trace.py googlenet "$OUT/googlenet-trace.json.gz"
        summary trace $rc $((SECONDS - start)) "$(grep '^wrote .*googlenet-trace' "$LOG" | tail -1 | cut -c1-160)" ;;
    profile)
        worst=0
        for model in googlenet inception_v3; do
            run "${PROFILE_TIMEOUT_S:-180}" "${opweave[@]}" profile --model "$model" --device cuda \
                -o "$OUT/$model.profile.json"
            [ $rc -ne 0 ] && [ $worst -eq 0 ] && worst=$rc
        done
        facts=$(python3 - "$OUT" <<'PY' 2>/dev/null
import json, sys
from pathlib import Path
parts = []
for model in ("googlenet", "inception_v3"):
    path = Path(sys.argv[1]) / f"{model}.profile.json"
    if not path.exists():
        parts.append(f"{model}: none")
        continue
    p = json.loads(path.read_text())
    lat = p["latency_ms"]
    parts.append(f"{model}: {len(lat)} ops, {sum(v > 0 for v in lat.values())} with GPU work, "
                 f"sum {sum(lat.values()):.3f} ms")
print("; ".join(parts))
PY
)
        summary profile $worst $((SECONDS - start)) "$facts" ;;
    bench)
        # shellcheck disable=SC2086 - BENCH_ARGS is a list of arguments
        run "${BENCH_TIMEOUT_S:-540}" python3 benchmarks/gpu_latency.py ${BENCH_ARGS:---quick} --out "$OUT"
        facts=$(python3 - "$OUT" <<'PY' 2>/dev/null
import json, sys
from pathlib import Path
files = sorted(Path(sys.argv[1]).glob("*-20*.json"))
if not files:
    print("no results JSON")
    raise SystemExit
data = json.loads(files[-1].read_text())
bad = sum(1 for r in data["results"] if "error" in r or not r.get("ok", True))
best = [f"{s['model']} b{s['batch_size']} {s['dtype']}: {s['best_scheduler']} "
        f"{s['speedup_vs_cuda_graph'] or 0:.2f}x vs graph" for s in data["summaries"]]
print(f"{files[-1].name}: {len(data['results'])} rows, {bad} failed or wrong; " + "; ".join(best))
PY
)
        summary bench $rc $((SECONDS - start)) "$facts" ;;
    esac
done
printf '\n######## summary\n' >>"$LOG"
printf '%s\n' "${summaries[@]}" >>"$LOG"
exit $status
