"""The eager prefill's fp32 linears on CPU go through oneDNN (executor.backends.eager_linear).

The tiny test models' weights are below the size where the switch applies, so a checkpoint with
one large projection is built here; against transformers (aten's sgemm) the prefill logits and the
greedy tokens must stay what the other parity tests demand.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tests.checkpoints as ckpt
from executor.backends import packed_linear
from executor.backends.eager_linear import OneDNNLinears
from tests.test_qwen_dense import PROMPT, assert_close_logits, hf_logits

pytestmark = pytest.mark.skipif(not packed_linear.supported(torch.float32), reason="torch built without oneDNN")

LARGE = packed_linear.MIN_WEIGHT_NUMEL // 256


def test_qualifying_linears_run_through_onednn_with_the_same_result():
    torch.manual_seed(0)
    big = torch.nn.Linear(256, LARGE)  # with a bias
    small = torch.nn.Linear(256, 32)
    x = torch.randn(2, 5, 256)
    with torch.no_grad():
        want_big, want_small = F.linear(x, big.weight, big.bias), small(x)
        with OneDNNLinears() as mode:
            got_big, got_small = big(x), small(x)
    assert mode.calls == 1  # the small weight stays with aten
    assert got_big.shape == (2, 5, LARGE)
    torch.testing.assert_close(got_big, want_big, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_small, want_small, rtol=0, atol=0)


def test_bf16_and_autograd_stay_with_aten():
    big = torch.nn.Linear(256, LARGE)
    x = torch.randn(4, 256, requires_grad=True)
    with OneDNNLinears() as mode:
        big(x).sum().backward()  # an op with a graph to record is left to aten
        with torch.no_grad():
            big.to(torch.bfloat16)(x.detach().bfloat16())  # aten already calls oneDNN for bf16
    assert mode.calls == 0
    assert x.grad is not None


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory):
    """Qwen2 (q/k/v bias) whose gate_up projection is large enough for the switch: 2 x 8192 x 64."""
    inter = packed_linear.MIN_WEIGHT_NUMEL // (2 * ckpt.QWEN2_CONFIG["hidden_size"])
    return ckpt.make_qwen2_checkpoint(tmp_path_factory.mktemp("wide") / "qwen2", intermediate_size=inter, init_std=0.05)


def test_prefill_uses_onednn_and_matches_hf(wide_ckpt, make_qwen_runner):
    runner, ref = make_qwen_runner(wide_ckpt), ckpt.load_reference(wide_ckpt)
    assert runner.prefill_linears.kernel == "onednn"
    expected = ckpt.reference_greedy(ref, PROMPT, 8)
    assert len(set(expected)) > 3, "degenerate reference; the comparison would prove little"
    gen = runner.generate([PROMPT], 8)
    assert gen.token_ids == [expected]
    assert_close_logits(gen.first_logits[0], hf_logits(ref, PROMPT)[-1])
    assert runner.prefill_linears.to_metrics() == {"kernel": "onednn", "onednn_calls": 2}  # one per layer


def test_bf16_and_small_models_keep_aten(wide_ckpt, qwen3_ckpt, make_qwen_runner):
    assert make_qwen_runner(wide_ckpt, "model_config.dtype=bfloat16").prefill_linears.kernel == "aten"
    assert make_qwen_runner(qwen3_ckpt).prefill_linears.kernel == "aten"  # every weight below the limit
