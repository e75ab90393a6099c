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
_lib.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
_lib.define("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)")
_lib.define("swiglu(Tensor x) -> Tensor")
_lib.define("rotary_mul(Tensor x, Tensor cos, Tensor sin) -> Tensor")
_lib.define("kv_update(Tensor(a!) cache, Tensor new, Tensor positions) -> Tensor(a!)")


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


def qualifies(*tensors: torch.Tensor) -> bool:
    """Tensors the kernels take: CPU, one dtype of DTYPES, rows contiguous, nothing to differentiate.

    Written as a plain loop over `is_cpu`: the eager step asks this ~9 times a layer, and as one
    `all()` over a generator reading `t.device.type` (a new device object per tensor) it cost 3.6-7.4
    us a call against 1.6-3.2 (BENCHMARKS.md, "fifty-second pass")."""
    first = tensors[0]
    dtype = first.dtype
    if dtype not in DTYPES or first.numel() == 0:
        return False
    for t in tensors:
        if not t.is_cpu or t.dtype != dtype or t.stride(-1) != 1:
            return False
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)


class PointwiseKernels:
    """The five op-table functions on the kernels, counting the calls they take."""

    def __init__(self):
        self.calls = 0

    def _take(self, *tensors: torch.Tensor) -> bool:
        if qualifies(*tensors) and kernel_runs():
            self.calls += 1
            return True
        return False

    def rms_norm(self, x, weight, eps):
        if weight.dim() == 1 and weight.is_contiguous() and self._take(x, weight):
            return torch.ops.cann_cpu.rms_norm(x, weight, eps)
        return reference.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        same = residual.shape == x.shape and weight.dim() == 1 and weight.is_contiguous()
        if same and self._take(x, residual, weight):
            return torch.ops.cann_cpu.add_rms_norm(x, residual, weight, eps)
        return reference.add_rms_norm(x, residual, weight, eps)

    def swiglu(self, x):
        if x.dim() >= 1 and x.shape[-1] % 2 == 0 and self._take(x):
            return torch.ops.cann_cpu.swiglu(x)
        return reference.swiglu(x)

    def rotary_mul(self, x, cos, sin):
        if x.shape[-1] % 2 == 0 and cos.dim() <= x.dim() and sin.dim() <= x.dim():
            try:
                cos_x, sin_x = cos.expand_as(x), sin.expand_as(x)
            except RuntimeError:  # not broadcastable to x: the reference says why
                return reference.rotary_mul(x, cos, sin)
            if self._take(x, cos_x, sin_x):
                return torch.ops.cann_cpu.rotary_mul(x, cos_x, sin_x)
        return reference.rotary_mul(x, cos, sin)

    def kv_update(self, cache, new, positions):
        shapes = cache.dim() == new.dim() == 4 and positions.dim() == 2 and positions.dtype == torch.long
        if shapes and positions.device.type == "cpu" and self._take(cache, new):
            return torch.ops.cann_cpu.kv_update(cache, new, positions)
        return reference.kv_update(cache, new, positions)

    def table(self) -> dict[str, Callable]:
        return {name: getattr(self, name) for name in OPS}
