"""One vocabulary: every option of :data:`opweave.pipeline.OPTIONS`, on every device, through every door
(``opweave.compile``, ``torch.compile(backend="opweave")``, the CLI's ``--option``, the server's executors), is either
used or refused with a :class:`~opweave.errors.UsageError` before anything touches a device."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import opweave
import opweave.dynamo
from opweave.backends.fakecuda import FakeCuda
from opweave.backends.ortgraph import OrtLanes
from opweave.costs.profile import profile_model
from opweave.costs.roofline import estimate
from opweave.errors import DeviceError, UsageError
from opweave.pipeline import OPTIONS, Options, mode_options, option_table, parse_option, resolve


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
           "cudagraphs": False, "capture_fallback": "eager", "static_outputs": True, "cache_size": 2, "warmup": 1,
           "link": "loopback", "timeout_s": 60.0, "start_method": "spawn"}  # costs and profile: made per model
CUDA_ONLY = {"cudagraphs", "capture_fallback", "static_outputs", "cache_size", "warmup", "runtime"}
RANKS_ONLY = {"link", "timeout_s", "start_method"}  # alone: refused (they need devices > 1)
CPU_ONLY = {"graph", "threads"}
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
    from opweave.capture import capture, coarsen

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
    if key in ("cudagraphs", "capture_fallback", "static_outputs", "cache_size", "warmup", "runtime"):
        return getattr(fast.backend, key) is value or getattr(fast.backend, key) == value
    raise AssertionError(key)


def test_compile_uses_or_refuses_every_option_on_the_cpu(made):
    model, inputs, coarse, path = made
    for key, value in _samples(coarse.graph, path).items():
        if key in expected_refused("cpu"):
            with pytest.raises(UsageError, match=repr(key)):
                opweave.compile(model, inputs, **{key: value})
            continue
        with opweave.compile(model, inputs, **{key: value}, **WITH.get(key, {})) as fast, torch.inference_mode():
            assert effect(key, value, fast, coarse.graph), key
            assert opweave.outputs.compare(model(*inputs), fast(*inputs), tolerance=1e-4).ok, key


def test_compile_uses_or_refuses_every_option_on_cuda_through_the_fake_runtime(made):
    """The CUDA door for real, on the CPU: the fake CUDA runtime (opweave.backends.fakecuda) runs the CUDA target's
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
        torch.compile(model, backend="opweave")(*inputs)
    graph = opweave.dynamo.last_compiled()  # dynamo's graph of the model: costs and profile must name its ops
    dynamo_path = path.parent / "dynamo.profile.json"
    profile_model(graph.captured, graph.captured.example_inputs, device="cpu", repeats=2, warmup=1).save(dynamo_path)
    samples = {**_samples(graph.graph, dynamo_path), "costs": estimate(graph.graph, "cpu", model="ideal")}
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
        assert effect(key, value, compiled, graph.graph if key != "coarsen" else coarse.graph), key
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


@pytest.mark.parametrize("device", ["cpu", "cuda", "sim"])
def test_the_server_takes_the_options_its_executors_use_and_refuses_the_others(device, made):
    from opweave.serve.assemble import SERVING_OPTIONS, serving_options

    _, _, coarse, path = made
    for key, value in _samples(coarse.graph, path).items():
        if key in SERVING_OPTIONS[device]:
            assert serving_options(device, {key: value}) == {key: value}
        else:
            with pytest.raises(UsageError, match=repr(key)):
                serving_options(device, {key: value})


def _chain(exc):
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


def test_an_option_the_scheduler_does_not_take_is_a_usage_error_naming_it():
    model, inputs = tiny()  # raised a raw TypeError from inside the scheduler before
    with pytest.raises(UsageError, match="scheduler 'sequential' takes no option 'sync_ms'"):
        opweave.compile(model, inputs, scheduler="sequential", scheduler_options={"sync_ms": 0.1})
    with opweave.compile(model, inputs, scheduler_options={"sync_ms": 0.1}) as fast:  # the default plan's guard
        assert fast.choice["label"] in ("lanes", "one lane", "eager")  # builds one lane without heft's option


def test_the_docs_show_the_options_table_as_it_is():
    from pathlib import Path

    from opweave.pipeline.options import options_markdown

    root = Path(__file__).resolve().parent.parent
    for doc in ("README.md", "docs/design.md"):
        assert options_markdown() in (root / doc).read_text(), f"{doc}: the options table is out of date"
