"""NPU half of the custom op `cann::decode_attention` (executor/custom_ops/decode_attention.py).

On Ascend the op is FusedInferAttentionScore told each batch row's valid KV length
(`actual_seq_lengths_kv`), so the kernel reads only those slots of the static cache, where
executor.ops.attention's NPU table entry hands it the whole cache and a mask. The valid length
of row b is its last unmasked slot + 1 (over its query rows), the same slots the CPU kernel
reads; the mask still goes in, so a mask with holes stays exact.

- eager (PrivateUse1 kernel): torch_npu's binding takes the lengths as host ints (SymInt[]), so
  they are read back from the mask once per call;
- ge_graph (torchair GE converter): the lengths are computed in the graph from the mask
  (LogicalNot -> Cast -> Mul by slot numbers 1..T -> ReduceMax), an int64 tensor input of
  FusedInferAttentionScore, the form torchair's own tensor-length FIA op emits
  (torchair/ops/_npu_fused_infer_attention_score.py): no host round trip, one static graph.
- npugraph_ex is refused: its aclgraph capture runs the eager kernel, and a capture cannot read
  values back to the host.

Lives in executor/backends/ because only this directory imports torch_npu/torchair (both are
handed in by the adapter, executor.backends.npu.custom_op_installer). `register` runs once per
process.
"""

from __future__ import annotations

import functools
import importlib

import torch

from executor.backends.npu import INT32_MAX, fused_infer_attention

MODES = ("eager", "ge_graph")
WHY_NOT = {
    "npugraph_ex": "an aclgraph capture cannot read the valid lengths back to the host, which its eager kernel does"
}

_registered: list[torch.library.Library] = []


def kv_lengths(mask: torch.Tensor) -> torch.Tensor:
    """(B,) int64: per batch row, the last unmasked slot + 1 over all its query rows (0 if none).
    mask (B, 1, S, T) bool, True = masked out."""
    slots = torch.arange(1, mask.shape[-1] + 1, device=mask.device)  # slot t -> t + 1
    return ((~mask).long() * slots).amax(dim=(1, 2, 3))


def fused_attention(tnpu, q, k_cache, v_cache, mask, scale):
    """The PrivateUse1 kernel (eager on NPU): the attention op-table entry's FIA call, told the
    valid lengths (host ints: the eager binding's SymInt[])."""
    return fused_infer_attention(
        tnpu, q, k_cache, v_cache, mask, scale, actual_seq_lengths_kv=kv_lengths(mask).tolist()
    )


def register(tnpu, torchair) -> None:
    """Register the PrivateUse1 kernel and the torchair GE converter of cann::decode_attention (once)."""
    if _registered:
        return
    importlib.import_module("executor.custom_ops.decode_attention")  # defines the schema and fake impl
    lib = torch.library.Library("cann", "FRAGMENT")
    lib.impl("decode_attention", functools.partial(fused_attention, tnpu), "PrivateUse1")
    _register_converter(torchair)
    _registered.append(lib)


def _register_converter(torchair) -> None:
    ge = importlib.import_module("torchair.ge")  # Const, DataType: torchair's public GE API
    ge_ops = importlib.import_module("torchair._ge_concrete_graph.ge_apis")  # every GE op, as torchair's converters use

    @torchair.register_fx_node_ge_converter(torch.ops.cann.decode_attention.default)
    def convert_decode_attention(q, k_cache, v_cache, mask, scale, meta_outputs=None):
        """FX node cann.decode_attention -> FusedInferAttentionScore with in-graph actual_seq_lengths_kv."""
        t = k_cache.symsize[2]
        valid = ge.Cast(ge_ops.LogicalNot(mask), dst_type=ge.DataType.DT_INT64)  # (B, 1, S, T) 1 = attend
        numbered = ge_ops.Mul(valid, ge.Const(list(range(1, t + 1)), dtype=ge.DataType.DT_INT64))
        lengths = ge_ops.ReduceMax(numbered, ge.Const([1, 2, 3], dtype=ge.DataType.DT_INT64), keep_dims=False)  # (B,)
        out, _lse = ge_ops.FusedInferAttentionScore(
            q,
            [k_cache],
            [v_cache],
            pse_shift=None,
            atten_mask=mask,
            actual_seq_lengths=None,
            actual_seq_lengths_kv=lengths,
            **{name: None for name in _UNUSED_FIA_INPUTS},
            num_heads=q.symsize[1],
            scale=scale,
            input_layout="BNSD",
            num_key_value_heads=k_cache.symsize[1],
            sparse_mode=0,
            pre_tokens=INT32_MAX,
            next_tokens=INT32_MAX,
        )
        return out


# FusedInferAttentionScore's optional inputs this op leaves unfed (quantisation, paging, prefixes, rope split)
_UNUSED_FIA_INPUTS = (
    "dequant_scale1",
    "quant_scale1",
    "dequant_scale2",
    "quant_scale2",
    "quant_offset2",
    "antiquant_scale",
    "antiquant_offset",
    "block_table",
    "query_padding_size",
    "kv_padding_size",
    "key_antiquant_scale",
    "key_antiquant_offset",
    "value_antiquant_scale",
    "value_antiquant_offset",
    "key_shared_prefix",
    "value_shared_prefix",
    "actual_shared_prefix_len",
    "query_rope",
    "key_rope",
    "key_rope_antiquant_scale",
    "dequant_scale_query",
    "learnable_sink",
    "q_start_idx",
    "kv_start_idx",
)
