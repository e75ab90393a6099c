"""Contract tests of the Ascend graph backends (executor/backends/npu.py) against recording doubles.

A real tiny Qwen3 decode step (bfloat16, the NPU dtype) is compiled through dynamo on CPU with
the doubles' torchair / npugraph_ex backends, so scopes, graphs and numbers are real; what is
pinned is every argument the real APIs take (CompilerConfig settings, npugraph_ex options, both
compile caches and the directory they are keyed on). The fused-op table and the doubles
themselves are in tests/test_npu_adapter.py.
"""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path

import pytest
import torch

import tests.npu_doubles as nd
from executor import ops
from executor.arch import arch_from_dict
from executor.backends import npu
from executor.backends.base import DecodeSpec, EagerBackend
from executor.compile import UnsupportedError, select_backend
from executor.config import CustomScope, ModelConfig, SuperKernelConfig
from executor.context import ExecutionContext
from executor.kv_cache import KVCache
from executor.platform import Platform
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
ARCH = arch_from_dict(TINY, "test_npu_compile.TINY")
BATCH, MAX_LEN, BF16 = 2, 8, torch.bfloat16
STATS_KEYS = {
    "backend",
    "compile_s",
    "graphs",
    "recompiles",
    "cache_dir",
    "cache_enabled",
    "cache_key",
    "cache_lookups",
    "direct_calls",
    "scopes",
    "superkernel_ran",
}
A3 = Platform("npu", "A3", "Ascend910_9392", "recording doubles")


@pytest.fixture
def doubles():
    with nd.installed() as d:
        yield d
    assert ops.active() == "reference"


class TinyDecode:
    """A tiny bf16 Qwen3 with its static cache. `_decode_step` is a bound method of an owner that
    is not an nn.Module, exactly like ModelRunner._decode_step (the function a backend compiles)."""

    def __init__(self, plan=NO_PLAN, batch: int = BATCH, state: dict | None = None):
        torch.manual_seed(0)
        self.model = QwenForCausalLM(ARCH).eval()
        for p in self.model.parameters():  # not the near-identity default init: peaked logits
            p.data.normal_(0, 0.3)
        self.model.to(BF16)
        if state is not None:
            self.model.load_state_dict(state)
        self.plan = plan
        self.cache = KVCache(ARCH.num_layers, batch, ARCH.num_kv_heads, MAX_LEN, ARCH.head_dim, BF16)
        self.scopes = ScopeRunner(plan, active=True)

    def _decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.logits(self.model(input_ids, positions, self.cache, self.scopes)[:, -1])

    def run(self, step, steps: int = 3, batch: int = BATCH) -> list[torch.Tensor]:
        ids = torch.arange(batch).view(batch, 1) + 5
        out = []
        with torch.no_grad():
            for i in range(steps):
                logits = step(ids, torch.full((batch, 1), i))
                out.append(logits)
                ids = logits.argmax(-1, keepdim=True)
        return out


def _spec(mc: ModelConfig, plan=NO_PLAN, **fields) -> DecodeSpec:
    base = DecodeSpec(mc, ARCH, "bfloat16", BATCH, MAX_LEN, plan, A3.device_name)
    return dataclasses.replace(base, **fields)


def _setup(plan_name: str = "attention", options: str = "stream-fusion=1", custom=(), **mc_fields):
    tiny = TinyDecode()
    plan = build_plan(tiny.model.regions(), plan_name, options, custom)
    tiny = TinyDecode(plan, state=tiny.model.state_dict())
    sk = SuperKernelConfig(plan=plan_name, options=options, custom=custom)
    mc = ModelConfig(
        exe_mode=mc_fields.pop("exe_mode", "ge_graph"), enable_superkernel=True, superkernel=sk, **mc_fields
    )
    return tiny, _spec(mc, plan)


def _sk_off(spec: DecodeSpec) -> DecodeSpec:
    mc = spec.model_config
    return dataclasses.replace(spec, model_config=dataclasses.replace(mc, enable_superkernel=False), plan=NO_PLAN)


def _compile(backend, fn):
    """Compile `fn` with `backend`; calls run inside the backend's execution context, as the runner's do."""
    context, step = ExecutionContext.for_backend(backend), backend.compile(fn)

    def run(input_ids, positions):
        with context.active():
            return step(input_ids, positions)

    return step, run


def _stats(step) -> dict:
    return dataclasses.asdict(step.report())


def _only(recorder, name):
    calls = recorder.named(name)
    assert len(calls) == 1, f"{name}: {len(calls)} calls"
    return calls[0]


def _eager_logits(tiny: TinyDecode, table: str, steps: int = 3) -> list[torch.Tensor]:
    with ops.using(table):
        eager = TinyDecode(NO_PLAN, state=tiny.model.state_dict())
        return eager.run(eager._decode_step, steps)


def _assert_numbers(tiny: TinyDecode, logits: list[torch.Tensor]) -> None:
    """Compiled = the same fused ops run eagerly (to rounding), and close to the reference ops in
    bf16 (the doubles compute attention in fp32, the reference in bf16 with an fp32 softmax)."""
    for got, want in zip(logits, _eager_logits(tiny, "npu", len(logits))):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    for got, want in zip(logits, _eager_logits(tiny, "reference", len(logits))):
        torch.testing.assert_close(got, want, rtol=0.1, atol=0.1)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def _graph_scope_args(gm: torch.fx.GraphModule, op_name: str) -> list:
    return [list(n.args) for n in gm.graph.nodes if n.op == "call_function" and op_name in str(n.target)]


# --------------------------------------------------------------------------- torchair GE
def test_torchair_ge_superkernel_scopes_config_and_numbers(doubles):
    tiny, spec = _setup()
    backend = npu.TorchairGEBackend(spec)
    step, run = _compile(backend, tiny._decode_step)
    _assert_numbers(tiny, tiny.run(run))
    tair = doubles.torchair
    cfg = _only(tair, "get_npu_backend").kwargs["compiler_config"]
    ex = cfg.experimental_config
    assert ex.frozen_parameter.value == "1" and ex.tiling_schedule_optimize.value == "1"  # option objects
    assert ex.topology_sorting_strategy.value == "StableRDFS" and cfg.mode.value == "max-autotune"
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
    assert [s["label"] for s in stats["cache_key"]["scopes"]] == labels  # recorded even without a cache


def test_torchair_ge_is_static_and_fullgraph(doubles):
    tiny, spec = _setup()
    backend = npu.TorchairGEBackend(_sk_off(spec))
    step, run = _compile(backend, tiny._decode_step)
    tiny.run(run, steps=2)
    tiny.cache = KVCache(2, 3, 2, MAX_LEN, 8, BF16)  # another batch size: a static recompile
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


def test_torchair_cache_compile_binds_step_to_a_module_in_a_keyed_dir(doubles, tmp_path):
    tiny, spec = _setup(enable_cache_compile=True, cache_dir=str(tmp_path))
    step, run = _compile(npu.TorchairGEBackend(spec), tiny._decode_step)
    _assert_numbers(tiny, tiny.run(run))
    call = _only(doubles.torchair, "inference.cache_compile")
    func = call.args[0]
    assert isinstance(func, types.MethodType) and isinstance(func.__self__, torch.nn.Module)
    assert func.__self__.model is tiny.model  # parameters resolvable by name on a cache hit
    cache_dir = Path(call.kwargs["cache_dir"])
    assert cache_dir.parent == tmp_path and cache_dir.name.startswith("torchair_ge+superkernel-")
    assert call.kwargs["ge_cache"] is True and call.kwargs["dynamic"] is False
    assert "fullgraph" not in call.kwargs  # cache_compile ignores it (it always compiles fullgraph)
    assert call.kwargs["config"].experimental_config.frozen_parameter.value == "1"
    assert not doubles.torchair.named("get_npu_backend")
    stats = _stats(step)
    assert stats["cache_dir"] == str(cache_dir) and stats["cache_enabled"] is True
    assert json.loads((cache_dir / "cache_key.json").read_text()) == stats["cache_key"]
    assert stats["superkernel_ran"] is True
    # the same spec again: the same directory; another plan: another one (torchair's own key misses both)
    assert npu.TorchairGEBackend(spec).cache_dir == cache_dir
    _, layer_spec = _setup("layer", enable_cache_compile=True, cache_dir=str(tmp_path))
    assert npu.TorchairGEBackend(layer_spec).cache_dir != cache_dir


def test_cached_step_refuses_another_batch_and_a_failed_compile_leaves_no_cache(doubles, tmp_path):
    tiny, spec = _setup(enable_cache_compile=True, cache_dir=str(tmp_path))
    backend = npu.TorchairGEBackend(spec)
    run = _compile(backend, tiny._decode_step)[1]
    ids = torch.zeros(BATCH + 1, 1, dtype=torch.long)
    with pytest.raises(UnsupportedError, match=f"batch {BATCH}"):  # a cache hit would skip the shape guards
        run(ids, ids)

    def broken(input_ids, positions):
        raise RuntimeError("GE compile failed")

    backend = npu.TorchairGEBackend(dataclasses.replace(spec, batch_size=1))
    assert backend.cache_dir.is_dir()
    with pytest.raises(RuntimeError, match="GE compile failed"):
        _compile(backend, broken)[1](ids[:1], ids[:1])
    assert not backend.cache_dir.exists()  # torchair would have saved a cache of the failed call


# --------------------------------------------------------------------------- npugraph_ex
def test_compile_npugraph_ex_options_and_scopes(doubles):
    tiny, spec = _setup("layer", exe_mode="npugraph_ex")
    backend = npu.NpuGraphExBackend(spec)
    step, run = _compile(backend, tiny._decode_step)
    _assert_numbers(tiny, tiny.run(run, steps=2))
    call = _only(doubles.torch_npu, "npugraph_ex_backend")
    assert call.kwargs["options"] == {
        "frozen_parameter": True,
        "static_kernel_compile": False,  # not forced on by SuperKernel
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
    assert stats["cache_key"]["backend_options"] == call.kwargs["options"]


def test_npugraph_ex_static_kernel_is_its_own_switch(doubles):
    tiny, spec = _setup(exe_mode="npugraph_ex", enable_static_kernel=True)
    tiny.run(_compile(npu.NpuGraphExBackend(_sk_off(spec)), tiny._decode_step)[1], steps=1)
    options = _only(doubles.torch_npu, "npugraph_ex_backend").kwargs["options"]
    assert options == {"frozen_parameter": True, "static_kernel_compile": True}  # without SuperKernel


def test_npugraph_ex_maps_dcci_options(doubles):
    options = "stream-fusion=1:dcci-disable-on-kernel=GroupedMatmul,MoeGatingTopK:dcci-after-kernel-end=SwiGlu"
    tiny, spec = _setup(options=options, exe_mode="npugraph_ex")
    tiny.run(_compile(npu.NpuGraphExBackend(spec), tiny._decode_step)[1], steps=1)  # the double checks key types
    sk = _only(doubles.torch_npu, "npugraph_ex_backend").kwargs["options"]["super_kernel_optimize_options"]
    assert sk == {
        "stream_fusion": 1,
        "dcci_disable_on_kernel": ["GroupedMatmul", "MoeGatingTopK"],
        "dcci_after_kernel_end": ["SwiGlu"],
    }


@pytest.mark.parametrize(
    "options, custom, error",
    [
        ("feed-sync-all=1", (), "feed-sync-all"),
        ("strict-scope-check=abort", (), "strict-scope-check"),
        (
            "stream-fusion=1",
            (
                CustomScope(("layer_0_attn",), "a", "stream-fusion=0"),  # 0 here, 1 inherited below
                CustomScope(("layer_1_attn",), "b", ""),
            ),
            "disagree",
        ),
    ],
)
def test_npugraph_ex_refuses_options_it_cannot_honour(doubles, options, custom, error):
    _tiny, spec = _setup("custom" if custom else "attention", options, custom, exe_mode="npugraph_ex")
    with pytest.raises(UnsupportedError, match=error):
        npu.NpuGraphExBackend(spec)  # at selection: before any weight is loaded
    assert not doubles.torch_npu.named("npugraph_ex_backend")


def test_npugraph_ex_cache_compile_in_a_keyed_dir(doubles, tmp_path):
    tiny, spec = _setup(exe_mode="npugraph_ex", enable_cache_compile=True, cache_dir=str(tmp_path))
    step, run = _compile(npu.NpuGraphExBackend(spec), tiny._decode_step)
    _assert_numbers(tiny, tiny.run(run, steps=2))
    call = _only(doubles.torch_npu, "npugraph_ex.inference.cache_compile")
    func = call.args[0]
    assert isinstance(func, types.MethodType) and func.__self__.model is tiny.model
    cache_dir = Path(call.kwargs["cache_dir"])
    assert cache_dir.parent == tmp_path and cache_dir.name.startswith("npugraph_ex+superkernel-")
    assert call.kwargs["dynamic"] is False and call.kwargs["options"]["super_kernel_optimize"] is True
    assert _stats(step)["cache_dir"] == str(cache_dir)
    tair_spec = _setup(enable_cache_compile=True, cache_dir=str(tmp_path))[1]
    assert npu.TorchairGEBackend(tair_spec).cache_dir != cache_dir  # exe_mode is in the key


# --------------------------------------------------------------------------- selection
def test_select_backend_npu_branch(doubles):
    tiny, spec = _setup()
    backend = select_backend(spec, A3)
    assert isinstance(backend, npu.TorchairGEBackend) and backend.op_table == "npu"
    with ExecutionContext.for_backend(backend).active():
        assert ops.active() == "npu"
    assert ops.active() == "reference"  # the context restores the process-wide table
    step, run = _compile(backend, tiny._decode_step)
    tiny.run(run, steps=1)
    assert backend.name == "torchair_ge+superkernel" and _stats(step)["superkernel_ran"] is True
    assert [s["label"] for s in _stats(step)["scopes"]] == ["layer_0_attn", "layer_1_attn"]
    eager_mc = dataclasses.replace(spec.model_config, exe_mode="eager", enable_superkernel=False)
    eager = select_backend(dataclasses.replace(spec, model_config=eager_mc, plan=NO_PLAN), A3)
    assert isinstance(eager, EagerBackend) and eager.op_table == "npu"
    with pytest.raises(UnsupportedError, match="float32"):  # a spec built elsewhere is checked again
        select_backend(dataclasses.replace(spec, dtype="float32"), A3)


def test_cache_compile_takes_the_real_runner_decode_step(doubles, qwen3_ckpt, make_qwen_runner, tmp_path):
    """ModelRunner._decode_step is not an nn.Module method; the adapter must still hand
    torchair.inference.cache_compile one whose module owns the runner's model."""
    runner = make_qwen_runner(
        qwen3_ckpt,
        "model_config.dtype=bfloat16",
        "model_config.exe_mode=ge_graph",
        "model_config.enable_cache_compile=true",
        f"model_config.cache_dir={tmp_path}",
        "model_config.enable_superkernel=true",
        "model_config.superkernel.plan=layer",
        max_new_tokens=4,
    )
    prompt = [runner.tokenizer.encode("The weather today is")]
    runner.use_backend(EagerBackend("npu"))
    want = runner.generate(prompt, 4)
    runner.use_backend(npu.select_backend(runner.decode_spec()))
    got = runner.generate(prompt, 4)
    assert got.token_ids == want.token_ids
    torch.testing.assert_close(got.last_logits, want.last_logits, rtol=1e-2, atol=1e-2)
    func = _only(doubles.torchair, "inference.cache_compile").args[0]
    assert isinstance(func.__self__, torch.nn.Module) and func.__self__.model is runner.model
    names = {f"model.{k}" for k, _ in runner.model.named_parameters()}
    assert dict(func.__self__.named_parameters()).keys() == names
    traced = sorted({label for label, _ in doubles.torchair.super_kernel_calls})
    assert traced == runner.plan.labels == ["layer_0", "layer_1"]
    report = runner.step.report()
    assert report.superkernel_ran is True
    key = report.cache_key
    assert (key["dtype"], key["batch_size"], key["max_len"], key["plan"]) == ("bfloat16", 1, 24 + 4, "layer")
    assert key["versions"]["torch_npu"] == nd.TORCH_NPU_VERSION and key["op_table"] == ops.implementations("npu")
