"""`compile_decode()`: the one place that turns (exe_mode, platform) into a decode step.

| exe_mode    | cpu / cuda                         | npu                                   |
|-------------|------------------------------------|---------------------------------------|
| eager       | plain PyTorch                      | torch_npu eager (fused ops)           |
| ge_graph    | Inductor; SK = one launch per scope| torchair GE backend; SK = super_kernel|
| npugraph_ex | error: needs an Ascend NPU         | npugraph_ex backend; SK post-capture  |

Nothing is downgraded silently: an impossible request raises UnsupportedError (exit code 2).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from executor import ops
from executor.config import ModelConfig
from executor.platform import Platform

DEFAULT_CACHE = Path.home() / ".cache" / "cann-recipes-infer" / "compile"


class UnsupportedError(Exception):
    """Requested but impossible on this platform; one line saying why."""


@dataclass
class DecodeBackend:
    """What compile_decode returns: the callable step and what compiling it did."""

    step: Callable
    name: str
    stats: Callable[[], dict] = field(default=lambda: {})


def prepare_platform(platform: Platform, mc: ModelConfig) -> None:
    """Choose the op table and compile cache once per run, before the model is traced."""
    if platform.kind == "npu":
        from executor.backends import npu

        npu.install_ops()
    else:
        ops.use("reference")
    if mc.exe_mode != "eager":
        cache = Path(mc.cache_dir).expanduser() if mc.cache_dir else DEFAULT_CACHE
        # A fresh directory when the cache is off, so "cold" really is cold.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(
            cache if mc.enable_cache_compile else tempfile.mkdtemp(prefix="sk_compile_")
        )


def compile_decode(step: Callable, mc: ModelConfig, platform: Platform) -> DecodeBackend:
    sk = mc.superkernel.enable
    if mc.exe_mode == "eager":
        return DecodeBackend(step, "eager")
    if platform.kind == "npu":
        from executor.backends import npu

        if mc.exe_mode == "ge_graph":
            return npu.compile_ge(step, mc, sk)
        return npu.compile_npugraph_ex(step, mc, sk)
    if mc.exe_mode == "npugraph_ex":
        raise UnsupportedError(
            f"exe_mode npugraph_ex needs an Ascend NPU with torch_npu; this machine is "
            f"{platform.describe()} (use exe_mode ge_graph for the portable graph mode)"
        )
    from executor.backends.inductor import compile_ge

    compiled = compile_ge(step, sk, platform.kind)

    def stats() -> dict:
        s = compiled.backend.stats
        return {
            "compile_s": round(s.compile_s, 3),
            "graphs": s.graphs,
            "recompiles": compiled.recompiles,
            "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
            "cache_enabled": mc.enable_cache_compile,
            "scopes": [v.as_dict() for v in s.scopes.values()],
            "superkernel_ran": any(v.launches > 0 for v in s.scopes.values()),
        }

    return DecodeBackend(compiled, compiled.name, stats)


def timer(platform: Platform) -> Callable[[], float]:
    """perf_counter that first waits for the device, so step times are real."""
    sync = lambda: None  # noqa: E731
    if platform.kind == "cuda":
        import torch

        sync = torch.cuda.synchronize
    elif platform.kind == "npu":
        import torch

        sync = torch.npu.synchronize  # attribute added by torch_npu, present only on NPU hosts

    def now() -> float:
        sync()
        return time.perf_counter()

    return now
