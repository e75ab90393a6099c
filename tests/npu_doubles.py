"""Recording stand-ins for `torch_npu` and `torchair`: the only test doubles this project allows.

No NPU exists in CI, so executor/backends/npu.py is checked against these fakes. Each fake
function has the documented signature (shared/reference/ascend-apis.md; a misspelt keyword such
as `pre_tockens` for the attention op is a TypeError, as on the real module), records the call
(name, args, kwargs) and computes the documented CPU meaning of the op, written here
independently of executor/ops/reference.py. So a wrapper that passes a wrong argument (mask
polarity, layout, missing scale, wrong rotary mode, counts as cumsum, ...) gets wrong numbers.

Calls are recorded when made eagerly; inside a dynamo trace the fused ops are traced through
(plain aten ops in the graph) and not recorded, because mutating Python state there would
recompile every step. The SuperKernel scope ops (`air.scope_enter/exit`,
`npu.super_kernel_scope_begin/end`) are real torch ops, as in torchair/torch_npu: they reach
the FX graph and record each time the compiled step executes them (`scope_events`).

Install with `installed()`: it puts both modules in sys.modules, `torch.npu`, and the
"npugraph_ex" dynamo backend, and removes them all afterwards.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.machinery
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends import registry

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


def _define_scope_ops() -> list:
    try:  # this module imported twice under two names must not define the ops twice
        torch.ops.air.scope_enter  # noqa: B018
        raise RuntimeError("tests/npu_doubles.py imported twice: import it one way only")
    except AttributeError:
        pass
    air, npu = torch.library.Library("air", "DEF"), torch.library.Library("npu", "DEF")
    air.define("scope_enter(str[] keys, str[] values) -> ()")
    air.define("scope_exit() -> ()")
    air.impl(
        "scope_enter",
        lambda keys, values: _event("air.scope_enter", tuple(keys), tuple(values)),
        "CompositeExplicitAutograd",
    )
    air.impl("scope_exit", lambda: _event("air.scope_exit"), "CompositeExplicitAutograd")
    npu.define("super_kernel_scope_begin(str name) -> ()")
    npu.define("super_kernel_scope_end(str name) -> ()")
    npu.impl(
        "super_kernel_scope_begin",
        lambda name: _event("npu.super_kernel_scope_begin", name),
        "CompositeExplicitAutograd",
    )
    npu.impl(
        "super_kernel_scope_end", lambda name: _event("npu.super_kernel_scope_end", name), "CompositeExplicitAutograd"
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
def _rms(x, gamma, epsilon):
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
    return gamma * (xf * rstd).to(x.dtype), rstd


def npu_rms_norm(x, gamma, epsilon=1e-6):
    return _rms(x, gamma, epsilon)


def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    x_sum = x1 + x2
    y, rstd = _rms(x_sum, gamma, epsilon)
    return y, rstd, x_sum


def npu_swiglu(x, dim=-1):
    a, b = x.chunk(2, dim=dim)
    return F.silu(a) * b


def npu_rotary_mul(x, r1, r2, rotary_mode="half"):
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    elif rotary_mode == "interleave":
        rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    else:
        raise ValueError(f"rotary_mode {rotary_mode!r}: expected 'half' or 'interleave'")
    return x * r1 + rotated * r2


def npu_fused_infer_attention_score(
    query,
    key,
    value,
    *,
    pse_shift=None,
    atten_mask=None,
    actual_seq_lengths=None,
    actual_seq_lengths_kv=None,
    block_table=None,
    num_heads=1,
    scale=1.0,
    pre_tokens=2147483647,
    next_tokens=2147483647,
    input_layout="BSH",
    num_key_value_heads=0,
    sparse_mode=0,
    inner_precise=0,
    block_size=0,
    softmax_lse_flag=False,
):
    """BNSD/BSND only; atten_mask bool, True = masked out; num_key_value_heads 0 means num_heads."""
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
    if sparse_mode != 0 or pre_tokens != 2147483647 or next_tokens != 2147483647 or pse_shift is not None:
        raise NotImplementedError("double implements sparse_mode=0 without band limits or pse")
    if atten_mask is not None and atten_mask.dtype not in (torch.bool, torch.int8, torch.uint8):
        raise TypeError(f"atten_mask must be bool/int8/uint8, got {atten_mask.dtype}")
    g = num_heads // hkv
    k, v = key.repeat_interleave(g, dim=1).float(), value.repeat_interleave(g, dim=1).float()
    scores = query.float() @ k.transpose(-1, -2) * scale  # (B, N, S, T)
    if atten_mask is not None:
        scores = scores.masked_fill(atten_mask.bool(), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    out = (torch.exp(scores - lse) @ v).to(query.dtype)
    return (out.transpose(1, 2) if input_layout == "BSND" else out), lse


def npu_moe_gating_top_k_softmax(x, finished=None, k=1):
    if finished is not None:
        raise NotImplementedError("double: finished must be None")
    y, idx = torch.topk(torch.softmax(x.float(), dim=-1), k, dim=-1)
    n = x.shape[0]
    row_idx = torch.arange(n * k, dtype=torch.int32).view(k, n).t().contiguous()  # row_idx[i, j] = j*N + i
    return y.to(x.dtype), idx.to(torch.int32), row_idx


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


def npu_grouped_matmul(
    x, weight, *, bias=None, group_list=None, split_item=0, group_type=None, group_list_type=0, output_dtype=None
):
    """Single-tensor form (split_item 2/3) with groups over M: y[s_e:e_e] = x[s_e:e_e] @ W[e]."""
    if not (isinstance(x, list) and isinstance(weight, list) and len(x) == len(weight) == 1):
        raise TypeError("x and weight must be lists holding one tensor each")
    if split_item not in (2, 3) or group_type != 0 or bias is not None:
        raise NotImplementedError("double: split_item 2/3, group_type 0, no bias")
    if group_list.dtype != torch.int64:
        raise TypeError(f"group_list must be int64, got {group_list.dtype}")
    ends = group_list.cumsum(0) if group_list_type == 1 else group_list
    out, start = [], 0
    for e, end in enumerate(ends.tolist()):
        out.append(x[0][start:end] @ weight[0][e])
        start = end
    return [torch.cat(out)]


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
# npugraph_ex options: the keys torchair maps, plus the SuperKernel ones (ascend-apis.md)
NPUGRAPH_EX_OPTIONS = {
    "static_kernel_compile",
    "inplace_pass",
    "input_inplace_pass",
    "remove_noop_ops",
    "graph_dump_type",
    "graph_dump_path",
    "force_eager",
    "pattern_fusion_pass",
    "clone_input",
    "frozen_parameter",
    "post_grad_custom_pre_pass",
    "post_grad_custom_post_pass",
    "use_graph_pool",
    "reuse_graph_pool_in_same_fx",
    "capture_limit",
    "clone_output",
    "super_kernel_optimize",
    "super_kernel_optimize_options",
    "super_kernel_debug_options",
}


class RecordingTorchNpu(types.ModuleType):
    """Fake `torch_npu`: the fused ops, `npu` (also installed as torch.npu), the npugraph_ex backend."""

    def __init__(self, device_name: str = "Ascend910_9392"):
        super().__init__("torch_npu")
        self.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
        self.calls: list[Call] = []
        for fn in _FUSED_OPS:
            setattr(self, fn.__name__, _recording(self.calls, fn.__name__, fn))
        npu = self.npu = _module("torch_npu.npu")
        for name, fn in {
            "get_device_name": lambda device=None: device_name,
            "is_available": lambda: True,
            "device_count": lambda: 1,
            "set_device": lambda device: None,
            "synchronize": lambda device=None: None,
            "super_kernel_scope_begin": lambda name: torch.ops.npu.super_kernel_scope_begin(name),
            "super_kernel_scope_end": lambda name: torch.ops.npu.super_kernel_scope_end(name),
        }.items():
            setattr(npu, name, _recording(self.calls, f"npu.{name}", fn))

    def npugraph_ex_backend(self, gm: torch.fx.GraphModule, example_inputs, options: dict | None = None):
        unknown = sorted(set(options or {}) - NPUGRAPH_EX_OPTIONS)
        if unknown:
            raise ValueError(f"Invalid option {unknown[0]!r}, allowed options: {sorted(NPUGRAPH_EX_OPTIONS)}")
        self.calls.append(Call("npugraph_ex_backend", (gm,), {"options": options}))
        return gm.forward

    def named(self, name: str) -> list[Call]:
        return [c for c in self.calls if c.name == name]


class _Options:
    """Like torchair's NpuBaseConfig: only declared options, each limited to its allowed values."""

    _ALLOWED: dict[str, tuple[Any, tuple]] = {}

    def __init__(self):
        object.__setattr__(self, "_values", {k: default for k, (default, _) in self._ALLOWED.items()})

    def __getattr__(self, key):
        try:
            return self.__dict__["_values"][key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key, value):
        if key not in self._ALLOWED:
            raise ValueError(f"{type(self).__name__} has no option {key}, all options {list(self._ALLOWED)}")
        if value not in self._ALLOWED[key][1]:
            raise ValueError(f"{value!r} not in optional list {list(self._ALLOWED[key][1])}")
        self._values[key] = value


class ExperimentalConfig(_Options):
    _ALLOWED = {
        "frozen_parameter": (False, (True, False)),
        "tiling_schedule_optimize": (False, (True, False)),
        "topology_sorting_strategy": ("DFS", ("BFS", "DFS", "RDFS", "StableRDFS")),
        "enable_single_stream": (False, (True, False)),
    }


class CompilerConfig(_Options):
    _ALLOWED = {"mode": ("max-autotune", ("max-autotune", "reduce-overhead"))}

    def __init__(self):
        super().__init__()
        object.__setattr__(self, "experimental_config", ExperimentalConfig())


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

    def _get_npu_backend(self, *, compiler_config=None, custom_decompositions=None):
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
