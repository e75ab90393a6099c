"""Plain PyTorch reference implementations of every fused op the models use.

Each function has the exact semantics of its torch_npu counterpart (see
shared/reference/ascend-apis.md), so every path runs, and is tested, on CPU. Shapes use
B batch, S query length, T key length, Hq/Hkv query/kv heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from executor.memo import TensorMemo


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b, as nn.Linear. An op of the table, like the fused ones, so that a backend can give
    the projections another kernel without a hook on every torch call (executor.backends.eager_kernels)."""
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """npu_rms_norm(x, gamma, eps)[0]: normalise in fp32, cast back, then scale."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def kv_update(cache: torch.Tensor, new: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Write `new` (B, Hkv, S, D) into the static cache (B, Hkv, T, D) at `positions` (B, S), in
    place; returns the cache.

    Why index_put_ and not scatter_: in a compiled step the cache is a graph input, and Inductor
    keeps an index_put_ in place but turns a scatter_ on it into a copy of the whole cache that is
    written back after the step, so every decode step paid for max_len, not for the tokens it
    wrote (tools/op_analysis.py found it). The NPU table keeps a scatter (torchair has no GE
    converter for aten.index_put)."""
    b, h, s, _ = new.shape
    rows = torch.arange(b, device=new.device).view(b, 1, 1)
    heads = torch.arange(h, device=new.device).view(1, h, 1)
    return cache.index_put_((rows, heads, positions.view(b, 1, s)), new)  # indices broadcast to (B, Hkv, S)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """npu_add_rms_norm(x1, x2, gamma, eps) -> (y, x_sum): y = rms_norm(x1 + x2)."""
    x_sum = x + residual
    return rms_norm(x_sum, weight, eps), x_sum


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """npu_swiglu(x, dim=-1): the FIRST half is the gate: silu(a) * b."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_mul(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """npu_rotary_mul(x, cos, sin, rotary_mode='half'): x*cos + rotate_half(x)*sin."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Masked GQA attention. q (B, Hq, S, D); k, v (B, Hkv, T, D); mask (B, 1, S, T) bool,
    True = masked out (the NPU polarity). Returns (B, Hq, S, D). Softmax runs in fp32.

    Prefill (S > 1) goes to PyTorch's fused attention (SDPA), which tiles the scores with an
    online softmax: materialising them made a 2048-token prefill 2.3x slower than transformers'
    (BENCHMARKS.md). When the mask is the plain causal one (a prefill from slot 0: right padding
    never shows a real query a pad key), it is passed as `is_causal`, so the kernel skips the
    blocks above the diagonal instead of computing and masking them (2.6x faster in fp32 at 2048
    tokens). Decode (S = 1, the compiled step) keeps the explicit form, which Inductor fuses into
    the step's generated code."""
    b, hq, s, d = q.shape
    if s > 1:  # prefill: a fused kernel that never materialises the (S, T) scores
        if is_causal_mask(mask):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=~mask, scale=scale, enable_gqa=True)
    hkv, t = k.shape[1], k.shape[2]
    g = hq // hkv
    # The G query heads sharing a KV head are stacked as rows, (B, Hkv, G*S, D): each product is
    # one batched matmul against K and V as stored. Broadcasting K/V over a G axis instead makes
    # matmul copy them G times (the bulk of an eager decode step at long context).
    qg = q.reshape(b, hkv, g * s, d)
    scores = (torch.matmul(qg, k.transpose(-1, -2)) * scale).view(b, hkv, g, s, t)
    scores = scores.masked_fill(mask.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs.view(b, hkv, g * s, t), v).view(b, hq, s, d)


_CAUSAL: TensorMemo[bool] = TensorMemo()


def is_causal_mask(mask: torch.Tensor) -> bool:
    """True when every row of `mask` (B, 1, S, T) masks exactly the slots after its query: S == T
    and slot j > query i. Every layer of a forward passes the same mask, so the S x T comparison
    (~8 ms at 2048 tokens, and a device sync on a GPU) runs once per mask, not once per layer;
    an in-place change to the mask makes it run again (executor.memo)."""
    s, t = mask.shape[-2:]
    if s != t:
        return False

    def compare() -> bool:
        causal = torch.ones(s, t, dtype=torch.bool, device=mask.device).triu_(1)
        return torch.equal(mask, causal.expand_as(mask))

    return _CAUSAL.get(mask, compare)


def moe_gating_top_k_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """npu_moe_gating_top_k_softmax(x, k)[:2]: top-k of softmax(x) in fp32 -> (weights, expert ids).

    The weights are float32 whatever the logits' dtype (softmax in fp32, as HF's router). The
    fused op returns its weights in its input's dtype, so the NPU table hands it float32 logits:
    with bf16 logits it would round the weights to bf16 first, and an eager-vs-fused comparison
    would no longer be like for like."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, idx = torch.topk(probs, k, dim=-1)
    return weights, idx


def moe_init_routing(
    x: torch.Tensor, expert_idx: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """npu_moe_init_routing: stable-sort the N*k (token, expert) pairs by expert.

    x (N, H); expert_idx (N, k). Returns expanded_x (N*k, H) grouped by expert, the source
    token of each row (N*k,), and the per-expert row counts (E,) for grouped_matmul.
    """
    _n, k = expert_idx.shape
    flat = expert_idx.reshape(-1)
    order = torch.sort(flat, stable=True).indices  # (N*k,) positions in (token, slot) order
    token_of_row = order // k
    counts = torch.bincount(flat, minlength=num_experts)
    return x[token_of_row], order, counts


def grouped_matmul(x: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """npu_grouped_matmul(group_list_type=1): rows of x grouped by expert, y[s_e:e_e] = x[...] @ W[e].

    weights (E, K, N) in x @ W orientation; counts (E,) rows per expert. Data-dependent
    shapes: prefill/eager only, never inside the compiled decode step.
    """
    out = x.new_empty(x.shape[0], weights.shape[-1])
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            out[start : start + n] = x[start : start + n] @ weights[e]
            start += n
    return out
