"""The command line contract of DESIGN.md §3, run as a user would."""

import json
import subprocess
import sys

import pytest

from opweave.ir import OpGraph


def opweave(*args: str, check_rc: int | None = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "opweave", *args], capture_output=True, text=True, timeout=300)
    if check_rc is not None:
        assert proc.returncode == check_rc, proc.stderr
    return proc


def test_schedule_json_lios_fig3():
    result = json.loads(opweave("schedule", "lios-fig3", "--scheduler", "lios", "--streams", "3", "--json").stdout)
    assert result["scheduler"] == "lios"
    assert result["makespan_ms"] == 38.0 and result["sequential_ms"] == 73.0
    assert result["streams_used"] == 3 and result["devices_used"] == 1
    assert result["syncs"] == sum(i["kind"] == "wait" for i in result["plan"])
    assert {o["id"] for o in result["ops"]} == {f"v{i}" for i in range(1, 11)}
    assert set(result["ops"][0]) == {"id", "device", "stream", "stage", "start_ms", "finish_ms"}
    assert {"device", "kind", "stream"} <= set(result["plan"][0])
    finish = {o["id"]: o["finish_ms"] for o in result["ops"]}
    assert finish["v10"] == 38.0 and finish["v6"] == 23.0


def test_bad_graph_exits_2_with_one_line_naming_the_op(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "opweave.graph/1", "ops": [{"id": "a"}, {"id": "a"}], "edges": []}))
    proc = opweave("schedule", str(bad), "--scheduler", "lios", check_rc=2)
    assert proc.stderr.strip().count("\n") == 0 and "duplicate op id 'a'" in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("args, needle", [
    (["schedule", "lios-fig3", "--scheduler", "magic"], "unknown scheduler 'magic'"),
    (["schedule", "no-such-file.json"], "no graph file"),
    (["simulate", "lios-fig3", "--cost-model", "quantum"], "unknown cost model"),
    (["schedule"], "give a GRAPH"),
])
def test_usage_errors_exit_2(args, needle):
    proc = opweave(*args, check_rc=2)
    assert needle in proc.stderr and proc.stderr.strip().count("\n") == 0


def test_synth_is_deterministic(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    opweave("synth", "--ops", "200", "--layers", "14", "--seed", "1", "-o", str(a))
    opweave("synth", "--ops", "200", "--layers", "14", "--seed", "1", "-o", str(b))
    assert a.read_bytes() == b.read_bytes()
    g = OpGraph.load(a)
    assert len(g) == 200 and len(g.edges) == 400


def test_simulate_all_schedulers_table_and_json(tmp_path):
    proc = opweave("simulate", "lios-fig3", "--streams", "3", "--json")
    rows = json.loads(proc.stdout)["results"]
    import opweave as ow

    assert [r["scheduler"] for r in rows] == ow.schedulers.names()
    assert all(r["makespan_ms"] >= 38.0 - 1e-9 for r in rows)
    table = opweave("simulate", "lios-fig3", "--streams", "3").stdout
    assert "lios" in table and "38.000" in table


def test_simulate_writes_gantt_and_trace(tmp_path):
    png, trace = tmp_path / "g.png", tmp_path / "t.json"
    opweave("simulate", "lios-fig3", "--scheduler", "lios", "--streams", "3",
            "--gantt", str(png), "--trace", str(trace))
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert len([e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]) == 10


def test_models_lists_the_zoo():
    names = json.loads(opweave("models", "--json").stdout)
    assert {"inception_v3", "googlenet", "squeezenet", "resnet50", "nasnet_a_mobile", "randwire", "bert_base",
            "deepfm"} <= set(names)


def test_bench_cpu_json():
    proc = opweave("bench", "--model", "squeezenet", "--device", "cpu", "--schedulers", "sequential,lios",
                   "--runs", "2", "--warmup", "1", "--json")
    result = json.loads(proc.stdout)
    assert [r["mode"] for r in result["rows"]] == ["eager", "opweave sequential", "opweave lios"]
    assert all(r["median_ms"] > 0 for r in result["rows"])
    assert all(r["max_abs_diff"] < 1e-3 for r in result["rows"][1:])


def test_bench_cuda_without_gpu_is_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = opweave("bench", "--model", "squeezenet", "--device", "cuda", check_rc=2)
    assert "CUDA" in proc.stderr and proc.stderr.strip().count("\n") == 0


def test_profile_without_gpu_is_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = opweave("profile", "--model", "squeezenet", "--device", "cuda", check_rc=2)
    assert "CUDA is not available" in proc.stderr and proc.stderr.strip().count("\n") == 0


def test_cpu_profile_feeds_simulate_and_is_refused_for_another_model(tmp_path):
    path = tmp_path / "sq.json"
    opweave("profile", "--model", "deepfm", "--device", "cpu", "-o", str(path))
    measured = json.loads(path.read_text())["latency_ms"]
    result = json.loads(opweave("schedule", "--model", "deepfm", "--profile", str(path), "--scheduler", "sequential",
                                "--coarsen", "--json").stdout)  # `opweave profile` measures the coarsened graph
    assert result["sequential_ms"] == pytest.approx(sum(measured.values()))
    proc = opweave("simulate", "--model", "squeezenet", "--profile", str(path), check_rc=2)
    assert "measured for model 'deepfm'" in proc.stderr
    proc = opweave("simulate", "--model", "deepfm", "--profile", str(path), check_rc=2)  # the fine graph
    assert "other granularity" in proc.stderr and proc.stderr.strip().count("\n") == 0
