"""Model architecture from a checkpoint's config.json, or from a named debug size.

Why a typed object: model code reads `arch.num_kv_heads`, not `config.get(...)` with hidden
defaults; a missing required field or an unsupported feature (rope scaling, sliding window)
is an error naming the field rather than a silently different model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from executor.errors import RecipeError
from executor.paths import CONFIGS_DIR

MODEL_SIZES = CONFIGS_DIR / "model_sizes.yaml"
DENSE_TYPES = ("qwen2", "qwen3")
MOE_TYPES = ("qwen3_moe",)


class ArchError(RecipeError):
    """config.json / debug size problem, naming the file and field."""


@dataclass(frozen=True)
class ModelArch:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2: always; Qwen3: attention_bias
    o_bias: bool  # Qwen3 only, with attention_bias
    qk_norm: bool  # Qwen3 per-head RMSNorm on q and k
    # MoE (Qwen3-MoE); num_experts == 0 means dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    eos_token_id: int | None = None
    source: str = ""  # where it came from, for logs/metrics

    def is_moe_layer(self, i: int) -> bool:
        """Qwen3-MoE's rule: MoE unless listed in mlp_only_layers or off the sparse step."""
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def weight_bytes(self, dtype_bytes: int) -> int:
        """Bytes of weights one decode step reads: every layer (MoE: the router and only the k
        chosen experts) and the lm_head; of the embedding table only one row per token."""
        d, h = self.head_dim, self.hidden_size
        attn = h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h
        total = self.vocab_size * h  # lm_head (tied or not); embedding rows are negligible
        for i in range(self.num_layers):
            ffn = (
                3 * h * self.moe_intermediate_size * self.num_experts_per_tok + h * self.num_experts
                if self.is_moe_layer(i)
                else 3 * h * self.intermediate_size
            )
            total += attn + ffn
        return total * dtype_bytes


def _get(cfg: dict, key: str, where: str, default=None, required=True):
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if required and default is None:
        raise ArchError(f"{where}: required field {key!r} is missing")
    return default


def arch_from_dict(cfg: dict, where: str) -> ModelArch:
    mt = cfg.get("model_type")
    if mt not in DENSE_TYPES + MOE_TYPES:
        raise ArchError(f"{where}: model_type {mt!r} is not supported; supported: {', '.join(DENSE_TYPES + MOE_TYPES)}")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ArchError(f"{where}: rope type {rope_type!r} is not supported yet; supported: default")
    if cfg.get("use_sliding_window"):
        raise ArchError(f"{where}: use_sliding_window=true is not supported yet")
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    heads = _get(cfg, "num_attention_heads", where)
    hidden = _get(cfg, "hidden_size", where)
    eos = cfg.get("eos_token_id")
    is_qwen3 = mt in ("qwen3", "qwen3_moe")
    bias = bool(cfg.get("attention_bias", False))
    kv_heads = _get(cfg, "num_key_value_heads", where, default=heads, required=False)
    if heads % kv_heads:
        raise ArchError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    moe = mt in MOE_TYPES
    return ModelArch(
        model_type=mt,
        vocab_size=_get(cfg, "vocab_size", where),
        hidden_size=hidden,
        intermediate_size=_get(cfg, "intermediate_size", where),
        num_layers=_get(cfg, "num_hidden_layers", where),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=_get(cfg, "head_dim", where, default=hidden // heads, required=False),
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", where, default=1e-6, required=False)),
        rope_theta=float(theta),
        max_position_embeddings=_get(cfg, "max_position_embeddings", where, default=32768, required=False),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bias if is_qwen3 else True,
        o_bias=bias if is_qwen3 else False,
        qk_norm=is_qwen3,
        num_experts=(cfg.get("num_experts") or _get(cfg, "num_local_experts", where)) if moe else 0,
        num_experts_per_tok=_get(cfg, "num_experts_per_tok", where) if moe else 0,
        moe_intermediate_size=_get(cfg, "moe_intermediate_size", where) if moe else 0,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1) or 1),
        mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        eos_token_id=eos[0] if isinstance(eos, list) and eos else eos,
        source=where,
    )


def load_arch(model_path: str, debug_size: str) -> ModelArch:
    """config.json of `model_path` when set, else the named debug size."""
    if model_path:
        path = Path(model_path) / "config.json"
        if not path.is_file():
            raise ArchError(f"{path}: checkpoint config.json not found (model_config.model_path={model_path!r})")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ArchError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        return arch_from_dict(cfg, str(path))
    sizes = yaml.safe_load(MODEL_SIZES.read_text())
    if debug_size not in sizes:
        raise ArchError(
            f"model_config.debug_size: {debug_size!r} is not a named size; allowed values: {', '.join(sizes)}"
        )
    return arch_from_dict(sizes[debug_size], f"{MODEL_SIZES.name}:{debug_size}")
