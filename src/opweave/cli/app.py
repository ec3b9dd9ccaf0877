"""The ``opweave`` Typer app, its error contract and the options several commands share.

Contract: an :class:`~opweave.errors.OpweaveError` (bad input, an unmet precondition) exits with status 2 and one
line on stderr; anything else escaping a command is a bug and keeps its traceback.
"""

from __future__ import annotations

import functools
import typing
import warnings
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from typer.core import TyperGroup

from opweave import schedulers
from opweave.costs import COST_MODELS, Costs, from_graph
from opweave.errors import OpweaveError, UsageError, did_you_mean
from opweave.ir import OpGraph


def _metavars(params: list) -> list:
    """What a parameter's help shows for its value: a word for what it is (``MODEL``, ``N``, ``PATH``; a flag
    nothing), never the type the code annotates it with (Typer would show ``<str>``, ``<list[Path]>``, ``<bool>``)."""
    for param in params:
        if getattr(param, "_metavar_set", False):
            continue
        param._metavar_set = True
        if param.param_type_name == "argument":  # its name, as click writes it: GRAPH, [GRAPH], RESULTS...
            name = param.metavar or (param.name or "value").upper()
            shown = name if param.required else f"[{name}]"
            param.metavar = name + ("..." if param.nargs != 1 else "")
            param.display_type_rich = lambda ctx: None
            param._usage_display_name = lambda shown=shown, many=param.nargs != 1: shown + ("..." if many else "")
            continue
        if param.metavar is not None:
            continue
        if getattr(param, "is_flag", False):
            param.metavar = ""
            continue
        kind = param.type_descriptor.annotation
        kind = (typing.get_args(kind) or (kind,))[0] if typing.get_origin(kind) is list else kind
        long = next((o for o in param.opts if o.startswith("--")), param.name or "value").lstrip("-")
        param.metavar = {int: "N", float: "NUMBER", Path: "PATH"}.get(kind) or long.replace("-", "_").upper()
    return params


class _Group(TyperGroup):
    """The app's command group: help texts are Markdown (``code`` shows as code) and values show what they are
    (:func:`_metavars`)."""

    def get_params(self, ctx):
        return _metavars(super().get_params(ctx))

    def get_command(self, ctx, cmd_name):
        command = super().get_command(ctx, cmd_name)
        if command is not None and not getattr(command, "_metavars", False):
            params = command.get_params
            command.get_params = lambda ctx: _metavars(params(ctx))
            command._metavars = True
        return command


app = typer.Typer(cls=_Group, rich_markup_mode="markdown", add_completion=False, no_args_is_help=True,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Inter-operator parallel DNN inference: schedule, simulate and run models on many streams.")
out = Console()
err = Console(stderr=True)


def _version(shown: bool) -> None:
    if shown:
        from opweave import __version__

        out.print(f"opweave {__version__}", markup=False, highlight=False)
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", help="print the version and exit", is_eager=True,
                                                callback=_version)] = False) -> None:
    """Inter-operator parallel DNN inference: schedule, simulate and run models on many streams."""


def fail(message: str) -> None:
    err.print(f"opweave: error: {message}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def guard(fn):
    """Turn the library's deliberate errors into the CLI contract: one line on stderr, exit 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except OpweaveError as exc:
            text = str(exc).strip()
            fail(text.splitlines()[0] if text else type(exc).__name__)

    return wrapper


# ---- shared options -----------------------------------------------------------------------------------------------
GraphArg = Annotated[str | None, typer.Argument(help="graph JSON file, example name (e.g. lios-fig3) or zoo model "
                                                       "(as --model NAME)")]
ModelOpt = Annotated[str | None, typer.Option("--model", help="zoo model name instead of a graph")]
ModelFileOpt = Annotated[Path | None, typer.Option("--model-file", help="a model saved by torch.export.save (.pt2) "
                                                                        "instead of a zoo name")]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu | cuda | auto (cuda when present)")]
StreamsOpt = Annotated[int | None, typer.Option("--streams", min=1, help="max streams per device")]
DevicesOpt = Annotated[int, typer.Option("--devices", min=1, help="number of devices")]
CostOpt = Annotated[str, typer.Option("--cost-model", help="ideal | gpu")]
PresetOpt = Annotated[str, typer.Option("--preset", help="device preset for zoo models' estimated latencies")]
BatchOpt = Annotated[int, typer.Option("--batch-size", min=1, help="samples per call (a zoo model's example batch)")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="fp32 | fp16 | bf16: what a zoo model's ops compute in "
                                                       "(estimated costs)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON object instead of a table")]
ProfileOpt = Annotated[Path | None, typer.Option("--profile", help="measured profile (opweave profile) for --model")]
CoarsenOpt = Annotated[bool, typer.Option("--coarsen/--no-coarsen",
                                           help="the papers' operators, each op merged with its epilogues, as "
                                                "opweave.compile plans them (--no-coarsen: one op per fx node)")]
OptionOpt = Annotated[list[str] | None, typer.Option(
    "--option", metavar="KEY=VALUE", help="any option of opweave.compile (e.g. cudagraphs=false, compiler=inductor, "
                                          "scheduler_options={\"sync_ms\": 0.1}), as in the options table; repeat "
                                          "for more")]
ModeOpt = Annotated[str | None, typer.Option(
    "--mode", help="a preset of options that means the same on every device, as torch.compile's: default, "
                   "reduce-overhead, max-autotune, max-autotune-no-cudagraphs (or --option mode=...)")]
LinkOpt = Annotated[str | None, typer.Option(
    "--link", help="link between devices: nvlink4, pcie4, pcie5, loopback or a file from opweave profile-links; "
                   "sets every edge's transfer time (HIOS schedulers, simulator)")]


def collect_options(texts: list[str] | None, mode: str | None = None, **flags) -> tuple[str, dict]:
    """A command's options, collected one way for every command that builds a model: ``--option KEY=VALUE`` items
    (:func:`opweave.pipeline.parse_option`), the ``mode`` (``--mode``, or ``--option mode=...``) and the command's
    own flags (None: not given). Returns the mode (``"default"`` when none) and the options, to be resolved
    (:func:`opweave.pipeline.resolve`, a server's :func:`opweave.serve.assemble.serving_options`); an option given
    both as a flag and with ``--option`` is refused naming it."""
    from opweave.pipeline import parse_option

    settings = dict(parse_option(text) for text in texts or [])
    if "mode" in settings:
        if mode is not None:
            raise UsageError("mode given both as --mode and with --option")
        mode = settings.pop("mode")
    both = sorted(k for k, v in flags.items() if v is not None and k in settings)
    if both:
        raise UsageError(f"option {both[0]!r} given both as --{both[0].replace('_', '-')} and with --option")
    return mode or "default", {**settings, **{k: v for k, v in flags.items() if v is not None}}


def graph_costs(graph: OpGraph, cost_model: str) -> Costs:
    if cost_model not in COST_MODELS:
        raise UsageError(f"unknown cost model {cost_model!r}{did_you_mean(cost_model, COST_MODELS)}; choose one of "
                         f"{', '.join(COST_MODELS)}")
    return from_graph(graph, model=cost_model)


def scheduler_names(name: str, also: tuple[str, ...] = ()) -> list[str]:
    """``name`` as the schedulers it names: one, a comma list or ``all`` (every one); ``also``: other names the
    command takes. The scheduler flag means this in every command."""
    if name == "all":
        return schedulers.names()
    names = [n.strip() for n in name.split(",") if n.strip()]
    for one in names or [name]:
        if one not in schedulers.names() and one not in also:
            known = [*also, *schedulers.names()]
            raise UsageError(f"unknown scheduler {one!r}{did_you_mean(one, known)}; choose "
                             f"{''.join(f'{a}, ' for a in also)}one of {', '.join(schedulers.names())} (a comma "
                             "list of them) or all")
    return list(dict.fromkeys(names))


def linked(graph: OpGraph, link: str | None) -> OpGraph:
    """``graph`` with every edge's transfer time over ``link`` (unchanged when no link is given)."""
    if link is None:
        return graph
    from opweave.costs.links import with_link

    return with_link(graph, link)


def graph_or_model(graph: str | None, model: str | None) -> tuple[str | None, str | None]:
    """``(graph, model)`` as a command takes them: a GRAPH that is neither a file nor an example but a zoo model's
    name is that model, as ``--model`` gives it."""
    from opweave import zoo
    from opweave.ir import examples

    if (graph is not None and model is None and graph not in examples.names() and not Path(graph).exists()
            and zoo.is_model(graph)):
        return None, graph
    return graph, model


def load_graph(graph: str | Path | None = None, model: str | None = None, *, batch_size: int = 1,
               preset: str = "h100", profile: str | Path | None = None, coarsen: bool = True,
               model_file: str | Path | None = None) -> OpGraph:
    """The graph the CLI's ``schedule`` and ``simulate`` work on: a graph JSON file or a shipped example
    (``graph``, which carries its own ops), or a zoo ``model`` captured at ``batch_size`` (or the ``.pt2``
    ``model_file``; :func:`opweave.capture.load`) and coarsened, as :func:`compile` plans it, unless
    ``coarsen=False``, with roofline latencies for ``preset``, or with the latencies measured in ``profile``.

    A profile must have been measured for this model, batch (input shapes), dtype and granularity; otherwise
    :class:`~opweave.costs.profile.ProfileKeyError`. Its device and torch version are not checked: scheduling and
    simulating a GPU's profile on another machine is the point (the graph then carries that GPU's costs).
    """
    from opweave.ir import examples

    if sum(x is not None for x in (graph, model, model_file)) != 1:
        raise UsageError("give a GRAPH (file or example name), --model NAME or --model-file PATH.pt2, one of them")
    if profile is not None and model is None:
        raise UsageError("--profile goes with --model (a graph file carries its own latencies)")
    if graph is None:
        from opweave.capture import load
        from opweave.costs.roofline import with_estimates

        source = Path(model_file) if model_file is not None else model
        assert source is not None  # one of the three, checked above
        _, inputs, captured = load(source, batch_size=batch_size, coarsen=coarsen)
        estimated = with_estimates(captured.graph, preset)
        if profile is None:
            return estimated
        from opweave.costs.profile import Profile, profile_key
        from opweave.costs.profile.store import model_dtype

        measured = Profile.load(profile)
        assert model is not None  # a profile goes with --model, checked above
        expect = profile_key(model, inputs, "cpu", model_dtype(captured, inputs))
        expect = {k: v for k, v in expect.items() if k not in ("device", "torch")}
        measured.check_key({**expect, "device": measured.key.get("device"), "torch": measured.key.get("torch")},
                           source=str(profile))
        return measured.apply(estimated)
    if str(graph) in examples.names():
        return examples.load(str(graph))
    if not Path(graph).exists():
        from opweave import zoo

        hint = did_you_mean(str(graph), [*examples.names(), *zoo.names()])  # a zoo name is taken as --model
        raise UsageError(f"no graph file, example or zoo model {str(graph)!r}{hint} (examples: "
                         f"{', '.join(examples.names())}; models: opweave models)")
    return OpGraph.load(graph)


def inductor_kernels(model: str | None, model_file: str | Path | None, batch_size: int = 1
                     ) -> tuple[OpGraph, dict[str, int], dict]:
    """A model's ops as Inductor's kernels when it compiles the whole model for CUDA (``graph="inductor"``,
    :mod:`opweave.backends.inductorgraph`), lowered here, on the CPU, without freezing, as CUDA's lowering is:
    convolutions as extern calls, BatchNorm and activations in Inductor's epilogue kernels. Returns the graph, the
    kernels each op launches, and the grouping's figures (kernels that compute no op: ``stats["unowned"]``)."""
    from opweave.backends.inductorgraph import inductor_graph
    from opweave.capture import load

    if model is None and model_file is None:
        raise UsageError("--inductor needs --model or --model-file: Inductor lowers the model itself")
    _, inputs, captured = load(Path(model_file) if model_file is not None else str(model), batch_size=batch_size,
                               coarsen=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its fallback warning: refused below instead
        regrouped = inductor_graph(captured, inputs, freeze=False)
    if not regrouped.kernels:
        raise UsageError(f"{captured.graph.name}: no plan over Inductor's kernels: "
                         f"{regrouped.stats.get('error', 'its lowering names no captured op')}")
    return regrouped.graph, regrouped.kernels, regrouped.stats


def fitted_gpu(cost_model: str, preset: str, dtype: str, *, inductor: bool = False) -> bool:
    """Whether ops are priced on a fitted GPU (``--cost-model gpu`` with a fitted preset); an unknown ``dtype`` is
    refused, and so is anything else with ``inductor`` (Inductor's kernels are priced on a fitted GPU only)."""
    from opweave.costs import calibrated

    if calibrated.DTYPES.get(dtype) is None:
        raise UsageError(f"unknown dtype {dtype!r}{did_you_mean(dtype, calibrated.DTYPES)}; choose one of "
                         f"{', '.join(calibrated.DTYPES)}")
    fitted = cost_model == "gpu" and preset.lower() in calibrated.FITTED
    if inductor and not fitted:
        raise UsageError(f"--inductor needs --cost-model gpu and a fitted preset ({', '.join(calibrated.FITTED)}): "
                         "Inductor's kernels are priced on a fitted GPU")
    return fitted


def run_one(graph: OpGraph, costs: Costs, name: str, streams: int | None, devices: int,
            replay: Costs | None = None):
    """Schedule, lower, validate and replay one scheduler: (schedule, plan, simulation result). The scheduler sees
    ``costs``; the replay runs under ``replay`` (default ``costs``)."""
    from opweave.backends.simulate import simulate
    from opweave.pipeline import plan_for

    sched, plan = plan_for(graph, costs, name, streams=streams,
                           devices=devices if name in schedulers.MULTI_DEVICE else 1)
    return sched, plan, simulate(graph, plan, replay or costs)


def device_costs(graph: OpGraph, cost_model: str, preset: str, dtype: str, measured: bool,
                 launches: dict[str, int] | None = None) -> tuple[OpGraph, Costs, Costs]:
    """(graph, the costs a scheduler sees, the costs the replay runs under) for ``simulate`` and ``schedule``.

    Under ``--cost-model gpu`` with a fitted preset (h200, h100: :mod:`opweave.costs.calibrated`) the ops get the
    fitted device's times, except where ``measured`` (a profile gave the graph its latencies), the schedulers see
    them as ideal costs (as the GPU benchmark's schedulers saw its profile) and the replay is the fitted model of one
    CUDA Graph call; ``launches``, the kernels Inductor launches per op (:func:`inductor_kernels`), replace the op
    classes' counts there. Otherwise the graph's own latencies (roofline estimates for ``dtype``, or the profile's)
    under ``cost_model``, for the scheduler and the replay alike."""
    from dataclasses import replace

    from opweave.costs import calibrated, roofline

    on_fitted_gpu = fitted_gpu(cost_model, preset, dtype, inductor=launches is not None)
    dtype = calibrated.DTYPES[dtype]
    if on_fitted_gpu:
        fitted = calibrated.costs(graph, calibrated.device(preset), dtype,
                                  latency_ms=graph.latencies() if measured else None, launches=launches)
        graph = OpGraph([replace(o, latency_ms=fitted.latency_ms[o.id], utilization=fitted.utilization[o.id])
                         for o in graph.ops], graph.edges, graph.name)
        return graph, replace(fitted, model="ideal"), fitted
    if dtype != "float32" and not measured and all(o.latency_ms is not None for o in graph.ops):
        graph = roofline.with_estimates(graph, preset, dtype)
    costs = graph_costs(graph, cost_model)
    return graph, costs, costs


def schedule_json(sched, plan, sim) -> dict:
    return {
        "scheduler": sched.scheduler, "makespan_ms": sim.makespan_ms, "sequential_ms": sim.sequential_ms,
        "scheduling_time_s": sched.scheduling_time_s, "streams_used": sched.streams_used,
        "devices_used": sched.devices_used, "syncs": plan.syncs,
        "ops": [{"id": o, "device": sched.device(o), "stream": sched.stream_of[o],
                 "stage": None if sched.stage_of is None else sched.stage_of[o],
                 "start_ms": sim.start_ms[o], "finish_ms": sim.finish_ms[o]} for o in sched.order],
        "plan": plan.to_list(),
    }


