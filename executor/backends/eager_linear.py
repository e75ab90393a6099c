"""Large linears that run eagerly on CPU: oneDNN for fp32 prefill GEMMs, our kernel for a few rows.

Why oneDNN: in this torch build aten's fp32 `linear` is MKL's sgemm, and on the reference
machine (an AMD EPYC) it ran the Qwen3-0.6B prefill's GEMMs at 60-90 GFLOP/s, while oneDNN, which
this build also carries, ran the same products 1.2-1.7x faster on the plain, unpacked weight (M =
128-2048 rows; a square product: 133 against 207 GFLOP/s; BENCHMARKS.md, "sixth pass"). The fp32
prefill is ~90% GEMMs, so this is most of its time. On the Intel host with AMX MKL is the faster
of the two from ~512 rows, so a long prompt's fp32 products stay aten's there (aten_takes_long_prompts).
bf16 GEMMs are left alone where oneDNN runs bf16 natively (AVX512-BF16 or AMX): aten already sends
them to it.

Why the rows kernel for bf16 GEMMs elsewhere (`cann_cpu::rows_linear` on the weight as stored,
csrc/rows_linear.cpp): on a CPU without native bf16 (an AVX2 host) oneDNN emulates bf16, and aten's
linear ran the 0.6B prefill's products at 11-21 GFLOP/s; the kernel's AVX2 loop, packing each
16-row block of the weight as it goes, ran them within 1.01x of its time on a packed copy at 128
rows, and the whole bf16 prefill of 128 tokens took 0.18x the time (BENCHMARKS.md, "nineteenth
pass"). On an AVX512-BF16 CPU without AMX its AVX-512 loop takes the bf16 products past dot_linear's
64 rows the same way (64-row blocks): there aten's linear reorders the weight for oneDNN on every
call, and over the 0.6B projections the loop took 0.87x / 0.90x / 0.98x / 0.97x aten's time at 128 /
512 / 1024 / 2048 rows (Zen 4; BENCHMARKS.md, "sixty-eighth pass").

Why a kernel for 1-4 rows (`cann_cpu::gemv`, csrc/gemv.cpp): with a row or a few (the eager
decode step; the prefill's last-token logits) a linear is a stream over the weight, and aten
streamed the 0.6B shape's bf16 weights at 15-19 GB/s where the machine reads ~33-35
(BENCHMARKS.md, "twelfth pass"). The kernel reads the weight as stored, at the read bandwidth
(an AVX-512 loop, or an AVX2 one).
It is built on the first call that needs it; where it cannot be, one line says so and aten
runs those calls.

Why a second loop for 3-64 rows on an AVX-512 CPU (`cann_cpu::dot_linear`, same source; in bf16
only without AMX): the eager decode step at batch 3-64 (and a short prompt's prefill) is such a product. On
the weight as stored aten's bf16 linear (oneDNN, reordering the weight per call) ran the 0.6B
projections at 86-181 GFLOP/s at 5-16 rows and oneDNN's fp32 one at 45-96; the loop (tiles of 4
weight rows x up to 6 rows of x, dot products along K) ran them 1.8-2.0x faster, level with the
compiled modes' loop on a packed copy. From 28 rows x is packed once per call and each weight
value broadcast to 2-4 vectors of 16 rows: 1.2-1.4x aten's rate at 24-64 rows. The eager step
took 0.57x / 0.69x / 0.76x / 0.88x the time at bf16 batch 8 / 16 / 32 / 64, and 0.62x / 0.63x /
0.81x / 0.85x in fp32; at batch 4 it took 0.84x (bf16) / 0.82x (fp32) the time of the GEMV
kernel's 4-row loop (BENCHMARKS.md, "twenty-seventh pass"). On a CPU with AMX (which has no fp32
tiles) the fp32 eager step took 0.82x oneDNN's time at batch 4 ("fifty-seventh pass").

Why dot_linear's AVX2 loop on a CPU without AVX-512 (tiles of 3 weight rows x up to 4 rows of x in
16 ymm registers, bf16 widened in registers as in the GEMV kernel's AVX2 loop): there oneDNN read
the stored fp32 0.6B projections at 6-9 GB/s at 5-64 rows against a ~21 GB/s sum, and nothing else
on that CPU did better; the loop ran them at 0.50-0.55x oneDNN's time at 5 rows, 0.63-0.71x at 16,
0.84x at 32, and in bf16 at 0.74-0.90x the rows kernel's time at 5-7 rows, so it takes 3-32 fp32
rows and 3-7 bf16 ones there (dot_max_rows; BENCHMARKS.md, "twenty-eighth pass").

Why the AMX loop for 2-192 bf16 rows on a CPU with AMX (`cann_cpu::amx_linear` on the weight as
stored, csrc/amx_linear.cpp): aten's linear reorders the weight for oneDNN on every call, and read
the 0.6B projections at 0.41 of a sum's rate at 4-16 rows on the AMX host; the loop, with the
weight as its A operand, read them at 0.73-0.82 (BENCHMARKS.md, "twenty-sixth pass"). The batched
eager decode step is where such products come from, and a short prompt's prefill: past 64 rows
the loop ran the 0.6B projections at 1.1-1.4x aten's rate up to 128 rows, level at 192-256, and
slower from 384; the bf16 prefill took 0.81x the time at 96 tokens, 0.855-0.874x at 128, 0.90x at
160, 0.91-0.98x at 192, level at 256 and 1.13x at 512 (7 rounds in turns, one process, two runs;
AMX_STORED_MAX_ROWS; BENCHMARKS.md, "seventy-fourth pass").

What runs through here: `ops.linear` during the runner's eager prefill and the eager backend's
decode step on CPU (executor.backends.eager_kernels installs it over the op table). A compiled
decode graph picks its own kernels (the GEMV lowering and `cann_cpu::packed_linear`).

The weight is used as stored (oneDNN measured within 3-20% of a copy packed for it): no second
copy of the weights, unlike the packed decode path. Small weights stay with aten, as there (a
call's setup costs more than it saves on a weight in cache).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from executor.backends import packed_linear
from executor.custom_ops._build import cpu_has_amx, cpu_has_avx2, cpu_has_avx512, load_optional_kernel
from executor.ops import reference
from executor.platform import ZEN4, cpu_family, cpu_runs_bf16

GEMV_MAX_ROWS = 4  # the kernel's limit (csrc/gemv.cpp)
DOT_MIN_ROWS, DOT_MAX_ROWS = 3, 64  # the rows the eager path gives dot_linear (the same source; it takes 1-64)
AVX2_DOT_MAX_ROWS = {torch.bfloat16: 11, torch.float32: 16}  # dot_linear's AVX2 loop: see dot_max_rows
GEMV_DTYPES = (torch.bfloat16, torch.float32)
GEMV_SOURCE = Path(__file__).resolve().parent / "csrc" / "gemv.cpp"
PLAIN_COLS = 16  # rows_linear's AVX2 loop on a weight as stored (N a multiple of it; plain_cols)
PLAIN_COLS_AVX512 = 64  # its AVX-512 bf16 loop on a weight as stored (N a multiple of it, K even)
PLAIN_MAX_ROWS_F32 = 1024  # the most fp32 rows the rows kernel takes; aten's sgemm more (rows_run_plain)
ATEN_MIN_ROWS_F32 = 512  # from this many fp32 rows, aten's sgemm not oneDNN on a CPU with AMX (aten_takes_long_prompts)
# The most bf16 rows the eager path gives the AMX loop on a weight as stored (a CPU with AMX; the
# module docstring): the largest prompt length at which the 0.6B prefill was measured faster with it.
AMX_STORED_MAX_ROWS = 192

_lib = torch.library.Library("cann_cpu", "FRAGMENT")  # the namespace is defined by packed_linear
_lib.define("gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_lib.define("gemv_supported(ScalarType dtype) -> bool")
_lib.define("dot_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_lib.define("dot_linear_supported(ScalarType dtype) -> bool")
_lib.define("blas_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")  # aten's linear, opaque (graph_passes)


@torch.library.register_fake("cann_cpu::gemv")  # a compiled graph may call it (gemv_in_graphs)
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("cann_cpu::blas_linear")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@functools.cache
def _gemv_library() -> bool:
    return load_optional_kernel(
        "cann_cpu::gemv",
        "cann_cpu_gemv",
        GEMV_SOURCE,
        "eager_linear",
        f"linears of 1-{GEMV_MAX_ROWS} rows run on aten instead",
    )


@functools.cache
def gemv_runs(dtype: torch.dtype) -> bool:
    """The kernel is built and loaded (once per machine / process) and this CPU runs it for `dtype`."""
    return (
        dtype in GEMV_DTYPES
        and (cpu_has_avx512(dtype) or cpu_has_avx2())
        and _gemv_library()
        and bool(torch.ops.cann_cpu.gemv_supported(dtype))
    )


def _large(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """A CPU linear with a weight worth a kernel call, nothing to differentiate (`is_cpu`: reading
    `device.type` makes a device object per call, eager_pointwise.may_take)."""
    return (
        x.is_cpu
        and x.dtype == weight.dtype
        and weight.dim() == 2
        and weight.numel() >= packed_linear.MIN_WEIGHT_NUMEL
        and x.numel() > 0
        and (bias is None or bias.dtype == weight.dtype)
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


@functools.cache
def dot_runs(dtype: torch.dtype) -> bool:
    """3 rows and more (up to dot_max_rows) go to `cann_cpu::dot_linear`: its AVX-512 loop
    (AVX512-BF16 for bf16; BENCHMARKS.md, "twenty-seventh pass") or, without those, its AVX2 loop
    ("twenty-eighth pass"). Not bf16 on a CPU with AMX, which has its AMX loop. fp32 there has no
    tiles: the AVX-512 loop lost to oneDNN in the twenty-fifth pass, and since took the eager step to
    0.82x oneDNN's time at batch 4 (6 of 6 alternating rounds; "fifty-seventh pass")."""
    return (
        dtype in GEMV_DTYPES
        and (cpu_has_avx512(dtype) or cpu_has_avx2())
        and not (cpu_has_amx() and dtype == torch.bfloat16)
        and _gemv_library()
        and bool(torch.ops.cann_cpu.dot_linear_supported(dtype))
    )


@functools.cache
def dot_max_rows(dtype: torch.dtype) -> int:
    """The most rows the eager path gives dot_linear: DOT_MAX_ROWS on its AVX-512 loop, fewer on its
    AVX2 one (AVX2_DOT_MAX_ROWS), where the rows kernel takes over on the weight as stored
    (rows_run_plain). There, in bf16, the loop widens every weight value in registers and ran the
    0.6B projections 0.74-0.90x the time of the rows kernel at 5-7 rows, level at 8, slower from 12
    (BENCHMARKS.md, "twenty-eighth pass"); with its full tile's spill gone, 0.93-0.99x at 8-11 rows
    and level at 12 ("fifty-first pass"); in fp32 the rows kernel, once its block packing was
    vectorized, took 1.21-1.43x dot_linear's time at 8-12 rows, 0.94-1.06x at 16, 0.92x at 32 and
    0.72x at 64 ("fiftieth pass")."""
    return DOT_MAX_ROWS if cpu_has_avx512(dtype) else AVX2_DOT_MAX_ROWS[dtype]


@functools.cache
def gemv_max_rows(dtype: torch.dtype) -> int:
    """The most rows the eager path gives the GEMV kernel: GEMV_MAX_ROWS; two where dot_linear runs
    `dtype`, or one on a CPU with AMX.
    - Where dot_linear runs, its tiles read the 0.6B shape's weights at 1.26x (bf16) / 1.43x (fp32)
      the GEMV kernel's rate at 4 rows (3 rows: 1.03x / 1.21x), and the eager batch-4 step took
      0.84x (bf16) / 0.82x (fp32) the time (BENCHMARKS.md, "twenty-seventh pass"). Its AVX2 loop took
      0.78-0.98x (bf16) and 0.95-0.96x (fp32) of the GEMV kernel's time on them at 3-4 rows
      ("twenty-eighth pass").
    - On a CPU with AMX oneDNN ran the eager 0.6B-shape batch-4 step in 0.91x (bf16, aten's linear)
      and 0.96x (fp32) of the time it took with the kernel, whose 4-row loop read the weights at
      0.50-0.64 of a sum's rate against oneDNN's 0.74-0.85 ("twenty-fifth pass"). There fp32's
      3-64 rows now go to dot_linear instead, and two rows stay with oneDNN (not measured)."""
    if cpu_has_amx():
        return 1
    return DOT_MIN_ROWS - 1 if dot_runs(dtype) else GEMV_MAX_ROWS


@functools.cache
def aten_takes_single_rows(dtype: torch.dtype) -> bool:
    """A single fp32 row goes to aten's linear (MKL's sgemv) on a CPU with AMX: there it read the
    0.6B shape's weights at 0.97 of a sum's rate, the GEMV kernel at 0.84 and oneDNN at 0.90, and
    the eager MoE step at the 30B-A3B shape (its fp32 lm_head) was slower than transformers'
    (BENCHMARKS.md, "twenty-fifth pass"); the eager batch-1 fp32 step took 1.49x the time with the
    GEMV kernel (6 of 6 alternating rounds, "fifty-seventh pass"). On the AMD hosts MKL's sgemv was
    the slow one (~17 GB/s)."""
    return dtype == torch.float32 and cpu_has_amx()


@functools.cache
def blas_linear_runs() -> bool:
    """`cann_cpu::blas_linear` (aten's linear as one opaque call, csrc/gemv.cpp) is built and loaded."""
    return _gemv_library()


@functools.cache
def aten_takes_long_prompts(dtype: torch.dtype) -> bool:
    """fp32 products of ATEN_MIN_ROWS_F32 rows and more (a long prompt's prefill) go to aten's linear
    (MKL's sgemm) instead of oneDNN on a CPU with AMX. There, over the 0.6B projections on whole 2 MiB
    pages, MKL took 1.08-1.13x oneDNN's time at 64-256 rows, 0.97-1.01x at 512, 0.95-0.97x at 1024
    and 0.92x at 2048; in the fp32 prefill (one process, 7 rounds in turns) 0.961-0.968x the time at
    512 tokens and 0.932-0.942x at 2048 from 256 or 512 rows on (BENCHMARKS.md, "seventy-eighth
    pass"). On the AMD hosts oneDNN ran them 1.2-1.7x faster than MKL (the module docstring)."""
    return dtype == torch.float32 and cpu_has_amx()


@functools.cache
def gemv_in_graphs(dtype: torch.dtype, launch_unit: bool = False) -> bool:
    """A compiled decode graph's large single-row linears call the GEMV kernel instead of becoming
    Inductor's generated reductions (executor.backends.graph_passes): bf16 on a CPU without
    AVX512-BF16 or AMX, bf16 on one with AMX, bf16 inside a SuperKernel launch unit (`launch_unit`)
    on any CPU the kernel runs on but AMD Zen 4, and fp32 on a CPU without AVX-512.
    - bf16, AVX2 host: the reduction widened bf16 in generated code at 15-19 GB/s even from
      cache, below the read bandwidth, while the kernel read the 0.6B shape's weights at 25-60
      (BENCHMARKS.md, "nineteenth pass").
    - bf16, AMX host: the batch-1 ge_graph step took 51 ms with the kernel against 55 with the
      reductions ("twenty-fifth pass").
    - bf16 in a launch unit, AVX512-BF16 host (Zen 5): the 0.6B batch-1 SK decoder step took
      0.89-0.91x the time with the kernel in its unit (faster in 21 and 24 of 24 alternating
      rounds), while plain ge_graph with the kernel everywhere took 1.05-1.12x ("fifty-fifth pass").
      My guess at why (not profiled): the unit calls the kernel from its C++ wrapper, a plain
      graph from Python, its kernels split around every call.
    - Not in a launch unit on Zen 4 (AMD family 19h with AVX512-BF16): there the kernel made the
      unit's batch-1 step 1.055x slower than the reductions, in two runs of 20 rounds in turns
      (the unit with the reductions 1.004x and 1.033x ge_graph's step, with the kernel 1.059x and
      1.090x; BENCHMARKS.md, "sixty-fourth pass"). Leaving the unit's o_proj (2048 x 1024) to
      Inductor's decomposition or making it a reduction read level there (1.005x), so on Zen 4
      the unit's baseline is not what decides it (unmeasured on Zen 5). With the kernel's one-row
      look-ahead (csrc/gemv.cpp, kRowAhead) it still lost there: the unit 1.075x ge_graph's step
      against 1.033x with the reductions, a plain graph with the kernel 1.069x in bf16 and 1.055x
      in fp32 (16 rounds in turns; "sixty-fifth pass").
    - fp32, AVX2 host (Zen 3): the kernel's AVX2 loop, whose threads take each other's leftover
      blocks, ran the 0.6B batch-1 ge_graph step in 0.96x the reductions' time (faster in 29 of
      40 alternating rounds; 0.99x in 9 at the forty-ninth pass) and the SK decoder step in 0.89x
      (28 of 30; "fifty-fourth pass").
    - Elsewhere the reduction stays (one kernel fewer to call per projection): on AMD's
      AVX512-BF16 hosts a plain graph's reduction keeps up with memory in bf16; in fp32 on the
      Zen 5 host the kernel took 1.09x the ge_graph step's time and 1.00x SK decoder's
      ("fifty-fifth pass"), and on the AMX host the fp32 step took 112 ms with it, 85 without."""
    if dtype == torch.bfloat16:
        wanted = (launch_unit and cpu_family() != ZEN4) or not cpu_runs_bf16() or cpu_has_amx()
    else:
        wanted = dtype == torch.float32 and not cpu_has_avx512(dtype)
    return wanted and gemv_runs(dtype)  # asked last: it builds the kernel where it is not built yet


@functools.cache
def rows_run_plain(dtype: torch.dtype) -> bool:
    """Products of more rows than dot_linear takes go to `cann_cpu::rows_linear` on the weight as
    stored (plain_cols says which loop):
    - bf16 where oneDNN would emulate bf16 (no AVX512-BF16 or AMX): the AVX2 loop;
    - bf16 on an AVX512-BF16 CPU without AMX: the AVX-512 loop, ahead of aten's linear (the module
      docstring);
    - fp32 on a CPU without AVX-512, ahead of oneDNN: on the AVX2 kind (Zen 3) it read the 0.6B
      projections in 0.81x oneDNN's time at 64 rows and 0.86-0.87x at 128 and 512 (BENCHMARKS.md,
      "fiftieth pass"); up to PLAIN_MAX_ROWS_F32 rows. Past that aten's linear (MKL's sgemm) takes
      them: on that kind the kernel took 0.69x its time at 128 rows, 0.93x at 512, 1.02x at 1024 and
      1.05x at 2048 (the sum over the 0.6B projections), and the 2048-token fp32 prefill spent 1.08x
      aten's GEMM time in it (BENCHMARKS.md, "sixty-second pass"). oneDNN, the other candidate, took
      1.08-1.24x aten's time from 512 rows on."""
    return plain_cols(dtype) > 0


@functools.cache
def plain_cols(dtype: torch.dtype) -> int:
    """The column blocks of the rows kernel's loop on a weight as stored, whose multiple N must be
    (rows_run_plain): PLAIN_COLS_AVX512 for bf16 on an AVX512-BF16 CPU without AMX (K even too),
    PLAIN_COLS where the AVX2 loop takes it, 0 where the kernel does not take a weight as stored."""
    if dtype not in (torch.bfloat16, torch.float32) or not packed_linear.kernel_runs(dtype):
        return 0
    cols = packed_linear.kernel_cols(dtype)
    if dtype == torch.bfloat16 and packed_linear.supported(dtype):
        return PLAIN_COLS_AVX512 if cols == PLAIN_COLS_AVX512 and not cpu_has_amx() else 0
    return PLAIN_COLS if cols == PLAIN_COLS else 0


class LinearKernel:
    """`linear` for the op table: the GEMV kernel for 1-4 rows (gemv_max_rows) of a large CPU
    weight in bf16 or fp32, except a single fp32 row on a CPU with AMX (aten_takes_single_rows);
    3-64 rows on dot_linear (in bf16 a CPU without AMX; on its AVX2 loop 3-16 in fp32, 3-11 in bf16:
    dot_max_rows); for more rows the rows kernel on the weight as stored (rows_run_plain): on a CPU
    without AVX-512 (in fp32 up to PLAIN_MAX_ROWS_F32 rows, aten's past that), in bf16 also where
    oneDNN would emulate it, and on an AVX512-BF16 CPU without AMX; else oneDNN in fp32 (aten from
    ATEN_MIN_ROWS_F32 rows on a CPU with AMX: aten_takes_long_prompts) and in bf16 the AMX loop
    (2-AMX_STORED_MAX_ROWS rows, a CPU with AMX); the reference otherwise. The counts are what
    metrics.json reports."""

    def __init__(self):
        self.onednn_calls = 0
        self.gemv_calls = 0
        self.dot_calls = 0
        self.rows_calls = 0
        self.amx_calls = 0
        self.aten_calls = 0  # fp32 GEMMs past the rows kernel's rows (PLAIN_MAX_ROWS_F32) or long prompts' (AMX)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if _large(x, weight, bias):
            rows = x.numel() // x.shape[-1]
            if rows == 1 and aten_takes_single_rows(weight.dtype):
                return reference.linear(x, weight, bias)
            if rows <= gemv_max_rows(weight.dtype) and weight.stride(1) == 1 and gemv_runs(weight.dtype):
                self.gemv_calls += 1
                return torch.ops.cann_cpu.gemv.default(x, weight, bias)
            if weight.stride(1) == 1 and packed_linear.amx_fits(weight, rows, AMX_STORED_MAX_ROWS):
                self.amx_calls += 1
                return torch.ops.cann_cpu.amx_linear.default(x, weight, bias)
            if DOT_MIN_ROWS <= rows <= dot_max_rows(weight.dtype) and weight.stride(1) == 1 and dot_runs(weight.dtype):
                self.dot_calls += 1
                return torch.ops.cann_cpu.dot_linear.default(x, weight, bias)
            if plain_fits(weight):
                if weight.dtype == torch.float32 and rows > PLAIN_MAX_ROWS_F32:
                    self.aten_calls += 1
                    return reference.linear(x, weight, bias)
                self.rows_calls += 1
                return torch.ops.cann_cpu.rows_linear.default(x, weight, bias)
            if weight.dtype == torch.float32 and packed_linear.supported(torch.float32):
                if rows >= ATEN_MIN_ROWS_F32 and aten_takes_long_prompts(weight.dtype):
                    self.aten_calls += 1
                    return reference.linear(x, weight, bias)
                self.onednn_calls += 1
                out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), weight, bias, "none", [], "")
                return out.view(*x.shape[:-1], weight.shape[0])
        return reference.linear(x, weight, bias)


def plain_fits(weight: torch.Tensor) -> bool:
    """The rows kernel takes this weight as stored (rows_run_plain): contiguous rows, N a multiple of
    plain_cols, and K even for the AVX-512 bf16 loop (its k pairs)."""
    cols = plain_cols(weight.dtype)
    return (
        cols > 0
        and weight.stride(1) == 1
        and weight.shape[0] % cols == 0
        and (cols == PLAIN_COLS or weight.shape[1] % 2 == 0)
    )


def kernel_for(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> str:
    """What a run's large linears get: "gemv+dot_linear+onednn" (fp32 on an AVX-512 CPU without
    AMX: GEMV for 1-2 rows, dot_linear for 3-64, oneDNN past that), "dot_linear+onednn+aten" (fp32 on
    a CPU with AMX: a single row on aten, dot_linear for 3-64, oneDNN up to 511, aten from
    ATEN_MIN_ROWS_F32), "gemv+dot_linear+rows_linear"
    (fp32 on an AVX2 CPU: dot_linear for 3-16 rows, the rows kernel past that up to 1024, aten more;
    bf16 on an AVX512-BF16 CPU without AMX: dot_linear for 3-64 rows, the rows kernel's AVX-512 loop
    past that; bf16 where oneDNN would emulate it: dot_linear's AVX2 loop takes 3-11 rows, the rows
    kernel more), "onednn" (fp32 elsewhere), "gemv" (bf16: its few-row products), "gemv+amx_linear"
    (bf16 on a CPU with AMX: the AMX loop takes 2-192 rows), "gemv+rows_linear" (bf16 where oneDNN
    would emulate it, without AVX2 for dot_linear) or "aten" (another device or dtype, or no weight
    large enough). Asking builds no kernel."""
    large = any(p.dim() == 2 and p.numel() >= packed_linear.MIN_WEIGHT_NUMEL for p in model.parameters())
    if device.type != "cpu" or not large:
        return "aten"
    amx_bf16 = cpu_has_amx() and dtype == torch.bfloat16
    dot = dtype in GEMV_DTYPES and (cpu_has_avx512(dtype) or cpu_has_avx2()) and not amx_bf16
    if dot and dtype == torch.float32 and cpu_has_amx():
        return "dot_linear+onednn+aten"
    if dot and dtype == torch.float32:
        return "gemv+dot_linear+onednn" if cpu_has_avx512(dtype) else "gemv+dot_linear+rows_linear"
    if dot and cpu_has_avx512(dtype):  # bf16 on an AVX512-BF16 CPU without AMX
        return "gemv+dot_linear+rows_linear"
    if dtype == torch.float32 and packed_linear.supported(dtype):
        return "onednn"
    if dtype == torch.bfloat16 and not packed_linear.supported(dtype) and packed_linear.kernel_cols(dtype):
        return "gemv+dot_linear+rows_linear" if dot else "gemv+rows_linear"
    if dtype == torch.bfloat16 and cpu_has_amx():
        return "gemv+amx_linear"
    return "gemv" if dtype in GEMV_DTYPES else "aten"
