"""Calling a torch.compile'd decode step past torch.compile's per-call wrapper, guards kept.

Why: in a sub-millisecond decode step, torch.compile's Python wrapper around every call (eval-frame
switching, nested-compile and export checks, dispatch-key save and restore) cost ~50 us of a ~420 us
SK decoder step at the overhead-bound bench size, far more than Dynamo's guards (~6 us): direct calls
took that step to 0.86-0.90x and ge_graph's to 0.89-0.95x (BENCHMARKS.md, "thirty-ninth pass").
torchair's `inference.cache_compile` skips Dynamo on a cache hit too, without guards; we keep them.

How: after a call through torch.compile, Dynamo's cache entries for the step's code object that our
backend compiled are read (`_debug_get_cache_entry_list`): each holds its guard tree and the
transformed bytecode, which fetches the graph's inputs from the frame's locals and calls the compiled
graph. A direct call checks each entry's guards against the step's arguments, as Dynamo's frame
evaluation does, and runs the first entry that passes as a plain function. Where none passes (a new
batch, another op table, a new thread count where it is compiled in), the step goes through
torch.compile again, which recompiles or picks its entry, and the entries are read again.

What a direct call leaves out of torch.compile's wrapper matters only while tracing (nested compiles,
export, FX and JIT tracing), and a compiled step is never called there. Where the entries cannot be
read (another torch, a step that is not a plain function or method), every call goes through
torch.compile, and `DirectCall.active` says so (metrics.json `compile.direct_calls`).
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch


def _cache_entries(code: types.CodeType) -> list:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return _debug_get_cache_entry_list(code)


class DirectCall:
    """The compiled entries of `step` (a function or bound method of (input_ids, positions))
    that the backend `compiler` produced, callable without torch.compile's wrapper."""

    def __init__(self, step: Callable, compiler: object):
        func = getattr(step, "__func__", step)
        self.owner = getattr(step, "__self__", None)
        self.compiler = compiler
        self.code = func.__code__ if isinstance(func, types.FunctionType) else None
        self.globals = func.__globals__ if self.code else {}
        self.closure = func.__closure__ if self.code else None
        self.prefix = () if self.owner is None else (self.owner,)
        self.names = self.code.co_varnames[: self.code.co_argcount] if self.code else ()
        self.entries: list[tuple[object, Callable]] = []
        self.calls = 0  # steps run directly

    @property
    def active(self) -> bool:
        return bool(self.entries)

    def refresh(self) -> None:
        """Read Dynamo's entries again (after a call through torch.compile, which may have compiled)."""
        if self.code is None or len(self.names) != len(self.prefix) + 2:
            return
        try:
            entries = [e for e in _cache_entries(self.code) if getattr(e.backend, "compiler_fn", None) is self.compiler]
            self.entries = [
                (e.guard_manager, types.FunctionType(e.code, self.globals, closure=self.closure))
                for e in entries
                if e.code.co_freevars == self.code.co_freevars
            ]
        except (AttributeError, ImportError, TypeError):  # a torch without these internals: never again
            self.code, self.entries = None, []

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The step's output, or None where no entry's guards pass (call through torch.compile)."""
        args = (*self.prefix, input_ids, positions)
        frame = dict(zip(self.names, args))
        if self.closure:  # a closure's free variables are frame locals too, which guards may read
            frame.update(zip(self.code.co_freevars, (cell.cell_contents for cell in self.closure)))
        for guards, fn in self.entries:
            try:
                passed = guards.check(frame)
            except TypeError:  # a guard tree that takes no dict of locals (another torch): never again
                self.code, self.entries = None, []
                return None
            if passed:
                self.calls += 1
                return fn(*args)
        return None
