"""An LLM's decode step: opweave's compiled step against the model itself, torch.compile and the sequential CUDA Graph
of the same step, in tokens per second; what the calibrated simulator predicts for it; and the check that the
generated tokens are eager's.

    python benchmarks/decode.py [--quick] [--parts time,predict,check] [--device cpu|cuda|fake]
                                [--models mixtral,qwen2_moe,llama,gptj] [--batch-sizes 1,8] [--prompt 16]
                                [--tokens 64] [--rounds 5] [--dtype fp32|fp16] [--out DIR]

The models are :mod:`opweave.llm.models` (random weights: Mixtral- and Qwen2-MoE-style mixtures of experts, a
Llama-style dense model, a GPT-J-style parallel block; 4 layers, hidden size 512; ``--quick``: their 2-layer,
hidden-64 versions, one model, fewer tokens and rounds). Every mode runs the same :class:`~opweave.llm.DecodeStep`
(its own static KV cache of ``prompt + tokens`` slots rounded up to 64) in the same greedy loop
(:func:`opweave.llm.greedy`: the prompt in one call, then one call per token).

**time** (``--device``): one generation of ``tokens`` tokens per batch row after a ``prompt``-token prompt, timed
end to end (prefill included), per mode, interleaved in ``rounds`` rounds after one untimed generation each (the
builds and compiles), medians and p10-p90 spread; tokens/s is batch x tokens over the median. Modes:

* ``eager``: the step uncompiled, the model itself;
* ``torch.compile``: ``torch.compile(step, mode="reduce-overhead", dynamic=False)`` on CUDA (CUDA Graph trees, the
  cache buffers marked static, as transformers marks its own), the default mode on the CPU; not on the fake runtime.
  ``cudagraph_skips`` counts the graphs torch.compile ran without a CUDA Graph;
* ``cuda-graph`` (CUDA): ``opweave.compile(step, scheduler="sequential")``, the step on one stream recorded into a
  CUDA Graph, eager's kernels in eager's order;
* ``opweave``: what :func:`opweave.generate` builds, the device's default (the CPU's race; on CUDA the calibrated
  simulator's pick of scheduler and streams, recorded into a CUDA Graph per signature);
* ``opweave-inductor`` (CUDA): the same plan with each stream segment compiled by Inductor (``compiler="inductor"``:
  fused kernels on the plan's streams, the cache writes between segments).

``--modes`` picks among them (default: those of the device).

``tokens_equal`` says whether a mode's tokens are eager's. On CUDA (and the fake runtime) ``held_mib`` is the memory a
mode holds once built (its cache, its graphs' pools) and ``peak_mib`` the most it held during a generation, both above
what was allocated before it was built. Writes ``decode_<device>.json`` and ``.md``.

**predict** (no device): per model, batch size (``--batch-sizes``) and dtype (fp32, fp16), the decode step (one
token at position ``prompt``, coarsened as ``opweave.compile`` plans it) priced on the fitted H200
(:mod:`opweave.costs.calibrated`), every scheduler at every stream cap replayed (:func:`opweave.pipeline.choose.choose`,
the CUDA default's choice), the best against the sequential plan, and what the gain is attributed to: in the best
plan's replay, each stretch of time in which k ops run at once credits each of them (k - 1)/k of it (what running
them one after another would have added), summed by the role of the module the op belongs to (routed experts, shared
expert, router, Q/K/V projections, attention, MLP, other) and scaled to the predicted gain. Writes
``decode_predict.json`` and ``.md``.

**check**: per model and batch size (1 and 4 unless ``--batch-sizes``), ``opweave.generate`` on the CPU default and
on CUDA streams on the fake runtime (a CUDA Graph per signature, kernels in a random order the events allow), each
against ``model.generate(..., do_sample=False)``: the tokens equal, every step's logits equal by
:func:`opweave.outputs.compare`, the cache writes in the validated plan. Writes ``decode_check.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common as common
import torch

from opweave.errors import first_line
from opweave.evaluate.bench import OtherWork, busy_warning, interleaved_times_ms, summarize, versus
from opweave.llm import Decoder, DecodeStep, greedy, models
from opweave.llm.decoding import CACHE_QUANTUM
from opweave.outputs import compare

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
MODES = {"cpu": ("eager", "torch.compile", "opweave"),
         "cuda": ("eager", "torch.compile", "cuda-graph", "opweave", "opweave-inductor"),
         "fake": ("eager", "cuda-graph", "opweave")}
MiB = 2**20


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny models, qwen2_moe alone, 8 tokens, 2 rounds")
    p.add_argument("--parts", default="time", help="comma list of time, predict, check (default %(default)s)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "fake"), help="where time runs")
    p.add_argument("--models", help=f"comma list of {', '.join(models.names())} (default: all)")
    p.add_argument("--batch-sizes", help="comma list (default: 1,8 for time and predict, 1,4 for check)")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens (default %(default)s)")
    p.add_argument("--tokens", type=int, help="tokens generated per row (default 64; --quick 8)")
    p.add_argument("--rounds", type=int, help="timed generations per mode (default 5; --quick 2)")
    p.add_argument("--dtype", default="fp32", choices=tuple(DTYPES), help="the models' dtype for time")
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    p.add_argument("--modes", help="comma list of modes for time (default: those of the device, module docstring)")
    p.add_argument("--stem", help="name of time's files (default decode_<device>, _quick with --quick)")
    args = p.parse_args()
    args.parts = common.split_names(args.parts, ("time", "predict", "check"), "part")
    args.models = common.split_names(args.models, models.names(), "model") or (
        ["qwen2_moe"] if args.quick else models.names())
    args.modes = common.split_names(args.modes, MODES["cuda"], "mode") or list(MODES[args.device])
    args.tokens = args.tokens or (8 if args.quick else 64)
    args.rounds = args.rounds or (2 if args.quick else 5)
    return args


def batch_sizes(args: argparse.Namespace, default: tuple[int, ...]) -> list[int]:
    if args.batch_sizes:
        return [int(b) for b in args.batch_sizes.split(",")]
    return [default[0]] if args.quick else list(default)


def prompt(rows: int, tokens: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, tokens), generator=torch.Generator().manual_seed(0))


def cache_len(args: argparse.Namespace) -> int:
    return CACHE_QUANTUM * math.ceil((args.prompt + args.tokens) / CACHE_QUANTUM)


# ---- time -----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Mode:
    """A way to run the step: ``run(ids, start) -> logits`` and ``issue`` for the loop's own work, once built."""

    name: str
    run: Callable[[torch.Tensor, int], torch.Tensor]
    issue: Callable[..., Any] | None = None
    build_s: float = 0.0
    extra: dict = dataclasses.field(default_factory=dict)


def eager_mode(model, rows: int, slots: int, name: str = "eager", wrap=None) -> Mode:
    step = DecodeStep(model, rows, slots).eval()
    positions = torch.arange(slots, device=step.device)
    fn = wrap(step) if wrap is not None else step

    def run(ids: torch.Tensor, start: int) -> torch.Tensor:
        with torch.no_grad():
            return fn(ids, positions[start:start + ids.shape[1]])

    mode = Mode(name, run)
    mode.extra["step"] = step
    return mode


def compiled_mode(model, rows: int, slots: int, device: str) -> Mode:
    def wrap(step):
        for name in step.opweave_state:  # static addresses: a CUDA Graph may write the cache in place
            torch._dynamo.mark_static_address(getattr(step, name))
        mode = "reduce-overhead" if device == "cuda" else "default"
        return torch.compile(step, mode=mode, dynamic=False)

    return eager_mode(model, rows, slots, "torch.compile", wrap)


def opweave_mode(model, rows: int, slots: int, name: str, **options) -> Mode:
    decoder = Decoder(model, rows, slots, **options)
    mode = Mode(name, decoder, decoder.issue)
    mode.extra["decoder"] = decoder
    return mode


def memory(args: argparse.Namespace, runtime) -> Any:
    """The allocator's statistics where time runs: torch.cuda, the fake runtime, or none on the CPU."""
    if args.device == "cuda":
        return torch.cuda
    return runtime if args.device == "fake" else None


def time_config(name: str, rows: int, args: argparse.Namespace) -> list[dict]:
    """Every mode of one model and batch size (module docstring, time)."""
    runtime = None
    if args.device == "fake":
        from opweave.testing import FakeCuda

        runtime = FakeCuda(seed=0)
    device = "cuda" if args.device == "cuda" else "cpu"
    model = models.create(name, tiny=args.quick).to(device, DTYPES[args.dtype])
    ids = prompt(rows, args.prompt, model.config.vocab_size).to(device)
    slots = cache_len(args)
    mem = memory(args, runtime)
    sync = (runtime.synchronize if runtime is not None else torch.cuda.synchronize if device == "cuda"
            else lambda: None)
    options: dict[str, Any] = {"runtime": runtime} if runtime is not None else {"device": device}
    every: dict[str, Callable[[], Mode]] = {
        "eager": lambda: eager_mode(model, rows, slots),
        "torch.compile": lambda: compiled_mode(model, rows, slots, device),
        "cuda-graph": lambda: opweave_mode(model, rows, slots, "cuda-graph", scheduler="sequential", **options),
        "opweave": lambda: opweave_mode(model, rows, slots, "opweave", **options),
        "opweave-inductor": lambda: opweave_mode(model, rows, slots, "opweave-inductor", compiler="inductor",
                                                 **options)}
    builders = {label: every[label] for label in args.modes}
    modes, rows_out, tokens = {}, [], {}
    for label, build in builders.items():
        before = mem.memory_allocated() if mem is not None else 0
        start = time.perf_counter()
        try:
            mode = build()
            out = greedy(mode.run, ids, args.tokens, issue=mode.issue)  # compiles what compiles at its first call
            sync()
        except Exception as exc:  # noqa: BLE001 - a mode that cannot run is a row that says why
            rows_out.append({"model": name, "batch_size": rows, "mode": label, "error": first_line(exc, 300)})
            continue
        mode.build_s = time.perf_counter() - start
        tokens[label] = out
        if mem is not None:
            held = mem.memory_allocated() - before
            mem.reset_peak_memory_stats()
            greedy(mode.run, ids, args.tokens, issue=mode.issue)
            sync()
            mode.extra["memory"] = {"held_mib": round(held / MiB, 3),
                                    "peak_mib": round((mem.max_memory_allocated() - before) / MiB, 3)}
        modes[label] = mode

    def generation(mode: Mode) -> Callable[[], object]:
        def call() -> None:
            greedy(mode.run, ids, args.tokens, issue=mode.issue)
            sync()
        return call

    with OtherWork() as other:
        times = interleaved_times_ms({label: generation(m) for label, m in modes.items()}, runs=args.rounds,
                                     warmup=1, rounds=args.rounds, device="cuda" if args.device == "cuda" else "cpu")
    skips = None
    if "torch.compile" in modes:
        from torch._dynamo.utils import counters

        skips = sum(counters["inductor"].get(k, 0) for k in ("cudagraph_skips",))
    base = summarize(times["eager"]) if "eager" in times else None
    for label, mode in modes.items():
        stats = summarize(times[label])
        row = {"model": name, "batch_size": rows, "mode": label, "build_s": round(mode.build_s, 2),
               **{k: round(v, 3) for k, v in stats.items()},
               "tokens_per_s": round(rows * args.tokens / (stats["median_ms"] / 1e3), 1),
               "tokens_equal": bool(torch.equal(tokens[label].cpu(), tokens["eager"].cpu())) if "eager" in tokens
               else None, **mode.extra.get("memory", {})}
        if base is not None and label != "eager":
            row["vs_eager"] = versus(base, stats)
        if label == "torch.compile":
            row["cudagraph_skips"] = skips
        decoder = mode.extra.get("decoder")
        if decoder is not None:
            compiled = decoder.compiled
            row["plan"] = _plan_label(compiled)
        rows_out.append(row)
    for row in rows_out:
        row["others_cpu_share"] = other.share
    for mode in modes.values():
        if "decoder" in mode.extra:
            mode.extra["decoder"].close()
    return rows_out


def _plan_label(compiled) -> str:
    choice = compiled.choice or {}
    label = choice.get("label") or compiled.schedule.scheduler
    return f"{label} ({compiled.schedule.streams_used} streams)"


def time_markdown(data: dict) -> str:
    lines = [f"Device: {data['device']}, {data['dtype']}, prompt {data['prompt']} tokens, {data['tokens']} generated "
             f"per row, {data['rounds']} timed generations per mode (interleaved).", "",
             "| model | batch | mode | tokens/s | median ms | spread | vs eager | tokens equal | plan | held MiB | "
             "peak MiB | build s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in data["results"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['batch_size']} | {r['mode']} | error: {r['error'][:80]} |"
                         + " |" * 8)
            continue
        vs = r.get("vs_eager")
        ratio = "" if vs is None else f"{vs['speedup']:.2f}x" + (" (within spread)" if vs["within_spread"] else "")
        held, peak = r.get("held_mib"), r.get("peak_mib")
        lines.append(f"| {r['model']} | {r['batch_size']} | {r['mode']} | {r['tokens_per_s']:.1f} | "
                     f"{r['median_ms']:.1f} | {r['spread_pct']:.0f}% | {ratio} | {r['tokens_equal']} | "
                     f"{r.get('plan', '')} | {'' if held is None else f'{held:.2f}'} | "
                     f"{'' if peak is None else f'{peak:.2f}'} | {r['build_s']:.1f} |")
    if data.get("warning"):
        lines += ["", f"Warning: {data['warning']}"]
    return "\n".join(lines) + "\n"


def run_time(args: argparse.Namespace) -> None:
    """Every model and batch size, the files written again after each (a run stopped midway keeps what it timed)."""
    from opweave.evaluate.bench import BUSY_SHARE, load_average

    results: list[dict] = []
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    stem = args.stem or f"decode_{args.device}" + ("_quick" if args.quick else "")
    for rows in batch_sizes(args, (1, 8)):  # every model at the first batch size first
        for name in args.models:
            common.console.print(f"time: {name} batch {rows} on {args.device}")
            results += time_config(name, rows, args)
            shares = [r["others_cpu_share"] for r in results if r.get("others_cpu_share") is not None]
            share = max(shares) if shares else None
            warning = busy_warning(share, load_average()) if share is not None and share > BUSY_SHARE else None
            data = {"machine": common.machine_info(), "device": device, "dtype": args.dtype, "prompt": args.prompt,
                    "tokens": args.tokens, "rounds": args.rounds, "quick": args.quick, "warning": warning,
                    "results": results}
            common.write_json(args.out / f"{stem}.json", data, quiet=True)
            (args.out / f"{stem}.md").write_text(time_markdown(data))
    common.console.print(f"wrote {args.out / stem}.json and .md")
    common.console.print(time_markdown(data))


# ---- predict --------------------------------------------------------------------------------------------------------
ROLES = (("shared_expert", "shared expert"), ("experts", "routed experts"), ("q_proj", "Q/K/V projections"),
         ("k_proj", "Q/K/V projections"), ("v_proj", "Q/K/V projections"))


def role(path: str) -> str:
    """The role of the module at ``path`` (a module path of the step) in a decoder layer."""
    parts = path.split(".")
    for key, name in ROLES:
        if any(p.startswith(key) for p in parts):
            return name
    if parts[-1] in ("gate", "router") and "mlp" in parts or "block_sparse_moe" in parts:
        return "router"
    if any(p in ("self_attn", "attn", "attention") for p in parts):
        return "attention"
    if any(p in ("mlp", "feed_forward") for p in parts):
        return "MLP"
    return "other"


def attribute(captured, sim) -> dict[str, float]:
    """Per role, the share of the time saved by running ops side by side in the replay ``sim`` (module docstring)."""
    events = sorted({t for op in sim.start_ms for t in (sim.start_ms[op], sim.finish_ms[op])})
    credit: dict[str, float] = {}
    roles = {}
    for op, group in captured.nodes.items():
        stack = group[0].meta.get("nn_module_stack") or {}
        roles[op] = role(list(stack.values())[-1][0]) if stack else "other"
    for a, b in zip(events, events[1:], strict=False):
        running = [op for op in sim.start_ms if sim.start_ms[op] <= a and sim.finish_ms[op] >= b and b > a]
        if len(running) < 2:
            continue
        for op in running:
            credit[roles[op]] = credit.get(roles[op], 0.0) + (b - a) * (len(running) - 1) / len(running)
    total = sum(credit.values())
    return {k: v / total for k, v in sorted(credit.items(), key=lambda kv: -kv[1])} if total else {}


def predict_config(name: str, rows: int, dtype: str, args: argparse.Namespace, dev) -> dict:
    from opweave.backends.simulate import simulate
    from opweave.capture import capture, coarsen
    from opweave.costs import calibrated
    from opweave.pipeline.choose import choose, sync_options
    from opweave.plan.make import plan_for

    step = DecodeStep(models.create(name, tiny=args.quick), rows, cache_len(args)).eval()
    captured = coarsen(capture(step, (torch.zeros(rows, 1, dtype=torch.long), torch.tensor([args.prompt]))))
    graph = captured.graph
    costs = calibrated.costs(graph, dev, dtype)
    choice = choose(graph, costs, dev, dtype=dtype)
    sequential = next(p for p in choice.predictions if p.scheduler == "sequential")
    ideal = dataclasses.replace(costs, model="ideal")
    _, plan = plan_for(graph, ideal, choice.scheduler, streams=choice.streams, **sync_options(choice.scheduler, dev))
    replay = calibrated.costs(graph, dev, dtype, latency_ms=costs.latency_ms, launches=costs.kernels)
    sim = simulate(graph, plan, replay)
    gain_us = 1e3 * (sequential.makespan_ms - choice.makespan_ms)
    shares = attribute(captured, sim)
    return {"model": name, "batch_size": rows, "dtype": dtype, "ops": len(graph),
            "cache_writes": len(captured.state_writes()), "sequential_ms": round(sequential.makespan_ms, 4),
            "best": f"{choice.scheduler}/{choice.streams}", "streams_used": next(
                p.streams_used for p in choice.predictions if (p.scheduler, p.streams) == (choice.scheduler,
                                                                                           choice.streams)),
            "best_ms": round(choice.makespan_ms, 4),
            "speedup_vs_sequential": round(sequential.makespan_ms / choice.makespan_ms, 3),
            "gain_us": round(gain_us, 2),
            "attributed_us": {k: round(v * gain_us, 2) for k, v in shares.items()}}


def predict_markdown(data: dict) -> str:
    lines = [f"Predicted decode-step time (one token, cache of {data['slots']} slots) on the fitted {data['device']}, "
             "the CUDA default's pick against the sequential plan; the gain attributed by role (module docstring).",
             "", "| model | batch | dtype | sequential ms | best plan | predicted ms | speed-up | gain attributed to |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in data["results"]:
        parts = ", ".join(f"{k} {v:.1f} us" for k, v in list(r["attributed_us"].items())[:3])
        lines.append(f"| {r['model']} | {r['batch_size']} | {r['dtype']} | {r['sequential_ms']:.3f} | {r['best']} "
                     f"({r['streams_used']} streams) | {r['best_ms']:.3f} | {r['speedup_vs_sequential']:.2f}x | "
                     f"{parts} |")
    return "\n".join(lines) + "\n"


def run_predict(args: argparse.Namespace) -> None:
    from opweave.costs import calibrated

    dev = calibrated.device("h200")
    results = []
    for name in args.models:
        for rows in batch_sizes(args, (1, 8)):
            for dtype in (("float32",) if args.quick else ("float32", "float16")):
                common.console.print(f"predict: {name} batch {rows} {dtype}")
                results.append(predict_config(name, rows, dtype, args, dev))
    data = {"machine": common.machine_info(), "device": dev.name, "slots": cache_len(args), "quick": args.quick,
            "results": results}
    stem = "decode_predict" + ("_quick" if args.quick else "")
    common.write_json(args.out / f"{stem}.json", data)
    (args.out / f"{stem}.md").write_text(predict_markdown(data))
    common.console.print(predict_markdown(data))


# ---- check ----------------------------------------------------------------------------------------------------------
def check_config(name: str, rows: int, where: str, args: argparse.Namespace) -> dict:
    """``opweave.generate`` against transformers' greedy generation (module docstring, check)."""
    import opweave
    from opweave.llm.decoding import decoder
    from opweave.plan.validate import validate
    from opweave.testing import FakeCuda

    model = models.create(name, tiny=args.quick)
    ids = prompt(rows, args.prompt, model.config.vocab_size)
    row: dict[str, Any] = {"model": name, "batch_size": rows, "device": where}
    start = time.perf_counter()
    try:
        with torch.no_grad():
            want = model.generate(ids, max_new_tokens=args.tokens, do_sample=False, output_scores=True,
                                  return_dict_in_generate=True)
        runtime = FakeCuda(seed=rows) if where == "fake cuda" else None
        options: dict[str, Any] = {"runtime": runtime} if runtime is not None else {"device": "cpu"}
        got, logits = opweave.generate(model, ids, args.tokens, return_logits=True, **options)
        if runtime is not None:
            runtime.synchronize()
        compiled = decoder(model, rows, cache_len(args), **options).compiled
        validate(compiled.graph, compiled.plan, compiled.schedule)
        writers = compiled.captured.state_writes()
        verdicts = [compare(w, g) for w, g in zip(want.scores, logits, strict=True)]
        row.update({"plan": _plan_label(compiled), "cache_writes": len(writers),
                    "cache_edges": sum(len(compiled.graph.succs[w]) for w in writers if w in compiled.graph.succs),
                    "tokens_equal": bool(torch.equal(got, want.sequences)),
                    "logits_equal": all(v.ok for v in verdicts),
                    "logits_max_relative": max(v.relative for v in verdicts)})
        row["ok"] = row["tokens_equal"] and row["logits_equal"] and len(writers) > 0
    except Exception as exc:  # noqa: BLE001 - a configuration that cannot run is a row that says why
        row["error"] = first_line(exc, 300)
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def check_markdown(data: dict) -> str:
    lines = [f"opweave.generate against model.generate(do_sample=False): prompt {data['prompt']} tokens, "
             f"{data['tokens']} generated per row.", "",
             "| model | batch | device | plan | cache writes | tokens equal | logits equal (largest relative) | ok |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in data["results"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['batch_size']} | {r['device']} | error: {r['error'][:100]} | | | | no |")
            continue
        lines.append(f"| {r['model']} | {r['batch_size']} | {r['device']} | {r['plan']} | {r['cache_writes']} | "
                     f"{r['tokens_equal']} | {r['logits_equal']} ({r['logits_max_relative']:.1e}) | "
                     f"{'yes' if r['ok'] else 'no'} |")
    return "\n".join(lines) + "\n"


def run_check(args: argparse.Namespace) -> None:
    results = []
    for name in args.models:
        for rows in batch_sizes(args, (1, 4)):
            for where in ("cpu", "fake cuda"):
                common.console.print(f"check: {name} batch {rows} on {where}")
                results.append(check_config(name, rows, where, args))
    data = {"machine": common.machine_info(), "prompt": args.prompt, "tokens": args.tokens, "quick": args.quick,
            "results": results}
    stem = "decode_check" + ("_quick" if args.quick else "")
    common.write_json(args.out / f"{stem}.json", data)
    (args.out / f"{stem}.md").write_text(check_markdown(data))
    common.console.print(check_markdown(data))
    if not all(r.get("ok") for r in results):
        raise SystemExit("decode check failed: " + "; ".join(
            f"{r['model']} b{r['batch_size']} {r['device']}" for r in results if not r.get("ok")))


def main() -> None:
    args = parse()
    if "check" in args.parts:
        run_check(args)
    if "predict" in args.parts:
        run_predict(args)
    if "time" in args.parts:
        run_time(args)


if __name__ == "__main__":
    main()
