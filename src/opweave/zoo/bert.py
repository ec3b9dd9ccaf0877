"""BERT-base encoder (Devlin et al., "BERT: Pre-training of Deep Bidirectional Transformers for Language
Understanding", NAACL 2019), written from scratch: L=12 layers, H=768 hidden, A=12 heads, 3072 feed-forward units,
WordPiece vocabulary 30522, 512 positions, 2 segment types, GELU, post-LayerNorm (eps 1e-12), as in the reference
implementation. Input: token ids (int64, batch x seq_len, 128 by default); output: the last hidden states
(batch x seq_len x 768).

Written for graph capture: the query, key and value projections are three separate ``nn.Linear`` (so each layer has
a three-way branch), attention is spelled out as matmul -> scale -> softmax -> matmul (no fused
``scaled_dot_product_attention``), and no tensor size is read in Python (heads are split with ``unflatten`` and merged
with ``flatten``; position ids come from a cumulative sum over the ids), so ``torch.fx.symbolic_trace`` sees every op.

Simplifications: no attention mask (every sequence is full length), segment ids are all 0, no pooler or task head,
no dropout (identity in eval). Random weights.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class Embeddings(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, max_positions: int, type_vocab_size: int) -> None:
        super().__init__()
        self.word = nn.Embedding(vocab_size, hidden)
        self.position = nn.Embedding(max_positions, hidden)
        self.token_type = nn.Embedding(type_vocab_size, hidden)
        self.norm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        position_ids = torch.cumsum(torch.ones_like(input_ids), dim=1) - 1
        token_type_ids = torch.zeros_like(input_ids)
        x = self.word(input_ids) + self.position(position_ids) + self.token_type(token_type_ids)
        return self.norm(x)


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.scale = 1.0 / math.sqrt(self.head_dim)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, hidden) -> (batch, heads, seq, head_dim)."""
        return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split_heads(self.query(x)), self.split_heads(self.key(x)), self.split_heads(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        probs = torch.softmax(scores, dim=-1)
        context = torch.matmul(probs, v)
        return context.transpose(1, 2).flatten(2)


class EncoderLayer(nn.Module):
    def __init__(self, hidden: int, num_heads: int, intermediate: int) -> None:
        super().__init__()
        self.attention = SelfAttention(hidden, num_heads)
        self.attention_out = nn.Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.intermediate = nn.Linear(hidden, intermediate)
        self.gelu = nn.GELU()
        self.output = nn.Linear(intermediate, hidden)
        self.output_norm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention_norm(x + self.attention_out(self.attention(x)))
        return self.output_norm(x + self.output(self.gelu(self.intermediate(x))))


class BertBase(nn.Module):
    def __init__(self, num_layers: int = 12, hidden: int = 768, num_heads: int = 12, intermediate: int = 3072,
                 vocab_size: int = 30522, max_positions: int = 512, type_vocab_size: int = 2) -> None:
        super().__init__()
        if hidden % num_heads:
            raise ValueError(f"hidden ({hidden}) must be a multiple of num_heads ({num_heads})")
        self.vocab_size = vocab_size
        self.embeddings = Embeddings(vocab_size, hidden, max_positions, type_vocab_size)
        self.layers = nn.Sequential(*[EncoderLayer(hidden, num_heads, intermediate) for _ in range(num_layers)])
        for module in self.modules():  # the reference initialisation: N(0, 0.02), zero biases
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.layers(self.embeddings(input_ids))


def create(batch_size: int = 1, seq_len: int = 128, num_layers: int = 12, **config):
    """BERT-base (``num_layers`` 12 by default) and one batch of random token ids of length ``seq_len``.

    ``config`` may override ``hidden``, ``num_heads``, ``intermediate``, ``vocab_size``, ``max_positions``.
    """
    model = BertBase(num_layers=num_layers, **config)
    max_positions = model.embeddings.position.num_embeddings
    if seq_len > max_positions:
        raise ValueError(f"seq_len {seq_len} exceeds max_positions {max_positions}")
    generator = torch.Generator().manual_seed(0)
    return model, (torch.randint(0, model.vocab_size, (batch_size, seq_len), generator=generator),)
