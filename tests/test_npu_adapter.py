"""Contract tests of executor/backends/npu.py's fused-op table and dtype rule, against recording doubles.

No NPU exists in CI, so the adapter is pinned call by call: every argument the real APIs need
(their schemas are in tests/data/ascend_facts/, read by the doubles), which tuple element is
taken, and, because the doubles compute each op's documented meaning, that every wrapper returns
what executor.ops.reference returns. The doubles themselves are checked against the facts
files here too, so a double that drifts from the real API fails a test. The compile paths are in
tests/test_npu_compile.py.
"""

from __future__ import annotations

import inspect
import io

import pytest
import torch

import tests.npu_doubles as nd
from executor import ops
from executor.backends import npu
from executor.cli import main as cli_main
from executor.compile import UnsupportedError, resolve_dtype
from executor.config import load_config
from executor.loader import LoadError
from executor.ops import reference
from executor.platform import Platform, detect
from models.qwen.models.runner_qwen import QwenRunner

A3 = Platform("npu", "A3", "Ascend910_9392", "recording doubles")
CPU = Platform("cpu", None, "cpu", "test")
CUDA = Platform("cuda", None, "gpu", "test")
BF16_TOL = {"rtol": 2e-2, "atol": 2e-2}  # bf16 keeps ~3 significant digits; the doubles compute in fp32


@pytest.fixture
def doubles():
    """Doubles installed; afterwards nothing of the NPU backend is left active in the process."""
    with nd.installed() as d:
        yield d
    assert ops.active() == "reference"


@pytest.fixture
def npu_ops(doubles):
    npu.register_ops()
    with ops.using("npu"):
        yield doubles.torch_npu


def _only(recorder, name):
    calls = recorder.named(name)
    assert len(calls) == 1, f"{name}: {len(calls)} calls"
    return calls[0]


# --------------------------------------------------------------------------- the doubles vs the facts files
def test_scope_op_schemas_are_the_real_ones():
    ge, ex = nd.SCOPES["ge_graph"], nd.SCOPES["npugraph_ex"]
    assert str(torch.ops.air.scope_enter.default._schema) == ge["scope_enter"]["schema"]
    assert str(torch.ops.air.scope_exit.default._schema) == ge["scope_exit"]["schema"]
    assert str(torch.ops.npu.super_kernel_scope_begin.default._schema) == ex["super_kernel_scope_begin"]["schema"]
    assert (
        "need_execute=False" in ge["scope_enter"]["schema"]
        and "str? scope_name=None" in ex["super_kernel_scope_begin"]["schema"]
    )


@pytest.mark.parametrize("fn", nd._FUSED_OPS, ids=lambda fn: fn.__name__)
def test_every_double_names_only_arguments_of_its_real_schema(fn):
    names = [a.name for a in nd.schema(fn.__name__).arguments]
    params = list(inspect.signature(fn).parameters)
    assert set(params) <= set(names) and params == [n for n in names if n in params]  # schema order too


def test_doubles_bind_calls_like_the_real_binding(npu_ops):
    q = torch.randn(1, 2, 1, 4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="pre_tockens"):  # npu_fusion_attention's spelling
        npu_ops.npu_fused_infer_attention_score(q, q, q, num_heads=2, input_layout="BNSD", pre_tockens=1)
    with pytest.raises(TypeError, match="positional"):  # everything after value is keyword-only
        npu_ops.npu_fused_infer_attention_score(q, q, q, None)
    with pytest.raises(TypeError, match="missing required argument 'gamma'"):
        npu_ops.npu_rms_norm(q)
    with pytest.raises(NotImplementedError, match="actual_seq_lengths"):  # no silent default for what it ignores
        npu_ops.npu_fused_infer_attention_score(q, q, q, num_heads=2, input_layout="BNSD", actual_seq_lengths=[1])


def test_fia_double_follows_the_documented_limits(npu_ops):
    q = torch.randn(1, 2, 1, 4)
    with pytest.raises(TypeError, match="float32"):
        npu_ops.npu_fused_infer_attention_score(q, q, q, num_heads=2, input_layout="BNSD")
    qb = q.bfloat16()
    with pytest.raises(RuntimeError, match="not contiguous"):
        npu_ops.npu_fused_infer_attention_score(
            torch.randn(1, 3, 2, 4, dtype=torch.bfloat16).transpose(1, 2), qb, qb, num_heads=2, input_layout="BNSD"
        )
    _out, lse = npu_ops.npu_fused_infer_attention_score(qb, qb, qb, num_heads=2, input_layout="BNSD")
    assert lse.shape == (1,) and lse.isnan().all()  # garbage unless softmax_lse_flag=True
    _out, lse = npu_ops.npu_fused_infer_attention_score(
        qb, qb, qb, num_heads=2, input_layout="BNSD", softmax_lse_flag=True
    )
    assert lse.shape == (1, 2, 1, 1) and lse.dtype == torch.float32


def test_compiler_config_double_is_strict_and_reads_back_option_objects():
    cfg = nd.CompilerConfig()
    ex = cfg.experimental_config
    ex.frozen_parameter = True
    assert ex.frozen_parameter.value == "1" and ex.frozen_parameter is not True  # an option object
    ex.topology_sorting_strategy = "StableRDFS"
    assert ex.topology_sorting_strategy.value == "StableRDFS"
    with pytest.raises(ValueError):
        ex.topology_sorting_strategy = "stable_rdfs"
    with pytest.raises(ValueError):
        ex.frozen_parameters = True  # unknown option
    with pytest.raises(ValueError):
        ex.enable_single_stream = True  # a ge_config option in torchair, not an experimental one
    cfg.mode = "npugraph_ex"  # allowed in 2.14.0
    with pytest.raises(ValueError):
        cfg.mode = "default"


def test_npugraph_ex_double_checks_options_like_the_real_backend():
    nd.check_npugraph_ex_options({"frozen_parameter": True, "remove_cat_ops": False, "capture_limit": 8})
    for bad, error in (
        ({"graph_dump_type": "pbtxt"}, ValueError),  # not an option in 2.14.0
        ({"static_kernel_compile": 1.5}, ValueError),
        ({"super_kernel_optimize_options": {"stream-fusion": 1}}, RuntimeError),  # GE spelling, not npugraph_ex's
        ({"super_kernel_optimize_options": {"dcci_disable_on_kernel": "GroupedMatmul"}}, RuntimeError),  # list[str]
    ):
        with pytest.raises(error):
            nd.check_npugraph_ex_options(bad)
    nd.check_npugraph_ex_options(
        {"super_kernel_optimize_options": {"stream_fusion": 1, "dcci_disable_on_kernel": [".*"]}}
    )


# --------------------------------------------------------------------------- fused op wrappers
def test_register_ops_makes_an_npu_table(npu_ops):
    assert ops.active() == "npu"
    assert set(ops.implementations()) == set(ops.OP_NAMES)
    own = {op for op, source in ops.provenance("npu").items() if source == "own"}
    assert own == set(ops.OP_NAMES) - {"linear"}  # linear: the reference's F.linear (MatMul in GE)
    assert all(ops.implementations()[op].startswith("executor.backends.npu.") for op in own)
    assert ops.provenance("npu")["linear"] == "base"  # declared, so the accuracy audit passes it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_epsilon_keyword_and_first_element(npu_ops, dtype):
    x, w = torch.randn(2, 3, 16, dtype=dtype) * 3, torch.rand(16, dtype=dtype) + 0.5
    y = ops.rms_norm(x, w, 1e-5)
    call = _only(npu_ops, "npu_rms_norm")
    assert call.args[0] is x and call.args[1] is w and call.kwargs == {"epsilon": 1e-5}
    torch.testing.assert_close(y, reference.rms_norm(x, w, 1e-5), rtol=0, atol=0)


def test_add_rms_norm_returns_y_and_x_sum_not_rstd(npu_ops):
    x, res, w = torch.randn(2, 16), torch.randn(2, 16), torch.rand(16) + 0.5
    y, x_sum = ops.add_rms_norm(x, res, w, 1e-6)
    call = _only(npu_ops, "npu_add_rms_norm")
    assert call.args[:3] == (x, res, w) and call.kwargs == {"epsilon": 1e-6}
    ref_y, ref_sum = reference.add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(y, ref_y)
    torch.testing.assert_close(x_sum, ref_sum)
    assert x_sum.shape == x.shape  # rstd would be (2, 1)


def test_swiglu_dim(npu_ops):
    x = torch.randn(3, 2 * 8)
    y = ops.swiglu(x)
    assert _only(npu_ops, "npu_swiglu").kwargs == {"dim": -1}
    torch.testing.assert_close(y, reference.swiglu(x))


def test_rotary_mul_half_mode(npu_ops):
    x, cos, sin = torch.randn(2, 4, 3, 8), torch.randn(2, 1, 3, 8), torch.randn(2, 1, 3, 8)
    y = ops.rotary_mul(x, cos, sin)
    call = _only(npu_ops, "npu_rotary_mul")
    assert call.args == (x, cos, sin) and call.kwargs == {"rotary_mode": "half"}
    torch.testing.assert_close(y, reference.rotary_mul(x, cos, sin))
    # the double really distinguishes the modes, so the keyword matters
    assert not torch.allclose(npu_ops.npu_rotary_mul(x, cos, sin, rotary_mode="interleave"), y)


def test_attention_arguments_mask_polarity_and_output(npu_ops):
    b, hq, hkv, s, t, d = 2, 4, 2, 3, 6, 8
    bf = torch.bfloat16
    q = torch.randn(b, s, hq, d, dtype=bf).transpose(1, 2)  # (B, Hq, S, D) as the model passes it: not contiguous
    k, v = torch.randn(b, hkv, t, d, dtype=bf), torch.randn(b, hkv, t, d, dtype=bf)
    pos = torch.tensor([[2, 3, 4], [0, 1, 2]])  # (B, S)
    mask = torch.arange(t).view(1, 1, 1, t) > pos.view(b, 1, s, 1)  # (B, 1, S, T) True = masked out
    out = ops.attention(q, k, v, mask, 0.3)
    call = _only(npu_ops, "npu_fused_infer_attention_score")
    assert torch.equal(call.args[0], q) and call.args[0].is_contiguous() and call.args[1:] == (k, v)
    kw = call.kwargs
    assert kw["atten_mask"] is mask and kw["atten_mask"].dtype == torch.bool
    assert kw["input_layout"] == "BNSD" and kw["scale"] == 0.3
    assert kw["num_heads"] == hq and kw["num_key_value_heads"] == hkv and kw["sparse_mode"] == 0
    assert kw["pre_tokens"] == kw["next_tokens"] == 2**31 - 1 and "softmax_lse_flag" not in kw
    assert out.shape == (b, hq, s, d) and out.dtype == bf  # element [0], not the lse
    torch.testing.assert_close(out, reference.attention(q, k, v, mask, 0.3), **BF16_TOL)
    # polarity really matters: the inverted mask gives other numbers
    inverted = npu_ops.npu_fused_infer_attention_score(
        q.contiguous(), k, v, atten_mask=~mask, num_heads=hq, num_key_value_heads=hkv, input_layout="BNSD", scale=0.3
    )[0]
    assert (inverted.float() - out.float()).abs().max() > 0.1


def test_moe_gating_hands_the_op_float32_logits(npu_ops):
    """The op returns weights in its input's dtype; the contract is float32 weights from a float32
    softmax. bf16 logits therefore go in as float32, and the weights match the reference exactly."""
    logits = torch.randn(5, 8, dtype=torch.bfloat16)
    w, idx = ops.moe_gating_top_k_softmax(logits, 2)
    call = _only(npu_ops, "npu_moe_gating_top_k_softmax")
    assert call.args[0].dtype == torch.float32 and torch.equal(call.args[0], logits.float())
    assert call.kwargs == {"finished": None, "k": 2}
    ref_w, ref_idx = reference.moe_gating_top_k_softmax(logits, 2)
    assert w.dtype == ref_w.dtype == torch.float32 and idx.dtype == ref_idx.dtype
    torch.testing.assert_close(w, ref_w, rtol=0, atol=0)
    assert torch.equal(idx, ref_idx)
    # what the cast avoids: fed bf16, the op rounds the weights to bf16
    assert npu_ops.npu_moe_gating_top_k_softmax(logits, None, 2)[0].dtype == torch.bfloat16


def test_moe_init_routing_row_idx_and_output_mapping(npu_ops):
    n, k, e, h = 5, 2, 4, 3
    x = torch.randn(n, h)
    # ties across slots: expert 1 is slot 1 of token 0 and slot 0 of token 1, etc.
    expert_idx = torch.tensor([[0, 1], [1, 3], [3, 0], [1, 2], [2, 1]])
    expanded_x, order, counts = ops.moe_init_routing(x, expert_idx, e)
    call = _only(npu_ops, "npu_moe_init_routing")
    row_idx = call.args[1]
    assert row_idx.dtype == torch.int32 and row_idx.shape == (n, k)
    assert all(row_idx[i, j] == j * n + i for i in range(n) for j in range(k))
    assert call.args[0] is x and call.args[2].dtype == torch.int32 and torch.equal(call.args[2], expert_idx.int())
    assert call.kwargs == {"active_num": n}
    ref_x, ref_order, ref_counts = reference.moe_init_routing(x, expert_idx, e)
    assert torch.equal(expanded_x, ref_x)
    assert torch.equal(order, ref_order) and order.dtype == ref_order.dtype
    assert torch.equal(counts, ref_counts) and counts.tolist() == [2, 4, 2, 2]


def test_grouped_matmul_group_list_counts(npu_ops):
    counts = torch.tensor([2, 0, 3, 1])
    x, w = torch.randn(6, 5), torch.randn(4, 5, 7)
    y = ops.grouped_matmul(x, w, counts)
    call = _only(npu_ops, "npu_grouped_matmul")
    assert call.args[0] == [x] and call.args[1] == [w]
    assert call.kwargs == {"group_list": counts, "group_type": 0, "group_list_type": 1, "split_item": 3}
    torch.testing.assert_close(y, reference.grouped_matmul(x, w, counts))


# --------------------------------------------------------------------------- platform and dtype
def test_detect_npu_with_doubles(doubles):
    p = detect("npu")
    assert (p.kind, p.soc_class, p.device_name) == ("npu", "A3", "Ascend910_9392")


def test_resolve_dtype_auto_per_platform_and_float32_refused_on_npu():
    assert resolve_dtype("auto", CPU) == "float32" and resolve_dtype("auto", CUDA) == "bfloat16"
    assert resolve_dtype("auto", A3) == "bfloat16" and resolve_dtype("float16", A3) == "float16"
    assert resolve_dtype("float32", CPU) == resolve_dtype("float32", CUDA) == "float32"
    with pytest.raises(UnsupportedError, match=r"model_config\.dtype: float32 cannot run on an Ascend NPU"):
        resolve_dtype("float32", A3)
    with pytest.raises(UnsupportedError, match="float16 or bfloat16"):
        npu.check_dtype("float32")  # the NPU backends check it again themselves


def _checkpoint_without_weights(tmp_path, qwen3_ckpt):
    (tmp_path / "config.json").write_text((qwen3_ckpt / "config.json").read_text())
    return tmp_path


def test_float32_on_npu_stops_before_weights_are_loaded(doubles, tmp_path, qwen3_ckpt):
    """A checkpoint directory without weights: reaching the loader would be a LoadError, so an
    UnsupportedError proves the dtype was refused first."""
    ckpt = _checkpoint_without_weights(tmp_path, qwen3_ckpt)
    sets = [f"model_config.model_path={ckpt}", "model_config.with_ckpt=true"]
    with pytest.raises(UnsupportedError, match=r"model_config\.dtype: float32"):
        QwenRunner(load_config(None, [*sets, "model_config.dtype=float32"]), A3)
    with pytest.raises(LoadError):  # the same run with auto (bfloat16) gets as far as loading
        QwenRunner(load_config(None, sets), A3)


def test_float32_on_npu_is_exit_2_and_one_line(doubles, capsys):
    code = cli_main(["run", "--set", "model_config.dtype=float32", "--set", "model_config.device=npu"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: model_config.dtype: float32")


def test_auto_is_float32_on_cpu_as_before():
    runner = QwenRunner(load_config(None, ["scheduler_config.max_new_tokens=2"]), CPU, stream=io.StringIO())
    assert runner.cfg.model_config.dtype == "auto" and runner.dtype == torch.float32
    assert runner.decode_spec().dtype == "float32" and runner.model.lm_head.weight.dtype == torch.float32
