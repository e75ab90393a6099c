"""Model architecture from a checkpoint's config.json, or from a named debug size.

Why a typed object: model code reads `arch.num_kv_heads`, not `config.get(...)` with hidden
defaults; a missing required field or an unsupported feature (rope scaling, sliding window)
is an error naming the field rather than a silently different model.
"""

from __future__ import annotations

import json
import math
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


_MISSING = object()


def _json(value) -> str:
    return json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__


def _int(cfg: dict, key: str, where: str, default=_MISSING, minimum: int = 1) -> int:
    """An integer field (not a bool, not a string, not 64.0) of at least `minimum`."""
    value = cfg.get(key)
    if value is None:
        if default is _MISSING:
            raise ArchError(f"{where}: required field {key!r} is missing")
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArchError(f"{where}: {key} must be an integer, got {_json(value)}")
    if value < minimum:
        raise ArchError(f"{where}: {key} must be >= {minimum}, got {value}")
    return value


def _positive(cfg: dict, key: str, where: str, default: float) -> float:
    """A finite number > 0 (rms_norm_eps, rope_theta)."""
    value = cfg.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArchError(f"{where}: {key} must be a number, got {_json(value)}")
    if not math.isfinite(value) or value <= 0:
        raise ArchError(f"{where}: {key} must be a finite number > 0, got {value}")
    return float(value)


def _bool(cfg: dict, key: str, where: str, default: bool = False) -> bool:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ArchError(f"{where}: {key} must be true or false, got {_json(value)}")
    return value


def _eos(value, where: str) -> int | None:
    if value is None or value == []:
        return None
    first = value[0] if isinstance(value, list) else value
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise ArchError(f"{where}: eos_token_id must be a token id or a list of them, got {_json(value)}")
    return first


def arch_from_dict(cfg: dict, where: str) -> ModelArch:
    """Validate a config.json (or debug size) and build the ModelArch.

    Every field the model reads is checked here, once: integers are integers and at least 1,
    eps/theta are positive numbers, head counts divide, head_dim is even (half-rotation RoPE),
    the MoE top-k fits the expert count. A bad field is one line naming the file and field,
    not a traceback deep inside model construction."""
    if not isinstance(cfg, dict):
        raise ArchError(f"{where}: must be a JSON object of model fields, got {_json(cfg)}")
    mt = cfg.get("model_type")
    if mt not in DENSE_TYPES + MOE_TYPES:
        raise ArchError(f"{where}: model_type {mt!r} is not supported; supported: {', '.join(DENSE_TYPES + MOE_TYPES)}")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ArchError(f"{where}: rope_parameters / rope_scaling must be an object, got {_json(rope)}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ArchError(f"{where}: rope type {rope_type!r} is not supported yet; supported: default")
    if _bool(cfg, "use_sliding_window", where):
        raise ArchError(f"{where}: use_sliding_window=true is not supported yet")
    theta = _positive(rope, "rope_theta", where, _positive(cfg, "rope_theta", where, 10000.0))
    heads = _int(cfg, "num_attention_heads", where)
    hidden = _int(cfg, "hidden_size", where)
    layers = _int(cfg, "num_hidden_layers", where)
    is_qwen3 = mt in ("qwen3", "qwen3_moe")
    bias = _bool(cfg, "attention_bias", where)
    kv_heads = _int(cfg, "num_key_value_heads", where, default=heads)
    if heads % kv_heads:
        raise ArchError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if cfg.get("head_dim") is None and hidden % heads:
        raise ArchError(
            f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} (and no head_dim is given)"
        )
    head_dim = _int(cfg, "head_dim", where, default=hidden // heads)
    if head_dim % 2:
        raise ArchError(f"{where}: head_dim {head_dim} must be even (rotary embedding rotates half of it)")
    moe = mt in MOE_TYPES
    experts = top_k = moe_inter = 0
    if moe:
        experts_key = "num_experts" if cfg.get("num_experts") is not None else "num_local_experts"
        experts = _int(cfg, experts_key, where)
        top_k = _int(cfg, "num_experts_per_tok", where)
        if top_k > experts:
            raise ArchError(f"{where}: num_experts_per_tok {top_k} is more than {experts_key} {experts}")
        moe_inter = _int(cfg, "moe_intermediate_size", where)
    mlp_only = cfg.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or any(
        isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers for i in mlp_only
    ):
        raise ArchError(f"{where}: mlp_only_layers must be a list of layer indices 0..{layers - 1}, got {mlp_only}")
    return ModelArch(
        model_type=mt,
        vocab_size=_int(cfg, "vocab_size", where),
        hidden_size=hidden,
        intermediate_size=_int(cfg, "intermediate_size", where),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_positive(cfg, "rms_norm_eps", where, 1e-6),
        rope_theta=theta,
        max_position_embeddings=_int(cfg, "max_position_embeddings", where, default=32768),
        tie_word_embeddings=_bool(cfg, "tie_word_embeddings", where),
        qkv_bias=bias if is_qwen3 else True,
        o_bias=bias if is_qwen3 else False,
        qk_norm=is_qwen3,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe_inter,
        norm_topk_prob=_bool(cfg, "norm_topk_prob", where),
        decoder_sparse_step=_int(cfg, "decoder_sparse_step", where, default=1),
        mlp_only_layers=tuple(mlp_only),
        eos_token_id=_eos(cfg.get("eos_token_id"), where),
        source=where,
    )


def load_arch(model_path: str, debug_size: str) -> ModelArch:
    """config.json of `model_path` when set, else the named debug size."""
    if model_path:
        root = Path(model_path)
        if root.exists() and not root.is_dir():
            raise ArchError(
                f"model_config.model_path {model_path}: is a file, not a checkpoint directory (one holding config.json)"
            )
        path = root / "config.json"
        if path.is_dir():
            raise ArchError(f"{path}: is a directory, not the checkpoint's config.json file")
        if not path.is_file():
            raise ArchError(f"{path}: checkpoint config.json not found (model_config.model_path={model_path!r})")
        try:
            cfg = json.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ArchError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
        except json.JSONDecodeError as exc:
            raise ArchError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        except OSError as exc:
            raise ArchError(f"{path}: cannot be read ({exc.strerror})") from None
        return arch_from_dict(cfg, str(path))
    return arch_from_dict(named_size(debug_size), f"{MODEL_SIZES.name}:{debug_size}")


def named_size(name: str, key: str = "model_config.debug_size") -> dict:
    """The config.json fields of a named size in configs/model_sizes.yaml; `key` is what the user
    set it with, for the error."""
    sizes = yaml.safe_load(MODEL_SIZES.read_text())
    if name not in sizes:
        raise ArchError(f"{key}: {name!r} is not a named size; allowed values: {', '.join(sizes)}")
    return dict(sizes[name])
