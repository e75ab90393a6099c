"""`cann::decode_attention`: decode attention that reads only the valid part of the static KV cache.

Why: executor.ops.attention (the reference, and FusedInferAttentionScore without lengths on NPU)
attends over all T slots of the static cache with a mask, so a decode step at position p costs
what max_len says, not what the p + 1 cached tokens say. This op has the same contract (q
(B, Hq, S, D), the full caches (B, Hkv, T, D), mask (B, 1, S, T) bool True = masked out, scale)
and skips every slot after a row's last unmasked one:

- CPU: C++ kernel (csrc/decode_attention.cpp), parallel over (batch, kv head, query row), fp32
  accumulation, fp32/bf16/fp16 inputs; built on first use (executor/custom_ops/_build.py);
- NPU: FusedInferAttentionScore with `actual_seq_lengths_kv` (executor/backends/npu_decode_attention.py:
  the PrivateUse1 kernel for eager, the torchair GE converter for ge_graph);
- tracing: the fake impl below, so dynamo records one opaque node (no graph break), which lands
  inside a SuperKernel scope and is called from Inductor's C++ wrapper on CPU.

In the op table it replaces "attention" for decode (one query row); prefill (S > 1) keeps the
base table's batched attention, which suits many query rows better.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from executor.custom_ops import CustomOp

SCHEMA = "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor mask, float scale) -> Tensor"

_lib = torch.library.Library("cann", "FRAGMENT")  # FRAGMENT: every custom op module adds to namespace cann
_lib.define(SCHEMA)


@torch.library.register_fake("cann::decode_attention")
def _fake(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor, scale: float):
    """Output metadata for tracing: a new contiguous tensor shaped and typed like q (as the kernels return)."""
    torch._check(q.dim() == 4 and k_cache.dim() == 4 and mask.dim() == 4, lambda: "decode_attention: 4-D inputs")
    torch._check(q.shape[1] % k_cache.shape[1] == 0, lambda: "decode_attention: Hq must be a multiple of Hkv")
    return q.new_empty(q.shape)


def entry(base: Callable) -> Callable:
    """The op-table "attention" with this op for decode; `base` (the backend table's) for prefill."""

    def attention(q, k_cache, v_cache, mask, scale):
        if q.shape[2] != 1:  # prefill: S query rows; a static shape, so dynamo resolves this once
            return base(q, k_cache, v_cache, mask, scale)
        return torch.ops.cann.decode_attention(q, k_cache, v_cache, mask, scale)

    return attention


OP = CustomOp(
    name="decode_attention",
    qualname="cann::decode_attention",
    replaces="attention",
    entry=entry,
    sources=("decode_attention.cpp",),
    npu="executor.backends.npu_decode_attention",
    summary="decode attention over the valid KV-cache slots only (cost follows the position, not max_len)",
    # Chosen by default on CPU once a kv head's cache holds this many values (slots x head_dim): 128
    # slots at head_dim 128 (Qwen2.5-1.5B and up, Qwen3), 256 at 64 (the built-in model), 512 at 32
    # (the debugmodel and bench-overhead sizes). Below it the op's fixed cost (~10 us a call) and
    # its extern call, which splits the layer's fused kernel, cost more than the skipped slots save. Speed-up of the
    # 0.6B-shape (head_dim 128) step with the op, nearly full cache, paired rounds (AVX-512 host;
    # BENCHMARKS.md, "sixty-seventh pass"): at 128 slots 0.99-1.04x fp32 batch 1, 16 and 64, 1.05x
    # bf16 batch 4; at 64 slots 0.97-1.06x. At head_dim 64 (Qwen2.5-0.5B's shape) and 256 slots
    # level (0.99-1.01x). At head_dim 32 and 128 slots the op cost: 0.81x SK decoder, 0.88x ge_graph
    # at batch 16. The rule was 512 slots at any head_dim until the op read its rows in address
    # order ("sixteenth", "seventeenth", "twenty-second" and "sixty-sixth pass"); rows are not
    # counted (at 64 slots, batch 4-64 were level on the AVX2 host, "twenty-third pass").
    auto_min_kv_values=128 * 128,
    # On the Intel AMX kind at head_dim 128 the op paid from the shortest cache measured, 33 slots
    # (the 0.6B bf16 step with the op, paired rounds in one process, 6-10 rounds): ge_graph 0.864x
    # and 0.893x at batch 1 (every round faster), level at 4 (0.999x), 0.983x at 16, 0.962x at 64;
    # SK decoder 0.997x at 1, 0.993x at 4, 0.962x at 16, 0.950x at 64 (BENCHMARKS.md,
    # "seventy-fourth pass"). In fp32 it was mixed there (ge_graph 1.027x at batch 1 and 0.972x at
    # 16, SK decoder 0.983x and 1.016x), so fp32 keeps the rule above, as do narrower heads
    # (unmeasured there).
    amx_min_slots=32,
    # In eager nothing is fused to split: at 64 slots the eager 0.6B step took 0.87x (bf16 batch 1),
    # 0.85x / 0.86x (bf16 batch 16 / 64) and 0.89x (fp32 batch 16) the time with the op, where the
    # reference ran two bmm calls of ~280 us per layer at batch 16 (AVX-512 host; "twenty-seventh
    # pass"; unmeasured on the AVX2 and AMX hosts).
    auto_in_eager=True,
)
