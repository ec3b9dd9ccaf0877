"""TOP's GNN-based policy-gradient stage partitioner, GPG (Lin et al., TOP, IEEE TPDS 2024, §V-C, Alg. 2, Fig. 11-13).

Like IOS (:mod:`opweave.schedulers.ios`), GPG splits a graph into *stages* by repeatedly removing an *ending* of
the ops left (a non-empty set with no edge towards the rest; its weakly connected components are the stage's
*groups*, run concurrently, each in topological order on its own stream). IOS's DP tries every ending of every
state; GPG walks one path: at each step a learned policy picks one ending among the candidates IOS's pruning admits
(at most r = 3 ops per group, s = 8 groups per stage, §V-D), so it visits a handful of states instead of all of
them (TOP Fig. 13: an order of magnitude faster, slightly worse).

**Encoder (§V-C 1, eqs. 5-6, TOP §VI-B sizes).** Each op has a raw state s_v: its kind (conv, linear, norm,
activation, pool, elementwise, concat, other — from ``Op.target``), its cost-model latency (over the graph's mean),
utilization, memory-bound flag, log FLOPs, log bytes, in- and out-degree. Layer 1 propagates top-down along the
DAG: e_v = h1(Σ_{p ∈ parents(v)} g1(e_p)) + P s_v, computed level by level (every op of a topological level at
once, with ``index_add``), once per graph and reused at every step. Layer 2 pools a set of ops:
h2(Σ_{v ∈ set} g2(e_v)). g1, h1, g2, h2 are 2-layer ReLU networks with 64 and 32 units (embeddings of 32).

**Policy.** The state z_t is layer 2 over the leaves of the ops left (eq. 6). Every candidate ending E gets y_E,
layer 2 over its own ops, and six cost-model features: its stage latency bound and its work (sum of its ops' latencies),
both over the graph's mean op latency (log1p), work / stage latency (the stage's speed-up), groups / s, ops / (r·s)
and its share of the ops left. The policy network (TOP's 2-layer ReLU policy with 500 and 128 units) scores
[z_t, y_E, features] → one logit per candidate; training samples from the softmax, inference takes the argmax
(deterministic: the candidates come in the fixed order :func:`opweave.schedulers.ios.endings` lists them, and logits
within 1e-6 of the largest tie, going to the first: :func:`greedy`). The scheduler is a pure function of graph,
costs and the weights file.

**Choices where TOP is ambiguous or where we depart from it, and why.**

* *Discrete scores instead of a 1-D continuous action.* TOP's policy outputs m ∈ [0, 1) and takes ending
  ⌊m·M⌋ of a list it does not define the order of, trained with DDPG and a critic q (eqs. 7-8). A score per
  candidate ranks endings by what they are, not by their place in a list, and needs no learned critic: we train it
  with REINFORCE whose baseline is the policy's own greedy rollout from the same state (:mod:`opweave.learn.gpg`).
  The critic's sizes (1024, 512, 300) are therefore unused here.
* *Reward.* TOP's u_t = e^{-l_t} summed over steps rewards *more* stages (each adds a term ≤ 1), not a shorter
  total. We use u_t = -l_t (over the graph's greedy makespan), so the return of an episode is minus the makespan
  it chose, exactly the quantity the DP minimizes.
* *Candidates.* The graph is first cut into the chunks IOS's DP uses (:func:`opweave.schedulers.ios.blocks`: cut
  ops, then chunks of ≤ 20 ops and ≤ 512 down-sets), so that GPG and the DP search the same space and the endings
  of a state can be listed (the number of endings of a wide combined block is otherwise combinatorial). The stage
  latency the policy sees of a candidate is a cheap bound from the cost model (:func:`stage_bound_ms`: longest
  group, device work); only the chosen stage is priced by ``Costs.stage_latency_ms`` (TOP measures stages while
  training only and never while searching, which is what makes GPG fast).

**Training** is :mod:`opweave.learn.gpg` (REINFORCE with a greedy-rollout baseline per step on combined zoo
blocks and random DAGs, ``opweave train-gpg``); this module only runs the weights it saves. The shipped default
weights (``data/top_gpg.pt``, float16, about 230 KB) and the command that trains them are described there.

**Rules** (:data:`RULES`, ``rule=``): the same walk with a one-line scorer in place of the network, the candidate
with the largest work or the highest speed-up (work / stage latency bound). They are what a trained network must
beat to have learned anything (``benchmarks/top_gpg.py`` runs both beside GPG and the DP).

Complexity per chunk: steps × (endings of the visited state, each priced by the cost model) + the network on each
step's candidates, against the DP's sum over *all* states of the chunk (``benchmarks/top_gpg.py`` measures both). A
graph's chunks are walked in lockstep (:func:`walk`): one network pass scores the candidates of every chunk's
current step, so a graph pays a pass's fixed cost once per round, not once per chunk and step.
"""

from __future__ import annotations

import math
import os
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from opweave.cores import intra_op_threads
from opweave.costs.model import Costs
from opweave.errors import UsageError, did_you_mean
from opweave.ir.graph import OpGraph
from opweave.schedulers import ios
from opweave.schedulers.schedule import Schedule

FORMAT = "opweave.top-gpg/1"
DEFAULT_WEIGHTS = Path(__file__).resolve().parent / "data" / "top_gpg.pt"
KINDS = ("conv", "linear", "norm", "act", "pool", "elementwise", "cat", "other")
_KIND_WORDS = (("conv", ("conv",)), ("linear", ("linear", "matmul", "addmm", "bmm", "mm", "einsum")),
               ("norm", ("norm",)), ("act", ("relu", "sigmoid", "tanh", "gelu", "silu", "softmax", "hardswish")),
               ("pool", ("pool",)), ("cat", ("cat", "concat", "stack")),
               ("elementwise", ("add", "mul", "sub", "div", "mean", "flatten", "view", "reshape")))
NODE_FEATURES = len(KINDS) + 7
CAND_FEATURES = 6
# One-line scorers in place of the network (``walk(rule=...)``, ``schedule(rule=...)``): take the candidate
# with the largest value of one candidate feature, its work (Σ latency of its ops) or its speed-up (work / stage
# latency bound). The baselines a trained GPG must beat (``benchmarks/top_gpg.py``).
RULES = {"work": 1, "speedup": 2}
EMBED = 32


def node_type(target: str | None) -> int:
    """The policy network's node-type feature (TOP §V-C encodes each op's type one-hot): the index in :data:`KINDS`
    of the first group of words found in an op's target (``torch.nn.Conv2d``, ``aten.relu.default``...). It is the
    encoding the shipped weights were trained on, so it is kept as it is rather than read from the op's kind
    (:mod:`opweave.ir.kinds`, which sorts activations, concatenations and means otherwise)."""
    text = (target or "").lower()
    for kind, words in _KIND_WORDS:
        if any(w in text for w in words):
            return KINDS.index(kind)
    return KINDS.index("other")


def _mlp(*sizes: int, last_relu: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _run(layers: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """``layers(x)`` without the module-call machinery: the same ``linear`` and ``relu`` calls, so the same bits,
    without a module call's Python overhead per layer (a step of the walk runs 7 layers, and GPG's speed is the
    point of it)."""
    for layer in layers:
        x = F.linear(x, layer.weight, layer.bias) if isinstance(layer, nn.Linear) else torch.relu(x)
    return x


class GPG(nn.Module):
    """The encoder (g1, h1, g2, h2, the raw-state projection P) and the policy network (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(NODE_FEATURES, EMBED)
        self.g1, self.h1 = _mlp(EMBED, 64, EMBED), _mlp(EMBED, 64, EMBED)
        self.g2, self.h2 = _mlp(EMBED, 64, EMBED), _mlp(EMBED, 64, EMBED)
        self.policy = _mlp(2 * EMBED + CAND_FEATURES, 500, 128, 1, last_relu=False)

    def embed(self, x: torch.Tensor, levels: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Layer 1 (eq. 5) for every op: ``levels`` lists, per topological level, (its ops, the edges' sources,
        the edges' destinations as positions among its ops); returns g2(e_v) per op, what layer 2 sums."""
        own = self.proj(x)
        e = torch.zeros_like(own)
        for ops, src, dst in levels:
            agg = torch.zeros(len(ops), EMBED, dtype=x.dtype).index_add(0, dst, _run(self.g1, e[src]))
            e = e.index_copy(0, ops, _run(self.h1, agg) + own[ops])
        return _run(self.g2, e)

    def scores(self, g2e: torch.Tensor, rows: torch.Tensor, owner: torch.Tensor, states: int,
               state_of: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """One logit per candidate of ``states`` states at once. Layer 2 (eq. 6) pools op embeddings into one row
        per state (its leaves: z_t) and one per candidate (its ops: y_E), ``g2e[rows[k]]`` into row ``owner[k]``
        (rows ``0..states-1`` the states', then the candidates' in order), in one pass; candidate ``i`` belongs to
        state ``state_of[i]`` and has the cost ``features[i]``."""
        pooled = torch.zeros(states + len(features), EMBED, dtype=g2e.dtype).index_add(0, owner, g2e[rows])
        h = _run(self.h2, pooled)
        return _run(self.policy, torch.cat([h[state_of], h[states:], features], 1)).squeeze(1)


# ---- graph encoding -------------------------------------------------------------------------------------------
def scale_ms(graph: OpGraph, costs: Costs) -> float:
    """The graph's mean op latency (what every time feature is divided by), at least 1 ns."""
    return max(1e-6, sum(costs.latency_ms[o] for o in graph.ids) / max(1, len(graph)))


def encode_inputs(graph: OpGraph, costs: Costs) -> tuple[torch.Tensor, list[Any]]:
    """Raw op states s_v (module docstring) in ``graph.ids`` order, and the levels :meth:`GPG.embed` walks."""
    scale = scale_ms(graph, costs)
    index = {o: i for i, o in enumerate(graph.ids)}
    pairs = sorted({(index[u], index[v]) for u, v in graph.edge})
    rows = []
    for op in graph.ops:
        kind = [0.0] * len(KINDS)
        kind[node_type(op.target)] = 1.0
        rows.append(kind + [math.log1p(costs.latency_ms[op.id] / scale), costs.util(op.id),
                            1.0 if costs.category.get(op.id, op.category) == "memory" else 0.0,
                            math.log1p(max(op.flops, 0.0)) / 30, math.log1p(max(op.bytes, 0.0)) / 30,
                            len(graph.preds[op.id]) / 4, len(graph.succs[op.id]) / 4])
    level: dict[str, int] = {}
    for name in graph.topo_order:
        level[name] = 1 + max((level[p] for p in graph.preds[name]), default=-1)
    by_level: dict[int, list[int]] = {}
    for name, lv in level.items():
        by_level.setdefault(lv, []).append(index[name])
    into: dict[int, list[int]] = {}
    for u, v in pairs:
        into.setdefault(v, []).append(u)
    levels = []
    for lv in sorted(by_level):
        ops = sorted(by_level[lv])
        src = [u for k, v in enumerate(ops) for u in into.get(v, [])]
        dst = [k for k, v in enumerate(ops) for _ in into.get(v, [])]
        levels.append((torch.tensor(ops), torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long)))
    return torch.tensor(rows, dtype=torch.float32), levels


def stage_bound_ms(costs: Costs, groups: list[list[str]]) -> float:
    """A cheap lower bound of ``costs.stage_latency_ms(groups)``: the longest group, and under the ``gpu`` model
    also the work the device must do (Σ latency × utilization) plus the fork/join events. Exact under ``ideal``.
    What the policy sees of a candidate (pricing every candidate with the contention model cost more than the
    whole DP on wide graphs); the chosen stage is priced exactly."""
    longest = max(math.fsum(costs.latency_ms[o] for o in g) for g in groups)  # as Costs.stage_latency_ms sums
    if costs.model == "ideal" or len(groups) <= 1:
        return longest
    work = math.fsum(costs.latency_ms[o] * costs.util(o) for g in groups for o in g)
    return max(longest, work) + costs.gpu.event_overhead_ms * (len(groups) - 1)


# ---- one chunk, one rollout -----------------------------------------------------------------------------------
def candidates(costs: Costs, block: list[str], desc: list[int], state: int, max_group_ops: int, max_groups: int,
               scale: float) -> tuple[list[tuple[int, tuple[int, ...]]], list[list[list[str]]], list[list[float]]]:
    """The candidate endings of ``state`` (bitset over ``block``, ``desc`` from
    :func:`opweave.schedulers.ios.block_descendants`) in :func:`opweave.schedulers.ios.endings`' order: the
    (ending, groups) bitsets, their groups as op ids, and their :data:`CAND_FEATURES` cost features (module
    docstring). They depend on the graph and costs only, not on the network."""
    cands = ios.endings(state, desc, max_group_ops, max_groups)
    left = state.bit_count()
    latency, utilization = costs.latency_ms, costs.utilization
    exact_bound = costs.model == "ideal"
    # per group (shared by every candidate holding it): its ops, their latencies, their latency × utilization, and
    # its Σ latency; the sums below are math.fsum of the same terms as stage_bound_ms's (so the same bits: fsum is
    # correctly rounded, whatever the order), without walking a group's bits again for every candidate
    split: dict[int, tuple[list[str], list[float], list[float], float]] = {}
    groups_ops, feats = [], []
    for ending, groups in cands:
        for g in groups:
            if g not in split:
                ops = [block[i] for i in ios._bits(g)]
                lat = [latency[o] for o in ops]
                split[g] = (ops, lat, [latency[o] * utilization.get(o, 1.0) for o in ops], math.fsum(lat))
        parts = [split[g] for g in groups]
        op_groups = [p[0] for p in parts]
        longest = max(p[3] for p in parts)
        if len(groups) == 1:
            stage_ms = work = longest
        else:
            work = math.fsum(chain.from_iterable(p[1] for p in parts))
            if exact_bound:
                stage_ms = longest
            else:
                device = math.fsum(chain.from_iterable(p[2] for p in parts))
                stage_ms = max(longest, device) + costs.gpu.event_overhead_ms * (len(groups) - 1)
        n = ending.bit_count()
        groups_ops.append(op_groups)
        feats.append([math.log1p(stage_ms / scale), math.log1p(work / scale), work / stage_ms if stage_ms > 0
                      else 1.0, len(groups) / max_groups, n / (max_group_ops * max_groups), n / left])
    return cands, groups_ops, feats


def candidate_logits(net: GPG, g2e: torch.Tensor, index: dict[str, int], block: list[str], desc: list[int],
                     state: int, groups_ops: list[list[list[str]]], feats: list[list[float]]) -> torch.Tensor:
    """The policy's logit of each candidate of ``state`` (:func:`candidates`); ``g2e`` is :meth:`GPG.embed`'s output
    and ``index`` maps op ids to its rows."""
    return batch_logits(net, g2e, index, [(block, desc, state, groups_ops, feats)])


Step = tuple[list[str], list[int], int, list[list[list[str]]], list[list[float]]]  # what batch_logits scores


def batch_logits(net: GPG, g2e: torch.Tensor, index: dict[str, int], steps: list[Step]) -> torch.Tensor:
    """The logits of the candidates of several states of one graph in one network pass, concatenated in the order
    of ``steps``: per state (its chunk's ops, their descendants, the state, its candidates' groups as op ids and
    their features, as :func:`candidate_logits` takes them)."""
    rows: list[int] = []
    owner: list[int] = []
    state_of: list[int] = []
    feats: list[list[float]] = []
    for k, (block, desc, state, _, _) in enumerate(steps):
        leaves = [index[block[i]] for i in ios._bits(state) if not desc[i] & state]
        rows += leaves
        owner += [k] * len(leaves)
    row = len(steps)
    for k, (_, _, _, groups_ops, f) in enumerate(steps):
        for groups in groups_ops:
            members = [index[o] for grp in groups for o in grp]
            rows += members
            owner += [row] * len(members)
            row += 1
        state_of += [k] * len(groups_ops)
        feats += f
    # through numpy: the same tensors as torch.tensor(list) in a fifth of the time
    return net.scores(g2e, _ints(rows), _ints(owner), len(steps), _ints(state_of),
                      torch.from_numpy(np.array(feats, dtype=np.float32)).to(g2e.dtype))


def _ints(values: list[int]) -> torch.Tensor:
    return torch.from_numpy(np.array(values, dtype=np.int64))


def rule_choice(rule: str, feats: list[list[float]]) -> int:
    """The candidate a one-line rule (:data:`RULES`) takes: the largest value of its feature, ties to the first."""
    return greedy(torch.tensor([f[RULES[rule]] for f in feats], dtype=torch.float64))


@dataclass
class _Walk:
    """Alg. 2's state on one chunk: the ops left (a bitset over ``block``), the stages taken, their latency."""

    block: list[str]
    desc: list[int]
    state: int
    stages: list[list[str]] = field(default_factory=list)
    total: float = 0.0


def walk(net: GPG | None, g2e: torch.Tensor | None, index: dict[str, int], graph: OpGraph, costs: Costs,
         blocks: list[list[str]], max_group_ops: int, max_groups: int, scale: float, *,
         rule: str | None = None) -> list[tuple[float, list[list[str]]]]:
    """Alg. 2, greedy (argmax), on every chunk of ``blocks``: per chunk (total latency in ms, stages as lists of
    groups in run order). ``rule`` (a key of :data:`RULES`) scores the candidates by one of their features instead
    of the network (``net`` and ``g2e`` may then be None): the one-line baselines a trained network must beat.

    The chunks are independent, so they are walked in lockstep: each round takes one step in every chunk not yet
    empty, and the candidates of every chunk that needs the network are scored in one pass (:func:`batch_logits`).
    A pass costs about 20 small torch calls whatever its size, so a graph of c chunks pays for one pass per round
    instead of c; the choices are those of walking each chunk alone."""
    if rule is not None and rule not in RULES:
        raise UsageError(f"top-gpg rule {rule!r}{did_you_mean(rule, RULES)}: choose one of {', '.join(RULES)}")
    walks = [_Walk(block, ios.block_descendants(graph, block), (1 << len(block)) - 1) for block in blocks]
    active = [w for w in walks if w.state]
    while active:
        scored = []
        for w in active:
            cands, groups_ops, feats = candidates(costs, w.block, w.desc, w.state, max_group_ops, max_groups, scale)
            if len(cands) == 1:
                _take(costs, w, cands, groups_ops, 0)
            elif rule is not None:
                _take(costs, w, cands, groups_ops, rule_choice(rule, feats))
            else:
                scored.append((w, cands, groups_ops, feats))
        if scored:
            assert net is not None and g2e is not None  # no rule: the network scores the candidates
            logits = batch_logits(net, g2e, index, [(w.block, w.desc, w.state, g, f) for w, _, g, f in scored])
            values, dtype, start = logits.tolist(), logits.dtype, 0
            for w, cands, groups_ops, _ in scored:
                choice = _greedy_values(values[start:start + len(cands)], dtype)
                start += len(cands)
                _take(costs, w, cands, groups_ops, choice)
        active = [w for w in active if w.state]
    return [(w.total, w.stages[::-1]) for w in walks]


def _take(costs: Costs, w: _Walk, cands: list[Any], groups_ops: list[Any], choice: int) -> None:
    w.stages.append(groups_ops[choice])
    w.total += costs.stage_latency_ms(groups_ops[choice])
    w.state ^= cands[choice][0]


def greedy(logits: torch.Tensor, tolerance: float = 1e-6) -> int:
    """The argmax, with ties broken towards the first candidate: every logit within ``tolerance`` (relative to the
    largest, at least absolute) of the largest counts as tied. Symmetric candidates (deepfm's identical branches)
    score the same up to the last bit, and which bit wins depends on the CPU's vector width, so a plain argmax
    picked a different partition on another machine.

    >>> greedy(torch.tensor([0.5, 1.0, 1.0 + 1e-7, 0.9]))
    1
    """
    return _greedy_values(logits.tolist(), logits.dtype, tolerance)


def _greedy_values(values: list[float], dtype: torch.dtype, tolerance: float = 1e-6) -> int:
    """:func:`greedy` of logits already read out as floats (of a tensor of ``dtype``)."""
    top = max(values)
    # the logits are of ``dtype``: the threshold is rounded to it, as comparing them in torch would round it
    threshold = top - tolerance * max(1.0, abs(top))
    if dtype == torch.float32:
        threshold = float(np.float32(threshold))  # IEEE round-to-nearest, as torch.tensor(x, dtype=float32) does
    elif dtype != torch.float64:
        threshold = torch.tensor(threshold, dtype=dtype).item()
    return next(i for i, v in enumerate(values) if v >= threshold)


# ---- weights ----------------------------------------------------------------------------------------------------
def load(path: str | Path | None = None) -> GPG:
    """The network saved at ``path`` (default: the shipped weights), in eval mode; cached per file and mtime."""
    path = Path(path) if path is not None else DEFAULT_WEIGHTS
    if not path.is_file():
        raise UsageError(f"top-gpg weights: no file {path}")
    return _load(str(path.resolve()), os.stat(path).st_mtime_ns)


@lru_cache(maxsize=8)
def _load(path: str, mtime: int) -> GPG:
    data = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UsageError(f"top-gpg weights: {path} is not an {FORMAT} file")
    net = GPG()
    net.load_state_dict({k: v.to(torch.float32) for k, v in data["state"].items()})
    return net.eval()


def one_thread() -> AbstractContextManager[int]:
    """Run torch with one intra-op thread, then restore the setting (:func:`opweave.cores.intra_op_threads`). The
    networks are tiny: a second thread only adds synchronization, which made a small DAG's partition many times
    slower (docs/design.md, §3.7)."""
    return intra_op_threads(1)


# ---- the scheduler ----------------------------------------------------------------------------------------------
def schedule(graph: OpGraph, costs: Costs, *, streams: int | None = None, devices: int = 1,
             weights: str | Path | None = None, max_group_ops: int = ios.DEFAULT_MAX_GROUP_OPS,
             max_groups: int = ios.DEFAULT_MAX_GROUPS, max_block_ops: int = ios.DEFAULT_MAX_BLOCK_OPS,
             max_states: int = ios.DEFAULT_MAX_STATES, rule: str | None = None) -> Schedule:
    """GPG on one device (``devices`` > 1 is ignored): greedy (argmax) stage partition with the weights at
    ``weights`` (default: the shipped file). ``streams`` caps the groups per stage, as for ``ios``. ``rule``
    (``"work"`` or ``"speedup"``, :data:`RULES`) walks the same Alg. 2 with that one-line scorer instead of the
    network (no weights are read): a baseline for measuring what the network learned, not a scheduler to use."""
    if max_group_ops < 1 or max_groups < 1 or max_block_ops < 1 or max_states < 2:
        raise UsageError("top-gpg needs max_group_ops, max_groups, max_block_ops >= 1 and max_states >= 2")
    if rule is not None and rule not in RULES:
        raise UsageError(f"top-gpg rule {rule!r}{did_you_mean(rule, RULES)}: choose one of {', '.join(RULES)}")
    group_cap = max_groups if streams is None else min(max_groups, streams)
    options: dict[str, int | str] = {"max_group_ops": max_group_ops, "max_groups": group_cap,
                                     "max_block_ops": max_block_ops, "max_states": max_states}
    if rule is None:
        with one_thread():  # loading too: a forked child (benchmarks/_common.run_limited) hangs in a second thread
            net = load(weights)
        options["weights"] = str(weights or DEFAULT_WEIGHTS.name)
    else:
        net = None
        options["rule"] = rule
    if not len(graph):
        return ios.staged("top-gpg", [], None, options)
    index = {o: i for i, o in enumerate(graph.ids)}
    scale = scale_ms(graph, costs)
    chunks = ios.blocks(graph, max_block_ops, max_states)
    with torch.inference_mode(), one_thread():  # no autograd bookkeeping at all: a step is ~20 tiny torch calls
        g2e = None if net is None else net.embed(*encode_inputs(graph, costs))
        walked = walk(net, g2e, index, graph, costs, chunks, max_group_ops, group_cap, scale, rule=rule)
        solved = {tuple(block): result for block, result in zip(chunks, walked, strict=True)}
        return ios.staged("top-gpg", chunks, lambda block: solved[tuple(block)], options)


__all__ = ["DEFAULT_WEIGHTS", "FORMAT", "GPG", "KINDS", "RULES", "batch_logits", "candidate_logits", "candidates",
           "encode_inputs", "greedy", "load", "one_thread", "node_type", "rule_choice", "scale_ms", "schedule", "walk"]
