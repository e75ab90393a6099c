"""What sk_compare and scope_search do before they measure anything, written once.

Both tools take the same recipe arguments (--model/--config/--set, as infer.sh), read the
user's config without changing it (each side runs a validated copy), own the SuperKernel keys
of every side, detect the platform once, and write into a result directory of the recipe.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from executor.config import RunConfig, load_config
from executor.platform import Platform, detect
from executor.registry import config_path, runner_class
from tools import measure


@dataclass(frozen=True)
class ToolStart:
    model: str  # recipe name
    runner: type  # the recipe's ModelRunner subclass
    config: Path  # the user's YAML: only read (except scope_search --apply)
    cfg: RunConfig  # keys and types checked; cross-field rules are checked on each side's copy
    platform: Platform


def start(args: argparse.Namespace, tool: str, owns_superkernel: bool = True) -> ToolStart:
    """Validate the recipe arguments in the order a user fixes them: model, config, overrides, device.

    A tool that sets the SuperKernel keys of its sides itself (`owns_superkernel`) refuses them in
    --set and checks the cross-field rules on each side's copy; another tool runs the config as
    given, so every rule is checked here."""
    runner = runner_class(args.model)
    config = config_path(args.model, args.yaml, args.config).resolve()
    if owns_superkernel:
        measure.reject_superkernel_overrides(args.overrides, tool)
    cfg = load_config(config, args.overrides, check=not owns_superkernel)
    return ToolStart(args.model, runner, config, cfg, detect(cfg.model_config.device))
