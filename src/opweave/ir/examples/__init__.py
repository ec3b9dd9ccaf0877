"""Paper examples shipped as graph JSON, loadable by name (``opweave.examples.load("lios-fig3")``)."""

from __future__ import annotations

import json
from importlib import resources

from opweave.errors import UsageError
from opweave.ir.graph import OpGraph


def names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files(__name__).iterdir() if p.name.endswith(".json"))


def load(name: str) -> OpGraph:
    if name not in names():
        raise UsageError(f"no example graph {name!r}; examples: {', '.join(names())}")
    return OpGraph.from_dict(json.loads(resources.files(__name__).joinpath(f"{name}.json").read_text()))
