"""`select_backend()`: the one place that turns (exe_mode, platform) into a decode backend.

| exe_mode    | cpu / cuda                         | npu                                   |
|-------------|------------------------------------|---------------------------------------|
| eager       | plain PyTorch                      | torch_npu eager (fused ops)           |
| ge_graph    | Inductor; SK = one launch per scope| torchair GE backend; SK = super_kernel|
| npugraph_ex | error: needs an Ascend NPU         | npugraph_ex backend; SK post-capture  |

Every backend implements executor.backends.base.Backend. Nothing is downgraded silently: an
impossible request raises UnsupportedError (exit code 2).
"""

from __future__ import annotations

from executor.backends.base import Backend, EagerBackend, UnsupportedError
from executor.config import ModelConfig
from executor.platform import Platform

__all__ = ["UnsupportedError", "select_backend"]


def select_backend(mc: ModelConfig, platform: Platform) -> Backend:
    """The backend this run compiles its decode step with (not compiled yet: see Backend.compile)."""
    if platform.kind == "npu":
        from executor.backends import npu  # the only module that imports torch_npu / torchair

        return npu.select_backend(mc)
    if mc.exe_mode == "eager":
        return EagerBackend()
    if mc.exe_mode == "npugraph_ex":
        raise UnsupportedError(
            f"exe_mode npugraph_ex needs an Ascend NPU with torch_npu; this machine is "
            f"{platform.describe()} (use exe_mode ge_graph for the portable graph mode)"
        )
    from executor.backends.inductor import InductorBackend

    return InductorBackend(mc, platform.kind)
