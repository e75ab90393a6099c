"""Import path the Ascend SuperKernel workflow documents: `from executor.utils import superkernel_scope`."""

from executor.scope import superkernel_scope

__all__ = ["superkernel_scope"]
