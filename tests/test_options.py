"""One vocabulary: every option of :data:`opweave.pipeline.OPTIONS`, on every device, through every door
(``opweave.compile``, ``torch.compile(backend="opweave")``, the CLI's ``--option``, the server's executors), is either
used or refused with a :class:`~opweave.errors.UsageError` before anything touches a device."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import opweave
import opweave.dynamo
from opweave.backends.ortgraph import OrtLanes
from opweave.capture import coarsen
from opweave.costs.profile import profile_model
from opweave.costs.roofline import estimate
from opweave.errors import DeviceError, UsageError
from opweave.pipeline import MODES, OPTIONS, Options, mode_options, option_table, parse_option, resolve, targets
from opweave.pipeline.tiers import Tiered
from opweave.testing.fakecuda import FakeCuda


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 1)
        self.norm = nn.BatchNorm2d(4)

    def forward(self, x):
        return torch.relu(self.norm(self.a(x))) + torch.sigmoid(self.b(x))


def tiny():
    torch.manual_seed(0)
    return Tiny().eval(), (torch.randn(1, 3, 8, 8),)


SAMPLES = {"runtime": FakeCuda(seed=0), "scheduler": "lios", "streams": 2, "devices": 2, "cost_model": "gpu",
           "coarsen": False, "fold_bn": True,
           "graph": "onnxruntime", "compiler": "eager", "scheduler_options": {"sync_ms": 0.125}, "threads": 1,
           "cudagraphs": False, "capture_fallback": "eager", "static_outputs": True, "cache_size": 2, "dynamic": False,
           "tiers": False,
           "buckets": "pow2", "warmup": 1,
           "link": "loopback", "timeout_s": 60.0, "start_method": "spawn"}  # costs and profile: made per model
CUDA_ONLY = {"cudagraphs", "capture_fallback", "static_outputs", "warmup", "runtime"}
RANKS_ONLY = {"link", "timeout_s", "start_method"}  # alone: refused (they need devices > 1)
CPU_ONLY = {"graph", "threads", "tiers"}
WITH = {"fold_bn": {"coarsen": False},  # coarsening folds BatchNorm too: its effect shows on the fx nodes
        "scheduler_options": {"scheduler": "heft"}}  # without a scheduler the guard may keep one lane


def expected_refused(device: str) -> set[str]:
    return RANKS_ONLY | (CUDA_ONLY if device == "cpu" else CPU_ONLY)


def test_every_option_is_in_the_table_and_has_a_sample():
    assert set(OPTIONS) == set(SAMPLES) | {"costs", "profile"}
    assert [row["name"] for row in option_table()] == list(OPTIONS)
    assert all(row["meaning"] and row["devices"] and row["default"] for row in option_table())
    assert set(OPTIONS) <= {f.name for f in __import__("dataclasses").fields(Options)}


def test_every_default_is_the_one_the_table_says_and_the_code_uses():
    """Defaults lived twice, as strings in the table and as values in the target code (the ranks' link, the
    stream caps, the threads), free to drift: now each lives in its Spec, which fills the resolved options."""
    from opweave.backends.streams import default_streams
    from opweave.backends.threads import total_threads

    for device in ("cpu", "cuda"):
        options = resolve(device, check_device=False)
        for key, spec in OPTIONS.items():
            if not callable(spec.default):
                assert getattr(options, key) == spec.default, (device, key)
                assert option_table()[list(OPTIONS).index(key)]["default"] == spec.default_text()
    cpu, cuda = resolve("cpu", threads=3), resolve("cuda", check_device=False)
    assert (cpu.scheduler, cpu.streams, cpu.threads, cpu.cudagraphs) == ("heft", 3, 3, False)
    assert resolve("cpu").threads == total_threads() == resolve("cpu").streams
    assert (cuda.scheduler, cuda.streams, cuda.cudagraphs, cuda.threads) == (None, default_streams(), True, None)
    ranks = resolve("cpu", devices=2)
    assert (ranks.scheduler, ranks.link, ranks.streams, ranks.threads) == ("hios-lp", "loopback", None,
                                                                         total_threads(ranks=2))
    assert resolve("cuda", devices=2, check_device=False).link == "nvlink4"
    assert Options(devices=2, link="pcie4").given == {"devices", "link"}  # made directly: what was passed


def _samples(captured_graph, profile_path) -> dict:
    return {**SAMPLES, "costs": estimate(captured_graph, "cpu", model="ideal"), "profile": str(profile_path)}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The tiny model, its inputs, and a profile and costs of its coarsened graph (what compile schedules)."""
    from opweave.capture import capture

    model, inputs = tiny()
    coarse = coarsen(capture(model, inputs))
    path = tmp_path_factory.mktemp("profile") / "tiny.profile.json"
    profile_model(coarse, inputs, device="cpu", repeats=2, warmup=1).save(path)
    return model, inputs, coarse, path


# ---- resolve: the table of outcomes, on both devices (no device needed) ------------------------------------------
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_each_option_alone_is_set_or_refused_by_resolve(device, made):
    _, _, coarse, path = made
    for key, value in _samples(coarse.graph, path).items():
        if key in expected_refused(device):
            with pytest.raises(UsageError, match=repr(key)):
                resolve(device, check_device=False, **{key: value})
        else:
            options = resolve(device, check_device=False, **{key: value})
            assert getattr(options, key) == value and key in options.given, key


def test_rank_options_are_used_with_several_devices():
    options = resolve("cpu", devices=2, link="loopback", timeout_s=60.0, start_method="spawn", threads=1)
    assert (options.link, options.timeout_s, options.start_method, options.threads) == ("loopback", 60.0, "spawn", 1)
    for key in ("compiler", "graph"):
        with pytest.raises(UsageError, match=f"option {key!r} applies to one device"):
            resolve("cpu", devices=2, **{key: SAMPLES[key]})


def test_values_are_checked_and_modes_are_presets():
    for key, bad in (("streams", 0), ("coarsen", "yes"), ("compiler", "tvm"), ("scheduler", "fastest"),
                     ("capture_fallback", "retry"), ("timeout_s", -1), ("cost_model", "real")):
        with pytest.raises(UsageError, match=f"option {key!r} must be"):
            resolve("cuda" if key == "capture_fallback" else "cpu", check_device=False, **{key: bad})
    assert mode_options("reduce-overhead") == {"cudagraphs": True} and mode_options("max-autotune")["autotune"]
    assert resolve("cuda", "reduce-overhead", check_device=False).cudagraphs
    assert resolve("cuda", check_device=False).cudagraphs  # opweave's default records CUDA Graphs too
    assert not resolve("cuda", "max-autotune-no-cudagraphs", check_device=False).cudagraphs
    with pytest.raises(UsageError, match="contradicts"):
        resolve("cuda", "reduce-overhead", cudagraphs=False, check_device=False)
    with pytest.raises(UsageError, match=r"unknown option 'fuse' \(now 'compiler'\)"):
        resolve("cpu", fuse="inductor")
    with pytest.raises(UsageError, match="given both as a keyword and in options"):
        resolve("cpu", "default", {"streams": 2}, streams=3)
    assert parse_option("cudagraphs=false") == ("cudagraphs", False)
    assert parse_option("streams=4") == ("streams", 4)
    assert parse_option('scheduler_options={"sync_ms": 0.5}') == ("scheduler_options", {"sync_ms": 0.5})


def test_cuda_on_a_machine_without_one_is_a_device_error_after_the_options_are_checked():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    model, inputs = tiny()
    with pytest.raises(DeviceError):
        opweave.compile(model, inputs, device="cuda", cudagraphs=False)
    with pytest.raises(UsageError):  # a bad option is told first, before the missing device
        opweave.compile(model, inputs, device="cuda", graph="onnxruntime")


# ---- the doors ------------------------------------------------------------------------------------------------
def effect(key: str, value, fast, coarse) -> bool:
    """Whether compiled ``fast`` shows that option ``key`` was used."""
    if key == "scheduler":
        return fast.schedule.scheduler == value
    if key == "streams":
        return fast.schedule.streams_used <= value and fast.options.streams == value
    if key == "devices":
        return len(fast.backend.pids) == value  # one rank process per device
    if key == "costs":
        return fast.costs.latency_ms == value.latency_ms
    if key == "profile":
        return fast.costs.latency_ms == json.loads(open(value).read())["latency_ms"]
    if key == "cost_model":
        return fast.costs.model == value
    if key == "coarsen":
        return len(fast.graph) > len(coarse)
    if key == "fold_bn":
        return not any("batch_norm" in (op.target or "") for op in fast.captured.graph.ops)
    if key == "graph":
        return isinstance(fast.backend, OrtLanes)
    if key == "compiler":
        return fast.fused is not None and fast.fused.compiler == value
    if key == "scheduler_options":
        return fast.schedule.options.get("sync_ms") == value["sync_ms"]
    if key == "threads":
        return fast.schedule.streams_used == 1  # one thread: one lane
    if key == "dynamic":
        return fast.variants.dynamic is value
    if key == "tiers":
        return fast.options.tiers is value and not isinstance(fast.backend, Tiered)
    if key == "buckets":
        return fast.variants.sizes.buckets == value
    if key == "cache_size" and fast.variants.bound != value:
        return False
    if key == "cache_size" and fast.device == "cpu":
        return True
    if key in ("cudagraphs", "capture_fallback", "static_outputs", "cache_size", "warmup", "runtime"):
        return getattr(fast.backend, key) is value or getattr(fast.backend, key) == value
    raise AssertionError(key)


def test_compile_uses_or_refuses_every_option_on_the_cpu(made):
    model, inputs, coarse, path = made
    for key, value in _samples(coarse.graph, path).items():
        if key in expected_refused("cpu"):
            with pytest.raises(UsageError, match=repr(key)):
                opweave.compile(model, inputs, device="cpu", **{key: value})
            continue
        with opweave.compile(model, inputs, device="cpu", **{key: value}, **WITH.get(key, {})) as fast, \
                torch.inference_mode():
            assert effect(key, value, fast, coarse.graph), key
            assert opweave.outputs.compare(model(*inputs), fast(*inputs), tolerance=1e-4).ok, key


def test_compile_uses_or_refuses_every_option_on_cuda_through_the_fake_runtime(made):
    """The CUDA door for real, on the CPU: the fake CUDA runtime (opweave.testing.fakecuda) runs the CUDA target's
    plans, graphs and streams; ranks are left out (no GPU to give each rank)."""
    model, inputs, coarse, path = made
    samples = {k: v for k, v in _samples(coarse.graph, path).items() if k not in ("devices", "profile")}
    needs = {"capture_fallback": {"cudagraphs": True}, "static_outputs": {"cudagraphs": True},
             "warmup": {"cudagraphs": True}, "fold_bn": {"coarsen": False}}
    for key, value in samples.items():
        given = {"runtime": FakeCuda(seed=1), **needs.get(key, {}), key: value}
        if key in expected_refused("cuda"):
            with pytest.raises(UsageError, match=repr(key)):
                opweave.compile(model, inputs, device="cuda", **given)
            continue
        with opweave.compile(model, inputs, device="cuda", **given) as fast, torch.no_grad():
            assert effect(key, value, fast, coarse.graph), key
            got = fast(*inputs)
            given["runtime"].synchronize()
            assert opweave.outputs.compare(model(*inputs), got, tolerance=1e-4).ok, key


def test_the_torch_compile_backend_uses_or_refuses_every_option(made):
    model, inputs, coarse, path = made
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend="opweave", options={"coarsen": False})(*inputs)  # the graph as dynamo gave it
    # dynamo's graph coarsened, as a compile given costs plans it (not the default compile's: its graph is coarse
    # or not as the candidate that won its race planned): costs and profile must name its ops
    dynamo = coarsen(opweave.dynamo.last_compiled().captured)
    dynamo_path = path.parent / "dynamo.profile.json"
    profile_model(dynamo, dynamo.example_inputs, device="cpu", repeats=2, warmup=1).save(dynamo_path)
    samples = {**_samples(dynamo.graph, dynamo_path), "costs": estimate(dynamo.graph, "cpu", model="ideal")}
    for key, value in samples.items():
        torch._dynamo.reset()
        fast = torch.compile(model, backend="opweave", options={key: value, **WITH.get(key, {})})
        # dynamo's graphs hold no BatchNorm module to fold; a runtime makes the graph CUDA's (the fake one here)
        if key in (expected_refused("cpu") - {"runtime"}) | {"fold_bn"}:
            with torch.no_grad(), pytest.raises(Exception, match=repr(key)) as info:
                fast(*inputs)
            assert any(isinstance(e, UsageError) for e in _chain(info.value)), key
            continue
        with torch.no_grad():
            got = fast(*inputs)
            SAMPLES["runtime"].synchronize()
            assert opweave.outputs.compare(model(*inputs), got, tolerance=1e-4).ok, key
        compiled = opweave.dynamo.last_compiled()
        assert effect(key, value, compiled, dynamo.graph if key != "coarsen" else coarse.graph), key
        compiled.close()
    torch._dynamo.reset()


def test_the_cli_takes_every_option_with_the_same_outcome(made, tmp_path):
    from opweave.cli import app

    model, inputs, coarse, path = made
    program = tmp_path / "tiny.pt2"
    torch.export.save(torch.export.export(model, inputs), program)
    runner = CliRunner()
    for key, value in _samples(coarse.graph, path).items():
        if key in ("costs", "profile", "coarsen", "devices"):
            continue  # a Costs has no text form; profile, coarsen and the ranks have their own flags (tested there)
        text = json.dumps(value) if isinstance(value, dict) else str(value).lower() if isinstance(value, bool) \
            else str(value)
        scheduler = value if key == "scheduler" else "heft" if key == "scheduler_options" else "sequential"
        flags = [] if key == "scheduler" else ["--option", f"{key}={text}"]
        result = runner.invoke(app, ["bench", "--model-file", str(program), "--device", "cpu", "--runs", "1",
                                     "--warmup", "0", "--json", "--schedulers", scheduler, *flags])
        if key in expected_refused("cpu") | {"fold_bn"}:  # an exported program has no BatchNorm module to fold
            assert result.exit_code == 2 and (repr(key) in result.output or key in result.output), (key, result.output)
        else:
            assert result.exit_code == 0, (key, result.output)
            assert all(row.get("ok", True) for row in json.loads(result.stdout)["rows"]), key


SERVED = {"cpu": {"scheduler", "streams", "cost_model", "coarsen", "compiler", "scheduler_options", "threads",
                  "cache_size", "tiers"},
          "cuda": {"scheduler", "streams", "cost_model", "coarsen", "compiler", "scheduler_options", "cudagraphs",
                   "capture_fallback", "cache_size", "warmup", "runtime"},
          "sim": {"scheduler", "streams", "cost_model", "coarsen", "scheduler_options"}}


@pytest.mark.parametrize("device", ["cpu", "cuda", "sim"])
def test_the_server_resolves_every_option_and_refuses_what_it_cannot_honour(device, made):
    """One resolved Options for every combined block, checked as opweave.compile checks them; what a server cannot
    honour (the cost sources, BatchNorm folding, several devices, another graph, ops in simulation) is refused
    naming the option. Before, it took scheduler, streams and (CPU) compiler alone, and replaced the scheduler with
    heft whenever blocks were compiled whole."""
    from opweave.serve.assemble import serving_options

    _, _, coarse, path = made
    for key, value in _samples(coarse.graph, path).items():
        if key in SERVED[device]:
            options = serving_options(device, {key: value, **(WITH[key] if key == "scheduler_options" else {})})
            assert getattr(options, key) == value and key in options.given, key
        else:
            with pytest.raises(UsageError, match=repr(key)):
                serving_options(device, {key: value})


def test_a_server_with_blocks_compiled_whole_keeps_the_scheduler_it_is_given(made):
    from opweave.serve.assemble import serving_options
    from opweave.serve.engine import blocks
    from opweave.serve.engine.cpu import CpuExecutor

    model, inputs, _, _ = made
    blocked = blocks.split(opweave.capture.capture(model, inputs), inputs, name="tiny")
    assert CpuExecutor({"t": blocked}, serving_options("cpu", compiler="eager")).scheduler == "heft"  # its default
    assert CpuExecutor({"t": blocked}, serving_options("cpu", compiler="eager", scheduler="lios")).scheduler == "lios"


def _chain(exc):
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


def test_an_option_the_scheduler_does_not_take_is_a_usage_error_naming_it():
    model, inputs = tiny()  # raised a raw TypeError from inside the scheduler before
    with pytest.raises(UsageError, match="scheduler 'sequential' takes no option 'sync_ms'"):
        opweave.compile(model, inputs, scheduler="sequential", scheduler_options={"sync_ms": 0.1})
    with opweave.compile(model, inputs, scheduler_options={"sync_ms": 0.1}) as fast:  # the default plan's guard
        assert fast.choice["label"] in targets.DEFAULT_LABELS  # builds one lane without heft's option


def test_the_docs_show_the_options_table_as_it_is():
    from pathlib import Path

    from opweave.pipeline.options import options_markdown

    root = Path(__file__).resolve().parent.parent
    for doc in ("README.md", "docs/design.md"):
        assert options_markdown() in (root / doc).read_text(), f"{doc}: the options table is out of date"


# ---- every way in takes one resolved Options, checked before any model loads --------------------------------------
class Built(Exception):
    """The pipeline (or the server's engine) was reached: what it was given is recorded."""


def _text(value) -> str:
    """An option's value as the command line gives it (objects without a text form go as a name)."""
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, bool):
        return str(value).lower()
    return type(value).__name__ if not isinstance(value, (str, int, float)) else str(value)


@pytest.fixture
def ways_in(monkeypatch, made, tmp_path):
    """Counts model loads (``capture.load``, the one way from a name to a model, and ``capture``) and stops at the
    pipeline's ``build`` or the server's ``make_engine``, recording the options they were given."""
    import opweave.api
    import opweave.capture
    import opweave.pipeline
    import opweave.pipeline.flow
    import opweave.serve.assemble
    import opweave.serve.engine.cpu
    import opweave.serve.engine.cuda

    model, inputs, _, path = made
    model.keywords = ()  # as a loaded program says it takes no keyword inputs
    real_capture = opweave.capture.capture
    seen = {"loads": 0, "options": []}

    def capture(*args, **kwargs):
        seen["loads"] += 1
        return real_capture(*args, **kwargs)

    def load(*args, **kwargs):
        seen["loads"] += 1
        return model, inputs, real_capture(model, inputs)

    def build(captured, example_inputs, options, **kwargs):
        seen["options"].append(options)
        raise Built

    def make_engine(models, *, options=None, **kwargs):
        seen["options"].append(options)
        raise Built

    monkeypatch.setattr(opweave.capture, "capture", capture)
    monkeypatch.setattr(opweave.api, "capture", capture)
    monkeypatch.setattr(opweave.capture, "load", load)
    for module in (opweave.pipeline, opweave.pipeline.flow, opweave.api, opweave.serve.engine.cpu,
                   opweave.serve.engine.cuda):
        monkeypatch.setattr(module, "build", build)
    monkeypatch.setattr(opweave.serve.assemble, "make_engine", make_engine)
    program = tmp_path / "tiny.pt2"
    program.write_bytes(b"loaded by the stand-in")
    samples = {**_samples(made[2].graph, path), "runtime": FakeCuda(seed=2)}
    return seen, samples, str(program)


def _outcome(seen: dict, key: str, value, raised: BaseException | None, door: str) -> str:
    """``"used"`` (the options the pipeline got hold ``key`` as given, with ``value``) or ``"refused"`` (a
    UsageError, and no model was loaded); anything else fails."""
    chain = list(_chain(raised))
    if any(isinstance(e, Built) for e in chain):
        options = seen["options"][-1]
        expected = parse_option(f"{key}={_text(value)}")[1] if door in ("bench", "serve", "run") else value
        assert key in options.given, (door, key)
        assert getattr(options, key) == expected or str(getattr(options, key)) == str(expected), (door, key)
        return "used"
    assert any(isinstance(e, UsageError) for e in chain), (door, key, raised)
    assert seen["loads"] == 0, (door, key, "a model was loaded before the refusal")
    return "refused"


def test_every_option_through_every_way_in_is_used_or_refused_before_a_model_loads(ways_in):
    """``opweave.compile``, the ``torch.compile`` backend, ``opweave bench -o``, ``opweave serve -o``, ``opweave run
    -o`` and the Ray deployment: each option either reaches the pipeline (or the server's engine) as given, or is a
    UsageError before any model is loaded. Before, the server checked its own list after loading the models,
    ``bench`` checked one dict and built with another (``-o scheduler=``, ``coarsen``, ``devices`` passed the check
    and failed after the load), and ``run`` took no option but its flags (dropping ``--threads`` under torchrun and
    ``--link``/``--timeout`` with one device)."""
    from opweave.cli import app
    from opweave.dynamo import opweave_backend
    from opweave.serve.ray import Replica, ReplicaOptions

    seen, samples, program = ways_in
    model, inputs = tiny()
    traced = torch.fx.symbolic_trace(model)
    runner = CliRunner()
    outcomes: dict[str, dict[str, str]] = {}

    def attempt(door: str, key: str, value, call, *args, **kwargs) -> None:
        seen["loads"], raised = 0, None
        try:
            result = call(*args, **kwargs)
            raised = getattr(result, "exception", None)
            if raised is not None and isinstance(raised, SystemExit) and result.exit_code == 2:
                raised = UsageError(result.output)  # the command line's one-line refusal
        except Exception as exc:  # noqa: BLE001 - judged by _outcome
            raised = exc
        outcomes.setdefault(door, {})[key] = _outcome(seen, key, value, raised, door)

    ranks = {"devices", "link", "timeout_s", "start_method"}
    for key, value in samples.items():
        with_ranks = {"devices": 2} if key in ranks - {"devices"} else {}
        option = ["--option", f"{key}={_text(value)}"]
        attempt("compile", key, value, opweave.compile, model, inputs, **with_ranks, **{key: value})
        with torch.no_grad():  # dynamo compiles an inference graph under no_grad
            attempt("torch.compile", key, value, opweave_backend, traced, inputs, options={**with_ranks, key: value})
        scheduler = "hios-lp" if key in ranks else "heft" if key == "scheduler_options" else "sequential"
        attempt("bench", key, value, runner.invoke, app, [
            "bench", "--model-file", program, "--device", "cpu", "--json", "--schedulers", scheduler,
            *(["--option", "devices=2"] if with_ranks else []), *option])
        attempt("serve", key, value, runner.invoke, app, [
            "serve", "--model-file", f"tiny={program}", "--port", "0", *option])
        attempt("run", key, value, runner.invoke, app, [
            "run", "--model", "tiny", "--devices", "2" if with_ranks else "1", "--json", *option])
        attempt("ray", key, value, lambda options: Replica(ReplicaOptions(
            model_files={"tiny": program}, options={"compiler": "none", **options})), {key: value})
    every = set(samples)
    assert all(set(by_key) == every for by_key in outcomes.values())
    used = {door: {k for k, v in by_key.items() if v == "used"} for door, by_key in outcomes.items()}
    # on the CPU every way in uses what applies there, but: the torch.compile backend takes a runtime for CUDA and
    # holds no BatchNorm module to fold; a command line writes no Costs object, and bench's and run's own flags
    # (--schedulers, --devices) are the scheduler and the devices there; a server costs and captures its blocks itself
    assert used["compile"] == every - CUDA_ONLY | {"runtime"}  # no device given: a runtime means CUDA
    assert used["torch.compile"] == every - CUDA_ONLY - {"fold_bn"} | {"runtime"}
    assert used["bench"] == every - CUDA_ONLY - {"costs", "scheduler"}
    assert used["run"] == every - CUDA_ONLY - {"costs", "devices"}
    assert used["serve"] == {"scheduler", "streams", "cost_model", "coarsen", "compiler", "scheduler_options",
                             "threads", "cache_size", "tiers"}  # tiers=false: a server's blocks keep their first
    # the replica here serves TOP's combined op graphs (no compiler): lios, which takes no sync_ms, refused at the door
    assert used["ray"] == used["serve"] - {"scheduler_options"}


def test_the_ray_deployment_refuses_an_option_before_ray_starts():
    ray = pytest.importorskip("ray")
    from opweave.serve.ray import ReplicaOptions, deploy

    with pytest.raises(UsageError, match="option 'devices' does not apply to serving"):
        deploy(ReplicaOptions(models=["squeezenet"], options={"devices": 2}))
    assert not ray.is_initialized()


# ---- resolved once at each door, handed down resolved ------------------------------------------------------------
def test_derived_options_are_checked_and_join_the_request():
    """What a target, a search or a server derives from resolved options goes through ``Options.derive``, which
    checks it by every rule ``resolve`` checks; ``Options.replace`` changed fields unchecked."""
    from opweave.backends.compilers import available

    options = resolve("cpu", scheduler="lios")
    assert not hasattr(options, "replace")
    with pytest.raises(UsageError, match="option 'streams' must be an integer >= 1"):
        options.derive(streams=0)
    with pytest.raises(UsageError, match="unknown option 'bogus'"):
        options.derive(bogus=1)
    with pytest.raises(UsageError, match="unknown option 'guard'"):  # follows from what was asked
        options.derive(guard=False)
    with pytest.raises(UsageError, match="option 'warmup' applies to device='cuda' only"):
        options.derive(warmup=1)
    derived = options.derive(scheduler="sequential", streams=1)
    assert (derived.scheduler, derived.streams, derived.guard) == ("sequential", 1, False)
    assert derived.given == options.given | {"streams"}
    assert options.derive(scheduler=None).scheduler == "heft" and options.derive(scheduler=None).guard
    served = resolve("cpu", serving="cpu")  # a server's blocks as ops of a plan: no compiler of the plan's own
    assert served.compiler == ("onnxruntime" if "onnxruntime" in available() else None)
    assert served.derive(compiler=None).compiler is None


def test_derive_refuses_the_rules_across_options_that_resolve_refuses():
    """``derive`` re-ran only the per-value checks: ``resolve("cpu", serving="cpu", fold_bn=True)`` was refused while
    ``resolve("cpu", serving="cpu").derive(fold_bn=True)`` was accepted, as were a compiler with several devices and
    a scheduler option the scheduler does not take."""
    with pytest.raises(UsageError, match="option 'fold_bn' does not apply to serving on cpu"):
        resolve("cpu", serving="cpu").derive(fold_bn=True)
    with pytest.raises(UsageError, match="option 'compiler' applies to one device"):
        resolve("cpu", devices=2).derive(compiler="eager")
    with pytest.raises(UsageError, match="scheduler 'lios' takes no option 'sync_ms'"):
        resolve("cpu", scheduler="lios").derive(scheduler_options={"sync_ms": 0.1})
    with pytest.raises(UsageError, match="mode='max-autotune' chooses the plan itself: give no 'scheduler'"):
        resolve("cpu", "max-autotune").derive(scheduler="lios")
    assert resolve("cpu", "max-autotune").derive(autotune=False, scheduler="lios").scheduler == "lios"  # a candidate
    with pytest.raises(UsageError, match="give costs or profile, not both"):
        resolve("cpu", profile="p.json").derive(costs=estimate(opweave.examples.load("lios-fig3"), "cpu"))


def test_a_scheduler_option_the_scheduler_that_will_run_does_not_take_is_refused_at_the_door():
    """``scheduler_options={"sync_ms": 0.1}`` with a server's default scheduler (TOP's lios) passed the door and
    failed at the first block's build; the option is checked against the scheduler that will run: the one given, or
    the default (the CPU's heft, a server's, the ranks' hios-lp); on CUDA, where the simulator picks among those that
    take the options, some must."""
    from opweave.serve.assemble import serving_options

    with pytest.raises(UsageError, match="scheduler 'lios' takes no option 'sync_ms'"):
        serving_options("cpu", compiler="none", scheduler_options={"sync_ms": 0.1})
    with pytest.raises(UsageError, match="scheduler 'lios' takes no option 'sync_ms'"):
        serving_options("sim", scheduler_options={"sync_ms": 0.1})
    assert serving_options("sim", scheduler="heft", scheduler_options={"sync_ms": 0.1}).scheduler == "heft"
    with pytest.raises(UsageError, match="scheduler 'heft' takes no option 'r'"):
        resolve("cpu", scheduler_options={"r": 2})  # the CPU default's lanes: heft
    with pytest.raises(UsageError, match="scheduler 'hios-lp' takes no option 'sync_ms'"):
        resolve("cpu", devices=2, scheduler_options={"sync_ms": 0.1})
    with pytest.raises(UsageError, match="no scheduler takes the options bogus"):
        resolve("cuda", scheduler_options={"bogus": 1}, check_device=False)
    assert resolve("cuda", scheduler_options={"sync_ms": 0.1}, check_device=False).scheduler is None


_BAD = {"streams": 0, "coarsen": "yes", "compiler": "tvm", "scheduler": "fastest", "threads": 0, "cache_size": 0,
        "scheduler_options": {"bogus": 1}, "graph": "tvm", "buckets": [0]}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_derive_refuses_whatever_resolve_refuses_with_the_same_message(device):
    """Over the options table, on both devices, in every mode and as every server: any set of options (each a sample,
    another valid value or a bad one) that ``resolve`` refuses, ``derive`` from the same device, mode and server
    refuses with the same message; what ``resolve`` accepts, ``derive`` makes equal."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    samples = {**SAMPLES, "runtime": FakeCuda(seed=0), "costs": estimate(opweave.examples.load("lios-fig3"), "cpu"),
               "profile": "tiny.profile.json", "compiler": "none"}
    values = {key: st.sampled_from([samples[key], *([_BAD[key]] if key in _BAD else []),
                                    *({"compiler": ["eager", "inductor", "onnxruntime"], "graph": ["fx", "inductor"],
                                       "scheduler": ["heft", "lios", "hios-lp", "sequential"],
                                       "cudagraphs": [True], "devices": [1],
                                       "scheduler_options": [{"r": 2}]}.get(key, []))])
              for key in OPTIONS}
    servers = [None, "cpu"] if device == "cpu" else [None, "cuda", "sim"]

    def outcome(make):
        try:
            return make()
        except UsageError as exc:
            return str(exc)

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(mode=st.sampled_from(MODES), serving=st.sampled_from(servers),
           asked=st.dictionaries(st.sampled_from(sorted(OPTIONS)), st.none(), max_size=4).flatmap(
               lambda keys: st.fixed_dictionaries({k: values[k] for k in keys})))
    def check(mode, serving, asked):
        base = outcome(lambda: resolve(device, mode, serving=serving, check_device=False))
        if isinstance(base, str):
            return  # the mode or the server alone is refused: nothing to derive from
        whole = outcome(lambda: resolve(device, mode, serving=serving, check_device=False, **asked))
        derived = outcome(lambda: base.derive(**asked))
        if isinstance(whole, str):
            assert derived == whole, (mode, serving, asked)
        else:
            assert isinstance(derived, Options), (mode, serving, asked, derived)
            fields = [f.name for f in dataclasses.fields(Options)]
            assert {f: getattr(derived, f) for f in fields} == {f: getattr(whole, f) for f in fields}

    check()


def test_the_cpu_default_guard_is_decided_when_the_options_are_resolved():
    assert resolve("cpu").guard and resolve("cpu", threads=2).guard
    assert not any(resolve("cpu", **{key: value}).guard for key, value in
                   (("scheduler", "heft"), ("streams", 2), ("compiler", "eager"), ("graph", "onnxruntime")))
    assert resolve("cpu", compiler="none").guard  # no compiler, asked for: the plan is still the default's
    assert not resolve("cuda", check_device=False).guard and not resolve("cpu", devices=2).guard
    assert not resolve("cpu", serving="cpu").guard and not resolve("cpu", "max-autotune").guard


def test_the_serving_preset_is_in_the_options_table_and_refuses_with_the_reason():
    from opweave.pipeline.options import serving_preset
    from opweave.serve.assemble import serving_options

    rows = {row["name"]: row["served"] for row in option_table()}
    assert rows["scheduler"].startswith("lios") and rows["coarsen"].startswith("false only")
    assert rows["costs"].startswith("refused") and "onnxruntime" in rows["compiler"]
    assert serving_preset("sim")["cost_model"] == "gpu" and serving_preset("cuda")["scheduler"] == "lios"
    assert serving_options("cuda", runtime=FakeCuda(seed=0)).cache_size == 64
    assert serving_options("cpu", compiler="none").compiler is None
    assert serving_options("cpu", compiler="none").scheduler == "lios"  # TOP's combined op graphs
    assert serving_options("cpu", compiler="eager").scheduler == "heft"
    assert serving_options("cuda", mode="reduce-overhead").cudagraphs
    with pytest.raises(UsageError, match="mode='max-autotune' does not apply to serving: a server builds a plan"):
        serving_options("cpu", mode="max-autotune")
    with pytest.raises(UsageError, match="option 'coarsen' does not apply to serving on cpu: blocks are cut"):
        serving_options("cpu", coarsen=True)
    assert not serving_options("cpu", coarsen=False).coarsen


@pytest.mark.parametrize("mode", ["max-autotune", "max-autotune-no-cudagraphs"])
def test_serve_takes_a_mode_or_refuses_it_with_the_reason_not_as_an_unknown_option(mode):
    """``mode`` was an unknown option to ``opweave serve``; it is the same preset as elsewhere, given as ``--mode`` or
    ``--option mode=...``, refused before any model loads where a server cannot honour it."""
    from opweave.cli import app

    runner = CliRunner()
    for flags in (["--option", f"mode={mode}"], ["--mode", mode]):
        result = runner.invoke(app, ["serve", "--models", "squeezenet", "--port", "0", *flags])
        assert result.exit_code == 2, result.output
        assert f"mode={mode!r} does not apply to serving" in result.output and "unknown option" not in result.output
    result = runner.invoke(app, ["serve", "--models", "squeezenet", "--port", "0", "--mode", "reduce-overhead"])
    assert result.exit_code == 2 and "records CUDA Graphs, which the CPU does not have" in result.output
    result = runner.invoke(app, ["serve", "--models", "squeezenet", "--mode", "default", "--option", "mode=default"])
    assert result.exit_code == 2 and "mode given both as --mode and with --option" in result.output


def test_run_takes_a_mode_as_compile_does(ways_in):
    from opweave.cli import app

    seen, _, _ = ways_in
    runner = CliRunner()
    result = runner.invoke(app, ["run", "--model", "tiny", "--devices", "1", "--json", "--option", "mode=default"])
    assert isinstance(result.exception, Built) and seen["options"][-1].mode == "default", result.output
    for devices in ("1", "2"):  # run plans over the devices it is given, a search chooses its own plan
        result = runner.invoke(app, ["run", "--model", "tiny", "--devices", devices, "--mode", "max-autotune"])
        assert result.exit_code == 2 and "mode='max-autotune' chooses the plan itself: give no 'devices'" in \
            result.output and "unknown option" not in result.output


def test_the_torch_compile_backend_resolves_a_graphs_options_once(monkeypatch):
    """It resolved them three times per graph (once to check, once for fold_bn, once in opweave.compile), and found
    the graph's device by a rule of its own."""
    import opweave.pipeline

    calls = []
    real = opweave.pipeline.resolve

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(opweave.pipeline, "resolve", counting)
    monkeypatch.setattr(opweave.api, "resolve", counting)
    model, inputs = tiny()
    with torch.no_grad():
        graph = opweave.dynamo.opweave_backend(torch.fx.symbolic_trace(model), inputs,
                                               options={"scheduler": "lios", "runtime": FakeCuda(seed=3)})
    assert len(calls) == 1 and calls[0][0] == "cuda" and graph.compiled.options.scheduler == "lios"
    assert graph.device == "cuda"


def test_costs_with_transfer_times_of_their_own_keep_them_unless_a_link_is_given(made):
    """Whether the link was given was asked below the door (the ranks' target read ``given``): now the link resolves
    to none where the costs given carry transfer times, and the target uses the link whenever there is one."""
    import dataclasses

    from opweave.pipeline.targets import RanksTarget

    _, inputs, coarse, _ = made
    own = {(e.src, e.dst): 0.5 for e in coarse.graph.edges}
    costs = dataclasses.replace(estimate(coarse.graph, "cpu", model="ideal"), edge_transfer_ms=own)
    assert resolve("cpu", devices=2).link == "loopback"
    kept = resolve("cpu", devices=2, costs=costs)
    assert kept.link is None and RanksTarget().plan(coarse, inputs, kept)[0].edge_transfer_ms == own
    linked = resolve("cpu", devices=2, costs=costs, link="pcie4")
    assert RanksTarget().plan(coarse, inputs, linked)[0].edge_transfer_ms != own


def test_a_ray_replica_receives_its_options_resolved(monkeypatch):
    """Replicas got the raw dict and resolved it again on every ``threads``; the options are resolved once, where
    the deployment is made, and travel resolved (picklable) to every replica."""
    import dataclasses
    import pickle

    from opweave.serve import assemble
    from opweave.serve.ray import ReplicaOptions

    calls = []
    real = assemble.serving_options
    monkeypatch.setattr(assemble, "serving_options", lambda *a, **k: calls.append(1) or real(*a, **k))
    options = ReplicaOptions(models=["squeezenet"], options={"scheduler": "lios"})
    resolved = options.resolved()
    shipped = pickle.loads(pickle.dumps(dataclasses.replace(options, options=resolved)))
    assert len(calls) == 1
    assert shipped.threads == 1 and shipped.resolved().scheduler == "lios" and len(calls) == 1


def test_the_model_itself_kept_by_the_default_carries_the_costs_asked_for(made, monkeypatch):
    """A profile given to the CPU default was lost when its race kept the model itself: that candidate's metadata was
    the roofline's, so which costs the compiled model reported depended on which candidate won a timing."""
    from opweave.pipeline import search

    model, inputs, _, path = made
    monkeypatch.setattr(search, "TIMER", lambda label, fn: (fn(), 1.0 if label == "eager" else 5.0)[1])
    with opweave.compile(model, inputs, profile=path) as fast:
        assert fast.choice["label"] == "eager"
        assert fast.costs.latency_ms == json.loads(open(path).read())["latency_ms"]
