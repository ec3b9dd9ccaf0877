"""Commands that run models on a device: ``bench`` and ``profile``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from opweave.cli.app import (
    BatchOpt,
    CoarsenOpt,
    DeviceOpt,
    JsonOpt,
    ModelFileOpt,
    ModeOpt,
    OptionOpt,
    StreamsOpt,
    app,
    collect_options,
    err,
    guard,
    out,
    scheduler_names,
)
from opweave.errors import UsageError


@app.command()
@guard
def bench(model: Annotated[str | None, typer.Option("--model", help="zoo model (default inception_v3)")] = None,
          model_file: ModelFileOpt = None,
          device: DeviceOpt = "auto",
          batch_size: BatchOpt = 1,
          schedulers_: Annotated[str, typer.Option(
              "--schedulers", "--scheduler", "-s",
              help="one scheduler, a comma list or all; 'default' is what opweave.compile picks given no scheduler")
          ] = "default,sequential,lios,opara",
          streams: StreamsOpt = None, runs: Annotated[int, typer.Option(min=1, help="timed calls per mode")] = 20,
          warmup: Annotated[int, typer.Option(min=0, help="untimed calls per mode first")] = 3,
          profile: Annotated[Path | None, typer.Option(help="schedule on this measured profile")] = None,
          coarsen: Annotated[bool | None, typer.Option("--coarsen/--no-coarsen",
                                                      help="the papers' operators, as opweave.compile plans them "
                                                           "(--no-coarsen: one op per fx node; default: coarsen)")
                             ] = None,
          mode: ModeOpt = None, options: OptionOpt = None, as_json: JsonOpt = False):
    """Real runs: eager vs opweave with each scheduler, and ``default``: what opweave.compile picks when given no
    scheduler (on a CPU, the fastest of a few timed candidates: the model in one ONNX Runtime segment where the
    ``onnx`` extra is installed, its lanes, the model itself; on CUDA, the plan the fitted device predicts fastest;
    ``--mode max-autotune``: the fastest of a wider search). Every mode is built first, then all are timed interleaved
    (rounds of a few calls each, so that all see the same load): the median, the spread (p10 to p90, as % of the
    median) and the speed-up over eager, shown as ~ when it is within the spread (README, "How to read a
    benchmark"). A machine that other processes kept busy meanwhile gets a warning. ``--option KEY=VALUE`` sets any
    other option of opweave.compile for every scheduler (refused, before the model loads, where it does not apply
    to one of them)."""
    from opweave.devices import resolve_device
    from opweave.evaluate.bench import bench_model

    device = resolve_device(device)
    mode, settings = collect_options(options, mode, streams=streams, profile=profile, coarsen=coarsen)
    names = scheduler_names(schedulers_, also=("default",))
    given = [name for name in names if name != "default"]
    if given and mode.startswith("max-autotune"):
        raise UsageError(f"mode={mode} chooses its own plan, so it takes no scheduler ({given[0]!r} was given): "
                         "use --schedulers default")
    if model is not None and model_file is not None:
        raise UsageError("give --model NAME or --model-file PATH.pt2, not both")
    result = bench_model(model_file or model or "inception_v3", device=device, batch_size=batch_size,
                         scheduler_names=names, runs=runs, warmup=warmup, progress=not as_json, mode=mode,
                         options=settings)
    if as_json:
        print(json.dumps(result))
        return
    machine = result["machine"]
    load = machine["load_average_1_5_15m"]
    others = machine["others_cpu_share"]
    caption = (f"ms: median of {runs} calls per mode in {result['rounds']} interleaved rounds; spread: p10 to p90 "
               "as % of the median; ~: within the spread, not a speed-up this run can show\n"
               f"{machine['cpus']} CPUs" + (f", load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}" if load else "")
               + (f"; other processes: {others:.0%} of them while timing" if others is not None else "")
               + "".join(f"\n{r['mode']} picked {r['choice']}" for r in result["rows"] if r.get("choice")))
    table = Table(title=f"{result['model']} batch {batch_size} on {result['device_name']} (torch {result['torch']})",
                  caption=caption, pad_edge=False)
    for col in ("mode", "ms", "spread", "vs eager", "streams", "syncs", "max diff"):
        table.add_column(col, justify="left" if col == "mode" else "right", no_wrap=True)
    for r in result["rows"]:
        table.add_row(r["mode"], f"{r['median_ms']:.3f}" if r["median_ms"] < 1e4 else f"{r['median_ms']:.0f}",
                      f"{r['spread_pct']:.0f}%",
                      ("~" if r.get("within_spread") else "") + f"{r['speedup_vs_eager']:.2f}x",
                      "" if r.get("streams") is None else str(r["streams"]),
                      "" if r.get("syncs") is None else str(r["syncs"]),
                      "" if r.get("max_abs_diff") is None else f"{r['max_abs_diff']:.1e}")
    out.print(table)
    if result["warning"]:
        err.print(f"[yellow]warning:[/yellow] {result['warning']}")


@app.command()
@guard
def profile(model: Annotated[str, typer.Option("--model", help="zoo model")] = "inception_v3",
            device: DeviceOpt = "auto",
            batch_size: BatchOpt = 1,
            output: Annotated[Path | None, typer.Option("-o", "--output", help="profile file to write (default: "
                                                        "MODEL-bBATCH-DEVICE.profile.json here)")] = None,
            coarsen: CoarsenOpt = True,
            threads: Annotated[int, typer.Option(min=1, help="CPU: intra-op threads per op (a lane's budget when "
                                                            "the lanes fill the cores)")] = 1):
    """Measure each op's latency (and kernel resources on CUDA) and save a profile the cost model loads (of the
    coarsened graph, as compile and bench schedule it, unless --no-coarsen). On the CPU each op is timed on
    --threads intra-op threads, the budget a lane runs it with."""
    from opweave.capture import load
    from opweave.costs.profile import profile_model
    from opweave.devices import resolve_device

    device = resolve_device(device)
    _, inputs, captured = load(model, batch_size=batch_size, device=device, coarsen=coarsen)
    prof = profile_model(captured, inputs, device=device, threads=threads if device == "cpu" else None)
    path = output or Path(f"{model}-b{batch_size}-{device}.profile.json")
    prof.save(path)
    err.print(f"wrote {path}")
