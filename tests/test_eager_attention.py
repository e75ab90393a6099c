"""The causal attention of the eager prefill on CPU runs cann_cpu::causal_attention
(executor.backends.eager_attention, csrc/causal_attention.cpp): its bf16 loop on AVX512-BF16 (taken
on a CPU without AMX), its fp32 loop on AVX2, or its wide fp32 loop on AVX-512F (taken on a CPU with
AMX; tested wherever AVX-512F runs).

The kernel is checked against fp64 attention (what it computes, at higher precision) with SDPA's
own error in the same dtype on the same inputs as the yardstick; the runner's prefill against
transformers in fp32 on the same checkpoint.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tests.checkpoints as ckpt
from executor.backends import eager_attention
from executor.backends.eager_attention import AttentionKernel, qualifies
from executor.custom_ops._build import cpu_has_amx, cpu_has_avx512
from executor.ops import reference as ops_reference
from tests.no_compiler import run_without_compiler
from tests.test_qwen_dense import PROMPT, assert_close_logits, hf_logits

DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]


@pytest.fixture(scope="module")
def kernel():
    if not eager_attention.kernel_runs(torch.bfloat16):
        pytest.skip("this CPU has no AVX512-BF16 (or no compiler to build the kernel)")


def needs_loop(dtype: torch.dtype) -> None:
    if not eager_attention.kernel_runs(dtype):
        pytest.skip(f"this CPU cannot run the kernel's {dtype} loop (or there is no compiler to build it)")


def reference(q, k, v, scale=None):
    """Causal GQA attention in fp64, each query head against its group's KV head."""
    return F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=True, scale=scale, enable_gqa=True
    )


def inputs(b, hq, hkv, s, d, seed=0, dtype=torch.bfloat16):
    """q as the model makes it (a transposed (B, S, H, D) view); k, v a slice of a longer cache."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, hq, d, generator=g).to(dtype).transpose(1, 2)
    cache = torch.randn(2, b, hkv, s + 40, d, generator=g).to(dtype)
    return q, cache[0, :, :, :s], cache[1, :, :, :s]


@pytest.mark.parametrize(
    "b,hq,hkv,s,d",
    [
        (1, 16, 8, 300, 128),  # the 0.6B shape's heads, blocks of keys past one 256-key block
        (2, 4, 4, 70, 64),  # two prompts, no grouping, a part of a 64-key tile
        (1, 14, 2, 257, 64),  # seven heads per KV head (Qwen2-0.5B), one key past a block
        (1, 2, 1, 1, 64),  # a single token
        (1, 4, 2, 33, 32),  # fp32's tiles only: the tiny checkpoints' head_dim, a part of a 16-key tile
        (1, 2, 2, 17, 16),
    ],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_fp64_attention_as_closely_as_sdpa(dtype, b, hq, hkv, s, d):
    needs_loop(dtype)
    if d % (eager_attention.WIDE_COLS if dtype == torch.bfloat16 else eager_attention.NARROW_COLS):
        pytest.skip(f"head_dim {d} is not a whole tile of the {dtype} loop")
    assert_as_close_as_sdpa(dtype, b, hq, hkv, s, d, wide=False)


def assert_as_close_as_sdpa(dtype, b, hq, hkv, s, d, wide):
    q, k, v = inputs(b, hq, hkv, s, d, dtype=dtype)
    want = reference(q, k, v)
    got = torch.ops.cann_cpu.causal_attention(q, k, v, d**-0.5, wide)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert got.shape == (b, hq, s, d) and got.dtype == dtype
    err, sdpa_err = (got.double() - want).abs(), (sdpa.double() - want).abs()
    floor = 1e-3 if dtype == torch.bfloat16 else 1e-6  # one rounding of an output in the dtype, about
    assert err.max() <= 1.5 * sdpa_err.max() + floor
    assert err.mean() <= 1.5 * sdpa_err.mean() + floor / 100


def needs_wide_loop() -> None:
    needs_loop(torch.float32)
    if not cpu_has_avx512(torch.float32):
        pytest.skip("this CPU has no AVX-512F for the wide fp32 loop")


@pytest.mark.parametrize(
    "b,hq,hkv,s,d",
    [
        (1, 16, 8, 300, 128),  # the 0.6B shape's heads, blocks of keys past one 256-key block
        (2, 4, 4, 70, 64),  # two prompts, no grouping, a part of a 64-key tile
        (1, 14, 2, 257, 64),  # seven heads per KV head, one key past a block
        (1, 2, 1, 1, 64),  # a single token
        (1, 4, 2, 600, 192),  # three 64-column blocks of the output, keys past two blocks
    ],
)
def test_the_wide_fp32_loop_matches_fp64_attention_as_closely_as_sdpa(b, hq, hkv, s, d):
    needs_wide_loop()
    assert_as_close_as_sdpa(torch.float32, b, hq, hkv, s, d, wide=True)


def test_the_wide_loop_is_fp32_on_whole_64_column_tiles_only():
    needs_wide_loop()
    q, k, v = inputs(1, 4, 2, 20, 64)
    with pytest.raises(RuntimeError, match="wide is the fp32 loop"):
        torch.ops.cann_cpu.causal_attention(q, k, v, 0.125, True)  # bf16
    q, k, v = (t[..., :48].float() for t in (q, k, v))
    with pytest.raises(RuntimeError, match="head_dim 48 is not a multiple of 64"):
        torch.ops.cann_cpu.causal_attention(q, k, v, 0.125, True)
    torch.ops.cann_cpu.causal_attention(q, k, v, 0.125)  # the AVX2 loop's 16-column tiles take it


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_scale_and_the_causal_mask_are_applied(dtype):
    needs_loop(dtype)
    q, k, v = inputs(1, 4, 2, 96, 64, seed=1, dtype=dtype)
    got = torch.ops.cann_cpu.causal_attention(q, k, v, 0.3).double()
    assert (got - reference(q, k, v, scale=0.3)).abs().max() < (0.02 if dtype == torch.bfloat16 else 1e-5)
    # The first query sees only the first key: its output is that key's value row.
    torch.testing.assert_close(got[:, :, 0], v[:, :, :1].repeat_interleave(2, 1)[:, :, 0].double(), rtol=0, atol=0)


def test_only_plain_causal_bf16_and_fp32_calls_qualify():
    q, k, v = inputs(1, 4, 2, 16, 64)
    assert qualifies(q, k, v)
    assert qualifies(q.float(), k.float(), v.float())
    assert not qualifies(q.double(), k.double(), v.double())
    assert not qualifies(q.float(), k, v)  # mixed dtypes
    assert not qualifies(q[..., :48], k[..., :48], v[..., :48])  # head_dim not a multiple of 64 (bf16)
    # fp32's tiles are 16 wide, or 64 where the wide loop is taken (a CPU with AMX)
    assert qualifies(*(t[..., :48].float() for t in (q, k, v))) == (not eager_attention.wide_f32())
    assert qualifies(*(t[..., :64].float() for t in (q, k, v)))
    assert not qualifies(*(t[..., :40].float() for t in (q, k, v)))
    assert not qualifies(q[:, :, :8], k, v)  # fewer queries than keys (a later chunk)
    assert not qualifies(q[:, :3], k, v)  # heads not a multiple of the KV heads
    with torch.enable_grad():
        assert not qualifies(q.detach().requires_grad_(), k, v)


def causal(s, t=None):
    """The runner's mask (B, 1, S, T), True = masked out: the plain causal one when T == S."""
    t = s if t is None else t
    return torch.ones(s, t, dtype=torch.bool).triu_(1).view(1, 1, s, t)


def test_the_table_entry_takes_causal_prefills_and_leaves_the_rest_to_the_reference(kernel):
    q, k, v = inputs(1, 4, 2, 40, 64)
    padded = causal(40).clone()
    padded[..., 30:] = True  # a padded key: not the plain causal mask
    entry = AttentionKernel()
    with torch.no_grad():
        got = entry.attention(q, k, v, causal(40), 64**-0.5)
        for args in [
            (q.double(), k.double(), v.double(), causal(40)),  # fp64
            (q, k, v, padded),  # another mask
            (q[:, :, :1], k[:, :, :1], v[:, :, :1], causal(1)),  # one query: the decode form
        ]:
            torch.testing.assert_close(entry.attention(*args, 0.125), ops_reference.attention(*args, 0.125))
    taken = eager_attention.takes_prefill()  # not on a CPU with AMX: SDPA's there
    assert entry.calls == int(taken)
    with torch.no_grad():
        want = ops_reference.attention(q, k, v, causal(40), 64**-0.5)
        if taken:
            want = torch.ops.cann_cpu.causal_attention(q, k, v, 64**-0.5)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.fixture(scope="module")
def wide_heads_ckpt(tmp_path_factory):
    """Qwen3 with head_dim 64 (the tiny checkpoints' 32 is not a whole tile of the kernel)."""
    return ckpt.make_qwen3_checkpoint(tmp_path_factory.mktemp("heads64") / "qwen3", head_dim=64, init_std=0.05)


def test_bf16_prefill_runs_the_kernel_and_matches_hf(kernel, wide_heads_ckpt, make_qwen_runner):
    runner = make_qwen_runner(wide_heads_ckpt, "model_config.dtype=bfloat16")
    gen = runner.generate([PROMPT], 2)
    taken = eager_attention.takes_prefill()  # not on a CPU with AMX: SDPA's there
    assert runner.prefill_kernels.to_metrics()["prefill_attention"] == {
        "kernel": eager_attention.KERNEL if taken else "sdpa",
        "kernel_calls": 2 * taken,
    }
    want = hf_logits(ckpt.load_reference(wide_heads_ckpt), PROMPT)[-1]
    got = gen.first_logits[0].float()
    assert F.cosine_similarity(got, want, dim=0) > 0.99


def test_fp32_prefill_takes_the_kernel_and_matches_hf(wide_heads_ckpt, make_qwen_runner):
    """An fp32 loop where one runs (AVX2; the wide one on a CPU with AMX), SDPA elsewhere; either way
    the prefill's logits and the greedy tokens are transformers'."""
    runner = make_qwen_runner(wide_heads_ckpt, "data_config.input_truncated_len=70")
    ref = ckpt.load_reference(wide_heads_ckpt)
    prompt = [(7 * i) % 90 + 3 for i in range(70)]  # past one 64-key tile (four 16-key ones), a part of the next
    gen = runner.generate([prompt], 4)
    taken = eager_attention.takes_prefill(torch.float32)
    assert taken == eager_attention.kernel_runs(torch.float32)
    assert eager_attention.wide_f32() == (cpu_has_amx() and cpu_has_avx512(torch.float32))
    assert runner.prefill_kernels.to_metrics()["prefill_attention"] == {
        "kernel": eager_attention.KERNEL if taken else "sdpa",
        "kernel_calls": 2 * taken,
    }
    assert_close_logits(gen.first_logits[0], hf_logits(ref, prompt)[-1])
    assert gen.token_ids == [ckpt.reference_greedy(ref, prompt, 4)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_compiler_is_one_line_and_sdpa_runs_the_calls(tmp_path, dtype):
    """A fresh kernel cache and CXX pointing at nothing: the table entry says so once and every call is
    SDPA's (no error: the kernel is a speed choice, not something the user asked for)."""
    if not eager_attention.takes_prefill(dtype):
        pytest.skip(f"the {dtype} prefill's attention stays SDPA's here, so the kernel is never built for it")
    name = str(dtype).removeprefix("torch.")
    code = (
        "import torch, torch.nn.functional as F\n"
        "from executor.backends.eager_attention import AttentionKernel\n"
        f"q = torch.randn(1, 4, 20, 64).to(torch.{name})\n"
        f"k, v = torch.randn(2, 1, 2, 20, 64).to(torch.{name})\n"
        "mask = torch.ones(20, 20, dtype=torch.bool).triu_(1).view(1, 1, 20, 20)\n"
        "want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)\n"
        "entry = AttentionKernel()\n"
        "with torch.no_grad():\n"
        "    for _ in range(3):\n"
        "        got = entry.attention(q, k, v, mask, 64**-0.5)\n"
        "torch.testing.assert_close(got, want, rtol=0, atol=0)\n"
        "print('calls', entry.calls)\n"
    )
    line, stdout = run_without_compiler(tmp_path, code, "eager_attention")
    assert "runs on SDPA instead" in line
    assert stdout.rstrip().endswith("calls 0")
