"""TOP's learned serving policy ``top`` (Lin et al., TOP, IEEE TPDS 2024, §V-B, Alg. 1), as it runs online: the
engine only calls ``Policy.launch`` and ``Policy.combine``.

* :class:`TopPolicy` (registered ``top``) — state, actions, superblocks (H) and the threshold T, as a policy;
* :class:`Actors`, :func:`actor_net` — the agents' actors, what serving runs of them;
* :func:`load_agents` — the policy file (``--policy-file``).

Training (MADDPG, the reward, Alg. 1's offline phase, saving the policy file) is :mod:`opweave.learn.policy`,
which this module never imports. Every choice where the paper is silent is in the docstring of the piece that makes it.
"""

from __future__ import annotations

import math
from pathlib import Path

from opweave.errors import UsageError
from opweave.serve.policies import Launch, Observation, Policy, Slot, register

SAMPLES = 10  # n: samples stacked into a state (§VI-B)
MIN_INTERVAL_S = 1e-3  # the launcher action's interval range is [MIN_INTERVAL_S, 1] s
FORMAT = "opweave.top-policy/1"


# ---- the actors ---------------------------------------------------------------------------------------------------
def actor_net(state: int, action: int):
    """TOP's policy network (§VI-B): 2 ReLU layers of 500 and 128 units, a sigmoid out."""
    from torch import nn

    return nn.Sequential(nn.Linear(state, 500), nn.ReLU(), nn.Linear(500, 128), nn.ReLU(), nn.Linear(128, action),
                         nn.Sigmoid())


class Actors:
    """The decentralized actors ρ^i(s) → a^i ∈ [0, 1]^{d_i} of TOP's agents (:func:`actor_net` each; agent 0 the
    launcher, then one per model), all seeing the same state: what a trained ``top`` policy runs.
    :class:`opweave.learn.maddpg.MADDPG` trains them."""

    def __init__(self, state_dim: int, action_dims: list[int]):
        self.state_dim, self.action_dims = state_dim, list(action_dims)
        self.actors = [actor_net(state_dim, d) for d in action_dims]

    def act(self, state) -> list:
        """Every agent's action for ``state`` (numpy arrays in [0, 1])."""
        import numpy as np
        import torch

        with torch.no_grad():
            s = torch.as_tensor(np.asarray(state, dtype=np.float32)).unsqueeze(0)
            return [a(s)[0].numpy().astype(np.float64) for a in self.actors]


# ---- the serving policy -------------------------------------------------------------------------------------------
@register("top")
class TopPolicy(Policy):
    """TOP's agents as a serving policy (§V-B): the launcher agent sets each model's launch interval, the model
    agents the block combination; online, the actors are asked again only when the queue-length variance σ passes
    ``threshold`` (Alg. 1 lines 26-41). ``policy_file``: what :func:`opweave.learn.policy.save_agents` wrote (without
    one the policy needs :meth:`apply` from a trainer).

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
        self.agents: Actors | None = None
        self.samples: list[list[float]] = []
        self.queue_samples: list[list[int]] = []
        self.util_samples: list[float] = []
        self.next_sample = -math.inf
        self.last_check = -math.inf
        self.intervals: dict[str, float] = {}
        self.groups: list[tuple[Slot, ...]] = []
        self.decisions = self.superblocks = 0

    def bind(self, blocks: dict[str, int], max_batch: dict[str, int], max_sub_blocks: int) -> None:
        bound = getattr(self, "model_blocks", None)
        if self.agents is not None and bound is not None and dict(blocks) != bound:  # a model loaded or unloaded
            raise UsageError(f"the top policy's agents serve {bound} and no other set of models")
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
        intervals are adopted either way (Alg. 1 keeps the previous frequency too: see
        :func:`opweave.learn.policy.train`)."""
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


# ---- the policy file ----------------------------------------------------------------------------------------------
def load_agents(path: str | Path, blocks: dict[str, int], max_sub_blocks: int) -> Actors:
    """Actors saved by :func:`opweave.learn.policy.save_agents`; refused unless they were trained for these models,
    blocks and H."""
    import torch

    if not Path(path).is_file():
        raise UsageError(f"--policy-file {path}: no such file")
    data = torch.load(str(path), map_location="cpu", weights_only=True)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UsageError(f"--policy-file {path}: not an {FORMAT} file")
    if data["blocks"] != dict(blocks) or data["max_sub_blocks"] != max_sub_blocks:
        raise UsageError(f"--policy-file {path} was trained for {data['blocks']} with H={data['max_sub_blocks']}, "
                         f"not {dict(blocks)} with H={max_sub_blocks}")
    agents = Actors(data["state_dim"], data["action_dims"])
    for actor, state in zip(agents.actors, data["actors"], strict=True):
        actor.load_state_dict(state)
    return agents
