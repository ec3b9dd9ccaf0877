"""scripts/gpu_ingest.py: what a GPU check plan wrote, brought into benchmarks/results as the committed files are,
checked against a committed run rebuilt as the machine wrote it."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
RUN = "gpu_latency_h200_2026-11-28_lease3.json"
NOTE = ("bench stopped at its 340 s limit during randwire at batch 1 fp32: its max-autotune, lios and heft rows are "
        "missing")


def ingest_module():
    spec = importlib.util.spec_from_file_location("gpu_ingest", ROOT / "scripts" / "gpu_ingest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def machine_out(tmp_path) -> Path:
    """The committed second-machine run as its plan left it in $OUT: the results without commit and command, the
    JUnit file and the log."""
    out = tmp_path / "out"
    out.mkdir()
    data = json.loads((RESULTS / RUN).read_text())
    commit, _ = data.pop("commit"), data.pop("command")
    assert commit == "e9d8d7d"
    (out / "nvidia-h200-2026-11-28.json").write_text(json.dumps(data, indent=1))
    shutil.copyfile(RESULTS / "gpu_junit_h200_2026-11-28_lease3.xml", out / "junit.xml")
    shutil.copyfile(RESULTS / "gpu_check_h200_2026-11-28_lease3.log", out / "gpu_check.log")
    return out


def test_a_plans_files_become_the_committed_files(machine_out, tmp_path, capsys):
    gi = ingest_module()
    results = tmp_path / "results"
    results.mkdir()
    assert gi.main([str(machine_out), "lease3", "--commit", "e9d8d7d", "--note", NOTE, "--results",
                    str(results)]) == 0
    assert sorted(p.name for p in results.iterdir()) == [
        "gpu_check_h200_2026-11-28_lease3.log", "gpu_junit_h200_2026-11-28_lease3.xml", RUN]
    assert (results / RUN).read_bytes() == (RESULTS / RUN).read_bytes()  # byte for byte what was committed
    printed = capsys.readouterr().out
    assert "nasnet_a_mobile b1 fp32: best opweave lios 1.232 ms, 2.38x the CUDA Graph, 2.15x torch.compile" in printed
    assert "69 of 72 passed, 3 failed" in printed
    assert "FAILED tests.test_fuse::test_inductor_segments_of_a_cpu_model_compiled_for_cuda" in printed
    assert "--name sim_gpu_heldout_h200_2026-11-28_lease3" in printed and "opweave calibrate" in printed
    assert "googlenet_fused" not in printed  # the fused run's rows are not fitted


def test_files_already_there_are_refused_not_overwritten(machine_out, tmp_path):
    gi = ingest_module()
    results = tmp_path / "results"
    results.mkdir()
    (results / RUN).write_text("kept")
    with pytest.raises(SystemExit, match="already in .*not overwritten: " + RUN):
        gi.ingest(machine_out, "lease3", "e9d8d7d", results=results)
    assert (results / RUN).read_text() == "kept" and len(list(results.iterdir())) == 1


def test_the_gpus_name_and_the_provenance():
    gi = ingest_module()
    assert [gi.gpu_slug(n) for n in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA H200 SXM")] == [
        "h200", "h100", "h200"]
    data = gi.with_provenance({"device": "d", "date": "x", "commit": "old", "results": []}, "abc", "cmd")
    assert list(data) == ["device", "date", "commit", "command", "results"] and data["commit"] == "abc"


def test_a_decode_plans_results_are_copied_beside_its_log(tmp_path):
    """A plan that ran benchmarks/decode.py (its JSON has results but no summaries: not the GPU latency benchmark's)
    brings it in named after the GPU, the date and the plan."""
    gi = ingest_module()
    out, results = tmp_path / "out", tmp_path / "results"
    out.mkdir()
    results.mkdir()
    (out / "decode_cuda_moe_b1.json").write_text(json.dumps({"device": "NVIDIA H200", "results": []}))
    shutil.copyfile(RESULTS / "gpu_check_h200_2026-11-28_lease3.log", out / "gpu_check.log")
    written = gi.ingest(out, "decode", "abc", results=results)
    assert sorted(p.name for p in written) == ["decode_cuda_moe_b1_h200_2026-11-28_decode.json",
                                               "gpu_check_h200_2026-11-28_decode.log"]
