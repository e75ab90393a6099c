"""A value derived from a tensor, computed once while the tensor lives and again after it changes.

Why one helper: the decode path derives things from tensors it sees on every call and that rarely
change (whether a prefill mask is the plain causal one, a weight's oneDNN-packed copy). Keyed on
the tensor object (weakly: dropped with it) and checked against its version counter, so an
in-place change is never served stale. Inference-mode tensors have no version counter; for them
the value is computed on every call (correct, only slower; nothing in this project makes them).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import torch
from torch.utils.weak import WeakIdKeyDictionary

T = TypeVar("T")


class TensorMemo(Generic[T]):
    def __init__(self):
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> ((version, key), value)

    def get(self, tensor: torch.Tensor, compute: Callable[[], T], key: Hashable = None) -> T:
        """`compute()`'s value for `tensor` (and `key`, anything else the value depends on)."""
        if tensor.is_inference():
            return compute()
        stamp = (tensor._version, key)
        hit = self._seen.get(tensor)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        value = compute()
        self._seen[tensor] = (stamp, value)
        return value

    def kept(self, tensor: torch.Tensor) -> T | None:
        """The value kept for `tensor` (whatever its version now), None if there is none (tests)."""
        hit = self._seen.get(tensor)
        return None if hit is None else hit[1]
