"""Multi-agent DDPG (Lowe et al. 2017), as TOP trains its serving agents (Lin et al., TOP, IEEE TPDS 2024, §V-B
eqs. 3-4, §VI-B sizes): the actors serving runs (:class:`opweave.serve.top.Actors`) with the centralized critics,
target copies, replay buffer and updates that train them."""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from opweave.serve.top import Actors

GAMMA, LR, BATCH, REPLAY = 0.95, 1e-3, 100, 2000  # §VI-B


def critic_net(inputs: int) -> nn.Sequential:
    """TOP's value network (§VI-B): 3 ReLU layers of 1024, 512 and 300 units, one value out."""
    return nn.Sequential(nn.Linear(inputs, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 300),
                         nn.ReLU(), nn.Linear(300, 1))


class MADDPG(Actors):
    """Multi-agent DDPG (Lowe et al. 2017; TOP §V-B eqs. 3-4): decentralized actors ρ^i(s) → a^i ∈ [0, 1]^{d_i}
    (:class:`~opweave.serve.top.Actors`, TOP's policy network), centralized critics Q^i(s, a^0..a^W)
    (:func:`critic_net`, TOP's value network), target copies of both moved by soft updates
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
        torch.manual_seed(seed)  # before the actors: their initial weights follow from the seed
        super().__init__(state_dim, action_dims)
        self.gamma, self.batch, self.replay, self.tau, self.noise = gamma, batch, replay, tau, noise
        self.saturation = saturation
        self.warmup = batch if warmup is None else warmup
        self.rng = np.random.default_rng(seed)
        total = state_dim + sum(action_dims)
        self.critics = [critic_net(total) for _ in action_dims]
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
            out = [np.clip(a + self.rng.normal(0, self.noise, a.shape), 0.0, 1.0) for a in out]
        return out

    def store(self, state, actions: list, rewards: list[float], next_state) -> None:
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


__all__ = ["BATCH", "GAMMA", "LR", "MADDPG", "REPLAY", "critic_net"]
