"""Every command of the README's quick starts, run for real, with what the README says about it checked.

The commands are read from README.md itself: the ``python`` blocks under "Python quick start" and "Fused segments
(TorchInductor)" (run statement by statement; an expression's value is checked against its comment) and every
``opweave ...`` line of "Command line quick start" (run through the Typer app with ``typer.testing.CliRunner``, in
a fresh directory, or as a process where it starts rank processes or a server; the rendered table text is checked,
as a user reads it). A README command with no check here fails :func:`test_every_readme_command_is_checked`, so the
README cannot gain an untested command.

The command-line blocks of "Several devices (HIOS)" are read the same way (``torchrun`` lines included).

Departures from the lines as written, each to keep the suite short: ``opweave bench`` lines also get ``--runs 2
--warmup 0`` and ``opweave run`` lines ``--runs 2 --warmup 1`` (the timing loop is the same code with fewer
iterations); ``opweave serve`` gets ``--port 0`` (a free port) and small images, the ``loadgen`` line against it a
tenth of its rates for 2 s, the simulated ``loadgen`` 1 s of virtual time, ``profile-links`` 3 repeats. Commands
that need CUDA are marked ``cuda``: without a GPU they must fail with one line on stderr and exit status 2 (what a
user without a GPU sees); with one they run for real. Without a GPU, the line that simulates a measured profile gets
a CPU profile of the same model instead of the one the README's ``opweave profile --device cuda`` line would write
(a profile's device is not checked when simulating).
"""

from __future__ import annotations

import ast
import contextlib
import json
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from typer.testing import CliRunner

import opweave
from benchmark_module import cpu_latency, render_docs
from cuda_precision import no_tf32
from opweave import zoo
from opweave.capture import load
from opweave.cli import app
from opweave.costs.links import load as load_link
from opweave.costs.profile import profile_model
from opweave.ir import OpGraph
from opweave.outputs import compare
from test_distributed_cli import TORCHRUN
from test_distributed_cli import command as rank_command

README = Path(__file__).resolve().parent.parent / "README.md"
HAS_CUDA = torch.cuda.is_available()
FAST_BENCH = ["--runs", "2", "--warmup", "0"]


# ---- reading the README ---------------------------------------------------------------------------------------------
def readme() -> str:
    """README.md as a reader sees it: its figures, without the comments they are rendered between
    (``scripts/render_docs.py``; ``tests/test_figures.py`` holds them to their files)."""
    return render_docs().plain(README.read_text())


def section(title: str) -> str:
    """The text under the ``## title`` heading, up to the next ``## `` heading."""
    text = readme()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def blocks(text: str, lang: str) -> list[str]:
    """The fenced blocks of ``text`` whose info string is ``lang`` ("" for a bare fence), fences paired in order."""
    found, current, info = [], None, ""
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            if current is None:
                current, info = [], line[3:].strip()
            else:
                if info == lang:
                    found.append("".join(current))
                current = None
        elif current is not None:
            current.append(line)
    return found


def test_blocks_pairs_fences_in_order():
    """A bare block after a python block was read as the text between them (a closing fence taken as an opening),
    so the README's "Several devices (HIOS)" commands were never run."""
    text = "```python\nx = 1\n```\n\n```\nopweave run\n```\n```python\ny = 2\n```\n"
    assert blocks(text, "") == ["opweave run\n"]
    assert blocks(text, "python") == ["x = 1\n", "y = 2\n"]


CLI_SECTIONS = ("Command line quick start", "Several devices (HIOS)")


def cli_lines() -> list[str]:
    """The commands (``opweave ...``, ``torchrun ...``) of the README's command-line blocks, without comments."""
    lines = []
    for title in CLI_SECTIONS:
        for block in blocks(section(title), ""):
            lines += [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    return lines


def python_statements(block: str) -> list[tuple[str, str, ast.stmt]]:
    """Each statement of a README block with its source and the comment on its (last) line."""
    lines = block.splitlines()
    out = []
    for node in ast.parse(block).body:
        comment = lines[node.end_lineno - 1].partition("#")[2].strip()
        out.append((ast.get_source_segment(block, node), comment, node))
    return out


def run_python(block: str) -> tuple[dict, dict[str, tuple[object, str]]]:
    """Run a README block statement by statement: (its namespace, {expression source: (value, comment)})."""
    namespace: dict = {}
    values: dict[str, tuple[object, str]] = {}
    for source, comment, node in python_statements(block):
        if isinstance(node, ast.Expr):
            values[source] = (eval(compile(ast.Expression(node.value), "README.md", "eval"), namespace), comment)
        else:
            exec(compile(ast.Module([node], []), "README.md", "exec"), namespace)
    return namespace, values


# ---- running a command line -----------------------------------------------------------------------------------------
def opweave_cli(line: str, *extra: str):
    """Run one ``opweave ...`` line through the CLI app (in the current directory); the click Result."""
    args = shlex.split(line)
    assert args[0] == "opweave", line
    return CliRunner().invoke(app, [*args[1:], *extra])


def succeeds(result) -> str:
    assert result.exit_code == 0, (result.exit_code, result.stderr, result.exception)
    return result.stdout


def fails_in_one_line(result, needle: str) -> str:
    """The CLI's contract for bad input or a missing device: status 2, one line on stderr naming the problem."""
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.exception)
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("opweave: error: "), result.stderr
    assert needle in result.stderr, result.stderr
    return result.stderr


def table_rows(text: str) -> dict[str, list[str]]:
    """The body rows of a rich table, by their first cell: ``│ lios │ 38.000 │ ...`` -> {"lios": ["38.000", ...]}
    (header rows are drawn with ``┃``, so they are not among them)."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if line.lstrip().startswith("│") and len(cells) > 1:
            rows[cells[0]] = cells[1:]
    return rows


# ---- the Python quick start -----------------------------------------------------------------------------------------
def test_python_quick_start_has_two_blocks():
    assert len(blocks(section("Python quick start"), "python")) == 2


@pytest.mark.slow
def test_python_quick_start_compile():
    block = blocks(section("Python quick start"), "python")[0]
    namespace, values = run_python(block)
    model, inputs, out, fast = (namespace[k] for k in ("model", "inputs", "out", "fast"))
    with torch.inference_mode():
        assert compare(model(*inputs), out).max_diff < 1e-4  # "equals model(*inputs) (allclose)"
    (stream_of, syncs), _ = values["fast.schedule.stream_of, fast.plan.syncs"]
    assert sorted(stream_of) == sorted(fast.graph.ids) and syncs == fast.plan.syncs > 0
    names, comment = values["opweave.schedulers.names()"]
    assert names == [n.strip() for n in comment.split(",")] == opweave.schedulers.names()


def test_python_quick_start_schedulers_on_graphs():
    block = blocks(section("Python quick start"), "python")[1]
    namespace, values = run_python(block)
    predicted, comment = values["s.predicted_ms"]
    assert comment == "38.0 (sequential: 73.0)" and predicted == 38.0
    g, schedulers = namespace["g"], namespace["schedulers"]
    assert schedulers.run("sequential", g, namespace["from_graph"](g)).predicted_ms == 73.0


FUSED = "Fused segments, and speed on the CPU"


@pytest.mark.slow
def test_fused_segments_block():
    block = blocks(section(FUSED), "python")[0]
    namespace, values = run_python(block)
    model, inputs, out, fused = (namespace[k] for k in ("model", "inputs", "out", "fused"))
    with torch.inference_mode():
        assert compare(model(*inputs), out).max_diff < 1e-4  # "equals model(*inputs) (allclose)"
    stats, comment = values["fused.fused.stats"]
    assert sorted(stats) == sorted(k.strip() for k in comment.split(","))
    assert stats["segments"] == stats["compiles"] > 1 and stats["compile_s"] > 0 and stats["fallbacks"] == 0
    assert fused.schedule.streams_used > 1  # several streams, each with its own segments


@pytest.mark.slow
def test_max_autotune_block(tmp_path, monkeypatch):
    monkeypatch.setenv("OPWEAVE_CACHE_DIR", str(tmp_path))
    first, second = blocks(section(FUSED), "python")
    namespace, _ = run_python(first.split("fused =")[0] + second)  # the model of the first block, then max-autotune
    model, inputs, fast = (namespace[k] for k in ("model", "inputs", "fast"))
    label, candidates = fast.choice["label"], fast.choice["candidates"]
    assert label in candidates and candidates[label]["median_ms"] == min(
        c["median_ms"] for c in candidates.values() if "median_ms" in c)
    with torch.inference_mode():
        assert compare(model(*inputs), fast(*inputs)).ok
    assert (tmp_path / "autotune.json").exists()  # "caches the choice"


# ---- the CPU results ------------------------------------------------------------------------------------------------
RESULTS = README.parent / "benchmarks" / "results"
CPU_TABLES = ("cpu_default",)  # the README's, in its order


def cpu_result(stem: str) -> dict:
    return json.loads((RESULTS / f"{stem}.json").read_text())


def test_cpu_result_files_are_rendered_from_their_json():
    """Each ``benchmarks/results/cpu_latency*.md`` is what cpu_latency.document renders from its JSON: the date and
    the command that produced the figures, then the tables."""
    for stem in (*CPU_TABLES, "cpu_latency", "cpu_latency_ortgraph"):
        data = cpu_result(stem)
        text = (RESULTS / f"{stem}.md").read_text()
        assert text == cpu_latency().document(data, stem), f"{stem}.md is not its JSON rendered"
        assert f"Measured {data['machine']['date'][:10]} by " in text and "python benchmarks/cpu_latency.py" in text


def test_readme_cpu_tables_are_their_json_rendered():
    """Every figure of the README's CPU tables is its JSON's, as cpu_latency.markdown renders it, under the date and
    command of the run that measured it and a link to its file; and the machine is the one the files name."""
    text = section("Results on a CPU")
    prose = " ".join(text.split())
    for stem in CPU_TABLES:
        data = cpu_result(stem)
        table = cpu_latency().markdown(data["rows"], data["summary"], data["settings"]["modes"])
        assert table in text, f"README: the table of {stem}.json is out of date"
        assert f"`{cpu_latency().command_line(data, stem)}`" in prose, stem
        assert data["machine"]["date"][:10] in prose and f"(benchmarks/results/{stem}.md)" in prose, stem
    machines = {(m["cpus_usable"], m["machine"], m["torch"], ".".join(m["python"].split(".")[:2]))
                for m in (cpu_result(stem)["machine"] for stem in CPU_TABLES)}
    ((cores, arch, torch_version, python),) = machines
    assert f"A {cores}-core {arch.replace('_', '-')} Linux machine, torch {torch_version}, Python {python}." in prose


def test_readme_says_which_mode_to_use_on_a_cpu_with_its_json_s_figures():
    """The default and max-autotune against torch.compile over the zoo, with their build times: the comparison table
    and the sentences that tell a CPU user what the default gives are rendered from the JSON (cpu_latency.verdict,
    cpu_latency.advice), and the first screen says where the CPU speed comes from."""
    prose = " ".join(section("Results on a CPU").split())
    data = cpu_result("cpu_default")
    assert {s["model"] for s in data["summary"]} == set(zoo_names()) and {s["batch"] for s in data["summary"]} == {1, 8}
    assert cpu_latency().verdict(data["summary"], data["rows"]) in section("Results on a CPU")
    assert " ".join(cpu_latency().advice(data).split()) in prose
    first_screen = " ".join(readme().split("\n## Install\n")[0].split())
    assert "the default's speed there comes from ONNX Runtime's compiled segments" in first_screen


def zoo_names() -> list[str]:
    from opweave import zoo

    return zoo.names()


# ---- the command line quick start -----------------------------------------------------------------------------------
def check_models(line: str, tmp_path: Path) -> None:
    out = succeeds(opweave_cli(line))  # once exited 2 with "opweave: error: 0"
    assert "opweave zoo" in out
    rows = table_rows(out)
    assert list(rows) == zoo.names()
    assert rows["inception_v3"] == ["124 / 158", "119 / 153"]  # opweave's op/edge counts, then the paper's


def check_schedule_fig3(line: str, tmp_path: Path) -> None:
    out = succeeds(opweave_cli(line))
    assert "lios on lios-fig3: makespan 38.000 ms (sequential 73.000)" in " ".join(out.split())
    rows = table_rows(out)
    assert list(rows) == ["v1", "v5", "v8", "v2", "v3", "v6", "v4", "v7", "v9", "v10"]  # LIOS's Table III order
    assert rows["v10"] == ["0", "0", "", "36.000", "38.000"]  # device, stream, stage, start, finish
    assert "streams 3, devices 1, syncs 5" in out
    as_json = json.loads(succeeds(opweave_cli(line, "--json")))  # "--json for machines"
    assert as_json["makespan_ms"] == 38.0 and len(as_json["ops"]) == 10


def check_simulate_fig3_all(line: str, tmp_path: Path) -> None:
    rows = table_rows(succeeds(opweave_cli(line)))
    assert list(rows) == opweave.schedulers.names()
    assert rows["sequential"][:2] == ["73.000", "1.00x"]
    assert rows["lios"][:2] == ["38.000", "1.92x"]
    assert all(float(cells[0]) >= 38.0 for cells in rows.values())  # the critical path


def check_simulate_zoo_gpu(line: str, tmp_path: Path) -> None:
    out = succeeds(opweave_cli(line))
    critical_ms = float(re.search(r"critical path ([0-9.]+) ms", out).group(1))
    assert "inception_v3:" in out and "cost model gpu" in out
    rows = table_rows(out)
    assert list(rows) == opweave.schedulers.names()
    assert rows["sequential"][1] == "1.00x"
    assert all(float(cells[0]) >= critical_ms for cells in rows.values())


def check_synth(line: str, tmp_path: Path) -> None:
    result = opweave_cli(line)
    succeeds(result)
    assert result.stderr.strip() == "wrote dag.json: 200 ops, 400 edges"
    graph = OpGraph.load(tmp_path / "dag.json")
    assert len(graph) == 200 and len(graph.edges) == 400


def check_simulate_file_gantt(line: str, tmp_path: Path) -> None:
    succeeds(opweave_cli(command("synth")))  # the README line before writes dag.json
    rows = table_rows(succeeds(opweave_cli(line)))
    assert list(rows) == ["hios-lp"] and 1 < int(rows["hios-lp"][3]) <= 4  # devices used
    assert (tmp_path / "gantt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def check_bench(line: str, tmp_path: Path) -> None:
    text = succeeds(opweave_cli(line, *FAST_BENCH))
    rows = table_rows(text)
    assert list(rows) == ["eager"] + [f"opweave {name}" for name in opweave.schedulers.names()]
    for mode, (median_ms, spread, versus, _, _, diff) in rows.items():
        assert float(median_ms) > 0 and spread.endswith("%") and versus.endswith("x"), (mode, spread, versus)
        if mode.startswith("opweave"):
            assert float(diff) < 1e-3, (mode, diff)
    assert "interleaved rounds" in text and "CPUs" in text


def check_profile_cuda(line: str, tmp_path: Path) -> None:
    result = opweave_cli(line)
    if not HAS_CUDA:
        fails_in_one_line(result, "CUDA is not available")
        assert not (tmp_path / "googlenet.profile.json").exists()
        return
    succeeds(result)
    assert json.loads((tmp_path / "googlenet.profile.json").read_text())["key"]["device"] == \
        torch.cuda.get_device_name()  # the profile store's key: the GPU's name ("NVIDIA H100 80GB HBM3")


def check_bench_cuda_profile(line: str, tmp_path: Path) -> None:
    if not HAS_CUDA:
        fails_in_one_line(opweave_cli(line, *FAST_BENCH), "CUDA is not available")
        return
    succeeds(opweave_cli(command("profile")))
    with no_tf32():  # the check below is eager's fp32 tolerance; TF32 rounds folded BatchNorm differently
        check_bench(line, tmp_path)


def check_simulate_profile(line: str, tmp_path: Path) -> None:
    if HAS_CUDA:
        succeeds(opweave_cli(command("profile")))  # the README line before
    else:  # what that line writes, measured on the CPU (one timed run per op: only the file's contents matter here)
        _, inputs, captured = load("googlenet")  # coarsened, as `opweave profile` measures it by default
        profile_model(captured, inputs, device="cpu", repeats=1, warmup=0).save(tmp_path / "googlenet.profile.json")
    profile = json.loads((tmp_path / "googlenet.profile.json").read_text())
    measured = profile["latency_ms"]
    out = succeeds(opweave_cli(line))
    assert "googlenet:" in out and "cost model gpu" in out
    rows = table_rows(out)
    assert list(rows) == opweave.schedulers.names()
    # the graph carries the measured latencies: doubling every one adds their sum to one stream's replay (which
    # also holds the graph's per-kernel gaps, the same in both runs)
    (tmp_path / "double.profile.json").write_text(json.dumps(
        {**profile, "latency_ms": {op: 2 * ms for op, ms in measured.items()}}))
    doubled = table_rows(succeeds(opweave_cli(line.replace("googlenet.profile.json", "double.profile.json"))))
    added = float(doubled["sequential"][0]) - float(rows["sequential"][0])
    assert added == pytest.approx(sum(measured.values()), abs=2e-3)  # each figure rounded to 3 decimals


def exported_model(path: Path) -> None:
    """``m.pt2`` for the ``--model-file`` lines: a zoo model saved by torch.export.save, as the README says."""
    model, inputs = zoo.create("squeezenet", batch_size=1)
    torch.export.save(torch.export.export(model, inputs), path)


def check_schedule_model_file(line: str, tmp_path: Path) -> None:
    exported_model(tmp_path / "m.pt2")
    out = succeeds(opweave_cli(line))
    assert re.search(r"lios on \S+: makespan [0-9.]+ ms", " ".join(out.split()))
    assert "scheduling time" in out


def check_bench_model_file(line: str, tmp_path: Path) -> None:
    exported_model(tmp_path / "m.pt2")
    check_bench(line, tmp_path)


# ---- serving (TOP) -------------------------------------------------------------------------------------------------
SMALL_IMAGES = ["--image-size", "64,inception_v3=75"]  # the zoo CNNs at small sizes: the same code, a shorter run


@contextlib.contextmanager
def readme_server():
    """The README's ``opweave serve`` line in a subprocess, on a free port of 127.0.0.1 (``--port 0`` after the
    line's own ``--port``: the last one counts) with small images; yields its URL; SIGTERM at the end must drain and
    exit 0."""
    line = command("serve")
    proc = subprocess.Popen([sys.executable, "-m", "opweave", *shlex.split(line)[1:], "--port", "0", *SMALL_IMAGES],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        found = re.search(r"listening on (http://127\.0\.0\.1:\d+)", first)
        assert found, (first, proc.stderr.read() if proc.poll() is not None else "")
        assert "inception_v3 (11 blocks)" in first and "policy static (the default on a CPU)" in first
        yield found.group(1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 0, proc.stderr.read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def check_serve(line: str, tmp_path: Path) -> None:
    with readme_server() as url:
        assert httpx.get(f"{url}/v2/health/ready", timeout=60).status_code == 200
        meta = httpx.get(f"{url}/v2/models/squeezenet", timeout=60).json()
        assert meta["name"] == "squeezenet" and meta["inputs"][0]["shape"][-2:] == [64, 64]


def loadgen_totals(result) -> dict:
    report = json.loads(succeeds(result).strip().splitlines()[-1])
    total = report["total"]
    assert total["sent"] == total["answered"] + total["rejected"] + total["timeouts"] + total["errors"] > 0
    assert total["errors"] == 0 and total["p50_ms"] <= total["p99_ms"]
    return report


def check_loadgen_url(line: str, tmp_path: Path) -> None:
    with readme_server() as url:  # a tenth of the README's rates for 2 s: a CPU at small images keeps up
        report = loadgen_totals(opweave_cli(line, "--url", url, "--duration", "2", "--scale", "0.1", "--json"))
    assert set(report["models"]) == {"inception_v3", "resnet50", "squeezenet"}
    assert report["total"]["answered"] > 0


def check_loadgen_simulate(line: str, tmp_path: Path) -> None:
    report = loadgen_totals(opweave_cli(line, "--duration", "1", "--json"))  # 1 s of virtual time
    assert report["mode"] == "simulate" and report["device_preset"] == "h100"
    assert report["pattern"] == {"inception_v3": 60.0, "resnet50": 120.0, "squeezenet": 240.0}


def check_blocks(line: str, tmp_path: Path) -> None:
    rows = table_rows(succeeds(opweave_cli(line)))

    def row(model: str) -> list[str]:  # at the runner's 80 columns rich cuts long names short ("squeeze…")
        return next(cells for name, cells in rows.items() if name and model.startswith(name.rstrip("…")))

    # captured ops, cut points, segments, blocks, TOP's blocks (docs/serving.md's table)
    assert row("inception_v3")[:5] == ["312", "29", "30", "11", "13"]
    assert row("resnet50")[:5] == ["174", "37", "38", "16", "5"]
    assert row("squeezenet")[:5] == ["64", "31", "32", "8", "12"]


# ---- several devices (HIOS) -----------------------------------------------------------------------------------------
FAST_RUN = ["--runs", "2", "--warmup", "1"]


def check_run_ranks(line: str, tmp_path: Path) -> None:
    proc, left = rank_command(*shlex.split(line)[1:], *FAST_RUN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "median latency" in proc.stdout and "max |diff| against single-process eager" in proc.stdout
    assert left == []  # no rank process outlives the run


def check_run_torchrun(line: str, tmp_path: Path) -> None:
    args = shlex.split(line)
    proc, left = rank_command(*args[1:], *FAST_RUN, "--json", launcher=(str(TORCHRUN),))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])  # rank 0 alone reports
    assert result["launch"] == "torchrun" and result["devices"] == 2 and result["max_abs_diff"] <= result["tolerance"]
    assert result["median_ms"] > 0 and len(result["ranks"]) == 2
    assert result["ops"] == sum(r["ops"] for r in result["ranks"]) == 124  # coarsened, as docs/zoo.md counts
    assert left == []


def check_profile_links(line: str, tmp_path: Path) -> None:
    proc, left = rank_command(*shlex.split(line)[1:], "--repeats", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fit: latency" in proc.stdout and left == []
    link = load_link(tmp_path / "link.json")
    assert link.bandwidth_gbs > 0 and link.latency_ms >= 0 and len(link.samples) >= 3


def check_simulate_link(line: str, tmp_path: Path) -> None:
    rows = table_rows(succeeds(opweave_cli(line)))
    assert list(rows) == ["hios-lp"] and 1 < int(rows["hios-lp"][3]) <= 4  # devices used


# README line -> its check; marks for the slow ones and those that need CUDA to succeed
CHECKS = {
    "opweave models": (check_models, ()),
    "opweave schedule lios-fig3 --scheduler lios --streams 3": (check_schedule_fig3, ()),
    "opweave simulate lios-fig3 --scheduler all --streams 3": (check_simulate_fig3_all, ()),
    "opweave simulate --model inception_v3 --cost-model gpu": (check_simulate_zoo_gpu, (pytest.mark.slow,)),
    "opweave synth --ops 200 --layers 14 --seed 1 -o dag.json": (check_synth, ()),
    "opweave simulate dag.json --devices 4 --scheduler hios-lp --gantt gantt.png": (check_simulate_file_gantt, ()),
    "opweave bench --model googlenet --device cpu --schedulers all": (check_bench, (pytest.mark.slow,)),
    "opweave profile --model googlenet --device cuda -o googlenet.profile.json": (check_profile_cuda,
                                                                                 (pytest.mark.cuda,)),
    "opweave bench --model googlenet --device cuda --profile googlenet.profile.json --schedulers all": (
        check_bench_cuda_profile, (pytest.mark.cuda,)),
    "opweave simulate --model googlenet --profile googlenet.profile.json --cost-model gpu": (
        check_simulate_profile, (pytest.mark.slow,)),
    # the --model-file lines (README of the `models` work): a model saved by torch.export.save
    "opweave schedule --model-file m.pt2 --scheduler lios": (check_schedule_model_file, (pytest.mark.slow,)),
    "opweave bench --model-file m.pt2 --device cpu --schedulers all": (check_bench_model_file, (pytest.mark.slow,)),
    # serving (TOP)
    "opweave serve --models inception_v3,resnet50,squeezenet --device cpu --port 8000": (
        check_serve, (pytest.mark.slow,)),
    "opweave loadgen --url http://127.0.0.1:8000 --pattern inception_v3:30,resnet50:60,squeezenet:120 --duration 10": (
        check_loadgen_url, (pytest.mark.slow,)),
    "opweave loadgen --simulate --preset h100 --pattern inception_v3:60,resnet50:120,squeezenet:240": (
        check_loadgen_simulate, (pytest.mark.slow,)),
    "opweave blocks --models inception_v3,resnet50,squeezenet": (check_blocks, (pytest.mark.slow,)),
    # several devices (HIOS)
    "opweave run --model inception_v3 --scheduler hios-lp --devices 2 --device cpu --check": (check_run_ranks,
                                                                                             (pytest.mark.slow,)),
    "torchrun --standalone --nproc-per-node 2 -m opweave run --model inception_v3 --check": (check_run_torchrun,
                                                                                            (pytest.mark.slow,)),
    "opweave profile-links --device cpu -o link.json": (check_profile_links, ()),
    "opweave simulate --model inception_v3 --devices 4 --scheduler hios-lp --link pcie4": (check_simulate_link,
                                                                                          (pytest.mark.slow,)),
}


def command(verb: str) -> str:
    """The first README line running ``opweave <verb>`` (for a check that needs the file an earlier line writes)."""
    return next(line for line in cli_lines() if line.split()[1] == verb)


def test_every_readme_command_is_checked():
    unchecked = [line for line in cli_lines() if line not in CHECKS]
    assert not unchecked, f"README command(s) without a test here: {unchecked}"


@pytest.mark.parametrize("line", [pytest.param(line, marks=CHECKS[line][1] if line in CHECKS else (), id=line)
                                  for line in cli_lines()])
def test_readme_command(line, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    check, _ = CHECKS[line]
    check(line, tmp_path)
