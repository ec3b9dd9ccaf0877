"""What a new input signature costs: compiling at the example, the first call of another batch size (which builds it),
and a call once it is built; and the compile time per op, across the zoo.

    .venv/bin/python benchmarks/new_signature.py [--models a,b] [--rounds 2] [--calls 20] [--device cpu]
                                                 [--stem new_signature] [--out DIR]
    .venv/bin/python benchmarks/new_signature.py --quick          # squeezenet and deepfm, one round

For each model at batch 1 (its zoo input otherwise), ``--rounds`` times, in a fresh compile each round:
``opweave.compile(model, inputs, device=DEVICE)`` with the defaults (on a CPU the guard times its candidates, as a
user's compile does), timed (``compile_s``); then the first call at batch 2 (``first_call_ms``: the new signature's
capture, schedule, plan and build, and the call), then ``--calls`` calls at batch 2 (``built_call_ms``: their
median). ``ops``: the ops the plan schedules (coarsened) and the fx nodes captured; ``compile_ms_per_op``:
``compile_s`` over the fx nodes. A line fitted to ``compile_s`` against the fx nodes says whether compile time
grows linearly (slope, intercept, R²).

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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma list of zoo models")
    p.add_argument("--rounds", type=int, default=2, help="fresh compiles per model (default %(default)s)")
    p.add_argument("--calls", type=int, default=20, help="calls of the built signature timed (default %(default)s)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default %(default)s)")
    p.add_argument("--stem", default="new_signature", help="file name without suffix (default %(default)s)")
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR, help="directory (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="squeezenet and deepfm, one round, 5 calls")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.rounds, args.calls = "squeezenet,deepfm", 1, 5
    return args


def batch_of(inputs: tuple, batch: int) -> tuple:
    """``inputs`` at batch ``batch`` (each tensor's first dimension), drawn like the example."""
    import torch

    out = []
    for x in inputs:
        shape = (batch, *x.shape[1:])
        if x.is_floating_point():
            out.append(torch.randn(shape, dtype=x.dtype, device=x.device))
        else:
            out.append(torch.randint(int(x.min()), int(x.max()) + 1, shape, dtype=x.dtype, device=x.device))
    return tuple(out)


def one_round(name: str, args) -> dict:
    import torch

    import opweave
    from opweave import zoo
    from opweave.outputs import compare

    model, inputs = zoo.create(name, **SMALL.get(name, {}))
    model = model.eval()
    if args.device == "cuda":
        model, inputs = model.cuda(), tuple(x.cuda() for x in inputs)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    start = time.perf_counter()
    fast = opweave.compile(model, inputs, device=args.device)
    compile_s = time.perf_counter() - start
    other = batch_of(inputs, 2)
    with torch.no_grad():
        sync()
        start = time.perf_counter()
        got = fast(*other)
        sync()
        first_ms = (time.perf_counter() - start) * 1e3
        right = compare(model(*other), got).ok
        calls = []
        for _ in range(args.calls):
            start = time.perf_counter()
            fast(*other)
            sync()
            calls.append((time.perf_counter() - start) * 1e3)
    fx_nodes = sum(len(nodes) for nodes in fast.captured.nodes.values()) if fast.captured is not None else None
    row = {"compile_s": compile_s, "first_call_ms": first_ms, "built_call_ms": statistics.median(calls),
           "ops": len(fast.graph), "fx_nodes": fx_nodes, "equal_to_eager": right,
           "plan": fast.choice.get("label") if fast.choice else fast.schedule.scheduler}
    fast.close()
    return row


def fit(points: list[tuple[float, float]]) -> dict:
    """Least squares ``y = slope x + intercept`` and R²."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    intercept = my - slope * mx
    total = sum((y - my) ** 2 for _, y in points)
    residual = sum((y - slope * x - intercept) ** 2 for x, y in points)
    return {"slope_s_per_node": slope, "intercept_s": intercept, "r2": 1 - residual / total if total else 1.0}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    rows = []
    with common.progress() as bar:
        task = bar.add_task("compiling", total=len(names) * args.rounds)
        for _ in range(args.rounds):  # rounds outermost: a slow spell of the machine spreads over every model
            for name in names:
                bar.update(task, description=f"compiling {name}")
                rows.append({"model": name, **one_round(name, args)})
                bar.advance(task)
    models = []
    for name in names:
        mine = [r for r in rows if r["model"] == name]

        def spread(key: str, mine=mine) -> dict:
            values = [r[key] for r in mine]
            return {"median": statistics.median(values), "min": min(values), "max": max(values)}

        first = mine[0]
        summary = {"model": name, "ops": first["ops"], "fx_nodes": first["fx_nodes"], "plan": first["plan"],
                   "equal_to_eager": all(r["equal_to_eager"] for r in mine),
                   **{key: spread(key) for key in ("compile_s", "first_call_ms", "built_call_ms")}}
        summary["compile_ms_per_node"] = summary["compile_s"]["median"] * 1e3 / first["fx_nodes"]
        summary["first_call_over_built"] = summary["first_call_ms"]["median"] / summary["built_call_ms"]["median"]
        models.append(summary)
    line = fit([(m["fx_nodes"], m["compile_s"]["median"]) for m in models]) if len(models) > 1 else None
    args.out.mkdir(parents=True, exist_ok=True)
    common.write_json(args.out / f"{args.stem}.json", {
        "machine": common.machine_info(), "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "models": models, "rows": rows, "compile_time_fit": line})
    table = ["| model | fx nodes | ops planned | plan | compile s (min-max) | ms per fx node | first call at batch 2, "
             "ms (min-max) | built call ms | first / built |", "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: "
             "| ---: |"]
    for m in models:
        c, f = m["compile_s"], m["first_call_ms"]
        table.append(f"| {m['model']} | {m['fx_nodes']} | {m['ops']} | {m['plan']} | {c['median']:.2f} "
                     f"({c['min']:.2f}-{c['max']:.2f}) | {m['compile_ms_per_node']:.1f} | {f['median']:.0f} "
                     f"({f['min']:.0f}-{f['max']:.0f}) | {m['built_call_ms']['median']:.1f} | "
                     f"{m['first_call_over_built']:.0f}x |")
    text = "\n".join(table) + "\n"
    if line:
        text += (f"\nCompile time against fx nodes: {line['slope_s_per_node'] * 1e3:.1f} ms per node + "
                 f"{line['intercept_s']:.2f} s, R² {line['r2']:.3f}.\n")
    (args.out / f"{args.stem}.md").write_text(f"# A new input signature on {args.device}\n\n{text}")
    common.console.print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
