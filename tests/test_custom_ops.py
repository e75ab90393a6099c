"""The custom-op path (executor/custom_ops/) and `cann::decode_attention`, without a whole model.

Why these checks: the kernel replaces attention for every decode step, so its numbers are held
to torch's own scaled_dot_product_attention (not to our reference), on the shapes the models
pass (GQA, batch rows at different positions, a query that is a transposed view, a cache that is
a batch slice), and it must really skip the slots after a row's last valid one: there the cache
holds NaN, which any read would carry into the output. The op-table layering, the config key,
the one-line errors (no compiler, unknown name, no CUDA kernel, npugraph_ex) and the NPU kernel's
arguments (against the recording doubles, which now implement actual_seq_lengths_kv) follow.
Whole models against HF: tests/test_decode_attention_models.py; GE conversion:
tests/test_custom_ops_ge.py. The C++ kernel is built once per machine (cache), loaded once here.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tests.npu_doubles as nd
from executor import custom_ops, ops
from executor.backends import npu, npu_decode_attention
from executor.backends.base import UnsupportedError
from executor.config import load_config
from executor.custom_ops._build import cpu_has_amx
from executor.errors import RecipeError
from executor.ops import reference
from executor.platform import Platform, detect
from tests.fresh_python import run_as_capability, run_code

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def kernel():
    """The CPU kernel, built (first time on this machine) and loaded; returns the torch op."""
    custom_ops.cpu_kernel(custom_ops.load("decode_attention"))
    return torch.ops.cann.decode_attention


def sdpa(q, k, v, mask, scale):
    """torch's own attention with GQA expanded; its mask is True = attend."""
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1), attn_mask=~mask, scale=scale
    )


def case(b=2, hq=4, hkv=2, s=1, t=40, d=32, positions=((5,), (23,)), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, s, d, generator=g).to(dtype)
    k, v = (torch.randn(b, hkv, t, d, generator=g).to(dtype) for _ in range(2))
    pos = torch.tensor(positions).view(b, s)
    mask = torch.arange(t).view(1, 1, 1, t) > pos.view(b, 1, s, 1)  # the models' decode mask
    return q, k, v, mask


@pytest.mark.parametrize("hq, hkv", [(4, 4), (4, 2), (6, 1)])
def test_kernel_matches_sdpa_in_decode(kernel, hq, hkv):
    q, k, v, mask = case(hq=hq, hkv=hkv)
    out = kernel(q, k, v, mask, 0.17)
    assert out.shape == q.shape and out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out, sdpa(q, k, v, mask, 0.17), rtol=1e-5, atol=1e-5)


def test_kernel_several_query_rows_and_a_mask_with_holes(kernel):
    q, k, v, mask = case(s=3, positions=((4, 5, 6), (30, 31, 32)))
    mask = mask.clone()
    mask[1, 0, :, 7:12] = True  # slots inside the valid range that must be skipped, not only cut off
    torch.testing.assert_close(kernel(q, k, v, mask, 0.2), sdpa(q, k, v, mask, 0.2), rtol=1e-5, atol=1e-5)


# whole vectors (read in place in fp32; in bf16 on AVX512-BF16 four and two 32-value vectors a row) /
# a padded last vector
@pytest.mark.parametrize("d", [128, 64, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 2-5 query heads to a kv head: bf16's heads in pairs (from 2 on an Intel CPU, from 4 elsewhere), and one left
@pytest.mark.parametrize("hq", [4, 6, 8, 10])
def test_kernel_blocks_of_slots_with_masked_garbage_inside(kernel, d, dtype, hq):
    """Over 32 slots (several blocks of the kernel), holes across a block edge whose cache rows hold
    NaN (a slot never written): they must weigh nothing, in the widened and the in-place path."""
    q, k, v, mask = case(hq=hq, hkv=2, t=100, d=d, positions=((70,), (99,)), dtype=dtype)
    mask = mask.clone()
    mask[1, 0, :, 28:37] = True
    clean_k, clean_v = k.clone(), v.clone()
    k[1, :, 28:37] = float("nan")
    v[1, :, 28:37] = float("nan")
    out = kernel(q, k, v, mask, d**-0.5)
    want = sdpa(q, clean_k, clean_v, mask, d**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_half_precision_accumulates_in_fp32(kernel, dtype):
    q, k, v, mask = case(dtype=dtype, t=300, positions=((150,), (299,)))
    out = kernel(q, k, v, mask, 0.125)
    assert out.dtype == dtype
    exact = sdpa(q, k, v, mask, 0.125)  # fp32 on the same rounded inputs
    assert (out.float() - exact).abs().max() < 1e-2  # only the output rounding (values are O(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_never_reads_slots_after_the_last_valid_one(kernel, dtype):
    """10 and 41 valid slots: neither a multiple of a block nor of the four K rows that the bf16
    dot-product loop (AVX512-BF16, d a multiple of 32) takes at a time, whose short last group must
    write its own slots' scores only (writing all four crashed this test)."""
    q, k, v, mask = case(t=64, positions=((9,), (40,)), dtype=dtype)
    for cache, row in ((k, 0), (v, 0), (k, 1), (v, 1)):
        cache[row, :, 41:] = float("nan")  # beyond both rows' valid slots
    k[0, :, 10:] = float("nan")
    v[0, :, 10:] = float("nan")  # row 0's valid slots end at 9
    out = kernel(q, k, v, mask, 0.2)
    assert torch.isfinite(out).all()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for b, n in ((0, 10), (1, 41)):
        want = sdpa(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], mask[b : b + 1, ..., :n], 0.2)
        torch.testing.assert_close(out[b : b + 1].float(), want, rtol=tol, atol=tol)
    # control: the masked reference reads every slot, so the NaN reaches its output
    assert torch.isnan(reference.attention(q, k, v, mask, 0.2)).any()


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_the_narrower_builds_compile_and_agree(capability):
    """The kernel as built for an AVX2 host, or in plain C++ (an Arm host such as Kunpeng), in a
    fresh Python told to report that capability (other flags, another build key, another build).
    Why: an AVX-512 host builds only the widest variant, and the AVX2 one once failed to compile
    (ATen's fp16 conversions need F16C, which -mavx2 alone does not enable) unseen there."""
    code = (
        "import torch\n"
        "from executor import custom_ops\n"
        "from tests.test_custom_ops import case, sdpa\n"
        "custom_ops.cpu_kernel(custom_ops.load('decode_attention'))\n"
        "for dtype in (torch.float32, torch.bfloat16, torch.float16):\n"
        "    for d in (128, 40):\n"
        "        q, k, v, mask = case(hq=8, hkv=2, t=100, d=d, positions=((70,), (99,)), dtype=dtype)\n"
        "        k[0, :, 71:] = float('nan')\n"  # never read: after row 0's last valid slot
        "        out = torch.ops.cann.decode_attention(q, k, v, mask, d**-0.5)\n"
        "        k[0, :, 71:] = 0.0\n"
        "        err = (out.float() - sdpa(q, k, v, mask, d**-0.5)).abs().max().item()\n"
        "        assert err < (1e-5 if dtype == torch.float32 else 1e-2), (dtype, d, err)\n"
    )
    run_as_capability(code, capability, timeout=600)


def test_kernel_views_as_the_model_passes_them(kernel):
    """q a transposed view (rotary of q.transpose(1, 2)); the cache a batch slice (prefill groups)."""
    q, k, v, mask = case(b=3, s=2, positions=((3, 4), (12, 13), (30, 31)))  # S = 2: the view is strided
    q_view = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, (B, S, H, D) memory
    assert not q_view.is_contiguous()
    out = kernel(q_view[1:], k[1:], v[1:], mask[1:], 0.3)
    torch.testing.assert_close(out, sdpa(q[1:], k[1:], v[1:], mask[1:], 0.3), rtol=1e-5, atol=1e-5)


def test_kernel_fully_masked_row_is_nan_like_the_reference(kernel):
    q, k, v, mask = case()
    mask = mask.clone()
    mask[0] = True
    out, ref = kernel(q, k, v, mask, 0.2), reference.attention(q, k, v, mask, 0.2)
    assert torch.isnan(out[0]).all() and torch.isnan(ref[0]).all() and torch.isfinite(out[1]).all()


def test_fake_impl_traces_one_opaque_node(kernel):
    q, k, v, mask = case()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = torch.compile(lambda *a: kernel(*a, 0.2) * 2, backend=backend, fullgraph=True, dynamic=False)
    torch.testing.assert_close(fn(q, k, v, mask), 2 * sdpa(q, k, v, mask, 0.2), rtol=1e-5, atol=1e-5)
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert len(graphs) == 1 and targets.count("cann.decode_attention") == 1, targets  # dynamo's packet target


# --------------------------------------------------------------------------- the op table
def test_layered_table_replaces_only_attention_and_keeps_prefill_on_the_base(kernel):
    name = custom_ops.layer("reference", ["decode_attention"], custom_ops.cpu_kernel)
    assert name == "reference+decode_attention"
    impl, base = ops.implementations(name), ops.implementations("reference")
    assert impl["attention"] == "executor.custom_ops.decode_attention.attention"
    assert {k: v for k, v in impl.items() if k != "attention"} == {k: v for k, v in base.items() if k != "attention"}
    q, k, v, mask = case(s=3, positions=((4, 5, 6), (7, 8, 9)))
    with ops.using(name), torch.profiler.profile() as prof:
        ops.attention(q[:, :, :1], k, v, mask[:, :, :1], 0.2)  # decode: the custom op
        ops.attention(q, k, v, mask, 0.2)  # prefill (S = 3): the base table's attention
    calls = [e for e in prof.events() if e.name == "cann::decode_attention"]
    assert len(calls) == 1
    assert custom_ops.layer("reference", [], custom_ops.cpu_kernel) == "reference"


def test_unknown_or_repeated_custom_op_is_a_config_error_listing_the_available():
    with pytest.raises(RecipeError, match=r"model_config.custom_ops: 'fused_rope' is not a custom op; available: .*"):
        load_config(None, ["model_config.custom_ops=[fused_rope]"])
    with pytest.raises(RecipeError, match="decode_attention is listed twice"):
        load_config(None, ["model_config.custom_ops=[decode_attention, decode_attention]"])
    assert "decode_attention" in custom_ops.available()
    assert load_config(None, ["model_config.custom_ops=[decode_attention]"]).model_config.custom_ops == (
        "decode_attention",
    )


def test_left_out_custom_ops_are_chosen_by_the_cache_length_and_a_list_is_the_users():
    op = custom_ops.load("decode_attention")
    at = op.auto_min_slots(128, cpu_has_amx())  # this CPU's threshold for a bf16 run
    assert at > 0
    amx = " in bf16 on a CPU with AMX" if cpu_has_amx() else ""
    chosen, why = custom_ops.resolve(None, "cpu", at, 128, 1, bf16=True)
    assert chosen == ("decode_attention",) and f"at {at} KV-cache slots (>= {at} at head_dim 128{amx})" in why
    assert "[] runs without" in why
    chosen, why = custom_ops.resolve(None, "cpu", at - 1, 128, 1, bf16=True)
    assert chosen == () and f"from {at} KV-cache slots at head_dim 128{amx}, this run has {at - 1}" in why
    assert custom_ops.resolve((), "cpu", 16 * at, 128, 1)[0] == ()  # [] keeps the reference at any length
    assert custom_ops.resolve(("decode_attention",), "cpu", 8, 128, 1)[0] == ("decode_attention",)
    for device, world in (("npu", 1), ("cuda", 1), ("cpu", 2)):  # measured on one CPU rank only
        chosen, why = custom_ops.resolve(None, device, 16 * at, 128, world)
        assert chosen == () and "left out" in why, (device, world)
        assert custom_ops.resolve(None, device, 8, 128, world, "eager")[0] == (), (device, world)


def test_the_cache_length_that_pays_scales_with_head_dim():
    """The threshold counts a kv head's cached values: heads a quarter as wide need four times the
    slots (at 128 slots the op slowed a compiled step with heads of 32 and sped up one with heads of 128)."""
    op = custom_ops.load("decode_attention")
    assert op.auto_min_slots(32) == 4 * op.auto_min_slots(128) and op.auto_min_slots(64) == 2 * op.auto_min_slots(128)
    assert op.auto_min_slots(96) * 96 >= op.auto_min_kv_values > (op.auto_min_slots(96) - 1) * 96  # rounded up
    slots = op.auto_min_slots(128)
    assert custom_ops.resolve(None, "cpu", slots, 128, 1)[0] == ("decode_attention",)
    chosen, why = custom_ops.resolve(None, "cpu", slots, 32, 1)
    assert chosen == () and f"from {4 * slots} KV-cache slots at head_dim 32, this run has {slots}" in why


def test_a_bf16_run_on_a_cpu_with_amx_gets_decode_attention_from_fewer_slots_at_head_dim_128_and_up():
    """Measured faster there in bf16 at head_dim 128 from 33 slots, mixed in fp32 (BENCHMARKS.md,
    "seventy-fourth pass"); fp32, narrower heads and every other CPU keep the general rule."""
    op = custom_ops.load("decode_attention")
    assert 0 < op.amx_min_slots < op.auto_min_slots(128)
    assert op.auto_min_slots(128, amx=True) == op.amx_min_slots == op.auto_min_slots(256, amx=True)
    assert op.auto_min_slots(64, amx=True) == op.auto_min_slots(64) == 2 * op.auto_min_slots(128)
    chosen, why = custom_ops.resolve(None, "cpu", op.amx_min_slots, 128, 1, bf16=True)
    assert (chosen == ("decode_attention",)) == cpu_has_amx(), why
    assert custom_ops.resolve(None, "cpu", op.amx_min_slots, 128, 1)[0] == ()  # fp32


def test_eager_gets_decode_attention_at_any_cache_length():
    """No compiled kernel to split in eager, so the length threshold does not apply there."""
    assert custom_ops.load("decode_attention").auto_in_eager
    chosen, why = custom_ops.resolve(None, "cpu", 8, 128, 1, "eager")
    assert chosen == ("decode_attention",) and "decode_attention in eager at any KV-cache length" in why
    assert custom_ops.resolve(None, "cpu", 8, 128, 1, "ge_graph")[0] == ()
    assert custom_ops.resolve((), "cpu", 8, 128, 1, "eager")[0] == ()  # [] is the user's


def test_without_a_compiler_a_left_out_op_is_not_chosen_and_the_reason_is_said(tmp_path):
    """Nobody asked for the op, so a host that cannot build it runs the reference (one line says
    why) instead of stopping, as it must when the op is listed."""
    code = "from executor import custom_ops\nprint(custom_ops.resolve(None, 'cpu', 1 << 14, 128, 1))\n"
    out = run_code(code, CXX=str(tmp_path / "no" / "g++"), CANN_RECIPES_EXTENSIONS_DIR=str(tmp_path / "ext"))
    assert (
        out.startswith("((), ")
        and str(tmp_path / "no" / "g++") in out
        and "decode_attention not chosen: custom op" in out
    ), out
    assert "remove it from model_config.custom_ops" not in out
    assert not list((tmp_path / "ext").glob("*/*.so"))


def test_a_bf16_compiled_run_with_heads_of_128_gets_the_op_from_32_slots_on_a_cpu_with_amx(make_qwen_runner, tmp_path):
    """End to end through the pre-flight, which passes the run's dtype: with heads of 128 and 34
    slots a bf16 ge_graph run layers the op on a CPU with AMX and nowhere else, an fp32 one nowhere."""
    import tests.checkpoints as ckpt

    path = ckpt.make_qwen3_checkpoint(tmp_path / "qwen3", head_dim=128)
    slots = ["model_config.exe_mode=ge_graph", "data_config.input_truncated_len=30"]
    bf16 = make_qwen_runner(path, *slots, "model_config.dtype=bfloat16", max_new_tokens=4)
    fp32 = make_qwen_runner(path, *slots, max_new_tokens=4)
    want = "reference+decode_attention" if cpu_has_amx() else "reference"
    assert bf16.context.op_table == want, bf16.custom_ops_note
    assert fp32.context.op_table == "reference", fp32.custom_ops_note


def test_a_long_cache_gets_the_op_unless_the_config_lists_none(make_qwen_runner, qwen3_ckpt):
    """End to end: left out, a compiled run long enough for its head_dim (32: 512 slots) layers the
    op (a shorter one does not), an eager run at any length, and says so in its log and metrics;
    the same run with `custom_ops: []` keeps the reference; both decode the same greedy tokens.
    (The compiled runners are only built: the op table is chosen before anything compiles.)"""
    at = custom_ops.load("decode_attention").auto_min_slots(32)  # the checkpoint's head_dim
    new = 4
    graph = "model_config.exe_mode=ge_graph"
    long = make_qwen_runner(qwen3_ckpt, f"data_config.input_truncated_len={at - new}", graph, max_new_tokens=new)
    short = make_qwen_runner(qwen3_ckpt, graph, max_new_tokens=new)  # 24 + 4 slots
    assert long.context.op_table == "reference+decode_attention" and short.context.op_table == "reference"
    assert f"decode_attention at {at} KV-cache slots (>= {at} at head_dim 32)" in long.custom_ops_note
    assert f"decode_attention from {at} KV-cache slots at head_dim 32, this run has 28" in short.custom_ops_note
    chosen = make_qwen_runner(qwen3_ckpt, "model_config.exe_mode=eager", max_new_tokens=new)
    listed = make_qwen_runner(
        qwen3_ckpt, "model_config.exe_mode=eager", "model_config.custom_ops=[]", max_new_tokens=new
    )
    assert chosen.context.op_table == "reference+decode_attention" and listed.context.op_table == "reference"
    assert chosen.cfg.model_config.custom_ops == ("decode_attention",) and listed.cfg.model_config.custom_ops == ()
    chosen.stream = io.StringIO()
    metrics = chosen.run()
    assert metrics["ops"]["attention"] == "executor.custom_ops.decode_attention.attention"
    assert metrics["custom_ops"]["chosen"] == ["decode_attention"] and "left out" in metrics["custom_ops"]["why"]
    assert "[run] custom ops: decode_attention (model_config.custom_ops left out: decode_attention in eager" in (
        chosen.stream.getvalue()
    )
    prompts = chosen.encode_prompts()
    assert chosen.generate(prompts, new).token_ids == listed.generate(prompts, new).token_ids


def test_no_cuda_kernel_is_refused_naming_the_op():
    with pytest.raises(RecipeError, match=r"custom op decode_attention has no cuda kernel .*cpu, npu"):
        custom_ops.layer("reference", ["decode_attention"], custom_ops.installer("cuda"))


@pytest.mark.parametrize("command", ["run", "compare"])
def test_no_compiler_is_one_line_naming_the_op_and_the_compiler(tmp_path, qwen3_ckpt, command):
    """A fresh kernel cache and CXX pointing at nothing: the pre-flight stops the run before it
    builds the model, and sk_compare before its first side runs."""
    env = dict(os.environ, CXX=str(tmp_path / "no" / "g++"), CANN_RECIPES_EXTENSIONS_DIR=str(tmp_path / "ext"))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "executor.cli", command, "--out", str(out)]
    cmd += ["--set", f"model_config.model_path={qwen3_ckpt}", "--set", "model_config.custom_ops=[decode_attention]"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("error: custom op cann::decode_attention: its CPU kernel is compiled on first use")
    assert str(tmp_path / "no" / "g++") in proc.stderr and "model_config.custom_ops" in proc.stderr
    assert not list((tmp_path / "ext").glob("*/*.so"))
    assert not list(out.glob("**/metrics.json")) and not (out / "runs").exists()  # nothing ran (infer.log: the error)


def test_preflight_refuses_a_custom_op_the_platform_cannot_run(qwen3_ckpt):
    """What sk_compare / scope_search ask for every side before the first run: a custom op with no
    kernel on the device, or not in the NPU exe_mode, stops there (no model, no weights, no build)."""
    from models.qwen.models.runner_qwen import QwenRunner

    base = [f"model_config.model_path={qwen3_ckpt}", "model_config.custom_ops=[decode_attention]"]
    cuda = Platform("cuda", None, "a CUDA GPU", "stated by the test")
    with pytest.raises(RecipeError, match=r"^custom op decode_attention has no cuda kernel \(it has: cpu, npu\)"):
        QwenRunner.check_before_run(load_config(None, base), cuda)
    a3 = Platform("npu", "A3", "Ascend910_9392", "stated by the test")
    ex = load_config(None, [*base, "model_config.exe_mode=npugraph_ex"])
    with pytest.raises(RecipeError, match=r"decode_attention cannot run in exe_mode npugraph_ex on an NPU"):
        QwenRunner.check_before_run(ex, a3)
    assert QwenRunner.check_before_run(load_config(None, base), detect("cpu")).plan.name  # CPU: runnable
    assert custom_ops.unsupported(custom_ops.load("decode_attention"), "npu", "ge_graph") is None


# --------------------------------------------------------------------------- the NPU half, against the doubles
def test_npu_kernel_passes_the_valid_lengths_and_the_fia_reads_only_them():
    q, k, v, mask = case(dtype=torch.bfloat16, t=48, positions=((6,), (30,)))
    k[0, :, 7:], v[0, :, 7:] = float("nan"), float("nan")  # row 0 is valid up to slot 6
    with nd.installed() as d:
        out = npu_decode_attention.fused_attention(d.torch_npu, q, k, v, mask, 0.25)
        (call,) = d.torch_npu.named("npu_fused_infer_attention_score")
        # control: without the lengths the same call reads the NaN slots
        unbounded = d.torch_npu.npu_fused_infer_attention_score(
            q, k, v, atten_mask=mask, num_heads=4, num_key_value_heads=2, input_layout="BNSD", scale=0.25
        )[0]
    kw = call.kwargs
    assert kw["actual_seq_lengths_kv"] == [7, 31] and kw["atten_mask"] is mask
    assert (kw["input_layout"], kw["num_heads"], kw["num_key_value_heads"], kw["scale"]) == ("BNSD", 4, 2, 0.25)
    assert torch.isfinite(out).all() and torch.isnan(unbounded[0]).any()
    want = torch.cat([sdpa(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], mask[b : b + 1, ..., :n], 0.25)
                      for b, n in ((0, 7), (1, 31))])  # fmt: skip
    assert (out.float() - want).abs().max() < 2e-2


def test_kv_lengths_is_last_unmasked_slot_plus_one():
    mask = torch.ones(3, 1, 2, 8, dtype=torch.bool)
    mask[0, 0, 0, :3] = False
    mask[1, 0, 1, 5] = False  # a hole-y row: the LAST unmasked slot counts
    assert npu_decode_attention.kv_lengths(mask).tolist() == [3, 6, 0]


def test_npugraph_ex_is_refused_for_decode_attention():
    install = npu.custom_op_installer("npugraph_ex")
    with pytest.raises(UnsupportedError, match=r"decode_attention cannot run in exe_mode npugraph_ex.*eager, ge_graph"):
        install(custom_ops.load("decode_attention"))
