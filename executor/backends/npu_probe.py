"""Is an Ascend NPU usable here? The one question platform detection asks the NPU adapter.

A module of its own so that executor.platform (below the backends) can ask it without importing
the adapter: it imports nothing from the project, and torch_npu only through importlib, only
when called (torch_npu needs the CANN libraries and cannot be imported on other machines).
"""

from __future__ import annotations

import importlib
import importlib.util


def probe() -> tuple[object | None, str]:
    """Import torch_npu if present and usable: (module or None, one-line reason)."""
    if importlib.util.find_spec("torch_npu") is None:
        return None, "torch_npu not installed"
    try:
        mod = importlib.import_module("torch_npu")
    except Exception as exc:  # typically missing CANN libraries
        first = (str(exc).splitlines() or [""])[0]
        return None, f"import torch_npu failed: {type(exc).__name__}: {first}"
    if not mod.npu.is_available():
        return None, "torch_npu imported but torch.npu.is_available() = False"
    return mod, "torch.npu.is_available() = True"
