"""RandWire-WS (Xie et al., "Exploring Randomly Wired Neural Networks for Image Recognition", ICCV 2019), small
computation regime of the paper's Table 1 with the WS(N=32, K=4, P=0.75) generator and C=78:

    conv1  3x3 conv, stride 2, C/2        112x112
    conv2  3x3 conv, stride 2, C           56x56
    conv3  random wiring, N nodes, C       28x28
    conv4  random wiring, N nodes, 2C      14x14
    conv5  random wiring, N nodes, 4C       7x7
    classifier  1x1 conv 1280, global average pool, fc 1000

Each stage is a connected Watts-Strogatz graph (``networkx.connected_watts_strogatz_graph``, one fixed seed per
stage) made a DAG by orienting every edge from the lower to the higher node index (paper Sec. 3.2). A node sums its
inputs with sigmoid-positive learned weights, then applies ReLU -> 3x3 separable conv -> BN; nodes without
predecessors read the stage input with stride 2, and the stage output is the unweighted average of the nodes without
successors (the paper's extra input and output nodes). Random weights; no dropout (identity in eval).

``regime="regular"`` builds the regular regime instead (conv1 only, then random stages of N/2, N, N, N nodes with C,
2C, 4C, 8C channels; C=154): the "RandWire" of the IOS benchmark (``randwire_large``) that IOS, LIOS and HIOS count.
"""

from __future__ import annotations

import networkx as nx
import torch
from torch import nn


def ws_dag(num_nodes: int = 32, k: int = 4, p: float = 0.75, seed: int = 0) -> list[tuple[int, int]]:
    """Edges (u, v), u < v, of a connected Watts-Strogatz graph oriented from lower to higher index."""
    graph = nx.connected_watts_strogatz_graph(num_nodes, k, p, tries=100, seed=seed)
    return sorted((min(u, v), max(u, v)) for u, v in graph.edges())


class Node(nn.Module):
    """Weighted-sum aggregation -> ReLU -> separable 3x3 conv -> BN."""

    def __init__(self, in_ch: int, out_ch: int, num_inputs: int, stride: int = 1) -> None:
        super().__init__()
        self.aggregate_weight = nn.Parameter(torch.zeros(num_inputs)) if num_inputs > 1 else None
        self.relu = nn.ReLU()
        self.depthwise = nn.Conv2d(in_ch, in_ch, 3, stride=stride, padding=1, groups=in_ch, bias=False)
        self.pointwise = nn.Conv2d(in_ch, out_ch, 1, bias=False)
        self.bn = nn.BatchNorm2d(out_ch)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        x = inputs[0]
        if self.aggregate_weight is not None:
            weights = torch.sigmoid(self.aggregate_weight).reshape(-1, 1, 1, 1, 1)
            x = (torch.stack(inputs) * weights).sum(0)
        return self.bn(self.pointwise(self.depthwise(self.relu(x))))


class RandomStage(nn.Module):
    """One randomly wired stage; the node order is a topological order because edges go from low to high index."""

    def __init__(self, in_ch: int, out_ch: int, edges: list[tuple[int, int]], num_nodes: int) -> None:
        super().__init__()
        self.preds = [[u for u, v in edges if v == n] for n in range(num_nodes)]
        has_succ = {u for u, _ in edges}
        self.outputs = [n for n in range(num_nodes) if n not in has_succ]
        self.nodes = nn.ModuleList(
            Node(out_ch, out_ch, len(p), 1) if p else Node(in_ch, out_ch, 1, 2) for p in self.preds
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        results: list[torch.Tensor] = []
        for node, preds in zip(self.nodes, self.preds, strict=True):
            results.append(node(*[results[u] for u in preds]) if preds else node(x))
        out = results[self.outputs[0]]
        for n in self.outputs[1:]:
            out = out + results[n]
        return out if len(self.outputs) == 1 else out / len(self.outputs)


class RandWire(nn.Module):
    """RandWire-WS; ``regime`` "small" (C=78 by default) or "regular" (C=154 by default, IOS's ``randwire_large``)."""

    def __init__(self, num_classes: int = 1000, regime: str = "small", channels: int | None = None,
                 num_nodes: int = 32, k: int = 4, p: float = 0.75, seed: int = 0) -> None:
        super().__init__()
        if regime not in ("small", "regular"):
            raise ValueError(f"regime must be 'small' or 'regular', got {regime!r}")
        c = channels or (78 if regime == "small" else 154)
        stem: list[nn.Module] = [nn.Conv2d(3, c // 2, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(c // 2)]
        if regime == "small":  # conv2 is a plain convolution; three random stages of N nodes
            stem += [nn.ReLU(inplace=True), nn.Conv2d(c // 2, c, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(c)]
            stages = [(c, c, num_nodes), (c, 2 * c, num_nodes), (2 * c, 4 * c, num_nodes)]
        else:  # conv2 is already a random stage, of N/2 nodes
            stages = [(c // 2, c, num_nodes // 2)] + [(c * 2**i, c * 2 ** (i + 1), num_nodes) for i in range(3)]
        self.stem = nn.Sequential(*stem)
        self.stages = nn.Sequential(*[
            RandomStage(c_in, c_out, ws_dag(n, k, p, seed + i), n) for i, (c_in, c_out, n) in enumerate(stages)
        ])
        self.classifier = nn.Sequential(nn.ReLU(inplace=True), nn.Conv2d(stages[-1][1], 1280, 1, bias=False),
                                        nn.BatchNorm2d(1280), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(1280, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(self.classifier(x), 1))


def create(batch_size: int = 1, num_classes: int = 1000, image_size: int = 224, regime: str = "small",
           channels: int | None = None, num_nodes: int = 32, k: int = 4, p: float = 0.75, seed: int = 0):
    """RandWire-WS (small regime, C=78, WS(32, 4, 0.75) by default; stage i's graph uses seed ``seed + i``) and a
    batch of 224x224 images."""
    model = RandWire(num_classes, regime, channels, num_nodes, k, p, seed)
    generator = torch.Generator().manual_seed(0)
    return model, (torch.randn(batch_size, 3, image_size, image_size, generator=generator),)
