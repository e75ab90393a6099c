"""The eager CPU path's own kernels, put over the op table for the runner's prefill and the eager decode step.

While `EagerKernels.active()` (or a step wrapped by `eager_step`) runs, the op table entries
that are still the reference's own functions (executor.ops.over_reference) are these instead:
- `linear`: `cann_cpu::gemv` for 1-4 rows in bf16 and fp32 (one bf16 row on a CPU with AMX), oneDNN for
  more rows in fp32, and
  `cann_cpu::rows_linear` for more rows in bf16 where oneDNN would emulate it
  (executor.backends.eager_linear);
- `attention`: `cann_cpu::causal_attention` for the causal prefill, bf16 and fp32 (eager_attention);
- `rms_norm`, `add_rms_norm`, `swiglu`, `rotary_mul`: one pass each; `kv_update`: row copies
  (eager_pointwise).
Each takes only the calls it computes as the reference does and hands the others to the
reference. An entry that another table set (NPU, a custom op of model_config.custom_ops) stays.

Why the op table and not torch function modes (what the linears and the attention used before):
a mode sees every torch call of the forward, views and splits included, and a 0.6B prefill paid
~8-11 ms for the two modes on the reference machine (BENCHMARKS.md, "thirteenth pass"); the
table costs one dictionary lookup per op, which model code pays anyway. A compiled decode step
never runs under these: it traces the reference, which Inductor fuses.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

from executor import ops
from executor.backends import eager_attention, eager_linear, eager_pointwise


class KernelTable:
    """The kernels' op-table functions and their call counts."""

    def __init__(self):
        self.linears = eager_linear.LinearKernel()
        self.attention = eager_attention.AttentionKernel()
        self.pointwise = eager_pointwise.PointwiseKernels()

    def functions(self, attention: bool = True, pointwise: bool = True) -> dict[str, Callable]:
        table = {"linear": self.linears.linear}
        if attention:
            table["attention"] = self.attention.attention
        if pointwise:
            table.update(self.pointwise.table())
        return table


class EagerKernels:
    """The runner's choice for its eager prefill, made once from the device, dtype and weights;
    `to_metrics` says which kernels ran and how often (metrics.json)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype):
        self.linear_kernel = eager_linear.kernel_for(model, device, dtype)
        self.attention = device.type == "cpu" and dtype in eager_attention.DTYPES
        self.pointwise = device.type == "cpu" and dtype in eager_pointwise.DTYPES
        self.kernels = KernelTable()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        table = self.kernels.functions(self.attention, self.pointwise)
        if self.linear_kernel == "aten":
            del table["linear"]
        with ops.over_reference(table):
            yield

    def to_metrics(self) -> dict[str, dict]:
        k = self.kernels
        return {
            "prefill_linears": {
                "kernel": self.linear_kernel,
                "onednn_calls": k.linears.onednn_calls,
                "gemv_calls": k.linears.gemv_calls,
                "dot_calls": k.linears.dot_calls,
                "rows_calls": k.linears.rows_calls,
                "amx_calls": k.linears.amx_calls,
                "aten_calls": k.linears.aten_calls,
            },
            "prefill_attention": {
                "kernel": eager_attention.KERNEL if k.attention.calls else "sdpa",
                "kernel_calls": k.attention.calls,
            },
            "prefill_pointwise": {
                "kernel": "cann_cpu::pointwise" if k.pointwise.calls else "reference",
                "kernel_calls": k.pointwise.calls,
            },
        }


def eager_step(step: Callable) -> Callable:
    """`step` (the eager backend's decode step on CPU) run with the kernels over the op table, in
    inference mode.

    Why inference mode: an eager step is ~40 op calls per layer, and under no_grad each still bumps
    version counters and records view metadata, which inference mode skips: the host-bound step
    (bench-overhead, 8 layers) took 0.91-0.92x the time, ~0.5 ms less; at the 0.6B shape, where
    the weights' stream dominates, the change was within the VM's noise (BENCHMARKS.md,
    "fifty-first pass"). What the step makes (hidden states, logits) are inference tensors: read
    afterwards, never changed in place. The KV cache and the positions are made outside and may be
    written in place inside. The compiled modes keep no_grad: Dynamo guards on the grad mode, and
    the prefill's causal-mask memo needs a version counter (executor.memo)."""
    table = KernelTable().functions()

    @functools.wraps(step)
    def run(*args, **kwargs):
        with torch.inference_mode(), ops.over_reference(table):
            return step(*args, **kwargs)

    return run
