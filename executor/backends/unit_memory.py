"""Where a small CPU SuperKernel launch unit keeps its intermediates: in arrays on the stack of its C++
wrapper where they fit, else in one pooled allocation.

Why: a unit's fused kernels write every intermediate of the scope, all alive at once, so Inductor
cannot reuse one buffer for another, and its C++ wrapper allocated each anew on every call (~150 at
bench-overhead, a TensorImpl, a StorageImpl and the data apiece: 15% of the SK decoder step's
samples under perf). Pooled (Inductor's `memory_planning`), that step took 0.89-0.90x the time
("thirty-eighth pass"), but every pooled buffer is still a tensor made and freed per call. Arrays on
the wrapper's stack (Inductor's ArrayRef wrapper, `aot_inductor.allow_stack_allocation`) are no
tensors at all: 0.77-0.82x the pooled step (2 x 21 alternating rounds; BENCHMARKS.md, "thirty-ninth pass").

Inductor allows stack arrays up to MAX_STACK_ALLOCATION_SIZE elements in all and, past that, falls
back to one allocation per buffer without a pool; so it does for a unit that calls an extern kernel
(an aten op called as a library function: the batched GEMMs of bench-overhead at batch 4). So the
unit's wrapper (`StackOrPool`) counts the elements first, as Inductor will, and takes the pool where
they do not fit or an extern kernel is called.

Only for units of up to POOL_MAX_NODES graph nodes (bench-overhead's and the built-in model's
decoder: 846): at the 0.6B shape the pooled step was level (0.998) and Inductor's planner recursed
past Python's frame limit on its 28-layer unit. Not for Python-wrapper graphs: there the pool's
views are made in Python, and the ge_graph step took 1.11-1.18x.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
from collections.abc import Iterator

POOL_MAX_NODES = 1200  # a 1,539-node test unit still planned at the default limit of 1000 frames

# The unit's compile options; the wrapper class is StackOrPool (see `unit_wrapper`).
SMALL_UNIT = {"memory_planning": True, "aot_inductor.allow_stack_allocation": True}


@functools.cache
def _stack_or_pool_class():
    """StackOrPool, built on first use: it subclasses an Inductor class, and importing Inductor
    costs seconds that a run without a compiled CPU unit should not pay."""
    from torch._inductor import config
    from torch._inductor.codegen import cpp_wrapper_cpu_array_ref as array_ref
    from torch._inductor.codegen.wrapper import AllocateLine

    class StackOrPool(array_ref.CppWrapperCpuArrayRef):
        """Inductor's ArrayRef C++ wrapper, which puts the intermediates on the stack where they fit
        in all; where they do not, the pool (memory_planning) instead of one allocation each."""

        @staticmethod
        def create(*_args, **_kwargs):
            return StackOrPool()

        def stack_elements(self) -> int:
            """The elements Inductor's stack test counts (static-shape CPU buffers), none reused."""
            total = 0
            for line in self.lines:
                if isinstance(line, AllocateLine) and line.node.get_device_or_error().type == "cpu":
                    shape = self.static_shape_for_buffer_or_none(line.node)
                    total += functools.reduce(operator.mul, shape, 1) if shape is not None else 0
            return total

        def run_wrapper_ir_passes(self, is_inference: bool):
            # An extern kernel call (an aten op the unit calls as a library function) has already
            # turned stack arrays off by now, as too many elements will when the plan is made.
            fits = self.allow_stack_allocation and self.stack_elements() <= array_ref.MAX_STACK_ALLOCATION_SIZE
            with config.patch(memory_planning=not (is_inference and fits)):
                super().run_wrapper_ir_passes(is_inference)

    return StackOrPool


@contextlib.contextmanager
def unit_wrapper() -> Iterator[None]:
    """While a small CPU unit compiles: its C++ wrapper is StackOrPool. Inductor picks the wrapper
    class per device from a table filled once per process; the table is restored afterwards, so
    every other C++-wrapper graph keeps Inductor's own. Where StackOrPool cannot be built on this
    torch, Inductor's own wrapper pools the unit's intermediates (SMALL_UNIT's memory_planning)."""
    from torch._inductor.codegen import common

    common.init_backend_registration()
    before = common.device_codegens["cpu"]
    try:
        ours = dataclasses.replace(before, cpp_wrapper_codegen=_stack_or_pool_class())
    except (AttributeError, ImportError, TypeError):  # another torch's Inductor: its own wrapper, pooled
        ours = before
    common.device_codegens["cpu"] = ours
    try:
        yield
    finally:
        common.device_codegens["cpu"] = before
