"""The multi-device layout of a run: group sizes per role, and the checks that need more than YAML.

`parallel_config` (executor.config) says how many ranks take each role; `Layout` turns it into
the numbers layers use. Ranks are numbered 0..world-1 and every TP group is a block of
consecutive ranks, as in cann-recipes-infer's CommManager:

    attention   TP attn_tp, data parallel attn_dp = world / attn_tp: attention-DP group g
                (ranks g*attn_tp ...) runs batch rows g*B/attn_dp ... on its own KV cache
    dense MLP   TP dense_tp (default attn_tp, as upstream's qwen recipe splits its MLP)
    MoE         experts split over expert parallel EP = world / moe_tp, each expert's
                intermediate dimension over moe_tp: rank r holds experts of EP index r // moe_tp,
                slice r % moe_tp, so all world ranks together hold every expert once
    embedding   vocabulary split over embed_tp;  lm_head: vocabulary split over lmhead_tp

Config-only rules (divisibility by world_size, the batch by attn_dp) are in executor.config;
here are the ones that need the checkpoint's config.json (heads, experts, vocabulary) or the
machine (devices present). Every error is a ConfigError naming the parallel_config key.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from executor.arch import ModelArch
from executor.config import ConfigError, ParallelConfig


@dataclass(frozen=True)
class Layout:
    world: int = 1
    attn_tp: int = 1
    dense_tp: int = 1
    moe_tp: int = 1
    embed_tp: int = 1
    lmhead_tp: int = 1

    @classmethod
    def from_config(cls, pc: ParallelConfig) -> Layout:
        dense = pc.dense_tp_size if pc.dense_tp_size is not None else pc.attn_tp_size
        return cls(pc.world_size, pc.attn_tp_size, dense, pc.moe_tp_size, pc.embed_tp_size, pc.lmhead_tp_size)

    @property
    def attn_dp(self) -> int:
        return self.world // self.attn_tp

    @property
    def moe_ep(self) -> int:
        return self.world // self.moe_tp

    def kv_heads_per_rank(self, num_kv_heads: int) -> int:
        """KV heads one attention rank holds: a share, or one head replicated on
        attn_tp / num_kv_heads ranks when there are fewer KV heads than ranks."""
        return max(num_kv_heads // self.attn_tp, 1)

    def describe(self) -> dict:
        """The layout for metrics.json and logs, in upstream's words."""
        return asdict(self) | {"attn_dp": self.attn_dp, "moe_ep": self.moe_ep}


ONE_DEVICE = Layout()


def check_arch(layout: Layout, arch: ModelArch) -> None:
    """Heads, KV heads, intermediate sizes, experts and vocabulary must split evenly."""
    where = arch.source
    tp = layout.attn_tp
    if arch.num_heads % tp:
        raise ConfigError(
            f"parallel_config.attn_tp_size: {tp} does not divide num_attention_heads {arch.num_heads} of {where}"
        )
    kv = arch.num_kv_heads
    if kv % tp and tp % kv:
        raise ConfigError(
            f"parallel_config.attn_tp_size: {tp} must divide num_key_value_heads {kv} of {where}, or be a multiple "
            "of it (then each KV head is replicated)"
        )
    dense_layers = [i for i in range(arch.num_layers) if not arch.is_moe_layer(i)]
    if dense_layers and arch.intermediate_size % layout.dense_tp:
        key = "dense_tp_size" if layout.dense_tp != tp else "dense_tp_size (default: attn_tp_size)"
        raise ConfigError(
            f"parallel_config.{key}: {layout.dense_tp} does not divide intermediate_size "
            f"{arch.intermediate_size} of {where}"
        )
    if arch.num_experts:
        if arch.num_experts % layout.moe_ep:
            raise ConfigError(
                f"parallel_config.moe_tp_size: expert parallel size {layout.moe_ep} (world_size {layout.world} / "
                f"moe_tp_size {layout.moe_tp}) does not divide num_experts {arch.num_experts} of {where}"
            )
        if arch.moe_intermediate_size % layout.moe_tp:
            raise ConfigError(
                f"parallel_config.moe_tp_size: {layout.moe_tp} does not divide moe_intermediate_size "
                f"{arch.moe_intermediate_size} of {where}"
            )
    for key, size in (("embed_tp_size", layout.embed_tp), ("lmhead_tp_size", layout.lmhead_tp)):
        if arch.vocab_size % size:
            raise ConfigError(f"parallel_config.{key}: {size} does not divide vocab_size {arch.vocab_size} of {where}")


def cpu_cores() -> int:
    """Cores this process may run on (respects taskset / cgroup cpusets)."""
    return len(os.sched_getaffinity(0))


def check_devices(world_size: int, nnodes: int, devices: int, what: str) -> int:
    """Ranks per machine (world_size / nnodes), which must fit the `devices` present here."""
    if world_size % nnodes:
        raise ConfigError(
            f"parallel_config.world_size: {world_size} is not divisible by the {nnodes} machines given to torchrun "
            "(--nnodes); every machine runs the same number of ranks"
        )
    per_node = world_size // nnodes
    if per_node > devices:
        machines = f" on each of {nnodes} machines" if nnodes > 1 else ""
        raise ConfigError(
            f"parallel_config.world_size: {world_size} is larger than the devices present: {per_node} rank(s)"
            f"{machines} but this machine has {devices} {what}"
        )
    return per_node
