"""Deployment configuration: strict YAML -> typed, frozen dataclasses.

Why strict: cann-recipes-infer silently ignores unknown keys, so a typo such as
`enable_superkernal: True` quietly measures the wrong thing. Here every key is declared once
(with its default and, where it is an enum, its allowed values), unknown keys and wrong types
are errors naming the key, and impossible combinations are rejected before anything runs.

Architecture (layer count, head sizes, ...) never lives here: it comes from the checkpoint's
config.json or from a named debug size in configs/model_sizes.yaml.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from executor.errors import RecipeError
from executor.scope import REGION_KINDS, parse_options

EXE_MODES = ("eager", "ge_graph", "npugraph_ex")
PLANS = (*REGION_KINDS, "custom")
DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: resolved per platform (executor.compile)
DEVICES = ("auto", "cpu", "cuda", "npu")


class ConfigError(RecipeError):
    """A configuration problem; the message is one line naming the key and what is allowed."""


def _choices(*values: str) -> dict:
    return {"choices": values}


@dataclass(frozen=True)
class CustomScope:
    """One scope of a `custom` plan: which regions it covers and how it is labelled."""

    regions: tuple[str, ...]  # region names or fnmatch patterns, e.g. "layer_*_attn"
    label: str
    options: str = ""


@dataclass(frozen=True)
class SuperKernelConfig:
    enable: bool = False
    plan: str = field(default="decoder", metadata=_choices(*PLANS))
    options: str = ""  # torchair grammar "opt=val:opt=val", validated in executor.scope
    custom: tuple[CustomScope, ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    model_name: str = "qwen"
    model_path: str = ""  # HF checkpoint directory; "" = the named debug size below
    debug_size: str = "debugmodel"  # key of configs/model_sizes.yaml, used when model_path == ""
    tokenizer_path: str = ""  # "" = model_path's tokenizer.json, else the built-in tokenizer
    with_ckpt: bool = False  # True: load weights and fail if they cannot be loaded
    dtype: str = field(default="auto", metadata=_choices(*DTYPES))  # auto: bfloat16 on NPU/CUDA, float32 on CPU
    device: str = field(default="auto", metadata=_choices(*DEVICES))
    exe_mode: str = field(default="eager", metadata=_choices(*EXE_MODES))
    enable_cache_compile: bool = False
    enable_static_kernel: bool = False  # npugraph_ex only: its static_kernel_compile option (independent of SK)
    cache_dir: str = ""  # "" = ~/.cache/cann-recipes-infer/compile
    enable_profiler: bool = False
    seed: int = 0
    superkernel: SuperKernelConfig = SuperKernelConfig()


@dataclass(frozen=True)
class DataConfig:
    prompts: tuple[str, ...] = ("The weather today is",)
    dataset: str = ""  # text file, one prompt per line; overrides prompts
    input_max_len: int = 128  # prompts are truncated (from the left) to this many tokens


@dataclass(frozen=True)
class SchedulerConfig:
    batch_size: int = 1
    max_new_tokens: int = 32


@dataclass(frozen=True)
class ParallelConfig:
    world_size: int = 1


@dataclass(frozen=True)
class RunConfig:
    model_config: ModelConfig = ModelConfig()
    data_config: DataConfig = DataConfig()
    scheduler_config: SchedulerConfig = SchedulerConfig()
    parallel_config: ParallelConfig = ParallelConfig()

    @property
    def superkernel_on(self) -> bool:
        return self.model_config.superkernel.enable


# ----------------------------------------------------------------------------- loading
def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is tuple:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is tuple:  # YAML lists become tuples so the config stays hashable/frozen
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a {_type_name(tp)}, got {type(value).__name__} {value!r}")
        (item_tp, _) = typing.get_args(tp)
        return tuple(_convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__} {value!r}")
        return _build(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if value is None:
            return ""
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise TypeError(f"unsupported config field type {tp!r} for {key}")  # programming error


def _build(cls: type, data: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            raise ConfigError(f"{full}: unknown key; allowed keys: {', '.join(fields)}")
        converted = _convert(value, hints[key], full)
        choices = fields[key].metadata.get("choices")
        if choices and converted not in choices:
            raise ConfigError(f"{full}: {converted!r} is not allowed; allowed values: {', '.join(choices)}")
        kwargs[key] = converted
    return cls(**kwargs)


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """Parse `--set key.path=value` strings; values are YAML scalars/lists (`x=[a, b]`, `x=true`)."""
    parsed = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. scheduler_config.max_new_tokens=32")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {key}: value {raw!r} is not valid YAML ({exc.__class__.__name__})") from None
        parsed.append((key.strip(), value))
    return parsed


def load_config(path: str | Path | None, overrides: list[str] = (), check: bool = True) -> RunConfig:
    """Load a recipe YAML (or only defaults when path is None), apply overrides, validate.

    Keys and types are always checked. `check=False` skips the cross-field rules, for tools
    that change the config before running it (sk_compare/scope_search switch an eager config to
    ge_graph) and validate the copies they run instead."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or exc.__class__.__name__
            raise ConfigError(f"{path}:{where} malformed YAML ({problem})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections ({', '.join(_section_names())})")
    for key, value in parse_overrides(list(overrides)):
        _set_dotted(data, key, value)
    cfg = _build(RunConfig, data, "")
    if check:
        validate(cfg)
    return cfg


def _section_names() -> list[str]:
    return [f.name for f in dataclasses.fields(RunConfig)]


def validate(cfg: RunConfig) -> None:
    """Cross-field rules (the ones cann-recipes-infer's check_model_settings applies, and ours)."""
    mc = cfg.model_config
    sk = mc.superkernel
    if mc.exe_mode == "eager":
        graph_only = [
            name
            for name, on in (
                ("model_config.superkernel.enable", sk.enable),
                ("model_config.enable_cache_compile", mc.enable_cache_compile),
            )
            if on
        ]
        if graph_only:
            raise ConfigError(
                f"{graph_only[0]}: eager does not support graph-only features; "
                f"set model_config.exe_mode to ge_graph or npugraph_ex, or disable it"
            )
    if mc.enable_static_kernel and mc.exe_mode != "npugraph_ex":
        raise ConfigError(
            f"model_config.enable_static_kernel: only exe_mode npugraph_ex has static kernels "
            f"(exe_mode is {mc.exe_mode}); set it to false"
        )
    if sk.plan == "custom" and sk.enable and not sk.custom:
        raise ConfigError(
            "model_config.superkernel.custom: plan 'custom' needs at least one "
            "{regions: [...], label: ..., options: ...} entry"
        )
    if mc.with_ckpt and not mc.model_path:
        raise ConfigError("model_config.model_path: with_ckpt is true but no checkpoint directory is set")
    for name, value in (
        ("scheduler_config.batch_size", cfg.scheduler_config.batch_size),
        ("scheduler_config.max_new_tokens", cfg.scheduler_config.max_new_tokens),
        ("data_config.input_max_len", cfg.data_config.input_max_len),
    ):
        if value < 1:
            raise ConfigError(f"{name}: must be >= 1, got {value}")
    if cfg.parallel_config.world_size != 1:
        raise ConfigError(
            f"parallel_config.world_size: {cfg.parallel_config.world_size} is not supported yet; allowed values: 1"
        )
    if not cfg.data_config.prompts and not cfg.data_config.dataset:
        raise ConfigError("data_config.prompts: give at least one prompt or a data_config.dataset file")
    parse_options(sk.options, key="model_config.superkernel.options")
    for i, scope in enumerate(sk.custom):
        parse_options(scope.options, key=f"model_config.superkernel.custom[{i}].options")


def to_dict(cfg: Any) -> Any:
    """Plain-data view of a config (tuples -> lists) for metrics.json and reports."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple):
        return [to_dict(v) for v in cfg]
    return cfg
