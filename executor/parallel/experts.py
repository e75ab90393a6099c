"""Expert parallelism: which experts a rank holds, and its part of a MoE block's output.

Rank r holds experts [first, last) of its expert-parallel index r // moe_tp, and of each the
slice r % moe_tp of the intermediate dimension (executor.parallel.layout). Together the world's
ranks hold every expert once, so the MoE output is the sum over all ranks of each rank's
partial output: its experts, on every token that chose them, weighted by the router.

Dispatch and combine (why all-reduce, not all-to-all): every rank needs the tokens of every
attention data parallel group. They are gathered with a zero-padded all-reduce (nothing to do
when attention is tensor parallel over the whole world: the tokens are already replicated),
each rank runs its experts on all of them (a token that chose none of them gets zero weight)
and the partial outputs are summed with one all-reduce, of which each rank keeps its own rows.
- It is exact and static-shaped, so the decode step stays one graph and its MoE block can be a
  SuperKernel scope: all-reduce is the one collective a CPU launch unit can call.
- A capacity-based all-to-all dispatch sends each token only to the ranks of its k experts,
  which is less traffic at large EP and large batch, but needs a fixed capacity per rank (or
  dropped tokens) and two all-to-alls that no CPU launch unit can hold. Upstream's NPU recipe
  uses the fused MC2 dispatch/combine kernels in decode and an all-to-all "double routing" in
  prefill; on this project's decode sizes (a few tokens per rank) one all-reduce of
  (tokens x hidden) is as cheap as the dispatch it replaces.
The router is replicated (every rank routes every token identically).
"""

from __future__ import annotations

import torch
from torch import nn

from executor import ops
from executor.parallel.groups import Parallel
from executor.parallel.shards import mark, rows


class ExpertShard:
    """This rank's experts; with one rank (EP 1, moe TP 1) each helper is the single-device MoE."""

    def __init__(self, num_experts: int, intermediate: int, hidden: int, parallel: Parallel):
        layout = parallel.layout
        self.num_experts, self.intermediate, self.hidden = num_experts, intermediate, hidden
        self.first, self.last = rows(parallel.ep_index, layout.moe_ep, num_experts)
        self.num_local = self.last - self.first
        self.slice = rows(parallel.moe_tp_index, layout.moe_tp, intermediate)  # of each expert's intermediate
        self.shard = parallel.moe
        self.all_local = self.num_local == num_experts

    def gate_up_weight(self) -> nn.Parameter:
        """(E_local, 2 I_local, H): [gate; up] of each local expert, this rank's slice of each."""
        e, (a, b), i = self.num_local, self.slice, self.intermediate
        param = nn.Parameter(torch.empty(e, 2 * (b - a), self.hidden))
        index = ((self.first, self.last),), ((a, b), (i + a, i + b)), None
        return mark(param, (self.num_experts, 2 * i, self.hidden), index)

    def down_weight(self) -> nn.Parameter:
        """(E_local, H, I_local)."""
        e, (a, b) = self.num_local, self.slice
        param = nn.Parameter(torch.empty(e, self.hidden, b - a))
        return mark(
            param, (self.num_experts, self.hidden, self.intermediate), (((self.first, self.last),), None, ((a, b),))
        )

    # ---------------------------------------------------------------- tokens
    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(b, S, H) this rank's tokens -> the tokens of every attention-DP group (rows in group order)."""
        return self.shard.gather_rows(x)

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial outputs and keep this rank's rows (inverse of gather)."""
        return self.shard.own_rows(self.shard.reduce(partial))

    # ---------------------------------------------------------------- routing restricted to local experts
    def local_choices(self, weights: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k (weights, ids) -> local ids; a choice of another rank's expert gets weight 0
        (and a valid local id, so the gathered formulation stays static-shaped)."""
        if self.all_local:
            return weights, idx
        local = idx - self.first
        mine = (local >= 0) & (local < self.num_local)
        return weights * mine.to(weights.dtype), local.clamp(0, self.num_local - 1)

    def combine_matrix(self, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """(N, E_local) router weights, zero off each token's top-k (and off other ranks' experts)."""
        full = torch.zeros((idx.shape[0], self.num_experts), dtype=weights.dtype, device=weights.device)
        full = full.scatter(1, idx.long(), weights)
        return full if self.all_local else full[:, self.first : self.last]

    def init_routing(self, x: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ops.moe_init_routing over the local experts: (rows sorted by local expert, the (token,
        slot) position of each row, counts per local expert). Choices of other ranks' experts go
        to one extra bucket sorted last and are dropped (prefill only: the shapes depend on routing)."""
        if self.all_local:
            return ops.moe_init_routing(x, idx, self.num_experts)
        local = idx - self.first
        local = local.masked_fill((local < 0) | (local >= self.num_local), self.num_local)
        sorted_rows, order, counts = ops.moe_init_routing(x, local, self.num_local + 1)
        kept = int(counts[: self.num_local].sum())
        return sorted_rows[:kept], order, counts[: self.num_local]

    def unsort(self, y: torch.Tensor, order: torch.Tensor, pairs: int) -> torch.Tensor:
        """Rows computed in expert order -> (token, slot) order; dropped pairs are zero."""
        if self.all_local:
            out = torch.empty_like(y)
            out[order.long()] = y
            return out
        out = y.new_zeros((pairs, y.shape[-1]))
        out[order[: y.shape[0]].long()] = y
        return out
