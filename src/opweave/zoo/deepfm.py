"""DeepFM (Guo et al., "DeepFM: A Factorization-Machine based Neural Network for CTR Prediction", IJCAI 2017).

Criteo-like input: 26 categorical fields (int64 indices, one embedding table per field, ``vocab_size`` rows each) and
13 numerical fields (float). Every field i gets a k=10 dimensional embedding e_i (for a numerical field, its value
times a learned vector, as the paper treats continuous fields), shared by both components (paper Fig. 1):

* FM: y_FM = w0 + sum_i w_i x_i + sum_{i<j} <e_i, e_j>, the pairwise term computed as
  0.5 * sum_k((sum_i e_ik)^2 - sum_i e_ik^2);
* deep: the concatenated embeddings through the paper's 400-400-400 ReLU MLP to one unit.

Output: sigmoid(y_FM + y_DNN), shape (batch, 1). Simplifications: small vocabularies instead of Criteo's millions of
ids, no dropout (identity in eval). Random weights.
"""

from __future__ import annotations

import torch
from torch import nn


class DeepFM(nn.Module):
    def __init__(self, num_sparse: int = 26, num_dense: int = 13, vocab_size: int = 1000, embed_dim: int = 10,
                 hidden: tuple[int, ...] = (400, 400, 400)) -> None:
        super().__init__()
        self.num_sparse, self.num_dense, self.vocab_size = num_sparse, num_dense, vocab_size
        self.embeddings = nn.ModuleList(nn.Embedding(vocab_size, embed_dim) for _ in range(num_sparse))
        self.first_order = nn.ModuleList(nn.Embedding(vocab_size, 1) for _ in range(num_sparse))
        self.dense_linear = nn.Linear(num_dense, 1)  # first-order weights of the numerical fields, and w0
        self.dense_embedding = nn.Parameter(torch.randn(num_dense, embed_dim) * 0.1)
        for table in [*self.embeddings, *self.first_order]:  # std 0.1: logits of order 1, so outputs vary with input
            nn.init.normal_(table.weight, std=0.1)
        layers: list[nn.Module] = []
        width = (num_sparse + num_dense) * embed_dim
        for units in hidden:
            layers += [nn.Linear(width, units), nn.ReLU(inplace=True)]
            width = units
        layers.append(nn.Linear(width, 1))
        self.deep = nn.Sequential(*layers)

    def forward(self, sparse: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        fields = [sparse[:, i] for i in range(self.num_sparse)]
        sparse_embeds = torch.stack([table(f) for table, f in zip(self.embeddings, fields, strict=True)], dim=1)
        dense_embeds = dense.unsqueeze(-1) * self.dense_embedding
        embeds = torch.cat([sparse_embeds, dense_embeds], dim=1)  # (batch, fields, k)

        sparse_weights = torch.cat([w(f) for w, f in zip(self.first_order, fields, strict=True)], dim=1)
        first = self.dense_linear(dense) + sparse_weights.sum(dim=1, keepdim=True)
        square_of_sum = embeds.sum(dim=1).pow(2)
        sum_of_square = embeds.pow(2).sum(dim=1)
        second = 0.5 * (square_of_sum - sum_of_square).sum(dim=1, keepdim=True)
        deep = self.deep(torch.flatten(embeds, 1))
        return torch.sigmoid(first + second + deep)


def create(batch_size: int = 1, num_sparse: int = 26, num_dense: int = 13, vocab_size: int = 1000,
           embed_dim: int = 10):
    """DeepFM and one batch of (sparse ids int64 [batch, 26], dense features float [batch, 13] in [0, 1))."""
    model = DeepFM(num_sparse, num_dense, vocab_size, embed_dim)
    generator = torch.Generator().manual_seed(0)
    sparse = torch.randint(0, vocab_size, (batch_size, num_sparse), generator=generator)
    dense = torch.rand(batch_size, num_dense, generator=generator)
    return model, (sparse, dense)
