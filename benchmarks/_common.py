"""Helpers shared by the benchmark scripts: options, graph loading, a time-limited child run, tables, JSON.

Graphs come through :func:`opweave.cli.app.load_graph`, so a benchmark sees exactly what ``opweave simulate --model
--no-coarsen`` sees: a zoo model captured at the given batch size, one op per fx node (the graphs the results in
``results/`` were measured on), with the roofline latencies of a device preset.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from opweave import schedulers, zoo
from opweave.cli.app import load_graph
from opweave.errors import first_line
from opweave.ir import OpGraph

RESULTS_DIR = Path(__file__).resolve().parent / "results"
QUICK_MODELS = ("squeezenet",)

# Wide enough for a table with one column per scheduler when the output goes to a file or a pipe.
console = Console(width=None if sys.stdout.isatty() else 200)


def parser(description: str) -> argparse.ArgumentParser:
    """The options every benchmark script takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help=f"small run: {', '.join(QUICK_MODELS)}, few repetitions")
    p.add_argument("--models", help="comma list of zoo models, example names or graph JSON files (default: the zoo)")
    p.add_argument("--schedulers", help="comma list of schedulers (default: all)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="directory for the results (default %(default)s)")
    p.add_argument("--preset", default="h100", help="roofline device preset for zoo latencies (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--streams", type=int, default=8, help="stream cap per device given to every scheduler; "
                                                          "0 = no cap (default %(default)s)")
    p.add_argument("--timeout-s", type=float, default=60.0,
                   help="give up on one scheduler on one graph after this long (default %(default)s)")
    return p


def split_names(text: str | None, known: Sequence[str], what: str) -> list[str] | None:
    """``"a,b"`` -> ``["a", "b"]``, rejecting names outside ``known`` (None when ``text`` is None)."""
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(known)}")
    return names


def scheduler_names(args: argparse.Namespace) -> list[str]:
    return split_names(args.schedulers, schedulers.names(), "scheduler") or schedulers.names()


def model_names(args: argparse.Namespace) -> list[str]:
    """The graphs to run: ``--models`` as given (zoo names, example names or files), else the quick set or the zoo."""
    if args.models:
        return [n.strip() for n in args.models.split(",") if n.strip()]
    return list(QUICK_MODELS) if args.quick else zoo.names()


def load(name: str, args: argparse.Namespace) -> OpGraph:
    """A zoo model captured (one op per fx node) with roofline latencies, or a shipped example / graph JSON file."""
    if name in zoo.names():
        return load_graph(None, name, batch_size=args.batch_size, preset=args.preset, coarsen=False)
    return load_graph(name, None)


def stream_cap(args: argparse.Namespace) -> int | None:
    return args.streams or None


def devices_for(name: str, devices: int) -> int:
    return devices if name in schedulers.MULTI_DEVICE else 1


def progress() -> Progress:
    """A progress bar on stderr, so that stdout carries only the tables."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True)


def _child(conn, fn: Callable, args: tuple) -> None:
    try:
        conn.send(("ok", fn(*args)))
    except BaseException as exc:  # report everything, the parent decides
        conn.send(("error", first_line(exc)))
    finally:
        conn.close()


def run_limited(fn: Callable, args: tuple, timeout_s: float) -> tuple[str, object]:
    """``fn(*args)`` in a forked child: ``("ok", result)``, ``("error", message)`` or ``("timeout", None)``.

    Why a child: IOS's dynamic program is exponential in the graph's width, and a pure-Python function cannot be
    interrupted from outside; a forked child inherits the loaded graphs for free and can be killed.
    """
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(send, fn, args), daemon=True)
    child.start()
    send.close()
    try:
        if receive.poll(timeout_s):
            return receive.recv()
        return ("timeout", None)
    except EOFError:
        return ("error", f"child died with exit code {child.exitcode}")
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        receive.close()


def machine_info() -> dict:
    import torch

    import opweave
    from opweave.evaluate.bench import load_average

    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "torch": torch.__version__,
        "opweave": getattr(opweave, "__version__", None),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # other work on the machine inflates every timing; say how busy it was when the results were written
        "load_average_1_5_15m": load_average(),
    }


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], caption: str | None = None) -> Table:
    """A rich table whose first column is left-aligned and the others right-aligned (numbers)."""
    t = Table(title=title, caption=caption)
    for i, col in enumerate(columns):
        t.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        t.add_row(*row)
    return t


def write_json(path: Path, data: dict, quiet: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    if not quiet:
        console.print(f"wrote {path}")


def save_figure(fig, path: Path, dpi: int = 110) -> None:
    """Lay out, write and close a matplotlib figure, and say where it went."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    console.print(f"wrote {path}")


class Stopwatch:
    """Wall time of the whole script, for its JSON."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def elapsed_s(self) -> float:
        return round(time.perf_counter() - self.start, 2)
