"""TOP's learned serving policy ``top`` (Lin et al., TOP, IEEE TPDS 2024, §V-B, Alg. 1) and the training graphs of
its GPG stage partitioner (§V-C, scheduler ``top-gpg``). Learning lives here, never in the engine: the engine only
calls ``Policy.launch`` and ``Policy.combine``.

* :class:`GpgGraphs`, :func:`gpg_over_dp` — random combined blocks of zoo models for ``opweave train-gpg``;
* :class:`MADDPG` — decentralized actors, centralized critics, replay, soft target updates (eqs. 3-4);
* :func:`reward`, :class:`ZScore` — eq. (2) on Z-scored utilization, latency and queue-length variance;
* :class:`TopPolicy` (registered ``top``) — state, actions, superblocks (H) and the threshold T, as a policy;
* :func:`train` — Alg. 1's offline phase against the simulated executor (``opweave train-policy``);
* :func:`save_agents`, :func:`load_agents` — the policy file (``--policy-file``).

Every choice where the paper is silent is in the docstring of the piece that makes it.
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import replace
from pathlib import Path

from opweave.costs.model import Costs, from_graph
from opweave.errors import UsageError
from opweave.ir.graph import OpGraph
from opweave.ir.synth import random_dag
from opweave.serve.engine import Observer
from opweave.serve.executors import SimExecutor, union_costs, union_graph
from opweave.serve.policies import Launch, Observation, Policy, Slot, register


# ---- GPG training graphs (TOP §V-C: "various block combinations in the model set") ------------------------------
class GpgGraphs:
    """Random combined blocks of the zoo ``models`` (1 to ``max_parts`` distinct ``(model, block)`` sub-blocks,
    each at a random batch of 1-16, side by side as the serving engine combines them, with the simulated
    executor's roofline costs under the ``gpu`` contention model) and, one graph in three, random layered DAGs
    (10-60 ops, 3-12 layers, latencies 0.1-4 ms, utilizations uniform in 0.1-1)."""

    def __init__(self, blocked: dict, *, preset: str = "h100", max_parts: int = 6, seed: int = 0):
        """``blocked``: name -> :class:`~opweave.serve.blocks.BlockedModel` (:func:`opweave.serve.build.gpg_graphs`
        loads zoo models into one)."""
        self.executor = SimExecutor(dict(blocked), preset=preset)
        self.slots = [(n, b) for n, m in blocked.items() for b in range(len(m.blocks))]
        self.max_parts = max_parts
        self.rng = random.Random(seed)

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


def gpg_over_dp(net, valid: list[tuple[OpGraph, Costs, float]]) -> float:
    """Mean over ``valid`` of GPG's greedy makespan over the DP's."""
    import torch

    from opweave.schedulers import ios, top_gpg

    ratios = []
    net.eval()
    with torch.no_grad():
        for g, c, dp_ms in valid:
            index = {o: i for i, o in enumerate(g.ids)}
            g2e = net.embed(*top_gpg.encode_inputs(g, c))
            scale = top_gpg._scale_ms(g, c)
            total = sum(top_gpg.chunk_stages(net, g2e, index, g, c, block, ios.DEFAULT_MAX_GROUP_OPS,
                                             ios.DEFAULT_MAX_GROUPS, scale)[0] for block in ios.blocks(g))
            ratios.append(total / dp_ms if dp_ms > 0 else 1.0)
    return sum(ratios) / len(ratios)


# ---- MADDPG (TOP §V-B, Alg. 1) ------------------------------------------------------------------------------------
A_UTIL, B_LATENCY, C_SIGMA = 0.4, 0.4, 0.2  # eq. (2) weights (§VI-B)
GAMMA, LR, BATCH, REPLAY = 0.95, 1e-3, 100, 2000  # §VI-B
SAMPLES = 10  # n: samples stacked into a state (§VI-B)
MIN_INTERVAL_S = 1e-3  # the launcher action's interval range is [MIN_INTERVAL_S, 1] s


def _actor(state: int, action: int):
    from torch import nn

    return nn.Sequential(nn.Linear(state, 500), nn.ReLU(), nn.Linear(500, 128), nn.ReLU(), nn.Linear(128, action),
                         nn.Sigmoid())


def _critic(inputs: int):
    from torch import nn

    return nn.Sequential(nn.Linear(inputs, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 300),
                         nn.ReLU(), nn.Linear(300, 1))


class MADDPG:
    """Multi-agent DDPG (Lowe et al. 2017; TOP §V-B eqs. 3-4): decentralized actors ρ^i(s) → a^i ∈ [0, 1]^{d_i}
    (TOP's policy network, 2 ReLU layers of 500 and 128 units, a sigmoid out), centralized critics Q^i(s, a^0..a^W)
    (TOP's value network, 3 ReLU layers of 1024, 512 and 300 units), target copies of both moved by soft updates
    (``tau``), a replay buffer of ``replay`` transitions (oldest dropped) sampled in batches of ``batch``, discount
    γ, Adam with learning rate η. All agents see the same state (TOP stacks one global state for every agent).

    Choices: updates start once ``warmup`` transitions are stored (Alg. 1 waits for ``replay_size`` = 2000; that
    alone is most of a 10-minute budget on 2 cores, so the default starts at one batch) and run once per stored
    transition; exploration adds Gaussian noise of standard deviation ``noise`` to every action (clipped to [0, 1]);
    ``tau`` = 0.01 (TOP gives none); the actor loss adds ``saturation`` × the mean square of how far the actor's
    output before its sigmoid lies beyond ±4: without it the model agents drove their outputs into the sigmoid's
    flat ends, where every block lands in one interval (a superblock, reward 0) and no gradient leads back (seen
    after 160 steps on SqueezeNet). (A plain square, tried first, pulls every output to 0.5, i.e. every block into
    one interval: on three models it ended in superblocks only.) :meth:`start_at` sets where the actors begin."""

    def __init__(self, state_dim: int, action_dims: list[int], *, gamma: float = GAMMA, lr: float = LR,
                 batch: int = BATCH, replay: int = REPLAY, warmup: int | None = None, tau: float = 0.01,
                 noise: float = 0.1, saturation: float = 1e-2, seed: int = 0):
        import copy

        import numpy as np
        import torch

        self.state_dim, self.action_dims = state_dim, list(action_dims)
        self.gamma, self.batch, self.replay, self.tau, self.noise = gamma, batch, replay, tau, noise
        self.saturation = saturation
        self.warmup = batch if warmup is None else warmup
        torch.manual_seed(seed)
        self.rng = np.random.default_rng(seed)
        total = state_dim + sum(action_dims)
        self.actors = [_actor(state_dim, d) for d in action_dims]
        self.critics = [_critic(total) for _ in action_dims]
        self.target_actors = [copy.deepcopy(a) for a in self.actors]
        self.target_critics = [copy.deepcopy(c) for c in self.critics]
        self.actor_opt = [torch.optim.Adam(a.parameters(), lr=lr) for a in self.actors]
        self.critic_opt = [torch.optim.Adam(c.parameters(), lr=lr) for c in self.critics]
        self.buffer: list[tuple] = []
        self.pos = 0
        self.updates = 0

    def start_at(self, agent: int, values) -> None:
        """Make actor ``agent`` (and its target) start near the action ``values`` in every state: its last layer's
        bias becomes their logit and its weights are scaled by 0.1."""
        import torch

        target = torch.as_tensor(values, dtype=torch.float32).clamp(1e-3, 1 - 1e-3)
        for net in (self.actors[agent], self.target_actors[agent]):
            last = net[-2]
            with torch.no_grad():
                last.weight.mul_(0.1)
                last.bias.copy_(torch.log(target / (1 - target)))

    def act(self, state, explore: bool = False) -> list:
        """Every agent's action for ``state`` (numpy arrays in [0, 1]); with ``explore``, plus noise."""
        import numpy as np
        import torch

        with torch.no_grad():
            s = torch.as_tensor(np.asarray(state, dtype=np.float32)).unsqueeze(0)
            out = [a(s)[0].numpy().astype(np.float64) for a in self.actors]
        if explore:
            out = [np.clip(a + self.rng.normal(0, self.noise, a.shape), 0.0, 1.0) for a in out]
        return out

    def store(self, state, actions: list, rewards: list[float], next_state) -> None:
        import numpy as np

        item = (np.asarray(state, np.float32), np.concatenate(actions).astype(np.float32),
                np.asarray(rewards, np.float32), np.asarray(next_state, np.float32))
        if len(self.buffer) < self.replay:
            self.buffer.append(item)
        else:
            self.buffer[self.pos] = item
        self.pos = (self.pos + 1) % self.replay

    def update(self) -> dict | None:
        """One MADDPG update of every agent from a sampled batch (eqs. 3-4) and the soft target updates; None until
        ``warmup`` transitions are stored. Returns the mean critic and actor losses."""
        import numpy as np
        import torch

        if len(self.buffer) < max(self.warmup, 1):
            return None
        idx = self.rng.integers(0, len(self.buffer), min(self.batch, len(self.buffer)))
        s, a, r, s2 = (torch.as_tensor(np.stack([self.buffer[i][k] for i in idx])) for k in range(4))
        with torch.no_grad():
            a2 = torch.cat([t(s2) for t in self.target_actors], 1)
        cuts = np.cumsum([0] + self.action_dims)
        critic_loss = actor_loss = 0.0
        for i, (actor, critic) in enumerate(zip(self.actors, self.critics, strict=True)):
            with torch.no_grad():
                y = r[:, i:i + 1] + self.gamma * self.target_critics[i](torch.cat([s2, a2], 1))
            q = critic(torch.cat([s, a], 1))
            loss = torch.nn.functional.mse_loss(q, y)
            self.critic_opt[i].zero_grad()
            loss.backward()
            self.critic_opt[i].step()
            critic_loss += float(loss.detach())
            pre = actor[:-1](s)  # before the sigmoid
            mine = torch.cat([a[:, :cuts[i]], torch.sigmoid(pre), a[:, cuts[i + 1]:]], 1)
            loss = -critic(torch.cat([s, mine], 1)).mean() + self.saturation * (torch.relu(pre.abs() - 4) ** 2).mean()
            self.actor_opt[i].zero_grad()
            loss.backward()
            self.actor_opt[i].step()
            actor_loss += float(loss.detach())
        with torch.no_grad():
            for net, target in [*zip(self.actors, self.target_actors, strict=True),
                                *zip(self.critics, self.target_critics, strict=True)]:
                for p, tp in zip(net.parameters(), target.parameters(), strict=True):
                    tp.mul_(1 - self.tau).add_(p, alpha=self.tau)
        self.updates += 1
        return {"critic_loss": critic_loss / len(self.actors), "actor_loss": actor_loss / len(self.actors)}


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
    import math

    mean_lat = sum(latency_z) / len(latency_z)
    return ([math.exp(A_UTIL * util_z - B_LATENCY * mean_lat - C_SIGMA * sigma_z)]
            + [math.exp(A_UTIL * util_z - B_LATENCY * lz - C_SIGMA * sigma_z) for lz in latency_z])


# ---- the serving policy -------------------------------------------------------------------------------------------
@register("top")
class TopPolicy(Policy):
    """TOP's agents as a serving policy (§V-B): the launcher agent sets each model's launch interval, the model
    agents the block combination; online, the actors are asked again only when the queue-length variance σ passes
    ``threshold`` (Alg. 1 lines 26-41). ``policy_file``: what :func:`train` saved (without one the policy needs
    :meth:`apply` from a trainer).

    **State (§V-B "S").** Every ``period_ms`` / n of virtual or real time the policy samples each model's
    inference progress (instances at each block) and the deviation of its queue length from the models' mean
    (divided by 8); the last n = 10 samples stacked are the state, n × (W + Σ B_i) numbers (missing samples are
    zeros). **σ** is the variance of the queue lengths pooled over the n samples and the W models (with one model,
    the variance of its queue over time: TOP's σ across queues would always be 0).

    **Actions (§V-B "A").** Launcher: a⁰ ∈ [0, 1]^W, model m's interval 10^{-3(1 − a)} s, i.e. (0, 1] s as TOP
    says, mapped log-uniformly onto [1 ms, 1 s] (a linear map spends almost the whole range on intervals far longer
    than the models' service times); each dequeue stacks everything queued up to the max batch, no cap on instances.
    Model agents: a^i ∈ [0, 1]^{B_i}; [0, 1] is cut into Σ B_i equal intervals (TOP: "according to the total number
    of blocks"); the blocks of every model whose values fall in one interval form one combined block. A combined
    block of more than H sub-blocks is a *superblock* (§V-D): the combination is refused, the previous one kept.
    The engine runs the combined block with the highest effective input ratio (§VI-A).

    ``threshold`` (T): TOP's 2×10⁵ is in units we do not know; ours is in requests², default 1.0.
    """

    name = "top"

    def __init__(self, policy_file: str | None = None, threshold: float = 1.0, period_ms: float = 50.0):
        self.policy_file, self.threshold, self.period_s = policy_file, float(threshold), period_ms / 1e3
        self.agents: MADDPG | None = None
        self.samples: list[list[float]] = []
        self.queue_samples: list[list[int]] = []
        self.util_samples: list[float] = []
        self.next_sample = -math.inf
        self.last_check = -math.inf
        self.intervals: dict[str, float] = {}
        self.groups: list[tuple[Slot, ...]] = []
        self.decisions = self.superblocks = 0

    def bind(self, blocks: dict[str, int], max_batch: dict[str, int], max_sub_blocks: int) -> None:
        super().bind(blocks, max_batch, max_sub_blocks)
        self.models = list(blocks)
        self.width = len(self.models) + sum(blocks.values())
        self.state_dim = SAMPLES * self.width
        self.action_dims = [len(self.models)] + [blocks[m] for m in self.models]
        self.intervals = {m: MIN_INTERVAL_S for m in self.models}
        self.groups = [((m, b),) for m in self.models for b in range(blocks[m])]
        if self.policy_file is not None and self.agents is None:
            self.agents = load_agents(self.policy_file, blocks, max_sub_blocks)

    # what the agents see ---------------------------------------------------------------------------------------
    def sample(self, obs: Observation) -> None:
        """Record one state sample (at most every ``period_s`` / n)."""
        if obs.now < self.next_sample:
            return
        self.next_sample = obs.now + self.period_s / SAMPLES
        queues = [obs.models[m].queue for m in self.models]
        mean = sum(queues) / len(queues)
        row = [(q - mean) / 8 for q in queues]
        for m in self.models:
            row += list(obs.models[m].progress)
        self.samples = (self.samples + [row])[-SAMPLES:]
        self.queue_samples = (self.queue_samples + [queues])[-SAMPLES:]
        self.util_samples = (self.util_samples + [obs.utilization])[-SAMPLES:]

    def state(self) -> list[float]:
        rows = [[0.0] * self.width] * (SAMPLES - len(self.samples)) + self.samples
        return [x for r in rows for x in r]

    def sigma(self) -> float:
        values = [q for row in self.queue_samples for q in row]
        if len(values) < 2:
            return 0.0
        mean = sum(values) / len(values)
        return sum((v - mean) ** 2 for v in values) / len(values)

    # what the agents decide ------------------------------------------------------------------------------------
    def combination(self, actions: list) -> list[tuple[Slot, ...]]:
        """The combined blocks of the model agents' actions (class docstring), in interval order."""
        k = sum(self.action_dims[1:])
        bins: dict[int, list[Slot]] = {}
        for m, acts in zip(self.models, actions[1:], strict=True):
            for b, a in enumerate(acts):
                bins.setdefault(min(k - 1, int(float(a) * k)), []).append((m, b))
        return [tuple(bins[i]) for i in sorted(bins)]

    def apply(self, actions: list) -> bool:
        """Adopt the agents' actions; False (and the previous combination kept) if one is a superblock. The launch
        intervals are adopted either way (Alg. 1 keeps the previous frequency too: see :func:`train`)."""
        groups = self.combination(actions)
        if max(len(g) for g in groups) > self.max_sub_blocks:
            self.superblocks += 1
            return False
        self.decisions += 1
        self.intervals = {m: MIN_INTERVAL_S ** (1 - float(a)) for m, a in zip(self.models, actions[0], strict=True)}
        self.groups = groups
        return True

    def launch(self, obs: Observation) -> dict[str, Launch]:
        self.sample(obs)
        if self.agents is not None and obs.now - self.last_check >= self.period_s:
            first = self.last_check == -math.inf
            self.last_check = obs.now
            if first or self.sigma() > self.threshold:
                self.apply(self.agents.act(self.state()))
        return {m: Launch(interval_s=self.intervals[m], batch=obs.models[m].max_batch) for m in self.models}

    def combine(self, obs: Observation) -> list[tuple[Slot, ...]]:
        return list(self.groups)

    def describe(self) -> dict:
        return {"policy": self.name, "policy_file": self.policy_file, "threshold": self.threshold,
                "period_ms": self.period_s * 1e3, "decisions": self.decisions, "superblocks": self.superblocks}


# ---- saving and loading -------------------------------------------------------------------------------------------
FORMAT = "opweave.top-policy/1"


def save_agents(agents: MADDPG, path: str | Path, *, blocks: dict[str, int], max_sub_blocks: int,
                meta: dict) -> None:
    """The actors (all serving needs) with the models and H they were trained for."""
    import torch

    torch.save({"format": FORMAT, "blocks": blocks, "max_sub_blocks": max_sub_blocks,
                "state_dim": agents.state_dim, "action_dims": agents.action_dims,
                "actors": [a.state_dict() for a in agents.actors], "meta": meta}, str(path))


def load_agents(path: str | Path, blocks: dict[str, int], max_sub_blocks: int) -> MADDPG:
    """Actors saved by :func:`save_agents`; refused unless they were trained for these models, blocks and H."""
    import torch

    if not Path(path).is_file():
        raise UsageError(f"--policy-file {path}: no such file")
    data = torch.load(str(path), map_location="cpu", weights_only=True)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UsageError(f"--policy-file {path}: not an {FORMAT} file")
    if data["blocks"] != dict(blocks) or data["max_sub_blocks"] != max_sub_blocks:
        raise UsageError(f"--policy-file {path} was trained for {data['blocks']} with H={data['max_sub_blocks']}, "
                         f"not {dict(blocks)} with H={max_sub_blocks}")
    agents = MADDPG(data["state_dim"], data["action_dims"], replay=1)
    for actor, state in zip(agents.actors, data["actors"], strict=True):
        actor.load_state_dict(state)
    return agents


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
    from opweave.serve.engine import Engine, Simulation
    from opweave.serve.executors import SimClock
    from opweave.serve.loadgen import arrivals

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
