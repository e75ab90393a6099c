"""Build tiny Qwen-family HuggingFace checkpoints on disk, fully offline.

Test helpers (import them, this is not a conftest; pyproject puts the repo root on the path)::

    from tests.checkpoints import make_qwen2_checkpoint

Each ``make_*_checkpoint(path, **overrides)`` writes, with transformers'
``save_pretrained``::

    config.json  model.safetensors  generation_config.json
    tokenizer.json  tokenizer_config.json      (the built-in 512-token tokenizer)

``overrides`` are config fields (``num_hidden_layers=3``, ``rope_theta=1e6``,
``vocab_size=...``); ``seed=`` and ``init_std=`` are taken out of them and
control the weights.  Everything is deterministic (``torch.manual_seed``).

Weights are deliberately *not* the transformers default init (std 0.02, unit
norms, zero biases), which gives near-uniform logits and degenerate greedy
output.  Instead every Linear/Embedding/expert weight is N(0, 0.2), every bias
N(0, 0.1) and every RMSNorm weight U(0.9, 1.1), so logits are peaked and greedy
decoding produces varied tokens.

Load the HuggingFace *reference* model for comparisons with::

    AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")

(or :func:`load_reference`).  In transformers 5.x ``dtype=`` is the argument;
``torch_dtype=`` still works but logs a deprecation warning.

transformers 5.x writes config.json in its own layout (``rope_parameters``
instead of ``rope_theta``, ``dtype`` instead of ``torch_dtype``, Qwen3-MoE
``num_local_experts`` instead of ``num_experts``).  Checkpoints on the Hub use
the older layout; :func:`to_hub_style_config` rewrites a config.json into it
so loaders can be tested against both.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

from executor.tokenizer import BUILTIN_TOKENIZER, ENDOFTEXT

#: id of <|endoftext|> in the built-in tokenizer (last id of the 512 vocab).
EOS_TOKEN_ID = 511

DEFAULT_SEED = 0
DEFAULT_INIT_STD = 0.2

_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    bos_token_id=EOS_TOKEN_ID,
    eos_token_id=EOS_TOKEN_ID,
    dtype="float32",
)

#: Qwen2: head_dim = hidden/heads = 16; q/k/v projections carry a bias.
QWEN2_CONFIG = dict(_COMMON, num_hidden_layers=2, tie_word_embeddings=False)

#: Qwen3: explicit head_dim 32 != hidden/heads (16); q_norm/k_norm; tied embeddings.
QWEN3_CONFIG = dict(_COMMON, num_hidden_layers=2, head_dim=32, attention_bias=False, tie_word_embeddings=True)

#: Qwen3-MoE: every layer sparse, 8 experts, top-2 with renormalised weights.
QWEN3_MOE_CONFIG = dict(
    _COMMON,
    num_hidden_layers=3,
    head_dim=32,
    attention_bias=False,
    tie_word_embeddings=False,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)


# ---------------------------------------------------------------------------
# weights


@torch.no_grad()
def _randomize(model: torch.nn.Module, std: float) -> None:
    """Large-ish random init so logits are peaked (see module docstring)."""
    for name, param in model.named_parameters():  # tied weights appear once
        if name.endswith("norm.weight"):  # input/post_attention/q/k/final RMSNorm
            param.uniform_(0.9, 1.1)
        elif name.endswith(".bias"):
            param.normal_(0.0, std / 2)
        else:  # Linear, Embedding, router, fused expert tensors
            param.normal_(0.0, std)


def _build(model_cls, config_cls, defaults: dict, path, overrides: dict) -> Path:
    from transformers import GenerationConfig

    overrides = dict(overrides)
    seed = overrides.pop("seed", DEFAULT_SEED)
    std = overrides.pop("init_std", DEFAULT_INIT_STD)
    if "torch_dtype" in overrides:  # accept the old spelling
        overrides["dtype"] = overrides.pop("torch_dtype")
    if "rope_parameters" in overrides:
        defaults = {k: v for k, v in defaults.items() if k != "rope_theta"}
    config = config_cls(**{**defaults, **overrides})

    torch.manual_seed(seed)
    model = model_cls(config)
    _randomize(model, std)
    model.eval()
    eos = config.eos_token_id
    bos = config.bos_token_id
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, do_sample=False)

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)  # always safetensors in transformers 5.x
    copy_tokenizer(path)
    return path


def make_qwen2_checkpoint(path, **overrides) -> Path:
    """Tiny Qwen2ForCausalLM (see :data:`QWEN2_CONFIG`) written to ``path``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _build(Qwen2ForCausalLM, Qwen2Config, QWEN2_CONFIG, path, overrides)


def make_qwen3_checkpoint(path, **overrides) -> Path:
    """Tiny Qwen3ForCausalLM (see :data:`QWEN3_CONFIG`) written to ``path``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _build(Qwen3ForCausalLM, Qwen3Config, QWEN3_CONFIG, path, overrides)


def make_qwen3_moe_checkpoint(path, **overrides) -> Path:
    """Tiny Qwen3MoeForCausalLM (see :data:`QWEN3_MOE_CONFIG`) written to ``path``.

    On disk the experts are per-expert tensors as on the Hub
    (``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight``, router
    ``model.layers.L.mlp.gate.weight``), although transformers 5.x holds them
    fused in memory.
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return _build(Qwen3MoeForCausalLM, Qwen3MoeConfig, QWEN3_MOE_CONFIG, path, overrides)


# ---------------------------------------------------------------------------
# files


def copy_tokenizer(path) -> Path:
    """Copy the built-in tokenizer.json (plus a minimal tokenizer_config.json) into ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(BUILTIN_TOKENIZER, path / "tokenizer.json")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": ENDOFTEXT,
        "pad_token": ENDOFTEXT,
        "model_max_length": 256,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return path / "tokenizer.json"


def _weights_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def shard_checkpoint(path, num_shards: int = 3) -> Path:
    """Re-save the checkpoint at ``path`` split into several safetensors shards.

    Writes ``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``
    and leaves no ``model.safetensors`` behind.  Returns the index path.
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    max_shard_size = max(_weights_bytes(path) // max(num_shards, 2), 1)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    single = path / "model.safetensors"
    if single.exists():  # transformers removes it; be sure
        single.unlink()
    index = path / "model.safetensors.index.json"
    shards = sorted(path.glob("model-*-of-*.safetensors"))
    if not index.is_file() or len(shards) < 2:
        raise RuntimeError(f"sharding {path} gave {len(shards)} shard(s); index present: {index.is_file()}")
    return index


def to_hub_style_config(path) -> Path:
    """Rewrite ``path``/config.json in the layout of pre-5.x / Hub checkpoints.

    ``rope_parameters`` -> ``rope_theta`` (+ ``rope_scaling`` when not the
    default rope), ``dtype`` -> ``torch_dtype``, ``num_local_experts`` ->
    ``num_experts``.  transformers 5.x still loads the result.
    """
    file = Path(path) / "config.json"
    cfg = json.loads(file.read_text())
    out = {}
    for key, value in cfg.items():
        if key == "rope_parameters" and isinstance(value, dict):
            rope = dict(value)
            out["rope_theta"] = rope.pop("rope_theta", 10000.0)
            if rope.get("rope_type", "default") != "default":
                out["rope_scaling"] = rope
            else:
                out["rope_scaling"] = None
        elif key == "dtype":
            out["torch_dtype"] = value
        elif key == "num_local_experts":
            out["num_experts"] = value
        else:
            out[key] = value
    file.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    return file


# ---------------------------------------------------------------------------
# reference model


def load_reference(path):
    """The HuggingFace model at ``path``: float32, eager attention, eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@torch.no_grad()
def reference_greedy(model, prompt_ids: Sequence[int], max_new_tokens: int = 16) -> list[int]:
    """Greedy continuation of ``prompt_ids`` by a HF model: full recompute each
    step, no KV cache, no stopping at eos.  Returns only the new tokens."""
    if not isinstance(model, torch.nn.Module):
        model = load_reference(model)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    new: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=ids, use_cache=False).logits[0, -1]
        nxt = int(torch.argmax(logits))
        new.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return new
