"""The eager CPU path's norms, SwiGLU and RoPE (executor.backends.eager_pointwise, csrc/pointwise.cpp)
and how the eager kernels are put over the op table (executor.ops.over_reference,
executor.backends.eager_kernels).

The kernels are held to the reference functions they replace (executor.ops.reference), which
the parity tests hold to transformers: in bf16 they round where the reference rounds, so RoPE is
bit-exact and the others may differ only by a rounding step; in fp32 to within a few ulps.
"""

from __future__ import annotations

import pytest
import torch

from executor import ops
from executor.backends import eager_pointwise
from executor.backends.eager_kernels import KernelTable
from executor.backends.eager_pointwise import PointwiseKernels
from executor.ops import reference
from tests.no_compiler import run_without_compiler

DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(scope="module")
def kernels():
    if not eager_pointwise.kernel_runs():
        pytest.skip("no compiler to build the kernels")


def assert_like_reference(got, want, exact: bool):
    """bf16: equal, or (not `exact`) one rounding step apart in a few elements; fp32: a few ulps."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=4e-6, atol=1e-6)
        return
    if exact:
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        return
    differ = got != want
    assert differ.float().mean() < 0.01
    torch.testing.assert_close(got[differ].float(), want[differ].float(), rtol=2**-7, atol=1e-6)


def heads(s=37, dtype=torch.bfloat16, seed=0):
    """q and k as the model makes them: (B, S, H, D) views of one fused projection, rows strided."""
    g = torch.Generator().manual_seed(seed)
    qkv = (3 * torch.randn(2, s, (4 + 2 + 2) * 64, generator=g)).to(dtype)
    q, k, _v = qkv.split([4 * 64, 2 * 64, 2 * 64], dim=-1)
    return q.view(2, s, 4, 64), k.view(2, s, 2, 64)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_norms_match_the_reference(kernels, dtype):
    g = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(2, 2, 37, 1000, generator=g) * 4).to(dtype)  # 1000: a partial vector block
    weight = torch.randn(1000, generator=g).to(dtype)
    q, _k = heads(dtype=dtype)
    qw = torch.randn(64, generator=g).to(dtype)
    fns = PointwiseKernels()
    assert_like_reference(fns.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), exact=False)
    assert_like_reference(fns.rms_norm(q, qw, 1e-5), reference.rms_norm(q, qw, 1e-5), exact=False)
    got_y, got_sum = fns.add_rms_norm(x, residual, weight, 1e-6)
    want_y, want_sum = reference.add_rms_norm(x, residual, weight, 1e-6)
    assert_like_reference(got_sum, want_sum, exact=True)  # one rounded add
    assert_like_reference(got_y, want_y, exact=False)
    assert fns.calls == 3


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_swiglu_and_rotary_match_the_reference(kernels, dtype):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 5, 2 * 700, generator=g) * 6).to(dtype)  # large |gate|: exp's range
    x[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -100.0])
    fns = PointwiseKernels()
    got, want = fns.swiglu(x), reference.swiglu(x)
    assert got[0, 0, :3].isnan().all() == want[0, 0, :3].isnan().all()
    assert_like_reference(got[..., 4:], want[..., 4:], exact=False)

    from models.qwen.models.modeling_qwen import rope_cos_sin

    q, k = heads(dtype=dtype)
    cos, sin = rope_cos_sin(torch.arange(37).expand(2, 37), 64, 1e4, dtype)  # (B, 1, S, D): broadcast over heads
    for t in (q.transpose(1, 2), k.transpose(1, 2)):  # (B, H, S, D) views
        got, want = fns.rotary_mul(t, cos, sin), reference.rotary_mul(t, cos, sin)
        assert_like_reference(got, want, exact=True)
        assert got.stride() == want.stride() and not got.is_contiguous()  # x's dim order, as the reference's
    assert fns.calls == 3


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_kv_update_writes_what_the_reference_writes(kernels, dtype):
    """The cache writes: a prefill's rows into a view of the full cache (rows 1-2, every slot), then
    new K given as (B, H, S, D) views of (B, S, H, D) memory at slots that differ per row: bit-equal
    to the reference's index_put_, in place; a slot past the cache is an error, as there."""
    g = torch.Generator().manual_seed(3)
    full = torch.randn(3, 2, 40, 64, generator=g).to(dtype)
    mine, want = full.clone(), full.clone()
    fns = PointwiseKernels()
    new = torch.randn(2, 2, 5, 64, generator=g).to(dtype)
    pos = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]])
    assert fns.kv_update(mine[1:3], new, pos).data_ptr() == mine[1:3].data_ptr()
    reference.kv_update(want[1:3], new, pos)
    strided = torch.randn(2, 5, 2, 64, generator=g).to(dtype).transpose(1, 2)
    pos = torch.tensor([[7, 8, 9, 10, 11], [39, 20, 5, 6, 30]])
    fns.kv_update(mine[1:3], strided, pos)
    reference.kv_update(want[1:3], strided, pos)
    assert torch.equal(mine, want) and fns.calls == 2
    with pytest.raises(RuntimeError, match="slot 40 outside"):
        fns.kv_update(mine[1:3], strided, pos + 1)


def test_calls_the_kernels_do_not_take_run_the_reference(kernels):
    fns = PointwiseKernels()
    half = torch.randn(4, 64).half()
    torch.testing.assert_close(fns.swiglu(half), reference.swiglu(half), rtol=0, atol=0)
    w = torch.randn(64, requires_grad=True)
    y = fns.rms_norm(torch.randn(4, 64), w, 1e-6)  # a graph to record: autograd needs the reference
    assert y.requires_grad
    columns = torch.randn(64, 4).t()  # rows not contiguous
    torch.testing.assert_close(fns.rms_norm(columns, w.detach(), 1e-6), reference.rms_norm(columns, w.detach(), 1e-6))
    mixed = torch.randn(4, 64).bfloat16()  # x in bf16, its weight in fp32: the kernels take one dtype
    torch.testing.assert_close(fns.rms_norm(mixed, w.detach(), 1e-6), reference.rms_norm(mixed, w.detach(), 1e-6))
    meta = torch.empty(4, 64, device="meta")  # not a CPU tensor
    assert fns.rms_norm(meta, torch.empty(64, device="meta"), 1e-6).device.type == "meta"
    assert fns.calls == 0


def test_a_kernel_says_which_calls_it_does_not_take(kernels):
    """The kernels check dtype, row strides and shapes themselves: a call they do not take returns
    None (kv_update: False) and writes nothing, so the Python side reads no strides; a value that is
    wrong for the reference too (a slot outside the cache) is still an error."""
    k = torch.ops.cann_cpu
    x = torch.randn(4, 64).bfloat16()
    w = torch.randn(64).bfloat16()
    assert k.rms_norm(x, w, 1e-6) is not None
    assert k.rms_norm(x.half(), w.half(), 1e-6) is None  # a dtype they do not run
    assert k.rms_norm(x, w.float(), 1e-6) is None  # two dtypes
    assert k.rms_norm(torch.randn(64, 4).bfloat16().t(), w, 1e-6) is None  # rows not contiguous
    assert k.rms_norm(x, w[:32], 1e-6) is None  # a weight of another length
    assert k.rms_norm(x[:0], w, 1e-6) is None  # nothing to norm
    assert len(k.add_rms_norm(x, x, w, 1e-6)) == 2
    assert k.add_rms_norm(x, x[:2], w, 1e-6) == []  # a residual of another shape
    assert k.swiglu(torch.randn(4, 63).bfloat16()) is None  # an odd row: no halves
    cos = torch.randn(1, 64).bfloat16()
    assert k.rotary_mul(x, cos, cos) is not None  # broadcast over the rows, as the model's
    assert k.rotary_mul(x, cos[:, :1], cos) is None  # a broadcast last dim: its rows are not contiguous
    assert k.rotary_mul(x, torch.randn(3, 64).bfloat16(), cos) is None  # does not broadcast to x
    cache = torch.zeros(1, 2, 8, 64).bfloat16()
    new = torch.randn(1, 2, 1, 64).bfloat16()
    assert k.kv_update(cache, new, torch.tensor([[3]], dtype=torch.int32)) is False  # int32 slots
    assert k.kv_update(cache, new.float(), torch.tensor([[3]])) is False
    assert not cache.any()
    assert k.kv_update(cache, new, torch.tensor([[3]])) is True and torch.equal(cache[:, :, 3:4], new)
    with pytest.raises(RuntimeError, match="slot 8 outside"):
        k.kv_update(cache, new, torch.tensor([[8]]))


def test_over_reference_replaces_only_reference_entries_and_restores_them():
    ops.register("test_over_reference", {"swiglu": lambda x: 2 * reference.swiglu(x)}, base="reference")
    table = KernelTable().functions()
    x = torch.randn(2, 8)
    with ops.using("test_over_reference"):
        before = ops.implementations()
        with ops.over_reference(table):
            now = ops.implementations()
            torch.testing.assert_close(ops.swiglu(x), 2 * reference.swiglu(x))  # the table's own entry stays
        assert ops.implementations() == before
    assert now["swiglu"] == before["swiglu"]
    assert now["rms_norm"].startswith("executor.backends.eager_pointwise.")
    assert now["linear"].startswith("executor.backends.eager_linear.")
    assert now["kv_update"].startswith("executor.backends.eager_pointwise.")
    assert now["moe_gating_top_k_softmax"] == before["moe_gating_top_k_softmax"]  # not one the kernels provide
    with pytest.raises(ValueError, match="unknown ops"), ops.over_reference({"softmax": reference.swiglu}):
        pass


def test_over_reference_reaches_the_calls_a_custom_op_hands_to_the_reference():
    """decode_attention layered over the reference (as its default at 512 slots does): inside
    over_reference its prefill calls (several query rows) reach the kernels' attention, not SDPA."""
    from executor import custom_ops

    name = custom_ops.layer("reference", ["decode_attention"], install=lambda op: None)
    seen = []

    def attention(q, k, v, mask, scale):
        seen.append(q.shape[2])
        return reference.attention(q, k, v, mask, scale)

    q, k, v = torch.randn(1, 4, 6, 64), torch.randn(1, 2, 6, 64), torch.randn(1, 2, 6, 64)
    mask = torch.ones(6, 6, dtype=torch.bool).triu_(1).view(1, 1, 6, 6)
    with ops.using(name):
        layered = ops.implementations()["attention"]
        with ops.over_reference({"attention": attention}):
            got = ops.attention(q, k, v, mask, 0.125)
        ops.attention(q, k, v, mask, 0.125)  # outside: the op's own base again
        assert ops.implementations()["attention"] == layered
    assert seen == [6]
    torch.testing.assert_close(got, reference.attention(q, k, v, mask, 0.125))


def test_the_runner_prefill_runs_the_kernels(kernels, qwen3_ckpt, make_qwen_runner):
    runner = make_qwen_runner(qwen3_ckpt)
    runner.generate([[5, 6, 7, 8]], 2)
    metrics = runner.prefill_kernels.to_metrics()["prefill_pointwise"]
    layers = runner.arch.num_layers
    # per layer: input norm, q and k norms, two RoPEs, K and V written, add + norm, SwiGLU; then the final norm
    assert metrics == {"kernel": "cann_cpu::pointwise", "kernel_calls": 9 * layers + 1}


def test_the_eager_decode_step_runs_in_inference_mode(qwen3_ckpt, make_qwen_runner):
    """The eager CPU step runs in inference mode (eager_kernels.eager_step): its logits are inference
    tensors, the KV cache it writes in place is not (made outside), and a second generate on the
    same runner, whose prefill rewrites that cache outside inference mode, gives the same tokens."""
    runner = make_qwen_runner(qwen3_ckpt, "model_config.exe_mode=eager", "model_config.enable_superkernel=false")
    first = runner.generate([[5, 6, 7, 8]], 4)
    with runner.session(1):
        pos = torch.tensor([[4]])
        logits = runner.decode_one(torch.tensor([[9]]), pos)
        pos += 1  # made outside: still an ordinary tensor
    assert logits.is_inference() and not runner.cache.k[0].is_inference()
    assert runner.generate([[5, 6, 7, 8]], 4).token_ids == first.token_ids


def test_no_compiler_is_one_line_and_the_reference_runs(tmp_path):
    code = (
        "import torch\n"
        "from executor.backends.eager_pointwise import PointwiseKernels\n"
        "from executor.ops import reference\n"
        "fns, x = PointwiseKernels(), torch.randn(3, 64)\n"
        "for _ in range(3):\n"
        "    torch.testing.assert_close(fns.swiglu(x), reference.swiglu(x), rtol=0, atol=0)\n"
        "print('calls', fns.calls)\n"
    )
    line, stdout = run_without_compiler(tmp_path, code, "eager_pointwise")
    assert "run on the reference instead" in line
    assert stdout.rstrip().endswith("calls 0")
