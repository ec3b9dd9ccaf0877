"""Nimble stream assignment (Kwon et al., NeurIPS 2020 [1]; §4.2 Algorithm 1, Theorems 1–4).

Algorithm 1:

1. G' = (V, E'), the minimum equivalent graph of the DAG (for a DAG, its unique transitive reduction).
2. A bipartite graph B with a left copy x_i and a right copy y_j of every op and an edge (x_i, y_j) per (v_i, v_j) ∈ E'.
3. A maximum matching M of B (Hopcroft–Karp).
4./5. Each matched (x_i, y_j) puts v_j right after v_i on v_i's stream, so every stream is a chain of E' edges.

This gives *maximum logical concurrency* (two independent ops never share a stream; Theorem 2) with the fewest
synchronizations among such assignments: |V| − |M| streams and |E'| − |M| cross-stream edges of E' (Theorems 3, 4).
An unmatched E' edge never joins two ops of one chain (it would be implied by the chain, so not in a reduction).

Departures from the paper:

* Stream cap (``max_streams`` option, or the generic ``streams``; the smaller wins). Nimble uses as many streams as
  it needs. With a cap below |V| − |M| the chains are folded longest-processing-time first: heaviest chain (total
  latency) first, each whole onto the least-loaded stream (:func:`merge_streams`); a merged stream issues its ops
  in launch order. (Merging the two lightest chains repeatedly, Huffman-style, gave longer ideal-model makespans
  in 10 of 12 trials: ``synth.random_dag(300, 20)``, seeds 0–3, caps 2/4/8.) Capped assignments lose maximum
  logical concurrency, and the sync count can differ from |E'| − |M| (edges between merged chains stop crossing).
* Launch order: the graph's topological order with capture-order ties (Nimble issues ops in the order its pre-run
  of the TorchScript graph meets them). ``devices`` > 1 is ignored: every op runs on device 0.

``predicted_ms`` replays the assignment under the ideal model (:func:`ideal_finish_times`).

Complexity: transitive reduction O(V + E) operations on V-bit reachability sets, Hopcroft–Karp O(E'·√V), merging
O(C log C + C·K) for C chains.

References
----------
.. [1] W. Kwon, G.-I. Yu, E. Jeong and B.-G. Chun, "Nimble: Lightweight and Parallel GPU Task Scheduling for Deep
   Learning", *Advances in Neural Information Processing Systems 33 (NeurIPS)*, 2020.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import networkx as nx
from networkx.algorithms import bipartite

from opweave.costs.model import Costs
from opweave.errors import UsageError
from opweave.ir.graph import OpGraph
from opweave.schedulers._listsched import ideal_finish_times, makespan_ms, merge_streams, renumber_streams
from opweave.schedulers.schedule import Schedule


def reduced_successors(graph: OpGraph) -> dict[str, list[str]]:
    """The successors of every op in G' (capture order; each op's in the order of its successors in the graph).

    An edge (u, v) is implied by others iff v is a descendant of another successor of u: one OR of the graph's
    reachability bitsets per op. O(V + E) bitset operations."""
    index, descendants = graph.index, graph.descendants
    reduced = {}
    for u in graph.ids:
        succs = graph.succs[u]
        implied = 0
        for w in succs:
            implied |= descendants[w]
        reduced[u] = [v for v in succs if not implied >> index[v] & 1]
    return reduced


def minimum_equivalent_graph(graph: OpGraph) -> nx.DiGraph:
    """G' as a networkx graph: the transitive reduction of the graph's DAG (same reachability, fewest edges), nodes
    in capture order and each op's edges in the order of :func:`reduced_successors`."""
    meg = nx.DiGraph()
    meg.add_nodes_from(graph.ids)
    meg.add_edges_from((u, v) for u, succs in reduced_successors(graph).items() for v in succs)
    return meg


def maximum_matching(meg: Mapping[str, Iterable[str]]) -> dict[str, str]:
    """A maximum matching of the bipartite graph B of Algorithm 1 step 2, as ``successor_of[v_i] = v_j``; ``meg``
    maps each op of G' to its successors (a ``dict`` of lists or an ``nx.DiGraph``).

    B's nodes are integers (x_i = i, y_j = n + j for the i-th and j-th op of ``meg``): networkx's Hopcroft–Karp
    walks its left side as a set, and a set of integers, unlike one of strings, iterates in the same order in every
    process, so the matching (and the schedule) does not depend on the string-hash seed."""
    nodes = list(meg)
    n = len(nodes)
    number = {u: i for i, u in enumerate(nodes)}
    bip = nx.Graph()
    bip.add_nodes_from(range(2 * n))
    bip.add_edges_from((number[u], n + number[v]) for u in nodes for v in meg[u])
    matching = bipartite.hopcroft_karp_matching(bip, top_nodes=range(n))
    return {nodes[i]: nodes[matching[i] - n] for i in range(n) if i in matching}


def nimble_stats(graph: OpGraph) -> tuple[int, int]:
    """(|E'|, |M|): edges of the minimum equivalent graph and size of a maximum matching of B."""
    reduced = reduced_successors(graph)
    return sum(map(len, reduced.values())), len(maximum_matching(reduced))


def nimble_chains(graph: OpGraph) -> list[list[str]]:
    """Algorithm 1's partition of V: |V| − |M| chains, each in dependency order, sorted by their first op's
    position in the topological order."""
    successor_of = maximum_matching(reduced_successors(graph))
    matched_right = set(successor_of.values())
    chains = []
    for head in graph.topo_order:
        if head in matched_right:
            continue
        chain = [head]
        while chain[-1] in successor_of:
            chain.append(successor_of[chain[-1]])
        chains.append(chain)
    return chains


def schedule(graph: OpGraph, costs: Costs, *, streams: int | None = None, devices: int = 1,
             max_streams: int | None = None) -> Schedule:
    caps = [c for c in (streams, max_streams) if c is not None]
    if any(c < 1 for c in caps):
        raise UsageError(f"max_streams must be at least 1, got {min(caps)}")
    order = list(graph.topo_order)
    position = {op: i for i, op in enumerate(order)}
    chains = sorted(nimble_chains(graph), key=lambda chain: position[chain[0]])
    stream_of = {op: s for s, chain in enumerate(chains) for op in chain}
    if caps and len(chains) > min(caps):
        stream_of = merge_streams(stream_of, min(caps), costs.latency_ms)
    stream_of = renumber_streams(order, stream_of)
    times = ideal_finish_times(graph, costs, order, stream_of)
    options = {"max_streams": min(caps)} if caps else {}
    return Schedule("nimble", order, stream_of, {op: 0 for op in order}, predicted_ms=makespan_ms(times),
                    options=options)
