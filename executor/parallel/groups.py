"""Process groups per role, and the traceable collectives layers call on them.

Why functional collectives (torch.distributed._functional_collectives) and nothing else: they
trace under torch.compile into the decode graph as `_c10d_functional.<op>` + `wait_tensor`
nodes (ge_graph keeps one graph; SuperKernel scopes can hold them), and they also run eagerly
for prefill. No async_op handles and no DTensor: DTensor's eager dispatch costs ~10-20x a
plain linear and hides where the collectives are.

Layers never read globals: the runner builds one `Parallel` per run (executor.context carries
it) and passes each layer the `Comm` / `Shard` of its role at construction. At world size 1
every group has size 1 and every helper here returns its input unchanged, so the single-device
decode graph has no extra node.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from executor.parallel.layout import ONE_DEVICE, Layout


@dataclass(frozen=True)
class Comm:
    """One process group as a layer sees it: its ranks, this rank's index in it, and the group
    name the functional collectives take (None for a group of one: nothing to communicate)."""

    ranks: tuple[int, ...] = (0,)
    index: int = 0
    name: str | None = None

    @property
    def size(self) -> int:
        return len(self.ranks)


SOLO = Comm()


@dataclass
class CollectiveLog:
    """Collectives issued while `recording` (the runner records one decode step). Noted where
    the layer calls them: in eager every call, under torch.compile once per trace, because
    `note` is assume_constant_result (dynamo runs it at trace time and bakes in its None)."""

    recording: bool = False
    calls: list[tuple[str, str, int]] = field(default_factory=list)  # (op, group, bytes)
    # False where no collective can run (world size 1, a rank's view without process groups):
    # marking `note` imports Dynamo, 2.3 s of the start of every process that builds a model
    reached: bool = True

    def __post_init__(self):
        def note(op: str, group: str, nbytes: int) -> None:
            if self.recording:
                self.calls.append((op, group, nbytes))

        self.note = torch.compiler.assume_constant_result(note) if self.reached else note

    def summary(self) -> dict:
        by_op: dict[str, int] = {}
        for op, _, _ in self.calls:
            by_op[op] = by_op.get(op, 0) + 1
        return {"count": len(self.calls), "by_op": by_op, "bytes": sum(b for _, _, b in self.calls)}


def _funcol():
    import torch.distributed._functional_collectives as funcol

    return funcol


def all_reduce(x: torch.Tensor, comm: Comm, log: CollectiveLog | None = None) -> torch.Tensor:
    """Sum over the group (identity for a group of one)."""
    if comm.size == 1:
        return x
    if log is not None:
        log.note("all_reduce", comm.name, x.numel() * x.element_size())
    return _funcol().all_reduce(x, "sum", comm.name)


def all_gather_last(x: torch.Tensor, comm: Comm, log: CollectiveLog | None = None) -> torch.Tensor:
    """Concatenate every member's x along the last dim, in member order. Only outside
    SuperKernel scopes (the lm_head): a CPU launch unit cannot call all_gather."""
    if comm.size == 1:
        return x
    if log is not None:
        log.note("all_gather", comm.name, x.numel() * x.element_size() * comm.size)
    return _funcol().all_gather_single(x, x.dim() - 1, comm.name)  # a negative gather dim fails eagerly


@dataclass(frozen=True)
class Shard:
    """How a block split over `group` meets its tokens.

    Each member of `group` holds a part of the block's weights and computes a partial result
    that an all-reduce over `group` completes. When `group` spans several attention data
    parallel groups, their tokens must first be brought together: `gather` is the group of the
    members that hold different tokens (one per attention-DP group inside `group`). Gathering
    is written as a zero-padded all-reduce, and the scatter back as taking this rank's rows of
    the reduced result, because all-reduce is the one collective a CPU SuperKernel launch unit
    can call (Inductor's C++ wrapper has no shim for all_gather / reduce_scatter).
    """

    group: Comm = SOLO
    gather: Comm = SOLO
    log: CollectiveLog | None = field(default=None, compare=False)

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def index(self) -> int:
        return self.group.index

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(n, ...) -> (gather.size * n, ...): every attention-DP group's rows, in group order."""
        g = self.gather
        if g.size == 1:
            return x
        n = x.shape[0]
        buffer = torch.slice_scatter(x.new_zeros((g.size * n, *x.shape[1:])), x, 0, g.index * n, (g.index + 1) * n)
        return all_reduce(buffer, g, self.log)

    def own_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of gather_rows on a result every member holds: this rank's rows."""
        g = self.gather
        if g.size == 1:
            return x
        n = x.shape[0] // g.size
        return x[g.index * n : (g.index + 1) * n]

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum the members' partial results (all-reduce over `group`)."""
        return all_reduce(partial, self.group, self.log)


NO_SHARD = Shard()  # a block on one rank: nothing to split, gather or reduce


@dataclass(frozen=True)
class Parallel:
    """The run's process groups by role (see executor.parallel.layout for the numbering)."""

    layout: Layout = ONE_DEVICE
    rank: int = 0
    attn: Shard = NO_SHARD  # attention TP group (never spans attention-DP groups)
    dense: Shard = NO_SHARD  # dense MLP layers
    moe: Shard = NO_SHARD  # MoE experts: the whole world (EP x moe TP)
    embed: Shard = NO_SHARD
    lmhead: Shard = NO_SHARD
    log: CollectiveLog = field(default_factory=CollectiveLog, compare=False)
    backend: str = ""  # torch.distributed backend ("" at world size 1)

    @property
    def world(self) -> int:
        return self.layout.world

    @property
    def dp_index(self) -> int:
        """This rank's attention data parallel group: which share of the batch it runs."""
        return self.rank // self.layout.attn_tp

    def local_rows(self, batch: int) -> tuple[int, int]:
        """[start, stop) of the global batch rows this rank's attention-DP group runs."""
        share = batch // self.layout.attn_dp
        return self.dp_index * share, (self.dp_index + 1) * share

    @property
    def dp_leaders(self) -> list[int]:
        """One rank per attention-DP group (its first), in row order: who holds which rows."""
        return list(range(0, self.world, self.layout.attn_tp))

    @property
    def ep_index(self) -> int:
        return self.rank // self.layout.moe_tp

    @property
    def moe_tp_index(self) -> int:
        return self.rank % self.layout.moe_tp


SINGLE_DEVICE = Parallel(log=CollectiveLog(reached=False))  # world size 1: its log is shared, no collective runs


def _block(rank: int, size: int) -> tuple[int, ...]:
    start = rank // size * size
    return tuple(range(start, start + size))


def role_ranks(layout: Layout, rank: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """role -> (the ranks of this rank's group, the ranks it gathers tokens from), pure arithmetic.

    A group of size S made of consecutive ranks lies inside one attention TP group when
    S <= attn_tp; otherwise it spans S / attn_tp of them and gathers over the members with this
    rank's position in its attention TP group (stride attn_tp)."""
    tp = layout.attn_tp

    def shard(size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        group = _block(rank, size)
        if size <= tp:
            return group, (rank,)
        return group, tuple(r for r in group if r % tp == rank % tp)

    return {
        "attn": (_block(rank, tp), (rank,)),
        "dense": shard(layout.dense_tp),
        "moe": shard(layout.world),
        "embed": shard(layout.embed_tp),
        "lmhead": shard(layout.lmhead_tp),
    }


def build(layout: Layout, rank: int, backend: str) -> Parallel:
    """Create the process groups of `layout` (torch.distributed must be initialised) and return
    this rank's view. c10d requires every rank to create every group in the same order, also
    the ones it is not in, so all groups of all ranks are created here, each distinct rank set
    once (roles with the same ranks share one group, as upstream's CommManager does)."""
    import torch.distributed as dist

    every: list[tuple[int, ...]] = []
    for r in range(layout.world):
        for group, gather in role_ranks(layout, r).values():
            for ranks in (group, gather):
                if len(ranks) > 1 and ranks not in every:
                    every.append(ranks)
    names: dict[tuple[int, ...], str] = {}
    for ranks in every:
        pg = dist.group.WORLD if len(ranks) == layout.world else _cached_new_group(list(ranks))
        if rank in ranks:
            names[ranks] = pg.group_name
    return view(layout, rank, names, backend)


def view(layout: Layout, rank: int, names: dict[tuple[int, ...], str] | None = None, backend: str = "") -> Parallel:
    """Rank `rank`'s Parallel given the group names of its rank sets. Without names (no process
    groups: building or loading one rank's part of a model, as tests do) every layer gets its
    shape and its slices, but nothing can communicate."""
    names = names or {}
    log = CollectiveLog(reached=bool(names))

    def comm(ranks: tuple[int, ...]) -> Comm:
        return Comm(ranks, ranks.index(rank), names.get(ranks)) if len(ranks) > 1 else SOLO

    shards = {role: Shard(comm(g), comm(d), log) for role, (g, d) in role_ranks(layout, rank).items()}
    return Parallel(layout, rank, log=log, backend=backend, **shards)


# Groups already created in this process, by rank set. Every rank builds the same layouts in the
# same order (the same config), so reusing a group for a second runner (tests, scope_search)
# keeps the ranks in step, and gloo/HCCL connections are not opened again per runner.
_GROUPS: dict[tuple[int, tuple[int, ...]], object] = {}


def created_groups() -> list:
    """The process groups created so far under the current default group (plus the world's)."""
    import torch.distributed as dist

    return [dist.group.WORLD, *(pg for (world, _), pg in _GROUPS.items() if world == id(dist.group.WORLD))]


def _cached_new_group(ranks: list[int]):
    import torch.distributed as dist

    key = (id(dist.group.WORLD), tuple(ranks))  # a new default group (after destroy) starts afresh
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(ranks)
    return _GROUPS[key]
