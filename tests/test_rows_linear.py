"""cann_cpu::rows_linear: the kernel that batched bf16 and fp32 decode GEMMs run on CPU
(executor.backends.packed_linear), against fp32 `linear` on the same values.

It has two loops, chosen by the packed layout: 64-column blocks for AVX-512 (AVX512-BF16 in bf16)
and 16-column blocks for AVX2. A weight as stored, (N, K), is packed a block at a time as the loop
goes: by the AVX-512 bf16 loop where it runs and 64-column blocks of k pairs fit, by the AVX2 loop
otherwise.
Every loop this CPU runs is tested (an AVX-512 host runs both).
The kernel needs a C++ compiler and an x86-64 CPU with AVX2; where one is missing the kernel tests
skip, while the packing and no-compiler tests run everywhere.
"""

from __future__ import annotations

import pytest
import torch

from executor.backends import packed_linear
from tests.no_compiler import run_without_compiler

needs_kernel = pytest.mark.skipif(
    not packed_linear.kernel_runs(torch.bfloat16), reason="no AVX2 on this CPU, or the kernel could not be built"
)
needs_f32_kernel = pytest.mark.skipif(
    not packed_linear.kernel_runs(torch.float32), reason="no AVX2 on this CPU, or the kernel could not be built"
)
DTYPES = [
    pytest.param(torch.bfloat16, marks=needs_kernel, id="bf16"),
    pytest.param(torch.float32, marks=needs_f32_kernel, id="fp32"),
]


def loop_runs(dtype: torch.dtype, cols: int) -> bool:
    """This CPU runs the loop of `cols`-column blocks for `dtype` (the AVX2 one runs on AVX-512 too)."""
    return packed_linear.kernel_runs(dtype) and torch.ops.cann_cpu.rows_supported(dtype, cols)


# fp32 accumulation in both; bf16 rounds once to bf16 at the end (its half-ulp), fp32 differs from
# oneDNN/MKL only in the summation order
TOLERANCE = {torch.bfloat16: {"rtol": 8e-3, "atol": 1e-2}, torch.float32: {"rtol": 1e-5, "atol": 1e-4}}


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())


def test_bf16_packing_puts_k_pairs_of_64_columns_together():
    w = torch.arange(128 * 6, dtype=torch.float32).view(128, 6).to(torch.bfloat16)
    p = packed_linear.pack_rows(w, 64)
    assert p.shape == (2, 3, 64, 2)
    for nb, kp, j, t in [(0, 0, 0, 0), (0, 0, 0, 1), (1, 2, 63, 1), (1, 0, 5, 0), (0, 1, 17, 1)]:
        assert p[nb, kp, j, t] == w[nb * 64 + j, 2 * kp + t]


@pytest.mark.parametrize("cols", [64, 16])
def test_fp32_packing_puts_each_k_row_of_a_block_together(cols):
    w = torch.arange(2 * cols * 5, dtype=torch.float32).view(2 * cols, 5)
    p = packed_linear.pack_rows(w, cols)
    assert p.shape == (2, 5, cols)
    for nb, k, j in [(0, 0, 0), (0, 4, 1), (1, 2, cols - 1), (1, 0, 5), (0, 3, 8)]:
        assert p[nb, k, j] == w[nb * cols + j, k]


def test_avx2_bf16_packing_interleaves_each_k_row_of_16_columns():
    """0, 8, 1, 9, ..., 7, 15: one shift and one mask widen the even and the odd values."""
    w = torch.arange(32 * 5, dtype=torch.float32).view(32, 5)
    b = packed_linear.pack_rows(w.to(torch.bfloat16), 16)
    assert b.shape == (2, 5, 16) and b.is_contiguous()
    for nb, k, j in [(0, 0, 0), (0, 4, 1), (1, 2, 15), (1, 0, 5), (0, 3, 8), (1, 1, 14)]:
        position = 2 * (j % 8) + j // 8
        assert b[nb, k, position] == w[nb * 16 + j, k].to(torch.bfloat16), (nb, k, j)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [64, 16], ids=["avx512", "avx2"])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_kernel_matches_fp32_linear_for_every_tile_size(dtype, cols, rows, bias):
    """Row counts that exercise every tile height (1-6) and a remainder after full tiles (and,
    with more than one tile, the prefetch of the next block); K = 258 is odd in k pairs (129)."""
    if not loop_runs(dtype, cols):
        pytest.skip(f"this CPU does not run the {cols}-column loop")
    torch.manual_seed(rows)
    w = (torch.randn(192, 258) * 0.05).to(dtype)  # 3 blocks of 64 columns, 12 of 16
    b = torch.randn(192).to(dtype) if bias else None
    x = torch.randn(rows, 258).to(dtype)
    y = torch.ops.cann_cpu.rows_linear(x, packed_linear.pack_rows(w, cols), b)
    assert y.dtype == dtype and y.shape == (rows, 192)
    torch.testing.assert_close(y.float(), reference(x, w, b), **TOLERANCE[dtype])


# (dtype, cols, packed) of every loop: a weight as stored runs the AVX-512 loop in bf16 only
LOOPS = [
    pytest.param(d.values[0], cols, packed, marks=d.marks, id=f"{name}-{d.id}")
    for cols, packed, name in [
        (64, True, "avx512"),
        (16, True, "avx2"),
        (16, False, "as-stored"),
        (64, False, "as-stored-avx512"),
    ]
    for d in DTYPES
    if packed or cols == 16 or d.values[0] == torch.bfloat16
]


@pytest.mark.parametrize(("dtype", "cols", "packed"), LOOPS)
def test_every_block_runs_once_whatever_the_threads(dtype, cols, packed):
    """The loops hand each thread a share of the blocks (of 64 or 16 columns) and let a thread that
    is done take the last blocks of another's share. A block's sums do not depend on the thread that
    runs it, so every thread count must give the one-thread result bit for bit; a block that no
    thread runs leaves the output's uninitialised memory there. More threads than cores (5 on the
    2-core reference machine) makes some wait for a core, so shares are taken over; block counts
    below, at and above the thread count. The AVX2 loops round a bf16 block's sums through a
    thread's own scratch rows, and the loop on a weight as stored packs each block into a thread's
    own buffer: one scratch or buffer shared by the threads fails here."""
    if not loop_runs(dtype, cols):
        pytest.skip(f"this CPU does not run the {cols}-column loop")
    before = torch.get_num_threads()
    torch.manual_seed(5)
    try:
        for blocks in (1, 2, 3, 5, 9, 40):
            w = (torch.randn(cols * blocks, 96) * 0.1).to(dtype)
            w = packed_linear.pack_rows(w, cols) if packed else w
            for rows in (2, 7, 16):
                x = torch.randn(rows, 96).to(dtype)
                torch.set_num_threads(1)
                alone = torch.ops.cann_cpu.rows_linear(x, w, None)
                for threads in (2, 3, 5):
                    torch.set_num_threads(threads)
                    for _ in range(20):
                        got = torch.ops.cann_cpu.rows_linear(x, w, None)
                        assert torch.equal(got, alone), (blocks, rows, threads)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_takes_strided_and_batched_rows(dtype):
    torch.manual_seed(0)
    w = (torch.randn(128, 64) * 0.1).to(dtype)
    x = torch.randn(3, 2, 128).to(dtype)[..., ::2]  # (3, 2, 64), not contiguous
    y = torch.ops.cann_cpu.rows_linear(x, packed_linear.pack_rows(w), None)
    assert y.shape == (3, 2, 128)
    torch.testing.assert_close(y.float(), reference(x, w, None), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_rows_give_an_empty_output(dtype):
    """A call with no rows of x (an empty batch) returns (0, N) and computes nothing: the tile split
    divides by the number of tiles, which is zero then."""
    w = torch.randn(128, 64).to(dtype)
    y = torch.ops.cann_cpu.rows_linear(torch.zeros(0, 64, dtype=dtype), packed_linear.pack_rows(w), None)
    assert y.shape == (0, 128) and y.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 6, 13, 200])
def test_a_weight_as_stored_gives_what_the_packed_one_gives(dtype, rows):
    """The AVX2 loop on an unpacked (N, K) weight (the eager bf16 prefill where oneDNN would emulate
    bf16) packs each block itself into the same layout, so its result is the packed call's, bit for
    bit: also with K odd, a bias, and weight rows further apart than K (a slice of a wider one).
    N = 48 fits no 64-column block, so an AVX512-BF16 host runs this loop too."""
    if not loop_runs(dtype, 16):
        pytest.skip("this CPU does not run the 16-column loop")
    torch.manual_seed(rows)
    wide = (torch.randn(48, 301) * 0.05).to(dtype)
    w, b, x = wide[:, :299], torch.randn(48).to(dtype), torch.randn(rows, 299).to(dtype)
    assert w.stride(0) == 301
    y = torch.ops.cann_cpu.rows_linear(x, w, b)
    assert y.dtype == dtype and y.shape == (rows, 48)
    assert torch.equal(y, torch.ops.cann_cpu.rows_linear(x, packed_linear.pack_rows(w.contiguous(), 16), b))
    torch.testing.assert_close(y.float(), reference(x, w, b), **TOLERANCE[dtype])


@needs_kernel
@pytest.mark.parametrize("rows", [1, 6, 13, 65, 200])
def test_a_bf16_weight_as_stored_runs_the_avx512_loop_with_the_packed_result(rows):
    """On an AVX512-BF16 CPU a bf16 weight as stored whose N is a multiple of 64 and K even (the eager
    bf16 products past dot_linear's 64 rows) runs the AVX-512 loop, packing each 64-column block as
    it goes (16 x 16 transposes of k pairs, a scalar copy for the last pairs): its result is the
    packed call's, bit for bit, with a bias, K pairs not a multiple of 16 (150 = 9 x 16 + 6) and
    weight rows further apart than K. A transpose that put one pair in the wrong lane fails here."""
    if not loop_runs(torch.bfloat16, 64):
        pytest.skip("this CPU does not run the 64-column bf16 loop")
    torch.manual_seed(rows)
    wide = (torch.randn(192, 302) * 0.05).to(torch.bfloat16)
    w, b, x = wide[:, :300], torch.randn(192).to(torch.bfloat16), torch.randn(rows, 300).to(torch.bfloat16)
    assert w.stride(0) == 302
    y = torch.ops.cann_cpu.rows_linear(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 192)
    assert torch.equal(y, torch.ops.cann_cpu.rows_linear(x, packed_linear.pack_rows(w.contiguous(), 64), b))
    torch.testing.assert_close(y.float(), reference(x, w, b), **TOLERANCE[torch.bfloat16])


@needs_kernel
@pytest.mark.parametrize("rows", [2, 4, 13])
def test_avx2_bf16_result_is_the_fp32_loops_rounded_to_nearest_even(rows):
    """The AVX2 loop widens bf16 to fp32 and sums in fp32 as its fp32 loop does, so on the same
    values its bf16 result must be the fp32 loop's rounded as aten rounds (to nearest even), bit for
    bit, and a NaN must stay one. Truncating instead fails here."""
    if not loop_runs(torch.bfloat16, 16) or not loop_runs(torch.float32, 16):
        pytest.skip("this CPU does not run the 16-column loop")
    torch.manual_seed(rows)
    w = (torch.randn(64, 131) * 0.05).to(torch.bfloat16)
    x = torch.randn(rows, 131).to(torch.bfloat16)
    x[0, 7] = float("nan")  # row 0 is NaN in every column
    b = torch.randn(64).to(torch.bfloat16)
    for weight in (packed_linear.pack_rows(w, 16), w):  # packed, and as stored
        y = torch.ops.cann_cpu.rows_linear(x, weight, b)
        f = weight if weight.dim() == 2 else packed_linear.pack_rows(w.float(), 16)
        want = torch.ops.cann_cpu.rows_linear(x.float(), f.float(), b.float()).to(torch.bfloat16)
        assert y[0].isnan().all() and not y[1:].isnan().any()  # a NaN's bits are free: aten's vector cast keeps them
        assert torch.equal(y[1:].view(torch.int16), want[1:].view(torch.int16))


@needs_f32_kernel
def test_kernel_refuses_a_weight_that_is_not_packed_or_of_another_dtype():
    w = torch.randn(128, 64)
    with pytest.raises(RuntimeError, match=r"packed as \(N/64, K/2, 64, 2\) or \(N/16, K, 16\)"):
        torch.ops.cann_cpu.rows_linear(torch.randn(2, 128).to(torch.bfloat16), w.t().to(torch.bfloat16)[None], None)
    with pytest.raises(RuntimeError, match=r"packed as \(N/64, K, 64\) or \(N/16, K, 16\)"):
        torch.ops.cann_cpu.rows_linear(torch.randn(2, 128), w.t()[None], None)
    with pytest.raises(RuntimeError, match="N a multiple of 16"):
        torch.ops.cann_cpu.rows_linear(torch.randn(2, 64), w[:120], None)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        torch.ops.cann_cpu.rows_linear(torch.randn(2, 128), w.t(), None)
    with pytest.raises(RuntimeError, match="x is BFloat16, the packed weight Float"):
        torch.ops.cann_cpu.rows_linear(torch.randn(2, 64).to(torch.bfloat16), packed_linear.pack_rows(w), None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_linear_runs_the_kernel_where_it_fits_and_onednn_elsewhere(dtype):
    """The kernel where it fits (whole column blocks, at most max_kernel_rows rows); elsewhere,
    for a row count above the limit and for a weight the blocks do not divide, oneDNN's packed
    weight, or aten's linear on the weight as stored where oneDNN would emulate the dtype (bf16
    on an AVX2 CPU)."""
    torch.manual_seed(0)
    fits = (torch.randn(256, 128) * 0.1).to(dtype)
    ragged = (torch.randn(200, 128) * 0.1).to(dtype)  # 200 = 12.5 blocks of 16
    cols = packed_linear.kernel_cols(dtype)
    kernel_shape = (4, 64, 64, 2) if cols == 64 and dtype == torch.bfloat16 else (256 // cols, 128, cols)
    amx = dtype == torch.bfloat16 and packed_linear.amx_runs()  # the AMX loop, on the same packed layout
    above = (packed_linear.AMX_MAX_ROWS if amx else packed_linear.max_kernel_rows(dtype)) + 1
    few = amx or packed_linear.max_kernel_rows(dtype) >= 4  # bf16 on a CPU with AMX: only the AMX loop
    for w, rows, kernel in [(fits, 4, few), (ragged, 4, False), (fits.clone(), above, False)]:
        xr = torch.randn(rows, 128).to(dtype)
        b = torch.randn(w.shape[0]).to(dtype)
        for _ in range(2):  # the second call reuses the packed weight (and the kernel's fp32 bias)
            y = packed_linear.packed_linear(xr, w, b)
            torch.testing.assert_close(y.float(), reference(xr, w, b), rtol=2e-2, atol=2e-2)
        kept = packed_linear._packed.kept(w)
        if kernel:
            assert kept.shape == kernel_shape, (w.shape, rows, kept.shape)
        elif packed_linear.supported(dtype):
            assert kept is not None and kept.shape != kernel_shape, (w.shape, rows)  # oneDNN's packed copy
        else:
            assert kept is None, (w.shape, rows)  # aten, nothing packed
    b = torch.randn(256).to(dtype)
    first = packed_linear.packed_linear(torch.ones(4, 128).to(dtype), fits, b)
    b.add_(1.0)  # changed in place: the kernel must not add a stale fp32 copy
    again = packed_linear.packed_linear(torch.ones(4, 128).to(dtype), fits, b)
    torch.testing.assert_close(again.float(), first.float() + 1.0, rtol=2e-2, atol=2e-2)  # a stale bias: off by 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_packs_says_whether_a_call_keeps_a_packed_copy(dtype):
    """`packs` (what the memory estimate asks, without building the kernel) agrees with what
    packed_linear does: a packed copy at a few rows and past the kernel's cap, except where the
    dtype then goes to aten (bf16 on an AVX2 CPU)."""
    for rows in (2, packed_linear.max_kernel_rows(dtype) + 1):
        w = (torch.randn(256, 128) * 0.1).to(dtype)
        packed_linear.packed_linear(torch.randn(rows, 128).to(dtype), w, None)
        assert (packed_linear._packed.kept(w) is not None) == packed_linear.packs(dtype, rows), rows


def test_no_compiler_is_one_line_and_onednn_runs_the_call(tmp_path):
    """A fresh kernel cache and CXX pointing at nothing: packed_linear says so once and gives the
    same product through oneDNN (no error: the kernel is a lowering choice, not something asked for)."""
    if not packed_linear.supported(torch.float32):
        pytest.skip("this torch build has no oneDNN")
    if not packed_linear.kernel_cols(torch.float32):
        pytest.skip("no AVX2 here: the kernel is never built, so there is no build to fail")
    code = (
        "import torch\n"
        "from executor.backends import packed_linear as p\n"
        "w = torch.randn(256, 128)\n"
        "x = torch.randn(4, 128)\n"
        "for _ in range(3):\n"
        "    y = p.packed_linear(x, w, None)\n"
        "torch.testing.assert_close(y, torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-4)\n"
        "print('kept', p._packed.kept(w).dim())\n"
        "print('graphs call', p.graph_op(torch.float32).name())\n"
    )
    line, stdout = run_without_compiler(tmp_path, code, "packed_linear")
    assert "run on oneDNN instead" in line and "model_config.custom_ops" not in line
    assert "kept 2\n" in stdout  # oneDNN's packed copy
    assert stdout.rstrip().endswith("graphs call cann_cpu::packed_linear")  # packed_call is in the library


@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_graph_decode_on_the_kernel_agrees_with_eager(tmp_path, make_qwen_runner, dtype):
    """A Qwen2 checkpoint whose gate_up projection is large enough to be packed: the ge_graph
    decode at batch 2 runs it on the kernel, and agrees with the eager run, which never calls the
    kernel: fp32 to rounding, with the same tokens; bf16 by cosine of the last step's logits (the
    project's bf16 standard). The bf16 reference is eager in bf16, not fp32: both share the eager
    prefill, and on an AVX2 host the bf16 prefill's first token of the second prompt already
    differed from fp32's (479 against 487, with and without the kernel in the decode)."""
    import tests.checkpoints as ckpt

    inter = packed_linear.MIN_WEIGHT_NUMEL // (2 * ckpt.QWEN2_CONFIG["hidden_size"])
    path = ckpt.make_qwen2_checkpoint(tmp_path / "qwen2", intermediate_size=inter, init_std=0.05)
    prompts = [[7, 42, 133, 250, 9, 311, 77, 400, 15], [3, 14, 15, 92, 65, 35, 89, 79, 32]]
    name = "bfloat16" if dtype == torch.bfloat16 else "float32"
    common = ("scheduler_config.batch_size=2", "model_config.enable_cache_compile=false", f"model_config.dtype={name}")
    graph = make_qwen_runner(path, *common, "model_config.exe_mode=ge_graph")
    eager = make_qwen_runner(path, *common, "model_config.exe_mode=eager")
    got, want = graph.generate(prompts, 3), eager.generate(prompts, 3)
    gate_up = graph.model.layers[0].mlp.gate_up_proj.weight
    kept = packed_linear._packed.kept(gate_up)
    if packed_linear.kernel_fits(gate_up, 2) or packed_linear.amx_fits(gate_up, 2):
        assert kept.shape == packed_linear.pack_rows(gate_up).shape  # the kernel (or its AMX loop) ran
    else:  # bf16 on a CPU with AMX whose AMX loop does not run: oneDNN's packed copy ran the product
        assert packed_linear.max_kernel_rows(dtype) < 2 and kept is not None and kept.dim() == 2
    if dtype == torch.float32:
        torch.testing.assert_close(got.last_logits, want.last_logits, rtol=1e-4, atol=1e-4)
        assert got.token_ids == want.token_ids
    cos = torch.nn.functional.cosine_similarity(got.last_logits.float(), want.last_logits.float(), dim=-1)
    assert cos.min().item() > 0.99, cos
