"""Language models' decode step on opweave: a static KV cache as module state, prefill and decode as two input
signatures of one compiled model, and greedy generation on it.

* :mod:`.step` — :class:`DecodeStep`: a Hugging Face causal LM over a static KV cache it owns, ``step(input_ids,
  cache_position) -> logits``, the cache written in place at the positions the step takes as input;
* :mod:`.moe` — :func:`static_moe`: mixtures of experts routed in fixed shapes, every expert a branch;
* :mod:`.decoding` — :func:`generate`, transformers' greedy ``generate`` on the compiled step, and the
  :class:`Decoder` it keeps per model and batch size;
* :mod:`.models` — four small causal LMs with random weights (Mixtral- and Qwen2-MoE-style mixtures of experts, a
  Llama-style dense model, a GPT-J-style parallel block), built from transformers' configurations.
"""

from opweave.llm import models
from opweave.llm.decoding import Decoder, decoder, generate, greedy
from opweave.llm.moe import StaticExperts, static_moe
from opweave.llm.step import DecodeStep

__all__ = ["DecodeStep", "Decoder", "StaticExperts", "decoder", "generate", "greedy", "models", "static_moe"]
