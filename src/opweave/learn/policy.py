"""TOP's Alg. 1, offline phase (Lin et al., TOP, IEEE TPDS 2024, §V-B): the MADDPG agents of serving policy
``top`` (:class:`opweave.serve.top.TopPolicy`) trained against the simulated engine (``opweave train-policy``).

* :func:`reward`, :class:`ZScore` — eq. (2) on Z-scored utilization, latency and queue-length variance;
* :func:`train` — the training loop (:class:`~opweave.learn.maddpg.MADDPG` agents, one decision per period);
* :func:`save_agents` — the policy file that :func:`opweave.serve.top.load_agents` reads (``--policy-file``).
"""

from __future__ import annotations

import copy
import math
import random
from pathlib import Path

import torch

from opweave.errors import UsageError
from opweave.learn.maddpg import MADDPG
from opweave.serve.engine import Engine, Observer, Simulation
from opweave.serve.executors import SimClock, SimExecutor
from opweave.serve.loadgen import arrivals
from opweave.serve.top import FORMAT, TopPolicy

A_UTIL, B_LATENCY, C_SIGMA = 0.4, 0.4, 0.2  # eq. (2) weights (§VI-B)


# ---- the reward (eq. 2) -------------------------------------------------------------------------------------------
class ZScore:
    """Running mean and standard deviation (Welford) of a quantity; ``z(x)`` is (x - mean) / std, clipped to ±3
    (TOP's Z-score normalization of eq. (2); before two samples, 0)."""

    def __init__(self, mean: float = 0.0, m2: float = 0.0, n: int = 0):
        self.mean, self.m2, self.n = mean, m2, n

    def add(self, x: float) -> None:
        self.n += 1
        delta = x - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (x - self.mean)

    def z(self, x: float) -> float:
        if self.n < 2:
            return 0.0
        std = (self.m2 / (self.n - 1)) ** 0.5
        return max(-3.0, min(3.0, (x - self.mean) / std)) if std > 0 else 0.0

    def state(self) -> list[float]:
        return [self.mean, self.m2, float(self.n)]


def reward(util_z: float, latency_z: list[float], sigma_z: float) -> list[float]:
    """Eq. (2): the launcher's reward (index 0) with the models' mean latency, then each model agent's with its own."""
    mean_lat = sum(latency_z) / len(latency_z)
    return ([math.exp(A_UTIL * util_z - B_LATENCY * mean_lat - C_SIGMA * sigma_z)]
            + [math.exp(A_UTIL * util_z - B_LATENCY * lz - C_SIGMA * sigma_z) for lz in latency_z])


# ---- training (Alg. 1, offline) -----------------------------------------------------------------------------------
class _Answers(Observer):
    """Requests answered since the last :meth:`take`."""

    def __init__(self) -> None:
        self.done: list = []

    def on_done(self, request) -> None:
        if request.status == "done":
            self.done.append(request)

    def take(self) -> list:
        out, self.done = self.done, []
        return out


def train(executor: SimExecutor, pattern: dict[str, float], *, steps: int, period_ms: float = 50.0,
          episode_steps: int = 40, scales: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0), max_queue: int = 64,
          max_batch: int = 16, max_sub_blocks: int = 4, warmup: int | None = None, keep_window: int = 100,
          seed: int = 0, on_step=None) -> tuple[MADDPG, list[dict]]:
    """Alg. 1's offline phase against the simulated executor: ``steps`` decisions of ``period_ms`` of virtual time
    each, in episodes of ``episode_steps`` (each a fresh engine with empty queues and Poisson arrivals of
    ``pattern`` at a scale drawn from ``scales``, so the agents see light and heavy load).

    The model agents start from the combination where every block runs alone (each in its own interval,
    :meth:`MADDPG.start_at`): from TOP's default initialization every block starts in the same interval, a
    superblock, and on three models (35 blocks, H = 4) three steps in four were superblocks from the start.

    One step: the agents act on the state (with exploration noise); a superblock gets reward 0 for every agent and
    keeps the state, the intervals and the combination (Alg. 1 lines 8-9, §V-D); otherwise the engine runs one
    period, the next state is sampled, and eq. (2) gives the rewards from the Z-scored (running statistics over the
    whole training) mean utilization of the period's samples, each model's mean latency of the requests answered in
    the period (when none was: the wait of its oldest queued request, 0 if none) and σ. The transition is stored and
    every agent updated (:class:`MADDPG`). Returns the agents and one record per step (the learning curve).

    The actors returned are those of the step at which the launcher's reward, averaged over the last
    ``keep_window`` steps, was highest once learning had begun (``agents.kept_step``; -1: the last ones): on three
    models the agents later drift into combinations that are all superblocks (reward 0; ``benchmarks/top_serving.py``
    shows the curve), and Alg. 1 says nothing about which actors to deploy."""
    models = list(pattern)
    if set(models) != set(executor.models):
        raise UsageError(f"train: the executor serves {sorted(executor.models)}, the pattern names {sorted(models)}; "
                         "a top policy is trained for exactly the models it serves")
    blocks = {m: len(executor.models[m].blocks) for m in models}
    probe = TopPolicy(period_ms=period_ms)
    probe.bind(blocks, {m: max_batch for m in models}, max_sub_blocks)
    agents = MADDPG(probe.state_dim, probe.action_dims, warmup=warmup, seed=seed)
    total = sum(blocks.values())
    first = 0
    for i, m in enumerate(models):  # the model agents start from "no block combined": block g in interval g
        agents.start_at(i + 1, [(first + b + 0.5) / total for b in range(blocks[m])])
        first += blocks[m]
    util_z, sigma_z, lat_z = ZScore(), ZScore(), {m: ZScore() for m in models}
    rng = random.Random(seed)
    history: list[dict] = []
    best: tuple[float, int, list | None] = (-math.inf, -1, None)
    step = 0
    episode = 0
    while step < steps:
        scale = rng.choice(scales)
        policy = TopPolicy(period_ms=period_ms)
        answers = _Answers()
        engine = Engine(executor, policy, SimClock(), max_queue=max_queue, max_batch=max_batch,
                        max_sub_blocks=max_sub_blocks, observers=[answers])
        period = policy.period_s
        sim = Simulation(engine, arrivals(pattern, episode_steps * period, seed=seed * 7919 + episode, scale=scale))
        state = policy.state()
        for _ in range(min(episode_steps, steps - step)):
            actions = agents.act(state, explore=True)
            record = {"step": step, "episode": episode, "scale": scale}
            if not policy.apply(actions):
                rewards, next_state = [0.0] * (len(models) + 1), state
                record["superblock"] = True
            else:
                sim.advance(engine.clock.now() + period)
                obs = engine.observe()
                done = answers.take()
                util = sum(policy.util_samples) / len(policy.util_samples) if policy.util_samples else 0.0
                sigma = policy.sigma()
                latency = {}
                for m in models:
                    mine = [r.latency_s * 1e3 for r in done if r.model == m]
                    latency[m] = sum(mine) / len(mine) if mine else obs.models[m].oldest_wait_s * 1e3
                util_z.add(util)
                sigma_z.add(sigma)
                for m in models:
                    lat_z[m].add(latency[m])
                rewards = reward(util_z.z(util), [lat_z[m].z(latency[m]) for m in models], sigma_z.z(sigma))
                next_state = policy.state()
                record.update(superblock=False, utilization=round(util, 4), sigma=round(sigma, 3),
                              latency_ms={m: round(v, 3) for m, v in latency.items()},
                              intervals_ms={m: round(v * 1e3, 3) for m, v in policy.intervals.items()},
                              combined_blocks=len(policy.groups))
            agents.store(state, actions, rewards, next_state)
            losses = agents.update()
            record.update(reward=round(rewards[0], 4), rewards=[round(r, 4) for r in rewards], **(losses or {}))
            history.append(record)
            recent = history[-keep_window:]
            mean = sum(r["reward"] for r in recent) / len(recent)
            if agents.updates and len(recent) == keep_window and mean > best[0]:
                best = (mean, step, [copy.deepcopy(a.state_dict()) for a in agents.actors])
            if on_step is not None:
                on_step(step, record)
            state = next_state
            step += 1
        episode += 1
    if best[2] is not None:
        for actor, state in zip(agents.actors, best[2], strict=True):
            actor.load_state_dict(state)
    agents.kept_step = best[1]
    return agents, history


# ---- the policy file ----------------------------------------------------------------------------------------------
def save_agents(agents: MADDPG, path: str | Path, *, blocks: dict[str, int], max_sub_blocks: int,
                meta: dict) -> None:
    """The actors (all serving needs) with the models and H they were trained for."""
    torch.save({"format": FORMAT, "blocks": blocks, "max_sub_blocks": max_sub_blocks,
                "state_dim": agents.state_dim, "action_dims": agents.action_dims,
                "actors": [a.state_dict() for a in agents.actors], "meta": meta}, str(path))


__all__ = ["A_UTIL", "B_LATENCY", "C_SIGMA", "ZScore", "reward", "save_agents", "train"]
