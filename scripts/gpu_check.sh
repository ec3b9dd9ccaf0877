#!/usr/bin/env bash
# The whole GPU check, on a GPU machine with no network whose python3 already has torch, torchvision, timm,
# transformers, pytest and pytest-timeout (no venv: the project is installed into that python3, without its deps).
#
#   OUT=/some/dir scripts/gpu_check.sh [lease5 | ... | lease10 | decode | decode2 | decode3 | env tests ... bench]
#                                                                                              # default: all six
#
# Where GPU time comes in short leases (say 15 minutes of device time, the machine's start included, each command
# at most 10 minutes), the check is a sequence of plans, each one command sized to fit; run them in this order
# (docs/gpu.md says what each measures and which have run). First, on a machine with network: scripts/gpu_wheels.sh
# (cachetools, FastAPI, uvicorn, for a GPU image that lacks them and has no network). Then each plan as one command on
# the GPU machine, with .whl/ copied beside the checkout (what it writes: scripts/gpu_ingest.py OUT PLAN --commit
# SHA); a lease runs an odd plan first, then at once, while the machine is warm, the even one after it. A
# configuration (model, batch, dtype) took 46-152 s with the modes below (an H200, 2026-11-28, the sum of its rows'
# mode_s: googlenet at batch 8 fp32 to nasnet_a_mobile at batch 1 fp32; max-autotune's segments compiled by Inductor
# add more, docs/gpu.md says how much where it was measured):
#   lease, lease2  (ran 2026-11-28) batch 8 fp16 and batch 1 fp32
#   lease3, lease4 (ran 2026-11-28, a second machine) every CUDA test; randwire at batch 8 fp16, nasnet_a_mobile and
#            randwire at batch 1 fp32, googlenet and inception_v3 at batch 8 fp32; then lease6 with a 175 s limit
#            (nasnet_a_mobile at batch 1 fp16 in part; randwire at batch 1 fp16 is now in lease7)
#   lease5   env, tests (every CUDA test: three failed on the last run and were fixed on the CPU), then the
#            configurations torch.compile won, again: googlenet and inception_v3 at batch 8 fp16, inception_v3 at
#            batch 8 fp32 (max-autotune's search now times its torch.compile candidate as the benchmark does, and
#            tries the first plan with Inductor's segments) (560 s)
#   lease6   right after: nasnet_a_mobile at batch 1 fp16 (230 s)
#   lease7   env, googlenet and inception_v3 at batch 1 fp16, randwire at batch 1 fp32 and fp16 (560 s)
#   lease8   right after: what a new input size costs on the GPU (squeezenet at batches 2-13, bert_base at 12
#            sequence lengths: one CUDA graph recorded per size on the plan built, against a steady call and against
#            a new build), then randwire at batch 8 fp32 (230 s)
#   lease9   per-op profiles of every zoo model at batch 1 fp32 and batch 8 fp16, the serving run on the GPU (TOP's
#            heuristic against static and batch, two patterns), torch.compile max-autotune as a second peer on two
#            models (560 s)
#   lease10  right after: nasnet_a_mobile at batch 8 fp32 (230 s)
#   decode   env, the decode step's CUDA tests (tests/test_llm.py: greedy generation on CUDA streams equal to
#            transformers'), then tokens/s of the two mixtures of experts (Mixtral- and Qwen2-MoE-style) at batch 1:
#            the model itself, torch.compile(mode="reduce-overhead") and the sequential CUDA Graph of the same step
#            against opweave's plan, and that plan with Inductor's segments, memory beside each
#            (benchmarks/decode.py --device cuda, results written after each model) (560 s)
#   decode2  right after: the mixtures of experts at batch 8, without Inductor's segments (300 s)
#   decode3  the dense Llama-style and the parallel-block GPT-J-style models at batch 1 and 8 (560 s)
# Every bench plan measures eager, the CUDA Graph, torch.compile, opweave's default and max-autotune, lios and heft.
# A plan's stages run with shorter limits than alone (below); a limit set in the environment wins. With more time,
# the stages one by one (each set meant to fit one 10-minute call):
#   env tests (~6 min) | more (~8 min) | trace profile (~4 min) | bench (--quick: ~8 min; BENCH_ARGS="..." for more)
#
# env      nvidia-smi, python/torch/CUDA/cuDNN versions, device properties, package versions, and that opweave and
#          its server import (the run stops here if `import opweave` fails: nothing after it could run)
# tests    the CUDA tests: pytest -m cuda tests/test_cuda.py, a per-test timeout, JUnit XML  -> $OUT/junit.xml
#          (--noconftest: tests/conftest.py imports hypothesis, a dev extra a GPU machine may lack)
# more     the other CUDA tests: Inductor segments inside the CUDA graph (tests/test_fuse.py), the serving engine's
#          CudaExecutor (tests/test_serve_cuda.py), the README's CUDA lines (tests/test_readme.py) -> $OUT/junit-more.xml
# trace    a real profiler trace of googlenet's ops (the CPU tests' fixture; copy it to tests/data/)
#                                                                          -> $OUT/googlenet-trace.json.gz
# profile  opweave profile for $PROFILE_MODELS (default googlenet and inception_v3; per-op GPU time and kernels)
#                                                                          -> $OUT/<model>.profile.json
# bench    benchmarks/gpu_latency.py $BENCH_ARGS (default --quick)          -> $OUT/<device>-<date>.json
# profiles per-op profiles of $PROFILE_MODELS (default: the zoo) at batch 1 fp32 and batch 8 fp16, one file
#                                                                          -> $OUT/profiles.json
# serve    benchmarks/serving.py --mode gpu on $SERVE_PATTERNS, TOP's heuristic against static and batch
#                                                                          -> $OUT/serving_gpu.json
# llm      the decode step's CUDA tests: pytest -k cuda tests/test_llm.py              -> $OUT/junit-llm.xml
# decode   benchmarks/decode.py --device cuda $DECODE_ARGS (default: every model at batch 1 and 8)
#                                                                          -> $OUT/decode_cuda.json, .md
# signatures benchmarks/new_signature.py --device cuda on $SIGNATURE_MODELS (default squeezenet and bert_base): a
#          new size's first call against a steady call, the plan built serving it (after) and a new build (before),
#          and with dynamic=True                                           -> $OUT/new_signature_cuda.json
#
# Wheels in .whl/ (carried) are installed into /tmp/site first and put on PYTHONPATH. Everything a stage prints goes
# to one log, $OUT/gpu_check.log (with a header per stage); at most 7 files come back, each well under 16 MiB, none
# in a subfolder. Every stage runs under its own time limit ($ENV_TIMEOUT_S, $TESTS_TIMEOUT_S, $MORE_TIMEOUT_S,
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
# The two plans of a 15-minute lease: their stages, and limits that add up to what the header says (the install
# and the stages' start-up fit in the margin). Limits already in the environment are kept.
FOUR=googlenet,inception_v3,nasnet_a_mobile,randwire
MODES="--schedulers lios,heft --fuse-schedulers none --opweave-modes default,max-autotune"
case "${stages[*]}" in
lease)  # ran 2026-11-28
    stages=(env tests bench)
    : "${ENV_TIMEOUT_S:=40}" "${TESTS_TIMEOUT_S:=150}" "${TEST_TIMEOUT_S:=60}" "${BENCH_TIMEOUT_S:=320}"
    : "${BENCH_ARGS:=--models $FOUR --batch-sizes 8 --dtypes fp16 $MODES}" ;;
lease2)  # ran 2026-11-28
    stages=(bench)
    : "${BENCH_TIMEOUT_S:=200}"
    : "${BENCH_ARGS:=--models $FOUR --batch-sizes 1 --dtypes fp32 --schedulers lios --fuse-schedulers none}" ;;
lease3)  # ran 2026-11-28
    stages=(env tests bench)
    : "${ENV_TIMEOUT_S:=40}" "${TESTS_TIMEOUT_S:=150}" "${TEST_TIMEOUT_S:=60}" "${BENCH_TIMEOUT_S:=340}"
    : "${BENCH_ARGS:=--configs randwire:8:fp16,nasnet_a_mobile:1:fp32,randwire:1:fp32 $MODES}" ;;
lease4)  # ran 2026-11-28
    stages=(bench)
    : "${BENCH_TIMEOUT_S:=215}"
    : "${BENCH_ARGS:=--configs googlenet:8:fp32,inception_v3:8:fp32 $MODES}" ;;
lease5)
    stages=(env tests bench)
    : "${ENV_TIMEOUT_S:=40}" "${TESTS_TIMEOUT_S:=150}" "${TEST_TIMEOUT_S:=60}" "${BENCH_TIMEOUT_S:=340}"
    : "${BENCH_ARGS:=--configs googlenet:8:fp16,inception_v3:8:fp16,inception_v3:8:fp32 $MODES}" ;;
lease6)
    stages=(bench)
    : "${BENCH_TIMEOUT_S:=215}"
    : "${BENCH_ARGS:=--configs nasnet_a_mobile:1:fp16 $MODES}" ;;
lease7)
    stages=(env bench)
    : "${ENV_TIMEOUT_S:=40}" "${BENCH_TIMEOUT_S:=490}"
    : "${BENCH_ARGS:=--configs googlenet:1:fp16,inception_v3:1:fp16,randwire:1:fp32,randwire:1:fp16 $MODES}" ;;
lease8)
    stages=(signatures bench)
    : "${SIGNATURES_TIMEOUT_S:=80}" "${BENCH_TIMEOUT_S:=145}"
    : "${BENCH_ARGS:=--configs randwire:8:fp32 $MODES}" ;;
lease9)
    stages=(env profiles serve bench)
    : "${ENV_TIMEOUT_S:=40}" "${PROFILES_TIMEOUT_S:=170}" "${SERVE_TIMEOUT_S:=180}" "${BENCH_TIMEOUT_S:=110}"
    : "${BENCH_ARGS:=--models googlenet,nasnet_a_mobile --batch-sizes 1 --dtypes fp32 --schedulers lios --fuse-schedulers none --opweave-modes none --torch-compile-modes reduce-overhead,max-autotune}" ;;
lease10)
    stages=(bench)
    : "${BENCH_TIMEOUT_S:=215}"
    : "${BENCH_ARGS:=--configs nasnet_a_mobile:8:fp32 $MODES}" ;;
decode)
    stages=(env llm decode)
    : "${ENV_TIMEOUT_S:=40}" "${LLM_TIMEOUT_S:=120}" "${DECODE_TIMEOUT_S:=390}"
    : "${DECODE_ARGS:=--models mixtral,qwen2_moe --batch-sizes 1 --stem decode_cuda_moe_b1}" ;;
decode2)
    stages=(decode)
    : "${DECODE_TIMEOUT_S:=290}"
    : "${DECODE_ARGS:=--models mixtral,qwen2_moe --batch-sizes 8 --stem decode_cuda_moe_b8 --modes eager,torch.compile,cuda-graph,opweave}" ;;
decode3)
    stages=(env decode)
    : "${ENV_TIMEOUT_S:=40}" "${DECODE_TIMEOUT_S:=500}"
    : "${DECODE_ARGS:=--models llama,gptj --batch-sizes 1,8 --stem decode_cuda_dense --modes eager,torch.compile,cuda-graph,opweave}" ;;
esac
for stage in "${stages[@]}"; do
    case $stage in env|tests|more|trace|profile|profiles|serve|signatures|bench|llm|decode) ;;
    *) echo "unknown stage $stage (env tests more trace profile profiles serve signatures bench llm decode, or one plan" \
            "alone: lease, lease2 ... lease10, decode, decode2, decode3)"; exit 2 ;;
    esac
done
status=0
summaries=()

# install ARGS...: pip install, quiet; when it fails, what it printed goes to the log and the run stops
install() {
    if ! python3 -m pip install -q "$@" >"$OUT/install.log" 2>&1; then
        tee -a "$LOG" <"$OUT/install.log"
        exit 1
    fi
    rm -f "$OUT/install.log"
}
if compgen -G ".whl/*.whl" >/dev/null; then  # carried wheels (scripts/gpu_wheels.sh): what the image lacks
    install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
install --no-deps --no-build-isolation -e .
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
        run "${ENV_TIMEOUT_S:-120}" bash -c 'nvidia-smi; echo "CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-unset}"
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
             "rich", "typer", "cachetools", "fastapi", "uvicorn", "onnxruntime"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
import opweave, opweave.serve.server  # every later stage needs the first, the README lines of lease2 the second
print("opweave", opweave.__version__, "and its server import")
PY'
        summary env $rc $((SECONDS - start)) "$(grep -m1 '^device ' "$LOG" | cut -c1-100)"
        [ $rc -ne 0 ] && break ;;  # no GPU, or opweave does not import: every later stage would fail the same way
    tests)
        run "${TESTS_TIMEOUT_S:-480}" python3 -m pytest -q -m cuda tests/test_cuda.py tests/test_serve_cuda.py tests/test_device_default.py \
            tests/test_fuse.py -p no:cacheprovider --noconftest \
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
        for model in ${PROFILE_MODELS:-googlenet inception_v3}; do
            run "${PROFILE_TIMEOUT_S:-180}" "${opweave[@]}" profile --model "$model" --device cuda \
                -o "$OUT/$model.profile.json"
            [ $rc -ne 0 ] && [ $worst -eq 0 ] && worst=$rc
        done
        facts=$(python3 - "$OUT" "${PROFILE_MODELS:-googlenet inception_v3}" <<'PY' 2>/dev/null
import json, sys
from pathlib import Path
parts = []
for model in sys.argv[2].split():
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
    profiles)
        run "${PROFILES_TIMEOUT_S:-300}" python3 - "$OUT/profiles.json" ${PROFILE_MODELS:-} <<'PY'
import json, sys, time
import torch
from opweave import zoo
from opweave.capture import load
from opweave.costs.profile import profile_model
out, models = sys.argv[1], sys.argv[2:] or zoo.names()
found = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "profiles": []}
for model in models:
    for batch, dtype in ((1, torch.float32), (8, torch.float16)):
        start = time.time()
        try:
            _, inputs, captured = load(model, batch_size=batch, device="cuda", dtype=dtype, coarsen=False)
            prof = profile_model(captured, inputs, device="cuda", repeats=10, warmup=3)
            found["profiles"].append({"model": model, "batch_size": batch, "dtype": str(dtype), **prof.to_dict()})
            print(f"{model} b{batch} {dtype}: {len(prof.latency_ms)} ops in {time.time() - start:.0f}s", flush=True)
        except Exception as exc:  # noqa: BLE001 - the others still run
            print(f"{model} b{batch} {dtype}: {type(exc).__name__}: {exc}", flush=True)
        json.dump(found, open(out, "w"))
PY
        summary profiles $rc $((SECONDS - start)) "$(grep -c ' ops in ' "$LOG") profiles" ;;
    serve)
        # shellcheck disable=SC2086 - SERVE_ARGS is a list of arguments
        run "${SERVE_TIMEOUT_S:-240}" python3 benchmarks/serving.py --mode gpu --policies heuristic,static,batch \
            --patterns "${SERVE_PATTERNS:-multi,squeezenet}" --no-search --duration 5 --repeats 1 --out "$OUT" \
            ${SERVE_ARGS:-}
        summary serve $rc $((SECONDS - start)) "$(ls "$OUT"/serving_gpu*.json 2>/dev/null | head -1)" ;;
    signatures)
        run "${SIGNATURES_TIMEOUT_S:-120}" python3 benchmarks/new_signature.py --device cuda \
            --models "${SIGNATURE_MODELS:-squeezenet,bert_base}" --rounds 1 --calls 3 --out "$OUT" \
            --stem new_signature_cuda
        summary signatures $rc $((SECONDS - start)) "$(ls "$OUT"/new_signature_cuda.json 2>/dev/null)" ;;
    llm)
        run "${LLM_TIMEOUT_S:-240}" python3 -m pytest -q -k cuda tests/test_llm.py -p no:cacheprovider --noconftest \
            --timeout "${TEST_TIMEOUT_S:-240}" --junitxml "$OUT/junit-llm.xml" -rfEs ${TESTS_ARGS:-}
        summary llm $rc $((SECONDS - start)) "$(junit_counts "$OUT/junit-llm.xml")" ;;
    decode)
        # shellcheck disable=SC2086 - DECODE_ARGS is a list of arguments
        run "${DECODE_TIMEOUT_S:-540}" python3 benchmarks/decode.py --device cuda ${DECODE_ARGS:-} --out "$OUT"
        facts=$(python3 - "$OUT" <<'PY' 2>/dev/null
import json, sys
from pathlib import Path
files = sorted(Path(sys.argv[1]).glob("decode_cuda*.json"), key=lambda p: p.stat().st_mtime)
if not files:
    print("no results JSON")
    raise SystemExit
rows = json.loads(files[-1].read_text())["results"]
by = {}
for r in rows:
    by.setdefault((r["model"], r["batch_size"]), {})[r["mode"]] = r
parts = []
for (model, batch), modes in by.items():
    ours, peer = modes.get("opweave", {}), modes.get("torch.compile", {})
    if "tokens_per_s" in ours and "tokens_per_s" in peer:
        parts.append(f"{model} b{batch}: {ours['tokens_per_s'] / peer['tokens_per_s']:.2f}x torch.compile"
                     f"{'' if ours.get('tokens_equal') else ' (tokens differ)'}")
    else:
        parts.append(f"{model} b{batch}: " + ", ".join(f"{m} {r.get('error', 'no timing')[:60]}"
                                                      for m, r in modes.items() if "tokens_per_s" not in r))
print(f"{files[-1].name}: " + "; ".join(parts))
PY
)
        summary decode $rc $((SECONDS - start)) "$facts" ;;
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
