"""Commands that run one model on several devices: ``run`` (one rank process per device, or one rank of a
``torchrun`` launch) and ``profile-links`` (point-to-point time against message size between two ranks)."""

from __future__ import annotations

import functools
import json
import platform
import statistics
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.table import Table

from opweave.cli.app import BatchOpt, CoarsenOpt, JsonOpt, LinkOpt, StreamsOpt, app, err, guard, out
from opweave.errors import UsageError


@app.command("run")
@guard
def run(model: Annotated[str, typer.Option("--model")] = "inception_v3",
        scheduler: Annotated[str, typer.Option("--scheduler", "-s")] = "hios-lp",
        devices: Annotated[int | None, typer.Option("--devices", min=1,
                                                   help="ranks (default 2; under torchrun its world size)")] = None,
        device: Annotated[str, typer.Option(help="cpu (gloo) | cuda (NCCL)")] = "cpu",
        check: Annotated[bool, typer.Option("--check", help="compare with single-process eager; exit 1 beyond "
                                                            "tolerance")] = False,
        runs: Annotated[int, typer.Option(min=1)] = 10, warmup: Annotated[int, typer.Option(min=0)] = 2,
        batch_size: BatchOpt = 1,
        image_size: Annotated[int | None, typer.Option(help="input height and width of the CNN models")] = None,
        streams: StreamsOpt = None, link: LinkOpt = None,
        threads: Annotated[int | None, typer.Option(min=1, help="intra-op threads per rank (default cores / "
                                                               "ranks)")] = None,
        timeout: Annotated[float, typer.Option(min=1, help="process-group timeout, seconds")] = 300.0,
        coarsen: CoarsenOpt = True, as_json: JsonOpt = False):
    """Run a model with a multi-device plan, one rank process per device; print the median latency. The plan is
    made for the coarsened graph, as ``opweave.compile(..., devices=N)`` makes it, unless --no-coarsen."""
    from opweave.backends.distributed import check_devices, torchrun
    from opweave.capture import load

    check_devices(1 if torchrun.launched() else devices or 2, device)  # before building the model: one line
    build = functools.partial(load, model, batch_size=batch_size, image_size=image_size, coarsen=coarsen)
    if torchrun.launched():
        result = _run_torchrun(build, model, scheduler, devices, device, runs, warmup, streams, link, timeout, check)
        if result is None:
            return
    else:
        result = _run_ranks(build, model, scheduler, devices or 2, device, runs, warmup, streams, link, threads,
                            timeout, check)
    _report(result, check, as_json)


def _eager(module, inputs):
    with torch.inference_mode():
        return module(*inputs)


def _simulated_ms(compiled_graph, plan, costs) -> float:
    from opweave.backends.simulate import simulate

    return simulate(compiled_graph, plan, costs).makespan_ms


def _run_ranks(build, model, scheduler, devices, device, runs, warmup, streams, link, threads, timeout,
               check) -> dict:
    from opweave.evaluate.bench import median_ms
    from opweave.pipeline.targets import RanksTarget

    module, inputs, captured = build()
    with RanksTarget().build(captured, inputs, _options(device, scheduler, devices, streams, link, threads,
                                                        timeout)) as fast:
        ms = median_ms(fast, inputs, runs=runs, warmup=warmup)
        return {"model": model, "scheduler": scheduler, "devices": devices, "device": device, "launch": "processes",
                "median_ms": ms, "runs": runs, "ops": len(fast.graph),
                "simulated_ms": _simulated_ms(fast.graph, fast.plan, fast.costs),
                "devices_used": fast.schedule.devices_used, "ranks": fast.backend.info,
                **(_compare(module, inputs, fast(*inputs)) if check else {})}


def _run_torchrun(build, model, scheduler, devices, device, runs, warmup, streams, link, timeout,
                  check) -> dict | None:
    from opweave.backends.distributed import torchrun
    from opweave.pipeline.targets import RanksTarget

    rank, world = torchrun.rank_and_world()
    if devices is not None and devices != world:
        raise UsageError(f"--devices {devices}, but torchrun started {world} ranks (--nproc-per-node x nodes)")
    built: dict = {}

    def prepare():
        module, inputs, captured = build()
        costs, sched, plan = RanksTarget().plan(captured, inputs, _options(device, scheduler, world, streams, link))
        built.update(module=module, inputs=inputs, costs=costs, sched=sched, plan=plan, graph=captured.graph)
        return captured, plan, inputs

    result = torchrun.run(prepare, device=device, runs=runs, warmup=warmup, timeout_s=timeout)
    if rank != 0:
        return None
    module, inputs = built["module"], built["inputs"]
    return {"model": model, "scheduler": scheduler, "devices": world, "device": device, "launch": "torchrun",
            "median_ms": statistics.median(result["times_ms"]), "runs": runs, "ops": len(built["graph"]),
            "simulated_ms": _simulated_ms(built["graph"], built["plan"], built["costs"]),
            "devices_used": built["sched"].devices_used, "ranks": result["ranks"],
            **(_compare(module, inputs, result["output"]) if check else {})}


def _options(device: str, scheduler: str, devices: int, streams, link, threads=None, timeout=None):
    """The rank processes' options, checked as opweave.compile checks them (the model was coarsened, or not, when it
    was loaded). One device runs the plan in one rank process: the baseline the others are held against."""
    from opweave.pipeline import resolve

    ranks = {"link": link, "timeout_s": timeout} if devices > 1 else {}
    return resolve(device, "default", {"scheduler": scheduler, "devices": devices, "streams": streams,
                                       "threads": threads if device == "cpu" else None, "coarsen": False, **ranks},
                   check_device=False)


def _compare(module, inputs, got) -> dict:
    """Whether ``got`` equals single-process eager (:func:`opweave.outputs.compare`): its largest absolute
    difference, the absolute tolerance it is held to, and the verdict."""
    from opweave.outputs import compare

    check = compare(_eager(module, inputs), got)
    return {"max_abs_diff": check.max_diff, "tolerance": check.tolerance * check.scale, "ok": check.ok}


def _report(result: dict, check: bool, as_json: bool) -> None:
    failed = check and not result["ok"]
    if as_json:
        print(json.dumps(result))
    else:
        table = Table(title=f"{result['model']} ({result['ops']} ops) with {result['scheduler']} on "
                            f"{result['devices']} {result['device']} rank(s) ({result['launch']}): median "
                            f"{result['median_ms']:.2f} ms over {result['runs']} runs, simulated "
                            f"{result['simulated_ms']:.2f} ms")
        for col in ("rank", "pid", "ops", "messages", "parameters MB", "threads"):
            table.add_column(col, justify="right")
        for info in result["ranks"]:
            table.add_row(str(info["rank"]), str(info["pid"]), str(info["ops"]), str(info["messages"]),
                          f"{info['param_bytes'] / 1e6:.2f}", str(info["threads"]))
        out.print(table)
        out.print(f"median latency {result['median_ms']:.3f} ms")
        if check:
            out.print(f"max |diff| against single-process eager {result['max_abs_diff']:.2e} "
                      f"(tolerance {result['tolerance']:.1e})")
    if failed:
        err.print(f"opweave: error: outputs differ from eager by {result['max_abs_diff']:.3g}, beyond the tolerance "
                  f"{result['tolerance']:.3g}", markup=False, highlight=False)
        raise typer.Exit(1)


@app.command("profile-links")
@guard
def profile_links(device: Annotated[str, typer.Option(help="cpu (gloo ranks) | cuda (NCCL, GPUs 0 and 1)")] = "cpu",
                  repeats: Annotated[int, typer.Option(min=1)] = 20,
                  max_bytes: Annotated[int, typer.Option(min=1024, help="largest message")] = 2 ** 24,
                  output: Annotated[Path | None, typer.Option("-o", "--output", help="write the link file here "
                                                              "(for --link)")] = None,
                  as_json: JsonOpt = False):
    """Measure point-to-point time against message size between two ranks; fit latency + bytes / bandwidth."""
    from opweave.backends.distributed import profile_link
    from opweave.costs.links import fit

    sizes = [2 ** k for k in range(4, max(5, max_bytes.bit_length()), 2)]
    samples = profile_link(device, sizes, repeats=repeats)
    link = fit(samples, name=f"measured-{device}",
               source=f"opweave profile-links --device {device} on {platform.node()} (torch {torch.__version__})")
    if output is not None:
        link.save(output)
    if as_json:
        print(json.dumps({"name": link.name, "latency_ms": link.latency_ms, "bandwidth_gbs": link.bandwidth_gbs,
                          "samples": link.samples}))
        return
    table = Table(title=f"point-to-point between two {device} ranks (median of {repeats}, one way)")
    for col in ("bytes", "measured ms", "fit ms"):
        table.add_column(col, justify="right")
    for size, ms in samples:
        table.add_row(str(size), f"{ms:.4f}", f"{link.transfer_ms(size):.4f}")
    out.print(table)
    out.print(f"fit: latency {link.latency_ms:.4f} ms + bytes / {link.bandwidth_gbs:.3f} GB/s")
    if output is not None:
        err.print(f"wrote {output}")
