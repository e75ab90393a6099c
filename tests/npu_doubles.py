"""Recording stand-ins for `torch_npu` and `torchair`: the only test doubles this project allows.

No NPU exists in CI, so executor/backends/npu.py is checked against these fakes. What the real
APIs look like is not written here but read from the facts files in tests/data/ascend_facts/
(each entry says which line of the torch-npu 2.14.0 wheel it came from), so a review sees one
place where our idea of the API lives:

- fused ops: each call is bound against the op's real schema (fused_ops.yaml): a misspelt or
  unknown keyword, a keyword-only argument passed by position, a missing argument is a
  TypeError, and every argument the double does not implement must keep its schema default.
  The double then computes the op's documented CPU meaning, written here independently of
  executor/ops/reference.py, and its documented limits (FIA: float16/bfloat16 contiguous
  inputs; its lse output is garbage unless softmax_lse_flag=True). So a wrapper that passes a
  wrong argument (mask polarity, layout, missing scale, counts as cumsum, ...) gets wrong numbers
  or an error, as on a device.
- scope ops (scope_ops.yaml): `air::scope_enter/scope_exit` and `npu::super_kernel_scope_begin/
  end` are real torch ops with the real schemas, so they reach the FX graph; they record each
  time the compiled step executes them (`scope_events`).
- CompilerConfig (compiler_config.yaml): only the real option names and values; options read
  back as option objects (`.value == "1"`), as torchair's do.
- npugraph_ex (npugraph_ex.yaml): the real option set, value types, and the checks of
  `super_kernel_optimize_options`; `torch.npu.npugraph_ex.inference.cache_compile`.

Calls are recorded when made eagerly; inside a dynamo trace the fused ops are traced through
(plain aten ops in the graph) and not recorded, because mutating Python state there would
recompile every step.

Install with `installed()`: it puts both modules in sys.modules, `torch.npu`, and the
"npugraph_ex" dynamo backend, and removes them all afterwards.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.machinery
import inspect
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch._dynamo.backends import registry

FACTS_DIR = Path(__file__).resolve().parent / "data" / "ascend_facts"


def facts(name: str) -> dict:
    """One facts file (tests/data/ascend_facts/<name>.yaml)."""
    return yaml.safe_load((FACTS_DIR / f"{name}.yaml").read_text())


FUSED = facts("fused_ops")
SCOPES = facts("scope_ops")
COMPILER_CONFIG = facts("compiler_config")
NPUGRAPH_EX = facts("npugraph_ex")
TORCH_NPU_VERSION = FUSED["torch_npu_version"]
SK_KEYS = ["_super_kernel_scope", "_super_kernel_options"]  # torchair's scope attribute names


@dataclass
class Call:
    name: str
    args: tuple
    kwargs: dict


# --------------------------------------------------------------------------- scope ops (real torch ops)
_SCOPE_EVENTS: list[list[tuple]] = [[]]  # the active doubles' event list (replaced per install)


def _event(*event) -> None:
    if not torch.compiler.is_compiling():  # dynamo also runs no-tensor ops once while tracing
        _SCOPE_EVENTS[0].append(event)


def _schema_body(qualified: str) -> str:
    """ "air::scope_enter(...) -> ()" -> "scope_enter(...) -> ()" (what Library.define takes)."""
    return qualified.split("::", 1)[1]


def _define_scope_ops() -> list:
    try:  # this module imported twice under two names must not define the ops twice
        torch.ops.air.scope_enter  # noqa: B018
        raise RuntimeError("tests/npu_doubles.py imported twice: import it one way only")
    except AttributeError:
        pass
    # FRAGMENT, as torchair (scope/_lib.py) and torch_npu (npu/graphs.py) define them
    air, npu = torch.library.Library("air", "FRAGMENT"), torch.library.Library("npu", "FRAGMENT")
    ge, ex = SCOPES["ge_graph"], SCOPES["npugraph_ex"]
    air.define(_schema_body(ge["scope_enter"]["schema"]))
    air.define(_schema_body(ge["scope_exit"]["schema"]))
    air.impl(
        "scope_enter",
        lambda keys, values, need_execute=False: _event("air.scope_enter", tuple(keys), tuple(values)),
        "CompositeExplicitAutograd",
    )
    air.impl("scope_exit", lambda need_execute=False: _event("air.scope_exit"), "CompositeExplicitAutograd")
    npu.define(_schema_body(ex["super_kernel_scope_begin"]["schema"]))
    npu.define(_schema_body(ex["super_kernel_scope_end"]["schema"]))

    def begin(scope_name=None):
        if scope_name is not None and not scope_name.strip():  # torch_npu's own check (graphs.py:102)
            raise RuntimeError("scope_name should be None or a non-empty string.")
        _event("npu.super_kernel_scope_begin", scope_name)

    npu.impl("super_kernel_scope_begin", begin, "CompositeExplicitAutograd")
    npu.impl(
        "super_kernel_scope_end",
        lambda scope_name=None: _event("npu.super_kernel_scope_end", scope_name),
        "CompositeExplicitAutograd",
    )
    for ns, names in (
        (torch.ops.air, ("scope_enter", "scope_exit")),
        (torch.ops.npu, ("super_kernel_scope_begin", "super_kernel_scope_end")),
    ):
        for name in names:
            torch.fx.node.has_side_effect(getattr(ns, name))
            torch.fx.node.has_side_effect(getattr(ns, name).default)
    return [air, npu]


_LIBS = _define_scope_ops()


# --------------------------------------------------------------------------- torch_npu op semantics
# Each function names the arguments it implements with the schema's names and no defaults: the
# defaults come from the schema (fused_ops.yaml) when the call is bound (see _bind).
def _rms(x, gamma, epsilon):
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
    return gamma * (xf * rstd).to(x.dtype), rstd


def npu_rms_norm(self, gamma, epsilon):
    return _rms(self, gamma, epsilon)


def npu_add_rms_norm(x1, x2, gamma, epsilon):
    x_sum = x1 + x2
    y, rstd = _rms(x_sum, gamma, epsilon)
    return y, rstd, x_sum


def npu_swiglu(self, dim):
    a, b = self.chunk(2, dim=dim)
    return F.silu(a) * b


def npu_rotary_mul(self, r1, r2, rotary_mode):
    x = self
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    elif rotary_mode == "interleave":
        rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    else:
        raise ValueError(f"rotary_mode {rotary_mode!r}: expected 'half' or 'interleave'")
    return x * r1 + rotated * r2


FIA_DTYPES = (torch.float16, torch.bfloat16)  # fused_ops.yaml constraints (int8: a quantised path, not doubled)


def npu_fused_infer_attention_score(
    query,
    key,
    value,
    atten_mask,
    actual_seq_lengths_kv,
    num_heads,
    scale,
    pre_tokens,
    next_tokens,
    input_layout,
    num_key_value_heads,
    sparse_mode,
    softmax_lse_flag,
):
    """BNSD/BSND only; atten_mask bool, True = masked out; num_key_value_heads 0 means num_heads;
    actual_seq_lengths_kv: row b reads key/value slots [0, L_b) only (fused_ops.yaml)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dtype not in FIA_DTYPES:
            raise TypeError(
                f"npu_fused_infer_attention_score: {name} dtype {t.dtype} is not supported (float16, bfloat16)"
            )
        if not t.is_contiguous():
            raise RuntimeError(f"npu_fused_infer_attention_score: {name} is not contiguous")
    if input_layout not in ("BNSD", "BSND"):
        raise NotImplementedError(f"double supports input_layout BNSD/BSND, got {input_layout!r}")
    if input_layout == "BSND":
        query, key, value = (t.transpose(1, 2) for t in (query, key, value))
    hkv = num_key_value_heads or num_heads
    if query.shape[1] != num_heads or key.shape[1] != hkv or num_heads % hkv:
        raise ValueError(
            f"num_heads={num_heads}, num_key_value_heads={num_key_value_heads} do not match "
            f"q heads {query.shape[1]}, kv heads {key.shape[1]}"
        )
    if sparse_mode != 0 or pre_tokens != 2147483647 or next_tokens != 2147483647:
        raise NotImplementedError("double implements sparse_mode=0 without band limits")
    if atten_mask is not None and atten_mask.dtype not in (torch.bool, torch.int8, torch.uint8):
        raise TypeError(f"atten_mask must be bool/int8/uint8, got {atten_mask.dtype}")
    lengths = [key.shape[2]] * query.shape[0]  # without actual_seq_lengths_kv every slot is read
    if actual_seq_lengths_kv is not None:
        if not isinstance(actual_seq_lengths_kv, (list, tuple)) or len(actual_seq_lengths_kv) != query.shape[0]:
            raise TypeError("actual_seq_lengths_kv: a list of ints, one per batch row (SymInt[])")
        lengths = [int(n) for n in actual_seq_lengths_kv]
    g = num_heads // hkv
    outs, lses = [], []
    for b, n in enumerate(lengths):  # row b reads slots [0, n) only
        k = key[b : b + 1, :, :n].repeat_interleave(g, dim=1).float()
        v = value[b : b + 1, :, :n].repeat_interleave(g, dim=1).float()
        scores = query[b : b + 1].float() @ k.transpose(-1, -2) * scale  # (1, N, S, n)
        if atten_mask is not None:
            row = atten_mask[min(b, atten_mask.shape[0] - 1)].unsqueeze(0)
            scores = scores.masked_fill(row[..., :n].bool(), float("-inf"))
        lses.append(torch.logsumexp(scores, dim=-1, keepdim=True))
        outs.append((torch.exp(scores - lses[-1]) @ v).to(query.dtype))
    out, lse = torch.cat(outs), torch.cat(lses)
    if not softmax_lse_flag:  # the eager kernel returns an uninitialised [1] float32 tensor: NaN here
        lse = torch.full((1,), float("nan"))
    return (out.transpose(1, 2) if input_layout == "BSND" else out), lse


def npu_moe_gating_top_k_softmax(x, finished, k):
    if finished is not None:
        raise NotImplementedError("double: finished must be None")
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be 2-D or 3-D, got {x.dim()}-D")
    y, idx = torch.topk(torch.softmax(x.float(), dim=-1), k, dim=-1)
    n = x.shape[0]
    row_idx = torch.arange(n * k, dtype=torch.int32).view(k, n).t().contiguous()  # row_idx[i, j] = j*N + i
    return y.to(x.dtype), idx.to(torch.int32), row_idx  # y in x's dtype (the op's meta)


def npu_moe_init_routing(x, row_idx, expert_idx, active_num):
    """The documented golden: stable sort by expert; expanded_row_idx[row id] = destination."""
    if row_idx.dtype != torch.int32 or expert_idx.dtype != torch.int32:
        raise TypeError("row_idx and expert_idx must be int32")
    n, k = expert_idx.shape
    sort = torch.sort(expert_idx.reshape(-1), stable=True)
    dst_to_src = row_idx.reshape(-1).long()[sort.indices]
    expanded_row_idx = torch.zeros(n * k, dtype=torch.int32)
    expanded_row_idx[dst_to_src] = torch.arange(n * k, dtype=torch.int32)
    rows = min(active_num, n) * k
    return x[dst_to_src[:rows] % n], expanded_row_idx, sort.values


def npu_grouped_matmul(x, weight, group_list, split_item, group_type, group_list_type):
    """Single-tensor form (split_item 2/3) with groups over M: y[s_e:e_e] = x[s_e:e_e] @ W[e]."""
    if not (isinstance(x, list) and isinstance(weight, list) and len(x) == len(weight) == 1):
        raise TypeError("x and weight must be lists holding one tensor each")
    if split_item not in (2, 3) or group_type != 0:
        raise NotImplementedError("double: split_item 2/3, group_type 0")
    if group_list.dtype != torch.int64:
        raise TypeError(f"group_list must be int64, got {group_list.dtype}")
    ends = group_list.cumsum(0) if group_list_type == 1 else group_list
    out, start = [], 0
    for e, end in enumerate(ends.tolist()):
        out.append(x[0][start:end] @ weight[0][e])
        start = end
    return [torch.cat(out)]


_FUSED_OPS = (
    npu_rms_norm,
    npu_add_rms_norm,
    npu_swiglu,
    npu_rotary_mul,
    npu_fused_infer_attention_score,
    npu_moe_gating_top_k_softmax,
    npu_moe_init_routing,
    npu_grouped_matmul,
)


def schema(name: str) -> torch._C.FunctionSchema:
    """The op's real schema, from fused_ops.yaml."""
    return torch._C.parse_schema(f"npu::{FUSED['ops'][name]['schema']}")


@dataclass(frozen=True)
class _Arg:
    """One schema argument as plain data (dynamo traces the doubles; it cannot call into FunctionSchema)."""

    name: str
    kwarg_only: bool
    has_default: bool
    default: Any


def _arguments(name: str) -> tuple[_Arg, ...]:
    return tuple(
        _Arg(a.name, a.kwarg_only, a.has_default_value(), a.default_value if a.has_default_value() else None)
        for a in schema(name).arguments
    )


def _bind(op: str, arguments: tuple[_Arg, ...], args: tuple, kwargs: dict) -> dict[str, Any]:
    """Bind a call to the schema as the torch_npu binding does: every argument by name, defaults filled in."""
    positional = [a for a in arguments if not a.kwarg_only]
    if len(args) > len(positional):
        raise TypeError(f"{op}() takes {len(positional)} positional arguments but {len(args)} were given")
    bound = {a.name: v for a, v in zip(positional, args)}
    names = {a.name for a in arguments}
    for key, value in kwargs.items():
        if key not in names:
            raise TypeError(f"{op}() got an unexpected keyword argument {key!r}")
        if key in bound:
            raise TypeError(f"{op}() got multiple values for argument {key!r}")
        bound[key] = value
    for a in arguments:
        if a.name not in bound:
            if not a.has_default:
                raise TypeError(f"{op}() missing required argument {a.name!r}")
            bound[a.name] = a.default
    return bound


def _as_torch_op(name: str, fn):
    """`fn` called the way torch_npu's binding calls the op: bound to the real schema; arguments
    the double does not implement must have their default (else NotImplementedError)."""
    arguments = _arguments(name)
    implemented = list(inspect.signature(fn).parameters)
    unknown = set(implemented) - {a.name for a in arguments}
    if unknown:  # the double itself disagrees with the facts file
        raise RuntimeError(f"double {name} names arguments not in its schema: {sorted(unknown)}")
    defaults = {a.name: a.default for a in arguments if a.has_default}

    def differs(value, default) -> bool:
        return value is not default if isinstance(value, torch.Tensor) else value != default

    def call(*args, **kwargs):
        bound = _bind(name, arguments, args, kwargs)
        changed = sorted(k for k in bound if k not in implemented and differs(bound[k], defaults.get(k)))
        if changed:
            raise NotImplementedError(f"double {name} does not implement {', '.join(changed)}")
        return fn(**{k: bound[k] for k in implemented})

    call.__name__ = name
    return call


# --------------------------------------------------------------------------- fake modules
def _recording(calls: list, name: str, fn):
    @functools.wraps(fn)
    def record_then_run(*args, **kwargs):
        if not torch.compiler.is_compiling():  # see the module docstring
            calls.append(Call(name, args, kwargs))
        return fn(*args, **kwargs)

    return record_then_run


def _module(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)  # importlib.util.find_spec needs one
    return mod


# npugraph_ex.CompilerConfig: every attribute is an option (npugraph_ex.yaml `options`)
_EX = NPUGRAPH_EX["options"]
NPUGRAPH_EX_OPTIONS = (
    set(_EX["bool"])
    | set(_EX["int"])
    | set(_EX["list_int"])
    | set(_EX["dict"])
    | set(_EX["callable"])
    | set(_EX["choice"])
    | set(_EX["path"])
    | set(_EX["other"])
)
_SK = NPUGRAPH_EX["super_kernel"]
_OPTION_TYPES = {"int": int, "str": str}


def _check_sk_options(what: str, given: dict, allowed: dict) -> None:
    """torch_npu's parse of super_kernel_optimize/debug_options (npu/graphs.py): unknown key or a
    value of the wrong type is a RuntimeError (isinstance checks, so True passes as int)."""
    for key, value in given.items():
        if key not in allowed:
            raise RuntimeError(f"Invalid {what} param key: {key!r}.")
        kind = str(allowed[key])
        if kind == "list[str]":
            ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        elif kind in _OPTION_TYPES:
            ok = isinstance(value, _OPTION_TYPES[kind])
        else:  # a nested dict
            ok = isinstance(value, dict)
        if not ok:
            raise RuntimeError(f"{what} {key} must be {kind}, got {type(value).__name__}")


def check_npugraph_ex_options(options: dict | None) -> None:
    """What npugraph_ex does with torch.compile's `options` (npugraph_ex.yaml): setattr on its
    CompilerConfig, so an unknown name is a ValueError; bool options take bools only; the SK
    option dicts are checked after capture (here: at once)."""
    for key, value in (options or {}).items():
        if key not in NPUGRAPH_EX_OPTIONS:
            raise ValueError(
                f"Invalid option {key!r}. The 'CompilerConfig' object does not have attribute {key!r}. "
                f"Supported attributes are: {sorted(NPUGRAPH_EX_OPTIONS)}"
            )
        if key in _EX["bool"] and value not in (True, False):
            raise ValueError(f"Value {value!r} (type: {type(value)}) not in optional list [True, False]")
    options = options or {}
    _check_sk_options("optimize_options", options.get("super_kernel_optimize_options", {}), _SK["optimize_options"])
    _check_sk_options("debug_options", options.get("super_kernel_debug_options", {}), _SK["debug_options"])


class RecordingTorchNpu(types.ModuleType):
    """Fake `torch_npu`: the fused ops, `npu` (also installed as torch.npu), the npugraph_ex backend
    and its compile cache."""

    def __init__(self, device_name: str = "Ascend910_9392"):
        super().__init__("torch_npu")
        self.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
        self.__version__ = TORCH_NPU_VERSION
        self.calls: list[Call] = []
        for fn in _FUSED_OPS:
            setattr(self, fn.__name__, _recording(self.calls, fn.__name__, _as_torch_op(fn.__name__, fn)))
        npu = self.npu = _module("torch_npu.npu")
        for name, fn in {
            "get_device_name": lambda device=None: device_name,
            "is_available": lambda: True,
            "device_count": lambda: 1,
            "set_device": lambda device: None,
            "synchronize": lambda device=None: None,
            "super_kernel_scope_begin": lambda scope_name=None: torch.ops.npu.super_kernel_scope_begin(scope_name),
            "super_kernel_scope_end": lambda scope_name=None: torch.ops.npu.super_kernel_scope_end(scope_name),
        }.items():
            setattr(npu, name, _recording(self.calls, f"npu.{name}", fn))
        npu.npugraph_ex = _module("torch_npu.npu.npugraph_ex")
        npu.npugraph_ex.inference = _module("torch_npu.npu.npugraph_ex.inference")
        npu.npugraph_ex.inference.cache_compile = _recording(
            self.calls, "npugraph_ex.inference.cache_compile", self._cache_compile
        )

    def npugraph_ex_backend(self, gm: torch.fx.GraphModule, example_inputs, options: dict | None = None):
        check_npugraph_ex_options(options)
        self.calls.append(Call("npugraph_ex_backend", (gm,), {"options": options}))
        return gm.forward

    def _cache_compile(
        self, func, *, dynamic=True, cache_dir=None, global_rank=None, tp_rank=None, pp_rank=None, **kwargs
    ):
        """torch.npu.npugraph_ex.inference.cache_compile (cache_compile.yaml): a bound nn.Module
        method only; `options` as for the backend."""
        if not isinstance(func, types.MethodType) or not isinstance(func.__self__, torch.nn.Module):
            raise ValueError(f"Only torch.nn.Module method can be cached now, got {func}")
        options = kwargs.get("options")
        check_npugraph_ex_options(options)
        backend = functools.partial(self.npugraph_ex_backend, options=options)
        return torch.compile(func, backend=backend, fullgraph=True, dynamic=dynamic)

    def named(self, name: str) -> list[Call]:
        return [c for c in self.calls if c.name == name]


class OptionValue:
    """torchair's OptionValue (configs/_option_base.py): the raw value behind `.value`, read back
    as "1"/"0"/str(value)/None; assigning checks the allowed values."""

    def __init__(self, default, optional):
        self.default, self.optional, self._value = default, optional, default

    def __bool__(self) -> bool:
        return bool(self._value)

    @property
    def value(self) -> str | None:
        if self._value is None:
            return None
        if str(self._value) in ("True", "False"):
            return "1" if self._value else "0"
        return str(self._value)

    @value.setter
    def value(self, v) -> None:
        if self.optional is not None and v not in self.optional:
            raise ValueError(f"Value {v!r} (type: {type(v)}) not in optional list {self.optional!r}")
        self._value = v


class _Options:
    """Like torchair's NpuBaseConfig: only declared options; `cfg.x = v` sets the OptionValue."""

    def __init__(self, options: dict[str, tuple[Any, list | None]]):
        object.__setattr__(self, "_options", {k: OptionValue(d, allowed) for k, (d, allowed) in options.items()})

    def __getattr__(self, key):
        try:
            return self.__dict__["_options"][key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key, value):
        if key not in self._options:
            raise ValueError(f"{type(self).__name__} has no option {key}, all options {list(self._options)}")
        self._options[key].value = value


def _section(prefix: str) -> dict[str, tuple[Any, list | None]]:
    """The options of compiler_config.yaml under `prefix` ("" = top level): name -> (default, allowed)."""
    found = {}
    for name, fact in COMPILER_CONFIG["options"].items():
        section, _, option = name.rpartition(".")
        if section == prefix and "default" in fact:
            found[option] = (fact["default"], fact.get("allowed"))
    return found


class CompilerConfig(_Options):
    def __init__(self):
        super().__init__(_section(""))
        object.__setattr__(self, "experimental_config", _Options(_section("experimental_config")))


class _SuperKernelScope:
    """Like torchair's scope: side-effect ops that stamp the scope attributes into the graph."""

    def __init__(self, scope, options):
        self.values = [scope or "", options or ""]

    def __enter__(self):
        torch.ops.air.scope_enter(SK_KEYS, self.values)
        return self

    def __exit__(self, *exc):
        torch.ops.air.scope_exit()
        return False


class RecordingTorchair(types.ModuleType):
    """Fake `torchair`: scope.super_kernel, get_npu_backend, CompilerConfig, inference.cache_compile."""

    def __init__(self):
        super().__init__("torchair")
        self.__spec__ = importlib.machinery.ModuleSpec("torchair", None)
        self.calls: list[Call] = []
        self.super_kernel_calls: list[tuple[str, str]] = []  # recorded at trace time too (see below)
        self.CompilerConfig = CompilerConfig
        self.configs = _module("torchair.configs")
        self.configs.compiler_config = _module("torchair.configs.compiler_config")
        self.configs.compiler_config.CompilerConfig = CompilerConfig
        self.scope, self.inference = _module("torchair.scope"), _module("torchair.inference")

        def note(scope, options):  # runs in Python even inside a dynamo trace, without a guard
            self.super_kernel_calls.append((scope, options))

        note = torch.compiler.assume_constant_result(note)

        def super_kernel(scope: str, options: str = ""):
            note(scope, options)
            return _SuperKernelScope(scope, options)

        self.scope.super_kernel = super_kernel
        self.get_npu_backend = _recording(self.calls, "get_npu_backend", self._get_npu_backend)
        self.inference.cache_compile = _recording(self.calls, "inference.cache_compile", self._cache_compile)

    def submodules(self) -> dict[str, types.ModuleType]:
        return {
            "torchair": self,
            "torchair.configs": self.configs,
            "torchair.scope": self.scope,
            "torchair.configs.compiler_config": self.configs.compiler_config,
            "torchair.inference": self.inference,
        }

    def _npu_backend(self, gm: torch.fx.GraphModule, example_inputs, compiler_config=None):
        self.calls.append(Call("npu_backend", (gm,), {"compiler_config": compiler_config}))
        return gm.forward  # a real dynamo backend: the graph runs on CPU

    def _get_npu_backend(self, *, compiler_config=None, custom_decompositions=None):  # real default: {}
        return functools.partial(self._npu_backend, compiler_config=compiler_config or CompilerConfig())

    def _cache_compile(
        self,
        func,
        *,
        config=None,
        backend=None,
        dynamic=True,
        cache_dir=None,
        global_rank=None,
        tp_rank=None,
        pp_rank=None,
        custom_decompositions=None,
        ge_cache=False,
        **kwargs,
    ):
        """Extra keywords (e.g. fullgraph) are accepted and ignored, as by the real one."""
        if not isinstance(func, types.MethodType) or not isinstance(func.__self__, torch.nn.Module):
            raise ValueError(f"Only torch.nn.Module method can be cached now, got {func}")
        backend = functools.partial(self._npu_backend, compiler_config=config or CompilerConfig())
        return torch.compile(func, backend=backend, fullgraph=True, dynamic=dynamic)

    def named(self, name: str) -> list[Call]:
        return [c for c in self.calls if c.name == name]


@dataclass
class Doubles:
    torch_npu: RecordingTorchNpu
    torchair: RecordingTorchair
    scope_events: list[tuple] = field(default_factory=list)


@contextlib.contextmanager
def installed(device_name: str = "Ascend910_9392"):
    """Install both doubles (sys.modules, torch.npu, the npugraph_ex backend); undo on exit."""
    doubles = Doubles(RecordingTorchNpu(device_name), RecordingTorchair())
    previous = _SCOPE_EVENTS[0]
    _SCOPE_EVENTS[0] = doubles.scope_events
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setitem(sys.modules, "torch_npu", doubles.torch_npu)
            for name, mod in doubles.torchair.submodules().items():
                mp.setitem(sys.modules, name, mod)
            mp.setattr(torch, "npu", doubles.torch_npu.npu, raising=False)
            mp.setitem(registry._BACKENDS, "npugraph_ex", None)
            mp.setitem(registry._COMPILER_FNS, "npugraph_ex", doubles.torch_npu.npugraph_ex_backend)
            yield doubles
    finally:
        _SCOPE_EVENTS[0] = previous
        torch._dynamo.reset()  # compiled code refers to the doubles; never reuse it
