"""Large CPU weights on whole 2 MiB pages.

Why: a decode step streams every weight once, and 4 KiB pages slow that stream (the prefetchers
stop at each page: executor/__init__.py asks PyTorch's allocator for transparent huge pages for
that reason). But the allocator aligns a tensor to 4 KiB only, and the kernel makes a huge page
only of a 2 MiB region wholly inside the advised range, so the regions at both ends of every
weight stay in 4 KiB pages: one region's worth per projection, 10% of the 0.6B fp32 weights (read
from the page flags of every parameter). Memory that glibc kept and hands out again (the malloc
policy in executor/__init__.py) is in 4 KiB pages already, and advice does not change pages that
exist. So a large weight is copied into an allocation one region longer, into the view that starts
on a region boundary, advised before the copy faults its pages in; then its whole regions are
collapsed into huge pages (MADV_COLLAPSE, Linux 6.1+: synchronous, and for pages already there).
The runner does this to the model's weights once they are loaded, packed_linear to the packed
copies it makes. On the AVX2 kind, alternating rounds in one process, the 0.6B batch-1 ge_graph
step took 0.92-0.98x the time in fp32 and 0.92-0.95x in bf16; batch 16 (compute-bound there) was
level (BENCHMARKS.md, "fiftieth pass").

Only where the process asked for huge pages (`THP_MEM_ALLOC_ENABLE=1`, executor/__init__.py's
default) and the kernel's mode allows them; metrics.json records what `place` did
(`weights_on_huge_pages`). One weight is copied at a time, so the peak grows by one weight.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os

import torch

from executor import thp_mode

REGION = 2 << 20  # the x86-64 transparent huge page
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # linux/mman-common.h


def wanted() -> bool:
    """Whether large weights go on huge pages in this process (see the module docstring)."""
    return os.environ.get("THP_MEM_ALLOC_ENABLE") == "1" and _kernel_mode() in ("always", "madvise")


@functools.cache
def _kernel_mode() -> str:
    return thp_mode()


def why_not() -> str:
    """Why `wanted()` says no (or what it read): the process's ask and the kernel's mode."""
    return f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}, kernel: {_kernel_mode()}"


@functools.cache
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _advise(libc, start: int, stop: int, advice: int) -> bool:
    """madvise over the whole regions in [start, stop); True if it took (or there were none)."""
    lo, hi = -(-start // REGION) * REGION, stop // REGION * REGION
    return hi <= lo or libc.madvise(lo, hi - lo, advice) == 0


def _on_regions(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, fill) -> tuple[torch.Tensor, bool]:
    """(a new contiguous CPU tensor that starts on a 2 MiB boundary, filled by `fill(out)` after
    the advice and before the collapse, whether its whole regions were collapsed into huge pages)."""
    nbytes = math.prod(shape) * dtype.itemsize
    buf = torch.empty(nbytes + REGION, dtype=torch.uint8)
    offset = -buf.data_ptr() % REGION
    out = buf[offset : offset + nbytes].view(dtype).view(shape)
    libc = _libc()
    start = out.data_ptr()
    _advise(libc, start, start + nbytes, MADV_HUGEPAGE)  # before the fill faults the pages in
    fill(out)
    return out, _advise(libc, start, start + nbytes, MADV_COLLAPSE)


def aligned_copy(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(a contiguous copy of CPU tensor `t` (any strides: the copy is the re-layout) that starts
    on a 2 MiB boundary, whether its whole regions were collapsed into huge pages)."""
    return _on_regions(t.shape, t.dtype, lambda out: out.copy_(t))


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """(`torch.zeros(shape, dtype=dtype)` on the CPU, whether it is on huge pages): where it is of
    one region or more and the process wants huge pages, it starts on a 2 MiB boundary with its
    regions collapsed, as a placed weight. For the KV cache (executor/kv_cache.py), which a
    long-context decode step reads like a weight: at 8k cached tokens ~80% of its bytes had been on
    huge pages, and `cann::decode_attention` over 28 layers' caches placed this way took 0.94-0.97x
    the time in bf16 (2048-8192 slots, four runs) and 0.90-0.94x in fp32 (one run; Zen 4;
    BENCHMARKS.md, "sixty-sixth pass")."""
    if math.prod(shape) * dtype.itemsize < REGION or not wanted():
        return torch.zeros(shape, dtype=dtype), False
    return _on_regions(shape, dtype, torch.Tensor.zero_)


def large(t: torch.Tensor) -> bool:
    """A CPU tensor of at least one region, in a process that wants huge pages."""
    return t.device.type == "cpu" and t.numel() * t.element_size() >= REGION and wanted()


def contiguous(t: torch.Tensor) -> torch.Tensor:
    """`t.contiguous()`, on huge pages if it is `large` (a packed weight's layout: packed_linear)."""
    return aligned_copy(t)[0] if large(t) else t.contiguous()


class Placement:
    """What `place` did: weights moved, their bytes, how many of them were collapsed."""

    def __init__(self, reason: str = ""):
        self.moved = self.collapsed = self.nbytes = 0
        self.reason = reason  # why nothing was moved, if so

    def to_metrics(self) -> str:
        if self.reason:
            return f"not placed ({self.reason})"
        if not self.moved:
            return "nothing to place (no CPU tensor of 2 MiB or more)"
        return (
            f"{self.moved} tensors ({self.nbytes / 2**20:.0f} MiB) on 2 MiB boundaries, "
            f"{self.collapsed} of them collapsed into huge pages"
        )


def place(module: torch.nn.Module) -> Placement:
    """Move every large CPU parameter and buffer of `module` onto huge pages, one at a time;
    tensors that share storage (tied weights) stay shared."""
    if not wanted():
        return Placement(why_not())
    done = Placement()
    moved: dict[tuple, torch.Tensor] = {}
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
            if key in moved:
                tensor.data = moved[key]
            elif large(tensor) and tensor.is_contiguous():
                new, collapsed = aligned_copy(tensor.data)
                tensor.data = moved[key] = new
                done.moved += 1
                done.collapsed += collapsed
                done.nbytes += tensor.numel() * tensor.element_size()
    return done
