"""What the calibrated simulator predicts on the GPU: every scheduler's plan against the sequential CUDA Graph, per
model, batch size and dtype, where the GPU has not measured it yet.

    .venv/bin/python benchmarks/sim_gpu_predict.py [--quick] [--models a,b] [--configs 1:fp32,8:fp16] [--preset h200]
                                                   [--streams 8]
                                                   [--out DIR]

Each configuration is one ``opweave simulate --model M --no-coarsen --cost-model gpu --preset P --batch-size B
--dtype D --streams 8 --json`` (the shipped fitted device, :mod:`opweave.costs.calibrated`; the graph captured one op
per fx node, as ``benchmarks/gpu_latency.py`` runs it). Beside each prediction at batch 1 fp32 stands what the H200
measured (``results/gpu_latency_h200_b1_fp32.json``), the configuration the device was fitted on.

Each configuration is simulated a second time over Inductor's kernels (``--inductor``: the model lowered here as
Inductor lowers it for CUDA, one op per group of ops that share a kernel, each priced on the fitted device with
Inductor's count of kernels), what ``opweave.compile(graph="inductor")`` plans on CUDA. Its best plan stands against
the same sequential CUDA Graph (eager's kernels). That prediction carries assumptions the device has not checked
yet: a convolution in Inductor's layout launches one kernel (against 1-3.45 in eager's), an Inductor kernel costs
the floor of its op's class, and the kernels that compute no op (BatchNorm's per-channel factors from its buffers,
``inductor.unowned``) are left out. Its kernels per call stand beside torch.compile's measured ones at batch 1 fp32
(the same lowering on the device). torch.compile itself is not predicted: on the H200 it measured 0.08-0.71 ms over
the sequential prediction over its own kernels (per-call work of its CUDA Graph trees that the fitted device does
not model); ``opweave.compile(mode="max-autotune")`` times it against the plans on the device and keeps the fastest.

Writes ``DIR/sim_gpu_predict.json`` (every configuration's rows and the best plan's predicted speed-up over the
sequential CUDA Graph) and ``DIR/sim_gpu_predict.md`` (one table).
"""

from __future__ import annotations

import json
import subprocess
import sys

import _common as common

MODELS = ("googlenet", "inception_v3", "nasnet_a_mobile", "randwire")
CONFIGS = ((1, "fp32"), (1, "fp16"), (8, "fp32"), (8, "fp16"))
MEASURED = common.RESULTS_DIR / "gpu_latency_h200_b1_fp32.json"


def predict(model: str, batch: int, dtype: str, preset: str, streams: int, inductor: bool = False) -> dict:
    """One ``opweave simulate --json`` run (module docstring)."""
    command = [sys.executable, "-m", "opweave", "simulate", "--model", model, "--no-coarsen", "--cost-model", "gpu",
               "--preset", preset, "--batch-size", str(batch), "--dtype", dtype, "--streams", str(streams), "--json",
               *(["--inductor"] if inductor else [])]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command[2:])}: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout)


def measured_b1_fp32() -> dict[str, dict]:
    """The H200's batch-1 fp32 summaries by model (best plan, its speed-up over the CUDA Graph), with the kernels per
    call torch.compile launched."""
    if not MEASURED.exists():
        return {}
    data = json.loads(MEASURED.read_text())
    kernels = {r["model"]: r["kernels_per_call"] for r in data["results"] if r["mode"] == "torch.compile"}
    return {s["model"]: {**s, "torch_compile_kernels": kernels.get(s["model"])} for s in data["summaries"]}


def fastest(run: dict) -> dict:
    """The fastest multi-stream row of one simulate run."""
    return min((r for r in run["results"] if r["scheduler"] != "sequential"), key=lambda r: r["makespan_ms"])


def markdown(data: dict) -> str:
    lines = ["| model | batch | dtype | sequential ms | best plan | predicted ms | predicted speed-up | measured | "
             "over Inductor's kernels | its speed-up | its kernels (torch.compile measured) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in data["summary"]:
        seen, fused = s.get("measured"), s.get("inductor")
        compiled = seen and seen.get("torch_compile_kernels")
        lines.append(f"| {s['model']} | {s['batch_size']} | {s['dtype']} | {s['sequential_ms']:.3f} | "
                     f"{s['best_scheduler']} | {s['best_ms']:.3f} | {s['speedup_vs_sequential']:.2f}x | "
                     + (f"{seen['best_scheduler']} {seen['speedup_vs_cuda_graph']:.2f}x" if seen else "") + " | "
                     + (f"{fused['best_scheduler']} {fused['best_ms']:.3f} | {fused['speedup_vs_sequential']:.2f}x | "
                        f"{fused['kernels_per_call']:.0f}" + (f" ({compiled:.0f})" if compiled else "")
                        if fused else " | | ") + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--configs", help="comma list of batch:dtype (default 1:fp32,1:fp16,8:fp32,8:fp16)")
    p.set_defaults(preset="h200")  # a fitted device
    args = p.parse_args(argv)
    models = args.models.split(",") if args.models else (["googlenet"] if args.quick else list(MODELS))
    configs = ([(int(b), d) for b, d in (c.split(":") for c in args.configs.split(","))] if args.configs
               else [(1, "fp32")] if args.quick else list(CONFIGS))
    measured = measured_b1_fp32() if args.preset == "h200" else {}
    results, summary = [], []
    for model in models:
        for batch, dtype in configs:
            run = predict(model, batch, dtype, args.preset, args.streams)
            sequential = next(r for r in run["results"] if r["scheduler"] == "sequential")
            best = fastest(run)
            fused = predict(model, batch, dtype, args.preset, args.streams, inductor=True)
            best_fused = fastest(fused)
            results.append({"model": model, "batch_size": batch, "dtype": dtype, **run, "over_inductor": fused})
            summary.append({"model": model, "batch_size": batch, "dtype": dtype,
                            "sequential_ms": sequential["makespan_ms"], "best_scheduler": best["scheduler"],
                            "best_ms": best["makespan_ms"],
                            "speedup_vs_sequential": sequential["makespan_ms"] / best["makespan_ms"],
                            "inductor": {"best_scheduler": best_fused["scheduler"],
                                         "best_ms": best_fused["makespan_ms"],
                                         "speedup_vs_sequential": sequential["makespan_ms"] / best_fused["makespan_ms"],
                                         "kernels_per_call": fused["kernels_per_call"],
                                         "unowned_kernels": (fused["inductor"] or {}).get("unowned")},
                            "measured": measured.get(model) if (batch, dtype) == (1, "fp32") else None})
            common.console.print(f"{model} batch {batch} {dtype}: {best['scheduler']} "
                                 f"{summary[-1]['speedup_vs_sequential']:.2f}x predicted; over Inductor's kernels "
                                 f"{best_fused['scheduler']} {summary[-1]['inductor']['speedup_vs_sequential']:.2f}x")
    settings = {"preset": args.preset, "streams": args.streams, "models": models,
                "configs": [list(c) for c in configs]}
    data = {"machine": common.machine_info(), "settings": settings,
            "results": results, "summary": summary}
    args.out.mkdir(parents=True, exist_ok=True)
    common.write_json(args.out / "sim_gpu_predict.json", data)
    (args.out / "sim_gpu_predict.md").write_text(markdown(data))
    common.console.print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
