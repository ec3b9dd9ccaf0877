"""Training TOP's GPG stage partitioner (Lin et al., TOP, IEEE TPDS 2024, §V-C), the network behind scheduler
``top-gpg`` (:mod:`opweave.schedulers.top_gpg`: the network, its encoding and greedy decoding, its choices).

**REINFORCE with a sample-mean baseline** (:func:`train`). Per graph, ``samples`` rollouts are sampled from the
policy; per chunk, each rollout's advantage is (mean makespan − its makespan) / mean makespan, and the loss is
−Σ advantage · Σ log π(step) − ``entropy`` × the policy's mean entropy; Adam with TOP's η = 0.001.
:func:`train_best` keeps the weights that did best on fixed validation graphs (greedy makespan over the DP's,
:func:`gpg_over_dp`). Graphs (:class:`GpgGraphs`, TOP's "various block combinations in the model set"):
combinations of 1-6 random blocks of the zoo models, side by side as the serving engine combines them (roofline
costs, ``gpu`` contention model, random batch 1-16), and random layered DAGs (:func:`opweave.ir.synth.random_dag`,
random utilizations). The shipped default weights (``schedulers/data/top_gpg.pt``, float16, about 230 KB) were
trained by::

    opweave train-gpg --episodes 600 --seed 0 -o src/opweave/schedulers/data/top_gpg.pt \\
        --plot benchmarks/results/top_gpg_train.png
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from opweave.costs.model import Costs, from_graph
from opweave.ir.graph import OpGraph
from opweave.ir.synth import random_dag
from opweave.schedulers import ios
from opweave.schedulers.top_gpg import FORMAT, GPG, chunk_stages, encode_inputs, one_thread, scale_ms
from opweave.serve.executors import SimExecutor, union_costs, union_graph


# ---- training graphs ----------------------------------------------------------------------------------------------
class GpgGraphs:
    """Random combined blocks of the zoo ``models`` (1 to ``max_parts`` distinct ``(model, block)`` sub-blocks,
    each at a random batch of 1-16, side by side as the serving engine combines them, with the simulated
    executor's roofline costs under the ``gpu`` contention model) and, one graph in three, random layered DAGs
    (10-60 ops, 3-12 layers, latencies 0.1-4 ms, utilizations uniform in 0.1-1)."""

    def __init__(self, blocked: dict, *, preset: str = "h100", max_parts: int = 6, seed: int = 0):
        """``blocked``: name -> :class:`~opweave.serve.blocks.BlockedModel` (:meth:`from_zoo` loads zoo models
        into one)."""
        self.executor = SimExecutor(dict(blocked), preset=preset)
        self.slots = [(n, b) for n, m in blocked.items() for b in range(len(m.blocks))]
        self.max_parts = max_parts
        self.rng = random.Random(seed)

    @classmethod
    def from_zoo(cls, models: list[str], *, preset: str = "h100", seed: int = 0) -> GpgGraphs:
        """The training graphs of the zoo ``models`` (loaded and split into blocks as the server does)."""
        from opweave.serve.build import load_models

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

    def validation(self) -> list[tuple[OpGraph, Costs, float]]:
        """Fixed graphs (their own seed) with IOS's DP makespan: combined blocks of 2, 4 and 6 sub-blocks and three
        random DAGs."""
        from opweave import schedulers

        keep = self.rng
        self.rng = random.Random(12345)
        graphs = [self.random_combined(k) for k in (2, 4, 6)] + [self.random_dag() for _ in range(3)]
        self.rng = keep
        return [(g, c, schedulers.run("ios", g, c).predicted_ms) for g, c in graphs]


def gpg_over_dp(net: GPG, valid: list[tuple[OpGraph, Costs, float]]) -> float:
    """Mean over ``valid`` of GPG's greedy makespan over the DP's."""
    ratios = []
    net.eval()
    with torch.no_grad():
        for g, c, dp_ms in valid:
            index = {o: i for i, o in enumerate(g.ids)}
            g2e = net.embed(*encode_inputs(g, c))
            scale = scale_ms(g, c)
            total = sum(chunk_stages(net, g2e, index, g, c, block, ios.DEFAULT_MAX_GROUP_OPS,
                                     ios.DEFAULT_MAX_GROUPS, scale)[0] for block in ios.blocks(g))
            ratios.append(total / dp_ms if dp_ms > 0 else 1.0)
    return sum(ratios) / len(ratios)


# ---- REINFORCE ----------------------------------------------------------------------------------------------------
def train(net: GPG, graphs: Iterable[tuple[OpGraph, Costs]], *, samples: int = 4, lr: float = 1e-3,
          entropy: float = 0.05, seed: int = 0,
          on_episode: Callable[[int, dict], None] | None = None) -> list[dict]:
    """REINFORCE on ``graphs`` (module docstring): one episode per graph, ``samples`` rollouts each. Returns per
    episode the mean sampled makespan over the greedy one (``sampled_over_greedy``) and the loss."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    history = []

    def sample(logits: torch.Tensor) -> int:
        return int(torch.multinomial(torch.softmax(logits.detach(), 0), 1, generator=gen))

    for episode, (graph, costs) in enumerate(graphs):
        index = {o: i for i, o in enumerate(graph.ids)}
        scale = scale_ms(graph, costs)
        g2e = net.embed(*encode_inputs(graph, costs))
        loss = torch.zeros(())
        sampled = greedy = 0.0
        for block in ios.blocks(graph):
            runs = [chunk_stages(net, g2e, index, graph, costs, block, ios.DEFAULT_MAX_GROUP_OPS,
                                 ios.DEFAULT_MAX_GROUPS, scale, pick=sample) for _ in range(samples)]
            mean = sum(r[0] for r in runs) / samples
            sampled += mean
            with torch.no_grad():
                greedy += chunk_stages(net, g2e, index, graph, costs, block, ios.DEFAULT_MAX_GROUP_OPS,
                                       ios.DEFAULT_MAX_GROUPS, scale)[0]
            for total, _, logps in runs:
                if logps:
                    advantage = (mean - total) / mean if mean > 0 else 0.0
                    logp, ent = torch.stack(logps).unbind(1)
                    loss = loss - (advantage * logp.sum() + entropy * ent.mean()) / samples
        if loss.requires_grad:
            opt.zero_grad()
            loss.backward()
            opt.step()
        record = {"episode": episode, "graph": graph.name, "ops": len(graph), "loss": float(loss.detach()),
                  "sampled_over_greedy": sampled / greedy if greedy > 0 else 1.0}
        history.append(record)
        if on_episode is not None:
            on_episode(episode, record)
    net.eval()
    return history


@dataclass
class Kept:
    """What :func:`train_best` returns: the network with the weights kept, the episode they are from, their
    validation ratio (greedy makespan over the DP's) and the learning curve (one record per episode, with
    ``valid_over_dp`` where validated)."""

    net: GPG
    episode: int
    valid_over_dp: float
    curve: list[dict]


def train_best(source: GpgGraphs, episodes: int, *, samples: int = 4, validate_every: int = 25, seed: int = 0,
               on_episode: Callable[[int, dict], None] | None = None) -> Kept:
    """A fresh network (torch seeded with ``seed``) trained by :func:`train` on ``episodes`` graphs of ``source``,
    with one intra-op thread; every ``validate_every`` episodes, and after the last, its greedy makespan on
    ``source``'s validation graphs is compared with IOS's DP, and the weights that did best there are kept.
    ``on_episode(i, record)`` sees each episode's record once it is validated."""
    valid = source.validation()
    curve: list[dict] = []
    torch.manual_seed(seed)
    net = GPG()
    best = {"ratio": float("inf"), "state": None, "episode": -1}

    def validate(i: int, rec: dict) -> None:
        if i % validate_every == 0 or i == episodes - 1:
            rec["valid_over_dp"] = gpg_over_dp(net, valid)
            if rec["valid_over_dp"] < best["ratio"]:
                best.update(ratio=rec["valid_over_dp"], state=copy.deepcopy(net.state_dict()), episode=i)
            net.train()
        curve.append(rec)
        if on_episode is not None:
            on_episode(i, rec)

    with one_thread():
        train(net, source.stream(episodes), samples=samples, seed=seed, on_episode=validate)
    net.load_state_dict(best["state"])
    return Kept(net, best["episode"], best["ratio"], curve)


# ---- the weights file ---------------------------------------------------------------------------------------------
def save(net: GPG, path: str | Path, meta: dict | None = None) -> None:
    """Weights as float16 (half the size; :func:`opweave.schedulers.top_gpg.load` reads them back as float32) with
    ``meta`` (how they were trained)."""
    state = {k: v.detach().to(torch.float16) for k, v in net.state_dict().items()}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": FORMAT, "state": state, "meta": meta or {}}, str(path))


__all__ = ["GpgGraphs", "Kept", "gpg_over_dp", "save", "train", "train_best"]
