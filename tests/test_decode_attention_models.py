"""`model_config.custom_ops: [decode_attention]` on a whole Qwen3 against HuggingFace transformers.

Why: the custom op is only worth switching on if the recipe still computes what HF computes, in
every execution mode it can run in (eager, ge_graph, ge_graph + every SuperKernel plan, where the
op is compiled inside a scope and called from Inductor's C++ wrapper), and if the op really ran
(a table that quietly kept the masked reference would pass a parity test too): the torch profiler
must see one `cann::decode_attention` call per layer per decode step. Two prompts of different
lengths make the rows' valid KV lengths differ. Each configuration is compiled once per module.
The MoE recipe (qwen3_moe against HF's Qwen3-MoE) adds the plans only it has: `moe`, and a custom
scope over one layer's attention and MoE.
"""

from __future__ import annotations

import io
import json

import pytest
import torch

import tests.checkpoints as ckpt

MAX_NEW = 6
PROMPTS = ["The weather today is", "Once upon a time, in a small village by the sea, there lived an old"]
BASE = ["scheduler_config.batch_size=2", "data_config.prompts=" + json.dumps(PROMPTS)]
CUSTOM_OPS = ["model_config.custom_ops=[decode_attention]"]
SK = ["model_config.exe_mode=ge_graph", "model_config.enable_superkernel=true"]
CUSTOM_PLAN = 'model_config.superkernel.custom=[{regions: ["layer_*_attn", layer_1_mlp], label: mixed}]'
CONFIGS = {
    "eager": [],
    "ge_graph": ["model_config.exe_mode=ge_graph"],
    **{
        f"sk_{plan}": [*SK, f"model_config.superkernel.plan={plan}"]
        for plan in ("attention", "mlp", "layer", "decoder")
    },
    "sk_custom": [*SK, "model_config.superkernel.plan=custom", CUSTOM_PLAN],
}


@pytest.fixture(scope="module")
def hf(qwen3_ckpt):
    return ckpt.load_reference(qwen3_ckpt)


@pytest.fixture(scope="module")
def hf_greedy(hf):
    """HF's greedy continuation per prompt, computed once for all configurations."""
    found: dict[tuple[int, ...], list[int]] = {}

    def greedy(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in found:
            found[tuple(prompt)] = ckpt.reference_greedy(hf, prompt, MAX_NEW)
        return found[tuple(prompt)]

    return greedy


@pytest.fixture(scope="module", params=list(CONFIGS))
def run(request, make_qwen_runner, qwen3_ckpt):
    runner = make_qwen_runner(qwen3_ckpt, *BASE, *CUSTOM_OPS, *CONFIGS[request.param], max_new_tokens=MAX_NEW)
    runner.stream = io.StringIO()
    metrics = runner.run()
    prompt_ids = runner.encode_prompts()
    with torch.profiler.profile() as prof:
        gen = runner.generate(prompt_ids, MAX_NEW)
    calls = sum(1 for e in prof.events() if e.name == "cann::decode_attention")
    return {
        "name": request.param,
        "runner": runner,
        "metrics": metrics,
        "gen": gen,
        "prompts": prompt_ids,
        "calls": calls,
    }


def test_greedy_tokens_equal_hf(run, hf_greedy):
    for prompt, tokens in zip(run["prompts"], run["gen"].token_ids):
        assert tokens == hf_greedy(prompt), run["name"]
    assert len({len(p) for p in run["prompts"]}) == 2  # rows at different positions


@torch.no_grad()
def test_last_decode_logits_match_hf(run, hf):
    gen = run["gen"]
    for row, (prompt, tokens) in enumerate(zip(run["prompts"], gen.token_ids)):
        ids = torch.tensor([prompt + tokens[:-1]])  # the last decode step saw this sequence
        theirs = hf(input_ids=ids, use_cache=False).logits[0, -1].float()
        ours = gen.last_logits[row]
        assert (ours - theirs).abs().max().item() < 1e-4, run["name"]
        assert torch.nn.functional.cosine_similarity(ours, theirs, dim=0).item() > 0.9999


def test_the_custom_op_ran_once_per_layer_per_decode_step(run):
    layers = len(run["runner"].model.layers)
    assert run["calls"] == layers * (MAX_NEW - 1), run["name"]  # prefill keeps the base attention


def test_op_table_metrics_and_compile_key_name_the_custom_op(run):
    metrics = run["metrics"]
    assert metrics["ops"]["attention"] == "executor.custom_ops.decode_attention.attention"
    assert metrics["ops"]["rms_norm"] == "executor.ops.reference.rms_norm"
    assert run["runner"].context.op_table == "reference+decode_attention"
    assert metrics["config"]["model_config"]["custom_ops"] == ["decode_attention"]
    if run["name"] != "eager":
        compile_info = metrics["compile"]
        assert compile_info["graphs"] == 1 and compile_info["recompiles"] == 0
        assert compile_info["cache_key"]["op_table"]["attention"] == metrics["ops"]["attention"]
    if run["name"].startswith("sk_"):
        assert metrics["superkernel"]["ran"] is True


# --------------------------------------------------------------------------- the MoE recipe
MOE_PLANS = ["moe", "custom"]  # the plan only a MoE model has; a custom scope mixing attention and MoE
MOE_CUSTOM = "model_config.superkernel.custom=[{regions: [layer_0_attn, layer_0_moe], label: attn_moe}]"


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    """Two layers: layer 0 MoE, layer 1 dense, so the `moe` plan scopes one region and leaves one out."""
    return ckpt.make_qwen3_moe_checkpoint(tmp_path_factory.mktemp("moe"), num_hidden_layers=2, mlp_only_layers=[1])


@pytest.mark.parametrize("plan", MOE_PLANS)
@torch.no_grad()
def test_qwen3_moe_with_the_custom_op_matches_hf_in_its_moe_plans(moe_ckpt, plan):
    from executor.config import load_config
    from executor.platform import detect
    from executor.registry import default_config
    from models.qwen3_moe.models.runner_qwen3_moe import Qwen3MoeRunner

    overrides = [
        f"model_config.model_path={moe_ckpt}",
        "model_config.with_ckpt=true",
        f"scheduler_config.max_new_tokens={MAX_NEW}",
        "data_config.input_truncated_len=24",
        "model_config.enable_cache_compile=false",
        *BASE,
        *CUSTOM_OPS,
        *SK,
        f"model_config.superkernel.plan={plan}",
        *([MOE_CUSTOM] if plan == "custom" else []),
    ]
    runner = Qwen3MoeRunner(load_config(default_config("qwen3_moe"), overrides), detect("cpu"), stream=io.StringIO())
    metrics = runner.run()
    assert metrics["superkernel"]["ran"] is True and metrics["compile"]["graphs"] == 1
    assert metrics["ops"]["attention"] == "executor.custom_ops.decode_attention.attention"
    prompt_ids = runner.encode_prompts()
    with torch.profiler.profile() as prof:
        gen = runner.generate(prompt_ids, MAX_NEW)
    calls = sum(1 for e in prof.events() if e.name == "cann::decode_attention")
    assert calls == len(runner.model.layers) * (MAX_NEW - 1)
    hf = ckpt.load_reference(moe_ckpt)
    for row, (prompt, tokens) in enumerate(zip(prompt_ids, gen.token_ids)):
        assert tokens == ckpt.reference_greedy(hf, prompt, MAX_NEW), plan
        theirs = hf(input_ids=torch.tensor([prompt + tokens[:-1]]), use_cache=False).logits[0, -1].float()
        assert (gen.last_logits[row] - theirs).abs().max().item() < 1e-4, plan


@pytest.mark.parametrize("store_once", [False, True], ids=["inductor_alone", "stored_once"])
def test_the_mask_is_computed_once_per_step_not_once_per_layer(make_qwen_runner, qwen3_ckpt, monkeypatch, store_once):
    """The decode mask (B, 1, 1, max_len) feeds every layer's op. Left to Inductor, each layer's
    kernel computed it again into its own buffer (a step that grew with max_len although the op
    reads only the valid slots); executor.backends.graph_passes stores it once."""
    from torch._inductor.utils import run_and_get_code

    import executor.backends.graph_passes as passes

    if not store_once:
        monkeypatch.setattr(passes, "_store_shared_opaque_inputs", lambda gm: 0)
    runner = make_qwen_runner(
        qwen3_ckpt, *CUSTOM_OPS, "model_config.exe_mode=ge_graph", "model_config.enable_cache_compile=false"
    )
    _, code = run_and_get_code(lambda: runner.generate([[7, 42, 133]], 3))
    mask = f"empty_strided_cpu((1, 1, 1, {runner.max_len}), "
    buffers = sum(line.count(mask) for src in code for line in src.splitlines() if "torch.bool" in line)
    assert buffers == (1 if store_once else len(runner.model.layers)), buffers
