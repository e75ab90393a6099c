"""Shared fixtures: tiny HF checkpoints built once per session, and a qwen-runner factory.

Why session scope: writing a checkpoint with transformers' save_pretrained costs ~1 s, and the
dense, config-CLI and graph-mode tests all read the same few. Tests must treat these
directories as read-only (copy them to tmp_path before corrupting anything).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

import tests.checkpoints as ckpt
import tests.tool_fixtures as tools

REPO_ROOT = Path(__file__).resolve().parent.parent

# The decode loop's thread governor (executor/threads.py) reacts to how busy the machine is, and a
# step at a new thread count compiles again: tests that count compiles or compare runs must not
# depend on a neighbour. It is off here (runs started from tests inherit this) unless a test turns
# it on; tests/test_threads.py drives it directly.
os.environ.setdefault("CANN_RECIPES_ADAPTIVE_THREADS", "0")


@pytest.fixture(scope="session")
def qwen2_ckpt(tmp_path_factory) -> Path:
    """Qwen2: q/k/v bias, untied embeddings, head_dim = hidden/heads, 2 layers."""
    return ckpt.make_qwen2_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen2")


@pytest.fixture(scope="session")
def qwen3_ckpt(tmp_path_factory) -> Path:
    """Qwen3: head_dim 32 != hidden/heads, q/k norm, tied embeddings, 2 layers."""
    return ckpt.make_qwen3_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen3")


@pytest.fixture(scope="session")
def qwen3_sharded_ckpt(tmp_path_factory) -> Path:
    """A different Qwen3 (3 layers, other seed, rope_theta 1e6) saved as 3 safetensors shards."""
    path = ckpt.make_qwen3_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "qwen3_sharded", num_hidden_layers=3, seed=7, rope_theta=1e6
    )
    ckpt.shard_checkpoint(path, num_shards=3)
    return path


@pytest.fixture(scope="session")
def make_qwen_runner() -> Callable:
    """Factory: `make_qwen_runner(model_path, "key=value", ..., with_ckpt=True)` -> QwenRunner on CPU.

    Goes through executor.config.load_config like the CLI does, so every override is
    type-checked; input_truncated_len is kept small so the static KV cache (and compile) stays tiny.
    """
    from executor.config import load_config
    from executor.platform import detect
    from models.qwen.models.runner_qwen import QwenRunner

    def make(model_path: Path | str, *overrides: str, with_ckpt: bool = True, max_new_tokens: int = 12):
        cfg = load_config(
            None,
            [
                f"model_config.model_path={model_path}",
                f"model_config.with_ckpt={'true' if with_ckpt else 'false'}",
                f"scheduler_config.max_new_tokens={max_new_tokens}",
                "data_config.input_truncated_len=24",
                *overrides,
            ],
        )
        return QwenRunner(cfg, detect("cpu"))

    return make


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory) -> Path:
    """Session-wide: tiny models + compile cache for the tools tests (sk_compare, scope_search)."""
    base = tmp_path_factory.getbasetemp() / "sk_tools_shared"
    tools.tiny_model(base / "tiny_dense", tools.TINY_DENSE)
    tools.tiny_model(base / "tiny_moe", tools.TINY_MOE)
    (base / "compile_cache").mkdir(parents=True, exist_ok=True)
    return base
