"""torchair's real FX-to-GE converter, run on a machine without an NPU (the GE check).

Why this exists: the NPU adapter (executor/backends/npu.py) can only run for real on an Ascend
machine, and none exists in CI. But torchair's conversion of an FX graph into a GE graph is pure
Python: only the step after it (handing the serialized graph to GE's C++ runtime) needs CANN.
So we take torchair from the published torch-npu wheel and stand in for what is compiled code
or device state, and nothing else:

- torchair/core/*.so (the C++ boundary): Python modules whose graph `load` raises
  CppBoundaryReached; every other symbol the converter reaches is a no-op or a distinct int;
- torch_npu itself (it needs CANN to import): a skeleton with the device queries torchair and
  the op metas ask (SoC name and version, CANN version, determinism level).

Real, from the same wheel: torchair, every torch_npu custom op schema
(torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml, its `custom:` section) and torch_npu's
own meta functions (torch_npu/op_plugin/meta/_meta_registrations.py), which give dynamo and
torchair the real output shapes and dtypes. Our adapter runs unchanged on top: its
CompilerConfig (npu.ge_compiler_config) gets a pbtxt graph dump and a read-only post-grad pass
(`OfflineTorchair.instrument`), the decode step's first call converts the graph, and the stand-in
stops it where GE would load it. What this proves: every FX node found a converter, which GE op
each fused op became, which GE ops carry `_super_kernel_scope`/`_super_kernel_options`. What it
cannot: GE compilation, per-chip kernel support, timing.

Process-wide and one-way: `OfflineTorchair.install()` fetches and extracts the wheel (once per
machine), defines the `npu::` ops, puts the stand-ins in sys.modules and imports torchair. None
of that can be undone (torchair defines torch ops only if absent and cannot be imported twice),
so the GE check runs in a process of its own (tools/ge_check.py; the tests start it as a
subprocess). It refuses to start where `air::scope_enter` already exists with another schema
(e.g. the recording doubles of tests/npu_doubles.py were imported).
"""

from __future__ import annotations

import atexit
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from executor.backends.ge_dump import GeGraph, parse_pbtxt

TORCH_NPU_VERSION = "2.14.0"
WHEEL_DIR_ENV = "CANN_RECIPES_TORCH_NPU_WHEEL_DIR"  # where the wheel and its extract are kept
DEFAULT_WHEEL_DIR = Path.home() / ".cache" / "cann-recipes-infer" / "torch_npu_wheel"
TORCHAIR_IN_WHEEL = "torch_npu/dynamo/torchair/"
OPS_YAML_IN_WHEEL = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
METAS_IN_WHEEL = "torch_npu/op_plugin/meta/_meta_registrations.py"
# torchair/core/*.so: the C++ boundary. Everything else in torchair is Python and runs for real.
COMPILED_MODULES = ("_torchair", "_npu_graph_executor", "_abi_compat_ge_apis", "_npu_utils")
DEFAULT_SOC = "Ascend910_9392"  # an Atlas A3 chip (the recipes' target); converters branch on the SoC
# torch_npu's SocVersion numbers the metas compare against (torch_npu/_inductor/config.py:
# Ascend910B1 = 220, Ascend910_9391 = 250, Ascend950 = 260).
SOC_VERSIONS = (("Ascend950", 260), ("Ascend910_95", 260), ("Ascend910_93", 250), ("Ascend910B", 220))
ASSUMED_CANN = "8.3.RC2"  # no toolkit here; the metas of the ops we use do not depend on it
# The arguments torchair 2.14.0 gives air::scope_enter (torchair/scope/_scope.py:13); torchair
# defines it only if absent, so anything registered under that name first would replace it.
REAL_SCOPE_ENTER = "air::scope_enter(str[] keys, str[] values, bool need_execute=False)"
_BOUNDARY = "GE C++ boundary reached"  # the message our stand-in load step raises


class GeOfflineError(RuntimeError):
    """The offline converter cannot be set up or did not produce a GE graph; one line saying why."""


class ConversionFailed(GeOfflineError):
    """The graph did not convert: FX targets without a GE converter (`missing`), or no GE graph written."""

    def __init__(self, message: str, missing: list[str] | None = None):
        super().__init__(message)
        self.missing = missing or []


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
    """Unpack torchair's Python files, the op schema yaml and the op metas next to the wheel, once.

    The compiled modules are left out on purpose: `import torchair` must find our stand-ins,
    never a .so that needs CANN. The extract is written to a temporary directory and renamed,
    so concurrent processes never see half of it.
    """
    root = wheel.parent / f"extract-{wheel.stem}"
    files = (OPS_YAML_IN_WHEEL, METAS_IN_WHEEL)
    if (root / "torchair" / "__init__.py").is_file() and all((root / Path(f).name).is_file() for f in files):
        return root
    tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=wheel.parent))
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = zf.namelist()
            for wanted in files:
                if wanted not in names:
                    raise GeOfflineError(f"{wheel.name}: {wanted} not found; is it a torch-npu wheel?")
                (tmp / Path(wanted).name).write_bytes(zf.read(wanted))
            for name in names:
                if not name.startswith(TORCHAIR_IN_WHEEL) or name.endswith("/") or ".so" in Path(name).suffixes:
                    continue
                dest = tmp / "torchair" / name[len(TORCHAIR_IN_WHEEL) :]
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(zf.read(name))
        shutil.rmtree(root, ignore_errors=True)  # an extract of an older layout of this file
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
    """One torch_npu custom op's schema as the wheel declares it (with the yaml line, for the facts files)."""

    name: str  # "npu_swiglu", or "npu_fused_infer_attention_score.out" for an overload
    schema: str  # e.g. "npu_swiglu(Tensor self, int dim=-1) -> Tensor"
    line: int


def read_schemas(yaml_path: Path) -> dict[str, OpSchema]:
    """Every `func:` of the yaml's `custom:` section (torch_npu's own `npu::` ops), first declaration wins.

    Read line by line rather than with a YAML loader because we also want the line number; the
    other sections name aten ops NPU implements, which torch already defines."""
    found: dict[str, OpSchema] = {}
    section = ""
    for number, line in enumerate(yaml_path.read_text().splitlines(), 1):
        if line and not line.startswith((" ", "-")):
            section = line.split(":", 1)[0]
            continue
        text = line.strip().removeprefix("- ")
        if section != "custom" or not text.startswith("func: "):
            continue
        schema = text[len("func: ") :]
        found.setdefault(schema.split("(", 1)[0], OpSchema(schema.split("(", 1)[0], schema, number))
    if "npu_fused_infer_attention_score" not in found:
        raise GeOfflineError(f"{yaml_path}: no custom op schemas found (not torch-npu's codegen yaml?)")
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


def _module(name: str, attrs: dict[str, Any], strict: bool = True) -> types.ModuleType:
    """A stand-in module. strict: any attribute not given is an AttributeError naming it, so a
    new need of torchair or the metas is visible instead of silently invented."""
    mod = types.ModuleType(name, f"ge_offline stand-in for {name}")
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)  # importlib.util.find_spec needs one
    mod.__dict__.update(attrs)
    if strict:

        def missing(attr: str):
            raise AttributeError(f"ge_offline: no stand-in for {name}.{attr}")

        mod.__getattr__ = missing
    return mod


def _compiled_stand_ins() -> dict[str, types.ModuleType]:
    """Python modules in place of torchair/core/*.so."""
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
    mods = {"_torchair": torchair_so, "_npu_graph_executor": {}, "_abi_compat_ge_apis": {}, "_npu_utils": {}}
    return {f"torchair.core.{name}": _module(f"torchair.core.{name}", attrs) for name, attrs in mods.items()}


class _Flag:
    allow_hf32 = False


def _soc_version(soc: str) -> int:
    return next((v for prefix, v in SOC_VERSIONS if soc.startswith(prefix)), 0)


def _torch_npu_stand_in(soc: str, schemas: dict[str, OpSchema]) -> dict[str, types.ModuleType]:
    """`torch_npu` as torchair, the op metas and our adapter see it: the custom ops as
    `torch_npu.<op>` (torch_npu exports them the same way) and the device queries they make.

    `soc` matters: converters ask torch_npu.npu.get_device_name() (torchair/_utils/check_platform.py,
    is_arch35) and emit other GE ops on Ascend950 (e.g. RotaryPositionEmbedding, not RotaryMul)."""
    ops = {name: getattr(torch.ops.npu, name) for name in schemas if "." not in name}
    # torch_npu's own dtypes (referenced by the metas of quantised ops): distinct placeholders
    dtypes = {n: object() for n in ("hifloat8", "float4_e2m1fn_x2", "float4_e1m2fn_x2", "float8_e8m0fnu", "int4")}
    npu_utils = _module(
        "torch_npu.npu.utils", {"get_cann_version": lambda module="CANN": ASSUMED_CANN, "_is_gte_cann_version": _noop}
    )
    npu = _module(
        "torch_npu.npu",
        {
            "current_device": lambda: 0,  # torchair: GE option ge.exec.deviceId
            "get_device_name": lambda device=None: soc,  # torchair converters: is_arch35()
            "is_available": lambda: False,  # honest: there is no device
            "matmul": _Flag(),  # torchair: GE option ge.exec.allow_hf32
            "conv": _Flag(),
            "_get_deterministic_level": lambda: 0,  # torchair: ge.deterministicLevel
            "utils": npu_utils,
        },
    )
    error_code = _module(
        "torch_npu.utils._error_code", {"ErrCode": _DistinctInts("ErrCode"), "ops_error": lambda *a: ""}
    )
    tnpu = _module("torch_npu", {"__version__": TORCH_NPU_VERSION, "npu": npu, **ops, **dtypes})
    return {
        "torch_npu": tnpu,
        "torch_npu.npu": npu,
        "torch_npu.npu.utils": npu_utils,
        "torch_npu.npu._backends": _module("torch_npu.npu._backends", {"get_soc_version": lambda: _soc_version(soc)}),
        "torch_npu.utils": _module("torch_npu.utils", {"_error_code": error_code}),
        "torch_npu.utils._error_code": error_code,
    }


def _define_ops(schemas: dict[str, OpSchema]) -> torch.library.Library:
    """Define every `npu::` op with the wheel's schema. No CPU kernel: nothing runs eagerly here."""
    defined = sorted(
        {op.name.split(".")[0] for op in schemas.values() if hasattr(torch.ops.npu, op.name.split(".")[0])}
    )
    if defined:
        raise GeOfflineError(f"torch.ops.npu.{defined[0]} is already defined in this process; run in a fresh process")
    lib = torch.library.Library("npu", "FRAGMENT")  # FRAGMENT: torch_npu's own namespace style
    for op in schemas.values():
        lib.define(op.schema)
    return lib


def _run_metas(metas: Path) -> None:
    """Execute the wheel's meta registrations (the shapes/dtypes torch_npu itself gives dynamo),
    unchanged, as the module torch_npu imports them as."""
    module = types.ModuleType("torch_npu.op_plugin.meta._meta_registrations")
    module.__file__ = str(metas)
    sys.modules[module.__name__] = module
    exec(compile(metas.read_text(), str(metas), "exec"), module.__dict__)


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

    @property
    def optimized(self) -> list[GeGraph]:
        """The graphs as they would be handed to GE (after torchair's GE graph passes)."""
        return [g for g in self.graphs if g.name.startswith("dynamo_optimized")]

    @property
    def without_converter(self) -> list[str]:
        return sorted({t for check in self.fx for t in check.without_converter})


# --------------------------------------------------------------------------- install / convert
class OfflineTorchair:
    """The real torchair, with stand-ins only at the C++ boundary (see the module docstring)."""

    _installed: OfflineTorchair | None = None

    def __init__(self, root: Path, schemas: dict[str, OpSchema], lib: torch.library.Library, soc: str):
        self.root, self.schemas, self.soc, self._lib = root, schemas, soc, lib
        self.torchair = sys.modules["torchair"]

    @classmethod
    def install(cls, directory: Path | None = None, soc: str = DEFAULT_SOC) -> OfflineTorchair:
        """Import torchair from the wheel into this process (once; later calls return the same object)."""
        if cls._installed is not None:
            if cls._installed.soc != soc:
                raise GeOfflineError(f"torchair is installed for SoC {cls._installed.soc}; start a new process")
            return cls._installed
        _check_air_namespace()
        if any(name.split(".")[0] in ("torch_npu", "torchair") for name in sys.modules):
            raise GeOfflineError("torch_npu or torchair is already imported in this process; run in a fresh process")
        root = extract(fetch_wheel(directory))
        schemas = read_schemas(root / Path(OPS_YAML_IN_WHEEL).name)
        lib = _define_ops(schemas)
        sys.modules.update(_torch_npu_stand_in(soc, schemas))
        _run_metas(root / Path(METAS_IN_WHEEL).name)  # after the stand-in: they import torch_npu's utilities
        sys.modules.update(_compiled_stand_ins())
        if not hasattr(torch.Tensor, "is_npu"):  # torch_npu adds it; torchair asks it of every graph input
            torch.Tensor.is_npu = property(lambda t: False)  # CPU tensors: torchair skips NPU formats
        handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        sys.path.insert(0, str(root))
        try:
            air = importlib.import_module("torchair")
        finally:
            sys.path.remove(str(root))
        for sig, handler in handlers.items():  # torchair's import installs its own SIGINT/SIGTERM handlers
            signal.signal(sig, handler)
        if Path(air.__file__).resolve().parent != (root / "torchair").resolve():
            raise GeOfflineError(f"imported torchair from {air.__file__}, not from {root}")
        for name in COMPILED_MODULES:  # `from . import _torchair` binds the parent attribute; bind all four
            setattr(sys.modules["torchair.core"], name, sys.modules[f"torchair.core.{name}"])
        with warnings.catch_warnings():
            # torchair imports its custom-op converters lazily, one module per torch_npu op, and warns
            # for each op whose Python half we lack. Import them now, quietly: a converter missing for
            # an op in OUR graph is reported per graph by FxCheck instead.
            warnings.filterwarnings("ignore", "Failed to import torchair", UserWarning)
            importlib.import_module("torchair._ge_concrete_graph.ge_converter.custom")
        # torchair's import registers a device-session atexit hook (GE finalize): nothing to finalize here.
        atexit.unregister(importlib.import_module("torchair.core._backend").finalize_graph_engine)
        cls._installed = cls(root, schemas, lib, soc)
        return cls._installed

    def needs_converter(self, target) -> bool:
        """torchair's own dispatch (npu_fx_compiler._NpuGraphConverter._wrap and
        GeConcreteGraph._parse_node_internal): Python builtins other than binary operators run
        in Python, scope/record/wait and sym_stride/storage_offset are handled in place."""
        fx2ge = importlib.import_module("torchair._ge_concrete_graph.fx2ge_converter")
        fx_compiler = importlib.import_module("torchair.npu_fx_compiler")
        if fx_compiler.is_builtin_callable(target) and not fx_compiler._is_binary_operator(target):
            return False
        return str(target) not in fx2ge._SPECIAL_TARGETS | {
            "aten.sym_stride.int",
            "aten.sym_storage_offset.default",
        }

    def has_converter(self, target) -> bool:
        """torchair registered a GE converter for FX target `target` (an op overload)."""
        fx2ge = importlib.import_module("torchair._ge_concrete_graph.fx2ge_converter")
        return hasattr(target, "_ge_converter") or fx2ge._get_converter(target) is not None

    def instrument(self, cfg: Any, dump_dir: Path) -> list[FxCheck]:
        """Make the CompilerConfig `cfg` (the adapter's own) dump every GE graph as pbtxt into
        `dump_dir` and record, per FX graph handed to torchair, its targets and which have no GE
        converter (a read-only post-grad pass). Returns the list the pass fills."""
        checks: list[FxCheck] = []
        needs_converter, has_converter = self.needs_converter, self.has_converter

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

        previous = cfg.post_grad_custom_post_pass.value

        def post_pass(gm, *rest):
            if previous is not None:
                previous(gm, *rest)
            observe(gm)

        dump_dir.mkdir(parents=True, exist_ok=True)
        cfg.debug.graph_dump.type = "pbtxt"
        cfg.debug.graph_dump.path = str(dump_dir)
        cfg.post_grad_custom_post_pass = post_pass
        return checks

    def convert(self, first_call: Callable[[], Any], dump_dir: Path, checks: list[FxCheck]) -> Conversion:
        """Run `first_call` (the compiled decode step's first call, with a config `instrument`ed for
        `dump_dir`) and return the GE graphs torchair dumped before the C++ load step. A failure
        before that step is a GeOfflineError naming the FX targets without a converter when there
        are any, else it propagates as raised."""
        dump_dir = Path(dump_dir)
        before = set(dump_dir.glob("*.pbtxt"))
        t0 = time.perf_counter()
        with warnings.catch_warnings():  # torchair's config check sets a process-wide "once" filter
            try:
                first_call()
            except Exception as exc:  # torchair wraps errors; find our stand-in's message in the chain
                boundary = _find_boundary(exc)
                missing = sorted({t for check in checks for t in check.without_converter})
                if boundary is None and missing:
                    raise ConversionFailed(f"FX targets without a GE converter: {', '.join(missing)}", missing) from exc
                if boundary is None:
                    raise
            else:  # e.g. a compile-cache hit that ran a saved graph, or a backend that is not torchair
                raise ConversionFailed("the compiled step ran without reaching GE's load step: nothing was converted")
        seconds = time.perf_counter() - t0
        dumps = sorted(set(dump_dir.glob("*.pbtxt")) - before, key=lambda p: p.stat().st_mtime_ns)
        if not dumps:
            raise ConversionFailed(f"conversion reached the GE load step but wrote no pbtxt into {dump_dir}")
        return Conversion([parse_pbtxt(p) for p in dumps], checks, seconds, boundary)


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


def _find_boundary(exc: BaseException | None) -> str | None:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, CppBoundaryReached) or _BOUNDARY in str(exc):
            return str(exc).splitlines()[0] if str(exc) else _BOUNDARY
        exc = exc.__cause__ or exc.__context__
    return None
