"""Large linears that run eagerly on CPU (executor.backends.eager_linear): fp32 GEMMs go through
oneDNN, products of 1-4 rows in bf16 and fp32 through the `cann_cpu::gemv` kernel (AVX-512 or
AVX2), of 3-64 rows through `cann_cpu::dot_linear` (AVX-512 or AVX2; in bf16 on a CPU without AMX; 3-11 in
bf16 and 3-16 in fp32 on the AVX2 loop), GEMMs of more rows through `cann_cpu::rows_linear` on the
weight as stored on a CPU without AVX-512 (bf16 where oneDNN would emulate it, and fp32), and 2-64
bf16 rows through `cann_cpu::amx_linear` on a CPU with AMX.

The tiny test models' weights are below the size where the switch applies, so a checkpoint with
one large projection is built here; against transformers (aten's sgemm) the prefill logits and the
greedy tokens of the eager decode (its step runs the kernel) must stay what the other parity tests
demand.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tests.checkpoints as ckpt
from executor.backends import eager_linear, packed_linear
from executor.backends.eager_linear import LinearKernel
from tests.fresh_python import run_code
from tests.test_qwen_dense import PROMPT, assert_close_logits, hf_logits

pytestmark = pytest.mark.skipif(not packed_linear.supported(torch.float32), reason="torch built without oneDNN")

LARGE = packed_linear.MIN_WEIGHT_NUMEL // 256
REPO = Path(__file__).resolve().parent.parent


def test_qualifying_fp32_gemms_run_through_onednn_or_the_rows_kernel_with_the_same_result():
    """80 fp32 rows, past dot_linear: the rows kernel on the weight as stored on a CPU without
    AVX-512 (rows_run_plain: faster than oneDNN there), oneDNN elsewhere; a small weight: aten."""
    torch.manual_seed(0)
    big = torch.nn.Linear(256, LARGE)  # with a bias
    small = torch.nn.Linear(256, 32)
    x = torch.randn(2, 40, 256)
    mode = LinearKernel()
    with torch.no_grad():
        want_big, want_small = F.linear(x, big.weight, big.bias), small(x)
        got_big, got_small = mode.linear(x, big.weight, big.bias), mode.linear(x, small.weight, small.bias)
    plain = eager_linear.rows_run_plain(torch.float32)
    assert plain == (not torch.cpu._is_avx512_supported() and packed_linear.kernel_runs(torch.float32))
    assert (mode.onednn_calls, mode.rows_calls, mode.gemv_calls, mode.dot_calls) == (int(not plain), int(plain), 0, 0)
    assert got_big.shape == (2, 40, LARGE)
    torch.testing.assert_close(got_big, want_big, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_small, want_small, rtol=0, atol=0)


def test_fp32_gemms_past_the_rows_kernels_rows_go_to_aten_on_its_cpu():
    """More than PLAIN_MAX_ROWS_F32 fp32 rows: aten's sgemm where the rows kernel takes fp32 (faster
    there at that size), oneDNN elsewhere (aten on a CPU with AMX, past ATEN_MIN_ROWS_F32), as below
    the limit; the rows kernel keeps the limit itself."""
    torch.manual_seed(0)
    big = torch.nn.Linear(256, LARGE)
    limit = eager_linear.PLAIN_MAX_ROWS_F32
    mode = LinearKernel()
    with torch.no_grad():
        for rows in (limit, limit + 1):
            x = torch.randn(rows, 256)
            torch.testing.assert_close(mode.linear(x, big.weight, big.bias), F.linear(x, big.weight, big.bias))
    plain = eager_linear.rows_run_plain(torch.float32)
    elsewhere = (0, 2, 0) if eager_linear.aten_takes_long_prompts(torch.float32) else (0, 0, 2)
    assert (mode.rows_calls, mode.aten_calls, mode.onednn_calls) == ((1, 1, 0) if plain else elsewhere)


def test_long_fp32_prompts_go_to_aten_on_a_cpu_with_amx():
    """From ATEN_MIN_ROWS_F32 rows on, an fp32 product that oneDNN would run is aten's (MKL's sgemm)
    on a CPU with AMX; elsewhere oneDNN keeps it (or the rows kernel, on an AVX2 CPU)."""
    if eager_linear.rows_run_plain(torch.float32) or not packed_linear.supported(torch.float32):
        pytest.skip("oneDNN does not take fp32 GEMMs of many rows on this CPU")
    torch.manual_seed(0)
    big = torch.nn.Linear(256, LARGE)
    limit = eager_linear.ATEN_MIN_ROWS_F32
    mode = LinearKernel()
    with torch.no_grad():
        for rows in (limit - 1, limit):
            x = torch.randn(rows, 256)
            torch.testing.assert_close(mode.linear(x, big.weight, big.bias), F.linear(x, big.weight, big.bias))
    amx = eager_linear.aten_takes_long_prompts(torch.float32)
    assert amx == torch.cpu._is_amx_tile_supported()
    assert (mode.onednn_calls, mode.aten_calls) == ((1, 1) if amx else (2, 0))


def test_autograd_stays_with_aten():
    big = torch.nn.Linear(256, LARGE)
    x = torch.randn(4, 256, requires_grad=True)
    mode = LinearKernel()
    mode.linear(x, big.weight, big.bias).sum().backward()  # an op with a graph to record is left to aten
    assert (mode.onednn_calls, mode.gemv_calls, mode.rows_calls) == (0, 0, 0)
    assert x.grad is not None


def test_many_bf16_rows_go_to_the_rows_kernel_except_on_a_cpu_with_amx():
    """Up to 64 rows: on a CPU with AMX the AMX loop takes those of a weight of whole 64-row blocks as
    stored (and more, up to AMX_STORED_MAX_ROWS), on another AVX512-BF16 CPU dot_linear takes any
    weight as stored. Past 64 rows the rows kernel takes a weight as stored, packing it as it goes,
    where it has a loop for it: its AVX2 loop (whole 16-row blocks) where oneDNN would emulate bf16
    (an AVX2 host; dot_linear's AVX2 loop only up to 11 rows), its AVX-512 loop (whole 64-row blocks,
    K even) on an AVX512-BF16 CPU without AMX; aten's linear (oneDNN) otherwise, and for a weight
    the blocks do not divide."""
    torch.manual_seed(0)
    big = torch.nn.Linear(256, LARGE).to(torch.bfloat16)
    odd = torch.nn.Linear(256, LARGE + 16).to(torch.bfloat16)  # N a multiple of 16, not of 64
    x = torch.randn(12, 256).to(torch.bfloat16)
    mode = LinearKernel()
    with torch.no_grad():
        got = mode.linear(x, big.weight, big.bias)
        mode.linear(x, big.weight[:-8], big.bias[:-8])  # just below the size limit: aten
        x_many = torch.randn(65, 256).to(torch.bfloat16)
        many = mode.linear(x_many, big.weight, big.bias)  # past dot_linear (on AMX: still its loop)
        mode.linear(x_many, odd.weight, odd.bias)  # the AVX2 loop's blocks divide it, the AVX-512 one's not
        x_past = torch.randn(eager_linear.AMX_STORED_MAX_ROWS + 1, 256).to(torch.bfloat16)
        past = mode.linear(x_past, big.weight, big.bias)  # past the AMX loop's rows too
    want = F.linear(x.double(), big.weight.double(), big.bias.double())
    emulated = not packed_linear.supported(torch.bfloat16) and packed_linear.kernel_cols(torch.bfloat16) == 16
    avx512 = packed_linear.kernel_cols(torch.bfloat16) == 64 and not packed_linear.cpu_has_amx()
    plain = eager_linear.rows_run_plain(torch.bfloat16)
    amx = packed_linear.amx_runs()
    assert plain == ((emulated or avx512) and packed_linear.kernel_runs(torch.bfloat16))
    assert eager_linear.plain_cols(torch.bfloat16) == (16 if emulated else 64 if avx512 else 0) * plain
    assert not (plain and amx)
    # 12 rows: dot_linear's AVX2 loop leaves them to the rows kernel
    dot = int(eager_linear.dot_runs(torch.bfloat16) and eager_linear.dot_max_rows(torch.bfloat16) >= 12)
    # the AVX2 loop: 12 rows, 65 rows twice, 193 rows; the AVX-512 one: `big` only (65 and 193 rows)
    rows_calls = (4 if emulated else 2) * plain
    assert (mode.onednn_calls, mode.gemv_calls, mode.rows_calls, mode.amx_calls, mode.dot_calls) == (
        0,
        0,
        rows_calls,
        2 * int(amx),  # 12 and 65 rows of `big`; `odd` is no whole 64-row blocks, 193 rows past the loop's
        dot,
    )
    torch.testing.assert_close(got.double(), want, rtol=8e-3, atol=1e-2)
    assert many.shape == (65, LARGE)
    for x_in, y in ((x_many, many), (x_past, past)):
        ref = F.linear(x_in.double(), big.weight.double(), big.bias.double())
        torch.testing.assert_close(y.double(), ref, rtol=8e-3, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(1, 1, 250), (4, 250), (1, 3, 250)])
def test_one_to_four_rows_run_the_few_row_kernels(dtype, shape):
    """The GEMV kernel, or dot_linear for 3-4 rows where it runs."""
    if not eager_linear.gemv_runs(dtype):
        pytest.skip("neither AVX-512 nor AVX2 here, or no compiler for the kernel")
    torch.manual_seed(0)
    big = torch.nn.Linear(250, 2 * LARGE).to(dtype)  # K = 250: a masked tail in both dtypes
    x = torch.randn(shape).to(dtype)
    want = F.linear(x.double(), big.weight.double(), big.bias.double())
    mode = LinearKernel()
    with torch.no_grad():
        aten = F.linear(x, big.weight, big.bias)
        got = mode.linear(x, big.weight, big.bias)
        mode.linear(x, big.weight.t().contiguous().t(), big.bias)  # columns contiguous: not the kernel's layout
    rows = math.prod(shape[:-1])
    mkl = rows == 1 and eager_linear.aten_takes_single_rows(dtype)  # a CPU with AMX: fp32's single rows
    dot = rows >= eager_linear.DOT_MIN_ROWS and eager_linear.dot_runs(dtype)
    assert mode.gemv_calls == int(rows <= eager_linear.gemv_max_rows(dtype) and not mkl)  # AMX: bf16's single rows
    assert mode.dot_calls == int(dot)  # 3-4 rows where dot_linear runs
    assert got.shape == (*shape[:-1], 2 * LARGE) and got.dtype == dtype
    err, aten_err = (got.double() - want).abs().max(), (aten.double() - want).abs().max()
    assert err <= 1.5 * aten_err + (1e-6 if dtype == torch.float32 else 1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_single_row_sums_as_each_row_of_two_does(dtype):
    """One row of x runs two weight rows at a time on an Intel CPU (csrc/gemv.cpp, run_pairs: rows n
    and n + 64 of each block of 128, the outputs past the last whole block one at a time), one row at
    a time elsewhere; two rows of x run bf16_row / f32_row<2>. Each sums in the same order, so a row
    alone gives what it gives beside another, bit for bit, bias included: K = 300 (two 128-value steps
    and a masked tail), 100 outputs (no whole block), 300 (two and a tail of 44), 384 (three)."""
    if not eager_linear.gemv_runs(dtype):
        pytest.skip("neither AVX-512 nor AVX2 here, or no compiler for the kernel")
    torch.manual_seed(5)
    for n in (100, 300, 384):
        w, b = (torch.randn(n, 300) * 0.1).to(dtype), torch.randn(n).to(dtype)
        x = torch.randn(1, 300).to(dtype)
        alone = torch.ops.cann_cpu.gemv(x, w, b)
        beside = torch.ops.cann_cpu.gemv(torch.cat([x, torch.randn(1, 300).to(dtype)]), w, b)
        assert torch.equal(alone[0], beside[0]), n
        want = F.linear(x.double(), w.double(), b.double())
        torch.testing.assert_close(alone.double(), want, rtol=8e-3, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gemv_every_output_once_whatever_the_threads(dtype):
    """The GEMV kernel hands each thread a share of the outputs (blocks of 32) and lets a thread that
    is done take the last blocks of another's share (csrc/linear_io.h, leftovers_for). An output's
    sum does not depend on the thread that runs it, so every thread count must give the one-thread
    result bit for bit; an output no thread runs keeps what its memory held, and two inputs taking
    turns make that the other input's result where the allocator hands the same memory back. Output
    counts below one share (256), between, and with a last block of 5; 5 threads on 2 cores wait for
    a core."""
    if not eager_linear.gemv_runs(dtype):
        pytest.skip("neither AVX-512 nor AVX2 here, or no compiler for the kernel")
    before = torch.get_num_threads()
    torch.manual_seed(3)
    try:
        for n in (100, 300, 32 * 40 + 5):
            w = (torch.randn(n, 96) * 0.1).to(dtype)
            for rows in (1, 2, 4):
                xs = [torch.randn(rows, 96).to(dtype) for _ in range(2)]
                torch.set_num_threads(1)
                alone = [torch.ops.cann_cpu.gemv(x, w, None) for x in xs]
                for threads in (2, 3, 5):
                    torch.set_num_threads(threads)
                    for i in range(10):
                        got = torch.ops.cann_cpu.gemv(xs[i % 2], w, None)
                        assert torch.equal(got, alone[i % 2]), (n, rows, threads)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rows", [3, 5, 6, 7, 11, 16, 17, 32, 48, 64])
def test_three_to_64_rows_run_dot_linear(dtype, rows):
    """Both loops: the tiles (3-7 rows: one tile of rows, 11 and 16-17: balanced tiles; N = 4k + 3: a last
    block of three weight rows; K = 250: a masked tail) and the packed-x loop (32, 48, 64 rows: 2-4
    vectors of x; the last N % (24 / vectors) weight rows on the tiles), a bias and x with strided
    rows: as close to a double-precision reference as aten's linear is."""
    if not eager_linear.dot_runs(dtype):
        pytest.skip("dot_linear runs on a CPU with AVX-512 or AVX2 and FMA (in bf16 without AMX)")
    torch.manual_seed(0)
    big = torch.nn.Linear(250, 2 * LARGE + 3).to(dtype)
    x = torch.randn(rows, 500).to(dtype)[:, ::2]
    want = F.linear(x.double(), big.weight.double(), big.bias.double())
    mode = LinearKernel()
    with torch.no_grad():
        aten = F.linear(x, big.weight, big.bias)
        got = torch.ops.cann_cpu.dot_linear(x, big.weight, big.bias)  # either loop takes 1-64 rows
        mode.linear(x, big.weight, big.bias)
        mode.linear(torch.randn(65, 250).to(dtype), big.weight, big.bias)  # past its rows: oneDNN / aten
    routed = rows <= eager_linear.dot_max_rows(dtype)  # the AVX2 loop: 3-16 fp32 rows, 3-11 bf16 ones
    assert mode.dot_calls == int(routed) and mode.gemv_calls == 0
    assert mode.onednn_calls == (2 - routed) * (dtype == torch.float32)
    assert got.shape == (rows, 2 * LARGE + 3) and got.dtype == dtype
    err, aten_err = (got.double() - want).abs().max(), (aten.double() - want).abs().max()
    assert err <= 1.5 * aten_err + (1e-6 if dtype == torch.float32 else 1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_dot_linear_every_tile_shape(dtype):
    """Every tile of either loop: 1-13 rows of x (AVX2: tiles of 1-4 rows; AVX-512: 1-6), N = 3k,
    3k + 1, 3k + 2 (AVX2: a last block of 1-3 weight rows; AVX-512: 4k + 0-3), K with a tail past
    the last whole 16 (AVX2: scalar; AVX-512: masked), with and without a bias."""
    if not eager_linear.dot_runs(dtype):
        pytest.skip("dot_linear runs on a CPU with AVX-512 or AVX2 and FMA (in bf16 without AMX)")
    torch.manual_seed(0)
    for rows, n, k, bias in [(1, 12, 37, True), (2, 13, 16, False), (3, 14, 250, True), (4, 15, 33, True),
                             (5, 16, 64, False), (9, 17, 250, True), (13, 31, 19, True)]:  # fmt: skip
        x, w = torch.randn(rows, k).to(dtype), torch.randn(n, k).to(dtype)
        b = torch.randn(n).to(dtype) if bias else None
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        got = torch.ops.cann_cpu.dot_linear(x, w, b)
        aten = F.linear(x, w, b)
        err, aten_err = (got.double() - want).abs().max(), (aten.double() - want).abs().max()
        assert err <= 1.5 * aten_err + (1e-5 if dtype == torch.float32 else 1e-2), (rows, n, k, bias)


def test_dot_linear_refuses_what_it_does_not_take():
    if not eager_linear.dot_runs(torch.float32):
        pytest.skip("dot_linear runs on a CPU with AVX-512 or AVX2 and FMA (in bf16 without AMX)")
    w = torch.randn(8, 32)
    with pytest.raises(RuntimeError, match="1 to 64 rows"):
        torch.ops.cann_cpu.dot_linear(torch.randn(65, 32), w, None)
    with pytest.raises(RuntimeError, match="x is"):
        torch.ops.cann_cpu.dot_linear(torch.randn(5, 32, dtype=torch.float64), w, None)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        torch.ops.cann_cpu.dot_linear(torch.randn(5, 8), w.t(), None)
    with pytest.raises(RuntimeError, match="bias has 7 values"):
        torch.ops.cann_cpu.dot_linear(torch.randn(5, 32), w, torch.randn(7))


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory):
    """Qwen2 (q/k/v bias) whose gate_up projection is large enough for the switch: 2 x 8192 x 64."""
    inter = packed_linear.MIN_WEIGHT_NUMEL // (2 * ckpt.QWEN2_CONFIG["hidden_size"])
    return ckpt.make_qwen2_checkpoint(tmp_path_factory.mktemp("wide") / "qwen2", intermediate_size=inter, init_std=0.05)


def test_prefill_linears_match_hf(wide_ckpt, make_qwen_runner):
    """The prompt's rows (3-64 of them) go to dot_linear where it runs (AVX-512 or AVX2, with AMX
    too: fp32 has no tiles), to oneDNN elsewhere; on an AVX2 CPU more than 16 rows go to the rows
    kernel (below). On a CPU with AMX a single fp32 row goes to aten, so no GEMV kernel is named."""
    runner, ref = make_qwen_runner(wide_ckpt), ckpt.load_reference(wide_ckpt)
    dot = eager_linear.dot_runs(torch.float32)
    assert dot == (torch.cpu._is_avx512_supported() or torch.cpu._is_avx2_supported())
    many = "rows_linear" if eager_linear.rows_run_plain(torch.float32) else "onednn"
    if eager_linear.aten_takes_long_prompts(torch.float32):
        many += "+aten"  # from ATEN_MIN_ROWS_F32 rows (none in this prompt)
    gemv = "" if eager_linear.aten_takes_single_rows(torch.float32) else "gemv+"
    assert runner.prefill_kernels.linear_kernel == (f"{gemv}dot_linear+{many}" if dot else "onednn")
    expected = ckpt.reference_greedy(ref, PROMPT, 8)
    assert len(set(expected)) > 3, "degenerate reference; the comparison would prove little"
    gen = runner.generate([PROMPT], 8)
    assert gen.token_ids == [expected]
    assert_close_logits(gen.first_logits[0], hf_logits(ref, PROMPT)[-1])
    assert runner.prefill_kernels.to_metrics()["prefill_linears"] == {
        "kernel": f"{gemv}dot_linear+{many}" if dot else "onednn",
        "onednn_calls": 0 if dot else 2,
        "gemv_calls": 0,
        "dot_calls": 2 if dot else 0,
        "rows_calls": 0,
        "amx_calls": 0,
        "aten_calls": 0,
    }


def test_a_long_fp32_prompt_runs_the_rows_kernel_and_matches_hf(wide_ckpt, make_qwen_runner):
    """24 prompt rows in fp32 on a CPU without AVX-512: past dot_linear's 16, the rows kernel on the
    weights as stored (its vectorized block packing) gives HF's logits."""
    if not eager_linear.rows_run_plain(torch.float32):
        pytest.skip("the rows kernel takes fp32 GEMMs only on an AVX2 CPU without AVX-512")
    runner, ref = make_qwen_runner(wide_ckpt), ckpt.load_reference(wide_ckpt)
    prompt = [(7 * i) % 90 + 3 for i in range(24)]
    gen = runner.generate([prompt], 1)
    assert_close_logits(gen.first_logits[0], hf_logits(ref, prompt)[-1])
    assert runner.prefill_kernels.to_metrics()["prefill_linears"]["rows_calls"] == 2  # gate_up, down


def test_eager_decode_runs_the_gemv_kernel_and_matches_hf(wide_ckpt, make_qwen_runner):
    """The eager decode step's large linear (one row) runs the kernel (aten's, on a CPU with AMX);
    the tokens stay HF's."""
    if not eager_linear.gemv_runs(torch.float32):
        pytest.skip("neither AVX-512 nor AVX2 here, or no compiler for the kernel")
    runner, ref = make_qwen_runner(wide_ckpt, "model_config.exe_mode=eager"), ckpt.load_reference(wide_ckpt)
    expected = ckpt.reference_greedy(ref, PROMPT, 8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        gen = runner.generate([PROMPT], 8)
    assert gen.token_ids == [expected]
    gemv = [e for e in prof.events() if e.name == "cann_cpu::gemv"]
    kernel = not eager_linear.aten_takes_single_rows(torch.float32)
    assert len(gemv) == 2 * 7 * kernel  # one large weight per layer, 7 decode steps (the prefill's rows: more than 4)
    assert runner.prefill_kernels.to_metrics()["prefill_linears"]["gemv_calls"] == 0


def test_bf16_takes_the_kernels_and_small_models_keep_aten(wide_ckpt, qwen3_ckpt, make_qwen_runner):
    """bf16: the GEMV kernel for a few rows; more rows go to dot_linear (up to 64, an AVX512-BF16
    CPU without AMX), the AMX loop (up to 64, a CPU with AMX) or oneDNN through aten where it runs
    bf16 natively; past dot_linear's rows to the rows kernel on the weight as stored where oneDNN
    would emulate bf16 and on an AVX512-BF16 CPU without AMX (the prefill then matches HF's
    logits)."""
    # a cache for 66 prompt rows (the AVX-512 case below)
    runner = make_qwen_runner(wide_ckpt, "model_config.dtype=bfloat16", "data_config.input_truncated_len=72")
    native = packed_linear.supported(torch.bfloat16)
    want_kernel = (
        "gemv+amx_linear"
        if packed_linear.cpu_has_amx()
        else "gemv+dot_linear+rows_linear"
        if torch.cpu._is_avx512_bf16_supported()
        else "gemv"
        if native
        else "gemv+dot_linear+rows_linear"
        if eager_linear.dot_runs(torch.bfloat16)
        else "gemv+rows_linear"
    )
    assert runner.prefill_kernels.linear_kernel == want_kernel
    if eager_linear.rows_run_plain(torch.bfloat16):
        rows = eager_linear.dot_max_rows(torch.bfloat16) + 2  # past dot_linear's: 13 on its AVX2 loop, 66 on AVX-512
        prompt = (PROMPT + [(7 * i) % 90 + 60 for i in range(rows)])[:rows]
        first = runner.generate([prompt], 1).first_logits[0].float()
        want = hf_logits(ckpt.load_reference(wide_ckpt), prompt)[-1]  # fp32: bf16 is checked by cosine
        assert F.cosine_similarity(first, want, dim=0) > 0.99
        assert runner.prefill_kernels.to_metrics()["prefill_linears"]["rows_calls"] == 2  # gate_up, down
    assert make_qwen_runner(qwen3_ckpt).prefill_kernels.linear_kernel == "aten"  # every weight below the limit


def test_the_avx512_only_kernel_is_not_built_where_it_cannot_run(tmp_path):
    """causal_attention's bf16 loop runs on AVX-512 only: on another host (an AVX2 VM, an Arm server)
    asking for it must say no without building it (about 15 s, wasted), in a fresh Python with an
    empty kernel cache. (gemv, rows_linear and causal_attention's fp32 loop have AVX2 loops too.)"""
    if torch.cpu._is_avx512_supported():
        pytest.skip("this CPU has AVX-512: the kernel is built and run here (tests/test_eager_attention.py)")
    code = "import torch\nfrom executor.backends import eager_attention as a\nprint(a.kernel_runs(torch.bfloat16))\n"
    assert run_code(code, CANN_RECIPES_EXTENSIONS_DIR=str(tmp_path)).split() == ["False"]
    assert not any(tmp_path.iterdir()), "a kernel was built that this CPU cannot run"
