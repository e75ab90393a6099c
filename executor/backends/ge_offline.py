"""torchair's real FX-to-GE converter, run on a machine without an NPU (the "GE check" tier).

Why this exists: the NPU adapter (executor/backends/npu.py) can only be run for real on an
Ascend machine, and none exists in CI. But torchair's conversion of an FX graph into a GE graph
is pure Python: only the step after it (handing the serialized graph to GE's C++ runtime) needs
CANN. So we take torchair from the published torch-npu wheel, stand in for its four compiled
extension modules at the C++ boundary, register the torch_npu fused ops our adapter calls under
their real schemas (read from the same wheel), and let the real converter, the real scope pass
and our real adapter run. Conversion ends by writing the GE graph as pbtxt
(`CompilerConfig().debug.graph_dump.type = "pbtxt"`) and then fails where GE would load it;
we catch that failure and parse the dump. What this proves: every FX node found a converter,
which GE op each fused op became, which GE ops carry `_super_kernel_scope`/`_super_kernel_options`.
What it cannot: GE compilation, per-chip kernel support, timing.

Use:
    with OfflineTorchair() as air:              # fetches/extracts the wheel on first use
        from executor.backends import npu       # imports torch_npu -> the stand-in
        npu.install_ops()
        conv = air.convert(lambda: npu.compile_ge(step, mc, True).step, (ids, pos), dump_dir)
        conv.optimized[-1].by_scope()            # {label or None: [GeNode(name, type, inputs, attrs)]}

Process-wide effects. Importing this module does nothing. The first `OfflineTorchair.__enter__`
in a process fetches and extracts the wheel, defines the fused ops in the `npu` op namespace
(real schemas, CPU kernels, fakes) and imports torchair against a stand-in `torch_npu` and
stand-in extension modules; torchair's import defines `air::*` ops (`scope_enter`, ...) and other
namespaces, registers its converters, an atexit hook, SIGINT/SIGTERM handlers and collective
remaps. None of that can be imported twice or unregistered cleanly, so the op definitions and
the torchair module objects stay for the rest of the process (`torch.ops.npu.npu_rms_norm` keeps
existing). `__exit__` removes every torchair/torch_npu/npugraph_ex entry from sys.modules (and
puts back whatever was there), restores the signal handlers, the remaps and `torch.Tensor`, drops
the atexit hook and resets dynamo; a later `__enter__` reinstalls the same module objects. Tests
that also import tests/npu_doubles.py (which defines `air::scope_enter` with another schema) must
run this in a fresh process: `__enter__` refuses with a clear error when it finds a foreign
`air::scope_enter`.
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import importlib
import importlib.machinery
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
import warnings
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

TORCH_NPU_VERSION = "2.14.0"
WHEEL_DIR_ENV = "CANN_RECIPES_TORCH_NPU_WHEEL_DIR"  # where the wheel and its extract are kept
DEFAULT_WHEEL_DIR = Path.home() / ".cache" / "cann-recipes-infer" / "torch_npu_wheel"
TORCHAIR_IN_WHEEL = "torch_npu/dynamo/torchair/"
OPS_YAML_IN_WHEEL = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
# torchair/core/*.so: the C++ boundary. Everything else in torchair is Python and runs for real.
COMPILED_MODULES = ("_torchair", "_npu_graph_executor", "_abi_compat_ge_apis", "_npu_utils")
# The torch_npu fused ops executor/backends/npu.py calls (all registered as `npu::<name>`).
FUSED_OPS = (
    "npu_rms_norm",
    "npu_add_rms_norm",
    "npu_swiglu",
    "npu_rotary_mul",
    "npu_fused_infer_attention_score",
    "npu_moe_gating_top_k_softmax",
    "npu_moe_init_routing",
    "npu_grouped_matmul",
)
# Ops torchair's own pattern passes (torchair/patterns/*.py, on by default in max-autotune) trace
# at registration. Our graphs never contain them, but the passes must run as on the device, so
# they get their real schema and a fake (shape/dtype only); their CPU kernel raises.
PATTERN_OPS = ("npu_dynamic_quant", "npu_add_rms_norm_dynamic_quant", "npu_add_rms_norm_cast", "_npu_dtype_cast")
DEFAULT_SOC = "Ascend910_9392"  # an Atlas A3 chip (the recipes' target); converters branch on the SoC
SK_ATTRS = ("_super_kernel_scope", "_super_kernel_options")  # what torchair stamps on scoped GE ops
# The arguments torchair 2.14.0 gives air::scope_enter (torchair/scope/_scope.py:13, returns None);
# torchair defines it only if absent, so anything registered under that name first (e.g. by a
# test double) would silently replace it.
REAL_SCOPE_ENTER = "air::scope_enter(str[] keys, str[] values, bool need_execute=False)"
_BOUNDARY = "GE C++ boundary reached"  # the message our stand-in load step raises


class GeOfflineError(RuntimeError):
    """The offline converter cannot be set up or did not produce a GE graph; one line saying why."""


class CppBoundaryReached(RuntimeError):
    """Raised by the stand-in for GE's graph load: conversion is complete, the C++ step begins."""


# --------------------------------------------------------------------------- the wheel
def wheel_dir() -> Path:
    return Path(os.environ.get(WHEEL_DIR_ENV) or DEFAULT_WHEEL_DIR).expanduser()


def fetch_wheel(directory: Path | None = None) -> Path:
    """The torch-npu wheel, downloaded once into `directory` with pip (no dependencies).

    Any platform's wheel will do: torchair is pure Python apart from the four core/*.so files
    we replace (the torchair files and the op yaml of the cp311 x86_64 and cp310 aarch64 wheels
    are byte-identical). pip first looks for this platform's wheel; if there is none (another
    OS/arch or Python), it falls back to the Linux x86_64 CPython 3.11 wheel. pip downloads into
    a temporary directory and the wheel is then renamed into place, so a concurrent process never
    picks up half a file.
    """
    directory = directory or wheel_dir()
    directory.mkdir(parents=True, exist_ok=True)
    pattern = f"torch_npu-{TORCH_NPU_VERSION}-*.whl"
    found = sorted(directory.glob(pattern))
    if found:
        return found[0]
    spec = f"torch-npu=={TORCH_NPU_VERSION}"
    fallback = ["--only-binary=:all:", "--platform", "manylinux_2_28_x86_64", "--python-version", "311"]
    error = ""
    for extra in ([], fallback):
        tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=directory))
        try:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(tmp), *extra, spec]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            for wheel in tmp.glob(pattern):
                os.replace(wheel, directory / wheel.name)
                return directory / wheel.name
            lines = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
            error = lines[-1] if lines else f"exit code {proc.returncode}"
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    raise GeOfflineError(
        f"cannot fetch the torch-npu {TORCH_NPU_VERSION} wheel into {directory} "
        f"(`pip download --no-deps {spec}`: {error}); set {WHEEL_DIR_ENV} to a directory holding it"
    )


def extract(wheel: Path) -> Path:
    """Unpack torchair's Python files and the fused-op schema yaml next to the wheel, once.

    The compiled modules are left out on purpose: `import torchair` must find our stand-ins,
    never a .so that needs CANN. The extract is written to a temporary directory and renamed,
    so concurrent processes never see half of it.
    """
    root = wheel.parent / f"extract-{wheel.stem}"
    if (root / "torchair" / "__init__.py").is_file() and (root / Path(OPS_YAML_IN_WHEEL).name).is_file():
        return root
    tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=wheel.parent))
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = zf.namelist()
            if OPS_YAML_IN_WHEEL not in names:
                raise GeOfflineError(f"{wheel.name}: {OPS_YAML_IN_WHEEL} not found; is it a torch-npu wheel?")
            (tmp / Path(OPS_YAML_IN_WHEEL).name).write_bytes(zf.read(OPS_YAML_IN_WHEEL))
            for name in names:
                if not name.startswith(TORCHAIR_IN_WHEEL) or name.endswith("/") or ".so" in Path(name).suffixes:
                    continue
                dest = tmp / "torchair" / name[len(TORCHAIR_IN_WHEEL) :]
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(zf.read(name))
        try:
            tmp.rename(root)
        except OSError:  # another process finished first; use its extract
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root


@dataclass(frozen=True)
class OpSchema:
    """One fused op's schema as the wheel declares it (yaml file and line, for the facts files)."""

    name: str
    schema: str  # e.g. "npu_swiglu(Tensor self, int dim=-1) -> Tensor"
    line: int


def read_schemas(yaml_path: Path, names: Iterable[str] = FUSED_OPS + PATTERN_OPS) -> dict[str, OpSchema]:
    """The `func:` entries of `names` (default overload) in npu_native_functions_by_codegen.yaml.

    Read line by line rather than with a YAML loader because we also want the line number, and
    the first declaration wins (the file repeats some ops in its `symint:` section)."""
    wanted, found = set(names), {}
    for number, line in enumerate(yaml_path.read_text().splitlines(), 1):
        text = line.strip().removeprefix("- ")
        if not text.startswith("func: "):
            continue
        schema = text[len("func: ") :]
        name = schema.split("(", 1)[0]
        if name in wanted and name not in found:
            found[name] = OpSchema(name, schema, number)
    missing = sorted(wanted - set(found))
    if missing:
        raise GeOfflineError(f"{yaml_path}: no schema for {', '.join(missing)}")
    return found


# --------------------------------------------------------------------------- stand-ins: C++ boundary
class _DistinctInts:
    """Stand-in for pybind11 enums such as `_torchair.TorchDataType`: every member a distinct int."""

    def __init__(self, name: str):
        self._name, self._next = name, itertools.count(1)

    def __getattr__(self, member: str) -> int:
        if member.startswith("__"):
            raise AttributeError(member)
        value = next(self._next)
        setattr(self, member, value)
        return value


class _TorchNpuGraphBase:
    """Stand-in for the C++ GE graph: loading it is exactly where conversion ends."""

    def __init__(self, name: str = ""):
        self.name = name

    def load(self, serialized_graph: bytes, options: dict, *args: Any) -> None:
        raise CppBoundaryReached(f"{_BOUNDARY}: GE would load graph {self.name!r} here")

    def compile(self):
        raise CppBoundaryReached(f"{_BOUNDARY}: GE would compile graph {self.name!r} here")

    def run(self, *args):
        raise CppBoundaryReached(f"{_BOUNDARY}: GE would run graph {self.name!r} here")

    def set_hint_shape(self, *args) -> None:
        pass

    def auto_tune(self, *args):
        raise CppBoundaryReached(f"{_BOUNDARY}: GE would auto-tune graph {self.name!r} here")


def _noop(*args, **kwargs) -> None:
    return None


def _compiled_stand_ins() -> dict[str, types.ModuleType]:
    """Python modules in place of torchair/core/*.so. Only what the converter reaches is defined;
    any other attribute is an AttributeError naming the C++ symbol, so a new need is visible."""

    def module(name: str, attrs: dict[str, Any]) -> types.ModuleType:
        mod = types.ModuleType(f"torchair.core.{name}", f"ge_offline stand-in for torchair/core/{name}.so")
        mod.__dict__.update(attrs)

        def missing(attr: str):
            raise AttributeError(f"ge_offline: no stand-in for C++ symbol torchair.core.{name}.{attr}")

        mod.__getattr__ = missing
        return mod

    torchair_so = {
        "TorchNpuGraphBase": _TorchNpuGraphBase,
        "TorchDataType": _DistinctInts("TorchDataType"),  # llm_datadist maps torch dtypes at import
        "InitializeGraphEngine": _noop,  # GE session options: nothing to initialise offline
        "FinalizeGraphEngine": _noop,  # called from torchair's atexit hook
        "SetDebugLogPath": _noop,
        "InitDeviceStdoutChannel": _noop,
        # The GE op registry is C++: "not available" makes torchair skip its auto-generated
        # converters for ops without one (so a missing converter is reported, not invented).
        "get_registered_ir_def": lambda op_type: ("UNAVAILABLE_OFFLINE", [], [], []),
        # "" = this CANN accepts the optional inputs/attrs the converter sets (cannot be checked offline)
        "check_cann_compat": lambda optype, optional_inputs, optional_attrs: "",
    }
    return {
        "_torchair": module("_torchair", torchair_so),
        "_npu_graph_executor": module("_npu_graph_executor", {}),
        "_abi_compat_ge_apis": module("_abi_compat_ge_apis", {}),
        "_npu_utils": module("_npu_utils", {}),
    }


# --------------------------------------------------------------------------- stand-ins: torch_npu ops
# CPU implementations follow executor/ops/reference.py (the documented semantics), plus the
# outputs our models never read (rstd, lse, row ids) with the shapes and dtypes of torch_npu's
# own meta functions (torch_npu/op_plugin/meta/_meta_registrations.py), which the fakes copy.
def _rstd_shape(x: torch.Tensor, gamma: torch.Tensor) -> list[int]:
    return [x.shape[i] if i < x.dim() - gamma.dim() else 1 for i in range(x.dim())]


def _rms(x: torch.Tensor, gamma: torch.Tensor, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + epsilon)
    return gamma * (xf * rstd).to(x.dtype), rstd


def _rms_norm_cpu(x, gamma, epsilon=1e-6):
    return _rms(x, gamma, epsilon)


def _rms_norm_fake(x, gamma, epsilon=1e-6):
    return torch.empty_like(x), x.new_empty(_rstd_shape(x, gamma), dtype=torch.float32)


def _add_rms_norm_cpu(x1, x2, gamma, epsilon=1e-6):
    x_sum = x1 + x2
    y, rstd = _rms(x_sum, gamma, epsilon)
    return y, rstd, x_sum


def _add_rms_norm_fake(x1, x2, gamma, epsilon=1e-6):
    return torch.empty_like(x1), x1.new_empty(_rstd_shape(x1, gamma), dtype=torch.float32), torch.empty_like(x1)


def _swiglu_cpu(x, dim=-1):
    gate, up = x.chunk(2, dim=dim)
    return F.silu(gate) * up


def _swiglu_fake(x, dim=-1):
    shape = list(x.shape)
    shape[dim] //= 2
    return x.new_empty(shape)


def _rotary_mul_cpu(x, r1, r2, rotary_mode="half", rotate=None):
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    elif rotary_mode == "interleave":
        rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    else:
        raise ValueError(f"npu_rotary_mul: rotary_mode {rotary_mode!r}; expected 'half' or 'interleave'")
    return x * r1 + rotated * r2


def _rotary_mul_fake(x, r1, r2, rotary_mode="half", rotate=None):
    return torch.empty_like(x)


def _fia_to_bnsd(t: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BSH":
        b, s, h = t.shape
        return t.view(b, s, heads, h // heads).transpose(1, 2)
    raise NotImplementedError(f"ge_offline npu_fused_infer_attention_score: input_layout {layout!r}")


def _fia_cpu(query, key, value, **kw):
    """Dense masked attention for the layouts BNSD/BSND/BSH; mask True/1 = masked out."""
    unsupported = {k for k, v in kw.items() if k.endswith(("scale1", "scale2", "offset2", "prefix")) and v is not None}
    if unsupported or kw.get("pse_shift") is not None or kw.get("block_table") is not None:
        raise NotImplementedError(f"ge_offline npu_fused_infer_attention_score: {sorted(unsupported)} not implemented")
    if kw.get("sparse_mode", 0) != 0:
        raise NotImplementedError("ge_offline npu_fused_infer_attention_score: sparse_mode != 0 not implemented")
    layout, nq = kw.get("input_layout", "BSH"), kw.get("num_heads", 1)
    nkv = kw.get("num_key_value_heads", 0) or nq
    q, k, v = _fia_to_bnsd(query, layout, nq), _fia_to_bnsd(key, layout, nkv), _fia_to_bnsd(value, layout, nkv)
    k, v = k.repeat_interleave(nq // nkv, dim=1).float(), v.repeat_interleave(nq // nkv, dim=1).float()
    scores = q.float() @ k.transpose(-1, -2) * kw.get("scale", 1.0)  # (B, N, S, T)
    mask = kw.get("atten_mask")
    if mask is not None:
        scores = scores.masked_fill(mask.bool(), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # (B, N, S, 1)
    out = (torch.exp(scores - lse) @ v).to(query.dtype)
    if layout == "BSND":
        out = out.transpose(1, 2)
    elif layout == "BSH":
        out = out.transpose(1, 2).flatten(2)
    if not kw.get("softmax_lse_flag", False):
        lse = torch.empty(0, dtype=torch.float32)  # the op's meta: an empty [0] tensor
    return out.contiguous(), lse.contiguous()


def _fia_fake(query, key, value, **kw):
    layout, nq = kw.get("input_layout", "BSH"), kw.get("num_heads", 1)
    nkv = kw.get("num_key_value_heads", 0) or nq
    dv = value.shape[-1] if layout in ("BNSD", "BSND") else value.shape[-1] // nkv
    if layout == "BNSD":
        out_shape, lse_shape = (*query.shape[:3], dv), (*query.shape[:3], 1)
    elif layout == "BSND":
        out_shape, lse_shape = (*query.shape[:3], dv), (query.shape[0], nq, query.shape[1], 1)
    elif layout == "BSH":
        out_shape, lse_shape = (*query.shape[:2], nq * dv), (query.shape[0], nq, query.shape[1], 1)
    else:
        raise NotImplementedError(f"ge_offline npu_fused_infer_attention_score: input_layout {layout!r}")
    lse = query.new_empty(lse_shape if kw.get("softmax_lse_flag", False) else (0,), dtype=torch.float32)
    return query.new_empty(out_shape), lse


def _gating_cpu(x, finished=None, k=1):
    if finished is not None:
        raise NotImplementedError("ge_offline npu_moe_gating_top_k_softmax: finished must be None")
    y, idx = torch.topk(torch.softmax(x.float(), dim=-1), k, dim=-1)
    n = x.shape[0]
    row_idx = torch.arange(n * k, dtype=torch.int32).view(k, n).t().contiguous()  # row_idx[i, j] = j*N + i
    return y.to(x.dtype), idx.to(torch.int32), row_idx


def _gating_fake(x, finished=None, k=1):
    shape = (*x.shape[:-1], k)
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.int32), x.new_empty(shape, dtype=torch.int32)


def _init_routing_cpu(x, row_idx, expert_idx, active_num):
    """Stable sort of the (token, slot) pairs by expert; expanded_row_idx[row id] = destination row."""
    n, k = expert_idx.shape
    order = torch.sort(expert_idx.reshape(-1), stable=True)
    dst_to_src = row_idx.reshape(-1).long()[order.indices]
    expanded_row_idx = torch.empty(n * k, dtype=torch.int32)
    expanded_row_idx[dst_to_src] = torch.arange(n * k, dtype=torch.int32)
    rows = min(active_num, n) * k
    return x[dst_to_src[:rows] % n], expanded_row_idx, order.values.to(torch.int32)


def _init_routing_fake(x, row_idx, expert_idx, active_num):
    n, k = x.shape[0], row_idx.shape[1]
    return x.new_empty(min(n, active_num) * k, x.shape[1]), row_idx.new_empty(n * k), row_idx.new_empty(n * k)


def _grouped_matmul_cpu(x, weight, **kw):
    """The single-tensor forms (split_item 2/3, group_type 0): y[s_e:e_e] = x[s_e:e_e] @ W[e]."""
    if kw.get("split_item") not in (2, 3) or kw.get("group_type") != 0 or len(x) != 1 or len(weight) != 1:
        raise NotImplementedError("ge_offline npu_grouped_matmul: only split_item 2/3, group_type 0, one x, one W")
    group_list = kw["group_list"]
    ends = group_list.cumsum(0) if kw.get("group_list_type", 0) == 1 else group_list
    out, start = [], 0
    for e, end in enumerate(ends.tolist()):
        out.append(x[0][start:end] @ weight[0][e])
        start = end
    return [torch.cat(out)]


def _grouped_matmul_fake(x, weight, **kw):
    if kw.get("split_item") not in (2, 3) or kw.get("group_type") != 0:
        raise NotImplementedError("ge_offline npu_grouped_matmul: only split_item 2/3, group_type 0")
    return [x[0].new_empty(sum(t.shape[0] for t in x), weight[0].shape[-1])]


def _dynamic_quant_fake(x, *, smooth_scales=None, group_index=None, dst_type=None, quant_mode="pertoken", **kw):
    if dst_type not in (None, 1) or quant_mode != "pertoken":  # 1 = torch_npu's enum value of int8
        raise NotImplementedError("ge_offline npu_dynamic_quant: only int8 per-token")
    return torch.empty_like(x, dtype=torch.int8), x.new_empty(x.shape[:-1], dtype=torch.float32)


def _add_rms_norm_dynamic_quant_fake(x1, x2, gamma, *, smooth_scale1=None, smooth_scale2=None, output_mask=None, **kw):
    if kw.get("y_dtype") not in (None, 1):
        raise NotImplementedError("ge_offline npu_add_rms_norm_dynamic_quant: only int8 outputs")
    y1, y2 = (True, smooth_scale1 is not None and smooth_scale2 is not None) if output_mask is None else output_mask
    shape, rows = x1.shape, x1.shape[:-1]
    return (
        x1.new_empty(shape if y1 else (0,), dtype=torch.int8),
        x1.new_empty(shape if y2 else (0,), dtype=torch.int8),
        torch.empty_like(x1),
        x1.new_empty(rows if y1 else (0,), dtype=torch.float32),
        x1.new_empty(rows if y2 else (0,), dtype=torch.float32),
    )


def _add_rms_norm_cast_fake(x1, x2, gamma, epsilon=1e-6):
    rstd = x1.new_empty(_rstd_shape(x1, gamma), dtype=torch.float32)
    return torch.empty_like(x1, dtype=torch.float32), torch.empty_like(x1), rstd, torch.empty_like(x1)


def _dtype_cast_fake(x, dtype):
    return torch.empty_like(x, dtype=dtype)


def _pattern_only(name: str) -> Callable:
    def cpu(*args, **kwargs):
        raise NotImplementedError(f"ge_offline: npu::{name} is registered for torchair's pattern passes only")

    return cpu


_IMPLS: dict[str, tuple[Callable, Callable]] = {
    **{
        name: (_pattern_only(name), fake)
        for name, fake in (
            ("npu_dynamic_quant", _dynamic_quant_fake),
            ("npu_add_rms_norm_dynamic_quant", _add_rms_norm_dynamic_quant_fake),
            ("npu_add_rms_norm_cast", _add_rms_norm_cast_fake),
            ("_npu_dtype_cast", _dtype_cast_fake),
        )
    },
    "npu_rms_norm": (_rms_norm_cpu, _rms_norm_fake),
    "npu_add_rms_norm": (_add_rms_norm_cpu, _add_rms_norm_fake),
    "npu_swiglu": (_swiglu_cpu, _swiglu_fake),
    "npu_rotary_mul": (_rotary_mul_cpu, _rotary_mul_fake),
    "npu_fused_infer_attention_score": (_fia_cpu, _fia_fake),
    "npu_moe_gating_top_k_softmax": (_gating_cpu, _gating_fake),
    "npu_moe_init_routing": (_init_routing_cpu, _init_routing_fake),
    "npu_grouped_matmul": (_grouped_matmul_cpu, _grouped_matmul_fake),
}


def _register_fused_ops(schemas: dict[str, OpSchema]) -> torch.library.Library:
    """Define `npu::<op>` with the wheel's schema, a CPU kernel and a fake (for dynamo/AOT)."""
    lib = torch.library.Library("npu", "FRAGMENT")  # FRAGMENT: torch_npu's own namespace style
    for name, op in schemas.items():
        if hasattr(torch.ops.npu, name):
            raise GeOfflineError(f"torch.ops.npu.{name} is already defined in this process; run in a fresh process")
        lib.define(op.schema)
        cpu, fake = _IMPLS[name]
        lib.impl(name, cpu, "CPU")
        torch.library.register_fake(f"npu::{name}", fake, lib=lib)
    return lib


class _Flag:
    allow_hf32 = False


def _torch_npu_stand_in(soc: str) -> dict[str, types.ModuleType]:
    """`torch_npu` as torchair and our adapter see it: the fused ops are `torch.ops.npu.*`
    (torch_npu exports them the same way) and `torch_npu.npu` has the few queries torchair makes
    while converting. Anything else is missing on purpose (AttributeError).

    `soc` matters: converters ask torch_npu.npu.get_device_name() (torchair/_utils/check_platform.py,
    is_arch35) and emit other GE ops on Ascend950 (e.g. RotaryPositionEmbedding, not RotaryMul)."""
    tnpu = types.ModuleType("torch_npu", "ge_offline stand-in for torch_npu (no device)")
    tnpu.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)  # importlib.util.find_spec needs one
    tnpu.__version__ = TORCH_NPU_VERSION
    for name in FUSED_OPS:
        setattr(tnpu, name, getattr(torch.ops.npu, name))
    npu = types.ModuleType("torch_npu.npu")
    npu.__spec__ = importlib.machinery.ModuleSpec("torch_npu.npu", None)
    npu.current_device = lambda: 0  # torchair: GE option ge.exec.deviceId
    npu.get_device_name = lambda device=None: soc  # torchair converters: is_arch35()
    npu.is_available = lambda: False  # honest: there is no device (executor.platform must not pick npu)
    npu.matmul, npu.conv = _Flag(), _Flag()  # torchair: GE option ge.exec.allow_hf32
    npu._get_deterministic_level = lambda: 0  # torchair: ge.deterministicLevel, cache_compile key
    tnpu.npu = npu
    return {"torch_npu": tnpu, "torch_npu.npu": npu}


# --------------------------------------------------------------------------- GE graph (parsed dump)
@dataclass
class GeNode:
    name: str
    type: str
    inputs: list[str]
    attrs: dict[str, Any]  # "_super_kernel_scope": "layer_0_attn", "epsilon": 1e-06, ...

    @property
    def scope(self) -> str | None:
        return self.attrs.get("_super_kernel_scope")

    @property
    def scope_options(self) -> str | None:
        return self.attrs.get("_super_kernel_options")


@dataclass
class GeGraph:
    name: str  # "dynamo_original_graph_0", "dynamo_optimized_graph_0"
    path: Path
    nodes: list[GeNode]

    def by_scope(self) -> dict[str | None, list[GeNode]]:
        """Nodes grouped by `_super_kernel_scope` (None = outside every scope), graph order."""
        groups: dict[str | None, list[GeNode]] = {}
        for node in self.nodes:
            groups.setdefault(node.scope, []).append(node)
        return groups

    def types(self) -> set[str]:
        return {n.type for n in self.nodes}


def _attr_value(attr) -> Any:
    """A torchair AttrDef message as a plain Python value."""
    kind = attr.WhichOneof("value")
    if kind in ("s", "bt"):
        return getattr(attr, kind).decode(errors="replace")
    if kind in ("i", "f", "b", "dt"):
        return getattr(attr, kind)
    if kind == "list":
        lv = attr.list
        for name in ("s", "i", "f", "b", "dt"):
            values = list(getattr(lv, name))
            if values:
                return [v.decode(errors="replace") if isinstance(v, bytes) else v for v in values]
        return []
    return str(attr).strip()


def parse_pbtxt(path: Path) -> GeGraph:
    """Parse torchair's pbtxt dump (`node { name op input* attr { key value { s: <AttrDef text> } } }`).

    torchair writes every attribute value as the text form of its AttrDef message, quoted as a
    Python bytes literal; we decode that literal and parse it with torchair's own AttrDef class,
    so types (string, int, float, list) come back as they were set."""
    from google.protobuf import text_format

    attr_def = importlib.import_module("torchair._ge_concrete_graph.ge_ir_pb2").AttrDef
    nodes: list[GeNode] = []
    node: GeNode | None = None
    key = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line == "node {":
            node = GeNode("", "", [], {})
            nodes.append(node)
        elif node is None or line in ("}", "attr {", "value {"):
            continue
        elif line.startswith("name: "):
            node.name = ast.literal_eval(line[6:])
        elif line.startswith("op: "):
            node.type = ast.literal_eval(line[4:])
        elif line.startswith("input: "):
            node.inputs.append(ast.literal_eval(line[7:]))
        elif line.startswith("key: "):
            key = ast.literal_eval(line[5:])
        elif line.startswith("s: ") and key is not None:
            text = ast.literal_eval("b" + line[3:]).decode(errors="replace")
            if not key.startswith(("[i]", "[o]")):  # tensor descriptors: not needed here
                msg = attr_def()
                text_format.Parse(text, msg)
                node.attrs[key] = _attr_value(msg)
            key = None
    return GeGraph(path.name.split("_rank_")[0], path, nodes)


# --------------------------------------------------------------------------- conversion result
@dataclass
class FxCheck:
    """The aten-level FX graph torchair converts (seen by a read-only post-grad pass)."""

    targets: list[str] = field(default_factory=list)  # every call_function target, graph order
    without_converter: list[str] = field(default_factory=list)  # targets torchair has no converter for


@dataclass
class Conversion:
    graphs: list[GeGraph]  # parsed dumps, oldest first
    fx: list[FxCheck]  # one per FX graph dynamo handed to torchair
    seconds: float  # wall time from the first call to the C++ boundary
    boundary: str  # the stand-in's message: proof conversion finished and GE load was next
    configs: list[Any]  # the CompilerConfig objects torchair received (after our dump settings)

    @property
    def optimized(self) -> list[GeGraph]:
        """The graphs as they would be handed to GE (after torchair's GE graph passes)."""
        return [g for g in self.graphs if g.name.startswith("dynamo_optimized")]


# --------------------------------------------------------------------------- install / convert
_PREFIXES = ("torchair", "torch_npu", "npugraph_ex")  # top-level names whose sys.modules entries we own


@dataclass
class _Loaded:
    """torchair as imported the first time in this process. torchair cannot be imported twice in
    one process (its modules define torch ops only if absent and then import names that only the
    first import defines), and torch keys converters on our op objects, so the modules and our op
    library are kept for the whole process and put back into sys.modules by every later install."""

    root: Path
    schemas: dict[str, OpSchema]
    lib: torch.library.Library
    modules: dict[str, types.ModuleType]


_LOADED: list[_Loaded] = []  # at most one


def _owned(name: str) -> bool:
    return name.split(".")[0] in _PREFIXES


class OfflineTorchair:
    """Context manager: the real torchair, with stand-ins only at the C++ boundary (see module doc)."""

    def __init__(self, directory: Path | None = None, soc: str = DEFAULT_SOC):
        self.directory, self.soc = directory, soc
        self.root: Path | None = None
        self.schemas: dict[str, OpSchema] = {}
        self.torchair: types.ModuleType | None = None
        self._saved_modules: dict[str, types.ModuleType] = {}
        self._saved_signals: dict[int, Any] = {}
        self._saved_remaps: dict | None = None
        self._added_is_npu = False

    # ----------------------------------------------------------------- install
    def __enter__(self) -> OfflineTorchair:
        if not _LOADED:
            self._check_air_namespace()
        self._saved_modules = {k: v for k, v in sys.modules.items() if _owned(k)}
        self._saved_signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        from torch.distributed import _functional_collectives as fc

        self._saved_remaps = dict(fc.traceable_collective_remaps)
        try:
            for name in self._saved_modules:
                del sys.modules[name]
            if not hasattr(torch.Tensor, "is_npu"):  # torch_npu adds it; torchair asks it of every graph input
                torch.Tensor.is_npu = property(lambda t: False)  # CPU tensors: torchair skips NPU formats
                self._added_is_npu = True
            loaded = _LOADED[0] if _LOADED else self._first_import()
            sys.modules.update(loaded.modules)
            sys.modules["torch_npu.npu"].get_device_name = lambda device=None: self.soc  # converters: is_arch35()
            self.root, self.schemas, self.torchair = loaded.root, loaded.schemas, loaded.modules["torchair"]
        except BaseException:
            self.__exit__()
            raise
        return self

    def _first_import(self) -> _Loaded:
        root = extract(fetch_wheel(self.directory))
        schemas = read_schemas(root / Path(OPS_YAML_IN_WHEEL).name)
        lib = _register_fused_ops(schemas)
        sys.modules.update(_torch_npu_stand_in(self.soc))
        sys.modules.update({f"torchair.core.{name}": mod for name, mod in _compiled_stand_ins().items()})
        sys.path.insert(0, str(root))
        try:
            air = importlib.import_module("torchair")
        finally:
            sys.path.remove(str(root))
        if Path(air.__file__).resolve().parent != (root / "torchair").resolve():
            raise GeOfflineError(f"imported torchair from {air.__file__}, not from {root}")
        for name in COMPILED_MODULES:  # `from . import _torchair` binds the parent attribute; bind all four
            setattr(sys.modules["torchair.core"], name, sys.modules[f"torchair.core.{name}"])
        with warnings.catch_warnings():
            # torchair imports its custom-op converters lazily, one module per torch_npu op, and warns
            # for each op this stand-in lacks (sparse_flash_attention, ...). Import them now, quietly:
            # a converter missing for an op in OUR graph is reported per graph by FxCheck instead.
            warnings.filterwarnings("ignore", "Failed to import torchair", UserWarning)
            importlib.import_module("torchair._ge_concrete_graph.ge_converter.custom")
        # torchair's import registers a device-session atexit hook (GE finalize): not ours to keep.
        atexit.unregister(importlib.import_module("torchair.core._backend").finalize_graph_engine)
        loaded = _Loaded(root, schemas, lib, {k: v for k, v in sys.modules.items() if _owned(k)})
        _LOADED.append(loaded)
        return loaded

    def __exit__(self, *exc) -> None:
        if _LOADED and self.torchair is not None:  # keep what torchair imported lazily meanwhile, too
            _LOADED[0].modules.update({k: v for k, v in sys.modules.items() if _owned(k)})
        for name in [k for k in sys.modules if _owned(k)]:
            del sys.modules[name]
        sys.modules.update(self._saved_modules)
        for sig, handler in self._saved_signals.items():  # torchair's import installs SIGINT/SIGTERM handlers
            signal.signal(sig, handler)
        if self._saved_remaps is not None:  # ... and patches torch.distributed's traceable collectives
            from torch.distributed import _functional_collectives as fc

            fc.traceable_collective_remaps.clear()
            fc.traceable_collective_remaps.update(self._saved_remaps)
        if self._added_is_npu:
            del torch.Tensor.is_npu
            self._added_is_npu = False
        torch._dynamo.reset()  # compiled code refers to torchair's backend: never reuse it
        self.torchair = None

    @staticmethod
    def _check_air_namespace() -> None:
        packet = getattr(torch.ops.air, "scope_enter", None) if hasattr(torch.ops, "air") else None
        if packet is None:
            return
        schema = str(packet.default._schema)
        if schema.split(" -> ")[0] != REAL_SCOPE_ENTER:
            raise GeOfflineError(
                f"torch.ops.air.scope_enter is already defined in this process as {schema!r} (a test double?), "
                f"and torchair would reuse it instead of its own {REAL_SCOPE_ENTER!r}: run the GE check in a "
                "fresh process"
            )

    # ----------------------------------------------------------------- convert
    @contextlib.contextmanager
    def dumping(self, dump_dir: Path):
        """While active, every `torchair.get_npu_backend(compiler_config=cfg)` and
        `torchair.inference.cache_compile(func, config=cfg, ...)` call (ours or the adapter's) gets
        `cfg` with a pbtxt graph dump into `dump_dir` and a read-only post-grad pass that records
        the FX targets and which have no converter. Yields (configs, fx checks)."""
        air = self.torchair
        if air is None:
            raise GeOfflineError("OfflineTorchair is not installed (use it as a context manager)")
        fx2ge = importlib.import_module("torchair._ge_concrete_graph.fx2ge_converter")
        fx_compiler = importlib.import_module("torchair.npu_fx_compiler")
        real_get = air.get_npu_backend
        configs: list[Any] = []
        checks: list[FxCheck] = []

        def needs_converter(target) -> bool:
            """torchair's own dispatch (npu_fx_compiler._NpuGraphConverter._wrap and
            GeConcreteGraph._parse_node_internal): Python builtins other than binary operators run
            in Python, scope/record/wait and sym_stride/storage_offset are handled in place."""
            if fx_compiler.is_builtin_callable(target) and not fx_compiler._is_binary_operator(target):
                return False
            return str(target) not in fx2ge._SPECIAL_TARGETS | {
                "aten.sym_stride.int",
                "aten.sym_storage_offset.default",
            }

        def has_converter(target) -> bool:
            return hasattr(target, "_ge_converter") or fx2ge._get_converter(target) is not None

        def observe(gm: torch.fx.GraphModule) -> None:
            check = FxCheck()
            for node in gm.graph.nodes:
                if node.op != "call_function":
                    continue
                target = node.target
                if str(target) == "auto_functionalized_v2":  # converted by the op it wraps
                    target = node.args[0]
                check.targets.append(str(node.target))
                if needs_converter(target) and not has_converter(target) and str(target) not in check.without_converter:
                    check.without_converter.append(str(target))
            checks.append(check)

        def instrument(cfg):
            cfg = cfg if cfg is not None else air.CompilerConfig()
            cfg.debug.graph_dump.type = "pbtxt"
            cfg.debug.graph_dump.path = str(dump_dir)
            previous = cfg.post_grad_custom_post_pass.value

            def post_pass(gm, *rest):
                if previous is not None:
                    previous(gm, *rest)
                observe(gm)

            cfg.post_grad_custom_post_pass = post_pass
            configs.append(cfg)
            return cfg

        def get_npu_backend(*, compiler_config=None, custom_decompositions=None):
            return real_get(
                compiler_config=instrument(compiler_config), custom_decompositions=custom_decompositions or {}
            )

        def cache_compile(func, *, config=None, **kwargs):
            # torchair.inference.cache_compile builds its backend internally (not via get_npu_backend).
            # Note: the post pass is part of its cache key (torchair digests post_grad_custom_post_pass).
            return real_cache_compile(func, config=instrument(config), **kwargs)

        dump_dir.mkdir(parents=True, exist_ok=True)
        real_cache_compile = air.inference.cache_compile
        air.get_npu_backend, air.inference.cache_compile = get_npu_backend, cache_compile
        try:
            yield configs, checks
        finally:
            air.get_npu_backend, air.inference.cache_compile = real_get, real_cache_compile

    def convert(self, make_step: Callable[[], Callable], args: tuple, dump_dir: Path) -> Conversion:
        """Build a compiled step with `make_step()` (e.g. the adapter's compile_ge(...).step, or
        torch.compile with `torchair.get_npu_backend`), call it once with `args`, and return the
        GE graphs torchair dumped before the C++ load step. A failure before that step is a
        GeOfflineError naming the FX targets without a converter when there are any, else it
        propagates as raised."""
        dump_dir = Path(dump_dir)
        before = set(dump_dir.glob("*.pbtxt")) if dump_dir.is_dir() else set()
        # catch_warnings: torchair's config check sets a process-wide "once" filter for UserWarning
        with self.dumping(dump_dir) as (configs, checks), warnings.catch_warnings():
            step = make_step()
            t0 = time.perf_counter()
            try:
                step(*args)
            except Exception as exc:  # torchair wraps errors; find our stand-in's message in the chain
                boundary = _find_boundary(exc)
                missing = sorted({t for check in checks for t in check.without_converter})
                if boundary is None and missing:
                    raise GeOfflineError(f"FX targets without a GE converter: {', '.join(missing)}") from exc
                if boundary is None:
                    raise
            else:  # e.g. a cache_compile hit that ran a graph saved earlier, or a backend that is not torchair
                raise GeOfflineError("the compiled step ran without reaching GE's load step: nothing was converted")
            seconds = time.perf_counter() - t0
        dumps = sorted(set(dump_dir.glob("*.pbtxt")) - before, key=lambda p: p.stat().st_mtime_ns)
        if not dumps:
            raise GeOfflineError(f"conversion reached the GE load step but wrote no pbtxt into {dump_dir}")
        return Conversion([parse_pbtxt(p) for p in dumps], checks, seconds, boundary, configs)


def _find_boundary(exc: BaseException | None) -> str | None:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, CppBoundaryReached) or _BOUNDARY in str(exc):
            return str(exc).splitlines()[0] if str(exc) else _BOUNDARY
        exc = exc.__cause__ or exc.__context__
    return None
