"""executor.memo.TensorMemo: a value kept per tensor, recomputed after an in-place change, dropped
with the tensor (the packed weights of batched decode and the prefill's causal-mask check use it)."""

from __future__ import annotations

import torch

from executor.memo import TensorMemo


def counting():
    calls = []

    def compute():
        calls.append(1)
        return len(calls)

    return calls, compute


def test_computed_once_per_version_and_key():
    memo, t = TensorMemo(), torch.zeros(4)
    calls, compute = counting()
    assert memo.get(t, compute, "a") == memo.get(t, compute, "a") == 1
    assert memo.get(t, compute, "b") == 2  # another key: computed again
    t.add_(1)  # an in-place change is never served stale
    assert memo.get(t, compute, "b") == 3 and memo.kept(t) == 3
    assert len(calls) == 3


def test_dropped_with_its_tensor_and_never_served_to_a_new_one():
    memo = TensorMemo()
    calls, compute = counting()
    for _ in range(50):  # new tensors often land at a freed one's address (and id)
        t = torch.zeros(4)
        assert memo.get(t, compute) == len(calls)  # a fresh value: no hit from a dead tensor
        del t  # the last reference: the weak reference's callback drops the entry right away
        assert len(memo) == 0
    assert len(calls) == 50


def test_a_view_is_its_own_tensor():
    memo, t = TensorMemo(), torch.zeros(4)
    _, compute = counting()
    memo.get(t, compute)
    assert memo.kept(t.view(2, 2)) is None


def test_inference_tensors_are_computed_every_time():
    memo = TensorMemo()
    calls, compute = counting()
    with torch.inference_mode():
        t = torch.zeros(4)
    memo.get(t, compute)
    memo.get(t, compute)
    assert len(calls) == 2 and len(memo) == 0
