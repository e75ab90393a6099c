"""Running test code in a fresh Python: a kernel built or loaded in the test process stays
loaded, so a build under other flags, another kernel cache or no compiler needs a new process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def run_code(code: str, timeout: int = 300, **env: str) -> str:
    """Run `code` from the repository root with `env` added; it must succeed. Returns its stdout."""
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=os.environ | env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-1000:] + proc.stderr[-2000:]
    return proc.stdout


def run_as_capability(code: str, capability: str, timeout: int = 300) -> str:
    """Run `code` where PyTorch reports CPU `capability` ("avx2", "default"): a kernel is then
    built with that variant's flags under its own build key. Skips an AVX2 run on a host without
    AVX2. Returns stdout."""
    if capability == "avx2" and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("not an x86 host with AVX2")
    code += "print(torch.backends.cpu.get_cpu_capability())\n"
    stdout = run_code(code, timeout, ATEN_CPU_CAPABILITY=capability)
    assert stdout.splitlines()[-1] == capability.upper()
    return stdout
