"""Peak memory of the CUDA backend's plans, without a GPU: every mode run on the fake CUDA runtime.

    .venv/bin/python benchmarks/memory_fake.py [--quick] [--models a,b] [--schedulers x,y] [--configs 1:fp32,8:fp16]
                                               [--calls 3] [--out DIR]

For each model (default: googlenet, inception_v3, nasnet_a_mobile, randwire), batch size and dtype (default batch 1
fp32 and batch 8 fp16), captured once with one op per fx node (as ``benchmarks/gpu_latency.py`` captures them),
each mode is built and called ``--calls`` times on a new :class:`~opweave.testing.fakecuda.FakeCuda` (seed 0),
its output checked against eager (:func:`opweave.outputs.compare`) at fp32; at fp16 the fake runs no kernel
(``compute=False``: the CPU's half-precision convolutions take minutes per call here) and outputs are not checked,
which changes nothing the host allocates or frees. Peak memory is the fake's
``max_memory_allocated`` from before building to after the calls, minus what was allocated before, as the GPU
benchmark reads ``torch.cuda.max_memory_allocated``: the bytes of the blocks the fake allocated that the host still
holds and has not dropped (its parameters are not the fake's, so they do not count). Modes:

* ``eager`` — the model called on the fake (every op's output freed when the host lets go of it), for reference;
* ``opweave <scheduler>`` for ``sequential`` (one stream: the sequential CUDA Graph's equivalent) and the
  multi-stream schedulers (default lios, heft, opara, nimble), at most 8 streams, on the fitted device's costs (what
  ``opweave.compile`` plans on), recorded into a CUDA Graph, each built twice:

  * ``before`` — the buffers learnt from a first run that keeps every intermediate, no added waits (the backend
    before buffers were planned ahead of the first run);
  * ``after`` — the buffers found on fake tensors and freed from the first run, with the memory pass's added waits
    (:func:`opweave.pipeline.memory_pass.with_free_joins`).

The summary gives, per configuration and variant, each plan's peak over the one-stream plan's (the ratio the GPU
target bounds by 1.25 against the sequential CUDA Graph) and the largest. Kernels take no time on the fake, workspace
and allocator rounding are not modelled: these are the plans' own buffers, not a GPU's figures.

Writes ``DIR/memory_fake.json`` (machine, settings, every row, the summary) and ``DIR/memory_fake.md`` (the tables).
"""

from __future__ import annotations

import contextlib
import gc
import sys
import time
from unittest import mock

import _common as common

from opweave import schedulers, zoo
from opweave.errors import first_line

MODELS = ("googlenet", "inception_v3", "nasnet_a_mobile", "randwire")
SCHEDULERS = ("lios", "heft", "opara", "nimble")
CONFIGS = ((1, "fp32"), (8, "fp16"))
DTYPES = {"fp32": "float32", "fp16": "float16"}
QUICK_MODELS = ("googlenet",)
QUICK_SCHEDULERS = ("lios",)
MB = 2**20


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--configs", help="comma list of batch:dtype (default 1:fp32,8:fp16; quick: 1:fp32)")
    p.add_argument("--calls", type=int, default=3, help="calls after building (default %(default)s)")
    args = p.parse_args(argv)
    models = common.split_names(args.models, zoo.names(), "model") or list(
        QUICK_MODELS if args.quick else MODELS)
    scheds = common.split_names(args.schedulers, schedulers.names(), "scheduler") or list(
        QUICK_SCHEDULERS if args.quick else SCHEDULERS)
    configs = [(int(b), d) for b, d in (c.split(":") for c in args.configs.split(","))] if args.configs else (
        [(1, "fp32")] if args.quick else list(CONFIGS))
    settings = {"models": models, "schedulers": ["sequential", *scheds], "configs": configs, "calls": args.calls,
                "streams": 8, "runtime": "FakeCuda(seed=0)", "granularity": "one op per fx node",
                "costs": "the fitted device's (opweave.compile's CUDA default)"}
    rows: list[dict] = []
    start = time.perf_counter()
    for name in models:
        for batch, dtype in configs:
            rows += measure_config(name, batch, dtype, ["sequential", *scheds], args.calls)
            print(f"{name} batch {batch} {dtype}: done ({time.perf_counter() - start:.0f} s)", flush=True)
    data = {"machine": common.machine_info(), "settings": settings, "results": rows, "summary": summarize(rows)}
    args.out.mkdir(parents=True, exist_ok=True)
    common.write_json(args.out / "memory_fake.json", data)
    (args.out / "memory_fake.md").write_text(markdown(data))
    print(markdown(data))
    return 0


def measure_config(name: str, batch: int, dtype: str, scheds: list[str], calls: int) -> list[dict]:
    """Every mode of one model, batch size and dtype: one row each (figures or the error)."""
    import torch

    from opweave.capture import load

    base = {"model": name, "batch_size": batch, "dtype": dtype}
    try:
        model, inputs, captured = load(name, batch_size=batch, dtype=getattr(torch, DTYPES[dtype]), coarsen=False)
    except Exception as exc:  # noqa: BLE001 - a failed capture skips the configuration, recorded
        return [{**base, "mode": "build", "error": first_line(exc)}]
    with torch.no_grad():
        expected = model(*inputs)
    compute = dtype == "fp32"
    rows = [{**base, "mode": "eager", **peak_of(lambda fake: _eager(model, fake), inputs, expected, calls, compute)}]
    for variant in ("before", "after"):
        for sched in scheds:
            extra: dict = {}
            with _variant(variant):
                figures = peak_of(lambda fake, s=sched, e=extra: _opweave(captured, inputs, s, fake, e), inputs,
                                  expected, calls, compute)
            rows.append({**base, "mode": f"opweave {sched}", "scheduler": sched, "variant": variant, **extra,
                         **figures})
    return rows


def peak_of(build, inputs: tuple, expected, calls: int, compute: bool) -> dict:
    """Build a mode on a new fake runtime, call it ``calls`` times; its peak and, when the fake ``compute`` s,
    whether its output was right (``ok`` None otherwise)."""
    import torch

    from opweave.outputs import compare
    from opweave.testing.fakecuda import FakeCuda

    gc.collect()
    fake = FakeCuda(seed=0, compute=compute)
    baseline = fake.memory_allocated()
    fake.reset_peak_memory_stats()
    fn = None
    start = time.perf_counter()
    try:
        fn = build(fake)
        with torch.no_grad():
            outs = [fn(*inputs) for _ in range(calls)]
        fake.synchronize()
        result = compare(expected, outs[-1]) if compute else None
    except Exception as exc:  # noqa: BLE001 - one failing mode must not stop the benchmark
        return {"error": first_line(exc)}
    finally:
        del fn
    return {"peak_mb": (fake.max_memory_allocated() - baseline) / MB, "ok": result and result.ok,
            "max_abs_diff": result and result.max_diff, "seconds": time.perf_counter() - start}


def _eager(model, fake):
    stream = fake.current_stream()
    return lambda *args: fake.launch(stream, model, *args)


def _opweave(captured, inputs: tuple, scheduler: str, fake, extra: dict):
    from opweave.pipeline import build, resolve

    fast = build(captured, inputs, resolve("cuda", scheduler=scheduler, coarsen=False, runtime=fake))
    extra.update(streams=fast.schedule.streams_used, syncs=fast.plan.syncs, ops=len(fast.graph))
    return fast


@contextlib.contextmanager
def _variant(variant: str):
    """``before``: the backend learns its buffers from a first run that keeps every intermediate, and the plan gets
    no added waits; ``after``: as built now."""
    if variant == "after":
        yield
        return

    def no_static(*args, **kwargs):
        raise RuntimeError("buffers from a first run (before)")

    with mock.patch("opweave.backends.cuda.static_buffers", no_static), \
            mock.patch("opweave.pipeline.targets.with_free_joins", lambda captured, plan, *a, **k: plan):
        yield


def summarize(rows: list[dict]) -> list[dict]:
    """Per configuration and variant: each multi-stream plan's peak over the one-stream plan's, and the largest."""
    out = []
    configs = sorted({(r["model"], r["batch_size"], r["dtype"]) for r in rows}, key=lambda c: (c[1], c[2], c[0]))
    for model, batch, dtype in configs:
        mine = [r for r in rows if (r["model"], r["batch_size"], r["dtype"]) == (model, batch, dtype)]
        eager = next((r.get("peak_mb") for r in mine if r["mode"] == "eager"), None)
        for variant in ("before", "after"):
            plans = {r["scheduler"]: r for r in mine if r.get("variant") == variant and "peak_mb" in r}
            one = plans.get("sequential")
            if one is None:
                continue
            ratios = {s: r["peak_mb"] / one["peak_mb"] for s, r in plans.items() if s != "sequential"}
            out.append({"model": model, "batch_size": batch, "dtype": dtype, "variant": variant,
                        "eager_mb": eager, "sequential_mb": one["peak_mb"], "ratio_to_sequential": ratios,
                        "max_ratio": max(ratios.values(), default=None),
                        "all_outputs_ok": None if any(r["ok"] is None for r in plans.values()) else all(
                            r["ok"] for r in plans.values())})
    return out


def markdown(data: dict) -> str:
    """One table per configuration: each mode's peak before and after, and its ratio to the one-stream plan."""
    rows = data["results"]
    out = ["# Peak memory on the fake CUDA runtime", "",
           "MB of the fake's blocks the host holds (`max_memory_allocated` from building to the last of "
           f"{data['settings']['calls']} calls); ratio: over the one-stream plan (`sequential`) of the same variant. "
           "*before*: buffers learnt from a first run keeping every intermediate, no added waits; *after*: buffers "
           "found on fake tensors, freed from the first run, with the memory pass's added waits. "
           "Written by `benchmarks/memory_fake.py`.", ""]
    configs = sorted({(r["model"], r["batch_size"], r["dtype"]) for r in rows}, key=lambda c: (c[1], c[2], c[0]))
    for model, batch, dtype in configs:
        mine = [r for r in rows if (r["model"], r["batch_size"], r["dtype"]) == (model, batch, dtype)]
        eager = next((r for r in mine if r["mode"] == "eager"), {})
        out += [f"**{model}**, batch {batch}, {dtype} (eager {_mb(eager.get('peak_mb'))} MB)", "",
                "| plan | streams | waits (after) | before MB | ratio | after MB | ratio | outputs |",
                "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        by = {(r.get("variant"), r.get("scheduler")): r for r in mine if "scheduler" in r}
        scheds = [s for s in data["settings"]["schedulers"] if ("after", s) in by or ("before", s) in by]
        for sched in scheds:
            before, after = by.get(("before", sched), {}), by.get(("after", sched), {})
            cells = [sched, str(after.get("streams", before.get("streams", "-"))),
                     f"{after.get('syncs', '-')} ({_signed(after, before)})"]
            for row in (before, after):
                one = by.get((row.get("variant"), "sequential"), {})
                cells += [_mb(row.get("peak_mb")), _ratio(row.get("peak_mb"), one.get("peak_mb"))]
            ok = [r.get("ok") for r in (before, after) if r]
            errors = [r["error"][:60] for r in (before, after) if r.get("error")]
            cells.append("; ".join(errors) if errors else "not computed" if None in ok else "right" if all(ok)
                         else "WRONG")
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def _mb(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ratio(a, b) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def _signed(after: dict, before: dict) -> str:
    if "syncs" not in after or "syncs" not in before:
        return "-"
    return f"{after['syncs'] - before['syncs']:+d}"


if __name__ == "__main__":
    sys.exit(main())
