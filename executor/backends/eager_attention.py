"""Causal attention of the eager prefill on CPU: this project's flash kernel instead of SDPA's.

Why: on the reference machine (2-core AMD EPYC with AVX512-BF16) PyTorch's CPU flash attention
ran one 2048-token Qwen3-0.6B layer (16 query heads, 8 KV heads, D = 128) in 123-136 ms in bf16,
~130 GFLOP/s where the same machine's bf16 GEMMs run ~420, and that was 40% of the prefill.
`cann_cpu::causal_attention` (csrc/causal_attention.cpp) ran the same layer in 50-57 ms, and 2.5-3x
faster at 128 and 512 tokens too (BENCHMARKS.md, "twelfth pass"): it packs each KV head once for
AVX512-BF16's dot product, computes all the query heads of a group against each packed block, and
never computes the blocks above the diagonal.

Why fp32 too (the kernel's AVX2 loop, 6 x 16 tiles as in rows_linear's): on an AVX2-only CPU (Zen 3)
SDPA ran the fp32 2048-token layer at ~127 GFLOP/s where the same CPU's fp32 GEMMs run ~180, 26%
of the fp32 prefill (BENCHMARKS.md, "sixty-second pass"). On an AVX-512 CPU (Zen 4) the same loop
ran one 0.6B layer in 0.71x / 0.54x / 0.79x SDPA's time at 128 / 512 / 2048 tokens, and the fp32
prefill took 0.92x / 0.93x the time at 512 / 2048 (level at 128; "sixty-ninth pass").

Why a wide fp32 loop on a CPU with AMX (AVX-512F, 6 x 64 tiles as the bf16 loop's; `wide_f32`): there
SDPA ran the fp32 0.6B layer at 80-206 GFLOP/s and the AVX2 loop in 0.99-1.04x / 0.79-0.83x /
1.19-1.25x its time at 128 / 512 / 2048 tokens, where the CPU's fp32 GEMMs run ~360-400; the wide
loop ran it in 0.81-0.86x / 0.53-0.58x / 0.78-0.83x SDPA's time, and the fp32 prefill in 0.997x /
0.961x / 0.957x (BENCHMARKS.md, "seventy-eighth pass"). Zen 4 keeps the AVX2
loop (measured there; the wide one is not), and in bf16 a CPU with AMX keeps SDPA, which won there.

Only the plain causal case goes through here: `AttentionKernel.attention`, installed over the op
table's reference attention around the runner's eager prefill (executor.backends.eager_kernels),
takes a prefill from slot 0 (the mask the reference passes to SDPA as `is_causal`) on CPU in bf16
with whole 64-wide heads, or in fp32 with whole heads of its loop's tile (16 wide, 64 on a CPU with
AMX). Every other call (another mask, a head_dim the kernel does not tile, a CPU without the
dtype's loop, bf16 on a CPU with AMX) is the reference's, SDPA as before. The kernel is built on the
first call that qualifies, like a custom op's; where it cannot be built one line says so and
SDPA runs the calls. metrics.json records which kernel ran (`prefill_attention`).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from executor.custom_ops._build import cpu_has_amx, cpu_has_avx2, cpu_has_avx512, load_optional_kernel
from executor.ops import reference

KERNEL = "cann_cpu::causal_attention"
KERNEL_SOURCE = Path(__file__).resolve().parent / "csrc" / "causal_attention.cpp"
WIDE_COLS = 64  # the tile width of the bf16 loop and of the wide fp32 one (AVX-512), over keys and output columns
NARROW_COLS = 16  # the AVX2 fp32 loop's
DTYPES = (torch.bfloat16, torch.float32)

_lib = torch.library.Library("cann_cpu", "FRAGMENT")  # the namespace is defined by packed_linear
_lib.define("causal_attention(Tensor q, Tensor k, Tensor v, float scale, bool wide=False) -> Tensor")
_lib.define("causal_attention_supported(ScalarType dtype) -> bool")


@functools.cache
def kernel_runs(dtype: torch.dtype = torch.bfloat16) -> bool:
    """The kernel is built and loaded (once per machine / process) and this CPU runs its loop for
    `dtype` (bf16: AVX512-BF16; fp32: AVX2 and FMA). A build that cannot happen is said once, not
    raised: SDPA then runs every call."""
    if not (cpu_has_avx512(torch.bfloat16) if dtype == torch.bfloat16 else dtype == torch.float32 and cpu_has_avx2()):
        return False  # not built where it could never run
    built = load_optional_kernel(
        KERNEL,
        "cann_cpu_causal_attention",
        KERNEL_SOURCE,
        "eager_attention",
        "the prefill attention runs on SDPA instead",
    )
    return built and bool(torch.ops.cann_cpu.causal_attention_supported(dtype))


@functools.cache
def wide_f32() -> bool:
    """fp32 calls run the wide loop (AVX-512F, 64 columns): on a CPU with AMX (the module docstring)."""
    return cpu_has_amx() and cpu_has_avx512(torch.float32)


def head_dim_multiple(dtype: torch.dtype) -> int:
    """The head_dim the loop taken for `dtype` tiles whole."""
    return NARROW_COLS if dtype == torch.float32 and not wide_f32() else WIDE_COLS


@functools.cache
def takes_prefill(dtype: torch.dtype = torch.bfloat16) -> bool:
    """The eager prefill's causal attention in `dtype` (bf16 or fp32) goes to the kernel where it
    runs, except bf16 on a CPU with AMX. On the one AMX host measured (an Intel Xeon) SDPA's CPU flash
    attention ran the bf16 2048-token 0.6B prefill in 1769 ms against 3744 with the kernel
    (BENCHMARKS.md, "twenty-fifth pass"; likely its blocks on AMX tiles through oneDNN's brgemm, not
    profiled), and 0.25-0.33x the kernel's time for one layer at 128-2048 tokens ("seventy-eighth
    pass"); in fp32 the wide loop runs there (wide_f32)."""
    if dtype == torch.bfloat16:
        return not cpu_has_amx() and kernel_runs(dtype)
    return dtype == torch.float32 and kernel_runs(dtype)


def qualifies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Tensors the kernel takes: bf16 or fp32 on CPU, (B, H, S, D) with as many keys as queries,
    whole heads of the tile width of the dtype's loop (head_dim_multiple), grouped heads, nothing to
    differentiate."""
    return (
        q.device.type == "cpu"
        and q.dtype == k.dtype == v.dtype
        and q.dtype in DTYPES
        and q.dim() == k.dim() == v.dim() == 4
        and k.shape == v.shape
        and q.shape[0] == k.shape[0]
        and q.shape[2] == k.shape[2] > 0
        and q.shape[3] == k.shape[3]
        and q.shape[3] % head_dim_multiple(q.dtype) == 0
        and q.shape[1] % k.shape[1] == 0
        and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
    )


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T scale, causal) v with the kernel; q (B, Hq, S, D), k and v (B, Hkv, S, D), bf16
    or fp32 (on the wide loop where wide_f32). The caller checked `qualifies` and `kernel_runs`."""
    rows_contiguous = [t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v)]
    wide = q.dtype == torch.float32 and wide_f32()
    return torch.ops.cann_cpu.causal_attention(*rows_contiguous, q.shape[-1] ** -0.5 if scale is None else scale, wide)


class AttentionKernel:
    """`attention` for the op table: the kernel for a prefill from slot 0 (the plain causal mask)
    that qualifies, the reference for every other call; `calls` is what metrics.json reports."""

    def __init__(self):
        self.calls = 0

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
        if q.shape[2] > 1 and qualifies(q, k, v) and takes_prefill(q.dtype) and reference.is_causal_mask(mask):
            self.calls += 1
            return causal_attention(q, k, v, scale)
        return reference.attention(q, k, v, mask, scale)
