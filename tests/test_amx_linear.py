"""cann_cpu::amx_linear: batched bf16 decode GEMMs on Intel AMX tiles (csrc/amx_linear.cpp), against
fp32 `linear` on the same values, and how executor.backends.packed_linear routes to it.

The loop runs only on a CPU with AMX-BF16 (an Intel Xeon, Sapphire Rapids or later); there its
tests run, elsewhere they skip, and the one test that runs everywhere checks that such a host never
builds the library.
"""

from __future__ import annotations

import pytest
import torch

from executor.backends import packed_linear
from executor.custom_ops import _build
from tests.no_compiler import run_without_compiler

needs_amx = pytest.mark.skipif(
    not packed_linear.amx_runs(), reason="no AMX-BF16 on this CPU (or its loop could not be built)"
)


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())


def test_a_cpu_without_amx_never_builds_the_loop():
    if _build.cpu_has_amx():
        pytest.skip("this CPU has AMX")
    w = torch.zeros(256, 128, dtype=torch.bfloat16)
    assert not packed_linear.amx_fits(w, 4)
    assert "cann_cpu_amx_linear" not in _build._loaded


def test_the_fake_kernel_gives_the_shape_for_both_layouts():
    """What a traced graph sees (no kernel needed): N from the packed blocks or from the stored rows."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(3, 1, 128, dtype=torch.bfloat16)
        packed = torch.ops.cann_cpu.amx_linear(x, torch.empty(4, 64, 64, 2, dtype=torch.bfloat16), None)
        stored = torch.ops.cann_cpu.amx_linear(x, torch.empty(192, 128, dtype=torch.bfloat16), None)
    assert packed.shape == (3, 1, 256) and stored.shape == (3, 1, 192)


@needs_amx
@pytest.mark.parametrize("rows", [2, 5, 16, 17, 31, 64])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("layout", ["packed", "stored"])
def test_amx_loop_matches_fp32_linear(rows, bias, layout):
    """Row counts of one tile, a partial one, two balanced tiles of different heights (17 = 9 + 8,
    31 = 16 + 15: the tiles are configured twice in one call) and four full ones; five 64-column
    blocks shared by the threads; K = 160, five 32-value chunks. On the packed weight (the weight
    the B operand) and on the weight as stored (the A operand, x transposed)."""
    torch.manual_seed(rows)
    w = (torch.randn(320, 160) * 0.1).to(torch.bfloat16)
    x = torch.randn(rows, 160).to(torch.bfloat16)
    b = torch.randn(320).to(torch.bfloat16) if bias else None
    y = torch.ops.cann_cpu.amx_linear(x, packed_linear.pack_rows(w, 64) if layout == "packed" else w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 320)
    # fp32 sums rounded once to bf16 (its half-ulp)
    torch.testing.assert_close(y.float(), reference(x, w, b), rtol=8e-3, atol=1e-2)


@needs_amx
def test_stored_weight_first_tile_of_rows_and_later_ones_sum_alike():
    """On the weight as stored the first tile of rows runs the block's 16-row tiles one after
    another (stored_rows) and the later ones side by side (stored_block): the same rows in both
    tiles come out bit-equal, so a decode row's result does not depend on the tile it lands in."""
    torch.manual_seed(0)
    w = (torch.randn(192, 3072) * 0.05).to(torch.bfloat16)
    x = torch.randn(16, 3072).to(torch.bfloat16)
    y = torch.ops.cann_cpu.amx_linear(torch.cat([x, x]), w, None)  # two tiles of 16
    assert torch.equal(y[:16], y[16:])
    torch.testing.assert_close(y[:16].float(), reference(x, w, None), rtol=8e-3, atol=1e-2)


@needs_amx
def test_amx_loop_keeps_x_leading_dims_and_takes_a_strided_x():
    torch.manual_seed(0)
    w = (torch.randn(128, 64) * 0.1).to(torch.bfloat16)
    x = torch.randn(3, 1, 128).to(torch.bfloat16)[..., ::2]  # a strided view: the kernel copies it
    y = torch.ops.cann_cpu.amx_linear(x, packed_linear.pack_rows(w, 64), None)
    assert y.shape == (3, 1, 128)
    torch.testing.assert_close(y.float(), reference(x, w, None), rtol=8e-3, atol=1e-2)


@needs_amx
def test_a_stored_weight_may_have_rows_further_apart_than_k():
    """A weight as stored that is a column slice of a wider one (rows 256 values apart, K = 160)."""
    torch.manual_seed(0)
    wide = (torch.randn(128, 256) * 0.1).to(torch.bfloat16)
    w = wide[:, :160]
    x = torch.randn(6, 160).to(torch.bfloat16)
    y = torch.ops.cann_cpu.amx_linear(x, w, None)
    torch.testing.assert_close(y.float(), reference(x, w, None), rtol=8e-3, atol=1e-2)


@needs_amx
def test_amx_loop_refuses_what_it_cannot_run():
    w = (torch.randn(128, 48) * 0.1).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.cann_cpu.amx_linear(torch.randn(2, 48).to(torch.bfloat16), packed_linear.pack_rows(w, 64), None)
    w = (torch.randn(128, 64) * 0.1).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"packed as \(N/64, K/2, 64, 2\), or as stored"):
        torch.ops.cann_cpu.amx_linear(torch.randn(2, 64).to(torch.bfloat16), packed_linear.pack_rows(w, 16), None)
    with pytest.raises(RuntimeError, match="N a multiple of 64"):
        torch.ops.cann_cpu.amx_linear(torch.randn(2, 64).to(torch.bfloat16), w[:100], None)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        torch.ops.cann_cpu.amx_linear(torch.randn(2, 128).to(torch.bfloat16), w.t(), None)
    with pytest.raises(RuntimeError, match="must be bf16"):
        torch.ops.cann_cpu.amx_linear(torch.randn(2, 64), packed_linear.pack_rows(w, 64), None)
    with pytest.raises(RuntimeError, match="x has 32 columns, the weight 64"):
        torch.ops.cann_cpu.amx_linear(torch.randn(2, 32).to(torch.bfloat16), packed_linear.pack_rows(w, 64), None)


@needs_amx
def test_packed_linear_sends_2_to_64_bf16_rows_to_the_amx_loop():
    """2-64 rows of a bf16 weight in whole blocks and chunks: the AMX loop on the AVX-512 bf16
    packing (the memo keeps that copy, and the result is the loop's own); 65 rows, a K of 48 (not
    whole chunks) or 200 columns (not whole blocks): oneDNN's packed copy; fp32: never the loop."""
    torch.manual_seed(0)
    for n, k, rows, amx in [
        (256, 128, 2, True),
        (256, 128, 64, True),
        (256, 128, 65, False),
        (256, 48, 4, False),
        (200, 128, 4, False),
    ]:
        w = (torch.randn(n, k) * 0.1).to(torch.bfloat16)
        x = torch.randn(rows, k).to(torch.bfloat16)
        b = torch.randn(n).to(torch.bfloat16)
        y = packed_linear.packed_linear(x, w, b)
        torch.testing.assert_close(y.float(), reference(x, w, b), rtol=2e-2, atol=2e-2)
        kept = packed_linear._packed.kept(w)
        assert (kept.dim() == 4) == amx, (n, k, rows, kept.shape)
        if amx:
            assert torch.equal(y, torch.ops.cann_cpu.amx_linear(x, kept, b))
    assert not packed_linear.amx_fits(torch.zeros(256, 128), 4)  # fp32
    assert not packed_linear.amx_fits(torch.zeros(256, 128, dtype=torch.bfloat16), 1)  # a single row: GEMV


@needs_amx
def test_fp32_rows_on_an_amx_cpu_take_the_kernels_avx512_loop():
    """fp32 has no AMX: its 2-64-row products take the kernel's AVX-512 loop on its fp32 packing,
    as on a CPU without AMX (it ran the 0.6B step level with oneDNN at batch 4 and faster at 16-64
    there), and 65 rows oneDNN's packed copy."""
    torch.manual_seed(0)
    for rows, kernel in [(2, True), (16, True), (64, True), (65, False)]:
        w = torch.randn(256, 128) * 0.1
        x = torch.randn(rows, 128)
        y = packed_linear.packed_linear(x, w, None)
        torch.testing.assert_close(y, torch.nn.functional.linear(x, w), rtol=1e-4, atol=1e-4)
        kept = packed_linear._packed.kept(w)
        assert (kept.shape == (4, 128, 64)) == kernel, (rows, kept.shape)
        if kernel:
            assert torch.equal(y, torch.ops.cann_cpu.rows_linear(x, kept, None))


@needs_amx
def test_no_compiler_for_the_amx_loop_is_one_line_and_onednn_runs_the_call(tmp_path):
    code = (
        "import torch\n"
        "from executor.backends import packed_linear as p\n"
        "w = torch.randn(256, 128).to(torch.bfloat16)\n"
        "x = torch.randn(4, 128).to(torch.bfloat16)\n"
        "for _ in range(3):\n"
        "    y = p.packed_linear(x, w, None)\n"
        "want = torch.nn.functional.linear(x.float(), w.float())\n"
        "torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=2e-2)\n"
        "print('kept', p._packed.kept(w).dim())\n"
    )
    line, stdout = run_without_compiler(tmp_path, code, "packed_linear")
    assert "cann_cpu::amx_linear" in line and "run on oneDNN instead" in line
    assert stdout.rstrip().endswith("kept 2")  # oneDNN's packed copy


@needs_amx
def test_batched_eager_bf16_decode_runs_the_amx_loop_on_the_stored_weights(tmp_path, make_qwen_runner, monkeypatch):
    """A Qwen2 checkpoint whose gate_up projection is large enough for the kernels (2 x 8192 x 64):
    the eager run at batch 2 in bf16 sends its rows (prefill and decode) to the AMX loop, on the
    weight as stored (no packed copy is kept), and agrees with the same run on aten's linear: the
    same tokens, and the last logits by cosine (the project's bf16 standard). The reference is bf16,
    not fp32: the two runs then share everything but the product."""
    import tests.checkpoints as ckpt

    inter = packed_linear.MIN_WEIGHT_NUMEL // (2 * ckpt.QWEN2_CONFIG["hidden_size"])
    path = ckpt.make_qwen2_checkpoint(tmp_path / "qwen2", intermediate_size=inter, init_std=0.05)
    prompts = [[7, 42, 133, 250, 9, 311, 77, 400, 15], [3, 14, 15, 92, 65, 35, 89, 79, 32]]
    runner = make_qwen_runner(
        path, "scheduler_config.batch_size=2", "model_config.exe_mode=eager", "model_config.dtype=bfloat16"
    )
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = runner.generate(prompts, 3)
    calls = [e for e in prof.events() if e.name == "cann_cpu::amx_linear"]
    assert len(calls) == 2 * 3  # gate_up in both layers: the prefill (18 rows) and 2 decode steps
    assert packed_linear._packed.kept(runner.model.layers[0].mlp.gate_up_proj.weight) is None
    monkeypatch.setattr(packed_linear, "amx_fits", lambda weight, rows, max_rows=None: False)
    want = runner.generate(prompts, 3)
    assert got.token_ids == want.token_ids
    cos = torch.nn.functional.cosine_similarity(got.last_logits.float(), want.last_logits.float(), dim=-1)
    assert cos.min().item() > 0.99, cos
