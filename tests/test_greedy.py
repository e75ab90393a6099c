"""The runner's token choice on CPU (executor.backends.greedy, csrc/greedy.cpp) against torch.argmax.

Greedy decoding is only right if every row's token is exactly argmax's: the first index among
equal values, in both dtypes, for any vocabulary length (the kernel works in blocks of vector
lanes, so lengths around a block edge matter), on rows that are not packed one after another.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from executor.backends import greedy
from tests.fresh_python import run_as_capability
from tests.no_compiler import run_without_compiler

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def kernel():
    if not greedy.kernel_runs():
        pytest.skip("no compiler to build the kernel")


def assert_argmax(logits: torch.Tensor) -> None:
    got = torch.ops.cann_cpu.greedy_tokens(logits)
    assert got.dtype == torch.int64 and got.shape == (logits.shape[0], 1)
    assert torch.equal(got, logits.argmax(-1, keepdim=True)), (got.flatten(), logits.argmax(-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_rows_of_every_length_around_a_block(kernel, dtype):
    torch.manual_seed(0)
    for vocab in (1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 4096, 151936):
        for batch in (1, 3, 16):
            assert_argmax(torch.randn(batch, vocab).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_first_of_equal_values_wins_in_the_body_and_the_tail(kernel, dtype):
    torch.manual_seed(1)
    x = torch.randn(6, 77).to(dtype)
    x[0, [5, 9]] = 9.0  # two lanes of one block
    x[1, [3, 40]] = 9.0  # two blocks
    x[2, [70, 75]] = 9.0  # both in the tail after the last whole block
    x[3, [63, 70]] = 9.0  # body, then tail
    x[4] = -float("inf")  # nothing larger than -inf: index 0
    x[5] = 0.0
    x[5, 30] = -0.0  # equal to 0.0: the first zero still wins
    assert_argmax(x)
    ties = torch.zeros(2, 4096).to(dtype)  # bf16 logits tie often: all equal
    assert_argmax(ties)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_counts_as_largest_and_inf_below_it(kernel, dtype):
    x = torch.zeros(4, 70).to(dtype)
    x[0, 66] = float("nan")  # in the tail, after an inf in the body
    x[0, 3] = float("inf")
    x[1, [20, 50]] = float("nan")
    x[2, 12] = float("inf")
    x[3, 69] = float("nan")
    assert_argmax(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_apart_in_memory(kernel, dtype):
    torch.manual_seed(2)
    wide = torch.randn(5, 300).to(dtype)
    rows = wide[:, 7:207]  # each row contiguous, rows 300 apart
    assert rows.stride() == (300, 1)
    assert_argmax(rows)


def test_next_tokens_uses_the_kernel_on_large_logits_and_argmax_elsewhere(kernel):
    torch.manual_seed(3)
    large = torch.randn(8, greedy.MIN_ELEMENTS // 8 + 1)
    assert torch.equal(greedy.next_tokens(large), large.argmax(-1, keepdim=True))
    columns = torch.randn(greedy.MIN_ELEMENTS // 4, 4).t()  # column stride 4: not the kernel's layout
    assert torch.equal(greedy.next_tokens(columns), columns.argmax(-1, keepdim=True))
    half = torch.randn(8, greedy.MIN_ELEMENTS // 8).half()
    assert torch.equal(greedy.next_tokens(half), half.argmax(-1, keepdim=True))


class _Ops(TorchDispatchMode):
    """Records the ops a call runs (a real dispatch mode: every op still runs)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def ops_of(logits: torch.Tensor) -> list[str]:
    with _Ops() as ops:
        tokens = greedy.next_tokens(logits)
    assert torch.equal(tokens, logits.argmax(-1, keepdim=True))
    return ops.names


def test_one_row_of_qwens_vocabulary_takes_the_kernel_the_built_in_models_logits_do_not(kernel):
    """At batch 1 aten's argmax over 151936 fp32 logits took 131 us, the kernel 20 (BENCHMARKS.md,
    "forty-fifth pass"); the built-in model's logits (vocabulary 512) stay on argmax even at batch
    64, so a run of it never builds the kernel."""
    torch.manual_seed(4)
    assert ops_of(torch.randn(1, 151936)) == ["cann_cpu.greedy_tokens.default"]
    assert ops_of(torch.randn(64, 512)) == ["aten.argmax.default"]


def test_without_a_compiler_the_tokens_come_from_argmax(tmp_path):
    code = (
        "import torch\n"
        "from executor.backends import greedy\n"
        "small = torch.randn(3, 1000)\n"
        "assert torch.equal(greedy.next_tokens(small), small.argmax(-1, keepdim=True))\n"
        "print('small logits: no build tried')\n"
        "x = torch.randn(8, greedy.MIN_ELEMENTS // 8)\n"
        "assert torch.equal(greedy.next_tokens(x), x.argmax(-1, keepdim=True))\n"
        "print('large logits: argmax')\n"
    )
    line, stdout = run_without_compiler(tmp_path, code, "greedy")
    assert "picked by torch.argmax instead" in line
    lines = stdout.splitlines()
    assert lines.index("small logits: no build tried") < lines.index(line) < lines.index("large logits: argmax")


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_the_narrower_builds_agree(kernel, capability):
    """The kernel as built for an AVX2 host or in plain C++ (an Arm host such as Kunpeng takes the
    latter), in a fresh Python told to report that capability (another build key, another build)."""
    code = (
        "import torch\n"
        "from executor.backends import greedy\n"
        "assert greedy.kernel_runs()\n"
        "torch.manual_seed(0)\n"
        "for dtype in (torch.float32, torch.bfloat16):\n"
        "    for vocab in (1, 17, 33, 100, 151936):\n"
        "        x = torch.randn(3, vocab).to(dtype)\n"
        "        x[1, -1] = x[1].max()\n"  # a tie in the tail
        "        assert torch.equal(torch.ops.cann_cpu.greedy_tokens(x), x.argmax(-1, keepdim=True)), (dtype, vocab)\n"
    )
    run_as_capability(code, capability)
