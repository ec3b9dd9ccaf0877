"""``opweave run`` (rank processes, and one rank of a torchrun launch) and ``opweave profile-links``, run as a user
would; afterwards no process started by the command may be left (found by a marker in their environment)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

from typer.testing import CliRunner

from opweave.cli import app
from opweave.costs.links import load

TORCHRUN = Path(sys.executable).with_name("torchrun")


def command(*args: str, launcher: tuple[str, ...] = (sys.executable, "-m", "opweave"), timeout: int = 600):
    """Run ``opweave args`` with a marker in its environment; return it and the processes still carrying the
    marker once it exited (none may be left)."""
    mark = uuid.uuid4().hex
    env = {**os.environ, "OPWEAVE_TEST_MARK": mark}
    proc = subprocess.run([*launcher, *args], capture_output=True, text=True, timeout=timeout, env=env)
    return proc, marked(mark)


def marked(mark: str) -> list[int]:
    """Live processes whose environment holds ``OPWEAVE_TEST_MARK=mark`` (zombies excluded)."""
    found = []
    needle = f"OPWEAVE_TEST_MARK={mark}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


# The README's `opweave run` and `torchrun ... -m opweave run` lines are run by tests/test_readme.py.


def test_run_with_more_devices_than_ops_or_gpus_fails_with_one_line():
    proc, _ = command("run", "--model", "deepfm", "--devices", "100000")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "devices=100000 is more than the graph's" in proc.stderr
    proc, _ = command("run", "--model", "deepfm", "--devices", "2", "--device", "cuda")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "CUDA" in proc.stderr


def test_run_plans_the_coarsened_graph_as_compile_does_unless_no_coarsen():
    """``opweave run`` scheduled the fine graph while ``opweave.compile(..., devices=N)`` coarsens by default."""
    from opweave import zoo
    from opweave.capture import capture, coarsen

    module, inputs = zoo.create("deepfm")
    fine = capture(module, inputs, name="deepfm")
    for flag, graph in (("--coarsen", coarsen(fine).graph), ("--no-coarsen", fine.graph)):
        proc, left = command("run", "--model", "deepfm", "--devices", "2", "--runs", "1", "--warmup", "0", "--check",
                             "--json", flag)
        assert proc.returncode == 0 and left == [], proc.stderr[-3000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["ops"] == len(graph) == sum(rank["ops"] for rank in result["ranks"])
        assert result["max_abs_diff"] <= result["tolerance"]
    assert len(coarsen(fine).graph) < len(fine.graph)


def test_run_takes_an_image_size_that_a_model_without_images_ignores():
    """``--image-size`` (for the CNNs) crashed ``opweave run --model deepfm`` with a TypeError traceback."""
    proc, left = command("run", "--model", "deepfm", "--image-size", "64", "--devices", "2", "--runs", "1",
                         "--warmup", "0", "--json")
    assert proc.returncode == 0 and left == [], proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["model"] == "deepfm"


def test_profile_links_writes_a_link_that_schedule_and_simulate_use(tmp_path):
    path = tmp_path / "link.json"
    proc, left = command("profile-links", "--device", "cpu", "--repeats", "3", "--max-bytes", str(1 << 24),
                         "-o", str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fit: latency" in proc.stdout and left == []
    link = load(path)
    assert link.bandwidth_gbs > 0 and link.latency_ms >= 0 and len(link.samples) >= 3
    runner = CliRunner()  # in process: the commands below need no rank processes
    result = runner.invoke(app, ["schedule", "lios-fig3", "--scheduler", "hios-lp", "--devices", "2", "--link",
                                 str(path), "--json"])
    assert result.exit_code == 0, result.output
    plain = runner.invoke(app, ["schedule", "lios-fig3", "--scheduler", "hios-lp", "--devices", "2", "--json"])
    assert json.loads(result.stdout)["makespan_ms"] >= json.loads(plain.stdout)["makespan_ms"]  # transfers cost
    result = runner.invoke(app, ["simulate", "lios-fig3", "--scheduler", "hios-lp", "--devices", "2", "--link",
                                 "nosuchlink"])
    assert result.exit_code == 2 and "unknown link 'nosuchlink'" in result.output
