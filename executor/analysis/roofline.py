"""This machine's roofline: what bounds each op, measured, not assumed.

An op moving B bytes and doing F FLOPs cannot take less than max(B / bandwidth, F / peak) here.
Which of the two is larger says whether it is bandwidth- or compute-bound on this machine; a
measured time far above both (OVERHEAD_FACTOR) means neither: the op is dominated by dispatch
and launch cost, which graph mode and SuperKernel scopes remove. Both rates are measured the
first time they are asked for (a reduction over a tensor far larger than the caches; a square
matmul in the run's dtype), best of several tries, since a shared machine only ever adds time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

OVERHEAD_FACTOR = 5.0  # measured > 5x the roofline time: dispatch/launch, not the hardware, bounds the op
BANDWIDTH_BYTES = 1 << 28  # 256 MiB: far beyond any CPU cache
MATMUL_N = 1024


@dataclass(frozen=True)
class Machine:
    read_gbs: float  # GB/s, a reduction over BANDWIDTH_BYTES
    peak_gflops: float  # GFLOP/s, an N x N x N matmul in the run's dtype
    dtype: str

    @property
    def balance(self) -> float:
        """FLOPs per byte where the two roofs meet: ops below it are bandwidth-bound."""
        return self.peak_gflops / self.read_gbs


def _best(fn, tries: int = 5) -> float:
    fn()
    times = []
    for _ in range(tries):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(dtype: torch.dtype = torch.float32) -> Machine:
    src = torch.empty(BANDWIDTH_BYTES // 4, dtype=torch.float32).uniform_()
    read = BANDWIDTH_BYTES / _best(src.sum) / 1e9
    del src
    a = torch.randn(MATMUL_N, MATMUL_N).to(dtype)
    peak = 2 * MATMUL_N**3 / _best(lambda: a @ a) / 1e9
    return Machine(round(read, 2), round(peak, 1), str(dtype).removeprefix("torch."))


def roofline_ms(flops: float, nbytes: float, machine: Machine) -> float:
    return max(nbytes / (machine.read_gbs * 1e9), flops / (machine.peak_gflops * 1e9)) * 1e3


def bound(flops: float, nbytes: float, ms: float, machine: Machine) -> str:
    """'bandwidth', 'compute' or 'overhead' (measured time far above the roofline, or nothing moved)."""
    floor = roofline_ms(flops, nbytes, machine)
    if floor <= 0 or ms > OVERHEAD_FACTOR * floor:
        return "overhead"
    return "compute" if flops / (machine.peak_gflops * 1e9) > nbytes / (machine.read_gbs * 1e9) else "bandwidth"
