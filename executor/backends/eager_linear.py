"""fp32 linears of the eager prefill on CPU: oneDNN instead of aten's sgemm.

Why: in this torch build aten's fp32 `linear` is MKL's sgemm, and on the reference machine (an
AMD EPYC) it ran the Qwen3-0.6B prefill's GEMMs at 60-90 GFLOP/s, while oneDNN, which this build
also carries, ran the same products 1.2-1.7x faster on the plain, unpacked weight (M = 128-2048
rows; a square product: 133 against 207 GFLOP/s; BENCHMARKS.md, "sixth pass"). The fp32 prefill
is ~90% GEMMs, so this is most of its time. bf16 is left alone: aten already sends bf16 linears
to oneDNN.

Only what runs eagerly goes through here: the prefill (executor.runner). A compiled decode
graph picks its own kernels (the GEMV lowering and `cann_cpu::packed_linear`), and a torch
function mode active while Dynamo traces would put its choices into the graph instead.

The weight is used as stored, which measured within 3-20% of a copy packed for oneDNN: no
second copy of the weights, unlike the packed decode path. Small weights stay with aten, as
there (a oneDNN call's setup costs more than it saves on a weight in cache).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

from executor.backends import packed_linear


def _qualifies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.numel() >= packed_linear.MIN_WEIGHT_NUMEL
        and x.numel() > 0
        and (bias is None or bias.dtype == torch.float32)
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


class OneDNNLinears(TorchFunctionMode):
    """While active, `F.linear` (and so every nn.Linear) with a qualifying fp32 CPU weight runs
    through oneDNN; `calls` counts them (what metrics.json reports)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch._C._nn.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if _qualifies(x, weight, bias):
                self.calls += 1
                rows = x.reshape(-1, x.shape[-1])
                out = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
                return out.view(*x.shape[:-1], weight.shape[0])
        return func(*args, **kwargs)


class EagerLinears:
    """The runner's choice for its eager prefill, made once: oneDNN where it applies (a CPU run
    in fp32 with oneDNN available and at least one weight large enough), else aten as is."""

    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype):
        large = any(p.dim() == 2 and p.numel() >= packed_linear.MIN_WEIGHT_NUMEL for p in model.parameters())
        self.kernel = (
            "onednn"
            if device.type == "cpu" and dtype == torch.float32 and large and packed_linear.supported(dtype)
            else "aten"
        )
        self.calls = 0

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        if self.kernel != "onednn":
            yield
            return
        mode = OneDNNLinears()
        try:
            with mode:
                yield
        finally:
            self.calls += mode.calls

    def to_metrics(self) -> dict:
        return {"kernel": self.kernel, "onednn_calls": self.calls}
