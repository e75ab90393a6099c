"""cann_cpu::bf16_rows_linear: the AVX512-BF16 kernel that batched bf16 decode GEMMs run on CPU
(executor.backends.packed_linear), against fp32 `linear` on the same bf16 values.

The kernel needs a CPU with AVX512-BF16 and a C++ compiler; where either is missing the kernel
tests skip, while the packing and no-compiler tests run everywhere oneDNN runs bf16.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from executor.backends import packed_linear

REPO = Path(__file__).resolve().parents[1]

needs_kernel = pytest.mark.skipif(
    not packed_linear.bf16_kernel(), reason="no AVX512-BF16 on this CPU, or the kernel could not be built"
)


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())


def test_packing_puts_k_pairs_of_64_columns_together():
    w = torch.arange(128 * 6, dtype=torch.float32).view(128, 6).to(torch.bfloat16)
    p = packed_linear.pack_bf16_rows(w)
    assert p.shape == (2, 3, 64, 2)
    for nb, kp, j, t in [(0, 0, 0, 0), (0, 0, 0, 1), (1, 2, 63, 1), (1, 0, 5, 0), (0, 1, 17, 1)]:
        assert p[nb, kp, j, t] == w[nb * 64 + j, 2 * kp + t]


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_kernel_matches_fp32_linear_for_every_tile_size(rows, bias):
    """Row counts that exercise every tile height (1-6) and a remainder after full tiles."""
    torch.manual_seed(rows)
    w = (torch.randn(192, 258) * 0.05).to(torch.bfloat16)  # 3 column blocks, K = 129 pairs
    b = torch.randn(192).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, 258).to(torch.bfloat16)
    y = torch.ops.cann_cpu.bf16_rows_linear(x, packed_linear.pack_bf16_rows(w), b)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 192)
    # fp32 accumulation, one rounding to bf16 at the end: within bf16's half-ulp of the output
    torch.testing.assert_close(y.float(), reference(x, w, b), rtol=8e-3, atol=1e-2)


@needs_kernel
def test_kernel_takes_strided_and_batched_rows():
    torch.manual_seed(0)
    w = (torch.randn(128, 64) * 0.1).to(torch.bfloat16)
    x = torch.randn(3, 2, 128).to(torch.bfloat16)[..., ::2]  # (3, 2, 64), not contiguous
    y = torch.ops.cann_cpu.bf16_rows_linear(x, packed_linear.pack_bf16_rows(w), None)
    assert y.shape == (3, 2, 128)
    torch.testing.assert_close(y.float(), reference(x, w, None), rtol=8e-3, atol=1e-2)


@needs_kernel
def test_kernel_refuses_a_weight_that_is_not_packed():
    w = torch.randn(128, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"packed as \(N/64, K/2, 64, 2\)"):
        torch.ops.cann_cpu.bf16_rows_linear(torch.randn(2, 64).to(torch.bfloat16), w, None)


@needs_kernel
def test_packed_linear_runs_bf16_on_the_kernel_and_the_rest_on_onednn():
    """The kernel where it fits (bf16, 64-column blocks, <= 64 rows); oneDNN's packed weight for
    fp32, for a row count above the limit, and for a weight the blocks do not divide."""
    torch.manual_seed(0)
    fits = (torch.randn(256, 128) * 0.1).to(torch.bfloat16)
    ragged = (torch.randn(200, 128) * 0.1).to(torch.bfloat16)
    x = torch.randn(4, 128).to(torch.bfloat16)
    for w, rows, kernel in [(fits, 4, True), (ragged, 4, False), (fits, packed_linear.MAX_KERNEL_ROWS + 1, False)]:
        xr = torch.randn(rows, 128).to(torch.bfloat16)
        y = packed_linear.packed_linear(xr, w, None)
        torch.testing.assert_close(y.float(), reference(xr, w, None), rtol=2e-2, atol=2e-2)
        kept = packed_linear._packed.kept(w)
        assert (kept.shape == (w.shape[0] // 64, 64, 64, 2)) == kernel, (w.shape, rows, kept.shape)
    w32 = torch.randn(256, 128)
    packed_linear.packed_linear(x.float(), w32, None)
    assert packed_linear._packed.kept(w32).dim() == 2  # oneDNN's blocked copy, not the kernel's


def test_no_compiler_is_one_line_and_onednn_runs_the_call(tmp_path):
    """A fresh kernel cache and CXX pointing at nothing: packed_linear says so once and gives the
    same product through oneDNN (no error: the kernel is a lowering choice, not something asked for)."""
    if not packed_linear.supported(torch.bfloat16):
        pytest.skip("oneDNN does not run bf16 natively on this CPU")
    env = dict(os.environ, CXX=str(tmp_path / "no" / "g++"), CANN_RECIPES_EXTENSIONS_DIR=str(tmp_path / "ext"))
    code = (
        "import torch\n"
        "from executor.backends import packed_linear as p\n"
        "w = torch.randn(256, 128).to(torch.bfloat16)\n"
        "x = torch.randn(4, 128).to(torch.bfloat16)\n"
        "for _ in range(3):\n"
        "    y = p.packed_linear(x, w, None)\n"
        "ref = torch.nn.functional.linear(x.float(), w.float())\n"
        "torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)\n"
        "print('kept', p._packed.kept(w).dim())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[packed_linear]")]
    assert len(lines) == 1, proc.stdout
    assert str(tmp_path / "no" / "g++") in lines[0] and "run on oneDNN instead" in lines[0]
    assert "model_config.custom_ops" not in lines[0]
    assert proc.stdout.rstrip().endswith("kept 2")  # oneDNN's packed copy
    assert not list((tmp_path / "ext").glob("*/*.so"))


@needs_kernel
def test_bf16_batched_graph_decode_on_the_kernel_agrees_with_fp32(tmp_path, make_qwen_runner):
    """A Qwen2 checkpoint whose gate_up projection is large enough to be packed: the bf16 ge_graph
    decode at batch 2 runs it on the kernel, and its first decode step's logits agree with the
    fp32 eager run's (cosine, the project's bf16 standard)."""
    import tests.checkpoints as ckpt

    inter = packed_linear.MIN_WEIGHT_NUMEL // (2 * ckpt.QWEN2_CONFIG["hidden_size"])
    path = ckpt.make_qwen2_checkpoint(tmp_path / "qwen2", intermediate_size=inter, init_std=0.05)
    prompts = [[7, 42, 133, 250, 9, 311, 77, 400, 15], [3, 14, 15, 92, 65, 35, 89, 79, 32]]
    common = ("scheduler_config.batch_size=2", "model_config.enable_cache_compile=false")
    graph = make_qwen_runner(path, *common, "model_config.dtype=bfloat16", "model_config.exe_mode=ge_graph")
    fp32 = make_qwen_runner(path, *common, "model_config.exe_mode=eager")
    got, want = graph.generate(prompts, 2), fp32.generate(prompts, 2)
    gate_up = graph.model.layers[0].mlp.gate_up_proj.weight
    assert packed_linear._packed.kept(gate_up).dim() == 4  # the kernel's layout: it ran
    assert got.token_ids[0][0] == want.token_ids[0][0] and got.token_ids[1][0] == want.token_ids[1][0]
    cos = torch.nn.functional.cosine_similarity(got.last_logits.float(), want.last_logits.float(), dim=-1)
    assert cos.min().item() > 0.99, cos
