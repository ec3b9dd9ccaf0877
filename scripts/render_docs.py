"""Render the figures of README.md and docs/*.md from the results files they come from.

A figure taken from a results file is written between two HTML comments (invisible once the Markdown is rendered)
that name the file and the value::

    `batch` sustains <!--fig gauge: one(d.results, policy="batch").sustainable_rps | .1f-->88.0<!--/fig--> req/s

``gauge`` is a short name the page gives a results file once (``<!--fig-alias gauge =
serving_cpu_squeezenet_gauge-->``; several files, ``a, b``, read as the list of their data), or a file of
``benchmarks/results/`` itself (a stem, or a name with its extension), read as ``d``; the expression after the colon
computes the value from it; the Python format spec after `` | `` (optional) writes it. A pair of numbers
(``span(...)``, ``(a, b)``) is written as a range, ``1.21–1.91``, each end in the format (one number where both ends
read the same); a string is written as it is. A figure of several lines (a table), or one whose comments stand on
lines of their own (a paragraph), is written as a block
between them. What the expression may use is small on purpose: the data (a record's fields as attributes,
``d.rows``), arithmetic, comparisons, comprehensions and f-strings, the functions of :data:`FUNCTIONS` (``one``,
``where``, ``col``, ``span``, ``load``, ``table``, ..., and the benchmarks' own table renderers), a few methods
(:data:`METHODS`), and no name that starts with an underscore.

    python scripts/render_docs.py           # rewrite every page from the results files (make render-docs)
    python scripts/render_docs.py --check   # exit 1, naming the pages, where a page is not its rendering

A test holds every committed page equal to its rendering, so a results file rerun is followed by one command.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import importlib.util
import json
import re
import statistics
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGES = ("README.md", "docs/*.md")
MARKER = re.compile(r"<!--fig (?P<source>[\w.\-]+): (?P<expr>(?:(?!-->|<!--).)+?)(?:\s\|\s*(?P<spec>[^|>]*?))?-->"
                    r"(?P<old>(?:(?!<!--fig).)*?)<!--/fig-->", re.S)


ALIAS = re.compile(r"<!--fig-alias (?P<name>\w+) = (?P<source>[\w.\-]+(?:, [\w.\-]+)*)-->")


class FigureError(ValueError):
    """A marker whose value cannot be rendered: the page, the line and why."""


class Record(dict):
    """A JSON object whose fields read as attributes too (``row.median_ms``); a field it lacks is an error naming
    the fields it has."""

    def __getattr__(self, name: str) -> Any:
        if name in self:
            return self[name]
        close = difflib.get_close_matches(name, list(self), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise FigureError(f"no field {name!r}{hint}; fields: {', '.join(self)}")


def records(data: Any) -> Any:
    """``data`` (parsed JSON) with every object a :class:`Record`."""
    if isinstance(data, dict):
        return Record({k: records(v) for k, v in data.items()})
    if isinstance(data, list):
        return [records(v) for v in data]
    return data


def reader(results: Path, aliases: dict[str, str] | None = None) -> Callable[[str], Any]:
    """``load(name)``: the results file ``name`` (a stem, a name with its extension, or one of the page's
    ``aliases``) of ``results``, each read once."""

    @functools.cache
    def load(name: str) -> Any:
        name = (aliases or {}).get(name, name)
        if ", " in name:  # an alias of several files: their data, in its order
            return [load(one) for one in name.split(", ")]
        path = results / (name if name.endswith(".json") else f"{name}.json")
        if not path.exists():
            raise FigureError(f"no results file {path.name!r} in {results}")
        return records(json.loads(path.read_text()))

    return load


def matches(row: Any, where: dict[str, Any]) -> bool:
    return isinstance(row, dict) and all(row.get(k) == v for k, v in where.items())


def one(rows: Iterable[Any], **where: Any) -> Any:
    """The one row of ``rows`` whose fields equal ``where``; none or several is an error."""
    found = [r for r in rows if matches(r, where)]
    if len(found) != 1:
        raise FigureError(f"{len(found)} rows with {where}, not one")
    return found[0]


def first(rows: Iterable[Any], **where: Any) -> Any:
    """The first row of ``rows`` whose fields equal ``where`` (one at least): the earliest run's, where several
    measured it."""
    for r in rows:
        if matches(r, where):
            return r
    raise FigureError(f"no row with {where}")


def where(rows: Iterable[Any], **fields: Any) -> list[Any]:
    """The rows of ``rows`` whose fields equal ``fields`` (one at least)."""
    found = [r for r in rows if matches(r, fields)]
    if not found:
        raise FigureError(f"no row with {fields}")
    return found


def col(rows: Iterable[Any], key: str) -> list[Any]:
    """The ``key`` of every row that has one."""
    return [r[key] for r in rows if isinstance(r, dict) and r.get(key) is not None]


def most(rows: Iterable[Any], key: str) -> Any:
    """The row of ``rows`` with the largest ``key``."""
    found = [r for r in rows if isinstance(r, dict) and r.get(key) is not None]
    if not found:
        raise FigureError(f"no row with {key!r}")
    return max(found, key=lambda r: r[key])


def least(rows: Iterable[Any], key: str) -> Any:
    """The row of ``rows`` with the smallest ``key``."""
    found = [r for r in rows if isinstance(r, dict) and r.get(key) is not None]
    if not found:
        raise FigureError(f"no row with {key!r}")
    return min(found, key=lambda r: r[key])


def words(values: Iterable[Any]) -> str:
    """``values`` joined by spaces: a command's flags as typed."""
    return " ".join(str(v) for v in values)


def unique(values: Iterable[Any]) -> list[Any]:
    """``values`` without repeats, in their order."""
    return list(dict.fromkeys(values))


def ratio(row: Any, over: str, under: str) -> float:
    """``row[over] / row[under]``."""
    return row[over] / row[under]


def span(values: Iterable[float]) -> tuple[float, float]:
    """``(min, max)`` of ``values``: written as a range."""
    values = list(values)
    if not values:
        raise FigureError("a range of no values")
    return min(values), max(values)


def best(rows: Iterable[Any], key: str, by: tuple[str, ...] = ("run", "model", "batch_size", "dtype")) -> list[Any]:
    """Per group of ``rows`` that agree on ``by`` (a GPU run's configuration), the row with the largest ``key``."""
    groups: dict[tuple, list[Any]] = {}
    for r in rows:
        if isinstance(r, dict) and r.get(key) is not None:
            groups.setdefault(tuple(r.get(k) for k in by), []).append(r)
    return [max(group, key=lambda r: r[key]) for group in groups.values()]


def gpu_rows(datas: Iterable[Any], modes: Iterable[str] | None = None) -> list[Any]:
    """Every measured opweave row of the GPU runs ``datas`` (``benchmarks/gpu_latency.py``'s results; ``modes``:
    those modes alone), each with ``run`` (its run's place in ``datas``) and what its configuration's peers of the
    same run give: ``vs_graph`` and ``vs_compile`` (the CUDA Graph's and torch.compile's median over its own),
    ``memory_vs_graph`` (its peak memory over the CUDA Graph's), ``compile_ms`` and ``compile_kernels``
    (torch.compile's median and kernels per call), ``timed`` (a max-autotune search's median per candidate) and
    ``search_compile_ms`` (torch.compile as the search timed it)."""
    wanted = None if modes is None else set(modes)
    out = []
    for run, data in enumerate(datas):
        measured = [r for r in data["results"] if r.get("median_ms") is not None]
        for r in measured:
            if not r["mode"].startswith("opweave") or wanted is not None and r["mode"] not in wanted:
                continue
            peers = {p["mode"]: p for p in measured
                     if (p["model"], p["batch_size"], p["dtype"]) == (r["model"], r["batch_size"], r["dtype"])}
            graph, compiled = peers.get("cuda-graph"), peers.get("torch.compile")
            timed = {**(r.get("candidates_ms") or {}), **{label: c["median_ms"] for label, c in
                                                        (r.get("candidates") or {}).items() if c.get("median_ms")}}
            out.append(Record({**r, "run": run, "vs_graph": graph and graph["median_ms"] / r["median_ms"],
                               "vs_compile": compiled and compiled["median_ms"] / r["median_ms"],
                               "memory_vs_graph": graph and r["peak_memory_mb"] / graph["peak_memory_mb"],
                               "compile_ms": compiled and compiled["median_ms"],
                               "compile_kernels": compiled and compiled.get("kernels_per_call"),
                               "timed": Record(timed), "search_compile_ms": timed.get("torch.compile")}))
    return out


def table(columns: list[str], rows: Iterable[Iterable[Any]], right: int = 0) -> str:
    """A Markdown table of ``rows`` (each cell written as it is) under ``columns``, the last ``right`` of them
    aligned right."""
    rule = ["---"] * (len(columns) - right) + ["---:"] * right
    lines = [columns, rule, *([str(cell) for cell in row] for row in rows)]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


@functools.cache
def benchmark(name: str) -> Any:
    """``benchmarks/NAME.py``, whose table renderers a page shows."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))  # for its ``import _common``
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpu_tables(data: Any) -> str:
    """The README's CPU tables of one ``cpu_latency.py`` run (``cpu_latency.markdown``)."""
    return benchmark("cpu_latency").markdown(data["rows"], data["summary"], data["settings"]["modes"]).rstrip()


def cpu_verdict(data: Any) -> str:
    """The README's table of the default and max-autotune against ``torch.compile`` (``cpu_latency.verdict``)."""
    return benchmark("cpu_latency").verdict(data["summary"], data["rows"]).rstrip()


def cpu_tuned(data: Any) -> str:
    """The README's table of the default against the peers CPU users tune (``cpu_latency.tuned_verdict``)."""
    return benchmark("cpu_latency").tuned_verdict(data["summary"]).rstrip()


def cpu_advice(data: Any) -> str:
    """What the README says of the CPU default against ``torch.compile`` (``cpu_latency.advice``)."""
    return benchmark("cpu_latency").advice(data).rstrip()


def cpu_command(data: Any, stem: str) -> str:
    """The command a ``cpu_latency.py`` run was measured by (``cpu_latency.command_line``)."""
    return benchmark("cpu_latency").command_line(data, stem)


def gpu_chosen(*datas: Any) -> str:
    """What opweave chose on the GPU over several runs, one table (``gpu_latency.chosen_markdown``)."""
    return benchmark("gpu_latency").chosen_markdown(list(datas)).rstrip()


def gpu_summary(data: Any) -> str:
    """The best plan per configuration of one GPU run (``gpu_latency.summary_markdown``)."""
    return benchmark("gpu_latency").summary_markdown(data).rstrip()


def predict_table(data: Any) -> str:
    """The simulator's predictions for the GPU configurations not yet measured (``sim_gpu_predict.markdown``)."""
    return benchmark("sim_gpu_predict").markdown(data).rstrip()


def gpu_tables(data: Any) -> str:
    """Every mode of every configuration of one GPU run (``gpu_latency.markdown``)."""
    return benchmark("gpu_latency").markdown(data).rstrip()


FUNCTIONS: dict[str, Any] = {
    "one": one, "first": first, "where": where, "col": col, "span": span, "most": most, "least": least, "ratio": ratio,
    "min": min, "max": max, "sum": sum, "len": len, "abs": abs, "round": round, "sorted": sorted, "any": any,
    "all": all, "median": statistics.median, "mean": statistics.mean, "table": table, "unique": unique, "best": best,
    "words": words, "gpu_rows": gpu_rows,
    "cpu_tables": cpu_tables, "cpu_verdict": cpu_verdict, "cpu_tuned": cpu_tuned, "cpu_advice": cpu_advice,
    "cpu_command": cpu_command,
    "gpu_chosen": gpu_chosen, "gpu_summary": gpu_summary, "gpu_tables": gpu_tables,
    "predict_table": predict_table,
}
# what a value's methods a figure may call
METHODS = frozenset({"items", "values", "keys", "get", "index", "count", "join", "startswith", "endswith", "replace",
                     "split", "removeprefix", "removesuffix"})
NODES = (ast.Expression, ast.Constant, ast.Name, ast.Load, ast.Store, ast.Attribute, ast.Subscript, ast.Slice,
         ast.Call, ast.keyword, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.IfExp, ast.operator,
         ast.unaryop, ast.boolop, ast.cmpop, ast.ListComp, ast.GeneratorExp, ast.SetComp, ast.DictComp,
         ast.comprehension, ast.Tuple, ast.List, ast.Dict, ast.Set, ast.Starred, ast.JoinedStr, ast.FormattedValue)


def compiled(expr: str) -> Any:
    """``expr`` compiled, once every node is one a figure may use (:data:`NODES`; no name or attribute with an
    underscore first; a call only of :data:`FUNCTIONS` or of :data:`METHODS`)."""
    if "--" in expr:
        raise FigureError("'--' in a figure would end its HTML comment in some Markdown renderers")
    try:
        tree = ast.parse(expr.replace("\n", " ").strip(), mode="eval")  # a marker wraps as prose does
    except SyntaxError as exc:
        raise FigureError(f"not an expression: {exc.msg}") from None
    for node in ast.walk(tree):
        if not isinstance(node, NODES):
            raise FigureError(f"{type(node).__name__} is not allowed in a figure")
        name = getattr(node, "id", None) or getattr(node, "attr", None)
        if name is not None and name.startswith("_"):
            raise FigureError(f"{name!r}: no name with an underscore first")
        if isinstance(node, ast.Call) and not (
                isinstance(node.func, ast.Name) and (node.func.id in FUNCTIONS or node.func.id == "load")
                or isinstance(node.func, ast.Attribute) and node.func.attr in METHODS):
            raise FigureError(f"{ast.unparse(node.func)}() is not a function a figure may call")
    return compile(tree, "<figure>", "eval")


def written(value: Any, spec: str) -> str:
    """``value`` as the page writes it: a number in ``spec``, a pair as a range (``1.2–1.8``, ``-165 to -99``), a
    string as it is."""
    if isinstance(value, str):
        return value
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        low, high = (format(v, spec) for v in value)
        if low == high:
            return low
        if low.startswith("-") or high.startswith("-"):  # -165 to -99, not -165–-99
            return f"{low} to {high}"
        return f"{low.removesuffix('%') if spec.endswith('%') else low}–{high}"  # 37–58%, as prose writes it
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, spec)
    raise FigureError(f"a figure must be a number, a pair of numbers or a string, not {type(value).__name__}")


def value_of(source: str, expr: str, spec: str, load: Callable[[str], Any]) -> str:
    """The text of one marker's figure, from the results files ``load`` reads."""
    scope = {**FUNCTIONS, "load": load, "d": load(source)}
    try:
        value = eval(compiled(expr), {"__builtins__": {}, **scope})  # noqa: S307 - compiled() allows a small grammar
    except FigureError:
        raise
    except Exception as exc:  # a key, an index, a division by zero: said with the marker's place
        raise FigureError(f"{type(exc).__name__}: {exc}") from None
    return written(value, spec.strip())


def render(text: str, results: Path = RESULTS, page: str = "page") -> str:
    """``text`` with every marker's figure written from ``results``. A marker of one figure may not start a line:
    Markdown would end the paragraph there (an HTML comment opens a block)."""
    load = reader(results, {m["name"]: m["source"] for m in ALIAS.finditer(text)})

    def one_marker(match: re.Match) -> str:
        line = text.count("\n", 0, match.start()) + 1
        try:
            figure = value_of(match["source"], match["expr"], match["spec"] or "", load)
            block = "\n" in figure or match["old"].startswith("\n")  # a table, or a paragraph laid out as a block
            before = text[text.rfind("\n", 0, match.start()) + 1:match.start()]
            if block:
                figure = f"\n\n{figure}\n\n"
            elif re.fullmatch(r"\s*(?:[-*+]\s+|\d+\.\s+)?", before):
                raise FigureError("a figure's marker starts a line, which ends the paragraph in Markdown")
        except FigureError as exc:
            raise FigureError(f"{page}:{line}: {match['source']}: {match['expr'].strip()}: {exc}") from None
        head = match.group(0)[:match.start("old") - match.start()]
        return f"{head}{figure}<!--/fig-->"

    stripped = MARKER.sub("", ALIAS.sub("", text))
    unclosed = re.search(r"<!--fig(?!-alias )", stripped)
    if unclosed is not None:
        raise FigureError(f"{page}: a marker not closed by <!--/fig--> or not of the forms above, near "
                          f"{stripped[unclosed.start():unclosed.start() + 60]!r}")
    return MARKER.sub(one_marker, text)


def plain(text: str) -> str:
    """``text`` as a reader sees it: every marker's comments gone, its figure left."""
    return ALIAS.sub("", MARKER.sub(lambda m: m["old"].strip("\n") if m["old"].startswith("\n") else m["old"], text))


def pages(root: Path = ROOT) -> list[Path]:
    return sorted({p for pattern in PAGES for p in root.glob(pattern)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 where a page is not its rendering")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the results files (default: %(default)s)")
    args = parser.parse_args(argv)
    stale = []
    for path in pages():
        text = path.read_text()
        try:
            new = render(text, args.results, str(path.relative_to(ROOT)))
        except FigureError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if new != text:
            stale.append(str(path.relative_to(ROOT)))
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print(f"not their rendering (python scripts/render_docs.py rewrites them): {', '.join(stale)}",
              file=sys.stderr)
        return 1
    print(f"{'would rewrite' if args.check else 'rewrote'} {len(stale)} of {len(pages())} pages"
          + (f": {', '.join(stale)}" if stale else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
