"""Graph mode and SuperKernel scopes (portable Inductor backend) against eager, on one tiny Qwen3.

Why these checks: a compiled decode step is only worth measuring if it computes what eager
computes (same tokens, same logits), compiles exactly once (a recompile would be timed as a
decode step), really runs the scopes the plan asked for, and never puts prefill inside a scope.
Compiling is slow on a shared CPU, so each configuration is compiled once per module and every
test reads the same run.
"""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch._dynamo

from executor.backends.inductor import ScopeCheckError, compile_inductor
from executor.scope import PREFILL_SCOPES, scope_impl, superkernel_scope

REPO = Path(__file__).resolve().parent.parent
MAX_NEW = 8
PROMPTS = ["The weather today is", "Once upon a time, in a small village by the sea, there lived an old"]
BASE = ["scheduler_config.batch_size=2", "data_config.prompts=" + json.dumps(PROMPTS)]
CUSTOM = (
    'model_config.superkernel.custom=[{regions: ["layer_*_attn"], label: attn_all}, '
    '{regions: [layer_1_mlp], label: mlp_last, options: "feed-sync-all=1"}]'
)
GRAPH = ["model_config.exe_mode=ge_graph"]
CONFIGS = {  # name -> (overrides, expected scope labels)
    "ge_graph": (GRAPH, set()),
    "sk_attention": (
        GRAPH + ["model_config.enable_superkernel=true", "model_config.superkernel.plan=attention"],
        {"layer_0_attn", "layer_1_attn"},
    ),
    "sk_mlp": (
        GRAPH + ["model_config.enable_superkernel=true", "model_config.superkernel.plan=mlp"],
        {"layer_0_mlp", "layer_1_mlp"},
    ),
    "sk_layer": (
        GRAPH + ["model_config.enable_superkernel=true", "model_config.superkernel.plan=layer"],
        {"layer_0", "layer_1"},
    ),
    "sk_decoder": (
        GRAPH + ["model_config.enable_superkernel=true", "model_config.superkernel.plan=decoder"],
        {"decode_layers"},
    ),
    "sk_custom": (
        GRAPH + ["model_config.enable_superkernel=true", "model_config.superkernel.plan=custom", CUSTOM],
        {"attn_all", "mlp_last"},
    ),
}
# run(): warm-up generate(2 tokens) = 1 decode step, then MAX_NEW - 1; then our generate: MAX_NEW - 1
DECODE_CALLS = 1 + 2 * (MAX_NEW - 1)


class RecordingScope:
    """Stand-in scope implementation that records every scope entered (eager code only)."""

    entered: list[str] = []

    def __init__(self, label: str, options: str):
        RecordingScope.entered.append(label)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def cosine_rows(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).tolist()


def _run(make_qwen_runner, ckpt_path: Path, overrides: list[str]) -> dict:
    runner = make_qwen_runner(ckpt_path, *BASE, *overrides, max_new_tokens=MAX_NEW)
    runner.stream = io.StringIO()  # keep pytest output short; the log format is tested in test_config_cli
    metrics = runner.run()
    prompt_ids = runner.encode_prompts()
    gen = runner.generate(prompt_ids, MAX_NEW)
    RecordingScope.entered = []
    with scope_impl(RecordingScope):  # prefill only (1 token = no decode step), eager, so a scope would record
        runner.generate(prompt_ids, 1)
    prefill_scopes = list(RecordingScope.entered)
    return {
        "runner": runner,
        "metrics": metrics,
        "gen": gen,
        "stats": dataclasses.asdict(runner.step.report()),
        "prefill_scopes": prefill_scopes,
        "prompt_ids": prompt_ids,
    }


@pytest.fixture(scope="module")
def eager(make_qwen_runner, qwen3_ckpt):
    return _run(make_qwen_runner, qwen3_ckpt, [])


@pytest.fixture(scope="module", params=list(CONFIGS))
def graph(request, make_qwen_runner, qwen3_ckpt):
    result = _run(make_qwen_runner, qwen3_ckpt, CONFIGS[request.param][0])
    result["name"] = request.param
    return result


def test_eager_baseline_is_not_degenerate(eager):
    tokens = eager["gen"].token_ids
    assert len(tokens) == 2 and all(len(row) == MAX_NEW for row in tokens)
    assert len(eager["prompt_ids"][0]) != len(eager["prompt_ids"][1])  # padding path covered
    assert all(len(set(row)) >= 4 for row in tokens), tokens
    assert eager["metrics"]["backend"] == "eager"


def test_tokens_identical_to_eager(graph, eager):
    assert graph["metrics"]["generated_token_ids"] == eager["metrics"]["generated_token_ids"]
    assert graph["gen"].token_ids == eager["gen"].token_ids


def test_last_step_logits_match_eager(graph, eager):
    ours, ref = graph["gen"].last_logits, eager["gen"].last_logits
    assert ours.dtype == torch.float32 and ours.shape == ref.shape == (2, 512)
    assert min(cosine_rows(ours, ref)) > 0.9999
    assert (ours - ref).abs().max().item() < 1e-3


def test_compiled_exactly_once(graph):
    for where in (graph["metrics"]["compile"], graph["stats"]):  # after run() and after 3 generate calls
        assert where["graphs"] == 1 and where["recompiles"] == 0, where
    assert graph["metrics"]["compile"]["compile_s"] > 0
    assert graph["runner"].step.calls == DECODE_CALLS
    assert graph["stats"]["direct_calls"] == DECODE_CALLS - 1  # every call after the one that compiled
    assert graph["metrics"]["exe_mode"] == "ge_graph"


def test_superkernel_scopes_ran_as_planned(graph):
    expected = CONFIGS[graph["name"]][1]
    sk = graph["metrics"]["superkernel"]
    assert sk["requested"] is bool(expected) and sk["ran"] is bool(expected)
    assert {s["label"] for s in sk["scopes"]} == expected
    for scope in graph["stats"]["scopes"]:
        assert scope["segments"] >= 1 and scope["ops"] > 0 and not scope["unfused"], scope
        assert scope["cut_reasons"] == [], scope
        # one launch per segment per decode step: prefill (eager) never enters a compiled scope
        assert scope["launches"] == scope["segments"] * DECODE_CALLS, scope
    if graph["name"] == "sk_custom":  # attn_all covers two regions, so two segments per step
        segments = {s["label"]: s["segments"] for s in graph["stats"]["scopes"]}
        assert segments == {"attn_all": 2, "mlp_last": 1}
        options = {s["label"]: s["options"] for s in sk["scopes"]}
        assert options == {"attn_all": "", "mlp_last": "feed-sync-all=1"}


def test_prefill_never_inside_a_scope(graph):
    assert PREFILL_SCOPES.active is False
    assert graph["prefill_scopes"] == []
    runner = graph["runner"]
    RecordingScope.entered = []
    with scope_impl(RecordingScope):  # control: the recorder does see the decode plan's scopes
        for spec in runner.plan.scopes:
            with runner.decode_scopes.region(spec.region):
                pass
    assert sorted(set(RecordingScope.entered)) == sorted(CONFIGS[graph["name"]][1])


# ----------------------------------------------------------------------------- strict-scope-check on a toy
def _toy(x: torch.Tensor, options: str):
    """A scope around an op with a data-dependent output shape (nonzero), with work on both sides."""
    with superkernel_scope(True, "s", options):
        y = torch.relu(x) * 2 + 1
        idx = torch.nonzero(y > 2.0)
        z = torch.tanh(y) * 3
    return z, idx


def toy_clean(x):  # no data-dependent op: control for the harness
    with superkernel_scope(True, "s", "strict-scope-check=abort"):
        y = torch.relu(x) * 2 + 1
        z = torch.tanh(y) * 3
    return z, y


# one top-level function per option: distinct code objects, so no dynamo cache entry is shared
def toy_cut(x):
    return _toy(x, "")


def toy_bypass(x):
    return _toy(x, "strict-scope-check=bypass")


def toy_abort(x):
    return _toy(x, "strict-scope-check=abort")


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


def run_toy(fn, calls: int = 2):
    step = compile_inductor(lambda x, _positions: fn(x), True, "cpu")  # the (ids, positions) step contract
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        outs = [step(X, None) for _ in range(calls)]
    return step, outs


def assert_same(outs, fn):
    expected = fn(X)
    for out in outs:
        for got, want in zip(out, expected):
            assert got.shape == want.shape and torch.allclose(got, want, atol=1e-6)


def test_toy_scope_without_blocker_fuses():
    step, outs = run_toy(toy_clean)
    assert_same(outs, toy_clean)
    s = step.compiler.stats.scopes["s"]
    assert (s.segments, s.cut_reasons, s.unfused, s.launches) == (1, [], False, 2)


def test_toy_abort_raises_scope_check_error_naming_op_and_scope():
    message = r"scope 's': op nonzero cannot join a SuperKernel.*strict-scope-check=abort"
    with pytest.raises(ScopeCheckError, match=message):
        run_toy(toy_abort)


def test_toy_bypass_warns_and_runs_unfused():
    with pytest.warns(UserWarning, match="scope 's' runs unfused: op nonzero"):
        step, outs = run_toy(toy_bypass)
    assert_same(outs, toy_bypass)
    s = step.compiler.stats.scopes["s"]
    assert s.unfused and s.launches == 0


def test_toy_default_cuts_the_scope():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step, outs = run_toy(toy_cut)
    assert_same(outs, toy_cut)
    s = step.compiler.stats.scopes["s"]
    assert s.cut_reasons and "nonzero" in s.cut_reasons[0]
    assert s.segments >= 2 and s.launches == 2 * s.segments and not s.unfused  # 2 calls


# ----------------------------------------------------------------------------- compile cache
def test_enable_cache_compile_second_run_compiles_from_the_cache(tmp_path, qwen3_ckpt):
    """The second run's graphs come from the first run's cache: counted from Inductor's own cache
    lookups (metrics.json compile.cache_lookups), not from compile_s, which a busy neighbour
    (another test worker) moves as much as a cache does."""
    cache = tmp_path / "cache"
    runs = []
    for i in range(2):
        out = tmp_path / f"run{i}"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "executor.cli",
                "run",
                "--set",
                f"model_config.model_path={qwen3_ckpt}",
                "--set",
                "model_config.with_ckpt=true",
                "--set",
                "model_config.exe_mode=ge_graph",
                "--set",
                "model_config.enable_cache_compile=true",
                "--set",
                f"model_config.cache_dir={cache}",
                "--set",
                "scheduler_config.max_new_tokens=4",
                "--set",
                "data_config.input_truncated_len=16",
                "--out",
                str(out),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads((out / "metrics.json").read_text()))
        if i == 0:
            assert any(cache.rglob("*")), "the first run left nothing in cache_dir"
    first, second = (r["compile"] for r in runs)
    assert first["cache_dir"] == second["cache_dir"] and second["cache_enabled"] is True  # same key, same dir
    assert Path(first["cache_dir"]).parent == cache and first["cache_key"] == second["cache_key"]
    assert first["graphs"] == second["graphs"] == 1 and first["recompiles"] == second["recompiles"] == 0
    assert runs[0]["generated_token_ids"] == runs[1]["generated_token_ids"]
    fx = ("hits", "misses")
    assert first["cache_lookups"]["misses"] > 0 and first["cache_lookups"]["hits"] == 0, first
    assert {k: second["cache_lookups"][k] for k in fx} == {"hits": first["cache_lookups"]["misses"], "misses": 0}
    # AOTAutograd's cache too: no graph bypasses it (the graph passes' rewrites once made one that
    # did, traced and lowered again on every warm run), so the second run hits it per graph
    assert first["cache_lookups"]["aot_bypasses"] == second["cache_lookups"]["aot_bypasses"] == 0, first
    assert first["cache_lookups"]["aot_misses"] == second["cache_lookups"]["aot_hits"] > 0, second
    assert second["cache_lookups"]["aot_misses"] == 0, second
