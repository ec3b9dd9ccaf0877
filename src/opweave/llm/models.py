"""Four small causal language models with random weights, built from transformers' own configurations and classes
(nothing downloaded): the decode step's shapes of today's served models, small enough for a CPU.

* ``mixtral`` — Mixtral-style mixture of experts: 8 experts, each token routed to 2 (``MixtralForCausalLM``);
* ``qwen2_moe`` — Qwen2-MoE-style: 8 routed experts (top 2) beside a shared expert with its sigmoid gate
  (``Qwen2MoeForCausalLM``);
* ``llama`` — Llama-style dense model with grouped-query attention (``LlamaForCausalLM``);
* ``gptj`` — GPT-J's parallel block: attention and the MLP read the same normalized input side by side
  (``GPTJForCausalLM``).

Each has 4 layers, hidden size 512, 8 attention heads (4 key/value heads where the class has them) and a vocabulary
of 8192; :data:`TINY` shrinks one to 2 layers of hidden size 64 over 256 tokens (the tests' size).
``create(name, **overrides)`` overrides configuration fields. Weights are seeded (``torch.manual_seed(0)`` inside a
forked RNG, the caller's state untouched); the model comes back in ``eval()`` mode, with no end-of-sequence token,
so that greedy generation always runs the tokens asked.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from opweave.errors import UsageError, did_you_mean
from opweave.zoo import ensure_torchvision_importable

_ATTENTION = {"num_attention_heads": 8, "num_key_value_heads": 4}
_COMMON = {"vocab_size": 8192, "hidden_size": 512, "num_hidden_layers": 4, "max_position_embeddings": 2048,
           "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "tie_word_embeddings": False}

# name -> (transformers configuration class, model class, fields)
SPECS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {**_COMMON, **_ATTENTION, "intermediate_size": 1024, "num_local_experts": 8, "num_experts_per_tok": 2,
                 "sliding_window": None}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {**_COMMON, **_ATTENTION, "intermediate_size": 1024, "moe_intermediate_size": 512,
                   "shared_expert_intermediate_size": 1024, "num_experts": 8, "num_experts_per_tok": 2,
                   "decoder_sparse_step": 1, "norm_topk_prob": True, "use_sliding_window": False,
                   "sliding_window": None}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {**_COMMON, **_ATTENTION, "intermediate_size": 1408}),
    "gptj": ("GPTJConfig", "GPTJForCausalLM",
             {"vocab_size": 8192, "n_embd": 512, "n_layer": 4, "n_head": 8, "rotary_dim": 32, "n_inner": 2048,
              "n_positions": 2048, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
              "tie_word_embeddings": False}),
}

# The tests' size: 2 layers, hidden size 64, 256 tokens (fields named as each configuration names them).
TINY: dict[str, dict[str, Any]] = {
    "mixtral": {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "intermediate_size": 64},
    "qwen2_moe": {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "intermediate_size": 64, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 64},
    "llama": {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128},
    "gptj": {"vocab_size": 256, "n_embd": 64, "n_layer": 2, "n_head": 4, "rotary_dim": 8, "n_inner": 128},
}


def names() -> list[str]:
    return list(SPECS)


def create(name: str, tiny: bool = False, **overrides) -> nn.Module:
    """Causal LM ``name`` (:func:`names`) with seeded random weights, in eval mode; ``tiny``: the tests' size
    (:data:`TINY`); ``overrides``: configuration fields."""
    if name not in SPECS:
        raise UsageError(f"unknown language model {name!r}{did_you_mean(name, names())}; known: {', '.join(names())}")
    ensure_torchvision_importable()  # transformers imports torchvision, which a CPU build of torch needs made able
    import transformers

    config_name, model_name, fields = SPECS[name]
    config = getattr(transformers, config_name)(**{**fields, **(TINY[name] if tiny else {}), **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(transformers, model_name)(config)
    generation = getattr(model, "generation_config", None)
    if generation is not None:  # no end of sequence: greedy generation runs every token asked
        generation.eos_token_id = generation.bos_token_id = generation.pad_token_id = None
    return model.eval()
