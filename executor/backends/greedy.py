"""The next token of every row: the index of its largest logit, on CPU in one vectorised kernel.

Why: the runner picks every step's tokens with an argmax over the (B, vocab) logits (fp32 in
every run dtype), outside the timed step but inside every token's wall time. aten's argmax over
the last dimension is not vectorised on CPU: over Qwen3's 151936-entry vocabulary it took 65-130
us per fp32 row (bf16: 270-550), 1.1 ms per token at batch 16 inside the decode loop (4.2 ms at
batch 64, timed alone). `csrc/greedy.cpp` returns the same indices (the first among equal
values; the first NaN, which the runner never reaches because it stops on non-finite logits)
from two vector passes over each row: 0.2 ms per token at batch 16 in the same loop
(BENCHMARKS.md, "fifteenth pass").

Logits under MIN_ELEMENTS (fewer than one row of a real vocabulary), and anything else the
kernel does not take (another device or dtype, rows that are not contiguous, no compiler to
build it; the last said once), run torch.argmax, which returns the same tokens.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from executor.custom_ops._build import load_optional_kernel

KERNEL_SOURCE = Path(__file__).resolve().parent / "csrc" / "greedy.cpp"
DTYPES = (torch.float32, torch.bfloat16)
# One row of a real vocabulary is enough: at one and four rows of Qwen3's 151936 logits argmax
# took 131 and 261 us a call against the kernel's 20 and 32 (fp32, medians of 7 x 50 calls; the
# threshold had been 2^20 logits, which left batches 1-6 on argmax: ~1% of a bf16 batch-4 token).
# A run whose logits stay below it (the small built-in model's, vocabulary 512) never builds the
# kernel (BENCHMARKS.md, "forty-fifth pass").
MIN_ELEMENTS = 1 << 17

_lib = torch.library.Library("cann_cpu", "FRAGMENT")  # the namespace is defined by packed_linear
_lib.define("greedy_tokens(Tensor logits) -> Tensor")  # (B, V) -> (B, 1) int64


@functools.cache
def kernel_runs() -> bool:
    """The kernel is built and loaded (once per machine / process); a build that cannot happen is
    said once, and torch.argmax picks every token."""
    return load_optional_kernel(
        "cann_cpu::greedy_tokens",
        "cann_cpu_greedy",
        KERNEL_SOURCE,
        "greedy",
        "tokens are picked by torch.argmax instead",
    )


def next_tokens(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1, keepdim=True)` for (B, V) logits: (B, 1) int64 token ids."""
    if (
        logits.device.type == "cpu"
        and logits.dim() == 2
        and logits.dtype in DTYPES
        and logits.numel() >= MIN_ELEMENTS
        and logits.stride(1) == 1
        and kernel_runs()
    ):
        return torch.ops.cann_cpu.greedy_tokens.default(logits)
    return logits.argmax(-1, keepdim=True)
