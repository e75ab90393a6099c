"""Checkpoint loading: HF safetensors (single or sharded) -> our module names, strictly.

Why a mapping table: our layers fuse q/k/v into one `qkv_proj` and gate/up into one
`gate_up_proj` (one matmul each in decode, and the layout npu_swiglu expects). The table
says how HF tensors stack into them, so model code never handles checkpoint names. Every
parameter must be loaded and every checkpoint tensor consumed: a partial load is an error,
never random weights in disguise.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from executor.errors import RecipeError

# fused name -> HF parts, concatenated along dim 0 in this order
STACKED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LoadError(RecipeError):
    """A checkpoint problem, naming the file or tensor."""


def checkpoint_files(model_path: str | Path) -> list[Path]:
    root = Path(model_path)
    if not root.is_dir():
        raise LoadError(f"{root}: checkpoint directory not found")
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise LoadError(f"{index}: not a valid safetensors index ({exc.__class__.__name__})") from None
        files = [root / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise LoadError(f"{index}: shard {missing[0]} is missing")
        return files
    single = root / "model.safetensors"
    if single.is_file():
        return [single]
    raise LoadError(
        f"{root}: no model.safetensors or model.safetensors.index.json (only safetensors checkpoints are supported)"
    )


def read_checkpoint(model_path: str | Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(model_path):
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise LoadError(f"{f}: cannot read safetensors file ({str(exc).splitlines()[0][:120]})") from None
    return tensors


def remap(hf: dict[str, torch.Tensor], stacked: dict[str, tuple[str, ...]] = STACKED) -> dict[str, torch.Tensor]:
    """HF names -> ours: drop the `model.` prefix and stack the parts of fused projections."""
    out: dict[str, torch.Tensor] = {}
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in hf.items():
        if name.endswith(IGNORED_SUFFIXES):
            continue
        name = name.removeprefix("model.")
        for fused, parts in stacked.items():
            hit = next((j for j, p in enumerate(parts) if f".{p}." in name), None)
            if hit is not None:
                pending.setdefault(name.replace(f".{parts[hit]}.", f".{fused}."), {})[hit] = tensor
                break
        else:
            out[name] = tensor
    for name, parts in pending.items():
        fused = next(f for f in stacked if f".{f}." in name)
        if len(parts) != len(stacked[fused]):
            missing = [p for j, p in enumerate(stacked[fused]) if j not in parts]
            raise LoadError(f"checkpoint has {name.replace(fused, '*')} without {', '.join(missing)}")
        out[name] = torch.cat([parts[j] for j in range(len(parts))], dim=0)
    return out


def load_weights(
    model: torch.nn.Module,
    model_path: str | Path,
    dtype: torch.dtype,
    extra_remap: Callable[[dict], dict] | None = None,
) -> None:
    """Load a checkpoint into `model` in place; any missing/unexpected/mis-shaped tensor is an error."""
    state = remap(read_checkpoint(model_path))
    if extra_remap is not None:
        state = extra_remap(state)
    own = model.state_dict()
    tied = "lm_head.weight" in own and own["lm_head.weight"].data_ptr() == own["embed_tokens.weight"].data_ptr()
    if tied and "lm_head.weight" not in state and "embed_tokens.weight" in state:
        state["lm_head.weight"] = state["embed_tokens.weight"]  # tied embeddings are saved once
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise LoadError(f"{model_path}: checkpoint does not match the model architecture: {what}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise LoadError(
                f"{model_path}: tensor {name} has shape {tuple(tensor.shape)}, model expects {tuple(own[name].shape)}"
            )
    with torch.no_grad():
        for name, param in model.state_dict(keep_vars=True).items():
            param.copy_(state[name].to(dtype))


def init_random(model: torch.nn.Module, seed: int, std: float = 0.1) -> None:
    """Deterministic random weights (with_ckpt: false): normal linears/embeddings, unit norms.

    std 0.1 (not HF's 0.02) so a random debug model's logits are peaked enough that greedy
    decoding does not repeat one token forever, which makes token-level checks meaningful."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
