"""What a new input size costs: its first call against a steady call of that size, before and after a compiled model
served other sizes with the plan it has built; and compiling at the example, across the zoo.

    .venv/bin/python benchmarks/new_signature.py [--models a,b] [--rounds 2] [--calls 5] [--device cpu]
                                                 [--dynamic-models squeezenet,bert_base] [--stem new_signature]
                                                 [--out DIR]
    .venv/bin/python benchmarks/new_signature.py --quick          # squeezenet and deepfm, one round, 3 sizes

For each model at batch 1 (bert_base: 2 layers at sequence 32), ``--rounds`` times, in a fresh compile each round:

* ``compile_s``: ``opweave.compile(model, inputs, device=DEVICE)`` with the defaults (on a CPU the default races
  its candidates, as a user's compile does), its later tiers off (``tiers=False``: the figures are a new size's, not
  those of an Inductor build running beside the sweep).
* **after** (what a compiled model does now): the sizes of :data:`SWEEPS` one after the other (squeezenet batches
  2-13, bert_base 12 sequence lengths, the other models batches 2-4), each first called once (``first_call_ms``,
  its output held against the model's), then, once what that call set going beside it is done (the plan's check at
  the new size: ``Compiled.wait``, ``settle_s``), ``--calls`` times (``steady_ms``, their median); ``ratio`` is the
  first over the steady call, ``median_ratio`` their median over the sizes, ``max_ratio`` the largest and
  ``first_size_ratio`` the first size's. Then the sweep again: ``builds_in_sweep`` counts the plans built over both
  sweeps (new captures and ranges of sizes planned again: none built twice when it does not grow in the second
  sweep), ``stats`` the compiled model's.
* **before** (what a new size cost until now: captured, planned and built again): a second compile that serves no
  size from its plan (``variants.sizes = None``: every new size goes to a build on the caller's thread), its first
  call at the sweep's first size and its steady calls there. Its steady call is that of a plan built for the size
  (on a CPU with ONNX Runtime, a session exported for that size), the after's one of a plan built for the example's
  (a session with free sizes): ``steady_interleaved`` times the two at that size, one call of each in turn.
* **dynamic=True** (``--dynamic-models``): a compile with ``dynamic=True`` and the same sweep (``dynamic_true``:
  its sizes, ``median_ratio``, ``max_ratio``, ``builds``).

Writes ``DIR/STEM.json`` and ``DIR/STEM.md``. The figures depend on the machine and on what else runs on it
(``machine.load_average_1_5_15m``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import _common as common

DEFAULT_MODELS = ("squeezenet", "deepfm", "bert_base", "resnet50", "googlenet", "inception_v3", "randwire",
                  "nasnet_a_mobile")
SMALL = {"bert_base": {"num_layers": 2, "seq_len": 32}}
SWEEPS = {"squeezenet": tuple(range(2, 14)),  # batches
          "bert_base": (64, 16, 24, 40, 48, 8, 12, 20, 28, 56, 96, 128)}  # sequence lengths (compiled at 32)
OTHERS = (2, 3, 4)  # batches, for the other models
QUICK = (2, 3, 5)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma list of zoo models")
    p.add_argument("--rounds", type=int, default=2, help="fresh compiles per model (default %(default)s)")
    p.add_argument("--calls", type=int, default=5, help="steady calls timed per size (default %(default)s)")
    p.add_argument("--dynamic-models", default="squeezenet,bert_base",
                   help="models also compiled with dynamic=True (default %(default)s)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default %(default)s)")
    p.add_argument("--stem", default="new_signature", help="file name without suffix (default %(default)s)")
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR, help="directory (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="squeezenet and deepfm, one round, 3 sizes, 3 calls")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.rounds, args.calls, args.dynamic_models = "squeezenet,deepfm", 1, 3, "squeezenet"
    return args


def sizes_of(name: str, args) -> tuple[int, ...]:
    return QUICK if args.quick else SWEEPS.get(name, OTHERS)


def inputs_at(name: str, inputs: tuple, size: int) -> tuple:
    """``inputs`` at ``size`` (bert_base: its sequence length, dimension 1; else the batch, dimension 0), drawn like
    the example."""
    import torch

    out = []
    for x in inputs:
        shape = (x.shape[0], size, *x.shape[2:]) if name == "bert_base" else (size, *x.shape[1:])
        generator = torch.Generator().manual_seed(size)
        if x.is_floating_point():
            value = torch.randn(shape, dtype=x.dtype, generator=generator)
        else:
            value = torch.randint(int(x.min()), int(x.max()) + 1, shape, dtype=x.dtype, generator=generator)
        out.append(value.to(x.device))
    return tuple(out)


class Clock:
    """Wall time of a call on the device (CUDA synchronized before and after)."""

    def __init__(self, device: str):
        import torch

        self.sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def call_ms(self, fn, inputs: tuple) -> tuple[float, object]:
        self.sync()
        start = time.perf_counter()
        out = fn(*inputs)
        self.sync()
        return (time.perf_counter() - start) * 1e3, out

    def steady_ms(self, fn, inputs: tuple, calls: int) -> float:
        return statistics.median(self.call_ms(fn, inputs)[0] for _ in range(calls))


def first_and_steady(model, fast, name: str, inputs: tuple, size: int, clock: Clock, calls: int) -> dict:
    """The first call of ``fast`` at ``size``, its steady calls there, and whether its output equals the model's."""
    from opweave.outputs import compare

    at = inputs_at(name, inputs, size)
    first_ms, out = clock.call_ms(fast, at)
    start = time.perf_counter()
    fast.wait(600)  # what the first call set going beside it (a check at the new size): the steady calls come after
    settle_s = time.perf_counter() - start
    steady = clock.steady_ms(fast, at, calls)
    return {"size": size, "first_call_ms": first_ms, "steady_ms": steady, "ratio": first_ms / steady,
            "settle_s": settle_s, "equal_to_eager": compare(model(*at), out).ok}


def sweep_of(model, fast, name: str, inputs: tuple, sizes, clock: Clock, calls: int) -> dict:
    """Every size of ``sizes`` in turn (:func:`first_and_steady`): the rows, and the ratios' median and largest."""
    rows = [first_and_steady(model, fast, name, inputs, size, clock, calls) for size in sizes]
    return {"sizes": rows, "median_ratio": statistics.median(s["ratio"] for s in rows),
            "max_ratio": max(s["ratio"] for s in rows), "first_size_ratio": rows[0]["ratio"]}


def one_round(name: str, args, dynamic: bool) -> dict:
    import torch

    import opweave
    from opweave import zoo

    model, inputs = zoo.create(name, **SMALL.get(name, {}))
    model = model.eval()
    if args.device == "cuda":
        model, inputs = model.cuda(), tuple(x.cuda() for x in inputs)
    clock = Clock(args.device)
    sizes = sizes_of(name, args)
    row: dict = {}
    first_tier = {"tiers": False} if args.device == "cpu" else {}
    with torch.no_grad():
        start = time.perf_counter()
        fast = opweave.compile(model, inputs, device=args.device, **first_tier)
        row["compile_s"] = time.perf_counter() - start
        swept = sweep_of(model, fast, name, inputs, sizes, clock, args.calls)
        sweep = swept["sizes"]
        built = fast.variants.stats["builds"] + fast.variants.stats["replans"]
        again = [first_and_steady(model, fast, name, inputs, size, clock, 1) for size in sizes]
        stats = dict(fast.variants.stats)
        row["after"] = {**swept, "builds_in_sweep": built,
                        "builds_in_second_sweep": stats["builds"] + stats["replans"] - built, "stats": stats,
                        "segments": dict(fast.fused.stats) if fast.fused is not None else None,
                        "equal_to_eager": all(s["equal_to_eager"] for s in sweep + again)}
        fx_nodes = sum(len(nodes) for nodes in fast.captured.nodes.values()) if fast.captured is not None else None
        row.update({"ops": len(fast.graph), "fx_nodes": fx_nodes,
                    "plan": fast.choice.get("label") if fast.choice else fast.schedule.scheduler})
        before = opweave.compile(model, inputs, device=args.device, **first_tier)
        before.variants.sizes = None  # every new size captured, planned and built on the caller's thread, as before
        row["before"] = first_and_steady(model, before, name, inputs, sizes[0], clock, args.calls)
        built_for = before.variants._built.get(next(iter(before.variants._built), None))
        row["before"]["plan"] = (built_for.choice or {}).get("label") if built_for is not None else None
        at = inputs_at(name, inputs, sizes[0])
        interleaved: dict[str, list[float]] = {"after_ms": [], "before_ms": []}
        for _ in range(max(args.calls, 5)):  # the plan built for the example's size against one built for this one
            interleaved["after_ms"].append(clock.call_ms(fast, at)[0])
            interleaved["before_ms"].append(clock.call_ms(before, at)[0])
        row["steady_interleaved"] = {k: statistics.median(v) for k, v in interleaved.items()}
        fast.close()
        before.close()
        if dynamic:
            free = opweave.compile(model, inputs, device=args.device, dynamic=True, **first_tier)
            row["dynamic_true"] = {**sweep_of(model, free, name, inputs, sizes, clock, args.calls),
                                   "builds": free.variants.stats["builds"] + free.variants.stats["replans"]}
            free.close()
    return row


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(name: str, mine: list[dict]) -> dict:
    first = mine[0]
    out = {"model": name, "ops": first["ops"], "fx_nodes": first["fx_nodes"], "plan": first["plan"],
           "compile_s": spread([r["compile_s"] for r in mine]),
           "after_median_ratio": spread([r["after"]["median_ratio"] for r in mine]),
           "after_first_size_ratio": spread([r["after"]["first_size_ratio"] for r in mine]),
           "after_max_ratio": spread([r["after"]["max_ratio"] for r in mine]),
           "steady_after_ms": spread([r["steady_interleaved"]["after_ms"] for r in mine]),
           "steady_before_ms": spread([r["steady_interleaved"]["before_ms"] for r in mine]),
           "before_ratio": spread([r["before"]["ratio"] for r in mine]),
           "before_first_call_ms": spread([r["before"]["first_call_ms"] for r in mine]),
           "before_plan": first["before"]["plan"],
           "sizes": [s["size"] for s in first["after"]["sizes"]],
           "builds_in_sweep": max(r["after"]["builds_in_sweep"] for r in mine),
           "builds_in_second_sweep": max(r["after"]["builds_in_second_sweep"] for r in mine),
           "equal_to_eager": all(r["after"]["equal_to_eager"] and r["before"]["equal_to_eager"]
                                 and all(s["equal_to_eager"] for s in r.get("dynamic_true", {}).get("sizes", []))
                                 for r in mine)}
    if "dynamic_true" in first:
        out["dynamic_true_median_ratio"] = spread([r["dynamic_true"]["median_ratio"] for r in mine])
        out["dynamic_true_max_ratio"] = spread([r["dynamic_true"]["max_ratio"] for r in mine])
        out["dynamic_true_builds"] = max(r["dynamic_true"]["builds"] for r in mine)
    return out


def markdown(models: list[dict], device: str) -> str:
    lines = [f"# A new input size on {device}", "",
             "First call of a new size over a steady call of that size. After: what a compiled model does now (the "
             "median over the sizes swept, the largest, and the first size alone); before: captured, planned and "
             "built again (the first size). Steady ms: a call at the first size of the plan built for the example's "
             "size (after) and of the one built for that size (before), timed interleaved. dynamic=True: the same "
             "sweep, median and largest, and the plans it built. Medians over the rounds (min-max).", "",
             "| model | plan | compile s | sizes | after: median first / steady | after: largest | after: first size "
             "| plans built in the sweep (second sweep) | before: first call ms | before: first / steady | steady ms "
             "after / before | dynamic=True: median, largest (plans built) | equal to eager |",
             "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]

    def ratio(s: dict) -> str:
        return f"{s['median']:.1f}x ({s['min']:.1f}-{s['max']:.1f})"

    for m in models:
        sizes = m["sizes"]
        shown = f"{sizes[0]}-{sizes[-1]}" if sizes == list(range(sizes[0], sizes[-1] + 1)) else ",".join(map(str,
                                                                                                               sizes))
        dynamic = (f"{ratio(m['dynamic_true_median_ratio'])}, {ratio(m['dynamic_true_max_ratio'])} "
                   f"({m['dynamic_true_builds']})" if "dynamic_true_median_ratio" in m else "-")
        lines.append(f"| {m['model']} | {m['plan']} | {m['compile_s']['median']:.2f} | {shown} | "
                     f"{ratio(m['after_median_ratio'])} | {ratio(m['after_max_ratio'])} | "
                     f"{ratio(m['after_first_size_ratio'])} | "
                     f"{m['builds_in_sweep']} ({m['builds_in_second_sweep']}) | "
                     f"{m['before_first_call_ms']['median']:.0f} | {ratio(m['before_ratio'])} | "
                     f"{m['steady_after_ms']['median']:.1f} / {m['steady_before_ms']['median']:.1f} | {dynamic} | "
                     f"{'yes' if m['equal_to_eager'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    dynamic = {n for n in args.dynamic_models.split(",") if n}
    rows = []
    with common.progress() as bar:
        task = bar.add_task("compiling", total=len(names) * args.rounds)
        for _ in range(args.rounds):  # rounds outermost: a slow spell of the machine spreads over every model
            for name in names:
                bar.update(task, description=f"{name}")
                rows.append({"model": name, **one_round(name, args, name in dynamic)})
                bar.advance(task)
    models = [summarize(name, [r for r in rows if r["model"] == name]) for name in names]
    args.out.mkdir(parents=True, exist_ok=True)
    common.write_json(args.out / f"{args.stem}.json", {
        "machine": common.machine_info(), "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "models": models, "rows": rows})
    text = markdown(models, args.device)
    (args.out / f"{args.stem}.md").write_text(text)
    common.console.print(text)
    wrong = [m["model"] for m in models if not m["equal_to_eager"]]
    if wrong:
        common.console.print(f"outputs differ from eager: {', '.join(wrong)}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
