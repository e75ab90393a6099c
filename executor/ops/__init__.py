"""The fused-op interface model code calls: `ops.rms_norm(...)`, `ops.attention(...)`, ...

Why an indirection: model files must not branch on the device. Each op name maps to one
implementation in the active table: "reference" (default, plain PyTorch, runs everywhere) or
"npu" (torch_npu fused kernels, registered by executor.backends.npu). The table is chosen once
per run by its backend and installed by the run's execution context (executor.context) with
`using(name)`, which restores the previous table afterwards; never inside model code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from executor.ops import reference

OP_NAMES = (
    "linear",
    "rms_norm",
    "add_rms_norm",
    "swiglu",
    "rotary_mul",
    "attention",
    "moe_gating_top_k_softmax",
    "moe_init_routing",
    "grouped_matmul",
    "kv_update",
)

_TABLES: dict[str, dict[str, Callable]] = {
    "reference": {name: getattr(reference, name) for name in OP_NAMES},
}
_active: dict[str, Callable] = dict(_TABLES["reference"])
_active_name = ["reference"]


_BASES: dict[str, str | None] = {"reference": "reference"}  # table -> where its other ops come from


def register(name: str, table: dict[str, Callable], base: str | None = None) -> None:
    """Register an implementation table. Ops it does not provide come from the reference: as a
    declared base (`base="reference"`: a table that only overrides some ops) or, without one,
    as fallbacks, which `provenance()` reports and the accuracy tool's audit fails."""
    unknown = set(table) - set(OP_NAMES)
    if unknown:
        raise ValueError(f"unknown ops {sorted(unknown)}; known: {', '.join(OP_NAMES)}")
    if base not in (None, "reference"):
        raise ValueError(f"base {base!r}: tables build on the reference only")
    _TABLES[name] = {**_TABLES["reference"], **table}
    _BASES[name] = base
    _OWN[name] = set(table)


_OWN: dict[str, set[str]] = {"reference": set(OP_NAMES)}


def provenance(table: str) -> dict[str, str]:
    """Per op of `table`: "own" (the table's implementation), "base" (inherited from the declared
    base) or "fallback" (the table lacks it and nothing declared where it should come from)."""
    own, base = _OWN[table], _BASES[table]
    return {op: "own" if op in own else "base" if base else "fallback" for op in OP_NAMES}


def defined_in(name: str) -> list[str]:
    """The modules defining table `name`'s own functions: what another process (a rank of a
    multi-device run) imports to get a table that its module registers when imported."""
    return sorted({_TABLES[name][op].__module__ for op in _OWN[name]} - {reference.__name__})


def registered() -> list[str]:
    return list(_TABLES)


@contextlib.contextmanager
def using(name: str) -> Iterator[None]:
    """Make table `name` the active one for a `with` block (the run's execution context does this)."""
    if name not in _TABLES:
        raise ValueError(f"op implementation {name!r} is not registered; registered: {', '.join(_TABLES)}")
    previous, previous_name = dict(_active), _active_name[0]
    _active.clear()
    _active.update(_TABLES[name])
    _active_name[0] = name
    try:
        yield
    finally:
        _active.clear()
        _active.update(previous)
        _active_name[0] = previous_name


@contextlib.contextmanager
def over_reference(fns: dict[str, Callable]) -> Iterator[None]:
    """For a `with` block, run `fns` (op -> function) in place of the active table's entries that
    are still the reference's own functions; an entry a table replaced (NPU, a custom op) stays.
    A custom op layered over the reference's entry (executor.custom_ops.layer) is layered over
    `fns`' instead, so the calls it hands to its base get them too: decode_attention's prefill
    calls reached SDPA, not the bf16 flash kernel, once the op was chosen by default at 512 slots.
    For the eager CPU kernels of executor.backends, which compute the reference in fewer passes."""
    unknown = set(fns) - set(OP_NAMES)
    if unknown:
        raise ValueError(f"unknown ops {sorted(unknown)}; known: {', '.join(OP_NAMES)}")
    reference_fns = _TABLES["reference"]
    replaced, instead = {}, {}
    for name, fn in fns.items():
        active_fn = _active[name]
        base, relayer = getattr(active_fn, "layered_over", (None, None))
        if active_fn is reference_fns[name]:
            replaced[name], instead[name] = active_fn, fn
        elif base is reference_fns[name]:
            replaced[name], instead[name] = active_fn, relayer(fn)
    _active.update(instead)
    try:
        yield
    finally:
        _active.update(replaced)


def active() -> str:
    return _active_name[0]


def implementations(table: str | None = None) -> dict[str, str]:
    """Which function implements each op of `table` (default: the active one), for metrics.json."""
    fns = _active if table is None else _TABLES[table]
    return {name: f"{fn.__module__}.{fn.__name__}" for name, fn in fns.items()}


def table(name: str) -> dict[str, Callable]:
    """A copy of registered table `name` (op -> function): the base that custom ops are layered on
    (executor.custom_ops.layer)."""
    if name not in _TABLES:
        raise ValueError(f"op implementation {name!r} is not registered; registered: {', '.join(_TABLES)}")
    return dict(_TABLES[name])


def linear(x, weight, bias=None):
    return _active["linear"](x, weight, bias)


def rms_norm(x, weight, eps):
    return _active["rms_norm"](x, weight, eps)


def kv_update(cache, new, positions):
    return _active["kv_update"](cache, new, positions)


def add_rms_norm(x, residual, weight, eps):
    return _active["add_rms_norm"](x, residual, weight, eps)


def swiglu(x):
    return _active["swiglu"](x)


def rotary_mul(x, cos, sin):
    return _active["rotary_mul"](x, cos, sin)


def attention(q, k, v, mask, scale):
    return _active["attention"](q, k, v, mask, scale)


def moe_gating_top_k_softmax(logits, k):
    return _active["moe_gating_top_k_softmax"](logits, k)


def moe_init_routing(x, expert_idx, num_experts):
    return _active["moe_init_routing"](x, expert_idx, num_experts)


def grouped_matmul(x, weights, counts):
    return _active["grouped_matmul"](x, weights, counts)
