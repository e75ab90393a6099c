"""The recipe registry: which recipes exist, their YAMLs, and how to build a recipe's runner.

A recipe is a directory `models/<name>/` laid out as in cann-recipes-infer: `config/*.yaml`
named by topology or purpose (`builtin.yaml`, the default, runs the recipe's built-in model;
`qwen3_8b_1tp.yaml` ... are upstream-shaped), and `models/runner_<name>.py` defining `RUNNER`.
The CLI and the tools (sk_compare, scope_search, benchmarks) all look recipes up here, so none
of them imports another.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from executor.config import BUILTIN, ConfigError
from executor.paths import MODELS_DIR, REPO_ROOT

DEFAULT_YAML = "builtin.yaml"  # every recipe's default: its built-in model, optimized, runs on CPU


def recipes() -> list[str]:
    """Recipe names, sorted (directories of models/ with a config/builtin.yaml)."""
    return sorted(p.parent.parent.name for p in MODELS_DIR.glob(f"*/config/{DEFAULT_YAML}"))


def _check(recipe: str) -> None:
    if recipe not in recipes():
        raise ConfigError(f"--model: {recipe!r} is not a recipe; allowed values: {', '.join(recipes())}")


def yamls(recipe: str) -> list[str]:
    """The YAML files of models/<recipe>/config/, sorted."""
    _check(recipe)
    return sorted(p.name for p in (MODELS_DIR / recipe / "config").glob("*.yaml"))


def config_path(recipe: str, yaml_name: str | None = None, config: str | None = None) -> Path:
    """The YAML a command runs: `--config PATH` (anywhere), else `--yaml NAME` of the recipe's
    config/ directory, else its builtin.yaml."""
    _check(recipe)
    if config and yaml_name:
        raise ConfigError(f"--config {config} and --yaml {yaml_name}: give one of them")
    if config:
        return Path(config)
    name = yaml_name or DEFAULT_YAML
    name = name if name.endswith((".yaml", ".yml")) else f"{name}.yaml"
    path = MODELS_DIR / recipe / "config" / name
    if not path.is_file():
        raise ConfigError(
            f"--yaml {yaml_name}: models/{recipe}/config/ has no such file; it has: {', '.join(yamls(recipe))}"
        )
    return path


def default_config(recipe: str) -> Path:
    """The recipe's default YAML (config/builtin.yaml)."""
    return config_path(recipe)


def resolve_model_path(recipe: str, model_path: str) -> str:
    """`model_path: builtin` is the recipe's trained checkpoint in models/<recipe>/builtin/."""
    return str(MODELS_DIR / recipe / "builtin") if model_path == BUILTIN else model_path


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
    p.add_argument("--yaml", metavar="NAME", help="a YAML of models/<model>/config/ (default: builtin.yaml)")
    p.add_argument("--config", metavar="PATH", help=config_help)
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, type-checked; the value is YAML, e.g. scheduler_config.batch_size=2 (repeatable)",
    )
    return p
