"""Tiny recipe configs shared by the tools tests (sk_compare, scope_search): a 1-layer model
(config.json only, seeded random weights) so a real compiled run costs seconds; and the
override lists of the multi-rank tests (SuperKernel modes, 2-rank layouts)."""

from __future__ import annotations

import json
from pathlib import Path

TINY_DENSE = {
    "model_type": "qwen3",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 256,
}
TINY_MOE = dict(
    TINY_DENSE,
    model_type="qwen3_moe",
    tie_word_embeddings=False,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
)

RECIPE_YAML = """\
# test recipe: a 1-layer model so that compiles stay short
model_config:
  model_name: "{name}"             # log name
  model_path: "{path}"             # config.json only: random weights
  exe_mode: "ge_graph"             # ["eager", "ge_graph", "npugraph_ex"]
  device: "cpu"
  enable_cache_compile: true       # one cache for the whole test session
  cache_dir: "{cache}"
  enable_superkernel: false        # the tools switch this on their copies only
  superkernel:
    plan: "attention"              # the configured plan
data_config:
  prompts:
    - "The weather today is"
  input_truncated_len: 16
scheduler_config:
  batch_size: 1
  max_new_tokens: 6
"""


def sk(plan: str) -> list[str]:
    """Overrides: ge_graph with SuperKernel plan `plan`."""
    return [
        "model_config.exe_mode=ge_graph",
        "model_config.enable_superkernel=true",
        f"model_config.superkernel.plan={plan}",
    ]


def world2(*sizes: str) -> list[str]:
    """Overrides: two ranks with the given `*_tp_size=N` layout keys."""
    return ["parallel_config.world_size=2", *(f"parallel_config.{s}" for s in sizes)]


# upstream's qwen3_8b_2tp layout: attention and lm_head split, embedding whole (the tiny qwen3
# ties them, so the two hold different blocks of one tensor)
DENSE_TP = world2("attn_tp_size=2", "lmhead_tp_size=2")
MOE_DP = world2("attn_tp_size=1", "moe_tp_size=1")  # attention DP 2 (a row each), EP 2 (4 experts each)


def tiny_model(root: Path, arch: dict) -> Path:
    """A checkpoint directory holding only config.json (with_ckpt false: seeded random weights)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(arch))
    return root


def recipe_config(path: Path, model_dir: Path, cache: Path, name: str = "qwen") -> Path:
    path.write_text(RECIPE_YAML.format(name=name, path=model_dir, cache=cache))
    return path
