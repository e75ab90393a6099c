"""The execution context installs a run's process-wide choices as one unit and restores them.

Why it matters: the op table, the scope implementation and the Inductor cache directory are read
while a decode step is traced. Two recipes in one process (tests, the accuracy tool, the scope
search) must not see each other's.
"""

from __future__ import annotations

import os

import pytest
import torch

from executor import ops
from executor.context import ExecutionContext
from executor.ops import reference
from executor.scope import superkernel_scope


class _Recording:
    def __init__(self, label, options):
        self.label = label

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_context_installs_and_restores_ops_scope_and_environment(monkeypatch):
    monkeypatch.delenv("CANN_RECIPES_TEST_VAR", raising=False)
    ops.register("doubled", {"swiglu": lambda x: 2 * reference.swiglu(x)})
    ctx = ExecutionContext("doubled", _Recording, {"CANN_RECIPES_TEST_VAR": "inside"})
    x = torch.randn(2, 8)
    with ctx.active():
        assert ops.active() == "doubled"
        torch.testing.assert_close(ops.swiglu(x), 2 * reference.swiglu(x))
        assert isinstance(superkernel_scope(True, "s"), _Recording)
        assert os.environ["CANN_RECIPES_TEST_VAR"] == "inside"
    assert ops.active() == "reference"
    torch.testing.assert_close(ops.swiglu(x), reference.swiglu(x))
    assert not isinstance(superkernel_scope(True, "s"), _Recording)
    assert "CANN_RECIPES_TEST_VAR" not in os.environ


def test_context_restores_on_error_and_nests():
    ops.register("other", {})
    outer, inner = ExecutionContext("other"), ExecutionContext("reference", _Recording)
    with pytest.raises(RuntimeError), outer.active():
        with inner.active():
            assert ops.active() == "reference" and isinstance(superkernel_scope(True, "s"), _Recording)
        assert ops.active() == "other" and not isinstance(superkernel_scope(True, "s"), _Recording)
        raise RuntimeError("boom")
    assert ops.active() == "reference"


def test_a_graph_run_leaves_nothing_behind(make_qwen_runner, qwen3_ckpt):
    """A ge_graph runner sets TORCHINDUCTOR_CACHE_DIR only while it compiles and runs."""
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    runner = make_qwen_runner(qwen3_ckpt, "model_config.exe_mode=ge_graph", max_new_tokens=3)
    seen = {}
    original = runner.decode_one

    def spy(token, positions):
        seen["cache"] = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        return original(token, positions)

    runner.decode_one = spy
    runner.generate([[5, 6, 7]], 3)
    assert seen["cache"] == runner.backend.cache_dir and seen["cache"] != before
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == before
    assert ops.active() == "reference"
