"""Decode GEMMs with a few rows (batch > 1) on CPU: each weight packed once, for oneDNN or our kernel.

Why: a batched decode step multiplies a handful of rows (M = batch, 2-64) by every weight
matrix, so it is still a stream over the weights. aten's linear re-lays the weight out on every
call at these shapes: on the 2-core reference machine it streamed a 100 MB fp32 weight at 5-6
GB/s for M = 4-16 (MKL sgemm) and a bf16 one at 11-16 GB/s (oneDNN with a per-call reorder),
against ~30 GB/s of read bandwidth. With the weight reordered once into oneDNN's blocked layout
(`mkldnn._reorder_linear_weight`, the packing Inductor's freezing does), the same call ran at
27-29 GB/s for M = 4 in both dtypes, and at 140 (fp32) / 290 (bf16) GFLOP/s for M = 16
(BENCHMARKS.md, "fourth pass").

Up to a few rows the call is this project's own kernel instead (`cann_cpu::rows_linear`,
csrc/rows_linear.cpp) on the weight packed for its vector loop: 64-column blocks on a CPU with
AVX-512 (AVX512-BF16 for bf16), 16-column blocks on one with AVX2 only. With AVX-512, on the 0.6B
shape's projections at M = 4 it read the weights at 0.97-1.0x of a sum's rate where oneDNN read
0.73-0.78x in bf16 and 0.57-0.77x in fp32, and ran 1.1x oneDNN's GFLOP/s at M = 16 in bf16
(BENCHMARKS.md, "eighth" and "ninth pass"); for the AVX2 loop see "eighteenth pass". On an AVX2
CPU oneDNN emulates bf16, so there the kernel is what makes a batched bf16 step stream half the
bytes of fp32; past its rows such a call stays with aten. The kernel is compiled on first use
like a custom op's kernel; where it cannot be built (no compiler) one line says so and oneDNN (or
aten) runs the call.

On a CPU with AMX (an Intel Xeon) the bf16 calls of 2-64 rows go to the kernel's AMX loop instead
(`cann_cpu::amx_linear`, csrc/amx_linear.cpp, on the same packed layout): there oneDNN's AMX
products read the 0.6B projections at 0.53-0.69 of a sum's rate at 4-16 rows and the AVX-512 loop
at 0.33-0.52, the AMX loop at 0.73-0.91 (two passes; BENCHMARKS.md, "twenty-sixth pass"). fp32
has no AMX and takes the AVX-512 loop there too (`max_kernel_rows`).

The packed copy is made on the first decode call from the live weight and kept next to it
(executor.memo: dropped with the weight, remade if the weight is changed in place), so the compiled
graph keeps taking the model's own parameters and the eager prefill keeps using them. The cost
is memory: one more copy of every packed weight (executor.memory counts it).

`pack_batched_linears` is the FX pass (run by executor.backends.inductor on CPU decode graphs
before Inductor sees them). The op it puts in their place is one opaque extern call, so it also
sits inside a SuperKernel scope's launch unit: `cann_cpu::packed_call` where the kernel library is
built, else `cann_cpu::packed_linear`. packed_linear (below) is Python: it decides the loop and
finds the packed copy. packed_call (csrc/packed_call.cpp) finds what packed_linear last chose for
the weight in a C++ table and calls that loop directly, and calls packed_linear only when the
table has nothing valid (a first call, a weight changed in place, another row count). So a launch
unit's batched GEMMs no longer call back into Python: the SK decoder step took 0.975x the time at
bf16 batch 16, 0.94x at batch 4 and 0.95x at fp32 batch 16 (BENCHMARKS.md, "forty-second pass").
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from executor import huge_pages
from executor.custom_ops._build import cpu_has_amx, cpu_has_avx2, cpu_has_avx512, load_optional_kernel
from executor.memo import TensorMemo
from executor.platform import cpu_runs_bf16

# Weights smaller than this (elements) stay with aten: they sit in cache, and a call of this op
# (Python dispatch plus oneDNN's per-call setup, ~30 us on a 64 x 64 weight) would cost more than
# the reorder saves. The overhead-bound sizes' weights are all below it; every Qwen3-0.6B
# projection is above.
MIN_WEIGHT_NUMEL = 1 << 20

# The kernel's limits: whole column blocks (and whole k pairs in the AVX-512 bf16 layout), at most
# MAX_KERNEL_ROWS rows for the AVX-512 loop, MAX_AVX2_KERNEL_ROWS for the AVX2 one. In the
# 0.6B-shape decode step (ge_graph, one process, kernel and oneDNN alternating, 5 rounds, median
# ratio) the AVX-512 loop took the step to 0.75x (bf16) / 0.81x (fp32) at batch 4 and
# 0.86x / 0.91x at batch 16, but to 1.09x / 1.00x at batch 64, although alone it out-ran (bf16)
# or matched (fp32) oneDNN there; bf16 at 32 rows gave 0.96x, inside its rounds' spread
# (0.88-1.09). With the prefetch of the tenth pass bf16 batch 64 gave 0.96x (rounds 0.94-1.45).
# So the cap stayed at 16 (BENCHMARKS.md, "eighth" to "tenth pass"). Since the graphs call the
# kernel without Python (packed_call), it wins past 16 rows too (same method, 7 rounds): 0.95x
# the ge_graph step at bf16 batch 64, 0.97x SK decoder's, 0.95x at fp32 batch 64 and 0.93x at
# bf16 batch 32 (BENCHMARKS.md, "forty-third pass"). So the cap is the largest batch measured. A
# single row stays with the GEMV lowering: the kernel there made the bf16 batch-1 step 1.10x
# slower (likely the Python dispatch of 113 calls per step; not measured apart).
# The AVX2 loop beat the alternative at every batch measured on an AVX2-only host (same method):
# the fp32 step took 0.79x, 0.59x and 0.82x of oneDNN's at batch 4, 16 and 64; the bf16 step
# 0.27x, 0.17x and 0.16x of aten's emulated linear's (BENCHMARKS.md, "eighteenth pass"). So its
# cap is the largest batch measured.
MAX_KERNEL_ROWS = 64
MAX_AVX2_KERNEL_ROWS = 64
KERNEL_DTYPES = (torch.bfloat16, torch.float32)
KERNEL_SOURCE = Path(__file__).resolve().parent / "csrc" / "rows_linear.cpp"
CALL_SOURCE = KERNEL_SOURCE.with_name("packed_call.cpp")  # packed_call, built into the same library
# packed_remember's `kind`: the loop packed_linear chose (csrc/packed_call.cpp's Kind)
ROWS, AMX, ONEDNN = 0, 1, 2
# The AMX loop (csrc/amx_linear.cpp, its own library: built only on a CPU with AMX) takes bf16
# products of 2 to AMX_MAX_ROWS rows on the same packed layout as the AVX-512 bf16 loop, whole
# 64-column blocks and K a multiple of its 32-value chunks.
AMX_SOURCE = Path(__file__).resolve().parent / "csrc" / "amx_linear.cpp"
AMX_MAX_ROWS = 64
AMX_CHUNK = 32

_packed: TensorMemo[torch.Tensor] = TensorMemo()  # weight -> its packed copy, per rows hint (or "rows")


@functools.cache  # asked on every call (113 per 0.6B step): ~2 us uncached in bf16
def supported(dtype: torch.dtype) -> bool:
    """oneDNN is in this torch build and runs `dtype` natively on this CPU (bf16 needs avx512_bf16
    or AMX, `cpu_runs_bf16`; without them oneDNN emulates it, slower than our AVX2 loop)."""
    if dtype == torch.float32:
        return torch.backends.mkldnn.is_available()
    return dtype == torch.bfloat16 and cpu_runs_bf16()


# Defined with the low-level Library API, not `torch.library.custom_op`: a decode step calls it
# once per projection (113 times at the 0.6B shape), and custom_op's Python wrapper cost 27-47 us
# more per call than this plain dispatcher registration on the reference machine (two
# micro-benchmarks; BENCHMARKS.md, "sixth pass"): 3-5 ms of a ~60 ms bf16 batch-4 step.
_lib = torch.library.Library("cann_cpu", "DEF")
_lib.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_lib.define("rows_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor")  # kernel: csrc/rows_linear.cpp
_lib.define("rows_supported(ScalarType dtype, int cols) -> bool")
_lib.define("amx_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor")  # kernel: csrc/amx_linear.cpp
_lib.define("amx_supported() -> bool")
_lib.define("packed_call(Tensor x, Tensor weight, Tensor? bias) -> Tensor")  # kernel: csrc/packed_call.cpp
_lib.define("packed_remember(Tensor weight, Tensor packed, int rows, int kind) -> ()")
_lib.define("packed_call_stats() -> (int, int, int)")


@functools.cache
def _kernel_library() -> bool:
    """Build (once per machine) and load the kernel library, on the first ask (a decode graph's
    compile). A build that cannot happen is said once, not raised: oneDNN then runs every call,
    as before the kernel existed."""
    global _remember
    _remember = load_optional_kernel(
        "cann_cpu::rows_linear",
        "cann_cpu_rows_linear",
        [KERNEL_SOURCE, CALL_SOURCE],
        "packed_linear",
        "batched decode GEMMs run on oneDNN instead",
    )
    return _remember


_remember = False  # the library is loaded: packed_linear tells packed_call's table what it chose


@functools.cache
def amx_runs() -> bool:
    """The AMX loop is built and loaded, and this CPU (and its kernel) lets the process use AMX-BF16
    tiles. Asked first on a CPU with AMX only: elsewhere the library is never built."""
    return (
        cpu_has_amx()
        and load_optional_kernel(
            "cann_cpu::amx_linear",
            "cann_cpu_amx_linear",
            AMX_SOURCE,
            "packed_linear",
            "batched bf16 decode GEMMs run on oneDNN instead",
        )
        and bool(torch.ops.cann_cpu.amx_supported())
    )


def amx_fits(weight: torch.Tensor, rows: int, max_rows: int = AMX_MAX_ROWS) -> bool:
    """The AMX loop runs this product: bf16, whole 64-column blocks, K in whole chunks, 2 to
    `max_rows` rows (a decode graph's batch: AMX_MAX_ROWS; the eager path, on the weight as stored,
    takes more: eager_linear.AMX_STORED_MAX_ROWS), a CPU with AMX. A single row stays with the GEMV
    kernel on the weight as stored: the loop on its packed copy read the 0.6B weights at 0.84 of a
    sum's rate against the kernel's 0.78, but a graph's bf16 batch-1 step sending its single rows
    there took as long (ge_graph 68.0 against 68.1 ms, SK decoder 58.5 against 57.3; 8 rounds in
    turns, one process) and would keep a second copy of every weight (BENCHMARKS.md, "seventy-second
    pass"; the twenty-sixth had read both at 0.92-0.93). Since the kernel runs a single bf16 row as
    two streams a thread on an Intel CPU it read 0.86-0.89 ("seventy-third pass")."""
    return 1 < rows <= max_rows and _amx_fits(*weight.shape, weight.dtype)


@functools.cache  # asked on every call
def _amx_fits(n: int, k: int, dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and n % 64 == 0 and k % AMX_CHUNK == 0 and amx_runs()


@functools.cache  # asked on every call, twice: the CPU does not change
def kernel_cols(dtype: torch.dtype) -> int:
    """Columns per packed block of the kernel's loop for `dtype` on this CPU: 64 with AVX-512
    (AVX512-BF16 for bf16), 16 with AVX2, 0 where neither runs."""
    if dtype not in KERNEL_DTYPES:
        return 0
    if cpu_has_avx512(dtype):
        return 64
    return 16 if cpu_has_avx2() else 0


@functools.cache  # asked on every call, through _fits's cache
def max_kernel_rows(dtype: torch.dtype) -> int:
    """The most rows the kernel's AVX-512 and AVX2 loops take on this CPU (past them oneDNN, or aten,
    runs the call). No bf16 rows on a CPU with AMX: there the AMX loop takes them (`amx_fits`), and
    oneDNN's AMX products had run the 0.6B-shape bf16 step in 0.70x / 0.59x the AVX-512 loop's time
    at batch 4 / 16 (BENCHMARKS.md, "twenty-fifth pass"). fp32 has no AMX, and there the AVX-512
    loop, once its threads took each other's leftover blocks and the graphs called it without
    Python, ran the ge_graph step level with oneDNN at batch 4 (1.00x, 10 alternating rounds) and
    faster at 16 and 64 (0.87x, 0.93x; SK decoder at 16 0.88x; "fifty-seventh pass"), where in the
    twenty-fifth pass oneDNN had been ahead (0.79x / 0.94x of the loop's time at batch 4 / 16)."""
    if cpu_has_amx() and dtype == torch.bfloat16 and supported(dtype):
        return 0
    return MAX_KERNEL_ROWS if kernel_cols(dtype) == 64 else MAX_AVX2_KERNEL_ROWS


def packs(dtype: torch.dtype, rows: int) -> bool:
    """A decode graph of `rows` rows keeps packed copies of its large `dtype` weights (memory
    estimate): oneDNN runs the dtype natively, or this CPU has a loop of the kernel that takes the
    rows (asked without building the kernel)."""
    return supported(dtype) or (bool(kernel_cols(dtype)) and rows <= max_kernel_rows(dtype))


@functools.cache
def kernel_runs(dtype: torch.dtype) -> bool:
    """The kernel is built and loaded, and this CPU runs it for `dtype` (bf16 or fp32)."""
    cols = kernel_cols(dtype)
    return bool(cols) and _kernel_library() and bool(torch.ops.cann_cpu.rows_supported(dtype, cols))


def kernel_fits(weight: torch.Tensor, rows: int) -> bool:
    """The kernel runs this product: whole column blocks (and k pairs in the AVX-512 bf16 layout), few
    rows, a CPU with it."""
    return _fits(*weight.shape, weight.dtype, rows)


@functools.cache  # asked on every call: ~1 us uncached, a handful of shapes per model
def _fits(n: int, k: int, dtype: torch.dtype, rows: int) -> bool:
    cols = kernel_cols(dtype)
    if not cols or n % cols or rows > max_kernel_rows(dtype):
        return False
    return (cols != 64 or dtype != torch.bfloat16 or k % 2 == 0) and kernel_runs(dtype)


def pack_rows(weight: torch.Tensor, cols: int | None = None) -> torch.Tensor:
    """The kernel's layout, per block of `cols` columns (default: this CPU's, `kernel_cols`):
    - 64, bf16: (N, K) -> (N/64, K/2, 64, 2), k pairs outermost (vdpbf16ps's operand);
    - 64 or 16, fp32: (N, K) -> (N/cols, K, cols), each k step's columns together;
    - 16, bf16: the same shape, each k step's columns interleaved 0, 8, 1, 9, ..., 7, 15 (the AVX2
      loop widens the even and the odd values to fp32 with one shift and one mask)."""
    n, k = weight.shape
    cols = cols or kernel_cols(weight.dtype)
    w = weight.detach().contiguous()
    if weight.dtype == torch.bfloat16:
        if cols == 64:
            return huge_pages.contiguous(w.view(n // cols, cols, k // 2, 2).permute(0, 2, 1, 3))
        return huge_pages.contiguous(w.view(n // cols, 2, cols // 2, k).permute(0, 3, 2, 1)).view(n // cols, k, cols)
    return huge_pages.contiguous(w.view(n // cols, cols, k).permute(0, 2, 1))


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`linear(x, weight, bias)` on `weight` packed once: the AMX loop or the kernel where they fit,
    else oneDNN (packed for x's row count), or aten where oneDNN would emulate the dtype (bf16 on
    AVX2)."""
    rows = x.numel() // x.shape[-1]
    amx = amx_fits(weight, rows)
    if amx or kernel_fits(weight, rows):
        # one packed copy for both loops: on AMX the AVX-512 bf16 layout, (N/64, K/2, 64, 2)
        packed = _packed.get(weight, lambda: pack_rows(weight, 64 if amx else None), "rows")
        if _remember and not weight.is_inference():
            torch.ops.cann_cpu.packed_remember.default(weight, packed, rows, AMX if amx else ROWS)
        if bias is not None and bias.dtype != torch.float32:  # the kernels add it in fp32: convert once
            bias = _packed.get(bias, lambda: bias.detach().float(), "fp32")
        if amx:
            return torch.ops.cann_cpu.amx_linear.default(x, packed, bias)
        return torch.ops.cann_cpu.rows_linear.default(x, packed, bias)  # .default: ~1 us less per call than the packet
    if not supported(weight.dtype):
        return torch.nn.functional.linear(x, weight, bias)
    packed = _packed.get(weight, lambda: torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows), rows)
    if _remember and not weight.is_inference():
        torch.ops.cann_cpu.packed_remember.default(weight, packed, rows, ONEDNN)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


_lib.impl("packed_linear", packed_linear, "CPU")


@torch.library.register_fake("cann_cpu::packed_linear")
@torch.library.register_fake("cann_cpu::packed_call")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("cann_cpu::amx_linear")
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    n = packed.shape[0] if packed.dim() == 2 else packed.shape[0] * packed.shape[2]  # as stored, or (N/64, K/2, 64, 2)
    return x.new_empty((*x.shape[:-1], n))


@torch.library.register_fake("cann_cpu::rows_linear")
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if packed.dim() == 2:  # the weight as stored, (N, K)
        return x.new_empty((*x.shape[:-1], packed.shape[0]))
    cols = packed.shape[2]  # (N/cols, K, cols) or, bf16 on AVX-512, (N/64, K/2, 64, 2)
    return x.new_empty((*x.shape[:-1], packed.shape[0] * cols))


def graph_op(dtype: torch.dtype):
    """The op a graph calls for a batched `dtype` linear: packed_call where the kernel library is
    built here (it holds packed_call), else packed_linear."""
    if kernel_cols(dtype) and _kernel_library():
        return torch.ops.cann_cpu.packed_call.default
    return torch.ops.cann_cpu.packed_linear.default


def pack_batched_linears(gm: torch.fx.GraphModule) -> int:
    """Replace every `linear` with more than one input row and a weight of at least
    MIN_WEIGHT_NUMEL elements by `graph_op` (packed_call or packed_linear). Single-row linears are
    left to the GEMV lowering. Returns how many were replaced: those oneDNN runs natively, and those
    the kernel takes (bf16 on an AVX2 CPU, where oneDNN emulates it, only up to max_kernel_rows)."""
    replaced = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch._C._nn.linear:
            continue
        x, w = node.args[0], node.args[1]
        value = x.meta.get("example_value") if isinstance(x, torch.fx.Node) else None
        weight = w.meta.get("example_value") if isinstance(w, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor) or not isinstance(weight, torch.Tensor):
            continue
        rows = value.numel() // value.shape[-1]
        if rows == 1 or weight.numel() < MIN_WEIGHT_NUMEL or value.dtype != weight.dtype or weight.dim() != 2:
            continue
        if not supported(weight.dtype) and not kernel_fits(weight, rows):
            continue
        call_instead(gm, node, graph_op(weight.dtype))
        replaced += 1
    gm.recompile()
    return replaced


def call_instead(gm: torch.fx.GraphModule, node: torch.fx.Node, op) -> torch.fx.Node:
    """Put `op(x, weight, bias)` in the place of the `linear` node `node` (its inputs, its meta).
    The graph passes replace linears with this project's ops through it."""
    x, w = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    with gm.graph.inserting_before(node):
        out = gm.graph.call_function(op, (x, w, bias))
    out.meta.update(node.meta)
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)
    return out
