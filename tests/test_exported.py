"""Exported programs: ``opweave.compile`` takes a ``torch.export.ExportedProgram`` or the path of a ``.pt2`` file, and
``opweave schedule``, ``simulate`` and ``bench`` take ``--model-file PATH.pt2`` beside zoo names."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

import opweave
from opweave.errors import UsageError
from opweave.evaluate.coverage import SCHEDULERS
from opweave.outputs import compare


class TwoBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(3, 8, 1)
        self.fc = nn.Linear(16, 4)

    def forward(self, x, scale=None):
        y = torch.cat([self.a(x).relu(), self.b(x).sigmoid()], 1).mean((2, 3))
        out = self.fc(y)
        return out if scale is None else out * scale


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model, x, scale = TwoBranches().eval(), torch.randn(1, 3, 16, 16), torch.rand(4)
    program = torch.export.export(model, (x,), {"scale": scale})
    path = tmp_path_factory.mktemp("pt2") / "two_branches.pt2"
    torch.export.save(program, path)
    return model, x, scale, program, path


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_compile_an_exported_program_and_its_file(saved, scheduler):
    model, x, scale, program, path = saved
    with torch.no_grad():
        expected = model(x, scale=scale)
        other = torch.randn_like(x)
        expected_other = model(other, scale=scale)
    for source in (program, path, str(path)):
        compiled = opweave.compile(source, scheduler=scheduler)  # the program's own example inputs
        assert compare(expected, compiled(x, scale=scale)).relative <= 1e-5
        assert compare(expected_other, compiled(other, scale)).relative <= 1e-5


def test_a_file_that_is_not_an_exported_program_is_one_usage_error(tmp_path):
    bad = tmp_path / "bad.pt2"
    bad.write_text("not a program")
    with pytest.raises(UsageError, match="bad.pt2.*torch.export.save"):
        opweave.compile(bad)
    with pytest.raises(UsageError, match="no model file"):
        opweave.compile(tmp_path / "missing.pt2")


def opweave_cli(*args: str, rc: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "opweave", *args], capture_output=True, text=True, timeout=900)
    assert proc.returncode == rc, proc.stderr[-3000:]
    return proc


def test_cli_schedule_simulate_and_bench_take_a_model_file(saved):
    path = str(saved[4])
    result = json.loads(opweave_cli("schedule", "--model-file", path, "--scheduler", "lios", "--json").stdout)
    assert {o["id"] for o in result["ops"]} >= {"conv2d", "conv2d_1", "cat", "linear"}
    assert result["streams_used"] >= 2
    simulated = json.loads(opweave_cli("simulate", "--model-file", path, "--json").stdout)
    assert simulated["graph"] == "two_branches" and simulated["ops"] == len(result["ops"])
    bench = json.loads(opweave_cli("bench", "--model-file", path, "--device", "cpu", "--schedulers",
                                   "sequential,lios", "--runs", "2", "--warmup", "1", "--json").stdout)
    assert bench["model"] == "two_branches"
    assert [r["mode"] for r in bench["rows"]] == ["eager", "opweave sequential", "opweave lios"]
    assert all(r["max_abs_diff"] < 1e-5 for r in bench["rows"][1:])


def test_cli_refuses_a_model_file_with_a_zoo_name_or_a_batch_size(saved):
    path = str(saved[4])
    proc = opweave_cli("schedule", "--model-file", path, "--model", "squeezenet", rc=2)
    assert "--model-file" in proc.stderr and proc.stderr.strip().count("\n") == 0
    proc = opweave_cli("bench", "--model-file", path, "--batch-size", "4", rc=2)
    assert "--batch-size does not apply" in proc.stderr
