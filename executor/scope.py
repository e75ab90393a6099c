"""SuperKernel scopes: regions, scope plans and `superkernel_scope` (the options grammar and the region
kinds are in executor.scope_grammar, which needs no torch; re-exported here).

Model files only *declare* regions (`ctx.scopes.region("layer_3_attn")`); a scope plan chosen in
config decides which regions become SuperKernel scopes, and only in decode (prefill never runs
inside a scope, as in cann-recipes-infer). What entering a scope does depends on the backend
that compiled the decode step; the run's execution context (executor.context) installs it with
`scope_impl` for the duration of the run and restores the previous one afterwards:

- "marker" (CPU/CUDA portable backend): side-effecting `sk.scope_enter/scope_exit` ops that
  survive into the FX graph, where the backend splits the graph and compiles each scope as one
  launch unit;
- "torchair" / "npugraph_ex" (Ascend): `executor.backends.npu` supplies a context factory that
  calls `torchair.scope.super_kernel` or `torch.npu.super_kernel_scope_begin/end`.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from executor.scope_grammar import OPTIONS, REGION_KINDS, ScopeError, parse_options  # noqa: F401  (re-exported)

# --------------------------------------------------------------------------- marker ops
# Schema ops with no outputs; registered as side-effecting so dead-code elimination keeps
# them and they reach the backend's FX graph in program order.
_lib = torch.library.Library("sk", "DEF")
_lib.define("scope_enter(str label, str options) -> ()")
_lib.define("scope_exit(str label) -> ()")
_lib.impl("scope_enter", lambda label, options: None, "CompositeExplicitAutograd")
_lib.impl("scope_exit", lambda label: None, "CompositeExplicitAutograd")
SCOPE_ENTER = torch.ops.sk.scope_enter.default
SCOPE_EXIT = torch.ops.sk.scope_exit.default
for _op in (SCOPE_ENTER, SCOPE_EXIT, torch.ops.sk.scope_enter, torch.ops.sk.scope_exit):
    torch.fx.node.has_side_effect(_op)


class _MarkerScope:
    """Portable scope: brackets the region with marker ops (a plain class so dynamo traces it)."""

    def __init__(self, label: str, options: str):
        self.label, self.options = label, options

    def __enter__(self):
        torch.ops.sk.scope_enter(self.label, self.options)
        return self

    def __exit__(self, *exc):
        torch.ops.sk.scope_exit(self.label)
        return False


class _NoScope:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


ScopeFactory = Callable[[str, str], AbstractContextManager]
# What `superkernel_scope(True, ...)` opens. Read while the decode step is traced, so it is
# process-wide; only `scope_impl` changes it, always restoring the previous one.
_scope_factory: ScopeFactory = _MarkerScope


@contextlib.contextmanager
def scope_impl(factory: ScopeFactory | None) -> Iterator[None]:
    """Install what entering a scope does (None = the portable marker ops) for a `with` block."""
    global _scope_factory
    previous, _scope_factory = _scope_factory, factory or _MarkerScope
    try:
        yield
    finally:
        _scope_factory = previous


def superkernel_scope(enable: bool, label: str, options: str = "") -> AbstractContextManager:
    """The documented Ascend idiom: a SuperKernel scope when enabled, else a no-op context."""
    if not enable:
        return _NoScope()  # a fresh object: dynamo only enters context managers created in the traced code
    return _scope_factory(label, options)


# --------------------------------------------------------------------------- regions and plans
@dataclass(frozen=True)
class Region:
    """A part of the decode path a model offers for a scope. `name` is also the default label."""

    name: str  # "decode_layers", "layer_3", "layer_3_attn", "layer_3_mlp", "layer_3_moe"
    kind: str  # one of REGION_KINDS
    layer: int | None = None


def decoder_regions(num_layers: int, ffn_kinds: Iterable[str]) -> list[Region]:
    """The standard region set of a decoder-only model; ffn_kinds[i] is "mlp" or "moe"."""
    regions = [Region("decode_layers", "decoder")]
    for i, ffn in enumerate(ffn_kinds):
        regions += [
            Region(f"layer_{i}", "layer", i),
            Region(f"layer_{i}_attn", "attention", i),
            Region(f"layer_{i}_{ffn}", ffn, i),
        ]
    assert len(regions) == 1 + 3 * num_layers
    return regions


@dataclass(frozen=True)
class ScopeSpec:
    region: str
    label: str
    options: str


@dataclass(frozen=True)
class ScopePlan:
    name: str  # "none", a built-in plan name or "custom"
    scopes: tuple[ScopeSpec, ...]

    def by_region(self) -> dict[str, ScopeSpec]:
        return {s.region: s for s in self.scopes}

    @property
    def labels(self) -> list[str]:
        return sorted({s.label for s in self.scopes})


NO_PLAN = ScopePlan("none", ())


def _contains(outer: Region, inner: Region) -> bool:
    if outer.kind == "decoder":
        return inner.kind != "decoder"
    return outer.kind == "layer" and inner.layer == outer.layer and inner.kind != "layer"


def build_plan(
    regions: list[Region], plan: str, options: str = "", custom: Iterable = (), model_name: str = "model"
) -> ScopePlan:
    """Turn a plan name (or custom selectors) into the scopes to open, validated against regions."""
    if plan == "custom":
        specs: list[ScopeSpec] = []
        names = [r.name for r in regions]
        for i, entry in enumerate(custom):
            parse_options(entry.options, key=f"superkernel.custom[{i}].options")
            for pattern in entry.regions:
                hits = fnmatch.filter(names, pattern)
                if not hits:
                    raise ScopeError(
                        f"superkernel.custom[{i}].regions: {pattern!r} matches no region of "
                        f"{model_name}; regions are e.g. {', '.join(names[:5])}, ..."
                    )
                specs += [ScopeSpec(h, entry.label, entry.options or options) for h in hits]
    else:
        if plan not in REGION_KINDS:  # a built-in plan is named after the region kind it wraps
            raise ScopeError(
                f"superkernel.plan: {plan!r} is not a plan; allowed values: {', '.join([*REGION_KINDS, 'custom'])}"
            )
        specs = [ScopeSpec(r.name, r.name, options) for r in regions if r.kind == plan]
        if not specs:
            present = sorted({r.kind for r in regions} - {"layer", "decoder"})
            usable = ", ".join(["attention", *(k for k in present if k != "attention"), "layer", "decoder", "custom"])
            raise ScopeError(
                f"superkernel.plan: {plan!r} marks no region of {model_name}; "
                f"it has {', '.join(present)} regions (plans: {usable})"
            )
    by_name = {r.name: r for r in regions}
    seen: dict[str, ScopeSpec] = {}
    for spec in specs:
        if spec.region in seen:
            raise ScopeError(f"superkernel.custom: region {spec.region} is selected twice")
        seen[spec.region] = spec
    for a in seen:
        for b in seen:
            if a != b and _contains(by_name[a], by_name[b]):
                raise ScopeError(
                    f"superkernel.custom: regions {a} and {b} are nested; a region may be in at most one scope"
                )
    return ScopePlan(plan, tuple(specs))


class ScopeRunner:
    """What model code talks to: `with scopes.region(name):` opens a scope iff the plan marks it,
    and `h = scopes.tap(name, h)` hands a region's output to an observer (the accuracy tool).

    `active` is False during prefill so that prefill never runs inside a scope.
    """

    def __init__(self, plan: ScopePlan = NO_PLAN, active: bool = False):
        self.plan = plan
        self.active = active
        self._specs = plan.by_region()
        # None in every run: dynamo then sees a constant and tap() adds nothing to the graph.
        self.observer: Callable[[str, torch.Tensor], None] | None = None

    def tap(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """Identity; with an observer installed, it also records `value` as region `name`'s output."""
        if self.observer is not None:
            self.observer(name, value)
        return value

    def region(self, name: str) -> AbstractContextManager:
        spec = self._specs.get(name) if self.active else None
        if spec is None:
            return _NoScope()  # a fresh object: dynamo only enters context managers created in the traced code
        return superkernel_scope(True, spec.label, spec.options)


PREFILL_SCOPES = ScopeRunner(NO_PLAN, active=False)


class ScopeStandIn:
    """Base of the objects a tool passes to the model in place of a ScopeRunner (the NaN
    locator's region tracker, op_analysis's profiler marker): they define `region`, and inherit
    every other hook model code calls, as the identity, so a hook added to ScopeRunner for one
    tool needs one line here, not one in every stand-in."""

    def tap(self, name: str, value: torch.Tensor) -> torch.Tensor:
        return value
