"""The eager CPU path's norms, SwiGLU, RoPE and KV-cache writes: one kernel call each, not 4-8 aten calls.

Why: executor.ops' reference functions are written in plain PyTorch so that they run everywhere
and Inductor can fuse them into a compiled decode step. Run eagerly, each is several passes over
memory with dtype casts and temporaries in between. `csrc/pointwise.cpp` computes each in one
pass, rounding where the reference rounds (bf16 results were bit-equal to the reference's on
random inputs; a norm may differ by one rounding where its sum is ordered differently). At the
Qwen3-0.6B shape with a 128-token prompt one layer's calls took 0.61-0.81x the reference's time
and the bf16 prefill 0.94x (BENCHMARKS.md, "thirteenth pass"). The KV-cache write (the reference's
index_put_ with two aranges for its indices) is row copies: the host-bound eager step took 0.86-0.90x
the time ("fifty-first pass").

What runs through here: the runner's eager prefill and the eager backend's decode step on CPU
(executor.backends.eager_kernels installs these over the op table's reference entries). A call
the kernels do not take (another dtype, a row that is not contiguous, autograd) runs the
reference. The kernels are built on the first call; where they cannot be, one line says so and
the reference runs everything. metrics.json records the calls (`prefill_pointwise`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch

from executor.custom_ops._build import load_optional_kernel
from executor.ops import reference

KERNEL_SOURCE = Path(__file__).resolve().parent / "csrc" / "pointwise.cpp"
DTYPES = (torch.bfloat16, torch.float32)
OPS = ("rms_norm", "add_rms_norm", "swiglu", "rotary_mul", "kv_update")

_lib = torch.library.Library("cann_cpu", "FRAGMENT")  # the namespace is defined by packed_linear
# Each returns None (kv_update: False), having written nothing, for a call it does not take
# (csrc/pointwise.cpp says which), and the reference runs it.
_lib.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor?")
_lib.define("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> Tensor[]")
_lib.define("swiglu(Tensor x) -> Tensor?")
_lib.define("rotary_mul(Tensor x, Tensor cos, Tensor sin) -> Tensor?")
_lib.define("kv_update(Tensor(a!) cache, Tensor new, Tensor positions) -> bool")
# The overloads, looked up once: an op packet (torch.ops.cann_cpu.swiglu) adds a Python frame per call.
_RMS_NORM = torch.ops.cann_cpu.rms_norm.default
_ADD_RMS_NORM = torch.ops.cann_cpu.add_rms_norm.default
_SWIGLU = torch.ops.cann_cpu.swiglu.default
_ROTARY_MUL = torch.ops.cann_cpu.rotary_mul.default
_KV_UPDATE = torch.ops.cann_cpu.kv_update.default


@functools.cache
def kernel_runs() -> bool:
    """The kernels are built and loaded (once per machine / process); a build that cannot happen
    is said once, and the reference runs every call."""
    return load_optional_kernel(
        "cann_cpu::rms_norm",
        "cann_cpu_pointwise",
        KERNEL_SOURCE,
        "eager_pointwise",
        "the eager norms, SwiGLU and RoPE run on the reference instead",
    )


def may_take(*tensors: torch.Tensor) -> bool:
    """The kernels may take a call on these tensors: all on the CPU (the only device they are
    registered for), nothing to differentiate (they have no backward), the kernels built. Each
    kernel checks the rest itself (dtype, row strides, shapes) and says whether it took the call.

    Why so little here: the eager step makes ~9 of these calls a layer, and reading dtypes and
    strides from Python before each (as a `qualifies` here did) cost 2.3-4.9 us a call where the
    kernels' own checks cost well under one; on the Intel AMX kind the 0.6B bf16 eager step took
    0.957x the time at batch 1 and 0.975-0.982x at batch 4 with the checks in the kernels, the same
    kernels in one process either way (BENCHMARKS.md, "seventy-seventh pass"). A plain loop over
    `is_cpu`: `device.type` makes a device object per read ("fifty-second pass")."""
    for t in tensors:
        if not t.is_cpu:
            return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return kernel_runs()


class PointwiseKernels:
    """The five op-table functions on the kernels, counting the calls they take."""

    def __init__(self):
        self.calls = 0

    def rms_norm(self, x, weight, eps):
        y = _RMS_NORM(x, weight, eps) if may_take(x, weight) else None
        if y is None:
            return reference.rms_norm(x, weight, eps)
        self.calls += 1
        return y

    def add_rms_norm(self, x, residual, weight, eps):
        out = _ADD_RMS_NORM(x, residual, weight, eps) if may_take(x, residual, weight) else None
        if not out:
            return reference.add_rms_norm(x, residual, weight, eps)
        self.calls += 1
        return out[0], out[1]

    def swiglu(self, x):
        y = _SWIGLU(x) if may_take(x) else None
        if y is None:
            return reference.swiglu(x)
        self.calls += 1
        return y

    def rotary_mul(self, x, cos, sin):
        y = _ROTARY_MUL(x, cos, sin) if may_take(x, cos, sin) else None
        if y is None:
            return reference.rotary_mul(x, cos, sin)
        self.calls += 1
        return y

    def kv_update(self, cache, new, positions):
        if may_take(cache, new, positions) and _KV_UPDATE(cache, new, positions):
            self.calls += 1
            return cache
        return reference.kv_update(cache, new, positions)

    def table(self) -> dict[str, Callable]:
        return {name: getattr(self, name) for name in OPS}
