"""qwen3_moe recipe against transformers' Qwen3-MoE on tiny random checkpoints.

Checked: the MoE block's three formulations (gathered decode, dense large-batch decode,
grouped prefill) against HF's Qwen3MoeSparseMoeBlock; full-sequence logits and greedy tokens
for all-MoE and mixed dense/MoE configs, with and without norm_topk_prob; the compiled decode
step (ge_graph, with and without every SuperKernel plan) against eager; expert stacking at load
time; the recipe's infer.sh end to end. Compiling is slow on a shared CPU, so every compiled
mode runs once, on the small mixed checkpoint where both `moe` and `mlp` plans apply.
"""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tests.checkpoints as ckpt
from executor.config import load_config
from executor.kv_cache import KVCache
from executor.loader import LoadError, read_checkpoint, remap
from executor.platform import detect
from executor.scope import PREFILL_SCOPES
from models.qwen3_moe.models.modeling_qwen3_moe import SparseMoeBlock
from models.qwen3_moe.models.runner_qwen3_moe import Qwen3MoeRunner

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "models" / "qwen3_moe" / "config" / "builtin.yaml"
EAGER = [
    "model_config.exe_mode=eager",
    "model_config.enable_superkernel=false",
    "model_config.enable_cache_compile=false",
]
PROMPT = [5, 17, 99, 200, 3, 42, 7, 300, 11]
NEW_TOKENS = 8

# name -> (checkpoint overrides, expected ffn kind per layer); 3 layers by default
CONFIGS = {
    "all_moe_norm": (dict(norm_topk_prob=True), ["moe", "moe", "moe"]),
    "all_moe_nonorm": (dict(norm_topk_prob=False, seed=1), ["moe", "moe", "moe"]),
    "mlp_only_layers": (dict(mlp_only_layers=[1]), ["moe", "mlp", "moe"]),
    "sparse_step_2": (
        dict(decoder_sparse_step=2, norm_topk_prob=False, num_hidden_layers=4, seed=3),
        ["mlp", "moe", "mlp", "moe"],
    ),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for name, (overrides, _) in CONFIGS.items():
        out[name] = ckpt.make_qwen3_moe_checkpoint(tmp_path_factory.mktemp(name), **overrides)
    ckpt.to_hub_style_config(out["sparse_step_2"])  # `num_experts`, as on the Hub, must parse too
    # one MoE layer: the extra compile of the batched (dense) decode step stays cheap
    out["one_layer"] = ckpt.make_qwen3_moe_checkpoint(tmp_path_factory.mktemp("one_layer"), num_hidden_layers=1)
    return out


def make_runner(path: Path, *overrides: str) -> Qwen3MoeRunner:
    cfg = load_config(
        CONFIG,
        [
            f"model_config.model_path={path}",
            "model_config.with_ckpt=true",
            f"scheduler_config.max_new_tokens={NEW_TOKENS}",
            *EAGER,  # the recipe's YAML is the optimized one; each test asks for what it measures
            *overrides,
        ],
    )
    return Qwen3MoeRunner(cfg, detect("cpu"), stream=io.StringIO())


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


@torch.no_grad()
def full_logits(runner: Qwen3MoeRunner, ids: list[int]) -> torch.Tensor:
    """Our eager prefill over the whole sequence -> (S, V) logits."""
    x = torch.tensor([ids])
    cache = KVCache(
        len(runner.model.layers),
        1,
        runner.arch.num_kv_heads,
        64,
        runner.arch.head_dim,
        torch.float32,
        torch.device("cpu"),
    )
    hidden = runner.model(x, torch.arange(len(ids)).unsqueeze(0), cache, PREFILL_SCOPES)
    return runner.model.logits(hidden)[0]


# --------------------------------------------------------------------------- eager vs transformers
@pytest.mark.parametrize("name", list(CONFIGS))
def test_layers_logits_and_greedy_match_transformers(checkpoints, name):
    runner = make_runner(checkpoints[name])
    assert [layer.ffn_kind for layer in runner.model.layers] == CONFIGS[name][1]
    ref = ckpt.load_reference(checkpoints[name])
    ids = PROMPT + [1, 2, 3, 400, 401, 402, 77]
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([ids])).logits[0]
    got = full_logits(runner, ids)
    assert (got - want).abs().max().item() < 1e-4
    assert cosine(got, want) > 0.9999
    gen = runner.generate([PROMPT], NEW_TOKENS)
    expected = ckpt.reference_greedy(ref, PROMPT, NEW_TOKENS)
    assert gen.token_ids[0] == expected
    assert len(set(expected)) > 2  # the checkpoint is not degenerate, so the check means something


@pytest.mark.parametrize("name", ["all_moe_norm", "all_moe_nonorm"])
@pytest.mark.parametrize("batch,seq", [(1, 1), (3, 1), (6, 1), (1, 7), (3, 5)])
def test_every_moe_formulation_matches_transformers_block(checkpoints, name, batch, seq):
    """Each formulation, and the one forward() picks, equals HF's block on the same weights
    (8 experts top-2: N*k <= 8 gathers, larger decode runs dense, prefill groups)."""
    ours: SparseMoeBlock = make_runner(checkpoints[name]).model.layers[0].mlp
    theirs = ckpt.load_reference(checkpoints[name]).model.layers[0].mlp
    x = torch.randn(batch, seq, ours.experts_gate_up.shape[-1], generator=torch.Generator().manual_seed(batch * seq))
    with torch.no_grad():
        want = theirs(x)
        flat = x.view(batch * seq, -1)
        weights, idx = ours.route(flat)
        results = {
            "forward": ours(x),
            "gathered": ours._gathered(flat, weights, idx),
            "dense": ours._dense(flat, weights, idx),
            "grouped": ours._grouped(flat, weights, idx),
        }
    assert want.abs().max().item() > 0.1
    for what, got in results.items():
        assert (got.view_as(want) - want).abs().max().item() < 1e-5, what


@pytest.mark.parametrize("batch", [1, 4])
def test_small_batch_decode_reads_only_the_chosen_experts(checkpoints, batch):
    """Decode at N*k <= E computes k experts per token, not all E (counted matmul FLOPs:
    router 2*N*H*E + experts 2*N*k*3*I*H; running every expert would be E/k = 4x the latter)."""
    from torch.utils.flop_counter import FlopCounterMode

    block: SparseMoeBlock = make_runner(checkpoints["all_moe_norm"]).model.layers[0].mlp
    e, k = block.num_experts, block.top_k
    _, two_i, h = block.experts_gate_up.shape
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        block(torch.randn(batch, 1, h))
    assert counter.get_total_flops() == 2 * batch * (h * e + k * 3 * (two_i // 2) * h)


@pytest.mark.parametrize("exe_mode", ["eager", "ge_graph"])
def test_batched_decode_matches_transformers_per_row(checkpoints, exe_mode):
    """Batch 5 (N*k = 10 > 8 experts: the dense decode formulation, which must compile as one
    static graph too), rows of different lengths: every row's greedy tokens equal HF's."""
    path = checkpoints["one_layer"]
    runner = make_runner(path, "scheduler_config.batch_size=5", f"model_config.exe_mode={exe_mode}")
    ref = ckpt.load_reference(path)
    prompts = [PROMPT, PROMPT[:4], [300, 301, 302, 303, 304, 305, 306], [9], PROMPT[::-1]]
    gen = runner.generate(prompts, NEW_TOKENS)
    assert gen.token_ids == [ckpt.reference_greedy(ref, p, NEW_TOKENS) for p in prompts]
    if exe_mode == "ge_graph":
        stats = dataclasses.asdict(runner.step.report())
        assert stats["graphs"] == 1 and stats["recompiles"] == 0


# --------------------------------------------------------------------------- loading
def test_remap_stacks_experts_and_rejects_a_missing_one(checkpoints):
    runner = make_runner(checkpoints["mlp_only_layers"])
    hf = remap(read_checkpoint(checkpoints["mlp_only_layers"]))  # lazy sources (executor.loader)
    state = runner.remap_weights(dict(hf))
    gate_up = state["layers.0.mlp.experts_gate_up"]
    assert tuple(gate_up.shape) == (8, 64, 64)  # (E, 2I, H), I = 32, H = 64
    assert torch.equal(gate_up.read()[3], hf["layers.0.mlp.experts.3.gate_up_proj.weight"].read())
    down = state["layers.2.mlp.experts_down"].read()
    assert torch.equal(down[7], hf["layers.2.mlp.experts.7.down_proj.weight"].read())
    # a part read through the stack is that part of the expert tensors: experts 5..7, columns 8..16
    part = state["layers.2.mlp.experts_down"].read((((5, 8),), None, ((8, 16),)))
    assert torch.equal(part, down[5:8, :, 8:16])
    assert "layers.1.mlp.gate_up_proj.weight" in state and "layers.0.mlp.gate.weight" in state
    assert not any(".experts." in k for k in state)
    del hf["layers.2.mlp.experts.5.down_proj.weight"]
    with pytest.raises(LoadError, match=r"layers\.2\.mlp\.experts_down.*missing experts \[5\]"):
        runner.remap_weights(hf)


# --------------------------------------------------------------------------- compiled decode
@pytest.fixture(scope="module")
def eager_generation(checkpoints):
    return make_runner(checkpoints["mlp_only_layers"]).generate([PROMPT], NEW_TOKENS)


# Each plan's scopes on the mixed model (MoE layers 0 and 2, a dense MLP in layer 1): what the
# model's regions give, read before anything compiles.
PLAN_LABELS = {
    "attention": ["layer_0_attn", "layer_1_attn", "layer_2_attn"],
    "moe": ["layer_0_moe", "layer_2_moe"],  # only the MoE layers of the mixed model
    "mlp": ["layer_1_mlp"],
    "layer": ["layer_0", "layer_1", "layer_2"],
    "decoder": ["decode_layers"],
}


def test_every_plan_marks_the_mixed_models_regions(checkpoints):
    for plan, labels in PLAN_LABELS.items():
        runner = make_runner(
            checkpoints["mlp_only_layers"],
            "model_config.exe_mode=ge_graph",
            "model_config.enable_superkernel=true",
            f"model_config.superkernel.plan={plan}",
        )
        assert sorted(s.label for s in runner.plan.scopes) == labels, plan


# Compiled against eager: no scope, and the plans whose scopes hold the MoE block or the dense MLP
# (one launch unit per scope). The attention and layer plans' scopes hold the shared attention
# code, compiled per plan on the dense models (tests/test_graph_mode.py), and the MoE block
# outside a scope is the no-plan case here: each compile here costs ~25-30 s of the suite.
@pytest.mark.parametrize("plan", [None, "moe", "mlp", "decoder"])
def test_ge_graph_matches_eager(checkpoints, eager_generation, plan):
    sk = ["model_config.enable_superkernel=true", f"model_config.superkernel.plan={plan}"] if plan else []
    runner = make_runner(checkpoints["mlp_only_layers"], "model_config.exe_mode=ge_graph", *sk)
    gen = runner.generate([PROMPT], NEW_TOKENS)
    assert gen.token_ids == eager_generation.token_ids
    assert cosine(gen.last_logits, eager_generation.last_logits) > 0.9999
    stats = dataclasses.asdict(runner.step.report())
    assert stats["graphs"] == 1 and stats["recompiles"] == 0  # fullgraph, static shapes
    labels = PLAN_LABELS.get(plan, [])
    scopes = {s["label"]: s for s in stats["scopes"]}
    assert sorted(scopes) == labels
    for s in scopes.values():  # every scope really ran as one launch unit, each decode step
        assert s["segments"] == 1 and not s["cut_reasons"] and s["launches"] == NEW_TOKENS - 1


# --------------------------------------------------------------------------- end to end
def test_recipe_infer_sh_runs_the_builtin_moe_model(tmp_path):
    """The recipe's default YAML: the trained built-in checkpoint (models/qwen3_moe/builtin)."""
    proc = subprocess.run(
        [
            "bash",
            str(ROOT / "models" / "qwen3_moe" / "infer.sh"),
            "--set",
            "scheduler_config.max_new_tokens=4",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["recipe"] == "qwen3_moe" and metrics["model_type"] == "qwen3_moe"
    mc = metrics["config"]["model_config"]
    assert (mc["model_path"], mc["with_ckpt"]) == ("builtin", True)
    assert metrics["model_path"] == str(ROOT / "models" / "qwen3_moe" / "builtin")
    layers = json.loads((ROOT / "models" / "qwen3_moe" / "builtin" / "config.json").read_text())["num_hidden_layers"]
    assert len(metrics["generated_token_ids"][0]) == 4 and len(metrics["decode_ms"]) == 3
    assert [r for r in metrics["regions"] if r.endswith("_moe")] == [f"layer_{i}_moe" for i in range(layers)]
    assert "qwen3_moe inference time cost of decode is" in proc.stdout
