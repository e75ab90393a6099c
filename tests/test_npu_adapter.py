"""Contract tests of executor/backends/npu.py against recording torch_npu/torchair doubles.

No NPU exists in CI, so the adapter is pinned call by call: every argument the documented APIs
need (shared/reference/ascend-apis.md), which tuple element is taken, and, because the doubles
compute each op's documented meaning, that every wrapper returns what executor.ops.reference
returns. The compile paths run a real tiny Qwen3 decode step through dynamo on CPU with the
doubles' backends, so scopes, graphs and numbers are real.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

import tests.npu_doubles as nd
from executor import ops
from executor.arch import arch_from_dict
from executor.backends import npu
from executor.backends.base import EagerBackend
from executor.compile import UnsupportedError, select_backend
from executor.config import CustomScope, ModelConfig, SuperKernelConfig
from executor.context import ExecutionContext
from executor.kv_cache import KVCache
from executor.ops import reference
from executor.platform import Platform, detect
from executor.scope import NO_PLAN, ScopeRunner, build_plan
from models.qwen.models.modeling_qwen import QwenForCausalLM

TINY = {
    "model_type": "qwen3",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
STATS_KEYS = {"backend", "compile_s", "graphs", "recompiles", "cache_dir", "cache_enabled", "scopes", "superkernel_ran"}
A3 = Platform("npu", "A3", "Ascend910_9392", "recording doubles")


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


def _compile(backend, fn):
    """Compile `fn` with `backend`; calls run inside the backend's execution context, as the runner's do."""
    context, step = ExecutionContext.for_backend(backend), backend.compile(fn)

    def run(input_ids, positions):
        with context.active():
            return step(input_ids, positions)

    return step, run


def _stats(step) -> dict:
    return dataclasses.asdict(step.report())


def _sk_off(mc: ModelConfig) -> ModelConfig:
    return dataclasses.replace(mc, enable_superkernel=False)


def _only(recorder, name):
    calls = recorder.named(name)
    assert len(calls) == 1, f"{name}: {len(calls)} calls"
    return calls[0]


# --------------------------------------------------------------------------- fused op wrappers
def test_register_ops_makes_an_npu_table(npu_ops):
    assert ops.active() == "npu"
    assert set(ops.implementations()) == set(ops.OP_NAMES)
    assert all(v.startswith("executor.backends.npu.") for v in ops.implementations().values())


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
    assert not torch.allclose(nd.npu_rotary_mul(x, cos, sin, rotary_mode="interleave"), y)


def test_attention_arguments_mask_polarity_and_output(npu_ops):
    b, hq, hkv, s, t, d = 2, 4, 2, 3, 6, 8
    q, k, v = torch.randn(b, hq, s, d), torch.randn(b, hkv, t, d), torch.randn(b, hkv, t, d)
    pos = torch.tensor([[2, 3, 4], [0, 1, 2]])  # (B, S)
    mask = torch.arange(t).view(1, 1, 1, t) > pos.view(b, 1, s, 1)  # (B, 1, S, T) True = masked out
    out = ops.attention(q, k, v, mask, 0.3)
    call = _only(npu_ops, "npu_fused_infer_attention_score")
    assert call.args == (q, k, v)
    kw = call.kwargs
    assert kw["atten_mask"] is mask and kw["atten_mask"].dtype == torch.bool
    assert kw["input_layout"] == "BNSD" and kw["scale"] == 0.3
    assert kw["num_heads"] == hq and kw["num_key_value_heads"] == hkv and kw["sparse_mode"] == 0
    assert kw["pre_tokens"] == kw["next_tokens"] == 2**31 - 1 and "pre_tockens" not in kw
    assert out.shape == (b, hq, s, d)  # element [0], not the lse
    torch.testing.assert_close(out, reference.attention(q, k, v, mask, 0.3))
    # polarity really matters: the inverted mask gives other numbers
    assert not torch.allclose(
        nd.npu_fused_infer_attention_score(
            q, k, v, atten_mask=~mask, num_heads=hq, num_key_value_heads=hkv, input_layout="BNSD", scale=0.3
        )[0],
        out,
    )


def test_attention_double_rejects_misspelt_keyword(npu_ops):
    q = torch.randn(1, 2, 1, 4)
    with pytest.raises(TypeError):
        npu_ops.npu_fused_infer_attention_score(q, q, q, num_heads=2, input_layout="BNSD", pre_tockens=1)


def test_moe_gating_k_and_contract_dtypes(npu_ops):
    logits = torch.randn(5, 8)
    w, idx = ops.moe_gating_top_k_softmax(logits, 2)
    call = _only(npu_ops, "npu_moe_gating_top_k_softmax")
    assert call.args == (logits,) and call.kwargs == {"finished": None, "k": 2}
    ref_w, ref_idx = reference.moe_gating_top_k_softmax(logits, 2)
    assert w.dtype == ref_w.dtype and idx.dtype == ref_idx.dtype
    torch.testing.assert_close(w, ref_w)
    assert torch.equal(idx, ref_idx)


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


# --------------------------------------------------------------------------- platform and config doubles
def test_detect_npu_with_doubles(doubles):
    p = detect("npu")
    assert (p.kind, p.soc_class, p.device_name) == ("npu", "A3", "Ascend910_9392")


def test_compiler_config_double_is_strict_like_torchair():
    cfg = nd.CompilerConfig()
    cfg.experimental_config.topology_sorting_strategy = "StableRDFS"
    with pytest.raises(ValueError):
        cfg.experimental_config.topology_sorting_strategy = "stable_rdfs"
    with pytest.raises(ValueError):
        cfg.experimental_config.frozen_parameters = True  # unknown option
    with pytest.raises(ValueError):
        cfg.mode = "default"


def test_scope_factory_rejects_other_modes(doubles):
    with pytest.raises(ValueError, match="ge_graph, npugraph_ex"):
        npu.scope_factory("eager")


# --------------------------------------------------------------------------- compiling a real tiny decode step
class TinyDecode:
    """A tiny Qwen3 with its static cache. `_decode_step` is a bound method of an owner that is
    not an nn.Module, exactly like ModelRunner._decode_step (the function compile_decode gets)."""

    def __init__(self, plan=NO_PLAN, batch: int = 2, state: dict | None = None):
        torch.manual_seed(0)
        arch = arch_from_dict(TINY, "test_npu_adapter.TINY")
        self.model = QwenForCausalLM(arch).eval()
        for p in self.model.parameters():  # not the near-identity default init: peaked logits
            p.data.normal_(0, 0.3)
        if state is not None:
            self.model.load_state_dict(state)
        self.plan = plan
        self.cache = KVCache(arch.num_layers, batch, arch.num_kv_heads, 8, arch.head_dim, torch.float32)
        self.scopes = ScopeRunner(plan, active=True)

    def _decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.logits(self.model(input_ids, positions, self.cache, self.scopes)[:, -1])

    def run(self, step, steps: int = 3, batch: int = 2) -> list[torch.Tensor]:
        ids = torch.arange(batch).view(batch, 1) + 5
        out = []
        with torch.no_grad():
            for i in range(steps):
                logits = step(ids, torch.full((batch, 1), i))
                out.append(logits)
                ids = logits.argmax(-1, keepdim=True)
        return out


def _setup(plan_name: str = "attention", options: str = "stream-fusion=1", **mc_fields):
    tiny = TinyDecode()
    plan = build_plan(tiny.model.regions(), plan_name, options)
    tiny = TinyDecode(plan, state=tiny.model.state_dict())
    mc = ModelConfig(
        exe_mode=mc_fields.pop("exe_mode", "ge_graph"),
        enable_superkernel=True,
        superkernel=SuperKernelConfig(plan=plan_name, options=options),
        **mc_fields,
    )
    return tiny, mc


def _reference_logits(tiny: TinyDecode, steps: int = 3) -> list[torch.Tensor]:
    with ops.using("reference"):
        eager = TinyDecode(NO_PLAN, state=tiny.model.state_dict())
        return eager.run(eager._decode_step, steps)


def _graph_scope_args(gm: torch.fx.GraphModule, op_name: str) -> list:
    return [list(n.args) for n in gm.graph.nodes if n.op == "call_function" and op_name in str(n.target)]


def test_torchair_ge_superkernel_scopes_config_and_numbers(npu_ops, doubles):
    tiny, mc = _setup()
    backend = npu.TorchairGEBackend(mc)
    step, run = _compile(backend, tiny._decode_step)
    logits = tiny.run(run)
    for got, want in zip(logits, _reference_logits(tiny)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    tair = doubles.torchair
    cfg = _only(tair, "get_npu_backend").kwargs["compiler_config"]
    ex = cfg.experimental_config
    assert ex.frozen_parameter is True and ex.tiling_schedule_optimize is True
    assert ex.topology_sorting_strategy == "StableRDFS"
    traced = tair.named("npu_backend")
    assert len(traced) == 1 and traced[0].kwargs["compiler_config"] is cfg  # fullgraph: one graph, our backend
    labels = ["layer_0_attn", "layer_1_attn"]
    assert labels == tiny.plan.labels
    assert tair.super_kernel_calls == [(label, "stream-fusion=1") for label in labels]
    keys = tuple(nd.SK_KEYS)
    in_graph = _graph_scope_args(traced[0].args[0], "air.scope_enter")
    assert in_graph == [[list(keys), [lb, "stream-fusion=1"]] for lb in labels]
    one_step = [("air.scope_enter", keys, (lb, "stream-fusion=1")) for lb in labels]
    one_step = [e for pair in zip(one_step, [("air.scope_exit",)] * 2) for e in pair]
    assert doubles.scope_events == one_step * 3  # scopes executed in every decode step, in order
    stats = _stats(step)
    assert set(stats) == STATS_KEYS and backend.name == stats["backend"] == "torchair_ge+superkernel"
    assert stats["superkernel_ran"] is True and stats["graphs"] == 1 and stats["recompiles"] == 0
    assert [(s["label"], s["options"]) for s in stats["scopes"]] == [(lb, "stream-fusion=1") for lb in labels]
    assert stats["compile_s"] > 0 and stats["cache_enabled"] is False and stats["cache_dir"] is None


def test_torchair_ge_is_static_and_fullgraph(npu_ops, doubles):
    tiny, mc = _setup()
    backend = npu.TorchairGEBackend(_sk_off(mc))
    step, run = _compile(backend, tiny._decode_step)
    tiny.run(run, steps=2)
    tiny.cache = KVCache(2, 3, 2, 8, 8, torch.float32)  # another batch size: a static recompile
    tiny.run(run, steps=1, batch=3)
    graphs = [c.args[0] for c in doubles.torchair.named("npu_backend")]
    assert len(graphs) == 2 and _stats(step)["recompiles"] == 1
    for gm in graphs:  # dynamic=False: no symbolic sizes even after a shape change
        for node in gm.graph.nodes:
            value = node.meta.get("example_value")
            if isinstance(value, torch.Tensor):
                assert all(isinstance(s, int) for s in value.shape), node
    assert doubles.torchair.super_kernel_calls == [] and doubles.scope_events == []
    assert _stats(step)["superkernel_ran"] is False and backend.name == "torchair_ge"

    def with_break(input_ids, positions):
        torch._dynamo.graph_break()
        return tiny._decode_step(input_ids, positions)

    zeros = torch.zeros(3, 1, dtype=torch.long)
    with pytest.raises(torch._dynamo.exc.Unsupported):  # fullgraph=True: a break is an error
        _compile(backend, with_break)[1](zeros, zeros)


def test_torchair_cache_compile_binds_step_to_a_module(npu_ops, doubles, tmp_path):
    tiny, mc = _setup(enable_cache_compile=True, cache_dir=str(tmp_path))
    step, run = _compile(npu.TorchairGEBackend(mc), tiny._decode_step)
    logits = tiny.run(run)
    for got, want in zip(logits, _reference_logits(tiny)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    call = _only(doubles.torchair, "inference.cache_compile")
    func = call.args[0]
    assert isinstance(func, types.MethodType) and isinstance(func.__self__, torch.nn.Module)
    assert func.__self__.model is tiny.model  # parameters resolvable by name on a cache hit
    assert call.kwargs["cache_dir"] == str(tmp_path / "torchair") and call.kwargs["ge_cache"] is True
    assert call.kwargs["dynamic"] is False and call.kwargs["fullgraph"] is True
    assert call.kwargs["config"].experimental_config.frozen_parameter is True
    assert not doubles.torchair.named("get_npu_backend")
    stats = _stats(step)
    assert stats["cache_dir"] == str(tmp_path / "torchair") and stats["cache_enabled"] is True
    assert stats["superkernel_ran"] is True


def test_compile_npugraph_ex_options_and_scopes(npu_ops, doubles):
    tiny, mc = _setup("layer", exe_mode="npugraph_ex")
    backend = npu.NpuGraphExBackend(mc)
    step, run = _compile(backend, tiny._decode_step)
    logits = tiny.run(run, steps=2)
    for got, want in zip(logits, _reference_logits(tiny, steps=2)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    call = _only(doubles.torch_npu, "npugraph_ex_backend")
    assert call.kwargs["options"] == {
        "frozen_parameter": True,
        "static_kernel_compile": True,
        "super_kernel_optimize": True,
        "super_kernel_optimize_options": {"stream_fusion": 1},
    }
    labels = ["layer_0", "layer_1"]
    assert _graph_scope_args(call.args[0], "super_kernel_scope_begin") == [[lb] for lb in labels]
    one_step = [e for lb in labels for e in (("npu.super_kernel_scope_begin", lb), ("npu.super_kernel_scope_end", lb))]
    assert doubles.scope_events == one_step * 2
    assert doubles.torchair.super_kernel_calls == []  # torchair scopes do nothing in this mode
    stats = _stats(step)
    assert set(stats) == STATS_KEYS and stats["superkernel_ran"] is True and backend.name == "npugraph_ex+superkernel"
    assert [s["label"] for s in stats["scopes"]] == labels


def test_compile_npugraph_ex_without_superkernel_has_no_sk_keys(npu_ops, doubles):
    tiny, mc = _setup(exe_mode="npugraph_ex")
    tiny.run(_compile(npu.NpuGraphExBackend(_sk_off(mc)), tiny._decode_step)[1], steps=1)
    options = _only(doubles.torch_npu, "npugraph_ex_backend").kwargs["options"]
    assert options == {"frozen_parameter": True, "static_kernel_compile": True}


@pytest.mark.parametrize(
    "options, custom",
    [
        ("feed-sync-all=1", ()),
        (
            "stream-fusion=1",
            (
                CustomScope(("layer_0_attn",), "a", "stream-fusion=0"),  # 0 here, 1 inherited below
                CustomScope(("layer_1_attn",), "b", ""),
            ),
        ),
    ],
)
def test_compile_npugraph_ex_refuses_options_it_cannot_honour(doubles, options, custom):
    sk = SuperKernelConfig(plan="custom" if custom else "attention", options=options, custom=custom)
    with pytest.raises(UnsupportedError, match="feed-sync-all" if not custom else "disagree"):
        mc = ModelConfig(exe_mode="npugraph_ex", enable_superkernel=True, superkernel=sk)
        npu.NpuGraphExBackend(mc).compile(lambda a, b: a)
    assert not doubles.torch_npu.named("npugraph_ex_backend")


def test_compile_npugraph_ex_has_no_compile_cache(doubles):
    with pytest.raises(UnsupportedError, match="enable_cache_compile"):
        npu.NpuGraphExBackend(ModelConfig(exe_mode="npugraph_ex", enable_cache_compile=True))


def test_select_backend_npu_branch(doubles):
    tiny, mc = _setup()
    backend = select_backend(mc, A3)
    assert isinstance(backend, npu.TorchairGEBackend) and backend.op_table == "npu"
    with ExecutionContext.for_backend(backend).active():
        assert ops.active() == "npu"
    assert ops.active() == "reference"  # the context restores the process-wide table
    step, run = _compile(backend, tiny._decode_step)
    tiny.run(run, steps=1)
    assert backend.name == "torchair_ge+superkernel" and _stats(step)["superkernel_ran"] is True
    assert [s["label"] for s in _stats(step)["scopes"]] == ["layer_0_attn", "layer_1_attn"]
    eager = select_backend(dataclasses.replace(mc, exe_mode="eager", enable_superkernel=False), A3)
    assert isinstance(eager, EagerBackend) and eager.op_table == "npu"


def test_cache_compile_takes_the_real_runner_decode_step(doubles, qwen3_ckpt, make_qwen_runner, tmp_path):
    """ModelRunner._decode_step is not an nn.Module method; the adapter must still hand
    torchair.inference.cache_compile one whose module owns the runner's model."""
    runner = make_qwen_runner(
        qwen3_ckpt,
        "model_config.exe_mode=ge_graph",
        "model_config.enable_cache_compile=true",
        f"model_config.cache_dir={tmp_path}",
        "model_config.enable_superkernel=true",
        "model_config.superkernel.plan=layer",
        max_new_tokens=4,
    )
    prompt = [runner.tokenizer.encode("The weather today is")]
    runner.use_backend(EagerBackend())
    want = runner.generate(prompt, 4)
    runner.use_backend(npu.select_backend(runner.cfg.model_config))
    got = runner.generate(prompt, 4)
    assert got.token_ids == want.token_ids
    torch.testing.assert_close(got.last_logits, want.last_logits, rtol=1e-4, atol=1e-4)
    func = _only(doubles.torchair, "inference.cache_compile").args[0]
    assert isinstance(func.__self__, torch.nn.Module) and func.__self__.model is runner.model
    names = {f"model.{k}" for k, _ in runner.model.named_parameters()}
    assert dict(func.__self__.named_parameters()).keys() == names
    traced = sorted({label for label, _ in doubles.torchair.super_kernel_calls})
    assert traced == runner.plan.labels == ["layer_0", "layer_1"]
    assert runner.step.report().superkernel_ran is True
