"""NaN / inf in the logits: detected at the step it appears, located in the region that made it.

Why: a checkpoint with a NaN weight used to decode to the end and exit 0, its "text" built from
argmax over NaN. The runner checks every step's (B, V) logits with one sum, into which NaN and
inf propagate (outside the timed region; its cost is in BENCHMARKS.md) and, on the first
non-finite value, re-runs that step's input eagerly under `locate` to name the region where the
first NaN/inf appeared. `locate` needs nothing from the model but what every model already does: it enters
its regions through `scopes.region(name)`, so a tracking stand-in for the ScopeRunner knows the
region of every op, and a TorchFunctionMode checks each op's output.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from executor.errors import RecipeError
from executor.scope import ScopeStandIn


class NonFiniteError(RecipeError):
    """NaN or inf in the logits: names the step, the row and the region where it first appeared."""


def first_bad_row(logits: torch.Tensor) -> int | None:
    """None when every logit is finite, else the first row holding a NaN or inf.

    The per-step check is one sum: NaN and inf propagate into it, and it reads the logits once
    without allocating (torch.isfinite(x).all() costs ~20x more on CPU; BENCHMARKS.md). Only a
    non-finite sum (or finite logits so large that their sum overflows) pays for the exact test."""
    if math.isfinite(float(logits.sum())):
        return None
    bad = (~torch.isfinite(logits)).any(dim=-1).nonzero()
    return int(bad[0, 0]) if len(bad) else None


def kind_of(t: torch.Tensor) -> str:
    return "NaN" if bool(torch.isnan(t).any()) else "inf"


# Ops whose output may legitimately hold garbage or -inf: uninitialised buffers (filled next) and
# a masked fill whose fill value is itself -inf (attention masks). An op is blamed only when its
# non-tensor arguments are all finite, which is what rules the masked fill out.
_UNINITIALISED = ("empty", "new_empty", "empty_like", "empty_strided")


@dataclass
class _Finding:
    regions: tuple[str, ...]
    op: str
    kind: str


@dataclass
class RegionTracker(ScopeStandIn):
    """Stands in for the ScopeRunner during a locating re-run: opens no scope, only records which
    regions the model is inside."""

    stack: list[str] = field(default_factory=list)

    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        self.stack.append(name)
        try:
            yield
        finally:
            self.stack.pop()


def _nonfinite_scalar(args: Any) -> bool:
    if isinstance(args, float):
        return not math.isfinite(args)
    if isinstance(args, (list, tuple)):
        return any(_nonfinite_scalar(a) for a in args)
    if isinstance(args, dict):
        return any(_nonfinite_scalar(a) for a in args.values())
    return False


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    return []


class _FirstNonFinite(TorchFunctionMode):
    """Records the first op (and the regions it ran in) whose floating output is not finite."""

    def __init__(self, tracker: RegionTracker):
        super().__init__()
        self.tracker, self.found = tracker, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        if self.found is None and name not in _UNINITIALISED and not _nonfinite_scalar((args, kwargs)):
            for t in _tensors(out):
                if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
                    self.found = _Finding(tuple(self.tracker.stack), name, kind_of(t))
                    break
        return out


def locate(forward: Callable[[RegionTracker], torch.Tensor]) -> str:
    """Run `forward(tracker)` eagerly and say where its first NaN/inf came from, in words."""
    tracker = RegionTracker()
    mode = _FirstNonFinite(tracker)
    with torch.no_grad(), mode:
        forward(tracker)
    found = mode.found
    if found is None:
        return "not reproduced by an eager re-run of the step (the compiled step differs from eager)"
    if not found.regions:
        return f"first {found.kind} from {found.op} outside every layer region (embedding, final norm or lm_head)"
    inner = found.regions[-1]
    return f"first {found.kind} in region {inner} (op {found.op})"
