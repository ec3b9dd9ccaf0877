"""A causal language model's step over a static KV cache, as one module whose state is the cache.

:class:`DecodeStep` wraps a Hugging Face causal LM: ``step(input_ids [B, T], cache_position [T]) -> logits [B, T, V]``
runs the model on ``T`` new tokens at positions ``cache_position`` of every row, writes their keys and values into
the cache at those positions (``index_copy_`` into buffers of shape [B, kv heads, max_len, head dim], two per layer)
and attends over the cache. The prefill (a prompt's ``T`` tokens at ``0..T-1``) and the decode step (one token at
``t``) are two input signatures of the same module; the position is an input, never a constant of the graph.

The cache buffers are the module's **state** (:data:`opweave.capture.trace.STATE`): capture keeps their writes in
place, orders each write before every read of the buffer, and checks that the graph writes what eager writes. A
step's writes depend only on its inputs and the cache below its positions, so a call repeated at the same position
writes the same values (what checks and timings rely on), and a generation overwrites each slot before it reads it.

The model is called as transformers' static cache is called (gpt-fast's and ``generate(...,
cache_implementation="static")``'s decode step): with a cache object (a subclass of ``transformers.StaticCache``
whose ``update`` writes the module's buffers at the step's positions), ``position_ids``, and a 4D additive attention
mask over the cache's ``max_len`` slots (a slot is seen by a token at or after its position), which transformers
takes as it is. That keeps the step the same across transformers versions: the cache's keyword (``cache`` or
``past_key_values``) and ``cache_position`` are passed where the model's ``forward`` takes them. A mixture of
experts is routed statically (:func:`opweave.llm.moe.static_moe`), the model given left unchanged.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

from opweave.capture.trace import STATE
from opweave.errors import UsageError
from opweave.llm.moe import shallow, static_moe
from opweave.zoo import ensure_torchvision_importable


@functools.cache
def _cache_class() -> type:
    """``transformers.StaticCache`` whose ``update`` writes the step's buffers at the step's positions."""
    ensure_torchvision_importable()
    import transformers

    class OwnedStaticCache(transformers.StaticCache):
        """The step's cache: ``buffers`` (per layer, keys and values) and ``position`` are set before each call."""

        buffers: list[tuple[torch.Tensor, torch.Tensor]]
        position: torch.Tensor

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            keys, values = self.buffers[layer_idx]
            keys.index_copy_(2, self.position, key_states)
            values.index_copy_(2, self.position, value_states)
            return keys, values

    return OwnedStaticCache


def _new_cache(config: Any, batch_size: int, max_len: int, dtype: torch.dtype, device: torch.device):
    cls = _cache_class()
    params = inspect.signature(cls).parameters
    kwargs: dict[str, Any] = {"config": config, "max_cache_len": max_len}
    if "max_batch_size" in params:  # transformers 4.x allocates its own tensors here, unused by the step
        kwargs.update(max_batch_size=batch_size, device=device, dtype=dtype)
    return cls(**kwargs)


def kv_shape(config: Any) -> tuple[int, int, int]:
    """Layers, key/value heads and head size of a transformers decoder configuration."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, kv_heads, head_dim


def _check_attention(config: Any, max_len: int, name: str) -> None:
    """Refuse what a cache of ``max_len`` slots under one mask over all of them would get wrong: layers that are not
    attention (linear attention, state-space layers), a sliding window shorter than the cache, an attention that
    takes no 4D mask."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = set(getattr(text, "layer_types", None) or ())
    other = kinds - {"full_attention", "sliding_attention"}
    if other:
        raise UsageError(f"{name} has {', '.join(sorted(other))} layers; the decode step caches attention layers only")
    window = getattr(text, "sliding_window", None) if getattr(text, "use_sliding_window", True) else None
    if window and max_len > window:
        raise UsageError(f"{name} attends within a sliding window of {window} tokens; a cache of {max_len} slots "
                         "would let a token see past it (use at most that many)")
    attention = getattr(config, "_attn_implementation", None)
    if attention not in (None, "eager", "sdpa"):
        raise UsageError(f"{name} uses {attention} attention, which takes no 4D mask; load it with "
                         "attn_implementation='sdpa' or 'eager'")


class DecodeStep(nn.Module):
    """``model`` (a Hugging Face causal LM) over a static KV cache of ``batch_size`` rows and ``max_len`` slots, on
    the model's device and dtype (module docstring). ``forward(input_ids, cache_position) -> logits``."""

    def __init__(self, model: nn.Module, batch_size: int, max_len: int):
        super().__init__()
        config = getattr(model, "config", None)
        if config is None or not hasattr(model, "forward"):
            raise UsageError(f"{type(model).__name__} is no Hugging Face causal LM (it has no config)")
        if batch_size < 1 or max_len < 1:
            raise UsageError(f"a decode step needs batch_size >= 1 and max_len >= 1, got {batch_size} and {max_len}")
        _check_attention(config, max_len, type(model).__name__)
        routed = static_moe(model)  # a copy sharing every parameter: the step holds no reference to ``model``
        self.model = routed if routed is not model else shallow(model)
        self.batch_size, self.max_len = batch_size, max_len
        layers, kv_heads, head_dim = kv_shape(config)
        weight = next(model.parameters())
        self.dtype, self.device = weight.dtype, weight.device
        names = []
        for i in range(layers):
            for kind in ("keys", "values"):
                name = f"{kind}_{i}"
                self.register_buffer(name, torch.zeros(batch_size, kv_heads, max_len, head_dim, dtype=weight.dtype,
                                                       device=weight.device), persistent=False)
                names.append(name)
        setattr(self, STATE, tuple(names))
        self.layers = layers
        self.cache = _new_cache(config, batch_size, max_len, weight.dtype, weight.device)
        takes = inspect.signature(model.forward).parameters
        self.cache_keyword = "cache" if "cache" in takes else "past_key_values"
        self.takes_cache_position = "cache_position" in takes

    def reset(self) -> None:
        """Zero the cache (not needed between generations: each overwrites a slot before it reads it)."""
        with torch.no_grad():
            for name in getattr(self, STATE):
                getattr(self, name).zero_()

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        # The buffers are read here, in forward, so that a tracer that swaps the module's buffers sees its own.
        self.cache.buffers = [(getattr(self, f"keys_{i}"), getattr(self, f"values_{i}")) for i in range(self.layers)]
        self.cache.position = cache_position
        rows, tokens = input_ids.shape
        dtype = self.dtype
        slots = torch.arange(self.max_len, device=input_ids.device)
        seen = slots[None, :] <= cache_position[:, None]  # [T, max_len]: slots a token attends to
        mask = torch.zeros(tokens, self.max_len, dtype=dtype, device=input_ids.device)
        mask = mask.masked_fill(~seen, torch.finfo(dtype).min)[None, None].expand(rows, 1, tokens, self.max_len)
        kwargs: dict[str, Any] = {self.cache_keyword: self.cache, "attention_mask": mask,
                                  "position_ids": cache_position[None].expand(rows, tokens), "use_cache": True}
        if self.takes_cache_position:
            kwargs["cache_position"] = cache_position
        return self.model(input_ids, **kwargs).logits
