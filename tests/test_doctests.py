"""Every example in the package's docstrings runs and prints what it says (doctest), so no example goes stale.

Modules are found by walking the package, not listed by hand: a new module's examples run without being added here.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import opweave

SKIP = {"opweave.__main__"}  # running it is running the CLI
MODULES = ["opweave"] + sorted(m.name for m in pkgutil.walk_packages(opweave.__path__, "opweave.")
                              if m.name not in SKIP)
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _examples(name: str) -> list[doctest.DocTest]:
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        if _internal(exc.name):  # a broken import inside the project must fail, not hide the module's examples
            raise
        pytest.skip(f"{name}: {exc}")  # an optional extra that is not installed; the module's own tests say so
    return [t for t in doctest.DocTestFinder().find(module, name) if t.examples]


def _internal(missing: str | None) -> bool:
    """Whether the module an ImportError could not import is the project's own (or unknown): not an optional
    third-party package."""
    return missing is None or missing == "opweave" or missing.startswith("opweave.")


WITH_EXAMPLES = ["opweave", "opweave.api", "opweave.backends.simulate", "opweave.plan.lower", "opweave.plan.semantics",
                 "opweave.schedulers"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    for test in _examples(name):
        runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, f"{results.failed} of {results.attempted} examples in {name} failed (output above)"


def test_only_a_missing_third_party_package_skips_a_module(tmp_path, monkeypatch):
    """Any ImportError skipped the module, so a broken import inside the project hid its examples."""
    (tmp_path / "broken_inside.py").write_text("from opweave.errors import NoSuchError\n")
    (tmp_path / "needs_an_extra.py").write_text("import no_such_optional_package\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def outcome(name: str) -> str:
        try:
            _examples(name)
        except pytest.skip.Exception:
            return "skipped"
        except ImportError as exc:
            return f"failed: {exc.name}"
        return "imported"

    assert outcome("broken_inside") == "failed: opweave.errors"
    assert outcome("opweave.no_such_module") == "failed: opweave.no_such_module"
    assert outcome("needs_an_extra") == "skipped"
    assert outcome("opweave.errors") == "imported"


def test_examples_are_found():
    """The walk finds the modules whose docstrings hold examples (a finder that found nothing would pass above)."""
    for name in WITH_EXAMPLES:
        assert name in MODULES and _examples(name), name


def test_decisions_are_logged_at_debug_only(caplog):
    """Scheduling, lowering, the program every backend runs and the simulator each log their decisions at DEBUG on
    their module's logger, and nothing above DEBUG (silent by default)."""
    from opweave import examples, schedulers
    from opweave.backends.program import Program
    from opweave.backends.simulate import simulate
    from opweave.costs.model import from_graph
    from opweave.plan.lower import lower

    graph = examples.load("lios-fig3")
    costs = from_graph(graph)
    with caplog.at_level("DEBUG", logger="opweave"):
        plan = lower(graph, schedulers.run("lios", graph, costs, streams=3))
        Program.from_plan(plan)
        simulate(graph, plan, costs)
    loggers = {r.name for r in caplog.records}
    assert {"opweave.schedulers", "opweave.plan.lower", "opweave.backends.program",
            "opweave.backends.simulate"} <= loggers
    assert all(r.levelname == "DEBUG" for r in caplog.records)
    assert any("3 lanes" in r.getMessage() for r in caplog.records if r.name == "opweave.backends.program")
