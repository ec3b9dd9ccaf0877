"""Figures in prose cannot go stale.

A figure written between the markers of ``scripts/render_docs.py`` (``<!--fig FILE: EXPR | FORMAT-->...<!--/fig-->``)
is rendered from its results file by code: every committed page is its rendering, and a changed value in a results
file changes the page.

Every other number with a unit (ms, s, MB, %, ×, ...) in a paragraph of README.md or docs/*.md that cites a results
file (``benchmarks/results/NAME.json``, ``.md``, ``.png``) must be one of that file's values, a unit conversion of
one, or a ratio of two values measured side by side (two rows of one table, or two fields of one record), at the
precision the prose gives. Tables are held to their JSON by the tests of the pages that render them; a figure that
is a setting of the run (a flag's value) is in the JSON's command or flags, so it matches too. A paragraph whose
figures come from elsewhere does not cite a results file."""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import pytest

from benchmark_module import render_docs

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CITE = re.compile(r"results/([A-Za-z0-9_.\-]+?)\.(?:json|md|png)")
NUMBER = r"\d+(?:,\d{3})*(?:\.\d+)?"
FIGURE = re.compile(rf"(?<![\w.\-/])({NUMBER})(?:\s*[–-]\s*({NUMBER}))?\s*(ms|s|MB|GB|KB|KiB|MiB|GiB|%|x|×)(?![\w/])")
# each unit, and the units a value of a results file may be kept in: a figure in s may come from ms, ...
SCALES = {"ms": (1.0, 1e3), "s": (1.0, 1e-3), "MB": (1.0, 1e-6, 2.0 ** -20), "GB": (1.0, 1e-9, 2.0 ** -30),
          "KB": (1.0, 1e-3, 2.0 ** -10), "KiB": (1.0, 2.0 ** -10), "MiB": (1.0, 2.0 ** -20),
          "GiB": (1.0, 2.0 ** -30), "%": (1.0, 100.0), "x": (1.0,), "×": (1.0,)}


def paragraphs(path: Path) -> list[str]:
    """The prose paragraphs of ``path``: blank-line separated, code blocks and tables left out, and the rendered
    figures (held to their files by the rendering) with their markers."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    text = render_docs().ALIAS.sub("", render_docs().MARKER.sub("", text))
    return [p for p in re.split(r"\n\s*\n", text) if p.strip() and not p.lstrip().startswith(("|", "#", "<"))]


def cited(paragraph: str) -> list[Path]:
    """The results files ``paragraph`` cites (a link, or a path alone in backticks; not a path a command line in
    backticks writes to), as the JSON that holds their figures."""
    found = []
    parts = paragraph.split("`")  # odd parts are code: a command line in one names no source
    prose = " ".join(part for i, part in enumerate(parts) if i % 2 == 0 or not re.search(r"\s", part))
    for stem in dict.fromkeys(CITE.findall(prose)):
        path = RESULTS / f"{stem}.json"
        if path.exists():
            found.append(path)
    return found


def leaves(data) -> list[float]:
    """Every number in ``data``: numeric values, and numbers written in its strings (a command's flags)."""
    out: list[float] = []
    if isinstance(data, bool):
        return out
    if isinstance(data, (int, float)):
        return [float(data)] if math.isfinite(data) else []
    if isinstance(data, str):
        return [float(n.replace(",", "")) for n in re.findall(NUMBER, data)]
    for value in (data.values() if isinstance(data, dict) else data if isinstance(data, list) else []):
        out += leaves(value)
    return out


CONFIGURATION = ("model", "graph", "batch", "batch_size", "dtype", "precision", "device", "scenario", "config",
                 "image_size", "streams")  # what two rows must share to have been measured side by side


def ratios(data) -> list[float]:
    """Ratios of values measured side by side: between the values of a record of numbers alone (``{"idle": 15.6,
    "attacked": 16.6}``), and between the same field of two rows of one list that share their configuration (the
    same model, batch, dtype, ...: two modes' rows)."""
    out: list[float] = []
    if isinstance(data, dict):
        numbers = [float(v) for v in data.values() if isinstance(v, (int, float)) and not isinstance(v, bool) and v]
        if numbers and len(numbers) == len(data) and len(numbers) <= 16:
            out += [a / b for a, b in itertools.permutations(numbers, 2)]
        for value in data.values():
            out += ratios(value)
    elif isinstance(data, list):
        records = [r for r in data if isinstance(r, dict)]
        groups: dict[str, list[dict]] = {}
        for r in records:
            groups.setdefault(json.dumps([r.get(k) for k in CONFIGURATION], default=str), []).append(r)
        for group in groups.values():
            if len(group) > 40:
                continue
            for a, b in itertools.permutations(group, 2):
                out += [float(a[k]) / float(b[k]) for k in a.keys() & b.keys()
                        if isinstance(a[k], (int, float)) and isinstance(b[k], (int, float))
                        and not isinstance(a[k], bool) and b[k] and k not in CONFIGURATION]
        for value in data:
            out += ratios(value)
    return out


def held(figure: str, unit: str, values: list[float]) -> bool:
    """Whether ``figure`` (as written) is one of ``values`` (its magnitude: prose says "8.5% off", not "-8.5%") in
    some unit ``unit`` may come from, at its precision."""
    shown = float(figure.replace(",", ""))
    decimals = len(figure.partition(".")[2])
    half = 0.5 * 10.0 ** -decimals + 1e-9
    return any(abs(abs(v) * scale - shown) <= half * max(1.0, 1e-3 * shown if decimals == 0 and shown >= 100 else 1.0)
               for scale in SCALES[unit] for v in values)


def figures_of(paragraph: str):
    for low, high, unit in FIGURE.findall(paragraph):
        yield from ((n, unit) for n in (low, high) if n)


CASES = [(path, p) for path in DOCS for p in paragraphs(path) if cited(p) and any(True for _ in figures_of(p))]


@pytest.mark.parametrize(("path", "paragraph"), CASES,
                         ids=[f"{path.name}:{p.strip()[:40]}" for path, p in CASES])
def test_every_figure_of_a_paragraph_is_in_the_results_it_cites(path, paragraph):
    data = [json.loads(f.read_text()) for f in cited(paragraph)]
    values = [v for d in data for v in leaves(d)]
    derived = [r for d in data for r in ratios(d)]
    stale = [f"{n} {u}" for n, u in figures_of(paragraph) if not held(n, u, values) and not held(n, u, derived)]
    assert not stale, f"{path.name}: {', '.join(stale)} not in {', '.join(f.name for f in cited(paragraph))}: " \
                      f"{' '.join(paragraph.split())[:300]}"


def test_a_stale_figure_is_found():
    # the check itself: a figure that is not in the file fails, the same figure as measured passes
    data = {"rows": [{"mode": "a", "median_ms": 10.0}, {"mode": "b", "median_ms": 15.2}]}
    values, derived = leaves(data), ratios(data)
    assert held("15.2", "ms", values) and held("1.52", "×", derived) and held("0.0152", "s", values)
    assert not held("15.3", "ms", values) and not held("1.60", "×", derived)


# ---- the figures rendered from their files ----------------------------------------------------------------------
def test_every_page_is_its_rendering():
    """What ``make render-docs`` writes is what is committed: no page holds a figure its results file does not."""
    for path in render_docs().pages(ROOT):
        text = path.read_text()
        assert render_docs().render(text, RESULTS, path.name) == text, (
            f"{path.relative_to(ROOT)} is not its rendering: run python scripts/render_docs.py")


def test_a_changed_result_changes_the_page(tmp_path):
    """A results file rerun (here a copy with one value changed) changes the figures rendered from it, and only
    those."""
    results = tmp_path / "results"
    results.mkdir()
    for path in RESULTS.glob("*.json"):
        (results / path.name).write_text(path.read_text())
    page = (ROOT / "docs" / "gpu.md").read_text()
    held = json.loads((results / "sim_gpu_heldout_h200_2026-11-28_second.json").read_text())
    row = next(r for r in held["chosen"] if (r["model"], r["batch"], r["dtype"]) == ("googlenet", 8, "fp32"))
    assert "measured <!--fig held2: ratio(one(d.chosen, model=\"googlenet\"" in " ".join(page.split())
    row["measured_ms"] = row["predicted_ms"] * 1.25
    (results / "sim_gpu_heldout_h200_2026-11-28_second.json").write_text(json.dumps(held))
    rendered = render_docs().render(page, results, "gpu.md")
    changed = [(a, b) for a, b in zip(page.splitlines(), rendered.splitlines(), strict=True) if a != b]
    assert len(changed) == 1 and "-->58%<!--/fig-->" in changed[0][0] and "-->25%<!--/fig-->" in changed[0][1], changed


def test_a_figure_is_written_as_prose_writes_it(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"rows": [{"mode": "a", "ms": 10.0, "ok": True},
                                                            {"mode": "b", "ms": 15.25, "ok": True}]}))
    render = render_docs().render

    def fig(expr: str) -> str:
        return render(f"x <!--fig run: {expr}-->?<!--/fig-->", tmp_path).removeprefix("x ").split("-->")[1]

    assert fig('one(d.rows, mode="b").ms | .1f') == "15.2<!--/fig"
    assert fig("span(col(d.rows, 'ms')) | .1f") == "10.0–15.2<!--/fig"
    assert fig("span(r.ms / 100 for r in d.rows) | .0%") == "10–15%<!--/fig"
    assert fig("span([10.0, 10.01]) | .1f") == "10.0<!--/fig"  # one figure where both ends read the same
    assert fig("span([-165.0, -99.0]) | .0f") == "-165 to -99<!--/fig"
    assert fig("f\"{most(d.rows, 'ms').mode} took longest\"") == "b took longest<!--/fig"


@pytest.mark.parametrize(("expr", "why"), [
    ("d.__class__", "underscore"),
    ("open('x')", "not a function"),
    ("sorted(d.rows, key=lambda r: r.ms)[0].ms", "Lambda is not allowed"),
    ("one(d.rows, mode='c').ms", "0 rows"),
    ("d.row", "did you mean 'rows'"),
])
def test_a_figure_that_cannot_be_rendered_names_its_place(expr, why, tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"rows": [{"mode": "a", "ms": 10.0}]}))
    with pytest.raises(render_docs().FigureError, match=rf"page.md:2: run: .*{re.escape(why)}"):
        render_docs().render(f"text\nand <!--fig run: {expr}-->1<!--/fig-->", tmp_path, "page.md")
    with pytest.raises(render_docs().FigureError, match="starts a line"):
        render_docs().render("text\n<!--fig run: 1-->1<!--/fig-->", tmp_path, "page.md")
