"""tools/accuracy.py on a multi-rank config: the candidate on 2 ranks (torchrun, gloo), the
reference on one device.

Why: every parallel layout computes the same model, so the gate must pass on a faithful tensor
parallel run and on attention data parallel + expert parallel (qwen3_moe, each rank its own
batch row), both in ge_graph with SuperKernel scopes, with the one-device perplexities; and it
must fail, naming the layer, when a wrong op runs on the ranks (tests/wrong_ops.py: the table
reaches them through its module). The three tool runs are made once for the module (each
starts 2 ranks).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

import tests.checkpoints as ckpt
from executor import accuracy, ops
from executor.config import ConfigError, load_config
from executor.ops import reference
from executor.platform import detect
from executor.registry import default_config, runner_class
from executor.tokenizer import BUILTIN_CORPUS
from tests.tool_fixtures import DENSE_TP, MOE_DP, sk
from tests.wrong_ops import WRONG_EPS
from tools import accuracy as tool

EVAL_TOKENS, PROMPT, NEW = 96, 24, 8
SMALL = [f"data_config.input_truncated_len={PROMPT}", f"scheduler_config.max_new_tokens={NEW}"]
SMALL += ["scheduler_config.batch_size=2", "model_config.enable_cache_compile=false"]
EAGER = ["model_config.exe_mode=eager", "model_config.enable_superkernel=false"]


# name -> (recipe, checkpoint, overrides, extra tool arguments)
RUNS = {
    "dense_tp_sk_decoder": ("qwen", "qwen3", [*DENSE_TP, *sk("decoder")], []),
    "moe_dp_ep_sk_moe": ("qwen3_moe", "moe", [*MOE_DP, *sk("moe")], []),
    "dense_tp_wrong_op": ("qwen", "qwen3", [*DENSE_TP, *EAGER], ["--ops", WRONG_EPS]),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, qwen3_ckpt) -> dict:
    tmp = tmp_path_factory.mktemp("accuracy_ranks")
    text = tmp / "eval.txt"
    text.write_text(BUILTIN_CORPUS.read_text()[:3000])
    moe = ckpt.make_qwen3_moe_checkpoint(tmp / "moe", num_hidden_layers=1, seed=2)
    return {"tmp": tmp, "text": text, "ckpts": {"qwen3": qwen3_ckpt, "moe": moe}}


def common(path: Path) -> list[str]:
    return [f"model_config.model_path={path}", "model_config.with_ckpt=true", *SMALL]


@pytest.fixture(scope="module")
def runs(setup) -> dict[str, tuple[int, dict, Path]]:
    """Every run of RUNS: (exit code, accuracy.json, output directory)."""
    out = {}
    for name, (recipe, ck, sets, extra) in RUNS.items():
        where = setup["tmp"] / name
        sets = [*common(setup["ckpts"][ck]), *sets]
        args = ["--model", recipe, *[a for s in sets for a in ("--set", s)], "--text", str(setup["text"])]
        rc = tool.main([*args, "--out", str(where), "--max-eval-tokens", str(EVAL_TOKENS), "--steps", "4", *extra])
        out[name] = (rc, json.loads((where / "accuracy.json").read_text()), where)
    return out


def one_device_ppl(recipe: str, path: Path, text: Path) -> float:
    """The decode-path perplexity of world size 1, eager, on the same windows and batch."""
    cfg = load_config(default_config(recipe), [*common(path), *EAGER])
    runner = runner_class(recipe)(cfg, detect("cpu"), None, io.StringIO())
    wins = accuracy.windows(runner.tokenizer.encode(text.read_text())[:EVAL_TOKENS], PROMPT + NEW)
    return accuracy.perplexity_decode(runner, wins, 2).ppl


@pytest.mark.parametrize("name", ["dense_tp_sk_decoder", "moe_dp_ep_sk_moe"])
def test_gate_passes_on_two_ranks_with_the_one_device_perplexity(runs, setup, name):
    recipe, ck, _, _ = RUNS[name]
    rc, r, out = runs[name]
    assert rc == 0, r["reasons"]
    assert r["passed"] and r["world_size"] == 2 and r["cosine_min"] > 0.999
    one = one_device_ppl(recipe, setup["ckpts"][ck], setup["text"])
    assert r["reference"]["ppl"] == pytest.approx(one, rel=1e-4)
    assert r["candidate"]["ppl"] == pytest.approx(one, rel=1e-3)
    assert r["candidate"]["ppl_prefill"] == pytest.approx(r["reference"]["ppl_prefill"], rel=1e-3)
    layers = {"qwen3": 2, "moe": 1}[ck]
    assert set(r["regions"]["decode"]) == {*(f"layer_{i}" for i in range(layers)), "logits"}
    assert set(r["regions"]["prefill"]) == set(r["regions"]["decode"])
    assert r["greedy"]["first_mismatch"] is None and r["greedy"]["tokens"] == 2 * NEW
    assert all(i["status"] == "PASS" for i in r["audit"]), r["audit"]
    if name == "dense_tp_sk_decoder":
        assert r["parallel"]["attn_tp"] == 2 and "rows 0-1 from rank 0" in r["rows_compared"]
        assert any(i["check"] == "scope decode_layers" for i in r["audit"])
    else:  # each rank its own row: both gathered
        assert r["parallel"]["attn_dp"] == 2 and r["parallel"]["moe_ep"] == 2
        assert "rows 0-0 from rank 0, rows 1-1 from rank 1" in r["rows_compared"]
        assert any(i["check"] == "scope layer_0_moe" for i in r["audit"])
    assert (out / "ranks" / "rank_1.log").is_file()
    assert (out / "accuracy_cosine.png").read_bytes()[:4] == b"\x89PNG"
    assert (
        "PASSED" in (out / "accuracy_report.md").read_text() and "2 rank(s)" in (out / "accuracy_report.md").read_text()
    )


def test_gate_fails_on_two_ranks_naming_the_layer_of_a_wrong_op(runs):
    rc, r, _ = runs["dense_tp_wrong_op"]
    assert rc == 1 and not r["passed"]
    assert r["candidate"]["op_table"] == WRONG_EPS and r["world_size"] == 2
    assert r["first_region_below_gate"] == "prefill:layer_0"
    assert any("prefill:layer_0" in reason for reason in r["reasons"])
    assert all(i["status"] == "PASS" for i in r["audit"])  # the table ran as asked: the numbers are wrong


def test_an_ops_table_the_ranks_cannot_import_is_refused():
    """A table defined in a script run as __main__ cannot reach other processes: exit 2, one line."""

    def rms_norm(x, weight, eps):
        return reference.rms_norm(x, weight, eps)

    rms_norm.__module__ = "__main__"
    ops.register("defined_in_main", {"rms_norm": rms_norm}, base="reference")
    assert tool.check_ops("defined_in_main", 1) == ["__main__"]
    with pytest.raises(ConfigError, match="__main__, which the 2 ranks cannot import"):
        tool.check_ops("defined_in_main", 2)
