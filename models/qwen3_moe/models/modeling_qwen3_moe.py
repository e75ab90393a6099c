"""Qwen3-MoE: the Qwen3 decoder of the qwen recipe with sparse MoE blocks in place of the MLP.

Everything but the MoE block is imported from models.qwen (norms, attention, dense MLP,
decoder layer, causal LM); this file only adds `SparseMoeBlock` and `build_model`. Which
layers are sparse follows the checkpoint (`arch.is_moe_layer`: mlp_only_layers and
decoder_sparse_step), so dense and MoE layers can be mixed.

SuperKernel regions: `decode_layers`, `layer_{i}`, `layer_{i}_attn`, and `layer_{i}_moe` on MoE
layers or `layer_{i}_mlp` on dense ones, so plan `moe` wraps only the MoE blocks.

On several devices each rank holds some experts (executor.parallel.experts.ExpertShard: expert
parallel, moe TP), runs them on the tokens of every attention data parallel group and the
partial outputs are summed; the router is replicated. On one device the shard holds every
expert and each of its helpers is the single-device computation.
"""

from __future__ import annotations

import torch
from torch import nn

from executor import ops
from executor.arch import ModelArch
from executor.parallel.experts import ExpertShard
from executor.parallel.groups import SINGLE_DEVICE, Parallel
from models.qwen.models.modeling_qwen import MLP, DecoderLayer, QwenForCausalLM


class SparseMoeBlock(nn.Module):
    """Router (softmax over experts, top-k, optional renormalisation) + SwiGLU experts.

    Expert weights are stored stacked, one tensor per projection, so one layer's experts can
    be indexed by the router's output without Python loops:
    `experts_gate_up` (E, 2I, H) holds [gate; up] per expert (the layout ops.swiglu splits),
    `experts_down` (E, H, I). Both are in nn.Linear orientation (out, in), like the checkpoint.

    With expert parallelism the tensors hold this rank's E_local experts (and its slice of each
    expert's intermediate dimension); `self.experts` (ExpertShard) restricts the routing to them.
    Three formulations of the same function. Traced (the compiled decode step), the choice is a
    *static* shape test (token count and query length are Python ints under torch.compile, so it
    never recompiles); run eagerly (eager mode, prefill), routing-dependent shapes cost nothing
    and the grouped one always wins, because it reads each chosen expert's weights in place:
    - gathered (traced, N*k <= E_local, i.e. decode at small batch): gather only the k chosen experts'
      weights per token and run batched mat-vecs. Static shapes, so the compiled decode step
      stays one graph, and it reads k experts, not E: what makes batch-1 decode fast. Inductor
      fuses the gather into the mat-vec; eagerly it would first copy N*k experts' weights.
    - dense (traced, N*k > E: decode at large batch): every expert on every token, weighted
      by a (N, E) combine matrix that is zero off the top-k. Still static shapes; it reads
      each expert once, which is less memory traffic than gathering N*k > E expert copies.
    - grouped (eager, or S > 1): ops.moe_init_routing sorts the (token, expert) pairs by expert
      and ops.grouped_matmul runs one matmul per expert hit, on views of its weights. Its shapes
      depend on the routing, so it never runs inside the compiled decode step.
    """

    def __init__(self, arch: ModelArch, parallel: Parallel = SINGLE_DEVICE):
        super().__init__()
        self.num_experts, self.top_k = arch.num_experts, arch.num_experts_per_tok
        self.norm_topk_prob = arch.norm_topk_prob
        h, i = arch.hidden_size, arch.moe_intermediate_size
        self.gate = nn.Linear(h, self.num_experts, bias=False)  # router (replicated)
        self.experts = ExpertShard(self.num_experts, i, h, parallel)
        self.experts_gate_up = self.experts.gate_up_weight()  # (E_local, 2I, H)
        self.experts_down = self.experts.down_weight()  # (E_local, H, I)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, H) -> top-k weights (N, k) in x's dtype and expert ids (N, k).

        Same order of ops and casts as transformers' Qwen3MoeTopKRouter: softmax and the
        renormalisation in fp32, then one cast to the hidden dtype."""
        logits = self.gate(x)  # (N, E)
        weights, idx = ops.moe_gating_top_k_softmax(logits, self.top_k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.experts.gather(x)  # (B, S, H): the tokens of every attention-DP group (this rank's on one device)
        b, s, h = x.shape
        flat = x.reshape(b * s, h)  # (N, H)
        weights, idx = self.route(flat)
        if s > 1 or not torch.compiler.is_compiling():
            out = self._grouped(flat, weights, idx)
        elif flat.shape[0] * self.top_k <= self.experts.num_local:
            out = self._gathered(flat, weights, idx)
        else:
            out = self._dense(flat, weights, idx)
        return self.experts.combine(out.view(b, s, h))  # summed over the ranks' experts, this rank's rows

    @staticmethod
    def _weighted_sum(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """y (N, X, H) expert outputs, weights (N, X) -> (N, H), in the hidden dtype like HF."""
        return (y * weights.unsqueeze(-1)).sum(dim=1)

    def _gathered(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        weights, idx = self.experts.local_choices(weights, idx)
        gate_up = self.experts_gate_up[idx]  # (N, k, 2I, H)
        act = ops.swiglu(torch.matmul(gate_up, x[:, None, :, None]).squeeze(-1))  # (N, k, I)
        down = self.experts_down[idx]  # (N, k, H, I)
        y = torch.matmul(down, act.unsqueeze(-1)).squeeze(-1)  # (N, k, H)
        return self._weighted_sum(y, weights)

    def _dense(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        act = ops.swiglu(torch.einsum("nh,eoh->neo", x, self.experts_gate_up))  # (N, E, I)
        y = torch.einsum("nei,ehi->neh", act, self.experts_down)  # (N, E, H)
        return self._weighted_sum(y, self.experts.combine_matrix(weights, idx))  # (N, E): 0 off top-k

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        n, k = idx.shape
        rows, flat_pos, counts = self.experts.init_routing(x, idx)  # (N*k, H) by expert
        act = ops.swiglu(ops.grouped_matmul(rows, self.experts_gate_up.transpose(1, 2), counts))
        y = ops.grouped_matmul(act, self.experts_down.transpose(1, 2), counts)  # (N*k, H)
        unsorted = self.experts.unsort(y, flat_pos, n * k)  # back to (token, slot) order
        return self._weighted_sum(unsorted.view(n, k, -1), weights)


def build_model(arch: ModelArch, parallel: Parallel = SINGLE_DEVICE) -> QwenForCausalLM:
    if not arch.num_experts:
        raise ValueError(f"{arch.source}: {arch.model_type} has no experts; use the qwen recipe")
    layers = []
    for i in range(arch.num_layers):
        moe = arch.is_moe_layer(i)
        ffn = SparseMoeBlock(arch, parallel) if moe else MLP(arch.hidden_size, arch.intermediate_size, parallel.dense)
        layers.append(DecoderLayer(arch, i, ffn, "moe" if moe else "mlp", attn=parallel.attn))
    return QwenForCausalLM(arch, parallel, layers=layers)
