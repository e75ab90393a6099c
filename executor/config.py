"""Deployment configuration: strict YAML -> typed, frozen dataclasses, in cann-recipes-infer's names.

Why strict: cann-recipes-infer silently ignores unknown keys, so a typo such as
`enable_superkernal: True` quietly measures the wrong thing. Here every key is declared once
(with its default and, where it is an enum, its allowed values), unknown keys, duplicate keys
and wrong types are errors naming the key, and impossible combinations are rejected before
anything runs.

Why upstream's names: our users bring their cann-recipes-infer YAMLs (`qwen3_8b_1tp.yaml`, ...)
and the SuperKernel workflow toggles `enable_superkernel` with sed. So the keys are upstream's:
`model_config.enable_superkernel` (or, where upstream model YAMLs keep it,
`model_config.custom_params.enable_superkernel`), `data_config.input_truncated_len`,
`data_config.dataset`, `enable_static_kernel`, `scheduler_config.max_prefill_tokens`,
`parallel_config.*`, and the top-level `model_name` / `world_size` upstream's launcher reads.
Upstream keys this project does not implement are accepted only at their default (off) value;
turned on, they stop the run naming the key. Our own settings with no upstream name live in
documented places: `model_config.superkernel` (plan, options, custom scopes), `dtype`, `device`,
`debug_size`, `tokenizer_path`, `cache_dir`, `seed`, `data_config.prompts`.

Architecture (layer count, head sizes, ...) never lives here: it comes from the checkpoint's
config.json or from a named debug size in configs/model_sizes.yaml.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from executor import custom_ops
from executor.errors import RecipeError
from executor.scope_grammar import REGION_KINDS, parse_options

EXE_MODES = ("eager", "ge_graph", "npugraph_ex")
PLANS = (*REGION_KINDS, "custom")
DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: resolved per platform (executor.compile)
DEVICES = ("auto", "cpu", "cuda", "npu")
DATASETS = ("default", "LongBench")  # or a path to a text file, one prompt per line
BUILTIN = "builtin"  # model_path value: the recipe's trained built-in checkpoint, models/<recipe>/builtin/


class ConfigError(RecipeError):
    """A configuration problem; the message is one line naming the key and what is allowed."""


def _choices(*values: str) -> dict:
    return {"choices": values}


def _upstream_only(default: Any) -> Any:
    """A cann-recipes-infer key this project does not implement: accepted at `default` only."""
    return field(default=default, metadata={"upstream_only": True})


@dataclass(frozen=True)
class CustomScope:
    """One scope of a `custom` plan: which regions it covers and how it is labelled."""

    regions: tuple[str, ...]  # region names or fnmatch patterns, e.g. "layer_*_attn"
    label: str
    options: str = ""


@dataclass(frozen=True)
class SuperKernelConfig:
    """Our SuperKernel settings (no upstream name); the switch is model_config.enable_superkernel."""

    plan: str = field(default="decoder", metadata=_choices(*PLANS))
    options: str = ""  # torchair grammar "opt=val:opt=val", validated in executor.scope
    custom: tuple[CustomScope, ...] = ()


@dataclass(frozen=True)
class CustomParams:
    """model_config.custom_params: where upstream model YAMLs keep model-specific switches."""

    enable_superkernel: bool | None = None  # same switch as model_config.enable_superkernel
    enable_multi_streams: bool = _upstream_only(False)


@dataclass(frozen=True)
class ModelConfig:
    model_name: str = "qwen"
    model_path: str = ""  # HF checkpoint directory; "builtin" = the recipe's trained model; "" = debug_size
    debug_size: str = "debugmodel"  # key of configs/model_sizes.yaml, used when model_path == ""
    tokenizer_path: str = ""  # "" = model_path's tokenizer.json, else the built-in tokenizer
    with_ckpt: bool = False  # True: load weights and fail if they cannot be loaded
    dtype: str = field(default="auto", metadata=_choices(*DTYPES))  # auto: bfloat16 on NPU/CUDA, float32 on CPU
    device: str = field(default="auto", metadata=_choices(*DEVICES))
    exe_mode: str = field(default="eager", metadata=_choices(*EXE_MODES))
    enable_superkernel: bool | None = None  # None: take custom_params.enable_superkernel, else off
    enable_cache_compile: bool = False
    cache_dir: str = ""  # "" = ~/.cache/cann-recipes-infer/compile
    enable_static_kernel: bool = False  # npugraph_ex's static_kernel_compile option (independent of SK)
    enable_profiler: bool = False
    # executor/custom_ops/ ops layered on the op table, e.g. [decode_attention]; [] = none; left out
    # (None): chosen per run by executor.custom_ops.resolve (the pre-flight)
    custom_ops: tuple[str, ...] | None = None
    output_path: str = ""  # results directory; "" = models/<recipe>/res/<date>/<case>/ (--out wins)
    seed: int = 0
    superkernel: SuperKernelConfig = SuperKernelConfig()
    custom_params: CustomParams = CustomParams()
    force_eplb: bool = _upstream_only(False)
    next_n: int = _upstream_only(0)  # speculative decoding steps
    enable_hadamard: bool = _upstream_only(False)

    @property
    def superkernel_enabled(self) -> bool:
        """The switch wherever the YAML keeps it (validate() rejects the two places disagreeing)."""
        for value in (self.enable_superkernel, self.custom_params.enable_superkernel):
            if value is not None:
                return value
        return False


@dataclass(frozen=True)
class DataConfig:
    dataset: str = "default"  # "default" = prompts below; "LongBench" = a local copy; or a text file path
    dataset_path: str = ""  # LongBench: its directory ("" = <repo>/dataset/LongBench, as upstream)
    prompts: tuple[str, ...] = ("The weather today is",)
    input_truncated_len: int = 128  # prompt tokens kept (from the end of the prompt)


@dataclass(frozen=True)
class SchedulerConfig:
    batch_size: int = 1
    max_new_tokens: int = 32
    max_prefill_tokens: int = 0  # > 0: prefill rows in groups of at most this many prompt tokens
    mem_fraction_static: float = _upstream_only(0.85)
    block_size: int = _upstream_only(128)  # paged KV cache block; ours is one static block per row
    num_reserved_decode_tokens: int = _upstream_only(64)


@dataclass(frozen=True)
class ParallelConfig:
    """Upstream's multi-device layout (executor.parallel builds the process groups from it).

    Ranks are numbered 0..world_size-1; every `*_tp_size` groups consecutive ranks."""

    world_size: int = 1  # ranks (one device each), started by torchrun
    attn_tp_size: int = 1  # attention data parallel size = world_size // attn_tp_size
    # dense MLP layers; None = attn_tp_size, which is what upstream's qwen recipe does (its MLP
    # uses the attention TP group, so its YAMLs leave this key out)
    dense_tp_size: int | None = None
    moe_tp_size: int = 1  # expert parallel size = world_size // moe_tp_size
    embed_tp_size: int = 1
    lmhead_tp_size: int = 1
    shared_tp_size: int = _upstream_only(1)
    o_proj_tp_size: int = _upstream_only(1)
    cp_size: int = _upstream_only(1)


@dataclass(frozen=True)
class RunConfig:
    model_config: ModelConfig = ModelConfig()
    data_config: DataConfig = DataConfig()
    scheduler_config: SchedulerConfig = SchedulerConfig()
    parallel_config: ParallelConfig = ParallelConfig()

    @property
    def superkernel_on(self) -> bool:
        return self.model_config.superkernel_enabled

    @property
    def max_len(self) -> int:
        """Static KV-cache slots per row: the longest prompt kept plus every generated token."""
        return self.data_config.input_truncated_len + self.scheduler_config.max_new_tokens


# Top-level keys of upstream YAMLs, read by its launcher; each repeats a section's key.
TOP_LEVEL = {"model_name": "model_config.model_name", "world_size": "parallel_config.world_size"}


# ----------------------------------------------------------------------------- loading
def _optional(tp: Any) -> Any:
    """`X | None` -> X, else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is tuple:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str) -> Any:
    inner = _optional(tp)
    if inner is not None:
        return None if value is None else _convert(value, inner, key)
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
        meta = fields[key].metadata
        choices = meta.get("choices")
        if choices and converted not in choices:
            raise ConfigError(f"{full}: {converted!r} is not allowed; allowed values: {', '.join(choices)}")
        if meta.get("upstream_only") and converted != fields[key].default:
            raise ConfigError(
                f"{full}: {value!r} is not supported here (a cann-recipes-infer option this project does not "
                f"implement); allowed value: {fields[key].default!r}"
            )
        kwargs[key] = converted
    missing = [
        name
        for name, f in fields.items()
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{prefix}: required key {missing[0]} is missing")
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


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last silently)."""


def _no_duplicates(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        if key in seen:
            raise ConfigError(f"{loader.name}: key {key!r} appears twice, on line {seen[key]} and line {line}")
        seen[key] = line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


def read_text_file(path: Path, what: str) -> str:
    """A UTF-8 text file, or a ConfigError naming it (missing, a directory, unreadable, not UTF-8)."""
    if path.is_dir():
        raise ConfigError(f"{what} {path} is a directory, not a file")
    if not path.is_file():
        raise ConfigError(f"{what} {path} does not exist")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except OSError as exc:
        raise ConfigError(f"{what} {path} cannot be read ({exc.strerror})") from None


def read_yaml(path: Path, what: str = "config file") -> Any:
    """Parse a YAML file strictly: malformed YAML and duplicate keys are errors naming the line."""
    text = read_text_file(path, what)
    loader = _StrictLoader(text)
    loader.name = str(path)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or exc.__class__.__name__
        raise ConfigError(f"{path}:{where} malformed YAML ({problem})") from None
    finally:
        loader.dispose()


def _merge_top_level(data: dict, path: Path) -> None:
    """Fold upstream's top-level `model_name` / `world_size` into their sections (they must agree)."""
    for key, dotted in TOP_LEVEL.items():
        if key not in data:
            continue
        value = data.pop(key)
        section, name = dotted.split(".")
        node = data.setdefault(section, {})
        if not isinstance(node, dict):
            continue  # reported as "expected a mapping" by _build
        if name in node and node[name] != value:
            raise ConfigError(f"{path}: top-level {key}: {value!r} disagrees with {dotted}: {node[name]!r}")
        node[name] = value


def load_config(path: str | Path | None, overrides: list[str] = (), check: bool = True) -> RunConfig:
    """Load a recipe YAML (or only defaults when path is None), apply overrides, validate.

    Keys and types are always checked. `check=False` skips the cross-field rules, for tools
    that change the config before running it (sk_compare/scope_search switch an eager config to
    ge_graph) and validate the copies they run instead."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        data = read_yaml(path) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections ({', '.join(_section_names())})")
        _merge_top_level(data, path)
    for key, value in parse_overrides(list(overrides)):
        _set_dotted(data, key, value)
    cfg = _build(RunConfig, data, "")
    if check:
        validate(cfg)
    return cfg


def _section_names() -> list[str]:
    return [f.name for f in dataclasses.fields(RunConfig)] + list(TOP_LEVEL)


def validate(cfg: RunConfig) -> None:
    """Cross-field rules (the ones cann-recipes-infer's check_model_settings applies, and ours)."""
    mc = cfg.model_config
    sk = mc.superkernel
    both = (mc.enable_superkernel, mc.custom_params.enable_superkernel)
    if None not in both and both[0] != both[1]:
        raise ConfigError(
            f"model_config.enable_superkernel: {both[0]} disagrees with model_config.custom_params.enable_superkernel: "
            f"{both[1]}; set the switch in one place"
        )
    if mc.exe_mode == "eager":
        graph_only = [
            name
            for name, on in (
                ("model_config.enable_superkernel", mc.superkernel_enabled),
                ("model_config.enable_cache_compile", mc.enable_cache_compile),
            )
            if on
        ]
        if graph_only:
            raise ConfigError(
                f"{', '.join(graph_only)}: eager does not support graph-only features; "
                f"set model_config.exe_mode to ge_graph or npugraph_ex, or set {' and '.join(graph_only)} to false"
            )
    if mc.enable_static_kernel and mc.exe_mode != "npugraph_ex":
        raise ConfigError(
            f"model_config.enable_static_kernel: true needs exe_mode npugraph_ex (it is npugraph_ex's static kernel "
            f"compile), not {mc.exe_mode}"
        )
    if sk.plan == "custom" and mc.superkernel_enabled and not sk.custom:
        raise ConfigError(
            "model_config.superkernel.custom: plan 'custom' needs at least one "
            "{regions: [...], label: ..., options: ...} entry"
        )
    for i, scope in enumerate(sk.custom):
        if not scope.label.strip():
            raise ConfigError(f"model_config.superkernel.custom[{i}].label: a scope needs a non-empty label")
        if not scope.regions:
            raise ConfigError(f"model_config.superkernel.custom[{i}].regions: a scope needs at least one region")
    if mc.with_ckpt and not mc.model_path:
        raise ConfigError("model_config.model_path: with_ckpt is true but no checkpoint directory is set")
    if not mc.model_name.strip():
        raise ConfigError("model_config.model_name: must not be empty (log lines are '<model_name> inference ...')")
    for name, value in (
        ("scheduler_config.batch_size", cfg.scheduler_config.batch_size),
        ("scheduler_config.max_new_tokens", cfg.scheduler_config.max_new_tokens),
        ("data_config.input_truncated_len", cfg.data_config.input_truncated_len),
    ):
        if value < 1:
            raise ConfigError(f"{name}: must be >= 1, got {value}")
    if (limit := cfg.scheduler_config.max_prefill_tokens) < 0:
        raise ConfigError(f"scheduler_config.max_prefill_tokens: must be >= 0 (0 = off), got {limit}")
    _validate_parallel(cfg)
    dc = cfg.data_config
    if dc.dataset == "default" and not dc.prompts:
        raise ConfigError("data_config.prompts: dataset 'default' needs at least one prompt")
    parse_options(sk.options, key="model_config.superkernel.options")
    custom_ops.check(mc.custom_ops or ())
    for i, scope in enumerate(sk.custom):
        parse_options(scope.options, key=f"model_config.superkernel.custom[{i}].options")


def _validate_parallel(cfg: RunConfig) -> None:
    """The layout rules that need no checkpoint; executor.parallel.layout checks heads, experts
    and vocabulary against config.json, and the device count against the machine."""
    pc, sc = cfg.parallel_config, cfg.scheduler_config
    sizes = {f.name: getattr(pc, f.name) for f in dataclasses.fields(pc) if getattr(pc, f.name) is not None}
    for name, value in sizes.items():
        if value < 1:
            raise ConfigError(f"parallel_config.{name}: must be >= 1, got {value}")
    world = pc.world_size
    divisors = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
    for name in ("attn_tp_size", "dense_tp_size", "moe_tp_size", "embed_tp_size", "lmhead_tp_size"):
        value = sizes.get(name)
        if value is not None and world % value:
            raise ConfigError(
                f"parallel_config.{name}: {value} does not divide parallel_config.world_size {world}; "
                f"allowed values: {divisors}"
            )
    attn_tp = pc.attn_tp_size
    for name in ("dense_tp_size", "embed_tp_size", "lmhead_tp_size"):
        value = sizes.get(name)
        if value is not None and attn_tp % value and value % attn_tp:
            raise ConfigError(
                f"parallel_config.{name}: {value} must divide parallel_config.attn_tp_size {attn_tp} or be a "
                "multiple of it (a group either lies inside one attention TP group or spans whole ones)"
            )
    attn_dp = world // attn_tp
    if sc.batch_size % attn_dp:
        raise ConfigError(
            f"scheduler_config.batch_size: {sc.batch_size} is not divisible by the attention data parallel size "
            f"{attn_dp} (parallel_config.world_size {world} / parallel_config.attn_tp_size {attn_tp}); each "
            "attention data parallel group runs an equal share of the batch"
        )
    if attn_dp > 1 and sc.max_prefill_tokens > 0:
        raise ConfigError(
            f"scheduler_config.max_prefill_tokens: grouped prefill is not supported with attention data parallel "
            f"size {attn_dp} (parallel_config.world_size / parallel_config.attn_tp_size); set it to 0"
        )


def to_dict(cfg: Any) -> Any:
    """Plain-data view of a config (tuples -> lists) for metrics.json and reports."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple):
        return [to_dict(v) for v in cfg]
    return cfg
