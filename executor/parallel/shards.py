"""Which part of a full (single-device) tensor a rank's parameter holds.

A sharded parameter carries a `ShardSpec`: the full tensor's shape and, per dimension, the
ranges of it this rank keeps (concatenated in order) or None for all of it. One spec per
parameter describes every split the layers make: a block of rows (column-parallel, vocabulary),
a block of columns (row-parallel), one block per fused part ([q | k | v], [gate | up]), a range
of experts. The loader reads exactly those ranges from the checkpoint (executor.loader) and
random initialisation cuts them from the full tensor (so a sharded model with random weights is
the same model as on one device).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

Ranges = tuple[tuple[int, int], ...]  # [start, stop) ranges along one dimension, concatenated
Index = tuple[Ranges | None, ...]  # per dimension; None = the whole dimension


@dataclass(frozen=True)
class ShardSpec:
    full_shape: tuple[int, ...]
    index: Index

    def local_shape(self) -> tuple[int, ...]:
        return tuple(
            full if ranges is None else sum(b - a for a, b in ranges)
            for full, ranges in zip(self.full_shape, self.index)
        )

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of an in-memory full tensor."""
        return read_index(lambda idx: full[tuple(slice(a, b) for a, b in idx)], tuple(full.shape), self.index)


def shard_spec(param: torch.Tensor) -> ShardSpec | None:
    """The parameter's spec, or None when it holds the full tensor (replicated or world size 1)."""
    return getattr(param, "shard", None)


def mark(param: torch.nn.Parameter, full_shape: Sequence[int], index: Index) -> torch.nn.Parameter:
    """Attach a spec to `param` (a no-op spec, all None, is not attached)."""
    if any(ranges is not None for ranges in index):
        param.shard = ShardSpec(tuple(full_shape), tuple(index))
        if param.shape != param.shard.local_shape():
            raise ValueError(f"parameter of shape {tuple(param.shape)} marked with {param.shard}")  # a layer bug
    return param


def rows(index: int, count: int, size: int) -> tuple[int, int]:
    """The index-th of `count` equal blocks of `size` elements."""
    step = size // count
    return index * step, (index + 1) * step


def read_index(read_box: Callable[[tuple[tuple[int, int], ...]], torch.Tensor], shape, index: Index) -> torch.Tensor:
    """Assemble `index` of a tensor of `shape` from box reads (one [start, stop) per dimension).

    A dimension with several ranges is read range by range and concatenated, so a reader that
    can only take rectangular boxes (safetensors' get_slice) reads exactly the kept elements."""
    boxes = [ranges if ranges is not None else ((0, n),) for ranges, n in zip(index, shape)]
    boxes += [((0, n),) for n in shape[len(index) :]]
    multi = next((d for d, ranges in enumerate(boxes) if len(ranges) > 1), None)
    if multi is None:
        return read_box(tuple(ranges[0] for ranges in boxes))
    parts = []
    for r in boxes[multi]:
        sub = tuple((r,) if d == multi else tuple(ranges) for d, ranges in enumerate(boxes))
        parts.append(read_index(read_box, shape, sub))
    return torch.cat(parts, dim=multi)
