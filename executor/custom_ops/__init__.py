"""Custom operators: ops the framework does not have, added as `torch.library` ops and switched on
by config (`model_config.custom_ops: [decode_attention]`).

Why a catalogue of its own: a custom op is more than a Python function. It has a schema (so
dynamo traces it as one opaque node and it lands inside SuperKernel scopes), a fake impl (shapes
for tracing), a C++ CPU kernel built on first use (executor/custom_ops/_build.py), an NPU kernel
and a torchair GE converter (in the NPU adapter, executor/backends/), and an entry of the
executor.ops table it replaces. Models never name it: the run's op table does.

Each module of this package whose name does not start with `_` defines one op and an `OP`
(`CustomOp`); its module name is the name config uses. `layer()` is the one place a run's op
table gets them: the backend's table with each requested op's entry replaced. docs/custom_ops.md
walks through adding one.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from executor.errors import RecipeError

# The narrowest heads an op's AMX threshold (CustomOp.amx_min_slots) covers: the head_dim it was
# measured at; narrower heads keep the general rule there.
AMX_MIN_HEAD_DIM = 128


class CustomOpError(RecipeError):
    """An unknown, duplicated or unusable custom op; one line naming it and what is allowed."""


@dataclass(frozen=True)
class CustomOp:
    """One custom operator, declared by its module as `OP`."""

    name: str  # config name (model_config.custom_ops) = module name
    qualname: str  # the torch op, "cann::decode_attention"
    replaces: str  # the executor.ops entry it implements (executor.ops.OP_NAMES)
    entry: Callable[[Callable], Callable]  # the base table's function for `replaces` -> the op-table function
    sources: tuple[str, ...] = ()  # C++ files of its CPU kernel (executor/custom_ops/csrc/); () = no CPU kernel
    npu: str = ""  # module of executor/backends/ with register(torch_npu, torchair): NPU kernel + GE converter
    summary: str = ""  # one line for --help texts and reports
    # custom_ops left out: a CPU run of one rank whose static KV cache holds at least this many
    # values a kv head (slots x head_dim) gets the op (where its kernel measured faster than the
    # base table's); 0 = never
    auto_min_kv_values: int = 0
    # ... and an eager one at any cache length (auto_min_kv_values > 0 only): a threshold that
    # exists because the op's extern call splits a compiled graph's fused kernels has no reason in eager
    auto_in_eager: bool = False
    # ... and in a bf16 run on a CPU with AMX, with heads of AMX_MIN_HEAD_DIM values or more, from
    # this many slots where that is fewer (0: the rule above everywhere)
    amx_min_slots: int = 0

    @property
    def library(self) -> str:
        """File name of its built CPU kernel library."""
        return f"cann_{self.name}"

    def auto_min_slots(self, head_dim: int, amx: bool = False) -> int:
        """The fewest KV-cache slots at which a compiled run with heads of `head_dim` gets the op
        by default (0: never); `amx`: a bf16 run on a CPU with AMX."""
        slots = -(-self.auto_min_kv_values // head_dim) if self.auto_min_kv_values else 0
        if slots and amx and self.amx_min_slots and head_dim >= AMX_MIN_HEAD_DIM:
            return min(slots, self.amx_min_slots)
        return slots


def available() -> list[str]:
    """Names config accepts: the op modules of this package, found without importing them."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def load(name: str) -> CustomOp:
    """Import the op's module (defines its schema and fake impl) and return its declaration."""
    if name not in available():
        raise CustomOpError(
            f"model_config.custom_ops: {name!r} is not a custom op; available: {', '.join(available()) or 'none'}"
        )
    op = importlib.import_module(f"{__name__}.{name}").OP
    if op.name != name:
        raise CustomOpError(f"executor/custom_ops/{name}.py declares OP.name {op.name!r}; it must be {name!r}")
    return op


def check(names: Sequence[str], key: str = "model_config.custom_ops") -> None:
    """Config validation: every name known, none twice (no import: safe before anything is built)."""
    known = available()
    for name in names:
        if name not in known:
            raise CustomOpError(f"{key}: {name!r} is not a custom op; available: {', '.join(known) or 'none'}")
    twice = sorted({n for n in names if list(names).count(n) > 1})
    if twice:
        raise CustomOpError(f"{key}: {twice[0]} is listed twice")


def unsupported(op: CustomOp, device: str, exe_mode: str) -> str | None:
    """Why `op` cannot run on `device` ("cpu" | "cuda" | "npu") in `exe_mode`, or None when it can.

    Found from declarations only (nothing built, nothing registered), so the pre-flight can ask
    before a run allocates anything and the installers give the same one-line answer."""
    if device == "cpu":
        return None if op.sources else f"custom op {op.name} has no CPU kernel (no C++ sources declared)"
    if device == "npu":
        if not op.npu.startswith("executor.backends."):
            return f"custom op {op.name} has no NPU implementation (CustomOp.npu names none in executor/backends/)"
        module = importlib.import_module(op.npu)  # MODES/WHY_NOT only: torch_npu is handed to register() later
        if exe_mode not in module.MODES:
            why = module.WHY_NOT.get(exe_mode, "not supported")
            return (
                f"custom op {op.name} cannot run in exe_mode {exe_mode} on an NPU ({why}); "
                f"it runs in: {', '.join(module.MODES)}"
            )
        return None
    return (
        f"custom op {op.name} has no {device} kernel (it has: "
        f"{', '.join(d for d, ok in (('cpu', op.sources), ('npu', op.npu)) if ok)}); "
        "remove it from model_config.custom_ops on this device"
    )


def check_runnable(names: Sequence[str], device: str, exe_mode: str) -> None:
    """Pre-flight: every op in `names` can be installed on `device` in `exe_mode`; on CPU, a kernel
    not built yet needs a compiler and ninja here. Nothing is built; errors are one line."""
    for name in names:
        op = load(name)
        why = unsupported(op, device, exe_mode)
        if why:
            raise CustomOpError(why)
        if device == "cpu":
            from executor.custom_ops._build import check_buildable

            check_buildable(op.qualname, op.library, list(op.sources))


def resolve(
    names: Sequence[str] | None,
    device: str,
    kv_slots: int,
    head_dim: int,
    world: int,
    exe_mode: str = "ge_graph",
    bf16: bool = False,
) -> tuple[tuple[str, ...], str]:
    """The custom ops a run layers on its op table, and one line saying why.

    `names` is model_config.custom_ops. A list, even an empty one, is the user's and is taken as
    given (the pre-flight then refuses what cannot run). Left out (None), the ops that pay at this
    run's static cache length and head_dim are chosen (`CustomOp.auto_min_kv_values`, in a bf16
    run (`bf16`) on a CPU with AMX `CustomOp.amx_min_slots` where fewer; in eager at any length
    where `CustomOp.auto_in_eager`): on CPU and one rank only, where they were measured, and only
    where the kernel is built or can be built here, since nobody asked for it and a missing compiler
    must not stop the run. Each op's entry says why its threshold is where it is.
    """
    if names is not None:
        return tuple(names), f"custom ops: {', '.join(names) or 'none'} (model_config.custom_ops)"
    left_out = "model_config.custom_ops left out"
    if device != "cpu" or world > 1:
        where = f"{world} ranks" if world > 1 else device
        return (), f"custom ops: none ({left_out}: ops are chosen on CPU with one rank, not on {where})"
    from executor.custom_ops._build import check_buildable, cpu_has_amx

    chosen, why = [], []
    for name in available():
        op = load(name)
        at = op.auto_min_slots(head_dim, bf16 and cpu_has_amx())
        if not at:
            continue
        amx = " in bf16 on a CPU with AMX" if at < op.auto_min_slots(head_dim) else ""
        eager = exe_mode == "eager" and op.auto_in_eager
        if kv_slots < at and not eager:
            why.append(f"{name} from {at} KV-cache slots at head_dim {head_dim}{amx}, this run has {kv_slots}")
            continue
        try:
            check_buildable(op.qualname, op.library, list(op.sources), remedy="")
        except RecipeError as exc:
            why.append(f"{name} not chosen: {exc}")
            continue
        chosen.append(name)
        why.append(
            f"{name} in eager at any KV-cache length"
            if eager
            else f"{name} at {kv_slots} KV-cache slots (>= {at} at head_dim {head_dim}{amx})"
        )
    detail = "; ".join(why) + ("; [] runs without" if chosen else "") or "none is chosen"
    return tuple(chosen), f"custom ops: {', '.join(chosen) or 'none'} ({left_out}: {detail})"


def cpu_kernel(op: CustomOp) -> None:
    """Install `op` for a CPU run: build (once per machine) and load its C++ kernel."""
    why = unsupported(op, "cpu", "")
    if why:
        raise CustomOpError(why)
    from executor.custom_ops._build import load_kernel

    load_kernel(op.qualname, op.library, list(op.sources))


def no_kernel(device: str) -> Callable[[CustomOp], None]:
    """Install hook for a device the custom ops have no kernel for: refuse, naming the op."""

    def refuse(op: CustomOp) -> None:
        raise CustomOpError(unsupported(op, device, ""))

    return refuse


def layer(base: str, names: Sequence[str] | None, install: Callable[[CustomOp], None]) -> str:
    """The op table a run uses: table `base` (the backend's) with the custom ops `names` on top
    (None, a config no pre-flight has resolved, as a backend built by hand has: none).

    `install(op)` makes each op runnable on the run's device first (CPU: build/load its kernel;
    NPU: the adapter registers its kernel and GE converter). Registers the layered table as
    "<base>+<name>+..." and returns that name; with no custom ops, `base` itself."""
    from executor import ops

    if not names:
        return base
    check(names)
    table = ops.table(base)
    replaced: dict[str, str] = {}
    for name in names:
        op = load(name)
        if op.replaces not in table:
            raise CustomOpError(f"custom op {name} replaces {op.replaces!r}, which is not an executor.ops op")
        if op.replaces in replaced:
            raise CustomOpError(f"custom ops {replaced[op.replaces]} and {name} both replace {op.replaces}")
        install(op)
        fn = op.entry(table[op.replaces])
        fn.layered_over = (table[op.replaces], op.entry)  # executor.ops.over_reference re-layers it
        table[op.replaces] = fn
        replaced[op.replaces] = name
    layered = "+".join([base, *names])
    ops.register(layered, table)
    return layered


def installer(device: str) -> Callable[[CustomOp], None]:
    """How custom ops are installed for a run on `device` outside the NPU adapter: CPU builds and
    loads their C++ kernels; CUDA has no kernels (refused). The NPU adapter has its own."""
    return cpu_kernel if device == "cpu" else no_kernel(device)
