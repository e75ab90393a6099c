"""Qwen2 / Qwen2.5 / Qwen3 dense decoder, written once for all three.

Architecture differences come from the checkpoint (`ModelArch`): q/k/v bias (Qwen2), per-head
q/k RMSNorm and optional o_proj bias (Qwen3), explicit head_dim, tied embeddings. Fused ops
come from `executor.ops` and scopes from `ctx.scopes`: no device or execution-mode branches here.
Multi-device runs change only which executor layers hold which part of each weight: the model
is built with the run's `Parallel` (executor.parallel), whose groups are all of size one on a
single device, where every parallel layer is the plain torch layer.

SuperKernel regions (see executor.scope): `decode_layers` (all layers), `layer_{i}`,
`layer_{i}_attn`, `layer_{i}_mlp`. The runner's scope plan decides which are opened.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from executor import ops
from executor.arch import ModelArch
from executor.kv_cache import KVCache
from executor.parallel.groups import NO_SHARD, SINGLE_DEVICE, Parallel, Shard
from executor.parallel.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    tie_embeddings,
)
from executor.scope import Region, ScopeRunner, decoder_regions


@dataclass
class ForwardContext:
    """Per-call inputs shared by every layer (built once per forward by the model)."""

    positions: torch.Tensor  # (B, S) absolute position of each input token
    cache: KVCache
    scopes: ScopeRunner
    cos: torch.Tensor | None = None  # (B, 1, S, D)
    sin: torch.Tensor | None = None
    mask: torch.Tensor | None = None  # (B, 1, S, T) bool, True = masked out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """GQA attention; with attention TP this rank's heads (and their KV heads), o_proj all-reduced."""

    def __init__(self, arch: ModelArch, layer: int, shard: Shard = NO_SHARD):
        super().__init__()
        self.layer, self.d = layer, arch.head_dim
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size, arch.num_heads, arch.num_kv_heads, self.d, arch.qkv_bias, shard
        )
        self.h, self.hkv = self.qkv_proj.heads, self.qkv_proj.kv_heads  # this rank's
        self.o_proj = RowParallelLinear(arch.num_heads * self.d, arch.hidden_size, arch.o_bias, shard)
        self.q_norm = RMSNorm(self.d, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.d, arch.rms_norm_eps) if arch.qk_norm else None
        self.scale = self.d**-0.5

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv_proj(x).split([self.h * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q, k, v = q.view(b, s, self.h, self.d), k.view(b, s, self.hkv, self.d), v.view(b, s, self.hkv, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = ops.rotary_mul(q.transpose(1, 2), ctx.cos, ctx.sin)  # (B, Hq, S, D)
        k = ops.rotary_mul(k.transpose(1, 2), ctx.cos, ctx.sin)  # (B, Hkv, S, D)
        k_all, v_all = ctx.cache.update(self.layer, k, v.transpose(1, 2), ctx.positions)
        out = ops.attention(q, k_all, v_all, ctx.mask, self.scale)  # (B, Hq, S, D)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.h * self.d))


class MLP(nn.Module):
    """SwiGLU MLP: gate/up column-parallel, down row-parallel (all-reduced) over `shard`'s group;
    when that group spans attention data parallel groups, their tokens are gathered first."""

    def __init__(self, hidden: int, intermediate: int, shard: Shard = NO_SHARD):
        super().__init__()
        self.shard = shard
        self.gate_up_proj = MergedColumnParallelLinear(hidden, intermediate, shard)  # [gate; up]
        self.down_proj = RowParallelLinear(intermediate, hidden, False, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.shard.gather_rows(x)
        return self.shard.own_rows(self.down_proj(ops.swiglu(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    """Pre-norm block. `ffn` is the MLP (dense) or an MoE block; `ffn_kind` names its region."""

    def __init__(self, arch: ModelArch, layer: int, ffn: nn.Module, ffn_kind: str = "mlp", attn: Shard = NO_SHARD):
        super().__init__()
        self.layer, self.ffn_kind = layer, ffn_kind
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, layer, attn)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = ffn

    def forward(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        i = self.layer
        with ctx.scopes.region(f"layer_{i}"):
            with ctx.scopes.region(f"layer_{i}_attn"):
                attn = self.self_attn(self.input_layernorm(h), ctx)
            with ctx.scopes.region(f"layer_{i}_{self.ffn_kind}"):
                norm = self.post_attention_layernorm
                x, h = ops.add_rms_norm(attn, h, norm.weight, norm.eps)
                h = h + self.mlp(x)
        return h


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (B, 1, S, D) for half-rotation RoPE, computed in fp32 like HF."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.float().unsqueeze(-1) * inv_freq  # (B, S, D/2)
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # (B, 1, S, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class QwenForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch, parallel: Parallel = SINGLE_DEVICE, layers: list[nn.Module] | None = None):
        super().__init__()
        self.arch = arch
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, parallel.embed)
        self.layers = nn.ModuleList(
            layers
            if layers is not None
            else [
                DecoderLayer(arch, i, MLP(arch.hidden_size, arch.intermediate_size, parallel.dense), attn=parallel.attn)
                for i in range(arch.num_layers)
            ]
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = ParallelLMHead(arch.hidden_size, arch.vocab_size, parallel.lmhead)
        if arch.tie_word_embeddings:
            tie_embeddings(self.lm_head, self.embed_tokens)

    def tied_weights(self) -> dict[str, str]:
        """Parameters the checkpoint stores once, as {ours: the tensor to fill it from}."""
        return {"lm_head.weight": "embed_tokens.weight"} if self.arch.tie_word_embeddings else {}

    def regions(self) -> list[Region]:
        return decoder_regions(len(self.layers), [layer.ffn_kind for layer in self.layers])

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, scopes: ScopeRunner
    ) -> torch.Tensor:
        """input_ids, positions (B, S) -> final hidden states (B, S, H); writes the cache."""
        h = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.arch.head_dim, self.arch.rope_theta, h.dtype)
        slots = torch.arange(cache.max_len, device=positions.device)
        mask = slots.view(1, 1, 1, -1) > positions.unsqueeze(1).unsqueeze(-1)  # (B, 1, S, T)
        ctx = ForwardContext(positions, cache, scopes, cos, sin, mask)
        with scopes.region("decode_layers"):
            for layer in self.layers:
                h = scopes.tap(f"layer_{layer.layer}", layer(h, ctx))
        return self.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def build_model(arch: ModelArch, parallel: Parallel = SINGLE_DEVICE) -> QwenForCausalLM:
    if arch.num_experts:
        raise ValueError(f"{arch.source}: {arch.model_type} is a MoE model; use the qwen3_moe recipe")
    return QwenForCausalLM(arch, parallel)
