"""The ``opweave`` command line: one Typer app (:mod:`.app`), its commands grouped by what they need.

* :mod:`.graphs` — ``schedule``, ``simulate``, ``synth``, ``models``: graphs only, any machine;
* :mod:`.runs` — ``bench``, ``profile``: real runs on a CPU or GPU;
* :mod:`.serve` — ``serve``, ``loadgen``, ``blocks``: multi-model serving (TOP).
* :mod:`.distributed` — ``run``, ``profile-links``: one model on several devices, one rank process per device;
* :mod:`.learn` — ``train-gpg``, ``train-policy``: TOP's learned scheduler and serving policy, trained in simulation.

Bad input exits with status 2 and one line on stderr (:func:`.app.guard`).
"""

from __future__ import annotations

import sys

from opweave.cli import distributed, graphs, learn, runs, serve  # noqa: F401 - registers the commands
from opweave.cli.app import app, graph_costs, run_one

__all__ = ["app", "graph_costs", "main", "run_one"]


def main() -> None:  # pragma: no cover - console entry
    sys.exit(app())
