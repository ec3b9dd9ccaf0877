"""The operator-graph IR: ops, data edges, and the `opweave.graph/1` JSON format.

Pure data (no torch import): a scheduler, the simulator and the CLI can load and save graphs on any machine.

An :class:`OpGraph` keeps its ops in *capture order* (the order the framework would run them sequentially). Edges
are data dependencies (``kind="data"``) or write-after-read orderings added for in-place operators
(``kind="war"``: the reader ``src`` must finish before the in-place writer ``dst`` starts). Both kinds constrain
every schedule the same way.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import networkx as nx

from opweave.errors import GraphError

FORMAT = "opweave.graph/1"
CATEGORIES = ("compute", "memory")


@dataclass
class Op:
    id: str
    name: str | None = None
    target: str | None = None
    category: str = "compute"
    shape: list[int] | None = None
    dtype: str | None = None
    flops: float = 0.0
    bytes: float = 0.0
    latency_ms: float | None = None
    utilization: float | None = None
    resources: dict[str, float] | None = None
    kind: str | None = None  # what capture found it to be (opweave.ir.kinds); None: read from the target


@dataclass
class Edge:
    src: str
    dst: str
    bytes: float = 0.0
    transfer_ms: float | None = None
    kind: str = "data"


@dataclass
class OpGraph:
    ops: list[Op]
    edges: list[Edge] = field(default_factory=list)
    name: str = "graph"

    def __post_init__(self) -> None:
        self.validate()

    # ---- structure ----------------------------------------------------------------------------------------------
    @cached_property
    def op(self) -> dict[str, Op]:
        """Ops by id."""
        return {o.id: o for o in self.ops}

    @cached_property
    def index(self) -> dict[str, int]:
        """Capture-order position of every op."""
        return {o.id: i for i, o in enumerate(self.ops)}

    @property
    def ids(self) -> list[str]:
        return [o.id for o in self.ops]

    @cached_property
    def preds(self) -> dict[str, list[str]]:
        p: dict[str, list[str]] = {o.id: [] for o in self.ops}
        for e in self.edges:
            if e.src not in p[e.dst]:
                p[e.dst].append(e.src)
        return p

    @cached_property
    def succs(self) -> dict[str, list[str]]:
        s: dict[str, list[str]] = {o.id: [] for o in self.ops}
        for e in self.edges:
            if e.dst not in s[e.src]:
                s[e.src].append(e.dst)
        return s

    @cached_property
    def edge(self) -> dict[tuple[str, str], Edge]:
        """Edges by (src, dst); when a data and a WAR edge join the same pair, the data edge wins."""
        out: dict[tuple[str, str], Edge] = {}
        for e in self.edges:
            if (e.src, e.dst) not in out or e.kind == "data":
                out[(e.src, e.dst)] = e
        return out

    def __len__(self) -> int:
        return len(self.ops)

    def nx(self) -> nx.DiGraph:
        """A networkx view (a fresh copy) with ops as nodes in capture order."""
        g = nx.DiGraph()
        g.add_nodes_from(self.ids)
        g.add_edges_from(self.edge)
        return g

    @cached_property
    def topo_order(self) -> list[str]:
        """A topological order, breaking ties by capture order (so a topologically sorted capture is unchanged).

        Kahn's algorithm that always takes the ready op captured first: the lexicographically smallest topological
        order by capture position (what ``nx.lexicographical_topological_sort`` keyed on ``index`` returns).
        O(V + E) when the capture order is already topological (every edge goes forward), O((V + E) log V) else.
        """
        index = self.index
        if all(index[e.src] < index[e.dst] for e in self.edges):
            return self.ids
        indegree = {op: len(p) for op, p in self.preds.items()}
        ready = [index[op] for op, d in indegree.items() if d == 0]
        heapq.heapify(ready)
        order: list[str] = []
        while ready:
            op = self.ops[heapq.heappop(ready)].id
            order.append(op)
            for succ in self.succs[op]:
                indegree[succ] -= 1
                if not indegree[succ]:
                    heapq.heappush(ready, index[succ])
        return order

    @cached_property
    def descendants(self) -> dict[str, int]:
        """Reachability as bitsets: bit ``index[v]`` of ``descendants[u]`` is set iff v is reachable from u."""
        index, succs = self.index, self.succs
        reach: dict[str, int] = {}
        for u in reversed(self.topo_order):
            bits = 0
            for v in succs[u]:
                bits |= reach[v] | 1 << index[v]
            reach[u] = bits
        return reach

    def reaches(self, u: str, v: str) -> bool:
        """True iff there is a path u → … → v (u ≠ v)."""
        return bool(self.descendants[u] >> self.index[v] & 1)

    def independent(self, u: str, v: str) -> bool:
        return u != v and not self.reaches(u, v) and not self.reaches(v, u)

    # ---- latencies ----------------------------------------------------------------------------------------------
    def latencies(self) -> dict[str, float]:
        """Each op's ``latency_ms`` (0 where unknown)."""
        return {o.id: o.latency_ms or 0.0 for o in self.ops}

    def total_work_ms(self, latency: dict[str, float] | None = None) -> float:
        lat = latency or self.latencies()
        return sum(lat[i] for i in self.ids)

    def critical_path_ms(self, latency: dict[str, float] | None = None) -> float:
        """Length of the longest path, counting op latencies (no transfer times)."""
        lat = latency or self.latencies()
        finish: dict[str, float] = {}
        for u in self.topo_order:
            finish[u] = max((finish[p] for p in self.preds[u]), default=0.0) + lat[u]
        return max(finish.values(), default=0.0)

    # ---- validation ---------------------------------------------------------------------------------------------
    def validate(self) -> None:
        seen: set[str] = set()
        for o in self.ops:
            if not isinstance(o.id, str) or not o.id:
                raise GraphError(f"op id {o.id!r} must be a non-empty string")
            if o.id in seen:
                raise GraphError(f"duplicate op id {o.id!r}")
            seen.add(o.id)
            if o.category not in CATEGORIES:
                raise GraphError(f"op {o.id!r}: category {o.category!r} is not one of {', '.join(CATEGORIES)}")
            for key in ("flops", "bytes", "latency_ms", "utilization"):
                _check_number(getattr(o, key), f"op {o.id!r}: {key}")
            if o.utilization is not None and o.utilization > 1:
                raise GraphError(f"op {o.id!r}: utilization {o.utilization} is above 1")
            for key, value in (o.resources or {}).items():
                _check_number(value, f"op {o.id!r}: resources.{key}")
        for e in self.edges:
            for end in (e.src, e.dst):
                if end not in seen:
                    raise GraphError(f"edge {e.src!r} -> {e.dst!r}: unknown op {end!r}")
            if e.src == e.dst:
                raise GraphError(f"edge {e.src!r} -> {e.dst!r}: self-loop on op {e.src!r}")
            _check_number(e.bytes, f"edge {e.src!r} -> {e.dst!r}: bytes")
            _check_number(e.transfer_ms, f"edge {e.src!r} -> {e.dst!r}: transfer_ms")
        try:
            cycle = nx.find_cycle(self.nx())
        except nx.NetworkXNoCycle:
            return
        path = " -> ".join([u for u, _ in cycle] + [cycle[0][0]])
        raise GraphError(f"cycle through op {cycle[0][0]!r}: {path}")

    # ---- JSON ---------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        def compact(item: Op | Edge) -> dict[str, Any]:  # drop fields at their defaults
            defaults = {f.name: f.default for f in dataclasses.fields(item)}
            return {k: v for k, v in asdict(item).items() if k in ("id", "src", "dst") or v != defaults[k]}

        return {"format": FORMAT, "name": self.name, "ops": [compact(o) for o in self.ops],
                "edges": [compact(e) for e in self.edges]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OpGraph:
        if not isinstance(data, dict):
            raise GraphError("graph JSON must be an object")
        fmt = data.get("format", FORMAT)
        if fmt != FORMAT:
            raise GraphError(f"unknown format {fmt!r} (this opweave reads {FORMAT!r})")
        ops = [_build(Op, raw, "op") for raw in data.get("ops", [])]
        edges = [_build(Edge, raw, "edge") for raw in data.get("edges", [])]
        return cls(ops, edges, str(data.get("name", "graph")))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> OpGraph:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise GraphError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        return cls.from_dict(data)


def _check_number(value: object, what: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GraphError(f"{what} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise GraphError(f"{what} must be finite and non-negative, got {value!r}")


def _build(kind: type, raw: object, what: str) -> Any:
    if not isinstance(raw, dict):
        raise GraphError(f"{what} entry {raw!r} must be an object")
    known = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(raw) - set(known))
    label = raw.get("id") or f"{raw.get('src')!r} -> {raw.get('dst')!r}"
    if unknown:
        raise GraphError(f"{what} {label}: unknown field(s) {', '.join(unknown)}")
    try:
        return kind(**raw)
    except TypeError as exc:
        raise GraphError(f"{what} {label}: {exc}") from None


def chain(latencies_ms: Iterable[float], name: str = "chain") -> OpGraph:
    """A linear graph v0 → v1 → …, handy in tests and examples."""
    ops = [Op(f"v{i}", latency_ms=lat) for i, lat in enumerate(latencies_ms)]
    return OpGraph(ops, [Edge(a.id, b.id) for a, b in zip(ops, ops[1:], strict=False)], name)
