"""The accuracy gate (tools/accuracy.py, executor/accuracy.py) on real runs.

Why these checks: a gate that cannot fail proves nothing, so it is run with deliberately wrong op
tables (a rotary turning the other way, an rms_norm with a wrong epsilon, a table missing ops)
and must fail naming where the error starts; and its perplexity must be the textbook one, so it
is checked against transformers on the same checkpoint and text.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

import tests.checkpoints as ckpt
from executor import accuracy, ops
from executor.cli import main as cli_main
from executor.ops import reference
from executor.tokenizer import BUILTIN_CORPUS, Tokenizer
from tools import accuracy as tool

SMALL = ["data_config.input_truncated_len=24", "scheduler_config.max_new_tokens=8"]
EAGER = [
    "model_config.exe_mode=eager",
    "model_config.enable_superkernel=false",
    "model_config.enable_cache_compile=false",
]


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval") / "eval.txt"
    path.write_text(BUILTIN_CORPUS.read_text()[:3000])
    return path


def run_tool(ckpt_path, text, out, *overrides, extra=()) -> tuple[int, dict | None]:
    sets = [f"model_config.model_path={ckpt_path}", "model_config.with_ckpt=true", *SMALL, *overrides]
    args = [x for s in sets for x in ("--set", s)] + ["--text", str(text), "--out", str(out), *extra]
    rc = tool.main([*args, "--max-eval-tokens", "160"])
    results = out / "accuracy.json"
    return rc, json.loads(results.read_text()) if results.is_file() else None


def test_the_reference_config_lists_no_custom_op_even_at_a_long_cache():
    """Left out, custom_ops would choose decode_attention at 512 slots and build its kernel for a
    runner whose table is then replaced by the reference; the reference config lists none."""
    from executor.config import load_config

    cfg = load_config(None, ["data_config.input_truncated_len=2048", "model_config.exe_mode=ge_graph"])
    assert cfg.model_config.custom_ops is None
    ref = accuracy.reference_config(cfg)
    assert ref.model_config.custom_ops == () and ref.model_config.exe_mode == "eager"


def test_reference_perplexity_equals_transformers(make_qwen_runner, qwen3_ckpt, text):
    """Both of our perplexities (decode path, prefill) equal transformers' on the same windows."""
    runner = make_qwen_runner(qwen3_ckpt, *EAGER, max_new_tokens=8)
    tokens = Tokenizer.from_file(qwen3_ckpt / "tokenizer.json").encode(text.read_text())[:160]
    wins = accuracy.windows(tokens, 24 + 8)
    ours = [accuracy.perplexity_decode(runner, wins, 1).ppl, accuracy.perplexity_prefill(runner, wins, 1).ppl]
    hf = ckpt.load_reference(qwen3_ckpt)
    nll = count = 0
    with torch.no_grad():
        for w in wins:
            logits = hf(input_ids=torch.tensor([w])).logits[0, :-1]
            nll += float(F.cross_entropy(logits, torch.tensor(w[1:]), reduction="sum"))
            count += len(w) - 1
    theirs = math.exp(nll / count)
    for value in ours:
        assert value == pytest.approx(theirs, rel=1e-3)


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(
            ["model_config.exe_mode=ge_graph", "model_config.superkernel.plan=decoder"], id="ge_graph-sk-fp32"
        ),
        pytest.param([*EAGER, "model_config.dtype=bfloat16"], id="eager-bf16"),
    ],
)
def test_gate_passes_on_faithful_runs(qwen3_ckpt, text, tmp_path, overrides):
    rc, r = run_tool(qwen3_ckpt, text, tmp_path / "out", *overrides)
    assert rc == 0, r and r["reasons"]
    assert r["passed"] and r["cosine_min"] > 0.99 and abs(r["ppl_diff"]) < 0.1
    assert {"reference", "candidate", "ppl_diff", "cosine_min", "worst_region", "passed"} <= set(r)
    assert r["reference"]["ppl"] > 1 and r["reference"]["tokens"] > 100
    assert set(r["regions"]["decode"]) == {"layer_0", "layer_1", "logits"}
    assert all(i["status"] == "PASS" for i in r["audit"])
    if "ge_graph" in overrides[0]:
        assert any(i["check"] == "scope decode_layers" for i in r["audit"])
        assert r["greedy"]["first_mismatch"] is None
    assert (tmp_path / "out" / "accuracy_cosine.png").read_bytes()[:4] == b"\x89PNG"
    assert "PASSED" in (tmp_path / "out" / "accuracy_report.md").read_text()


def _wrong_half_rotary(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, -x1), dim=-1) * sin  # rotates the wrong way


@pytest.mark.parametrize(
    "name, table",
    [
        ("wrong_rotary", {"rotary_mul": _wrong_half_rotary}),
        ("wrong_eps", {"rms_norm": lambda x, w, eps: reference.rms_norm(x, w, 1.0)}),
    ],
)
def test_gate_fails_and_names_the_layer_where_a_wrong_op_starts(qwen3_ckpt, text, tmp_path, name, table):
    ops.register(name, table, base="reference")
    rc, r = run_tool(qwen3_ckpt, text, tmp_path / "out", *EAGER, extra=["--ops", name])
    assert rc == 1 and not r["passed"]
    assert r["first_region_below_gate"] == "prefill:layer_0"
    assert any("prefill:layer_0" in reason for reason in r["reasons"])
    assert r["candidate"]["op_table"] == name


def test_audit_fails_a_table_that_falls_back(qwen3_ckpt, text, tmp_path):
    ops.register("half_a_table", {"swiglu": reference.swiglu})  # no base: the other ops are fallbacks
    rc, r = run_tool(qwen3_ckpt, text, tmp_path / "out", *EAGER, extra=["--ops", "half_a_table"])
    assert rc == 1 and r["cosine_min"] > 0.9999  # numerically right, yet not what was asked for
    failed = {i["check"] for i in r["audit"] if i["status"] == "FAIL"}
    assert "op rms_norm" in failed and "op swiglu" not in failed


def test_bad_input_is_one_line_exit_2(qwen3_ckpt, tmp_path, capsys):
    base = ["--set", f"model_config.model_path={qwen3_ckpt}", "--set", "model_config.with_ckpt=true"]
    for extra, needle in (
        (["--text", str(tmp_path / "missing.txt")], "missing.txt"),
        (["--text", str(BUILTIN_CORPUS), "--ops", "no_such_table"], "no_such_table"),
    ):
        assert cli_main(["accuracy", *base, *extra, "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and err.count("\n") == 1 and needle in err


# ----------------------------------------------------------------------------- the built-in models
# The gate as a user runs it: the recipe's default config (the trained built-in model, its
# held-out text by default), across exe_modes, SuperKernel plans and both dtypes. Each compiled
# case is a cold compile (40-75 s on the 2-core CI machine), so there are three (both models,
# both dtypes) and one eager. Elsewhere: ge_graph without SuperKernel against eager in scope_search's baseline
# (tests/test_scope_search.py) and token for token in tests/test_graph_mode.py; the moe plan in
# tests/test_qwen3_moe.py and on two ranks in tests/test_accuracy_ranks.py; plans attention and
# layer in tests/test_graph_mode.py.
BUILTIN_CASES = [
    ("qwen", "float32", ["model_config.superkernel.plan=decoder"]),
    ("qwen", "bfloat16", EAGER),
    ("qwen", "bfloat16", ["model_config.superkernel.plan=mlp"]),
    ("qwen3_moe", "bfloat16", ["model_config.superkernel.plan=decoder"]),
]


@pytest.mark.parametrize(
    "model, dtype, overrides",
    [pytest.param(*c, id=f"{c[0]}-{c[1]}-{c[2][0].split('=')[1]}") for c in BUILTIN_CASES],
)
def test_gate_passes_on_the_builtin_models(tmp_path, model, dtype, overrides):
    sets = [*SMALL, f"model_config.dtype={dtype}", "model_config.enable_cache_compile=false", *overrides]
    args = ["--model", model, *[x for s in sets for x in ("--set", s)], "--out", str(tmp_path / "out")]
    rc = tool.main([*args, "--max-eval-tokens", "192", "--steps", "4"])
    r = json.loads((tmp_path / "out" / "accuracy.json").read_text())
    assert rc == 0, r["reasons"]
    assert r["text"].endswith(f"models/{model}/builtin/eval.txt")  # the held-out text by default
    assert r["candidate"]["dtype"] == dtype and r["cosine_min"] > 0.99 and abs(r["ppl_diff"]) < 0.1
    assert 20 < r["reference"]["ppl"] < 1000  # a trained model: far below the vocabulary size (4096)
    assert all(i["status"] == "PASS" for i in r["audit"])
