"""What a run checks before it allocates anything, in one place for the runner and the tools.

Why: a run that is bound to fail must fail before it loads weights, allocates a KV cache or
compiles, and sk_compare / scope_search must be able to ask "would this side run?" for every
side before they start the first (a dense model given `--plan moe` used to run the whole
baseline first). Everything here needs only config.json and the config: the model is built on
PyTorch's meta device, which gives its regions (for the scope plan) and its exact parameter
count (for the memory estimate) without allocating a byte of weights.

Several devices: the layout is checked against config.json here too (heads, experts, vocabulary
must split), and the meta model is built as rank 0's part (every rank's part has the same size,
as the sizes split evenly), so the memory estimate is per rank; on CPU the ranks of one machine
share its RAM and are checked together.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from executor import custom_ops, memory
from executor.arch import ArchError, ModelArch, load_arch
from executor.backends.base import cache_root
from executor.config import ConfigError, ModelConfig, RunConfig
from executor.loader import NoInit
from executor.parallel.groups import Parallel, view
from executor.parallel.layout import ONE_DEVICE, Layout, check_arch
from executor.platform import Platform
from executor.registry import resolve_model_path
from executor.scope import NO_PLAN, Region, ScopePlan, build_plan


class RunnerLike(Protocol):
    """The part of a recipe's ModelRunner the pre-flight needs (build_model must use no state)."""

    recipe: str
    model_types: tuple[str, ...]
    build_model: Callable[[ModelArch, Parallel], torch.nn.Module]


@dataclass(frozen=True)
class Preflight:
    model_path: str  # model_config.model_path resolved ("builtin" -> models/<recipe>/builtin)
    arch: ModelArch
    plan: ScopePlan  # NO_PLAN when SuperKernel is off
    memory: memory.MemoryEstimate
    cfg: RunConfig  # the config as the run uses it: model_config.custom_ops resolved (never None)
    custom_ops_note: str  # which custom ops the run layers on its table, and why


def meta_model(runner: RunnerLike, arch: ModelArch, layout: Layout) -> torch.nn.Module:
    """Rank 0's part of the recipe's model on the meta device: shapes and regions, no storage
    (and no process groups: nothing runs)."""
    with torch.device("meta"), NoInit():
        return runner.build_model(arch, view(layout, 0))


def ranks_on_this_machine(layout: Layout) -> int:
    """Ranks sharing this machine: torchrun's LOCAL_WORLD_SIZE in a rank, else all of them (the
    launcher passes its own count for a run over several machines)."""
    if layout.world == 1:
        return 1
    return int(os.environ.get("LOCAL_WORLD_SIZE", layout.world))


def scope_plan(regions: list[Region], mc: ModelConfig) -> ScopePlan:
    """The decode scopes the config asks for. A requested plan that would open nothing (a pattern
    matching no region, a plan kind the model lacks) is a ScopeError from build_plan; an empty
    region list is refused by config validation."""
    if not mc.superkernel_enabled:
        return NO_PLAN
    sk = mc.superkernel
    return build_plan(regions, sk.plan, sk.options, sk.custom, mc.model_name)


def check_cache_dir(mc: ModelConfig) -> None:
    """A compile cache that cannot be used is an error naming model_config.cache_dir, before compiling."""
    if mc.exe_mode == "eager" or not mc.enable_cache_compile:
        return
    root = cache_root(mc)
    shown = f"model_config.cache_dir {mc.cache_dir}" if mc.cache_dir else f"model_config.cache_dir (default {root})"
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{shown}: is a file, not a directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{shown}: cannot be created ({exc.strerror})") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise ConfigError(f"{shown}: is not writable (the compile cache is written there)")


def check_vocab(arch: ModelArch, tokenizer_vocab: int, tokenizer_path: str) -> None:
    """Every id the tokenizer can produce must have an embedding row."""
    if tokenizer_vocab > arch.vocab_size:
        raise ArchError(
            f"{arch.source}: vocab_size {arch.vocab_size} is smaller than the tokenizer's {tokenizer_vocab} ids "
            f"({tokenizer_path}); the checkpoint and tokenizer do not belong together"
        )


def check(
    runner: RunnerLike, cfg: RunConfig, platform: Platform, dtype: torch.dtype, ranks_here: int | None = None
) -> Preflight:
    """Architecture, recipe match, parallel layout, scope plan, custom ops, memory and compile
    cache; nothing is allocated. `ranks_here`: ranks on this machine (default: ranks_on_this_machine)."""
    mc = cfg.model_config
    model_path = resolve_model_path(runner.recipe, mc.model_path)
    arch = load_arch(model_path, mc.debug_size)
    if runner.model_types and arch.model_type not in runner.model_types:
        raise ArchError(
            f"{arch.source}: model_type {arch.model_type!r} does not belong to the "
            f"{runner.recipe} recipe (it runs {', '.join(runner.model_types)})"
        )
    layout = Layout.from_config(cfg.parallel_config)
    check_arch(layout, arch)
    meta = meta_model(runner, arch, layout)
    plan = scope_plan(meta.regions(), mc)
    bf16 = dtype == torch.bfloat16
    chosen, note = custom_ops.resolve(
        mc.custom_ops, platform.kind, cfg.max_len, arch.head_dim, layout.world, mc.exe_mode, bf16=bf16
    )
    cfg = dataclasses.replace(cfg, model_config=dataclasses.replace(mc, custom_ops=chosen))
    custom_ops.check_runnable(chosen, platform.kind, mc.exe_mode)  # no kernel here, no compiler
    params = memory.count_parameters(meta)
    if layout.world > 1:  # random weights are drawn at full size, then cut: the largest is the whole model's
        params = memory.ParamCount(params.total, memory.count_parameters(meta_model(runner, arch, ONE_DEVICE)).largest)
    here = ranks_here if ranks_here is not None else ranks_on_this_machine(layout)
    estimate = memory.check_run(arch, cfg, platform.kind, params, dtype, layout, here)
    check_cache_dir(mc)
    return Preflight(model_path, arch, plan, estimate, cfg, note)
