"""cann_cpu::packed_call (executor/backends/csrc/packed_call.cpp): the op compiled decode graphs call
for a batched linear where the kernel library is built. It serves a call from a C++ table of what
`packed_linear` last chose for the weight, and must never serve a stale or dead entry: a weight
changed in place, another row count, a weight gone, an inference tensor all go to packed_linear,
which decides and remembers again. Every result is compared with packed_linear's own (the same loop
on the same packed copy: equal) and with fp32 `linear`.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from executor.backends import packed_linear

pytestmark = pytest.mark.skipif(
    not (packed_linear.kernel_cols(torch.float32) and packed_linear.kernel_runs(torch.float32)),
    reason="no AVX2 on this CPU, or the kernel library (which holds packed_call) could not be built",
)
DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}, torch.float32: {"rtol": 1e-5, "atol": 1e-4}}


def stats() -> tuple[int, int]:
    """(calls served from the table, calls sent to packed_linear) so far."""
    hits, misses, _ = torch.ops.cann_cpu.packed_call_stats()
    return hits, misses


def call(x, w, b=None):
    """packed_call, and how many of its calls the table served / sent to packed_linear."""
    before = stats()
    y = torch.ops.cann_cpu.packed_call(x, w, b)
    after = stats()
    return y, (after[0] - before[0], after[1] - before[1])


def reference(x, w, b=None):
    return torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())


def weight_and_rows(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A 256 x 128 weight and 4 rows of x in `dtype` (skips where nothing here runs the dtype)."""
    if not (packed_linear.supported(dtype) or packed_linear.kernel_runs(dtype)):
        pytest.skip(f"neither oneDNN (natively) nor the kernel runs {dtype} here")
    torch.manual_seed(seed)
    return (torch.randn(256, 128) * 0.1).to(dtype), torch.randn(4, 128).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_repeat_calls_are_served_from_the_table_with_packed_linears_result(dtype):
    w, x = weight_and_rows(dtype, 0)
    b = torch.randn(256).to(dtype)  # bf16: the loop converts it to fp32 itself
    first, counted = call(x, w, b)
    assert counted == (0, 1)  # nothing remembered yet: packed_linear decides, packs and remembers
    for _ in range(2):
        again, counted = call(x, w, b)
        assert counted == (1, 0)
        assert torch.equal(again, first)
    assert torch.equal(first, packed_linear.packed_linear(x, w, b))
    torch.testing.assert_close(first.float(), reference(x, w, b), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_a_weight_changed_in_place_or_another_row_count_goes_back_to_packed_linear(dtype):
    """A stale packed copy would give the old product (off by x's row sums here)."""
    w, x = weight_and_rows(dtype, 1)
    call(x, w)
    call(x, w)
    w.add_(1.0)
    y, counted = call(x, w)
    assert counted == (0, 1)
    torch.testing.assert_close(y.float(), reference(x, w), **TOLERANCE[dtype])
    assert call(x, w)[1] == (1, 0)  # remembered again, at the new version
    # past the kernel's rows (oneDNN's packed copy for that count, or aten where oneDNN would emulate)
    many = torch.randn(packed_linear.max_kernel_rows(dtype) + 1, 128).to(dtype)
    y, counted = call(many, w)
    assert counted == (0, 1)
    torch.testing.assert_close(y.float(), reference(many, w), **TOLERANCE[dtype])
    y, counted = call(many, w)
    assert counted == ((1, 0) if packed_linear.supported(dtype) else (0, 1))  # aten keeps nothing to remember
    torch.testing.assert_close(y.float(), reference(many, w), **TOLERANCE[dtype])
    # the entry is the last row count's (aten remembers nothing: the 4 rows' entry stands)
    assert call(x, w)[1] == ((0, 1) if packed_linear.supported(dtype) else (1, 0))


def test_the_table_keeps_no_packed_copy_alive_and_a_dead_weights_entry_never_matches():
    torch.manual_seed(2)
    x = torch.randn(4, 128)
    w = torch.randn(256, 128) * 0.1
    call(x, w)
    assert call(x, w)[1] == (1, 0)
    packed = weakref.ref(packed_linear._packed.kept(w))
    del w
    gc.collect()
    assert packed() is None  # dropped with the weight, though the table had an entry for it
    entries = []
    for _ in range(20):  # new weights of the same size (an allocator may reuse the old addresses)
        w = torch.randn(256, 128) * 0.1
        y, counted = call(x, w)
        assert counted == (0, 1)
        torch.testing.assert_close(y, reference(x, w), **TOLERANCE[torch.float32])
        entries.append(torch.ops.cann_cpu.packed_call_stats()[2])
    assert max(entries) == entries[0]  # each new weight's entry dropped the one before (dead by then)


def test_an_inference_tensor_is_never_remembered():
    """No version counter: an in-place change could not be seen, so every call asks packed_linear."""
    torch.manual_seed(3)
    with torch.inference_mode():
        w = torch.randn(256, 128) * 0.1
        x = torch.randn(4, 128)
        for _ in range(2):
            y, counted = call(x, w)
            assert counted == (0, 1)
        torch.testing.assert_close(y, reference(x, w), **TOLERANCE[torch.float32])
    with pytest.raises(RuntimeError, match="inference tensor has no version counter"):
        torch.ops.cann_cpu.packed_remember(w, w, 4, packed_linear.ROWS)


def test_graphs_call_packed_call_where_the_library_is_built():
    assert packed_linear.graph_op(torch.float32) is torch.ops.cann_cpu.packed_call.default
