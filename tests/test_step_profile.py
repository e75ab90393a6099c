"""benchmarks/step_profile.py counts what one decode step runs: checked on the eager CPU step, where
the count is known from the architecture (each layer's four projections, qkv / o / gate_up / down,
plus the lm_head, each one `aten::linear` call per step)."""

import argparse

from benchmarks.step_profile import profile_mode
from executor.arch import load_arch


def test_the_eager_step_runs_one_linear_per_projection_per_step():
    args = argparse.Namespace(
        device="cpu",
        size="debugmodel",
        dtype="float32",
        batch=1,
        prompt_len=8,
        steps=3,
        warmup=1,
        timed=2,
        trace_dir="",
    )
    summary = profile_mode(args, "eager")
    per_step = {name: n for name, n, _us in summary["top"]}
    assert per_step["aten::linear"] == 4 * load_arch("", "debugmodel").num_layers + 1
    assert summary["plain_ms"] > 0 and summary["wall_ms"] > 0 and summary["busy_ms"] > 0
