"""Multi-agent DDPG (Lowe et al. 2017), as TOP trains its serving agents (Lin et al., TOP, IEEE TPDS 2024, §V-B
eqs. 3-4, §VI-B sizes): the actors serving runs (:class:`opweave.serve.engine.top.Actors`) with the centralized critics,
target copies, replay buffer and updates that train them."""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from opweave.serve.engine.top import Actors

GAMMA, LR, BATCH, REPLAY_SIZE = 0.95, 1e-3, 100, 2000  # §VI-B (replay_size: transitions before the first update)
CAPACITY = 100_000  # transitions the replay buffer keeps (TOP gives none; see MADDPG)
ACTOR_LR = 1e-4  # DDPG's (Lillicrap et al. 2016) actor rate under Adam; see MADDPG


def critic_net(inputs: int) -> nn.Sequential:
    """TOP's value network (§VI-B): 3 ReLU layers of 1024, 512 and 300 units, one value out."""
    return nn.Sequential(nn.Linear(inputs, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 300),
                         nn.ReLU(), nn.Linear(300, 1))


class MADDPG(Actors):
    """Multi-agent DDPG (Lowe et al. 2017; TOP §V-B eqs. 3-4): decentralized actors ρ^i(s) → a^i ∈ [0, 1]^{d_i}
    (:class:`~opweave.serve.engine.top.Actors`, TOP's policy network), centralized critics Q^i(s, a^0..a^W)
    (:func:`critic_net`, TOP's value network), target copies of both moved by soft updates
    (``tau``), a replay buffer of ``capacity`` transitions (oldest dropped) sampled in batches of ``batch``, discount
    γ. All agents see the same state (TOP stacks one global state for every agent).

    Choices where TOP is silent or where we depart from it:

    * Adam, the critics at TOP's η = 10⁻³ (``lr``), the actors at 10⁻⁴ (``actor_lr``, one rate or one per
      agent), DDPG's rates (Lillicrap et al. 2016). TOP's eqs. (3)-(4) are plain gradient steps with one η; under
      Adam, whose steps do not shrink with the gradient, η = 10⁻³ drove the model agents' outputs to 0 or 1 within
      a few dozen updates (ResNet-50; docs/serving.md, ``top``), where every block lands in the first or last
      interval: superblocks.
    * Updates start once ``warmup`` transitions are stored (Alg. 1 line 19: ``replay_size``, 2000) and run once per
      stored transition. The buffer keeps ``capacity`` = 10⁵ transitions, all of a training's: TOP gives the
      number before updates, not how many are kept, and 2000 would keep only the last 50 episodes, so what the
      early actions (long launch intervals) cost would be forgotten once the launcher has left them.
      :meth:`relabel` rewrites the stored rewards (the trainer's Z-scores move).
    * Exploration adds Gaussian noise to every action (clipped to [0, 1]), standard deviation ``noise`` (one value,
      or one per agent: the trainer gives the model agents one interval's width).
    * ``tau`` = 0.01 (TOP gives none).
    * The actor loss adds ``saturation`` × the mean square of how far the actor's output before its sigmoid lies
      beyond ±4 (saturated outputs have no gradient back), and, with ``max_group`` = H, ``crowding`` ×
      :meth:`overflow` to the model agents' (agents 1..W): a soft count of the blocks in each interval, penalized
      above H - ½. The superblock rule is known, so the actors are told where it lies rather than left to find a
      reward cliff through a critic that smooths it over (without it, at either actor rate, the model agents'
      values bunched up within a few hundred updates on ResNet-50: superblocks at 62-85 % of steps).
    * A transition stored as ``final`` (the trainer's superblocks) has no bootstrapped successor value.

    :meth:`start_at` sets where an actor begins."""

    def __init__(self, state_dim: int, action_dims: list[int], *, gamma: float = GAMMA, lr: float = LR,
                 actor_lr: float | list[float] = ACTOR_LR, batch: int = BATCH, capacity: int = CAPACITY,
                 warmup: int = REPLAY_SIZE, tau: float = 0.01, noise: float | list[float] = 0.1,
                 saturation: float = 1e-2, max_group: int | None = None, crowding: float = 10.0, seed: int = 0):
        torch.manual_seed(seed)  # before the actors: their initial weights follow from the seed
        super().__init__(state_dim, action_dims)
        self.gamma, self.batch, self.capacity, self.tau = gamma, batch, capacity, tau
        self.noise = list(noise) if isinstance(noise, list | tuple) else [float(noise)] * len(action_dims)
        self.saturation, self.max_group, self.crowding = saturation, max_group, crowding
        self.warmup = warmup
        self.rng = np.random.default_rng(seed)
        total = state_dim + sum(action_dims)
        self.critics = [critic_net(total) for _ in action_dims]
        self.target_actors = [copy.deepcopy(a) for a in self.actors]
        self.target_critics = [copy.deepcopy(c) for c in self.critics]
        rates = list(actor_lr) if isinstance(actor_lr, list | tuple) else [float(actor_lr)] * len(action_dims)
        self.actor_opt = [torch.optim.Adam(a.parameters(), lr=r) for a, r in zip(self.actors, rates, strict=True)]
        self.critic_opt = [torch.optim.Adam(c.parameters(), lr=lr) for c in self.critics]
        self.buffer: list[tuple] = []
        self.pos = 0
        self.updates = 0

    def start_at(self, agent: int, values) -> None:
        """Make actor ``agent`` (and its target) start near the action ``values`` in every state: its last layer's
        bias becomes their logit and its weights are scaled by 0.1."""
        target = torch.as_tensor(values, dtype=torch.float32).clamp(1e-3, 1 - 1e-3)
        for net in (self.actors[agent], self.target_actors[agent]):
            last = net[-2]
            with torch.no_grad():
                last.weight.mul_(0.1)
                last.bias.copy_(torch.log(target / (1 - target)))

    def act(self, state, explore: bool = False) -> list:
        """Every agent's action for ``state`` (numpy arrays in [0, 1]); with ``explore``, plus noise."""
        out = super().act(state)
        if explore:
            out = [np.clip(a + self.rng.normal(0, sd, a.shape), 0.0, 1.0)
                   for a, sd in zip(out, self.noise, strict=True)]
        return out

    def store(self, state, actions: list, rewards: list[float], next_state, final: bool = False) -> int:
        """Keep a transition (the oldest dropped once ``capacity`` are kept) and return its index in the buffer;
        ``final``: nothing follows it, its value is its reward alone (no bootstrapped value of ``next_state``)."""
        item = (np.asarray(state, np.float32), np.concatenate(actions).astype(np.float32),
                np.asarray(rewards, np.float32), np.asarray(next_state, np.float32),
                np.asarray([0.0 if final else 1.0], np.float32))
        index = self.pos
        if len(self.buffer) < self.capacity:
            self.buffer.append(item)
        else:
            self.buffer[self.pos] = item
        self.pos = (self.pos + 1) % self.capacity
        return index

    def relabel(self, rewards) -> None:
        """Replace the rewards of the stored transitions: ``rewards(i)`` gives transition i's."""
        for i, (s, a, _, s2, go_on) in enumerate(self.buffer):
            self.buffer[i] = (s, a, np.asarray(rewards(i), np.float32), s2, go_on)

    def overflow(self, values: torch.Tensor) -> torch.Tensor:
        """The model agents' soft superblock penalty (mean over the batch): each of the K block values is spread
        over the K intervals of [0, 1] by a softmax of minus its squared distance to their middles over (half an
        interval)², and Σ over intervals of relu(soft count − (H − ½))². Near 0 unless an interval holds about H
        blocks or more."""
        k = values.shape[1]
        middles = (torch.arange(k, dtype=values.dtype) + 0.5) / k
        weights = torch.softmax(-((values.unsqueeze(-1) - middles) * 2 * k) ** 2, dim=-1)
        counts = weights.sum(1)
        assert self.max_group is not None  # the penalty applies with a group bound (H)
        return (torch.relu(counts - (self.max_group - 0.5)) ** 2).sum(1).mean()

    def update(self) -> dict | None:
        """One MADDPG update of every agent from a sampled batch (eqs. 3-4) and the soft target updates; None until
        ``warmup`` transitions are stored. Returns the mean critic and actor losses."""
        if len(self.buffer) < max(self.warmup, 1):
            return None
        idx = self.rng.integers(0, len(self.buffer), min(self.batch, len(self.buffer)))
        s, a, r, s2, go_on = (torch.as_tensor(np.stack([self.buffer[i][k] for i in idx])) for k in range(5))
        with torch.no_grad():
            a2 = torch.cat([t(s2) for t in self.target_actors], 1)
        cuts = np.cumsum([0] + self.action_dims)
        critic_loss = actor_loss = 0.0
        for i, (actor, critic) in enumerate(zip(self.actors, self.critics, strict=True)):
            with torch.no_grad():
                y = r[:, i:i + 1] + self.gamma * go_on * self.target_critics[i](torch.cat([s2, a2], 1))
            q = critic(torch.cat([s, a], 1))
            loss = torch.nn.functional.mse_loss(q, y)
            self.critic_opt[i].zero_grad()
            loss.backward()
            self.critic_opt[i].step()
            critic_loss += float(loss.detach())
            pre = actor[:-1](s)  # before the sigmoid
            mine = torch.cat([a[:, :cuts[i]], torch.sigmoid(pre), a[:, cuts[i + 1]:]], 1)
            loss = -critic(torch.cat([s, mine], 1)).mean() + self.saturation * (torch.relu(pre.abs() - 4) ** 2).mean()
            if i > 0 and self.max_group is not None:
                loss = loss + self.crowding * self.overflow(mine[:, cuts[1]:])
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


__all__ = ["ACTOR_LR", "BATCH", "CAPACITY", "GAMMA", "LR", "MADDPG", "REPLAY_SIZE", "critic_net"]
