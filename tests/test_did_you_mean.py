"""Every door that takes a name answers a misspelt one with the name it was likely meant to be: the Python API, the
``torch.compile`` backend's options, every CLI command and the server's flags, through one function
(:func:`opweave.errors.did_you_mean`). Each door is refused before a model loads or a device is touched."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import opweave
from opweave.cli import app
from opweave.errors import UsageError


def _model():
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval(), (torch.randn(2, 4),)


def compile_(**options):
    model, inputs = _model()
    return lambda: opweave.compile(model, inputs, **options)


def torch_compile(**kwargs):
    def call():
        model, inputs = _model()
        torch._dynamo.reset()
        try:
            torch.compile(model, backend="opweave", **kwargs)(*inputs)
        finally:
            torch._dynamo.reset()
    return call


def library(fn, *args):
    return lambda: fn(*args)


def serving_options(device):
    from opweave.serve.assemble import serving_options as make

    return lambda: make(device)


def policy(name, **options):
    from opweave.serve.engine import policies

    return lambda: policies.create(name, **options)


def cli(*args):
    return args


def _roofline(name):
    from opweave.costs import roofline

    return roofline.preset(name)


def _link(name):
    from opweave.costs import links

    return links.load(name)


def _compiler(name):
    from opweave.backends import compilers

    return compilers.get(name)


DOORS = [
    # the Python API: opweave.compile's keywords, names and values alike
    ("compile scheduler", compile_(scheduler="lioss"), "lios"),
    ("compile mode", compile_(mode="max-autotun"), "max-autotune"),
    ("compile device", compile_(device="cdua"), "cuda"),
    ("compile option name", compile_(schedular="lios"), "scheduler"),
    ("compile compiler", compile_(compiler="onnxrt"), "onnxruntime"),
    ("compile graph", compile_(graph="onxruntime"), "onnxruntime"),
    ("compile cost_model", compile_(cost_model="idael"), "ideal"),
    ("compile capture_fallback", compile_(capture_fallback="eagr"), "eager"),
    ("compile start_method", compile_(start_method="spwan"), "spawn"),
    ("compile scheduler option", compile_(scheduler="heft", scheduler_options={"sync_m": 0.1}), "sync_ms"),
    ("zoo model", library(opweave.zoo.create, "googlnet"), "googlenet"),
    ("zoo prefix", library(opweave.zoo.create, "torchvison:resnet18"), "torchvision:resnet18"),
    ("roofline preset", library(_roofline, "h10"), "h100"),
    ("link preset", library(_link, "nvlnk4"), "nvlink4"),
    ("segment compiler", library(_compiler, "onnxrt"), "onnxruntime"),
    # the torch.compile backend's options
    ("torch.compile scheduler", torch_compile(options={"scheduler": "lioss"}), "lios"),
    ("torch.compile option name", torch_compile(options={"stream": 2}), "streams"),
    ("torch.compile mode", torch_compile(mode="reduce-overhed"), "reduce-overhead"),
    # the serving library
    ("serving device", serving_options("simm"), "sim"),
    ("serving policy", policy("heuristc"), "heuristic"),
    ("serving policy option", policy("heuristic", drian_s=1.0), "drain_s"),
    # every CLI command
    ("schedule -s", cli("schedule", "lios-fig3", "-s", "lois"), "lios"),
    ("schedule GRAPH", cli("schedule", "lios-fg3"), "lios-fig3"),
    ("schedule GRAPH (a zoo name)", cli("schedule", "googlnet"), "googlenet"),
    ("schedule --link", cli("schedule", "lios-fig3", "-s", "hios-lp", "--devices", "2", "--link", "nvlnk4"),
     "nvlink4"),
    ("simulate --model", cli("simulate", "--model", "googlnet"), "googlenet"),
    ("simulate --cost-model", cli("simulate", "lios-fig3", "--cost-model", "gpy"), "gpu"),
    ("simulate --preset", cli("simulate", "--model", "squeezenet", "--preset", "h20", "--cost-model", "gpu"),
     "h200"),
    ("simulate --dtype", cli("simulate", "lios-fig3", "--dtype", "fp61"), "fp16"),
    ("bench --schedulers", cli("bench", "--model", "squeezenet", "--schedulers", "defualt"), "default"),
    ("bench --mode", cli("bench", "--model", "squeezenet", "--device", "cpu", "--mode", "max-autotun"),
     "max-autotune"),
    ("bench --device", cli("bench", "--model", "squeezenet", "--device", "cpuu"), "cpu"),
    ("bench --option name", cli("bench", "--model", "squeezenet", "--device", "cpu", "--option", "schedular=lios"),
     "scheduler"),
    ("bench --option compiler", cli("bench", "--model", "squeezenet", "--device", "cpu", "--option",
                                    "compiler=onnxrt"), "onnxruntime"),
    ("bench --option graph", cli("bench", "--model", "squeezenet", "--device", "cpu", "--option",
                                 "graph=onxruntime"), "onnxruntime"),
    ("profile --model", cli("profile", "--model", "squeezenett", "--device", "cpu"), "squeezenet"),
    ("run -s", cli("run", "-s", "hios-l", "--device", "cpu"), "hios-lp"),
    ("run --mode", cli("run", "--device", "cpu", "--mode", "defualt"), "default"),
    ("run --device", cli("run", "--device", "cdua"), "cuda"),
    ("profile-links --device", cli("profile-links", "--device", "cpuu"), "cpu"),
    ("serve -s", cli("serve", "--models", "squeezenet", "-s", "hef"), "heft"),
    ("serve --device", cli("serve", "--models", "squeezenet", "--device", "cdua"), "cuda"),
    ("serve --mode", cli("serve", "--models", "squeezenet", "--device", "cpu", "--mode", "reduce-overhed"),
     "reduce-overhead"),
    ("serve --compiler", cli("serve", "--models", "squeezenet", "--device", "cpu", "--compiler", "onnxrt"),
     "onnxruntime"),
    ("serve --policy", cli("serve", "--models", "squeezenet", "--device", "cpu", "--policy", "heuristc"),
     "heuristic"),
    ("serve --policy-options", cli("serve", "--models", "squeezenet", "--device", "cpu", "--policy", "batch",
                                   "--policy-options", "max_bach=4"), "max_batch"),
    ("serve --model-control-mode", cli("serve", "--device", "cpu", "--model-control-mode", "explicet"), "explicit"),
    ("serve --models", cli("serve", "--models", "squeezenett", "--device", "cpu"), "squeezenet"),
    ("loadgen --policy", cli("loadgen", "--simulate", "--pattern", "squeezenet:10", "--policy", "statc"), "static"),
    ("loadgen --arrivals", cli("loadgen", "--simulate", "--pattern", "squeezenet:10", "--arrivals", "poison"),
     "poisson"),
    ("loadgen -s", cli("loadgen", "--simulate", "--pattern", "squeezenet:10", "-s", "opar"), "opara"),
    ("blocks --models", cli("blocks", "--models", "torchvison:resnet18"), "torchvision:resnet18"),
    ("export MODEL", cli("export", "resnet5", "unused-repository"), "resnet50"),
]


@pytest.mark.parametrize(("door", "given", "right"), DOORS, ids=[d[0] for d in DOORS])
def test_a_misspelt_name_at_every_door_gets_a_did_you_mean(door, given, right, tmp_path, monkeypatch):
    hint = f"(did you mean {right!r}?)"
    if isinstance(given, tuple):  # a command line: exit status 2, one line on stderr
        monkeypatch.chdir(tmp_path)  # nothing a refused command might write lands in the worktree
        result = CliRunner().invoke(app, list(given))
        assert result.exit_code == 2, (result.stderr, result.exception)
        assert result.stderr.startswith("opweave: error: ") and result.stderr.count("\n") == 1, result.stderr
        assert hint in result.stderr
        return
    with pytest.raises(Exception) as raised:
        given()
    assert isinstance(raised.value, UsageError) or "UsageError" in str(raised.value), raised.value
    assert hint in str(raised.value)


def test_a_zoo_name_given_as_a_graph_runs_that_model():
    import json

    listed = json.loads(CliRunner().invoke(app, ["schedule", "googlenet", "--json"]).stdout)
    given = json.loads(CliRunner().invoke(app, ["schedule", "--model", "googlenet", "--json"]).stdout)
    assert listed["scheduler"] == "lios" and len(listed["ops"]) == opweave.zoo.COUNTS["googlenet"][0]
    assert listed["makespan_ms"] == given["makespan_ms"]
