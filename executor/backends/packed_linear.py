"""Decode GEMMs with a few rows (batch > 1) on CPU: each weight packed once, for oneDNN or a bf16 kernel.

Why: a batched decode step multiplies a handful of rows (M = batch, 2-64) by every weight
matrix, so it is still a stream over the weights. aten's linear re-lays the weight out on every
call at these shapes: on the 2-core reference machine it streamed a 100 MB fp32 weight at 5-6
GB/s for M = 4-16 (MKL sgemm) and a bf16 one at 11-16 GB/s (oneDNN with a per-call reorder),
against ~30 GB/s of read bandwidth. With the weight reordered once into oneDNN's blocked layout
(`mkldnn._reorder_linear_weight`, the packing Inductor's freezing does), the same call ran at
27-29 GB/s for M = 4 in both dtypes, and at 140 (fp32) / 290 (bf16) GFLOP/s for M = 16
(BENCHMARKS.md, "fourth pass").

In bf16, on a CPU with AVX512-BF16, up to 16 rows, the call is this project's own kernel instead
(`cann_cpu::bf16_rows_linear`, csrc/bf16_rows_linear.cpp) on the weight packed for vdpbf16ps: on
the 0.6B shape's projections it read the weights at 0.97-1.0x of a sum's rate at M = 4 where
oneDNN read 0.73-0.78x, and ran 1.1x oneDNN's GFLOP/s at M = 16 (BENCHMARKS.md, "eighth pass").
It is compiled on first use like a custom op's kernel; where it cannot be built (no compiler) one
line says so and oneDNN runs the call.

The packed copy is made on the first decode call from the live weight and kept next to it
(executor.memo: dropped with the weight, remade if the weight is changed in place), so the compiled
graph keeps taking the model's own parameters and the eager prefill keeps using them. The cost
is memory: one more copy of every packed weight (executor.memory counts it).

`pack_batched_linears` is the FX pass (run by executor.backends.inductor on CPU decode graphs
before Inductor sees them); `cann_cpu::packed_linear` is the op it puts in their place, one
opaque extern call, so it also sits inside a SuperKernel scope's launch unit.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from executor.custom_ops._build import KernelBuildError, load_kernel
from executor.memo import TensorMemo

# Weights smaller than this (elements) stay with aten: they sit in cache, and a call of this op
# (Python dispatch plus oneDNN's per-call setup, ~30 us on a 64 x 64 weight) would cost more than
# the reorder saves. The overhead-bound sizes' weights are all below it; every Qwen3-0.6B
# projection is above.
MIN_WEIGHT_NUMEL = 1 << 20

# The bf16 kernel's limits: whole 64-column blocks, whole k pairs, at most MAX_KERNEL_ROWS rows.
# In the 0.6B-shape decode step (ge_graph, one process, kernel and oneDNN alternating, 5 rounds)
# the kernel took the step to 0.75x at batch 4 and 0.86x at batch 16, but to 1.09x at batch 64,
# although alone it out-ran oneDNN there too; 32 rows gave 0.96x, inside its rounds' spread
# (0.88-1.09), so the cap stays where the gain is clear. A single row stays with the GEMV lowering:
# the kernel there made the batch-1 step 1.10x slower (likely the Python dispatch of 113 calls per
# step; not measured apart).
KERNEL_COLS = 64
MAX_KERNEL_ROWS = 16
KERNEL_SOURCE = Path(__file__).resolve().parent / "csrc" / "bf16_rows_linear.cpp"

_packed: TensorMemo[torch.Tensor] = TensorMemo()  # weight -> its packed copy, per rows hint (or "bf16_rows")


def supported(dtype: torch.dtype) -> bool:
    """oneDNN is in this torch build and runs `dtype` natively on this CPU (bf16 needs avx512_bf16
    or AMX; without them oneDNN emulates it, slower than aten)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


# Defined with the low-level Library API, not `torch.library.custom_op`: a decode step calls it
# once per projection (113 times at the 0.6B shape), and custom_op's Python wrapper cost 27-47 us
# more per call than this plain dispatcher registration on the reference machine (two
# micro-benchmarks; BENCHMARKS.md, "sixth pass"): 3-5 ms of a ~60 ms bf16 batch-4 step.
_lib = torch.library.Library("cann_cpu", "DEF")
_lib.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_lib.define("bf16_rows_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor")  # kernel: csrc/
_lib.define("bf16_rows_supported() -> bool")


@functools.cache
def bf16_kernel() -> bool:
    """The bf16 kernel is built and loaded, and this CPU runs it. Built once per machine, on the
    first ask (a decode graph's compile); a build that cannot happen is said once, not raised:
    oneDNN then runs every call, as before the kernel existed."""
    if not supported(torch.bfloat16):
        return False
    try:
        load_kernel("cann_cpu::bf16_rows_linear", "cann_cpu_bf16_rows_linear", [str(KERNEL_SOURCE)], remedy="")
    except KernelBuildError as exc:
        print(f"[packed_linear] {exc}; bf16 batched decode GEMMs run on oneDNN instead", flush=True)
        return False
    return bool(torch.ops.cann_cpu.bf16_rows_supported())


def kernel_fits(weight: torch.Tensor, rows: int) -> bool:
    """The bf16 kernel runs this product: bf16, whole column blocks and k pairs, few rows, a CPU with it."""
    n, k = weight.shape
    return (
        weight.dtype == torch.bfloat16 and n % KERNEL_COLS == 0 and k % 2 == 0 and rows <= MAX_KERNEL_ROWS
    ) and bf16_kernel()


def pack_bf16_rows(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) -> (N/64, K/2, 64, 2): per 64-column block, k pairs outermost (vdpbf16ps's operand)."""
    n, k = weight.shape
    return weight.detach().contiguous().view(n // KERNEL_COLS, KERNEL_COLS, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`linear(x, weight, bias)` on `weight` packed once: the bf16 kernel where it fits, else oneDNN
    (packed for x's row count)."""
    rows = x.numel() // x.shape[-1]
    if kernel_fits(weight, rows):
        packed = _packed.get(weight, lambda: pack_bf16_rows(weight), "bf16_rows")
        return torch.ops.cann_cpu.bf16_rows_linear(x, packed, bias)
    packed = _packed.get(weight, lambda: torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows), rows)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


_lib.impl("packed_linear", packed_linear, "CPU")


@torch.library.register_fake("cann_cpu::packed_linear")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("cann_cpu::bf16_rows_linear")
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed.shape[0] * packed.shape[2]))


def pack_batched_linears(gm: torch.fx.GraphModule) -> int:
    """Replace every `linear` with more than one input row and a weight of at least
    MIN_WEIGHT_NUMEL elements by `cann_cpu::packed_linear`. Single-row linears are left to the
    GEMV lowering. Returns how many were replaced (0 where oneDNN cannot run the dtype natively)."""
    replaced = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch._C._nn.linear:
            continue
        x, w = node.args[0], node.args[1]
        value = x.meta.get("example_value") if isinstance(x, torch.fx.Node) else None
        weight = w.meta.get("example_value") if isinstance(w, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor) or not isinstance(weight, torch.Tensor):
            continue
        if value.numel() == value.shape[-1] or weight.numel() < MIN_WEIGHT_NUMEL or not supported(weight.dtype):
            continue
        if value.dtype != weight.dtype or weight.dim() != 2:
            continue
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        with gm.graph.inserting_before(node):
            out = gm.graph.call_function(torch.ops.cann_cpu.packed_linear.default, (x, w, bias))
        out.meta.update(node.meta)
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        replaced += 1
    gm.recompile()
    return replaced
