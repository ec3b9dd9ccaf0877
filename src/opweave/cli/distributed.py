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

from opweave.cli.app import (
    BatchOpt,
    JsonOpt,
    LinkOpt,
    ModeOpt,
    OptionOpt,
    StreamsOpt,
    app,
    collect_options,
    err,
    guard,
    out,
)
from opweave.errors import UsageError


@app.command("run")
@guard
def run(model: Annotated[str, typer.Option("--model", help="zoo model")] = "inception_v3",
        scheduler: Annotated[str | None, typer.Option("--scheduler", "-s", help="default: hios-lp (one device: the "
                                                                              "device's own default)")] = None,
        devices: Annotated[int | None, typer.Option("--devices", min=1,
                                                   help="ranks (default 2; under torchrun its world size)")] = None,
        device: Annotated[str, typer.Option(
            "--device", help="cpu (gloo) | cuda (NCCL) | auto (cuda when there is a GPU per rank)")] = "auto",
        check: Annotated[bool, typer.Option("--check", help="compare with single-process eager; exit 1 beyond "
                                                            "tolerance")] = False,
        runs: Annotated[int, typer.Option(min=1, help="timed calls")] = 10,
        warmup: Annotated[int, typer.Option(min=0, help="untimed calls first")] = 2,
        batch_size: BatchOpt = 1,
        image_size: Annotated[int | None, typer.Option(help="input height and width of the CNN models")] = None,
        streams: StreamsOpt = None, link: LinkOpt = None,
        threads: Annotated[int | None, typer.Option(min=1, help="the threads each rank's lanes may use in all "
                                                               "(default: the cores split among the ranks)")] = None,
        timeout: Annotated[float | None, typer.Option(min=1, help="process-group timeout, seconds (default "
                                                                 "300)")] = None,
        coarsen: Annotated[bool | None, typer.Option("--coarsen/--no-coarsen",
                                                    help="the papers' operators, as opweave.compile plans them "
                                                         "(--no-coarsen: one op per fx node; default: coarsen)")
                           ] = None,
        mode: ModeOpt = None, options: OptionOpt = None, as_json: JsonOpt = False):
    """Run a model with a multi-device plan, one rank process per device; print the median latency. The model is
    built as ``opweave.compile(..., devices=N)`` builds it, by the pipeline, with these flags, ``--mode`` and
    ``--option KEY=VALUE`` as its options, every one checked before the model loads (one device: the device's own
    plan, in this process). Under torchrun each rank's threads default to the cores split among the ranks of its
    node."""
    from opweave.backends.distributed import check_devices, torchrun
    from opweave.backends.threads import total_threads
    from opweave.capture import load
    from opweave.devices import resolve_device
    from opweave.pipeline import resolve

    world = torchrun.rank_and_world()[1] if torchrun.launched() else devices or 2
    device = resolve_device(device, gpus=1 if torchrun.launched() else world) if device == "auto" else device
    if torchrun.launched() and devices is not None and devices != world:
        raise UsageError(f"--devices {devices}, but torchrun started {world} ranks (--nproc-per-node x nodes)")
    mode, settings = collect_options(options, mode, scheduler=scheduler, devices=world, streams=streams, link=link,
                                     threads=threads, timeout_s=timeout, coarsen=coarsen)
    if torchrun.launched() and device == "cpu" and "threads" not in settings:  # this node's share, not the world's
        settings["threads"] = total_threads(ranks=torchrun.ranks_here())
    resolved = resolve(device, mode, settings, check_device=False)
    check_devices(1 if torchrun.launched() else world, device)  # before building the model: one line
    loaded = functools.partial(load, model, batch_size=batch_size, image_size=image_size, coarsen=False,
                               fold_bn=resolved.fold_bn)
    if torchrun.launched():
        result = _run_torchrun(loaded, model, resolved, runs, warmup, check)
        if result is None:
            return
    else:
        result = _run_ranks(loaded, model, resolved, runs, warmup, check)
    _report(result, check, as_json)


def _eager(module, inputs):
    with torch.inference_mode():
        return module(*inputs)


def _simulated_ms(compiled_graph, plan, costs) -> float:
    from opweave.backends.simulate import simulate

    return simulate(compiled_graph, plan, costs).makespan_ms


def _run_ranks(loaded, model, options, runs, warmup, check) -> dict:
    from opweave.evaluate.bench import median_ms
    from opweave.pipeline import build

    module, inputs, captured = loaded()
    with build(captured, inputs, options, eager=module) as fast:
        ms = median_ms(fast, inputs, runs=runs, warmup=warmup)
        return {"model": model, "scheduler": fast.schedule.scheduler, "devices": options.devices,
                "device": options.device, "launch": "processes" if options.devices > 1 else "this process",
                "median_ms": ms, "runs": runs, "ops": len(fast.graph),
                "simulated_ms": _simulated_ms(fast.graph, fast.plan, fast.costs),
                "devices_used": fast.schedule.devices_used, "ranks": getattr(fast.backend, "info", []),
                **(_compare(module, inputs, fast(*inputs)) if check else {})}


def _run_torchrun(loaded, model, options, runs, warmup, check) -> dict | None:
    from opweave.backends.distributed import torchrun
    from opweave.pipeline.flow import plan_ranks

    rank, world = torchrun.rank_and_world()
    built: dict = {}

    def prepare():
        module, inputs, captured = loaded()
        planned = plan_ranks(captured, inputs, options)  # as the pipeline's build plans the ranks it starts
        built.update(module=module, inputs=inputs, costs=planned.costs, sched=planned.schedule, plan=planned.plan,
                     graph=planned.captured.graph)
        return planned.captured, planned.plan, inputs

    result = torchrun.run(prepare, device=options.device, runs=runs, warmup=warmup, timeout_s=options.timeout_s,
                          threads=options.threads)
    if rank != 0:
        return None
    assert result is not None  # rank 0 collects every rank's
    module, inputs = built["module"], built["inputs"]
    return {"model": model, "scheduler": options.scheduler, "devices": world, "device": options.device,
            "launch": "torchrun", "median_ms": statistics.median(result["times_ms"]), "runs": runs,
            "ops": len(built["graph"]), "simulated_ms": _simulated_ms(built["graph"], built["plan"], built["costs"]),
            "devices_used": built["sched"].devices_used, "ranks": result["ranks"],
            **(_compare(module, inputs, result["output"]) if check else {})}


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
def profile_links(device: Annotated[str, typer.Option(
                      "--device", help="cpu (gloo ranks) | cuda (NCCL, GPUs 0 and 1) | auto (cuda when two GPUs are "
                                        "present)")
                  ] = "auto",
                  repeats: Annotated[int, typer.Option(min=1, help="messages timed per size")] = 20,
                  max_bytes: Annotated[int, typer.Option(min=1024, help="largest message")] = 2 ** 24,
                  output: Annotated[Path | None, typer.Option("-o", "--output", help="write the link file here "
                                                              "(for --link)")] = None,
                  as_json: JsonOpt = False):
    """Measure point-to-point time against message size between two ranks; fit latency + bytes / bandwidth."""
    from opweave.backends.distributed import profile_link
    from opweave.costs.links import fit
    from opweave.devices import resolve_device

    device = resolve_device(device, gpus=2) if device == "auto" else device
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
