"""The benchmark scripts run end to end (``--quick``: small zoo graphs and one small random DAG) and write JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def run_script(name: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, str(BENCHMARKS / name), "--quick", "--out", str(out), *extra],
                            capture_output=True, text=True, timeout=120, cwd=BENCHMARKS.parent)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_sched_time_quick(tmp_path):
    result = run_script("sched_time.py", tmp_path, "--models", "squeezenet,lios-fig3")
    data = json.loads((tmp_path / "sched_time.json").read_text())
    assert {"machine", "settings", "schedulers", "graphs", "results", "acceptance", "paper_reference"} <= set(data)
    assert {"platform", "python", "torch", "date"} <= set(data["machine"])
    assert [g["name"] for g in data["graphs"]] == ["squeezenet", "lios-fig3", "synth-50-14-100-s0"]
    assert len(data["results"]) == len(data["graphs"]) * len(data["schedulers"])
    for row in data["results"]:
        assert row["status"] in ("ok", "timeout"), row
        if row["status"] == "ok":
            assert row["median_s"] >= 0 and row["reps"] >= 1
    assert data["acceptance"]["graph"] == "squeezenet"
    assert data["paper_reference"]["lios_table_v"]["values"]["SqueezeNet"]["LIOS"] == 0.05
    assert ("PASS" if data["acceptance"]["pass"] else "FAIL") + ": every polynomial scheduler" in result.stdout


def test_sim_quality_quick(tmp_path):
    run_script("sim_quality.py", tmp_path)
    data = json.loads((tmp_path / "sim_quality.json").read_text())
    assert {"machine", "settings", "definitions", "schedulers", "graphs", "results", "summary"} <= set(data)
    assert [g["name"] for g in data["graphs"]] == ["squeezenet"]
    assert len(data["results"]) == 2 * len(data["schedulers"])
    for row in data["results"]:
        assert row["status"] in ("ok", "timeout"), row
        if row["status"] == "ok":
            # no schedule beats the lower bound, and sequential under the ideal model is the sum of latencies
            assert row["ratio_to_bound"] >= 1 - 1e-9
            assert row["makespan_ms"] >= row["lower_bound_ms"] - 1e-9
    ideal_sequential = next(r for r in data["results"] if r["cost_model"] == "ideal" and r["scheduler"] == "sequential")
    assert ideal_sequential["speedup"] == pytest.approx(1.0)
    assert (tmp_path / "sim_quality.png").stat().st_size > 1000


@pytest.mark.slow
def test_multi_device_quick(tmp_path):
    run_script("multi_device.py", tmp_path)
    data = json.loads((tmp_path / "multi_device_quick.json").read_text())
    assert data["link"]["bandwidth_gbs"] > 0 and data["settings"]["ranks"] == [1, 2]
    (result,) = data["results"]
    assert [r["ranks"] for r in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert row["measured_ms"] > 0 and row["simulated_ms"] > 0 and row["max_abs_diff"] < 1e-4
        assert sum(row["ops_per_rank"]) == result["ops"]
