"""Putting a server together from options: models, executor, policy, engine (shared by ``opweave serve``,
``opweave loadgen --simulate`` and the serving benchmark)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from opweave import zoo
from opweave.errors import UsageError, did_you_mean
from opweave.pipeline.options import Options
from opweave.serve.engine import policies
from opweave.serve.engine.combined import Part
from opweave.serve.engine.cpu import CpuExecutor
from opweave.serve.engine.cuda import CudaExecutor
from opweave.serve.engine.engine import Engine
from opweave.serve.engine.executors import Executor, RealClock
from opweave.serve.engine.simulation import SimClock, SimExecutor
from opweave.serve.models import ServedModel, check_name, load

DEVICES = ("cpu", "cuda", "sim")
# The policy a server runs unless told (docs/serving.md, "Results"): on a CPU `static` sustained the highest rates
# measured (ONNX Runtime's intra-op threads already fill the cores, and the instances `heuristic` keeps in flight only
# lengthen each request); on a GPU, where one block leaves most of the device idle, `heuristic`.
DEFAULT_POLICIES = {"cpu": "static", "cuda": "heuristic", "sim": "heuristic"}


def default_policy(device: str) -> str:
    """The serving policy for ``device`` when none is asked for (:data:`DEFAULT_POLICIES`)."""
    if device not in DEFAULT_POLICIES:
        raise UsageError(f"device must be one of {', '.join(DEVICES)}, got {device!r}{did_you_mean(device, DEVICES)}")
    return DEFAULT_POLICIES[device]


def load_models(names: list[str], files: dict[str, Path] | None = None, *, device: str = "cpu", max_batch: int = 8,
                image_size: int | dict[str, int] | None = None,
                cuts: dict[str, list[str]] | None = None,
                say: Callable[[str], None] | None = None) -> dict[str, ServedModel]:
    """Zoo models ``names`` and exported programs ``files`` (name -> path), captured and split into blocks.
    ``image_size``: one size for every zoo CNN, or per model (see :func:`parse_image_size`). ``device`` "sim" loads
    on the CPU (only the graphs are used). ``say``: told what is under way, one line per model (a progress bar)."""
    sizes = image_size if isinstance(image_size, dict) else {"*": image_size}
    files = files or {}
    check_models(names, files)
    where = "cpu" if device == "sim" else device
    out = {}
    every = [*names, *files]
    for i, name in enumerate(every, 1):
        if say is not None:
            say(f"loading {name} ({i}/{len(every)}): capture and blocks")
        out[name] = load(name, path=files.get(name), device=where, max_batch=max_batch,
                         image_size=sizes.get(name, sizes.get("*")), cuts=(cuts or {}).get(name))
    return out


def check_models(names: list[str], files: dict[str, Path]) -> None:
    """The names :func:`load_models` is given, checked before the first model loads: each a zoo model (with the name
    it was likely meant to be) or a file's, none both, none reserved, and one at least."""
    both = sorted(set(names) & set(files))
    if both:
        raise UsageError(f"model {both[0]!r} is both a zoo name and a --model-file")
    if not names and not files:
        raise UsageError("no model to serve; give --models and/or --model-file")
    for name in [*names, *files]:
        check_name(name)
        if name not in files:
            zoo.check(name)


def parse_image_size(text: str | None) -> dict[str, int] | None:
    """``"64"`` (every model) or ``"64,inception_v3=75"`` (a default and per-model sizes) as a dict, ``*`` the
    default."""
    if not text:
        return None
    out: dict[str, int] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        model, sep, size = item.rpartition("=")
        if not size.isdigit() or int(size) < 1:
            raise UsageError(f"--image-size {item!r} must be N or MODEL=N with N a positive integer")
        out[model if sep else "*"] = int(size)
    return out


def load_profiles(items: list[str] | None, models: dict[str, ServedModel]) -> dict[str, dict[int, object]]:
    """``MODEL=PATH`` items: profiles (``opweave profile``) of served models, by the batch they were measured at (the
    first dimension of the profile's first input shape). A profile measured for another model is refused."""
    from opweave.costs.profile import Profile

    out: dict[str, dict[int, object]] = {}
    for item in items or []:
        model, sep, path = item.partition("=")
        if not sep or model not in models:
            raise UsageError(f"--profile {item!r} must be MODEL=PATH with MODEL one of {', '.join(models)}"
                             f"{did_you_mean(model, models)}")
        prof = Profile.load(path)
        missing = [op for op in models[model].blocked.captured.graph.ids if op not in prof.latency_ms]
        if missing:
            raise UsageError(f"--profile {path}: no latency for op {missing[0]!r} of {model} (measured for "
                             f"{prof.key.get('model')!r})")
        shapes = prof.key.get("input_shapes") or [[1]]
        out.setdefault(model, {})[int(shapes[0][0]) if shapes[0] else 1] = prof
    return out


def parse_cuts(items: list[str] | None) -> dict[str, list[str]]:
    """``MODEL=op1+op2`` items (the manual block cuts) as a dict."""
    out: dict[str, list[str]] = {}
    for item in items or []:
        model, sep, ops = item.partition("=")
        if not sep or not model or not ops:
            raise UsageError(f"--cuts {item!r} must be MODEL=OP[+OP...]")
        out[model] = [o for o in ops.split("+") if o]
    return out


def serving_options(device: str, options: dict | None = None, *, mode: str | None = None, **flags) -> Options:
    """The one resolved :class:`~opweave.pipeline.Options` a server on ``device`` (cpu, cuda, sim) builds every
    combined block with, from ``mode``, ``options`` (``--option KEY=VALUE``) and ``flags`` (``--scheduler``,
    ``--streams``, ``--threads``, ``--compiler``; one given both ways is refused): checked as ``opweave.compile``
    checks them, with the serving preset's defaults (:class:`opweave.pipeline.options.Served`, the options table's
    last column), before any model loads. What a server cannot honour is a :class:`~opweave.errors.UsageError`
    naming it and why, never dropped: the cost sources and ``fold_bn``, a plan over several devices or over another
    graph than the blocks' fx nodes, a mode that searches, and in simulation anything but the plan's own options
    (the simulator runs no op)."""
    from opweave.pipeline import resolve

    if device not in DEVICES:
        raise UsageError(f"device must be one of {', '.join(DEVICES)}, got {device!r}{did_you_mean(device, DEVICES)}")
    return resolve("cpu" if device == "cpu" else "cuda", mode, options, check_device=False, serving=device, **flags)


def make_engine(models: dict[str, ServedModel], *, device: str = "cpu", options: Options | None = None,
                policy: str | None = None, policy_options: dict | None = None, max_queue: int = 64,
                max_batch: int = 8, max_sub_blocks: int = 4, timeout_s: float | None = None,
                preset: str = "h100", step_overhead_ms: float = 0.03, profiles: dict | None = None,
                warm: bool = True, say: Callable[[str], None] | None = None) -> Engine:
    """An engine on the real executor of ``device`` (cpu, cuda) or on the simulator (``sim``), its combined blocks
    built with ``options`` (:func:`serving_options` of the device: the serving preset, unless given), under
    ``policy`` (default: :func:`default_policy` of the device). In simulation, ``preset`` (the roofline preset of the
    simulated GPU), ``step_overhead_ms`` and ``profiles`` (see :func:`load_profiles`, replacing roofline latencies)
    go to :class:`~opweave.serve.engine.simulation.SimExecutor`. ``warm`` compiles every block alone at batch 1 first
    (and checks it runs): with a compiler, every block's first variants up front (its any-batch session, or its
    batch-1 variant: :meth:`~opweave.serve.engine.cpu.CpuExecutor.warm_model`); other batches when first asked for.
    ``say``: told what is under way, model by model (a progress bar)."""
    options = serving_options(device) if options is None else options
    if options.serving != device:
        raise UsageError(f"the options of a server on {device} are resolved by serving_options({device!r}, ...)")
    blocked = {name: m.blocked for name, m in models.items()}
    executor: Executor
    if device == "sim":
        executor = SimExecutor(blocked, options, preset=preset, step_overhead_ms=step_overhead_ms, profiles=profiles)
        clock: RealClock | SimClock = SimClock()
    elif device == "cuda":
        executor = CudaExecutor(blocked, options)
        clock = RealClock()
    else:
        executor = CpuExecutor(blocked, options)
        clock = RealClock()
    for name, m in blocked.items():
        executor.check_sizes(name, m)
    policy = policy or default_policy(device)
    engine = Engine(executor, policies.create(policy, **(policy_options or {})), clock, max_queue=max_queue,
                    max_batch=max_batch, max_sub_blocks=max_sub_blocks, timeout_s=timeout_s)
    if warm:
        if isinstance(executor, CpuExecutor) and executor.compiler is not None:
            executor.warm_models(max_batch, say=say)
        if say is not None:
            say("running every model once")
        warm_up(engine)
    return engine


def warm_up(engine: Engine) -> None:
    """Run each model once, block by block alone at batch 1, on its example inputs (compiles those signatures)."""
    ex = engine.executor
    for name, model in ex.models.items():
        state = ex.prepare(name, [model.flat_inputs(model.example_inputs)]) if not simulated(ex) else None
        for b in range(len(model.blocks)):
            part = Part(name, b, 1, state)
            ex.run([part])
            state = part.state


def simulated(executor) -> bool:
    """Whether ``executor`` times its blocks in simulation (it runs no op)."""
    return isinstance(executor, SimExecutor)


__all__ = ["DEFAULT_POLICIES", "DEVICES", "default_policy", "load_models",
           "load_profiles", "make_engine", "parse_cuts", "parse_image_size", "serving_options", "warm_up"]
