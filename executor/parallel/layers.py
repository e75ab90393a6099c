"""Tensor-parallel layers, written once for every model (Megatron-style, as upstream shards them).

| layer                      | weight kept by a rank                 | communication                       |
|----------------------------|---------------------------------------|-------------------------------------|
| QKVParallelLinear          | its q heads, its (or a replicated) kv | none (output stays split by head)   |
|                            | head, one block per part of [q|k|v]   |                                     |
| MergedColumnParallelLinear | its block of gate and of up           | none                                |
| RowParallelLinear          | its block of the input dimension      | all-reduce of the output; bias after|
| VocabParallelEmbedding     | its block of the vocabulary           | masked lookup, all-reduce           |
| ParallelLMHead             | its block of the vocabulary           | all-gather of the logits            |

Each subclasses the torch layer it replaces and keeps its parameter names (`weight`, `bias`),
so checkpoints map the same way; with a group of one it computes what that layer does. The
projections go through `ops.linear` (F.linear in the reference table, so a compiled decode graph
is unchanged), which lets the eager CPU path give them its own kernels. Parameters carry a
ShardSpec saying which part of the full tensor they hold (the loader reads only that part).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor import ops
from executor.parallel.groups import Shard, all_gather_last
from executor.parallel.shards import mark, rows


def kv_head_range(index: int, size: int, num_kv_heads: int) -> tuple[int, int]:
    """KV heads of attention rank `index` of `size`: a block, or the one head it replicates."""
    if num_kv_heads >= size:
        return rows(index, size, num_kv_heads)
    head = index // (size // num_kv_heads)
    return head, head + 1


class QKVParallelLinear(nn.Linear):
    """Fused [q | k | v] projection; this rank's q heads and the kv heads they attend to."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool, shard: Shard):
        n, i, d = shard.size, shard.index, head_dim
        q0, q1 = rows(i, n, heads)
        k0, k1 = kv_head_range(i, n, kv_heads)
        self.heads, self.kv_heads = q1 - q0, k1 - k0  # this rank's
        super().__init__(hidden, (self.heads + 2 * self.kv_heads) * d, bias=bias)
        q, kv = heads * d, kv_heads * d
        parts = ((q0 * d, q1 * d), (q + k0 * d, q + k1 * d), (q + kv + k0 * d, q + kv + k1 * d))
        if n > 1:
            mark(self.weight, (q + 2 * kv, hidden), (parts, None))
            if bias:
                mark(self.bias, (q + 2 * kv,), (parts,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(nn.Linear):
    """Fused [gate | up] projection (no bias); this rank's block of each part."""

    def __init__(self, hidden: int, intermediate: int, shard: Shard):
        a, b = rows(shard.index, shard.size, intermediate)
        super().__init__(hidden, 2 * (b - a), bias=False)
        if shard.size > 1:
            mark(self.weight, (2 * intermediate, hidden), (((a, b), (intermediate + a, intermediate + b)), None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight)


class RowParallelLinear(nn.Linear):
    """Input dimension split; the partial outputs are summed over the group, then the bias added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, shard: Shard):
        a, b = rows(shard.index, shard.size, in_features)
        super().__init__(b - a, out_features, bias=bias)
        self.shard = shard
        if shard.size > 1:
            mark(self.weight, (out_features, in_features), (None, ((a, b),)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shard.size == 1:
            return ops.linear(x, self.weight, self.bias)
        y = self.shard.reduce(ops.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Vocabulary split: each rank looks up the ids in its block (zeros elsewhere), summed."""

    def __init__(self, vocab: int, hidden: int, shard: Shard):
        self.vocab_range = rows(shard.index, shard.size, vocab)
        super().__init__(self.vocab_range[1] - self.vocab_range[0], hidden)
        self.shard = shard
        if shard.size > 1:
            mark(self.weight, (vocab, hidden), ((self.vocab_range,), None))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shard.size == 1:
            return super().forward(ids)
        ids = self.shard.gather_rows(ids)  # (b', S) every attention-DP group's ids when the group spans them
        local = ids - self.vocab_range[0]
        inside = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        out = out.masked_fill(~inside.unsqueeze(-1), 0.0)
        return self.shard.own_rows(self.shard.reduce(out))


class ParallelLMHead(nn.Linear):
    """Vocabulary split: each rank computes its block of logits, all-gathered on every rank (so
    every rank takes the same greedy token without another message)."""

    def __init__(self, hidden: int, vocab: int, shard: Shard):
        self.vocab_range = rows(shard.index, shard.size, vocab)
        super().__init__(hidden, self.vocab_range[1] - self.vocab_range[0], bias=False)
        self.shard = shard
        if shard.size > 1:
            mark(self.weight, (vocab, hidden), ((self.vocab_range,), None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shard.size == 1:
            return ops.linear(x, self.weight)
        x = self.shard.gather_rows(x)
        logits = all_gather_last(ops.linear(x, self.weight), self.shard.group, self.shard.log)
        return self.shard.own_rows(logits)


def tie_embeddings(lm_head: ParallelLMHead, embed: VocabParallelEmbedding) -> bool:
    """Share one weight when both hold the same vocabulary block (always on one device); with
    different splits each keeps its own block, and the loader fills both from the embedding."""
    if lm_head.vocab_range != embed.vocab_range:
        return False
    lm_head.weight = embed.weight
    return True
