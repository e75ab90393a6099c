"""`select_backend()`: the one place that turns (exe_mode, platform) into a decode backend.

| exe_mode    | cpu / cuda                         | npu                                   |
|-------------|------------------------------------|---------------------------------------|
| eager       | plain PyTorch                      | torch_npu eager (fused ops)           |
| ge_graph    | Inductor; SK = one launch per scope| torchair GE backend; SK = super_kernel|
| npugraph_ex | error: needs an Ascend NPU         | npugraph_ex backend; SK post-capture  |

Every backend implements executor.backends.base.Backend. Nothing is downgraded silently: an
impossible request raises UnsupportedError (exit code 2). A backend's op table is its own with the
config's custom ops layered on top (executor.custom_ops.layer; the NPU adapter installs their
NPU kernels, the others build their CPU kernels).

`resolve_dtype()` is the one place `model_config.dtype: auto` becomes a dtype, and where a dtype
the platform's op table cannot run is refused, before anything is built or loaded.
"""

from __future__ import annotations

from executor import custom_ops
from executor.backends.base import Backend, DecodeSpec, EagerBackend, UnsupportedError
from executor.platform import Platform

__all__ = ["AUTO_DTYPE", "DecodeSpec", "UnsupportedError", "resolve_dtype", "select_backend"]

# What `dtype: auto` means per platform: the NPU's fused attention takes float16/bfloat16 only and
# CUDA runs bfloat16 natively; on CPU float32 is both the fastest and the most accurate choice.
AUTO_DTYPE = {"npu": "bfloat16", "cuda": "bfloat16", "cpu": "float32"}


def resolve_dtype(requested: str, platform: Platform) -> str:
    """`model_config.dtype` as the run will use it: "auto" resolved for `platform`; a dtype the
    platform's op table cannot run (float32 on NPU) is an UnsupportedError, never a cast."""
    dtype = AUTO_DTYPE[platform.kind] if requested == "auto" else requested
    if platform.kind == "npu":
        from executor.backends import npu

        npu.check_dtype(dtype)
    return dtype


def select_backend(spec: DecodeSpec, platform: Platform) -> Backend:
    """The backend this run compiles its decode step with (not compiled yet: see Backend.compile)."""
    mc = spec.model_config
    if platform.kind == "npu":
        from executor.backends import npu  # the only module that imports torch_npu / torchair

        return npu.select_backend(spec)
    if mc.exe_mode == "eager":
        table = custom_ops.layer("reference", mc.custom_ops, custom_ops.installer(platform.kind))
        if platform.kind != "cpu":
            return EagerBackend(table)
        from executor.backends.eager_kernels import eager_step  # our linear and pointwise kernels

        return EagerBackend(table, eager_step)
    if mc.exe_mode == "npugraph_ex":
        raise UnsupportedError(
            f"exe_mode npugraph_ex needs an Ascend NPU with torch_npu; this machine is "
            f"{platform.describe()} (use exe_mode ge_graph for the portable graph mode)"
        )
    from executor.backends.inductor import InductorBackend

    return InductorBackend(spec, platform.kind)
