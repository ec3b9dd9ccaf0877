"""Mixtures of experts routed without data-dependent shapes, so that one graph holds them and streams can overlap
their experts.

transformers' experts (``MixtralExperts``, ``Qwen2MoeExperts``, ...: every expert's weights stacked in 3D
parameters) loop over the experts some token picked and gather those tokens: the loop's length and each gather's
size depend on the router's choice, which no captured graph holds (``torch.export`` stops at the ``nonzero``).
:class:`StaticExperts` computes the same sum in a fixed shape: every expert is one branch over every token, its
output scaled by the token's routing weight for it (zero where the token did not pick it), the branches added in
the experts' order, as the loop adds them. A token's output is the loop's (an unpicked expert adds exactly zero);
at decode batch sizes the step is bound by launches rather than arithmetic, and the E independent branches are what
a multi-stream plan runs side by side, where the loop ran the picked ones one after another. The price is E/k times
the experts' arithmetic, which grows with the batch.

:func:`static_moe` returns a model whose experts route so, sharing every parameter with the model given and leaving
it unchanged (the modules on the way to each experts module are shallow copies).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from opweave.errors import UsageError


class StaticExperts(nn.Module):
    """``experts`` (a transformers experts module: ``gate_up_proj`` [E, 2I, D] and ``down_proj`` [E, D, I], or
    transposed) called as it is, ``(hidden [T, D], top_k_index [T, k], top_k_weights [T, k]) -> [T, D]``, with every
    expert a branch over every token (module docstring)."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        unsupported = [flag for flag, default in (("has_bias", False), ("has_gate", True), ("is_concatenated", True),
                                                  ("has_post_expert_norm", False))
                       if getattr(experts, flag, default) != default]
        if unsupported or not hasattr(experts, "gate_up_proj") or not hasattr(experts, "down_proj"):
            what = ", ".join(unsupported) or "no gate_up_proj and down_proj"
            raise UsageError(f"{type(experts).__name__}: experts with {what} have no static form here")
        self.inner = experts
        self.transposed = bool(getattr(experts, "is_transposed", False))

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        inner: Any = self.inner
        count = int(inner.gate_up_proj.shape[0])
        weights = torch.zeros(hidden.shape[0], count, dtype=top_k_weights.dtype, device=hidden.device)
        weights = weights.scatter(1, top_k_index, top_k_weights)  # [T, E]: a token's weight for each expert
        out = None
        for e in range(count):
            gate_up, down = inner.gate_up_proj[e], inner.down_proj[e]
            if self.transposed:
                gate_up, down = gate_up.t(), down.t()
            gate, up = F.linear(hidden, gate_up).chunk(2, dim=-1)
            branch = F.linear(inner.act_fn(gate) * up, down)
            branch = (branch * weights[:, e, None]).to(hidden.dtype)
            out = branch if out is None else out + branch
        assert out is not None
        return out


def routed_experts(model: nn.Module) -> list[str]:
    """Paths of ``model``'s experts modules that route with data-dependent shapes (stacked 3D expert weights)."""
    return [path for path, module in model.named_modules()
            if not isinstance(module, StaticExperts) and hasattr(module, "gate_up_proj")
            and hasattr(module, "down_proj") and getattr(module.gate_up_proj, "dim", lambda: 0)() == 3]


def static_moe(model: nn.Module) -> nn.Module:
    """``model`` with every experts module routed statically (:class:`StaticExperts`), or ``model`` itself when it
    has none. The result shares every parameter and buffer with ``model``, which is left unchanged."""
    paths = routed_experts(model)
    if not paths:
        return model
    copies: dict[str, nn.Module] = {"": shallow(model)}
    for path in paths:
        parent = ""
        parts = path.split(".")
        for part in parts[:-1]:
            child = f"{parent}.{part}" if parent else part
            if child not in copies:
                copies[child] = shallow(_child(copies[parent], part))
                copies[parent]._modules[part] = copies[child]
            parent = child
        holder = copies[parent]
        holder._modules[parts[-1]] = StaticExperts(_child(holder, parts[-1]))
    return copies[""]


def _child(module: nn.Module, name: str) -> nn.Module:
    child = module._modules[name]
    assert child is not None  # a path named_modules() gave
    return child


def shallow(module: nn.Module) -> nn.Module:
    """A copy of ``module`` sharing its parameters, buffers and submodules, whose own submodule table may change."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    return clone
