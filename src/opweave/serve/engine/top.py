"""TOP's learned serving policy ``top`` (Lin et al., TOP, IEEE TPDS 2024, §V-B, Alg. 1), as it runs online: the
engine only calls ``Policy.launch`` and ``Policy.combine``.

* :class:`TopPolicy` (the policy ``top``) — state, actions, superblocks (H) and the threshold T, as a policy;
* :class:`Actors`, :func:`actor_net` — the agents' actors, what serving runs of them;
* :func:`load_agents` — a policy file (``--policy-file``); :func:`shipped_file` — the one shipped with the package
  for a set of models (``serve/data/``), what ``--policy top`` loads without ``--policy-file``.

Training (MADDPG, the reward, Alg. 1's offline phase, the held-out evaluation that picks the actors kept, saving
the policy file) is :mod:`opweave.learn.policy`, which this module never imports. Every choice where the paper is
silent is in the docstring of the piece that makes it.
"""

from __future__ import annotations

import math
from pathlib import Path

from opweave.errors import UsageError
from opweave.serve.engine.policy import Launch, Observation, Policy, Slot

SAMPLES = 10  # n: samples stacked into a state (§VI-B)
MIN_INTERVAL_S = 1e-4  # the launcher action's interval range is [MIN_INTERVAL_S, 1] s, log-uniform
START_LAUNCH = 0.5  # the launcher action in force before the agents' first decision: a 10 ms interval
FORMAT = "opweave.top-policy/1"
DATA_DIR = Path(__file__).resolve().parents[1] / "data"  # the serve package's data


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
        """Every agent's action for ``state`` (numpy arrays in [0, 1]), greedy (no exploration)."""
        import numpy as np
        import torch

        with torch.no_grad():
            s = torch.as_tensor(np.asarray(state, dtype=np.float32)).unsqueeze(0)
            return [a(s)[0].numpy().astype(np.float64) for a in self.actors]


# ---- the serving policy -------------------------------------------------------------------------------------------
class TopPolicy(Policy):
    """TOP's agents as a serving policy (§V-B): the launcher agent sets each model's launch interval, the model
    agents the block combination. The actors: ``agents`` given in memory (the trainer's held-out evaluation), else
    ``policy_file`` (what :func:`opweave.learn.policy.save_agents` wrote), else the file shipped for the served
    models (:func:`shipped_file`); with ``shipped`` false and neither given, none: the policy runs its start until a
    trainer calls :meth:`apply`.

    **State (§V-B "S").** Every ``period_ms`` / n of virtual or real time the policy samples each model's queue
    length in batches (requests waiting / its max batch) and its inference progress (ln(1 + instances) at each
    block); the last n = 10 samples stacked are the state, n × (W + Σ B_i) numbers (missing samples are zeros). TOP
    samples each queue's *deviation* from the models' mean instead, which is 0 with one model: three of TOP's four
    patterns are single-model, and their agents decided on a state whose queue part was always zero. The lengths
    carry the deviations (their differences) and the load. The logarithm: nothing caps the instances in flight (the
    launcher sets a frequency only), and past the device's capacity they pile up at a block by the hundreds
    (docs/serving.md, ``top``), inputs that saturated the actors. **σ** is the variance of the queue lengths pooled
    over the n samples and the W models (with one model, the variance of its queue over time: TOP's σ across queues
    would always be 0).

    **Actions (§V-B "A").** Launcher: a⁰ ∈ [0, 1]^W, model m's interval 10^{-4(1 − a)} s, i.e. (0, 1] s as TOP
    says, mapped log-uniformly onto [0.1 ms, 1 s] (a linear map spends almost the whole range on intervals far
    longer than the models' service times; a floor of 1 ms capped a model at its max batch per ms, 16 000 requests/s,
    which SqueezeNet's pattern reaches on the simulated H100); each dequeue stacks everything queued up to the max
    batch, no cap on instances. Model agents: a^i ∈ [0, 1]^{B_i}; [0, 1] is cut into Σ B_i equal intervals (TOP:
    "according to the total number of blocks"); the blocks of every model whose values fall in one interval form one
    combined block. A combined block of more than H sub-blocks is a *superblock* (§V-D): the decision is refused and
    the previous intervals and combination kept (counted in ``superblocks``). The engine runs the combined block with
    the highest effective input ratio (§VI-A).

    **Before the first decision** (and while every decision is a superblock) the policy runs :meth:`start_groups`,
    the valid combination the model agents also start training from, with launcher action 0.5 (10 ms intervals).

    **When the actors are asked.** ``threshold`` T = 0 (the default): every ``period_ms``, as they were trained
    (:func:`opweave.learn.policy.train` decides every period). T > 0: once at start, then at a period's end only if σ
    passes T (Alg. 1 lines 26-41, TOP's online gate; T in requests², TOP's 2×10⁵ is in units it does not give).
    The agents never see that gate in training: between two decisions the state goes on changing while the action
    stays, which is not what their critics valued.
    """

    name = "top"

    def __init__(self, policy_file: str | None = None, threshold: float = 0.0, period_ms: float = 50.0,
                 agents: Actors | None = None, shipped: bool = True):
        self.policy_file, self.threshold, self.period_s = policy_file, float(threshold), period_ms / 1e3
        self.agents: Actors | None = agents
        self.shipped = bool(shipped)
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
        self.intervals = {m: interval(START_LAUNCH) for m in self.models}
        self.groups = self.start_groups()
        if self.agents is None and self.policy_file is None and self.shipped and self.models:
            self.policy_file = str(shipped_file(blocks, max_sub_blocks))
        if self.policy_file is not None and self.agents is None:
            self.agents = load_agents(self.policy_file, blocks, max_sub_blocks)

    # what the agents see ---------------------------------------------------------------------------------------
    def sample(self, obs: Observation) -> None:
        """Record one state sample (at most every ``period_s`` / n)."""
        if obs.now < self.next_sample:
            return
        self.next_sample = obs.now + self.period_s / SAMPLES
        queues = [obs.models[m].queue for m in self.models]
        row = [q / self.model_max_batch[m] for q, m in zip(queues, self.models, strict=True)]
        for m in self.models:
            row += [math.log1p(c) for c in obs.models[m].progress]
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

    def start_actions(self) -> list[list[float]]:
        """The model agents' actions of :meth:`start_groups`: with K = Σ B_i slots in model order and
        g = ⌈K / H⌉ groups, slot j goes to group j mod g, and group i's blocks all take the value at the middle of
        interval ⌊(i + ½) K / g⌋, so the groups' intervals are spread evenly over [0, 1] with empty intervals
        between them (exploration noise moves a block into an empty interval, a valid split, rather than into a
        full group's, a superblock)."""
        k = sum(self.action_dims[1:])
        g = math.ceil(k / max(1, self.max_sub_blocks - 1)) if self.max_sub_blocks > 1 else k
        out, j = [], 0
        for m in self.models:
            acts = []
            for _ in range(self.model_blocks[m]):
                acts.append((int((j % g + 0.5) * k / g) + 0.5) / k)
                j += 1
            out.append(acts)
        return out

    def start_groups(self) -> list[tuple[Slot, ...]]:
        """The valid combination the policy runs before its first decision and the model agents start training
        from (:meth:`start_actions`): blocks ⌈K / H⌉ slots apart combined, at most H per group. Why strided: the
        blocks far apart in a model are those that a pipeline of its instances holds ready at once, so a group of
        them can run full; a group of neighbouring blocks is never ready at once for one instance, and with every
        block alone (the previous start) the engine's tie order runs block 0 first, so new instances keep
        overtaking those in flight: the highest sustainable load was far lower than with the strided start
        (docs/serving.md, ``top``)."""
        if not self.models:
            return []
        return self.combination([[START_LAUNCH] * len(self.models)] + self.start_actions())

    def apply(self, actions: list) -> bool:
        """Adopt the agents' actions; False, with the previous intervals and combination kept, if one combined
        block is a superblock (§V-D; :func:`opweave.learn.policy.train` does the same)."""
        groups = self.combination(actions)
        if max(len(g) for g in groups) > self.max_sub_blocks:
            self.superblocks += 1
            return False
        self.decisions += 1
        self.intervals = {m: interval(a) for m, a in zip(self.models, actions[0], strict=True)}
        self.groups = groups
        return True

    def launch(self, obs: Observation) -> dict[str, Launch]:
        self.sample(obs)
        if self.agents is not None and obs.now - self.last_check >= self.period_s:
            first = self.last_check == -math.inf
            self.last_check = obs.now
            if first or self.threshold <= 0 or self.sigma() > self.threshold:
                self.apply(self.agents.act(self.state()))
        return {m: Launch(interval_s=self.intervals[m], batch=obs.models[m].max_batch) for m in self.models}

    def combine(self, obs: Observation) -> list[tuple[Slot, ...]]:
        return list(self.groups)

    def wake(self) -> float:
        """The next decision (a queue held by a long interval would otherwise see no step, and no decision, before
        its next dequeue: training decides every period whatever the intervals)."""
        return self.last_check + self.period_s if self.agents is not None else math.inf

    def describe(self) -> dict:
        return {"policy": self.name, "policy_file": self.policy_file, "threshold": self.threshold,
                "period_ms": self.period_s * 1e3, "decisions": self.decisions, "superblocks": self.superblocks}


def interval(action: float) -> float:
    """The launch interval (s) of launcher action ``action`` ∈ [0, 1]: 10^{-4(1 − a)}, 0.1 ms to 1 s."""
    return MIN_INTERVAL_S ** (1 - float(action))


# ---- the policy file ----------------------------------------------------------------------------------------------
def shipped_file(blocks: dict[str, int], max_sub_blocks: int) -> Path:
    """The policy file shipped for these models (``serve/data/top_<models, sorted, joined by +>.pt``, trained on
    TOP's pattern of these models in simulation, H100 preset: ``serve/data/README.md``); :class:`UsageError` if
    there is none."""
    path = DATA_DIR / f"top_{'+'.join(sorted(blocks))}.pt"
    if not path.is_file():
        raise UsageError(f"no top policy is shipped for {', '.join(sorted(blocks))} (H={max_sub_blocks}); train one "
                         "with opweave train-policy and pass it with --policy-file")
    return path


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
        actor.load_state_dict({k: v.float() for k, v in state.items()})
    return agents
