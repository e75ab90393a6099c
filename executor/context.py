"""The execution context: everything process-wide that a run selects, installed as one unit.

Why: executor.ops dispatches to the active op table and executor.scope opens the active scope
implementation; both are read while the decode step is traced, and Inductor reads its cache
directory from the environment. Set here and there, two recipes in one process (tests, the
accuracy tool, the scope search) would leak them into each other. The runner builds one
context from its backend and enters it around everything that traces or runs the model; on
exit every piece is restored to what it was before.

The context also carries the run's process groups (`parallel`, executor.parallel): the runner
hands them to the model it builds, so each layer receives its group at construction and no
layer reads a global. They are not "installed": torch.distributed's groups live as long as the
process, and a second runner in the same process reuses them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

from executor import ops
from executor.backends.base import Backend
from executor.parallel.groups import SINGLE_DEVICE, Parallel
from executor.scope import ScopeFactory, scope_impl


@dataclass(frozen=True)
class ExecutionContext:
    op_table: str = "reference"  # executor.ops table
    scope_factory: ScopeFactory | None = None  # what superkernel_scope opens (None: portable markers)
    environment: dict[str, str] = field(default_factory=dict)  # e.g. TORCHINDUCTOR_CACHE_DIR
    parallel: Parallel = SINGLE_DEVICE  # process groups by role

    @classmethod
    def for_backend(cls, backend: Backend, parallel: Parallel = SINGLE_DEVICE) -> ExecutionContext:
        return cls(backend.op_table, backend.scope_factory(), backend.environment(), parallel)

    @contextlib.contextmanager
    def active(self) -> Iterator[ExecutionContext]:
        """Install the op table, scope implementation and environment; restore all on exit."""
        with ops.using(self.op_table), scope_impl(self.scope_factory), environment(self.environment):
            yield self


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    previous = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
