"""The command line contract, run as a user would: JSON output, files written, and the error contract — an
``OpweaveError`` (bad input, a missing device) exits with status 2 and one line on stderr; anything else is a bug
and keeps its traceback.

Commands run in-process through ``typer.testing.CliRunner`` (the same Typer app the ``opweave`` script runs); the
tests that are about the process itself (what reaches stderr, the exit status) run ``python -m opweave`` in a
subprocess. The README's own commands and their tables are in ``test_readme.py``.
"""

import json
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import typer
from typer.testing import CliRunner

import opweave as ow
from opweave import errors
from opweave.cli import app
from opweave.cli.app import guard
from opweave.errors import UsageError
from opweave.ir import OpGraph
from opweave.pipeline import targets


def opweave(*args: str, check_rc: int | None = 0):
    """Run ``opweave ARGS`` in-process; the click Result (``stdout``, ``stderr``, ``exit_code``, ``exception``)."""
    result = CliRunner().invoke(app, list(args))
    if check_rc is not None:
        assert result.exit_code == check_rc, (result.stderr, result.exception)
    return result


def one_line(result) -> str:
    assert result.stderr.startswith("opweave: error: ") and result.stderr.count("\n") == 1, result.stderr
    return result.stderr


def opweave_process(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "opweave", *args], capture_output=True, text=True, timeout=900)


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


def test_schedule_takes_every_scheduler_or_a_list_as_its_own_error_text_offers():
    # `-s all` raised "too many values to unpack" though the error text offered "all"
    result = opweave("schedule", "lios-fig3", "-s", "all")
    for name in ow.schedulers.names():
        assert f"{name} on lios-fig3: makespan" in " ".join(result.stdout.split()), name
    listed = json.loads(opweave("schedule", "lios-fig3", "-s", "lios,opara", "--json").stdout)
    assert [r["scheduler"] for r in listed] == ["lios", "opara"]
    simulated = json.loads(opweave("simulate", "lios-fig3", "-s", "lios,opara", "--json").stdout)
    assert [r["scheduler"] for r in simulated["results"]] == ["lios", "opara"]


def test_serve_refuses_a_body_limit_its_budget_could_never_admit():
    # a body over --max-held-mb is refused 503 whatever the load: a limit above it would refuse every such request
    assert "raise --max-held-mb" in one_line(opweave("serve", "--models", "squeezenet", "--max-body-mb", "600",
                                                    check_rc=2))


def test_bad_graph_exits_2_with_one_line_naming_the_op(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "opweave.graph/1", "ops": [{"id": "a"}, {"id": "a"}], "edges": []}))
    proc = opweave_process("schedule", str(bad), "--scheduler", "lios")  # the whole process: status and stderr
    assert proc.returncode == 2
    assert proc.stderr == "opweave: error: duplicate op id 'a'\n"
    assert proc.stdout == ""


@pytest.mark.parametrize("args, needle", [
    (["schedule", "lios-fig3", "--scheduler", "magic"], "unknown scheduler 'magic'"),
    (["schedule", "no-such-file.json"], "no graph file"),
    (["simulate", "lios-fig3", "--cost-model", "quantum"], "unknown cost model"),
    (["schedule"], "give a GRAPH"),
    (["bench", "--model", "squeezenet", "--device", "tpu"], "device must be cpu, cuda or auto"),
    (["bench", "--model", "squeezenet", "--schedulers", "defualt"],
     "unknown scheduler 'defualt' (did you mean 'default'?); choose default,"),
    (["bench", "--model", "squeezenet", "--option", "mode=max-autotune"], "use --schedulers default"),
    (["simulate", "--model", "deepfm", "--profile", "no-such.profile.json"], "cannot read profile"),
])
def test_usage_errors_exit_2(args, needle):
    assert needle in one_line(opweave(*args, check_rc=2))


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU it would serve")
def test_serving_on_cuda_without_a_gpu_is_one_line_before_any_model_loads():
    """It loaded the models onto the missing device and failed there, with a traceback."""
    proc = opweave_process("serve", "--device", "cuda", "--models", "squeezenet", "--port", "1")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "opweave: error: CUDA is not available on this machine; use --device cpu\n"


def test_synth_is_deterministic(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    opweave("synth", "--ops", "200", "--layers", "14", "--seed", "1", "-o", str(a))
    opweave("synth", "--ops", "200", "--layers", "14", "--seed", "1", "-o", str(b))
    assert a.read_bytes() == b.read_bytes()
    g = OpGraph.load(a)
    assert len(g) == 200 and len(g.edges) == 400
    assert json.loads(opweave("synth", "--ops", "200", "--layers", "14", "--seed", "1").stdout) == g.to_dict()


def test_simulate_all_schedulers_json():
    rows = json.loads(opweave("simulate", "lios-fig3", "--streams", "3", "--json").stdout)["results"]
    assert [r["scheduler"] for r in rows] == ow.schedulers.names()
    assert all(r["makespan_ms"] >= 38.0 - 1e-9 for r in rows)


def test_simulate_writes_gantt_and_trace(tmp_path):
    png, trace = tmp_path / "g.png", tmp_path / "t.json"
    opweave("simulate", "lios-fig3", "--scheduler", "lios", "--streams", "3", "--gantt", str(png),
            "--trace", str(trace))
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert len([e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]) == 10
    assert "need a single --scheduler" in one_line(opweave("simulate", "lios-fig3", "--gantt", str(png), check_rc=2))


def test_models_json_lists_the_zoo():
    assert json.loads(opweave("models", "--json").stdout) == ow.zoo.names()


def test_bench_cpu_json():
    result = json.loads(opweave("bench", "--model", "squeezenet", "--device", "cpu", "--schedulers", "sequential,lios",
                                "--runs", "2", "--warmup", "1", "--json").stdout)
    assert [r["mode"] for r in result["rows"]] == ["eager", "opweave sequential", "opweave lios"]
    assert all(0 < r["p10_ms"] <= r["median_ms"] <= r["p90_ms"] and r["spread_pct"] >= 0 for r in result["rows"])
    assert all(r["max_abs_diff"] < 1e-3 for r in result["rows"][1:])
    # each speed-up carries the verdict of the rule (opweave.evaluate.bench.versus) on its own figures
    for row in result["rows"][1:]:
        assert row["within_spread"] == (row["p10_ms"] <= result["rows"][0]["p90_ms"]
                                        and result["rows"][0]["p10_ms"] <= row["p90_ms"])
    assert "within_spread" not in result["rows"][0] and result["rounds"] == 2
    machine = result["machine"]
    assert set(machine) == {"cpus", "load_average_1_5_15m", "others_cpu_share", "busy"}
    assert (result["warning"] is not None) == machine["busy"]


def test_bench_times_what_compile_picks_by_itself_and_says_what_it_picked():
    """``default`` (first by default, so ``make demo`` shows it) is opweave.compile given no scheduler: on a CPU
    the guard's pick among its lanes, one lane and the model itself."""
    result = json.loads(opweave("bench", "--model", "squeezenet", "--device", "cpu", "--runs", "2", "--warmup", "1",
                                "--json").stdout)
    assert [r["mode"] for r in result["rows"]] == ["eager", "opweave default", "opweave sequential", "opweave lios",
                                                   "opweave opara"]
    default = result["rows"][1]
    assert default["choice"] in targets.DEFAULT_LABELS and default["ok"]
    assert "choice" not in result["rows"][2]  # a scheduler given is built as it is
    table = opweave("bench", "--model", "squeezenet", "--device", "cpu", "--schedulers", "default", "--runs", "1",
                    "--warmup", "0").stdout
    assert re.search(r"opweave default picked (" + "|".join(targets.DEFAULT_LABELS) + ")", table), table


def test_cpu_profile_feeds_simulate_and_is_refused_for_another_model(tmp_path):
    path = tmp_path / "sq.json"
    opweave("profile", "--model", "deepfm", "--device", "cpu", "-o", str(path))
    measured = json.loads(path.read_text())["latency_ms"]
    result = json.loads(opweave("schedule", "--model", "deepfm", "--profile", str(path), "--scheduler", "sequential",
                                "--coarsen", "--json").stdout)  # `opweave profile` measures the coarsened graph
    assert result["sequential_ms"] == pytest.approx(sum(measured.values()))
    assert "measured for model 'deepfm'" in one_line(opweave("simulate", "--model", "squeezenet", "--profile",
                                                             str(path), check_rc=2))
    assert "other granularity" in one_line(opweave("simulate", "--model", "deepfm", "--profile", str(path),
                                                    "--no-coarsen", check_rc=2))  # the fine graph


def test_schedule_and_simulate_plan_the_coarsened_graph_unless_no_coarsen():
    """They planned one op per fx node while compile, bench, profile and run plan the coarsened graph."""
    from opweave.capture import load

    coarse, fine = load("deepfm").captured.graph, load("deepfm", coarsen=False).captured.graph
    assert len(coarse) < len(fine)
    for flag, graph in ((), coarse), (("--no-coarsen",), fine):
        result = json.loads(opweave("schedule", "--model", "deepfm", "--scheduler", "lios", "--json", *flag).stdout)
        assert sorted(o["id"] for o in result["ops"]) == sorted(graph.ids)
        assert json.loads(opweave("simulate", "--model", "deepfm", "--json", *flag).stdout)["ops"] == len(graph)


# ---- the guard: only the OpweaveError family becomes one line and status 2 -----------------------------------------
def guarded_app(exc: BaseException) -> typer.Typer:
    """A one-command app whose command raises ``exc`` through the CLI's guard."""
    one = typer.Typer()

    @one.command()
    @guard
    def fail():
        raise exc

    return one


OPWEAVE_ERRORS = [getattr(errors, name) for name in errors.__all__ if isinstance(getattr(errors, name), type)]


@pytest.mark.parametrize("cls", OPWEAVE_ERRORS, ids=lambda cls: cls.__name__)
def test_guard_turns_every_opweave_error_into_one_line(cls):
    assert issubclass(cls, errors.OpweaveError)
    result = CliRunner().invoke(guarded_app(cls("op 'v3': first line\nsecond line")), [])
    assert result.exit_code == 2 and result.stderr == "opweave: error: op 'v3': first line\n"


@pytest.mark.parametrize("exc", [KeyError(0), ValueError("bad value"), RuntimeError("boom"), TypeError("t"),
                                 ImportError("no module")], ids=lambda exc: type(exc).__name__)
def test_guard_lets_every_other_error_through(exc):
    # a KeyError once became "opweave: error: 0" and status 2; the builtins the OpweaveError family also derives
    # from (ValueError, RuntimeError, ImportError) must not be caught either
    result = CliRunner().invoke(guarded_app(exc), [])
    assert result.exception is exc and result.exit_code == 1
    assert "opweave: error" not in result.stderr


def test_a_bug_in_a_real_command_is_not_turned_into_a_usage_error(monkeypatch):
    def broken():
        raise KeyError(0)

    monkeypatch.setattr(ow.zoo, "names", broken)  # `opweave models` once exited 2 with "opweave: error: 0"
    result = CliRunner().invoke(app, ["models"])
    assert isinstance(result.exception, KeyError) and result.exit_code == 1
    assert "opweave: error" not in result.stderr


def test_a_bug_prints_its_traceback():
    script = textwrap.dedent("""
        from opweave.cli import app
        from opweave.cli.app import guard

        @app.command()
        @guard
        def broken():
            return {}[0]

        app(["broken"], prog_name="opweave")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr and proc.stderr.endswith("KeyError: 0\n")
    assert "opweave: error" not in proc.stderr


def test_the_design_lists_every_command():
    """docs/design.md §5 is the CLI's outside contract; it had missed train-gpg and train-policy."""
    import re
    from pathlib import Path

    from typer.main import get_command

    design = (Path(__file__).resolve().parent.parent / "docs" / "design.md").read_text()
    listed = re.search(r"\* \*\*CLI\*\*: `opweave ([^`]+)`", design).group(1)
    assert sorted(c.strip() for c in listed.split("|")) == sorted(get_command(app).commands)



def test_version_and_short_help():
    assert opweave("--version").stdout.strip() == f"opweave {ow.__version__}"
    assert "[OPTIONS] COMMAND" in opweave("-h").stdout  # CliRunner names the program "root"
    assert " simulate [OPTIONS]" in opweave("simulate", "-h").stdout


def test_short_o_means_output_on_every_command():
    """``-o`` names a file to write wherever it exists; options are given as ``--option KEY=VALUE``."""
    command = typer.main.get_command(app)
    for name, sub in command.commands.items():
        for param in sub.params:
            if "-o" in getattr(param, "opts", ()):
                assert param.name == "output", (name, param.opts)


def test_help_texts_keep_their_square_brackets():
    """Typer renders help as Rich markup, where ``[word]`` is a tag and vanishes: ``--ray``'s help said "(needs
    opweave)" for ``opweave[ray]``. Every bracketed word of every command's help must reach the screen."""
    import re

    import typer.main

    command = typer.main.get_command(app)
    checked = 0
    for name, sub in command.commands.items():
        raw = [sub.help or ""] + [getattr(p, "help", None) or "" for p in sub.params]
        wanted = [token.replace("\\[", "[") for text in raw for token in re.findall(r"[^\s(]*\\?\[[^\]\s]*\]", text)]
        if wanted:
            shown = " ".join(opweave(name, "--help").stdout.split())
            for token in wanted:
                assert token in shown, (name, token)
                checked += 1
    assert checked >= 1  # serve's --ray


def test_the_default_serving_policy_is_told_one_way():
    """What ``opweave serve`` and ``opweave loadgen --simulate`` run without ``--policy`` (DEFAULT_POLICIES) is what
    both commands' help, docs/serving.md and the README say; loadgen against a server refuses a policy of its own."""
    from pathlib import Path

    from opweave.serve.assemble import DEFAULT_POLICIES

    def policy_help(name: str) -> str:  # as --help prints it, before Rich draws it into a panel
        command = typer.main.get_command(app).commands[name]
        return next(p.help for p in command.params if "--policy" in p.opts) + " " + command.help

    cpu, gpu, sim = DEFAULT_POLICIES["cpu"], DEFAULT_POLICIES["cuda"], DEFAULT_POLICIES["sim"]
    assert f"default: {cpu} on a CPU, {gpu} on a GPU" in policy_help("serve")
    assert f"default: {sim}, the default on a GPU, which the simulator models" in policy_help("loadgen")
    assert f"opweave serve``: {cpu} on a CPU, {gpu} on a GPU" in " ".join(policy_help("loadgen").split())
    assert gpu == sim
    root = Path(__file__).resolve().parent.parent
    serving = " ".join((root / "docs" / "serving.md").read_text().split())
    assert (f"`opweave serve` runs `{cpu}` on a CPU and `{gpu}` on a GPU, and `opweave loadgen --simulate` runs "
            f"`{sim}`") in serving
    assert f"* `{cpu}` (the default on a CPU)" in serving and f"* `{gpu}` (ours; the default on a GPU" in serving
    readme = " ".join((root / "README.md").read_text().split())
    assert f"on a CPU the default is `{cpu}`" in readme and f"on a CPU the default policy, `{cpu}`" in readme
    refused = opweave("loadgen", "--url", "http://127.0.0.1:1", "--pattern", "squeezenet:1", "--policy", "batch",
                      check_rc=2)
    assert "go with --simulate" in one_line(refused)


def test_every_command_names_a_device_a_scheduler_and_a_mode_one_way():
    """``--device`` defaults to auto (cuda when present) in every command that takes one; the scheduler flag is
    ``--scheduler``/``-s`` everywhere (where a command compares schedulers it also takes a comma list or all);
    ``--mode`` goes wherever ``--option`` does, as ``compile`` has ``mode=``."""
    command = typer.main.get_command(app)
    devices = schedulers_seen = modes = 0
    for name, sub in command.commands.items():
        params = {opt: param for param in sub.params for opt in getattr(param, "opts", ())}
        if "--device" in params:
            assert params["--device"].default == "auto", name
            devices += 1
        if "--scheduler" in params:
            assert "-s" in params["--scheduler"].opts, name
            schedulers_seen += 1
        if "--option" in params:
            assert "--mode" in params, name
            modes += 1
    assert devices >= 5 and schedulers_seen >= 5 and modes >= 3  # bench, profile, serve, run, profile-links, ...
    assert "--mode" in {o for p in command.commands["bench"].params for o in p.opts}
    assert "--mode" in {o for p in command.commands["serve"].params for o in p.opts}


def test_every_commands_help_is_read_as_markdown_with_no_markup_left_and_flags_without_a_type():
    """Help texts were shown with their ``code`` quotes, reST roles and a ``<bool>`` beside every flag."""
    command = typer.main.get_command(app)
    for name in ["", *command.commands]:
        shown = opweave(*([name] if name else []), "--help").stdout
        assert "``" not in shown and ":func:" not in shown and "<bool>" not in shown, name
        assert "DIR///" not in shown, name  # an <angle> word is HTML to Markdown: it vanished
    assert "--model-repository" in opweave("serve", "--help").stdout


def test_a_model_file_is_a_path_in_every_command_and_a_server_may_name_it(tmp_path):
    from opweave.serve.models import parse_model_files

    path = tmp_path / "tiny.pt2"
    path.write_bytes(b"")
    assert parse_model_files([str(path)]) == {"tiny": path}
    assert parse_model_files([f"other={path}"]) == {"other": path}
    with pytest.raises(UsageError, match="two models named 'tiny'"):
        parse_model_files([str(path), f"tiny={path}"])


def _commands() -> list[list[str]]:
    import typer.main

    return [[], *([name] for name in typer.main.get_command(app).commands)]


TYPE_NAMES = re.compile(r"<(str|int|float|bool|path|list|tuple|Path)\b[^>]*>|\blist\[|\{[A-Za-z_]+\}|"
                        r"\b(TEXT|INTEGER|FLOAT|BOOLEAN|FILENAME|PATH RANGE)\b")


@pytest.mark.parametrize("command", _commands(), ids=lambda c: " ".join(c) or "opweave")
def test_help_shows_what_each_value_is_never_a_type_name(command):
    """Typer showed the annotations' types (``<list[str]>``, ``<list[Path]>``, ``{results}...``) where a value's
    meaning belongs; every flag and argument has a help text of its own."""
    import click
    import typer.main

    result = CliRunner().invoke(app, [*command, "--help"], terminal_width=200, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    found = TYPE_NAMES.search(result.output)
    assert found is None, f"{found.group(0)!r} in the help of opweave {' '.join(command)}:\n{result.output}"
    group = typer.main.get_command(app)
    target = group.commands[command[0]] if command else group
    bare = [p.opts for p in target.get_params(click.Context(target)) if not p.help and p.name != "help"]
    assert not bare, f"no help text for {bare} of opweave {' '.join(command)}"
