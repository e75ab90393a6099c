"""Where a step's time goes, per model region and op type, and what each op call moves and computes.

Why eager: attributing time to an op needs the ops to run one by one (a compiled graph fuses
them). The regions are the model's own (`ctx.scopes.region(...)`, the SuperKernel regions), so
the analysis stands in for the runner's ScopeRunner with `RegionMarker`, which opens a
torch.profiler range per region instead of a scope; embed, final_norm and lm_head, which are
no region of the model, get ranges from module hooks. Ops outside every range are "other"
(RoPE tables, the attention mask). Per op call, a dispatch mode records FLOPs (torch's own
flop formulas), bytes (footprints of inputs and outputs; views move nothing), dtype, the model
source line and the executor.ops entry the op runs inside (None: the model's own code).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from executor.paths import REPO_ROOT
from executor.scope import ScopeStandIn

MODULE_REGIONS = {"embed_tokens": "embed", "norm": "final_norm", "lm_head": "lm_head"}  # model attribute -> region
_STEP = "__op_analysis_step_"  # profiler range around each profiled step
OTHER = "other"  # ops outside every region: RoPE tables, the mask, the KV-cache bookkeeping in forward
PYTHON = "(python)"  # a region's own time: Python between its ops (what graph mode removes)
_MODELS = str(REPO_ROOT / "models")
_OPS_INTERFACE = str(REPO_ROOT / "executor" / "ops" / "__init__.py")


class RegionMarker(ScopeStandIn):
    """Stands in for ScopeRunner while analysing: `region(name)` is a profiler range, and the
    innermost open region is known to the op recorder."""

    def __init__(self):
        self.stack: list[str] = []

    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        self.stack.append(name)
        try:
            with torch.profiler.record_function(name):
                yield
        finally:
            self.stack.pop()

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else OTHER


@contextlib.contextmanager
def module_regions(model: torch.nn.Module, marker: RegionMarker) -> Iterator[None]:
    """Profiler ranges around the embedding, the final norm and the lm_head (forward hooks)."""
    handles = []
    for attr, name in MODULE_REGIONS.items():
        module = getattr(model, attr, None)
        if not isinstance(module, torch.nn.Module):
            continue
        ranges: list = []

        def pre(_mod, _args, name=name, ranges=ranges):
            ranges.append(marker.region(name))
            ranges[-1].__enter__()

        def post(_mod, _args, _out, ranges=ranges):
            ranges.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


# --------------------------------------------------------------------------- time per region and op
@dataclass
class OpTime:
    region: str
    op: str  # "aten::mm", "cann::decode_attention", or PYTHON
    ms: float  # per step
    calls: float  # per step


def profile_times(step: Callable[[], object], steps: int, regions: set[str]) -> list[OpTime]:
    """Run `step` `steps` times under torch.profiler; per (region, op) the self CPU time and call
    count, the median over the steps (on a shared machine a spike hits one step, not the median).
    Region ranges contribute their own self time as PYTHON."""
    marks = [f"{_STEP}{i}" for i in range(steps)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for mark in marks:
            with torch.profiler.record_function(mark):
                step()
    per_step: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    for event in prof.events():
        mark = _region_of(event, set(marks))
        if event.name in regions:
            key = (event.name, PYTHON)
        elif "::" in event.name and mark != OTHER:
            key = (_region_of(event.cpu_parent, regions), event.name)
        else:  # the step ranges, profiler bookkeeping
            continue
        per_step[key][mark][0] += event.self_cpu_time_total / 1e3
        per_step[key][mark][1] += 1
    return [
        OpTime(
            r,
            op,
            statistics.median([v[0] for v in by.values()] + [0.0] * (steps - len(by))),
            max(n for _, n in by.values()),
        )
        for (r, op), by in per_step.items()
    ]


def _region_of(event, regions: set[str]) -> str:
    while event is not None:
        if event.name in regions:
            return event.name
        event = event.cpu_parent
    return OTHER


# --------------------------------------------------------------------------- what each op call does
@dataclass
class OpCall:
    op: str  # "aten::mm"
    region: str
    flops: int
    bytes: int  # read + written, from the tensors' footprints (a view moves nothing)
    dtype: str  # of the first tensor output (or input), e.g. "float32"
    source: str  # innermost frame in models/: "models/qwen/models/modeling_qwen.py:63", "" if none
    entry: str | None  # the executor.ops entry it runs inside ("rms_norm"), None = the model's own code


def footprint(t: torch.Tensor) -> int:
    """Bytes a tensor's elements span in memory (an expanded dim of stride 0 counts once)."""
    if t.numel() == 0:
        return 0
    span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    return min(span, t.numel()) * t.element_size()


def _where() -> tuple[str, str | None]:
    """(model source line, executor.ops entry) of the op being dispatched, from the Python stack."""
    source, entry = "", None
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not source and name.startswith(_MODELS):
            source = f"{Path(name).relative_to(REPO_ROOT)}:{frame.f_lineno}"
        if name == _OPS_INTERFACE:
            entry = frame.f_code.co_name  # the outermost one wins: add_rms_norm, not the rms_norm inside
        frame = frame.f_back
    return source, entry


class OpRecorder(TorchDispatchMode):
    """Records an OpCall per aten/custom op reaching the dispatcher (below autograd, so composite
    ops such as linear arrive as their parts: t + addmm)."""

    def __init__(self, marker: RegionMarker):
        super().__init__()
        self.marker, self.calls = marker, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        if schema.name.startswith("profiler::"):  # the region ranges themselves
            return out
        packet = func._overloadpacket
        flops = flop_registry[packet](*args, **kwargs, out_val=out) if packet in flop_registry else 0
        source, entry = _where()
        self.calls.append(
            OpCall(
                f"{schema.name}",
                self.marker.current,
                int(flops),
                _bytes_moved(schema, args, kwargs, out),
                _dtype(out, args),
                source,
                entry,
            )
        )
        return out


def _bytes_moved(schema, args, kwargs, out) -> int:
    """Inputs read + outputs written. A view (output aliases an input) moves nothing; an in-place
    op writes as many bytes as it reads from its other inputs (e.g. a KV-cache scatter)."""
    inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs)) if t.numel()}
    if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
        return 0
    mutated = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    named = dict(zip((a.name for a in schema.arguments), args)) | kwargs
    read = sum(footprint(t) for n, v in named.items() if n not in mutated for t in _tensors(v))
    if mutated:
        return 2 * read
    outputs = _tensors(out)
    if outputs and all(t.untyped_storage().data_ptr() in inputs for t in outputs if t.numel()):
        return 0  # a view without an alias annotation (e.g. _unsafe_view): nothing moves
    return read + sum(footprint(t) for t in outputs)


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _dtype(out, args) -> str:
    tensors = _tensors(out) or _tensors(args)
    return str(tensors[0].dtype).removeprefix("torch.") if tensors else ""
