"""Large linears that run eagerly on CPU (executor.backends.eager_linear): fp32 GEMMs go through
oneDNN, products of 1-4 rows in bf16 and fp32 through the `cann_cpu::gemv` kernel (AVX-512 or
AVX2), bf16 GEMMs through `cann_cpu::rows_linear` where oneDNN would emulate bf16, and 2-64 bf16
rows through `cann_cpu::amx_linear` on a CPU with AMX.

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


def test_qualifying_linears_run_through_onednn_with_the_same_result():
    torch.manual_seed(0)
    big = torch.nn.Linear(256, LARGE)  # with a bias
    small = torch.nn.Linear(256, 32)
    x = torch.randn(2, 5, 256)
    mode = LinearKernel()
    with torch.no_grad():
        want_big, want_small = F.linear(x, big.weight, big.bias), small(x)
        got_big, got_small = mode.linear(x, big.weight, big.bias), mode.linear(x, small.weight, small.bias)
    assert (mode.onednn_calls, mode.gemv_calls) == (1, 0)  # 10 rows; the small weight stays with aten
    assert got_big.shape == (2, 5, LARGE)
    torch.testing.assert_close(got_big, want_big, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_small, want_small, rtol=0, atol=0)


def test_autograd_stays_with_aten():
    big = torch.nn.Linear(256, LARGE)
    x = torch.randn(4, 256, requires_grad=True)
    mode = LinearKernel()
    mode.linear(x, big.weight, big.bias).sum().backward()  # an op with a graph to record is left to aten
    assert (mode.onednn_calls, mode.gemv_calls, mode.rows_calls) == (0, 0, 0)
    assert x.grad is not None


def test_many_bf16_rows_go_to_the_rows_kernel_only_where_onednn_would_emulate_bf16():
    """Where oneDNN runs bf16 natively, aten's linear (which calls it) keeps them, except on a CPU
    with AMX, where the AMX loop takes up to 64 rows of a weight of whole 64-row blocks as stored;
    where oneDNN would emulate bf16 (an AVX2 host), the rows kernel takes a weight of whole 16-row
    blocks as stored."""
    torch.manual_seed(0)
    big = torch.nn.Linear(256, LARGE).to(torch.bfloat16)
    x = torch.randn(8, 256).to(torch.bfloat16)
    mode = LinearKernel()
    with torch.no_grad():
        got = mode.linear(x, big.weight, big.bias)
        mode.linear(x, big.weight[:-8], big.bias[:-8])  # N not a multiple of 16 (nor 64): aten
        many = mode.linear(torch.randn(65, 256).to(torch.bfloat16), big.weight, big.bias)  # past the AMX loop
    want = F.linear(x.double(), big.weight.double(), big.bias.double())
    takes = not packed_linear.supported(torch.bfloat16) and packed_linear.kernel_cols(torch.bfloat16) == 16
    plain = eager_linear.rows_run_plain(torch.bfloat16)
    amx = packed_linear.amx_runs()
    assert plain == (takes and packed_linear.kernel_runs(torch.bfloat16))
    assert not (plain and amx)
    assert (mode.onednn_calls, mode.gemv_calls, mode.rows_calls, mode.amx_calls) == (0, 0, 2 * plain, int(amx))
    torch.testing.assert_close(got.double(), want, rtol=8e-3, atol=1e-2)
    assert many.shape == (65, LARGE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(1, 1, 250), (4, 250), (1, 3, 250)])
def test_one_to_four_rows_run_the_gemv_kernel(dtype, shape):
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
    assert mode.gemv_calls == int(rows <= eager_linear.gemv_max_rows() and not mkl)  # AMX: bf16's single rows
    assert got.shape == (*shape[:-1], 2 * LARGE) and got.dtype == dtype
    err, aten_err = (got.double() - want).abs().max(), (aten.double() - want).abs().max()
    assert err <= 1.5 * aten_err + (1e-6 if dtype == torch.float32 else 1e-3)


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory):
    """Qwen2 (q/k/v bias) whose gate_up projection is large enough for the switch: 2 x 8192 x 64."""
    inter = packed_linear.MIN_WEIGHT_NUMEL // (2 * ckpt.QWEN2_CONFIG["hidden_size"])
    return ckpt.make_qwen2_checkpoint(tmp_path_factory.mktemp("wide") / "qwen2", intermediate_size=inter, init_std=0.05)


def test_prefill_uses_onednn_and_matches_hf(wide_ckpt, make_qwen_runner):
    runner, ref = make_qwen_runner(wide_ckpt), ckpt.load_reference(wide_ckpt)
    assert runner.prefill_kernels.linear_kernel == "onednn"
    expected = ckpt.reference_greedy(ref, PROMPT, 8)
    assert len(set(expected)) > 3, "degenerate reference; the comparison would prove little"
    gen = runner.generate([PROMPT], 8)
    assert gen.token_ids == [expected]
    assert_close_logits(gen.first_logits[0], hf_logits(ref, PROMPT)[-1])
    assert runner.prefill_kernels.to_metrics()["prefill_linears"] == {
        "kernel": "onednn",
        "onednn_calls": 2,
        "gemv_calls": 0,
        "rows_calls": 0,
        "amx_calls": 0,
    }


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
    assert len(gemv) == 2 * 7 * kernel  # one large weight per layer, 7 decode steps (the prefill's rows went to oneDNN)
    assert runner.prefill_kernels.to_metrics()["prefill_linears"]["gemv_calls"] == 0


def test_bf16_takes_the_kernels_and_small_models_keep_aten(wide_ckpt, qwen3_ckpt, make_qwen_runner):
    """bf16: the GEMV kernel for a few rows; more rows go to oneDNN through aten where it runs bf16
    natively, to the rows kernel where it would emulate it (the prefill then matches HF's logits)."""
    runner = make_qwen_runner(wide_ckpt, "model_config.dtype=bfloat16")
    native = packed_linear.supported(torch.bfloat16)
    want_kernel = "gemv+amx_linear" if packed_linear.cpu_has_amx() else "gemv" if native else "gemv+rows_linear"
    assert runner.prefill_kernels.linear_kernel == want_kernel
    if eager_linear.rows_run_plain(torch.bfloat16):
        first = runner.generate([PROMPT], 1).first_logits[0].float()
        want = hf_logits(ckpt.load_reference(wide_ckpt), PROMPT)[-1]  # fp32: bf16 is checked by cosine
        assert F.cosine_similarity(first, want, dim=0) > 0.99
        assert runner.prefill_kernels.to_metrics()["prefill_linears"]["rows_calls"] == 2  # gate_up, down
    assert make_qwen_runner(qwen3_ckpt).prefill_kernels.linear_kernel == "aten"  # every weight below the limit


def test_the_avx512_only_kernel_is_not_built_where_it_cannot_run(tmp_path):
    """causal_attention runs on AVX-512 only: on another host (an AVX2 VM, an Arm server) asking
    for it must say no without building it (about 15 s, wasted), in a fresh Python with an empty
    kernel cache. (gemv and rows_linear have AVX2 loops too.)"""
    if torch.cpu._is_avx512_supported():
        pytest.skip("this CPU has AVX-512: the kernel is built and run here (tests/test_eager_attention.py)")
    code = "from executor.backends import eager_attention\nprint(eager_attention.kernel_runs())\n"
    assert run_code(code, CANN_RECIPES_EXTENSIONS_DIR=str(tmp_path)).split() == ["False"]
    assert not any(tmp_path.iterdir()), "a kernel was built that this CPU cannot run"
