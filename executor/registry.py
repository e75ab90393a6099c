"""The recipe registry: which recipes exist and how to build a recipe's runner.

A recipe is a directory `models/<name>/` with a default `config.yaml` and a
`models/runner_<name>.py` that defines `RUNNER`. The CLI and the tools (sk_compare,
scope_search, benchmarks) all look recipes up here, so none of them imports another.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from executor.config import ConfigError
from executor.paths import MODELS_DIR, REPO_ROOT


def recipes() -> list[str]:
    """Recipe names, sorted (directories of models/ that have a default config.yaml)."""
    return sorted(p.parent.name for p in MODELS_DIR.glob("*/config.yaml"))


def _check(recipe: str) -> None:
    if recipe not in recipes():
        raise ConfigError(f"--model: {recipe!r} is not a recipe; allowed values: {', '.join(recipes())}")


def default_config(recipe: str) -> Path:
    """The recipe's default YAML."""
    _check(recipe)
    return MODELS_DIR / recipe / "config.yaml"


def runner_class(recipe: str) -> type:
    """The recipe's ModelRunner subclass (`models/<recipe>/models/runner_<recipe>.py: RUNNER`)."""
    _check(recipe)
    if str(REPO_ROOT) not in sys.path:  # models/ is a package at the repo root, not installed
        sys.path.insert(0, str(REPO_ROOT))
    return importlib.import_module(f"models.{recipe}.models.runner_{recipe}").RUNNER


def recipe_parser(prog: str, description: str, epilog: str, config_help: str) -> argparse.ArgumentParser:
    """The parser of a command that runs a recipe (infer.sh, sk_compare, scope_search): --model,
    --config and --set mean the same everywhere; the command adds its own options."""
    p = argparse.ArgumentParser(
        prog=prog, description=description, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="qwen", help=f"recipe (default: qwen; one of: {', '.join(recipes())})")
    p.add_argument("--config", help=config_help)
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, type-checked; the value is YAML, e.g. scheduler_config.batch_size=2 (repeatable)",
    )
    return p
