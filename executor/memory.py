"""Memory is checked before it is spent: what a run will need, against what is free.

Why: `scheduler_config.batch_size=100000` used to grow until the kernel's OOM killer ended the
process with no message, and a KV cache of 1e9 tokens ended in an allocation traceback. The
estimate here is made from the architecture and the config alone, before any weight or cache
tensor exists, so an impossible run stops at once with one line naming the keys and the
numbers; every run records the estimate next to its measured peak (metrics.json `memory`).

What is counted, in bytes (an estimate meant to be within a small factor, not exact):
- weights: parameter count (counted on a meta-device model, so exact for any recipe) x dtype;
- loading, transient and freed before the KV cache exists: the model is built in fp32 and then
  cast; random weights come from an fp32 randn of each parameter and its scaled copy (the
  largest parameter, usually the embedding, sets the peak); a checkpoint is read whole (plus its
  fused q/k/v and gate/up copies) before it is copied into the parameters;
- KV cache: 2 (k, v) x layers x batch x kv heads x (input_truncated_len + max_new_tokens)
  x head_dim x dtype;
- activations of the largest step (the prefill of a row group, or a decode step of the whole
  batch): fp32 attention scores over the whole static cache, the k/v broadcast to every query
  head, the FFN's intermediate, hidden-size buffers and the fp32 logits;
- compile: graph modes trace and compile the decode step inside this process; on CPU with more
  than one row per step, the decode graph also keeps a packed copy of its large weights
  (oneDNN's layout, or the kernel's: executor.backends.packed_linear), counted as one
  more copy of all of them.
Several devices (parallel_config): the estimate is per rank, from the rank's part of the model
(parameters counted on its meta model), its attention-DP share of the batch rows, its KV heads
and query heads, its experts and intermediate slices (tokens gathered from every attention-DP
group), and the full-vocabulary logits every rank holds after the lm_head's all-gather. On CPU
the ranks of one machine share its RAM: the check compares ranks-on-this-machine x the per-rank
need with what is free; on CUDA/NPU each rank has its own device.
On CPU the process's own resident memory when the estimate is made is added to give the
expected peak (what ru_maxrss measures); the check compares only the new need with what is
free: host RAM (MemAvailable, or the cgroup's limit if lower, read after the pages this process
has freed are given back: executor.release_freed_memory) on CPU, free device memory on
CUDA (torch.cuda.mem_get_info). On an NPU the free memory is not queried: the estimate is
recorded and the run says the check was not done.
"""

from __future__ import annotations

import gc
import resource
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from executor import release_freed_memory
from executor.arch import ModelArch
from executor.backends import packed_linear
from executor.config import RunConfig
from executor.errors import RecipeError
from executor.parallel.layout import ONE_DEVICE, Layout

MB = 2**20
# In-process compile of the decode step (dynamo + Inductor lowering; the C++ compiler runs in
# child processes): peak RSS of a cold ge_graph + SuperKernel run minus the eager run's was
# ~184 MB for the 8-layer debugmodel on this project's reference machine (BENCHMARKS.md).
COMPILE_BASE = 128 * MB
COMPILE_PER_LAYER = 8 * MB
# Keys a user changes to make a run fit, named in the error.
KEYS = ("scheduler_config.batch_size", "data_config.input_truncated_len", "scheduler_config.max_new_tokens")


class MemoryBudgetError(RecipeError):
    """The run cannot fit: one line with the estimate, what is available, and the keys to change."""


def fmt_bytes(n: float) -> str:
    """Human units for messages: MB below 1 GB, else GB with 2 decimals (1 GB = 2**30 bytes)."""
    return f"{n / MB:.1f} MB" if n < 2**30 else f"{n / 2**30:.2f} GB"


@dataclass(frozen=True)
class MemoryEstimate:
    where: str  # "host RAM", "cuda memory", "npu memory"
    weights: int
    loading: int  # transient while building and loading (freed before the KV cache is allocated)
    kv_cache: int
    activations: int
    compile: int
    process: int  # held by this process when estimated (host RSS on CPU, allocated bytes on CUDA)
    available: int | None  # free where the run allocates; None = not known
    source: str  # where `available` comes from, or why it is not known
    kv_detail: str = ""  # the KV cache product in words, for the error message
    ranks_sharing: int = 1  # ranks of this machine that share `where` (host RAM on CPU), each needing `needed`

    @property
    def needed(self) -> int:
        """Bytes the run adds to the process at its peak: loading, or running with the cache."""
        return self.weights + max(self.loading, self.kv_cache + self.activations + self.compile)

    @property
    def peak(self) -> int:
        """Expected peak of the process: what it held already plus what the run adds."""
        return self.process + self.needed

    @property
    def needed_here(self) -> int:
        """What is checked against `available`: every rank sharing that memory needs `needed`."""
        return self.needed * self.ranks_sharing

    @property
    def checked(self) -> bool:
        return self.available is not None

    def describe(self) -> str:
        """One log line: the estimate, its parts, and what it was checked against."""
        parts = (
            f"weights {fmt_bytes(self.weights)}, KV cache {fmt_bytes(self.kv_cache)}, "
            f"activations {fmt_bytes(self.activations)}, compile {fmt_bytes(self.compile)}"
        )
        against = (
            f"{fmt_bytes(self.available)} available ({self.source})" if self.checked else f"not checked: {self.source}"
        )
        who = "the run needs" if self.ranks_sharing == 1 else f"{self.ranks_sharing} ranks need {self.ranks_sharing} x"
        return f"[run] memory: {who} about {fmt_bytes(self.needed)} of {self.where} ({parts}); {against}"

    def to_metrics(self, measured_peak: float | None, measured_source: str) -> dict:
        """metrics.json `memory`: the estimate next to the measured peak (both in MB)."""
        est = {
            "weights": self.weights,
            "loading": self.loading,
            "kv_cache": self.kv_cache,
            "activations": self.activations,
            "compile": self.compile,
            "process_at_start": self.process,
            "needed": self.needed,
            "peak": self.peak,
        }
        return {
            "where": self.where,
            "estimate_mb": {k: round(v / MB, 1) for k, v in est.items()},
            "available_mb": None if self.available is None else round(self.available / MB, 1),
            "available_source": self.source,
            "checked": self.checked,
            "measured_peak_mb": None if measured_peak is None else round(measured_peak / MB, 1),
            "measured_peak_source": measured_source,
            "estimate_over_measured": round(self.peak / measured_peak, 3) if measured_peak else None,
            "per_rank": True,  # at world_size 1 the one rank is the run
            "ranks_sharing": self.ranks_sharing,
        }


# ----------------------------------------------------------------------------- what is free
def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (no limit) -> None


def host_available() -> tuple[int | None, str]:
    """Free host RAM: MemAvailable, or the cgroup's limit minus its usage when that is lower."""
    meminfo, source = None, "no /proc/meminfo on this system"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                meminfo, source = int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
                break
    except OSError:
        pass
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),  # v1
    ):
        limit, usage = _read_int(Path(limit_file)), _read_int(Path(usage_file))
        if limit is not None and usage is not None and limit < 2**60:  # v1 writes ~2**63 for "no limit"
            free = max(0, limit - usage)
            if meminfo is None or free < meminfo:
                meminfo, source = free, f"cgroup limit {limit_file} minus usage"
            break
    return meminfo, source


def process_resident() -> int:
    """Resident bytes of this process now (VmRSS), or its peak so far where /proc is absent."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def available(kind: str) -> tuple[int | None, str, int]:
    """(free bytes or None, where that comes from, bytes this process holds there already)."""
    if kind == "cpu":
        release_freed_memory()  # what this process freed and kept counts as available again
        free, source = host_available()
        return free, source, process_resident()
    if kind == "cuda":
        free, _total = torch.cuda.mem_get_info()
        return free, "torch.cuda.mem_get_info", torch.cuda.memory_allocated()
    return None, f"free {kind} memory is not queried by this project yet (estimate recorded only)", 0


def measured_peak(kind: str) -> tuple[float | None, str]:
    """Peak bytes the run really used, where the platform can say."""
    if kind == "cuda":
        return float(torch.cuda.max_memory_allocated()), "torch.cuda.max_memory_allocated"
    if kind == "cpu":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0, "ru_maxrss (peak RSS of the process)"
    return None, f"not measured on {kind}"


# ----------------------------------------------------------------------------- the estimate
@dataclass(frozen=True)
class ParamCount:
    total: int  # elements, tied parameters once (this rank's part on several devices)
    largest: int  # elements of the largest single parameter at full size (random init draws it whole)


def count_parameters(model: torch.nn.Module) -> ParamCount:
    """Parameter elements of a (meta-device) model."""
    sizes = [p.numel() for p in model.parameters()]
    return ParamCount(sum(sizes), max(sizes, default=0))


def estimate(
    arch: ModelArch,
    cfg: RunConfig,
    kind: str,
    params: ParamCount,
    dtype: torch.dtype,
    layout: Layout = ONE_DEVICE,
    ranks_here: int = 1,
) -> MemoryEstimate:
    """What `cfg` on `arch` will allocate on `kind` (cpu, cuda, npu) with weights and cache in
    `dtype`, before anything is allocated: per rank of `layout`, `ranks_here` of them on this machine."""
    mc, sc = cfg.model_config, cfg.scheduler_config
    eb = dtype.itemsize
    b, s = sc.batch_size // layout.attn_dp, cfg.data_config.input_truncated_len  # this rank's rows
    t = s + sc.max_new_tokens  # static cache length
    hq, d, h = arch.num_heads // layout.attn_tp, arch.head_dim, arch.hidden_size
    hkv = layout.kv_heads_per_rank(arch.num_kv_heads)
    kv = 2 * arch.num_layers * b * hkv * t * d * eb
    said = "scheduler_config.batch_size" if layout.attn_dp == 1 else "rows per attention-DP group (batch_size / DP)"
    kv_detail = (
        f"KV cache {fmt_bytes(kv)} = 2 (k, v) x {arch.num_layers} layers x {said} {b} "
        f"x {hkv} kv heads x (data_config.input_truncated_len {s} + scheduler_config.max_new_tokens "
        f"{sc.max_new_tokens}) tokens x head_dim {d} x {eb} bytes ({str(dtype).removeprefix('torch.')})"
        + (" per rank" if layout.world > 1 else "")
    )
    limit = sc.max_prefill_tokens
    rows = b if limit <= 0 else min(b, max(1, limit // s))  # rows prefilled together

    def step(rows: int, q_len: int) -> int:
        """Live activation bytes of one forward of `rows` x `q_len` tokens against the full cache."""
        tokens = rows * q_len
        scores = 3 * rows * hq * q_len * t * 4  # fp32 scores, masked copy, softmax
        broadcast_kv = rows * hq * t * d * eb  # k (then v) expanded to every query head by the matmul
        # MoE: the rank's experts and slices, on the tokens of every attention-DP group
        e, k, i = (
            arch.num_experts // layout.moe_ep,
            arch.num_experts_per_tok,
            arch.moe_intermediate_size // layout.moe_tp,
        )
        tokens_moe = tokens * layout.attn_dp
        if tokens_moe * k <= e:  # gathered: the k chosen experts' weights are copied per token
            moe = tokens_moe * k * 3 * i * h * eb
        elif q_len == 1:  # dense decode: every expert on every token
            moe = tokens_moe * e * (3 * i + h) * eb
        else:  # grouped prefill: token copies per chosen expert
            moe = tokens_moe * k * (3 * h + 3 * i) * eb
        dense_tokens = tokens * max(1, layout.dense_tp // layout.attn_tp)  # gathered when dense TP spans DP groups
        dense = dense_tokens * 3 * (arch.intermediate_size // layout.dense_tp) * eb
        layers = [arch.is_moe_layer(n) for n in range(arch.num_layers)]
        ffn = max(moe if any(layers) else 0, dense if not all(layers) else 0)
        hidden = tokens * (6 * h + 3 * (hq + 2 * hkv) * d) * eb + 2 * tokens * d * 4 + rows * q_len * t
        return scores + broadcast_kv + ffn + hidden

    logits = 2 * b * arch.vocab_size * 4  # fp32 logits of the prefill and of the current step (all-gathered)
    activations = max(step(rows, s), step(b, 1)) + logits
    graph = mc.exe_mode != "eager"
    n = params.total
    if kind == "cpu":
        build = n * 4 if eb != 4 else 0  # built in fp32, then cast: the fp32 copy exists until the cast ends
        if mc.with_ckpt:
            fill = 2 * n * eb  # the checkpoint read whole + its fused q/k/v, gate/up copies, then copied in
        else:
            fill = 2 * params.largest * 4  # init_random: an fp32 randn of the largest parameter and its scaled copy
        loading = max(build, fill)
        compile_bytes = COMPILE_BASE + COMPILE_PER_LAYER * arch.num_layers if graph else 0
        if graph and b > 1 and packed_linear.packs(dtype, b):
            compile_bytes += n * eb
    else:  # weights are built and loaded on the host, then moved; graphs keep their own buffers on the device
        loading = 0
        compile_bytes = step(b, 1) if graph else 0
    free, source, process = available(kind)
    return MemoryEstimate(
        where="host RAM" if kind == "cpu" else f"{kind} memory",
        weights=n * eb,
        loading=loading,
        kv_cache=kv,
        activations=activations,
        compile=compile_bytes,
        process=process,
        available=free,
        source=source,
        kv_detail=kv_detail,
        ranks_sharing=ranks_here if kind == "cpu" else 1,  # CUDA/NPU: one device per rank
    )


def check(est: MemoryEstimate) -> None:
    """Raise MemoryBudgetError when the run cannot fit in what is available."""
    if est.available is None or est.needed_here <= est.available:
        return
    who = "this run needs" if est.ranks_sharing == 1 else f"{est.ranks_sharing} ranks on this machine need"
    raise MemoryBudgetError(
        f"memory: {who} about {fmt_bytes(est.needed_here)} of {est.where} but {fmt_bytes(est.available)} is "
        f"available ({est.source}): {est.kv_detail}; weights {fmt_bytes(est.weights)}, activations "
        f"{fmt_bytes(est.activations)}, compile {fmt_bytes(est.compile)}; lower {', '.join(KEYS[:2])} or {KEYS[2]}"
    )


def forget_runners() -> None:
    """Drop dynamo's compiled graphs and collect the runners freed since: reference cycles hold a
    freed runner and its weights until a full collection (check_run), so a process that builds
    runners in turn frees each one's memory before it builds the next. Not for a process that
    keeps a compiled runner it will call again: its graphs would be compiled anew."""
    torch._dynamo.reset()
    gc.collect()


def check_run(
    arch: ModelArch,
    cfg: RunConfig,
    kind: str,
    params: ParamCount,
    dtype: torch.dtype,
    layout: Layout = ONE_DEVICE,
    ranks_here: int = 1,
) -> MemoryEstimate:
    """Estimate and check in one call (the runner and the tools' pre-flight use this).

    A run that does not fit is estimated again after a full garbage collection before it is
    refused. Why: a freed runner is held by reference cycles (its thread governor keeps its bound
    `log`, its compiled step the bound `_decode_step`, and dynamo's and FX's objects point at each
    other and at the weights), so it and its weights stay until the collector's rare full pass;
    decode_bench's batch sweep found 13 GB of 23 still resident after freeing the three runners
    of batch 4 at the 0.6B shape, and a later batch was refused with 6.4 GB said to be free
    (BENCHMARKS.md, "fifty-third pass"). Not done for a run that fits: a full collection after a
    compile walks 0.4-0.6M objects (0.45-1.07 s here)."""
    est = estimate(arch, cfg, kind, params, dtype, layout, ranks_here)
    if est.checked and est.needed_here > est.available:
        collected = gc.collect()
        if kind == "cuda":
            torch.cuda.empty_cache()  # the collected tensors' blocks back to the device
        est = estimate(arch, cfg, kind, params, dtype, layout, ranks_here)
        est = replace(est, source=f"{est.source}, read after a full garbage collection ({collected} objects)")
    check(est)
    return est


__all__ = [
    "MemoryBudgetError",
    "MemoryEstimate",
    "ParamCount",
    "check",
    "check_run",
    "count_parameters",
    "estimate",
    "forget_runners",
    "measured_peak",
]
