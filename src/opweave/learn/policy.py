"""TOP's Alg. 1, offline phase (Lin et al., TOP, IEEE TPDS 2024, §V-B): the MADDPG agents of serving policy
``top`` (:class:`opweave.serve.engine.top.TopPolicy`) trained against the simulated engine (``opweave train-policy``).

* :func:`reward`, :class:`ZScore` — eq. (2) on Z-scored utilization, latency and queue-length variance;
* :class:`HeldOut`, :func:`evaluate` — the fixed held-out loads on which the actors kept are chosen, and the score:
  the highest load scale the greedy actors sustain there (the benchmarks' sustainable-rate rule);
* :func:`train` — the training loop (:class:`~opweave.learn.maddpg.MADDPG` agents, one decision per period), with a
  held-out evaluation every so many steps; :class:`Trained` what it returns;
* :func:`save_agents` — the policy file that :func:`opweave.serve.engine.top.load_agents` reads (``--policy-file``, or
  shipped in ``serve/data/``).
"""

from __future__ import annotations

import copy
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from opweave.errors import UsageError
from opweave.learn.maddpg import ACTOR_LR, MADDPG, REPLAY_SIZE
from opweave.serve.engine.engine import Engine
from opweave.serve.engine.requests import Observer
from opweave.serve.engine.simulation import SimClock, SimExecutor, Simulation
from opweave.serve.engine.top import FORMAT, Actors, TopPolicy
from opweave.serve.loadgen import arrivals, run_simulated

A_UTIL, B_LATENCY, C_SIGMA = 0.4, 0.4, 0.2  # eq. (2) weights (§VI-B)
STEPS = 8000  # TOP's MADDPG "can converge within 8000 steps" (§VI-F, Fig. 22)
SCALES = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
GRID = 8  # held-out scales are 2^(k / GRID): steps of 9 %
MODEL_ACTOR_LR = 1e-5  # the model agents' actor learning rate (the launcher's: maddpg.ACTOR_LR); see train
REJECTED_MS = 1000.0  # a request refused by a full queue counts in eq. (2)'s mean latency as this late


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


# ---- the held-out evaluation ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HeldOut:
    """The fixed held-out loads the actors are scored on: the pattern's Poisson arrivals from ``seeds`` (never a
    training episode's: those are ``seed * 7919 + episode``) at the scales 2^(k/8) up to ``max_scale``, each run
    ``duration_s`` of virtual time (longer where needed to send ``min_requests``) and then drained."""

    seeds: tuple[int, ...] = (101, 102)
    duration_s: float = 0.5
    min_requests: int = 200
    slo_ms: float = 100.0
    max_scale: float = 128.0


def evaluate(actors: Actors, executor: SimExecutor, pattern: dict[str, float], held_out: HeldOut = HeldOut(), *,
             period_ms: float = 50.0, max_queue: int = 64, max_batch: int = 16, max_sub_blocks: int = 4) -> dict:
    """The highest scale of ``pattern`` at which ``actors``, deciding greedily every period as
    :class:`~opweave.serve.engine.top.TopPolicy` runs them when served (T = 0), keep the 99th percentile of every sent
    request under ``held_out.slo_ms`` (rejections infinitely late) on every held-out trace: the sustainable-rate
    rule of ``benchmarks/serving.py`` on a fixed grid (doubling from scale 1, then bisecting to one grid step).
    Returns ``{"scale", "p99_ms"}`` (the worst p99 over the seeds at that scale; scale 0 if not even the lowest
    holds) and ``probes``, ``[scale, worst p99 or None]`` in the order run."""
    total = sum(pattern.values())
    seen: dict[int, float | None] = {}
    probes: list[list] = []

    def worst_p99(k: int) -> float | None:
        if k not in seen:
            scale, worst = 2 ** (k / GRID), 0.0
            held: float | None = 0.0
            for seed in held_out.seeds:
                engine = Engine(executor, TopPolicy(agents=actors, period_ms=period_ms, shipped=False), SimClock(),
                                max_queue=max_queue, max_batch=max_batch, max_sub_blocks=max_sub_blocks)
                duration = max(held_out.duration_s, held_out.min_requests / (scale * total))
                rep, _ = run_simulated(engine, pattern, duration, seed=seed, scale=scale)
                p99 = rep["total"]["p99_all_ms"]
                if not (rep["total"]["sent"] and p99 < held_out.slo_ms):
                    held = None
                    break
                worst = max(worst, p99)
            seen[k] = worst if held is not None else None
            probes.append([round(scale, 4), None if worst is None else round(worst, 3)])
        return seen[k]

    k_max, k_min = math.floor(GRID * math.log2(held_out.max_scale)), -3 * GRID
    lo = hi = None
    k = 0
    while True:
        if worst_p99(k) is not None:
            lo = k
            if hi is not None or k >= k_max:
                break
            k = min(k + GRID, k_max)
        else:
            hi = k
            if lo is not None or k <= k_min:
                break
            k = max(k - GRID, k_min)
    if lo is None:
        return {"scale": 0.0, "p99_ms": None, "probes": probes}
    while hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        if worst_p99(mid) is not None:
            lo = mid
        else:
            hi = mid
    kept = seen[lo]
    assert kept is not None  # lo held the SLO
    return {"scale": round(2 ** (lo / GRID), 4), "p99_ms": round(kept, 3), "probes": probes}


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


@dataclass
class Trained:
    """What :func:`train` returns: the agents with the kept actors loaded, one record per step (the learning
    curve), the held-out evaluations (``step``, ``scale``, ``p99_ms``, ``probes``, ``seconds``; step 0 is the
    untrained start) and which one was kept."""

    agents: MADDPG
    curve: list[dict]
    evals: list[dict] = field(default_factory=list)
    kept_step: int = 0
    kept_scale: float = 0.0
    kept_actors: list[dict] = field(default_factory=list)  # the kept evaluation's actors' weights, while training

    def summary(self, every: int = 50) -> dict:
        """A compact record for the policy file's ``meta``: the counts, the kept evaluation, every evaluation
        (without probes) and the curve as means over ``every`` steps (``[step, launcher reward, superblock
        share]``)."""
        curve = []
        for i in range(0, len(self.curve), every):
            part = self.curve[i:i + every]
            curve.append([part[-1]["step"], round(sum(r["reward"] for r in part) / len(part), 4),
                          round(sum(r["superblock"] for r in part) / len(part), 3)])
        return {"steps": len(self.curve), "updates": self.agents.updates, "kept_step": self.kept_step,
                "kept_scale": self.kept_scale, "start_scale": self.evals[0]["scale"] if self.evals else None,
                "evals": [[e["step"], e["scale"], e["p99_ms"]] for e in self.evals], "curve_every": every,
                "curve": curve}


def train(executor: SimExecutor, pattern: dict[str, float], *, steps: int = STEPS, period_ms: float = 50.0,
          episode_steps: int = 40, scales: tuple[float, ...] = SCALES, max_queue: int = 64, max_batch: int = 16,
          max_sub_blocks: int = 4, warmup: int = REPLAY_SIZE, eval_every: int = 100, held_out: HeldOut = HeldOut(),
          superblock_final: bool = True, seed: int = 0, on_step=None, on_eval=None) -> Trained:
    """Alg. 1's offline phase against the simulated executor: ``steps`` decisions of ``period_ms`` of virtual time
    each, in episodes of ``episode_steps`` (each a fresh engine with empty queues and Poisson arrivals of
    ``pattern`` at a scale drawn from ``scales``, so the agents see light and heavy load).

    The model agents start from :meth:`TopPolicy.start_actions` (a valid strided combination, its groups' intervals
    spread out; :meth:`MADDPG.start_at`), the launcher from TOP's default initialization (about a = 0.5, 10 ms).
    The model agents' actors learn at ``MODEL_ACTOR_LR`` = 10⁻⁵, a tenth of the launcher's: their actions reach the
    reward only through which of Σ B_i intervals each value falls in, so what the critics tell them is mostly the
    smoothing of a step function, and at 10⁻⁴ they moved the start to worse combinations while the launcher was
    learning (Inception-v3, 600 steps: the kept actors sustained 11.3 in the benchmark's search, the start
    combination at the same launch intervals 12.3; at 10⁻⁵, 12.3).

    One step: the agents act on the state (with exploration noise: standard deviation 0.1 for the launcher, one
    interval, 1/Σ B_i, for the model agents); a superblock gets reward 0 for every agent and keeps the state, the
    intervals and the combination (Alg. 1 lines 8-9, §V-D), and is stored as a final transition (``superblock_final``:
    no bootstrapped value after it; with γ = 0.95, a 0 followed by the same state costs about one step's reward in
    twenty, which the critics could not tell from noise); otherwise the engine runs one period, the next state is
    sampled, and eq. (2) gives the rewards from the Z-scored mean utilization of the period's samples, each model's
    mean latency of the requests answered in the period, those its full queue refused in the period counted as
    answered after ``REJECTED_MS`` = 1 s (when there were neither: the wait of its oldest queued request, 0 if
    none), and σ. (TOP's queues are unbounded, so a task it cannot serve waits and its wait counts; ours hold 64,
    and with the refused left out, shedding load would make the few answered fast.) The transition is stored and,
    once ``warmup`` transitions are (Alg. 1's ``replay_size``, 2000), every agent updated (:class:`MADDPG`) once
    per step.

    **Z-scores.** Against running statistics *of the episode's load scale* (one set per scale): against pooled
    statistics a step's reward said mostly which scale its episode had drawn (light load: short latencies, high
    reward, whatever the actions). After every episode every stored transition's reward is recomputed from what
    it was computed from with the statistics of now (:meth:`MADDPG.relabel`): as the actors improve, the running
    means follow them, and a transition rewarded against old statistics scored a 10 ms launch interval of the
    start as well as a 0.1 ms one of now; the critics lost the difference and, in a seeded ResNet-50 run, the
    launcher drifted back from the shortest intervals to the longest; relabelled, it kept them short
    (docs/serving.md, ``top``).

    **The actors kept.** Alg. 1 does not say which actors to deploy, and the in-training reward cannot say it (it
    is Z-scored, noisy, and taken with exploration noise). Before the first step and every ``eval_every`` steps
    once updates have begun (and after the last), :func:`evaluate` scores the current actors, greedy, on
    ``held_out``: fixed traces at fixed scales, the highest scale they sustain. The actors of the best score are
    kept (ties: the lower p99 there, then the earlier): the untrained start if no update improved on it.
    ``on_step(step, record)`` and ``on_eval(record)`` report progress."""
    models = list(pattern)
    if set(models) != set(executor.models):
        raise UsageError(f"train: the executor serves {sorted(executor.models)}, the pattern names {sorted(models)}; "
                         "a top policy is trained for exactly the models it serves")
    blocks = {m: len(executor.models[m].blocks) for m in models}
    probe = TopPolicy(period_ms=period_ms, shipped=False)
    probe.bind(blocks, {m: max_batch for m in models}, max_sub_blocks)
    k = sum(blocks.values())
    agents = MADDPG(probe.state_dim, probe.action_dims, warmup=warmup, noise=[0.1] + [1 / k] * len(models),
                    actor_lr=[ACTOR_LR] + [MODEL_ACTOR_LR] * len(models), max_group=max_sub_blocks, seed=seed)
    for i, values in enumerate(probe.start_actions()):
        agents.start_at(i + 1, values)
    trained = Trained(agents, [])
    best: tuple = (-math.inf, -math.inf)

    def held_out_eval(step: int) -> None:
        nonlocal best
        start = time.perf_counter()
        result = evaluate(agents, executor, pattern, held_out, period_ms=period_ms, max_queue=max_queue,
                          max_batch=max_batch, max_sub_blocks=max_sub_blocks)
        record = {"step": step, **result, "seconds": round(time.perf_counter() - start, 1)}
        trained.evals.append(record)
        score = (result["scale"], -(result["p99_ms"] or 0.0))
        if score > best:
            best = score
            trained.kept_step, trained.kept_scale = step, result["scale"]
            trained.kept_actors = [copy.deepcopy(a.state_dict()) for a in agents.actors]
        if on_eval is not None:
            on_eval(record)

    held_out_eval(0)
    stats: dict[float, tuple[ZScore, ZScore, dict[str, ZScore]]] = {}
    raw: dict[int, tuple | None] = {}  # buffer index: what its reward was computed from (None: a superblock)

    def relabelled(item: tuple | None) -> list[float]:
        if item is None:
            return [0.0] * (len(models) + 1)
        scale, util, latency, sigma = item
        u, g, lat = stats[scale]
        return reward(u.z(util), [lat[m].z(v) for m, v in zip(models, latency, strict=True)], g.z(sigma))

    rng = random.Random(seed)
    step = episode = 0
    while step < steps:
        scale = rng.choice(scales)
        util_z, sigma_z, lat_z = stats.setdefault(scale, (ZScore(), ZScore(), {m: ZScore() for m in models}))
        policy = TopPolicy(period_ms=period_ms, shipped=False)
        answers = _Answers()
        engine = Engine(executor, policy, SimClock(), max_queue=max_queue, max_batch=max_batch,
                        max_sub_blocks=max_sub_blocks, observers=[answers])
        period = policy.period_s
        sim = Simulation(engine, arrivals(pattern, episode_steps * period, seed=seed * 7919 + episode, scale=scale))
        state = policy.state()
        rejected = 0
        for _ in range(min(episode_steps, steps - step)):
            actions = agents.act(state, explore=True)
            record: dict[str, Any] = {"step": step, "episode": episode, "scale": scale,
                      "largest": max(len(g) for g in policy.combination(actions))}
            if not policy.apply(actions):
                rewards, next_state = [0.0] * (len(models) + 1), state
                record["superblock"] = True
            else:
                sim.advance(engine.clock.now() + period)
                obs = engine.observe()
                done = answers.take()
                util = sum(policy.util_samples) / len(policy.util_samples) if policy.util_samples else 0.0
                sigma = policy.sigma()
                shed, rejected = sim.rejected[rejected:], len(sim.rejected)
                latency = {}
                for m in models:
                    mine = [r.latency_s * 1e3 for r in done if r.model == m]
                    mine += [REJECTED_MS] * sum(a.model == m for a in shed)
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
            index = agents.store(state, actions, rewards, next_state, final=record["superblock"] and superblock_final)
            raw[index] = None if record["superblock"] else (scale, util, [latency[m] for m in models], sigma)
            losses = agents.update()
            record.update(reward=round(rewards[0], 4), rewards=[round(r, 4) for r in rewards], **(losses or {}))
            trained.curve.append(record)
            if on_step is not None:
                on_step(step, record)
            state = next_state
            step += 1
            if agents.updates and (step % eval_every == 0 or step == steps):
                held_out_eval(step)
        episode += 1
        agents.relabel(lambda i: relabelled(raw[i]))
    for actor, kept in zip(agents.actors, trained.kept_actors, strict=True):
        actor.load_state_dict(kept)
    trained.kept_actors = []  # loaded: the copies go
    return trained


# ---- the policy file ----------------------------------------------------------------------------------------------
def save_agents(agents: Actors, path: str | Path, *, blocks: dict[str, int], max_sub_blocks: int,
                meta: dict) -> None:
    """The actors (all serving needs; weights in half precision, :func:`~opweave.serve.engine.top.load_agents` makes
    them float again) with the models and H they were trained for and ``meta`` (how they were trained)."""
    torch.save({"format": FORMAT, "blocks": blocks, "max_sub_blocks": max_sub_blocks,
                "state_dim": agents.state_dim, "action_dims": agents.action_dims,
                "actors": [{k: v.half() for k, v in a.state_dict().items()} for a in agents.actors], "meta": meta},
               str(path))


__all__ = ["A_UTIL", "B_LATENCY", "C_SIGMA", "GRID", "MODEL_ACTOR_LR", "REJECTED_MS", "SCALES", "STEPS", "HeldOut",
           "Trained", "ZScore", "evaluate", "reward", "save_agents", "train"]
