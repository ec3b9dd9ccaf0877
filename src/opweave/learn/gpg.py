"""Training TOP's GPG stage partitioner (Lin et al., TOP, IEEE TPDS 2024, §V-C), the network behind scheduler
``top-gpg`` (:mod:`opweave.schedulers.top_gpg`: the network, its encoding and greedy decoding, its choices).

**REINFORCE with a greedy-rollout baseline per step** (:func:`train`), after Kool, van Hoof and Welling,
"Attention, Learn to Solve Routing Problems!" (ICLR 2019), who subtract from a sampled solution's cost that of a
greedy rollout of the policy (their frozen best-so-far copy; here the current weights, whose greedy walk does not
change within an episode). The makespan of a chunk is a sum of stage latencies, so the baseline can be taken per
step: for a choice E sampled in state S, its advantage is

    A = V(S) − (latency(E) + V(S − E)),   V(S) = latency of the stages the greedy policy splits S into,

divided by the graph's greedy makespan: positive when taking E here, then going on greedily, beats going greedily
from here. The greedy cost-to-go V is cached per state within an episode (the weights do not change during one), so a
choice equal to the greedy one has A = 0 exactly and costs nothing. Per graph, ``samples`` rollouts are sampled per
chunk from the softmax; the loss is −Σ A · log π(E | S) / samples − ``entropy`` (0.01) × the policy's mean entropy,
and Adam (TOP's η = 0.001, falling linearly to a tenth over the run) takes one step per graph. The sample-mean
baseline this replaces (one advantage per rollout, shared by all its steps) learned nothing a one-line rule does not
do: the weights it kept gave the same mean makespan over the DP as "take the ending with the largest work" on the
benchmark's graphs (docs/schedulers.md).

:func:`train_best` validates every so many episodes on fixed graphs (:meth:`GpgGraphs.validation`: combined blocks
of 1-6 sub-blocks, five of each size, drawn with :data:`VALIDATION_SEED`) against IOS's DP, and keeps the weights
whose greedy makespan over the DP's (:func:`gpg_over_dp`) was lowest there; it also reports the one-line rules'
ratio on the same graphs (:data:`opweave.schedulers.top_gpg.RULES`). Training graphs (:class:`GpgGraphs`, TOP's
"various block combinations in the model set") are combinations of 1-6 random blocks of the zoo models, side by
side as the serving engine combines them (roofline costs, ``gpu`` contention model, random batch 1-16), and, one in
three, random layered DAGs (:func:`opweave.ir.synth.random_dag`, random utilizations), drawn with the training
seed; seeds :data:`VALIDATION_SEED` and :data:`HELD_OUT_SEED` (``benchmarks/top_gpg.py``'s graphs) are refused for
training. The network starts from fresh weights (torch seeded with the same seed): no warm start.

The default weights (``schedulers/data/top_gpg.pt``, float16, about 230 KB) are trained by::

    opweave train-gpg --episodes 20000 --seed 0 -o src/opweave/schedulers/data/top_gpg.pt \
        --plot benchmarks/results/top_gpg_train.png

(the training graphs take most of the time, the validation graphs' DP solves are made once; how long the shipped
weights took: docs/schedulers.md); the file records the command, the episode kept and its validation ratios in its
``meta``, and the learning curve goes to ``top_gpg_train.json`` beside the plot.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from opweave.costs.model import Costs, from_graph
from opweave.errors import UsageError
from opweave.ir.graph import OpGraph
from opweave.ir.synth import random_dag
from opweave.schedulers import ios
from opweave.schedulers.top_gpg import (
    FORMAT,
    GPG,
    RULES,
    candidate_logits,
    candidates,
    encode_inputs,
    greedy,
    one_thread,
    scale_ms,
    walk,
)
from opweave.serve.assemble import serving_options
from opweave.serve.engine.combined import union_costs, union_graph
from opweave.serve.engine.simulation import SimExecutor

VALIDATION_SEED = 12345  # the validation graphs' draws
HELD_OUT_SEED = 2024  # benchmarks/top_gpg.py's graphs


# ---- training graphs ----------------------------------------------------------------------------------------------
class GpgGraphs:
    """Random combined blocks of the zoo ``models`` (1 to ``max_parts`` distinct ``(model, block)`` sub-blocks,
    each at a random batch of 1-16, side by side as the serving engine combines them, with the simulated
    executor's roofline costs under the ``gpu`` contention model) and, one graph in three, random layered DAGs
    (10-60 ops, 3-12 layers, latencies 0.1-4 ms, utilizations uniform in 0.1-1)."""

    def __init__(self, blocked: dict, *, preset: str = "h100", max_parts: int = 6, seed: int = 0):
        """``blocked``: name -> :class:`~opweave.serve.engine.blocks.BlockedModel` (:meth:`from_zoo` loads zoo models
        into one)."""
        self.executor = SimExecutor(dict(blocked), serving_options("sim"), preset=preset)
        self.slots = [(n, b) for n, m in blocked.items() for b in range(len(m.blocks))]
        self.max_parts = max_parts
        self.rng = random.Random(seed)

    @classmethod
    def from_zoo(cls, models: list[str], *, preset: str = "h100", seed: int = 0) -> GpgGraphs:
        """The training graphs of the zoo ``models`` (loaded and split into blocks as the server does)."""
        from opweave.serve.assemble import load_models

        served = load_models(models, device="sim", max_batch=16)
        return cls({n: m.blocked for n, m in served.items()}, preset=preset, seed=seed)

    def combined(self, parts: list[tuple[str, int, int]]) -> tuple[OpGraph, Costs]:
        """The union graph and costs of ``(model, block, batch)`` parts (what the simulated executor schedules)."""
        graphs = [self.executor.models[m].graph_at(b, n) for m, b, n in parts]
        costs = union_costs([self.executor.part_costs(m, b, n) for m, b, n in parts], "gpu")
        return union_graph(graphs, "+".join(f"{m}.b{b}x{n}" for m, b, n in parts)), costs

    def random_combined(self, k: int) -> tuple[OpGraph, Costs]:
        picks = self.rng.sample(self.slots, min(k, len(self.slots)))
        return self.combined([(m, b, self.rng.choice((1, 2, 4, 8, 16))) for m, b in picks])

    def random_dag(self) -> tuple[OpGraph, Costs]:
        ops = self.rng.randint(10, 60)
        layers = self.rng.randint(3, min(12, ops))
        g = random_dag(ops, layers, seed=self.rng.randrange(1 << 30))
        g = OpGraph([replace(o, utilization=round(self.rng.uniform(0.1, 1.0), 3)) for o in g.ops], g.edges, g.name)
        return g, from_graph(g, "gpu")

    def stream(self, episodes: int):
        for i in range(episodes):
            yield self.random_dag() if i % 3 == 2 else self.random_combined(self.rng.randint(1, self.max_parts))

    def validation(self, per_size: int = 5, seed: int = VALIDATION_SEED) -> list[tuple[OpGraph, Costs, float]]:
        """Fixed graphs with IOS's DP makespan: ``per_size`` combined blocks of each size 1..``max_parts``, drawn
        with their own ``seed`` (the training stream is left where it was)."""
        from opweave import schedulers

        keep = self.rng
        self.rng = random.Random(seed)
        try:
            graphs = [self.random_combined(k) for k in range(1, self.max_parts + 1) for _ in range(per_size)]
        finally:
            self.rng = keep
        return [(g, c, _predicted(schedulers.run("ios", g, c))) for g, c in graphs]


def _predicted(sched) -> float:
    """A schedule's predicted makespan (IOS's DP predicts its own)."""
    assert sched.predicted_ms is not None
    return sched.predicted_ms


def gpg_over_dp(net: GPG | None, valid: list[tuple[OpGraph, Costs, float]], rule: str | None = None) -> float:
    """Mean over ``valid`` of GPG's greedy makespan over the DP's (with one of
    :data:`~opweave.schedulers.top_gpg.RULES` in place of the network when ``rule`` is given)."""
    ratios = []
    if net is not None:
        net.eval()
    with torch.no_grad():
        for g, c, dp_ms in valid:
            index = {o: i for i, o in enumerate(g.ids)}
            g2e = None if rule is not None or net is None else net.embed(*encode_inputs(g, c))
            scale = scale_ms(g, c)
            total = sum(t for t, _ in walk(net, g2e, index, g, c, ios.blocks(g), ios.DEFAULT_MAX_GROUP_OPS,
                                           ios.DEFAULT_MAX_GROUPS, scale, rule=rule))
            ratios.append(total / dp_ms if dp_ms > 0 else 1.0)
    return sum(ratios) / len(ratios)


# ---- REINFORCE with a greedy-rollout baseline per step -----------------------------------------------------------
class _Chunk:
    """One chunk of one training graph under the current weights. Caches per state (a bitset over the chunk's ops):
    the candidates and their features (weights-independent), the logits (one forward pass, kept for backward), the
    exact latency of each ending taken, and the greedy rollout's cost-to-go V(state)."""

    def __init__(self, net: GPG, g2e: torch.Tensor, index: dict[str, int], graph: OpGraph, costs: Costs,
                 block: list[str], scale: float):
        self.net, self.g2e, self.index, self.costs, self.block, self.scale = net, g2e, index, costs, block, scale
        self.desc = ios.block_descendants(graph, block)
        self.full = (1 << len(block)) - 1
        self._cands: dict[int, tuple] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self._stage_ms: dict[int, float] = {}
        self._value: dict[int, float] = {0: 0.0}

    def candidates(self, state: int) -> tuple:
        if state not in self._cands:
            self._cands[state] = candidates(self.costs, self.block, self.desc, state, ios.DEFAULT_MAX_GROUP_OPS,
                                            ios.DEFAULT_MAX_GROUPS, self.scale)
        return self._cands[state]

    def logits(self, state: int) -> torch.Tensor:
        if state not in self._logits:
            _, groups_ops, feats = self.candidates(state)
            self._logits[state] = candidate_logits(self.net, self.g2e, self.index, self.block, self.desc, state,
                                                   groups_ops, feats)
        return self._logits[state]

    def step(self, state: int, choice: int) -> tuple[float, int]:
        """(exact latency of candidate ``choice``'s stage, the state left)."""
        cands, groups_ops, _ = self.candidates(state)
        ending = cands[choice][0]
        if ending not in self._stage_ms:
            self._stage_ms[ending] = self.costs.stage_latency_ms(groups_ops[choice])
        return self._stage_ms[ending], state ^ ending

    def greedy_choice(self, state: int) -> int:
        return 0 if len(self.candidates(state)[0]) == 1 else greedy(self.logits(state).detach())

    def value(self, state: int) -> float:
        """V(state): the latency of the stages the greedy policy partitions ``state`` into."""
        path = []
        while state not in self._value:
            latency, rest = self.step(state, self.greedy_choice(state))
            path.append((state, latency))
            state = rest
        total = self._value[state]
        for s, latency in reversed(path):
            total += latency
            self._value[s] = total
        return self._value[path[0][0]] if path else total


def train(net: GPG, graphs: Iterable[tuple[OpGraph, Costs]], *, samples: int = 4, lr: float = 1e-3,
          decay_episodes: int = 0, entropy: float = 0.01, seed: int = 0,
          on_episode: Callable[[int, dict], None] | None = None) -> list[dict]:
    """REINFORCE on ``graphs`` (module docstring): one episode and one Adam step per graph, ``samples`` rollouts
    sampled from the policy per chunk, each choice's advantage measured against the greedy rollout from the state it
    was made in. With ``decay_episodes`` > 0 the learning rate falls linearly from ``lr`` to ``lr / 10`` at that
    episode (and stays there). Returns per episode the greedy makespan before the step (``greedy_ms``), the mean
    sampled one over it (``sampled_over_greedy``), the loss and the policy's mean entropy over its choices."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    history = []
    net.train()
    for episode, (graph, costs) in enumerate(graphs):
        if decay_episodes > 0:
            for group in opt.param_groups:
                group["lr"] = lr * (1 - 0.9 * min(1.0, episode / decay_episodes))
        index = {o: i for i, o in enumerate(graph.ids)}
        scale = scale_ms(graph, costs)
        g2e = net.embed(*encode_inputs(graph, costs))
        chunks = [_Chunk(net, g2e, index, graph, costs, block, scale) for block in ios.blocks(graph)]
        greedy_ms = sum(c.value(c.full) for c in chunks)
        terms: list[torch.Tensor] = []
        entropies: list[torch.Tensor] = []
        sampled_ms = 0.0
        for chunk in chunks:
            for _ in range(samples):
                state = chunk.full
                while state:
                    if len(chunk.candidates(state)[0]) == 1:
                        latency, rest = chunk.step(state, 0)
                    else:
                        logp = torch.log_softmax(chunk.logits(state), 0)
                        choice = int(torch.multinomial(logp.detach().exp(), 1, generator=gen))
                        latency, rest = chunk.step(state, choice)
                        advantage = (chunk.value(state) - latency - chunk.value(rest)) / greedy_ms
                        if advantage:
                            terms.append(-advantage * logp[choice])
                        entropies.append(-(logp.exp() * logp).sum())
                    sampled_ms += latency / samples
                    state = rest
        ent = torch.stack(entropies).mean() if entropies else torch.zeros(())
        loss = (torch.stack(terms).sum() / samples if terms else torch.zeros(())) - entropy * ent
        if loss.requires_grad:
            opt.zero_grad()
            loss.backward()
            opt.step()
        record = {"episode": episode, "graph": graph.name, "ops": len(graph), "greedy_ms": greedy_ms,
                  "sampled_over_greedy": sampled_ms / greedy_ms if greedy_ms > 0 else 1.0,
                  "loss": float(loss.detach()), "entropy": float(ent.detach())}
        history.append(record)
        if on_episode is not None:
            on_episode(episode, record)
    net.eval()
    return history


@dataclass
class Kept:
    """What :func:`train_best` returns: the network with the weights kept, the episode they are from (-1: the
    untrained weights), their validation ratio (greedy makespan over the DP's), the one-line rules' ratio on the same
    graphs, and the learning curve (one record per episode, with ``valid_over_dp`` where validated)."""

    net: GPG
    episode: int
    valid_over_dp: float
    rules_over_dp: dict[str, float]
    curve: list[dict]


def train_best(source: GpgGraphs, episodes: int, *, samples: int = 4, lr: float = 1e-3, validate_every: int = 250,
               validation_per_size: int = 5, seed: int = 0,
               on_episode: Callable[[int, dict], None] | None = None) -> Kept:
    """A fresh network (torch seeded with ``seed``) trained by :func:`train` on ``episodes`` graphs of ``source``
    (whose own seed draws them), with one intra-op thread and the learning rate decaying over the run; before
    training, every ``validate_every`` episodes and after the last, its greedy makespan on ``source``'s validation
    graphs is compared with IOS's DP, and the weights that did best there are kept. ``on_episode(i, record)`` sees
    each episode's record once it is validated."""
    if seed in (VALIDATION_SEED, HELD_OUT_SEED):
        raise UsageError(f"seed {seed} draws the validation or benchmark graphs; train with another")
    if episodes < 1 or validate_every < 1:
        raise UsageError("train-gpg needs episodes >= 1 and validate_every >= 1")
    with one_thread():
        valid = source.validation(validation_per_size)
        rules = {rule: gpg_over_dp(None, valid, rule) for rule in RULES}
        torch.manual_seed(seed)
        net = GPG()
        start = gpg_over_dp(net, valid)
        best: dict[str, Any] = {"ratio": start, "state": copy.deepcopy(net.state_dict()), "episode": -1}
        curve: list[dict] = []

        def validate(i: int, rec: dict) -> None:
            if (i + 1) % validate_every == 0 or i == episodes - 1:
                rec["valid_over_dp"] = gpg_over_dp(net, valid)
                if rec["valid_over_dp"] < best["ratio"]:
                    best.update(ratio=rec["valid_over_dp"], state=copy.deepcopy(net.state_dict()), episode=i)
                net.train()
            curve.append(rec)
            if on_episode is not None:
                on_episode(i, rec)

        train(net, source.stream(episodes), samples=samples, lr=lr, decay_episodes=episodes, seed=seed,
              on_episode=validate)
    net.load_state_dict(best["state"])
    net.eval()
    return Kept(net, best["episode"], best["ratio"], rules, [{"episode": -1, "valid_over_dp": start}] + curve)


# ---- the weights file ---------------------------------------------------------------------------------------------
def save(net: GPG, path: str | Path, meta: dict | None = None) -> None:
    """Weights as float16 (half the size; :func:`opweave.schedulers.top_gpg.load` reads them back as float32) with
    ``meta`` (how they were trained)."""
    state = {k: v.detach().to(torch.float16) for k, v in net.state_dict().items()}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": FORMAT, "state": state, "meta": meta or {}}, str(path))


__all__ = ["HELD_OUT_SEED", "VALIDATION_SEED", "GpgGraphs", "Kept", "gpg_over_dp", "save", "train", "train_best"]
