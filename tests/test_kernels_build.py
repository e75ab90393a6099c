"""The backends' own CPU kernels (executor/backends/csrc) build wherever a loop of theirs can run.

A kernel that cannot be built is said in one line and its calls go to what ran before it existed
(aten, oneDNN, SDPA, torch.argmax): right on a host without a compiler, a silent slowdown anywhere
else. Each kernel's own tests skip when it is not built, so without this file a kernel that stops
compiling on one kind of CPU reads as "this CPU cannot". That happened: gemv.cpp once failed to
build on every CPU without AVX-512 (an AVX-512 function used AVX512-VL instructions its target did
not name), and the suite stayed green on the AVX2 hosts.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from executor.backends import eager_attention, eager_linear, eager_pointwise, greedy, packed_linear
from executor.custom_ops import _build

CSRC = Path(eager_linear.__file__).resolve().parent / "csrc"


def _any_simd() -> bool:
    return _build.cpu_has_avx2() or _build.cpu_has_avx512(torch.float32)


# source file -> (this CPU runs a loop of it, the kernel is built and loaded here)
KERNELS = {
    "gemv.cpp": (_any_simd, lambda: eager_linear.gemv_runs(torch.float32) and eager_linear.gemv_runs(torch.bfloat16)),
    "rows_linear.cpp": (_any_simd, lambda: packed_linear.kernel_runs(torch.float32)),
    "amx_linear.cpp": (_build.cpu_has_amx, packed_linear.amx_runs),
    "causal_attention.cpp": (lambda: _build.cpu_has_avx512(torch.bfloat16), eager_attention.kernel_runs),
    "pointwise.cpp": (lambda: True, eager_pointwise.kernel_runs),  # ATen's vector types: any CPU
    "greedy.cpp": (lambda: True, greedy.kernel_runs),
}


def test_every_kernel_source_is_listed_here():
    """A new kernel gets a row above, or its build is never asked for outside its own (skipping) tests."""
    assert sorted(p.name for p in CSRC.glob("*.cpp")) == sorted(KERNELS)


@pytest.mark.parametrize("source", sorted(KERNELS))
def test_the_kernel_builds_wherever_a_loop_of_it_runs(source):
    if shutil.which(_build.compiler()) is None or shutil.which("ninja") is None:
        pytest.skip("no C++ toolchain here: the kernels are not built, by design")
    cpu_runs, built = KERNELS[source]
    if not cpu_runs():
        pytest.skip(f"no loop of {source} runs on this CPU")
    assert built(), f"{source} did not build or load on a CPU that runs it (see the one-line message above)"
