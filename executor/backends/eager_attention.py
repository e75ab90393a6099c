"""bf16 causal attention of the eager prefill on CPU: this project's flash kernel instead of SDPA's.

Why: on the reference machine (2-core AMD EPYC with AVX512-BF16) PyTorch's CPU flash attention
ran one 2048-token Qwen3-0.6B layer (16 query heads, 8 KV heads, D = 128) in 123-136 ms in bf16,
~130 GFLOP/s where the same machine's bf16 GEMMs run ~420, and that was 40% of the prefill.
`cann_cpu::causal_attention` (csrc/causal_attention.cpp) ran the same layer in 50-57 ms, and 2.5-3x
faster at 128 and 512 tokens too (BENCHMARKS.md, "twelfth pass"): it packs each KV head once for
AVX512-BF16's dot product, computes all the query heads of a group against each packed block, and
never computes the blocks above the diagonal.

Only the plain causal case goes through here: executor.ops' reference attention passes a prefill
from slot 0 to `scaled_dot_product_attention(..., is_causal=True)`, and this mode, active around
the runner's eager prefill, runs those calls in bf16 on CPU with whole 64-wide heads. Every other
call (a mask, fp32, a head_dim the kernel does not tile, a CPU without AVX512-BF16) is SDPA's, as
before. The kernel is built on the first call that qualifies, like a custom op's; where it cannot
be built one line says so and SDPA runs the calls. metrics.json records which kernel ran
(`prefill_attention`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from executor.custom_ops._build import load_optional_kernel

KERNEL = "cann_cpu::causal_attention"
KERNEL_SOURCE = Path(__file__).resolve().parent / "csrc" / "causal_attention.cpp"
HEAD_DIM_MULTIPLE = 64  # the kernel's tile width over keys and output columns

_lib = torch.library.Library("cann_cpu", "FRAGMENT")  # the namespace is defined by packed_linear
_lib.define("causal_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor")
_lib.define("causal_attention_supported() -> bool")


@functools.cache
def kernel_runs() -> bool:
    """The kernel is built and loaded (once per machine / process) and this CPU has AVX512-BF16.
    A build that cannot happen is said once, not raised: SDPA then runs every call."""
    built = load_optional_kernel(
        KERNEL,
        "cann_cpu_causal_attention",
        KERNEL_SOURCE,
        "eager_attention",
        "the bf16 prefill attention runs on SDPA instead",
    )
    return built and bool(torch.ops.cann_cpu.causal_attention_supported())


def qualifies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask, dropout_p: float, is_causal: bool) -> bool:
    """An SDPA call the kernel computes exactly: causal with no mask, bf16 on CPU, (B, H, S, D)
    with as many keys as queries, whole 64-wide heads, grouped heads, nothing to differentiate."""
    return (
        is_causal
        and attn_mask is None
        and dropout_p == 0.0
        and q.device.type == "cpu"
        and q.dtype == k.dtype == v.dtype == torch.bfloat16
        and q.dim() == k.dim() == v.dim() == 4
        and k.shape == v.shape
        and q.shape[0] == k.shape[0]
        and q.shape[2] == k.shape[2] > 0
        and q.shape[3] == k.shape[3]
        and q.shape[3] % HEAD_DIM_MULTIPLE == 0
        and q.shape[1] % k.shape[1] == 0
        and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
    )


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T scale, causal) v with the kernel; q (B, Hq, S, D), k and v (B, Hkv, S, D), bf16.
    The caller checked `qualifies` and `kernel_runs`."""
    rows_contiguous = [t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v)]
    return torch.ops.cann_cpu.causal_attention(*rows_contiguous, q.shape[-1] ** -0.5 if scale is None else scale)


class CausalAttentionMode(TorchFunctionMode):
    """While active, a qualifying `F.scaled_dot_product_attention` runs the kernel; `calls` counts
    them (what metrics.json reports)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            call = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale"), args))
            call.update(kwargs)
            q, k, v = call["query"], call["key"], call["value"]
            gqa = call.get("enable_gqa", False) or q.shape[1] == k.shape[1]
            mask, dropout, causal = call.get("attn_mask"), call.get("dropout_p", 0.0), call.get("is_causal", False)
            if gqa and qualifies(q, k, v, mask, dropout, causal) and kernel_runs():
                self.calls += 1
                return causal_attention(q, k, v, call.get("scale"))
        return func(*args, **kwargs)


class EagerAttention:
    """The runner's prefill attention on CPU in bf16: the kernel for every qualifying call (built
    on the first), SDPA for the rest and on every other device and dtype."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.enabled = device.type == "cpu" and dtype == torch.bfloat16
        self.calls = 0

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        mode = CausalAttentionMode()
        try:
            with mode:
                yield
        finally:
            self.calls += mode.calls

    def to_metrics(self) -> dict:
        return {"kernel": KERNEL if self.calls else "sdpa", "kernel_calls": self.calls}
