"""IOS: dynamic programming over "endings" (Ding et al., "IOS: Inter-Operator Scheduler for CNN Acceleration",
MLSys 2021 [1]; the HIOS paper §V-B and the TOP paper §V-C, Fig. 5, describe it too).

**Recurrence.** For a set S of not-yet-scheduled ops (always closed under predecessors), IOS picks the *last* stage:

    cost[∅] = 0,   cost[S] = min over endings E of S of  cost[S − E] + stage_latency(E)

An *ending* E ⊆ S is non-empty and closed under successors within S (no edge leaves E towards S − E), so S − E can
run first. The ops of E are split into *groups* = the weakly connected components of the subgraph E induces; each
group runs in topological order on its own stream and the groups run concurrently (IOS's "concurrent execution"
strategy; "operator merge" needs kernel fusion and is not modelled). ``costs.stage_latency_ms(groups)`` prices a
stage (ideal model: the longest group).

**Search space (pruning r, s).** An ending is admitted iff every group has at most ``max_group_ops`` (IOS's r,
default 3) ops and there are at most ``max_groups`` (IOS's s, default 8; capped by ``streams``) groups. Endings are
enumerated *exactly*: a group of E is a connected successor-closed set ("piece"); pieces are built as connected
unions of the closures desc_S(u) ∪ {u} of ops whose closure has ≤ r ops, and an ending is any set of ≤ s pairwise
disjoint pieces (disjoint closed sets have no edge between them, so they are its components). This departs from the
IOS code, which takes one suffix per chain of a chain decomposition and requires the chosen ops' descendant sets to
be disjoint, so it misses endings whose closures overlap (mit-han-lab/inter-operator-scheduler issue #10, "Is this
a legal ending of graph G?"); here overlapping closures simply merge into one group.

**Blocks.** The DP is exponential in the graph's width, so (like IOS, which schedules a network block by block) the
graph is first cut at *cut ops* — ops that every source→sink path passes through (the dominators of a virtual sink,
from a virtual source, via networkx). Every op is comparable with every cut op, so no stage can usefully span a cut
(a stage holding a cut op has a single group, whose latency is the sum of its ops): cutting there loses nothing.
A segment between two cuts that is still large is split greedily, in topological order, into chunks of at most
``max_block_ops`` ops and at most ``max_states`` DP states (down-sets of the chunk, counted as the chunk grows);
this chunking *is* a heuristic (stages cannot span two chunks). Chunks are scheduled one after the other.

**Complexity.** Per chunk, states ≤ ``max_states`` (the chunk's down-sets) and the endings of a state are sets of
≤ s disjoint pieces among the state's pieces (each ≤ r ops), so the work is O(states · Σ_{j≤s} C(pieces, j)),
exponential in the chunk's width; the chunk bounds keep it small. Cut ops cost O(V + E) (dominators) and chunking
O(V · max_states). ``benchmarks/hios_sim.py`` records the scheduling time on 50/120/400-op random DAGs (HIOS
shape, 14 layers; ``ios_timing`` in ``benchmarks/results/hios_sim.json``).

Output: ``stage_of`` = global stage index, ``stream_of`` = group index inside the stage, device 0 everywhere,
``predicted_ms`` = sum of stage latencies (which the ideal replay of the plan reproduces: every op of a stage has
its inputs from earlier stages, so each group starts at the stage barrier).

References
----------
.. [1] Y. Ding, L. Zhu, Z. Jia, G. Pekhimenko and S. Han, "IOS: Inter-Operator Scheduler for CNN Acceleration",
   *Proceedings of Machine Learning and Systems (MLSys)*, vol. 3, pp. 167-180, 2021.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import networkx as nx

from opweave.costs.model import Costs
from opweave.errors import UsageError
from opweave.ir.graph import OpGraph
from opweave.schedulers.schedule import Schedule

DEFAULT_MAX_GROUP_OPS = 3  # IOS's r
DEFAULT_MAX_GROUPS = 8  # IOS's s
DEFAULT_MAX_BLOCK_OPS = 20
DEFAULT_MAX_STATES = 512  # ≥ 2^9: graphs of ≤ 9 ops are never chunked, so the DP is exact on them


def cut_ops(graph: OpGraph) -> list[str]:
    """Ops that every path from a source to a sink passes through, in topological order.

    They are the dominators of a virtual sink in the graph with a virtual source before every source (and a sink
    after every sink). Example: in a → {b, c} → d, the cut ops are a and d. Complexity O((V + E) α) (networkx).
    """
    source, sink = -1, -2  # op ids are strings, so these cannot clash
    g = graph.nx()
    g.add_edges_from((source, op) for op in graph.ids if not graph.preds[op])
    g.add_edges_from((op, sink) for op in graph.ids if not graph.succs[op])
    if not len(graph):
        return []
    idom = nx.immediate_dominators(g, source)
    cuts, node = [], idom[sink]
    while node != source:
        cuts.append(node)
        node = idom[node]
    return cuts[::-1]


def blocks(graph: OpGraph, max_block_ops: int = DEFAULT_MAX_BLOCK_OPS,
           max_states: int = DEFAULT_MAX_STATES) -> list[list[str]]:
    """The graph's ops split into consecutive blocks of a topological order, each scheduled by its own DP.

    Cut ops (:func:`cut_ops`) are blocks of their own; a segment between cuts is chunked so that no chunk has more
    than ``max_block_ops`` ops or more than ``max_states`` down-sets (DP states). Each block is a list of op ids in
    topological order.
    """
    cuts = set(cut_ops(graph))
    segments: list[list[str]] = [[]]
    for op in graph.topo_order:
        if op in cuts:
            segments += [[op], []]
        else:
            segments[-1].append(op)
    out: list[list[str]] = []
    for segment in segments:
        out += _chunks(graph, segment, max_block_ops, max_states) if segment else []
    return out


def _chunks(graph: OpGraph, segment: list[str], max_block_ops: int, max_states: int) -> list[list[str]]:
    """Greedy topological chunks of a segment, counting the chunk's down-sets as ops are added."""
    chunks: list[list[str]] = []
    chunk: list[str] = []
    pos: dict[str, int] = {}
    downsets: list[int] = [0]
    for op in segment:
        preds = sum(1 << pos[p] for p in graph.preds[op] if p in pos)
        grown = [d | 1 << len(chunk) for d in downsets if d & preds == preds]
        if chunk and (len(chunk) >= max_block_ops or len(downsets) + len(grown) > max_states):
            chunks.append(chunk)
            chunk, pos, downsets = [], {}, [0]
            grown = [1]
        pos[op] = len(chunk)
        chunk.append(op)
        downsets += grown
    return chunks + [chunk]


def _bits(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def endings(state: int, desc: list[int], max_group_ops: int, max_groups: int) -> list[tuple[int, tuple[int, ...]]]:
    """Every admissible ending of ``state`` (a bitset, closed under predecessors), as (ending, groups) bitsets.

    ``desc[i]`` is the bitset of i's descendants. Every successor-closed non-empty subset whose components have
    ≤ ``max_group_ops`` ops, ≤ ``max_groups`` of them, is listed exactly once, with its components as groups.
    """
    closures = {(desc[i] & state) | 1 << i for i in _bits(state)}
    small = [c for c in closures if c.bit_count() <= max_group_ops]
    pieces = set(small)
    frontier = list(small)
    while frontier:  # connected unions of closures; two closed sets are connected iff they intersect
        piece = frontier.pop()
        for c in small:
            if c & piece and c & ~piece:
                bigger = piece | c
                if bigger not in pieces and bigger.bit_count() <= max_group_ops:
                    pieces.add(bigger)
                    frontier.append(bigger)
    ordered = sorted(pieces)
    found: list[tuple[int, tuple[int, ...]]] = []
    stack: list[tuple[int, int, tuple[int, ...]]] = [(0, 0, ())]
    while stack:  # sets of pairwise disjoint pieces, each set once (pieces taken in increasing index)
        start, used, chosen = stack.pop()
        for k in range(start, len(ordered)):
            piece = ordered[k]
            if not piece & used:
                groups = chosen + (piece,)
                found.append((used | piece, groups))
                if len(groups) < max_groups:
                    stack.append((k + 1, used | piece, groups))
    return found


def block_descendants(graph: OpGraph, block: list[str]) -> list[int]:
    """``desc[i]``: the bitset (positions in ``block``) of the descendants of ``block[i]`` inside the block."""
    pos = {op: i for i, op in enumerate(block)}
    desc = [0] * len(block)
    for i in reversed(range(len(block))):  # block is topologically ordered and convex, so paths stay inside it
        for succ in graph.succs[block[i]]:
            if succ in pos:
                desc[i] |= desc[pos[succ]] | 1 << pos[succ]
    return desc


def block_stages(graph: OpGraph, costs: Costs, block: list[str], max_group_ops: int = DEFAULT_MAX_GROUP_OPS,
                 max_groups: int = DEFAULT_MAX_GROUPS) -> tuple[float, list[list[list[str]]]]:
    """Optimal stages of one block under the recurrence above: (total latency in ms, stages as lists of groups)."""
    desc = block_descendants(graph, block)
    stage_ms: dict[int, float] = {}
    best: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}

    def solve(state: int) -> float:
        if state not in best:
            choice: tuple[float, tuple[int, ...]] = (math.inf, ())
            for ending, groups in endings(state, desc, max_group_ops, max_groups):
                latency_ms = stage_ms.get(ending)  # an ending determines its groups
                if latency_ms is None:
                    op_groups = [[block[i] for i in _bits(g)] for g in groups]
                    latency_ms = stage_ms[ending] = costs.stage_latency_ms(op_groups)
                total = solve(state ^ ending) + latency_ms
                if total < choice[0]:
                    choice = (total, groups)
            best[state] = choice
        return best[state][0]

    full = (1 << len(block)) - 1
    total_ms = solve(full)
    stages: list[list[list[str]]] = []
    state = full
    while state:
        groups = best[state][1]
        stages.append([[block[i] for i in _bits(g)] for g in groups])
        state &= ~sum(groups)
    return total_ms, stages[::-1]


def schedule(graph: OpGraph, costs: Costs, *, streams: int | None = None, devices: int = 1,
             max_group_ops: int = DEFAULT_MAX_GROUP_OPS, max_groups: int = DEFAULT_MAX_GROUPS,
             max_block_ops: int = DEFAULT_MAX_BLOCK_OPS, max_states: int = DEFAULT_MAX_STATES) -> Schedule:
    """IOS on one device (``devices`` > 1 is ignored). ``streams`` caps the groups per stage."""
    if max_group_ops < 1 or max_groups < 1 or max_block_ops < 1 or max_states < 2:
        raise UsageError("IOS needs max_group_ops, max_groups, max_block_ops >= 1 and max_states >= 2")
    group_cap = max_groups if streams is None else min(max_groups, streams)
    options = {"max_group_ops": max_group_ops, "max_groups": group_cap, "max_block_ops": max_block_ops,
               "max_states": max_states}
    return staged("ios", blocks(graph, max_block_ops, max_states),
                  lambda block: block_stages(graph, costs, block, max_group_ops, group_cap), options)


def staged(name: str, chunks: list[list[str]], solve: Callable[[list[str]], Any] | None,
           options: dict[str, Any]) -> Schedule:
    """The stage schedule of ``chunks`` solved one after the other: ``solve(chunk)`` gives (latency in ms, stages as
    lists of groups); stages are numbered globally, a group's index inside its stage is its stream, device 0."""
    order: list[str] = []
    stream_of: dict[str, int] = {}
    stage_of: dict[str, int] = {}
    total_ms = 0.0
    stage = 0
    for block in chunks:
        assert solve is not None  # chunks to solve come with the solver
        block_ms, stages = solve(block)
        total_ms += block_ms
        for groups in stages:
            for stream, group in enumerate(groups):
                for op in group:
                    order.append(op)
                    stream_of[op] = stream
                    stage_of[op] = stage
            stage += 1
    return Schedule(name, order, stream_of, {op: 0 for op in order}, stage_of=stage_of, predicted_ms=total_ms,
                    options=options)
