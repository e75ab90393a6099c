"""tools/scope_search.py end to end on CPU (1-layer dense and MoE models), plus the pieces a
real search relies on: the accuracy rule, the search-space checks and the safe config edit.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
import yaml

from executor.cli import main as cli_main
from executor.runner import Generation
from executor.tokenizer import BUILTIN_CORPUS
from tests.tool_fixtures import recipe_config
from tools.config_edit import apply_changes
from tools.measure import check_accuracy

REPO = Path(__file__).resolve().parent.parent

DENSE_SPACE = """\
builtin_plans: [moe, decoder]   # moe: not applicable to a dense model
option_variants: {npu: ["stream-fusion=1"], cpu: []}
custom:
  - name: attn_ffn_split
    scopes:
      - {regions: ["layer_*_attn"], label: "attn"}
      - {regions: ["layer_*_m??"], label: "ffn"}
  - name: nested                                  # fails when the runner builds its plan
    scopes:
      - {regions: ["layer_0", "layer_0_attn"], label: "x"}
  - name: other_model                             # matches nothing here
    scopes:
      - {regions: ["layer_*_router"], label: "x"}
"""


# The decode-path perplexity gate on a few tokens of an English text (the model is random: what is
# checked is that every candidate's PPL equals eager's, not that it is low).
PPL_TEXT = ["--text", str(BUILTIN_CORPUS), "--ppl-tokens", "48"]


def search(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli_main(["search", *argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def search_captured(*argv: str) -> tuple[int, str, str]:
    """`search` for module-scoped fixtures, where capsys is not available."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(["search", *argv])
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def dense_search(tmp_path_factory, shared_dir) -> SimpleNamespace:
    """One search on the 1-layer dense model in two phases: a zero budget (nothing measured),
    then the same --out resumed to the end with --apply. Each phase's outcome is kept for the
    tests below; searching once keeps the module fast."""
    tmp = tmp_path_factory.mktemp("dense_search")
    config = recipe_config(tmp / "recipe.yaml", shared_dir / "tiny_dense", shared_dir / "compile_cache")
    space = tmp / "space.yaml"
    space.write_text(DENSE_SPACE)
    out = tmp / "search"
    common = ["--config", str(config), "--search-space", str(space), "--runs", "1", "--warmup", "0", "--out", str(out)]
    common += PPL_TEXT
    budget = search_captured(*common, "--max-minutes", "0")
    budget_status = json.loads((out / "search_status.json").read_text())
    before = config.read_text()
    applied = search_captured(*common, "--apply")
    return SimpleNamespace(
        tmp=tmp, config=config, out=out, common=common, before=before, budget=budget,
        budget_status=budget_status, applied=applied,
    )  # fmt: skip


def test_dense_search_with_no_budget_measures_nothing_and_says_how_to_resume(dense_search):
    rc, stdout, _ = dense_search.budget
    assert rc == 1 and "unfinished" in stdout and f"--out {dense_search.out}" in stdout
    status = dense_search.budget_status
    assert status["state"] == "budget"
    assert list(status["candidates"]) == ["baseline", "decoder", "attn_ffn_split", "nested"]
    assert {c["status"] for c in status["candidates"].values()} == {"pending"}
    assert [s["name"] for s in status["skipped"]] == ["moe", "other_model"]


def test_dense_search_resumes_ranks_and_applies_the_winner(dense_search):
    out, config, before = dense_search.out, dense_search.config, dense_search.before
    rc, stdout, err = dense_search.applied
    status = json.loads((out / "search_status.json").read_text())
    # --apply refuses a winner slower than the baseline beyond noise (on a loaded machine the
    # 1-layer model's SuperKernel plans can be); tests/test_reliability.py pins both outcomes.
    refused = status["apply_refused"]
    assert rc == (1 if refused else 0), stdout + err
    assert "resuming" in err and "0 of 4 candidate(s) already finished" in err
    recs = status["candidates"]
    assert status["state"] == "complete"
    assert recs["nested"]["status"] == "failed" and "nested" in recs["nested"]["reason"]
    assert (out / "candidates" / "nested.error.txt").is_file()
    measured = [n for n in recs if n != "nested"]
    for name in measured:
        r = recs[name]
        assert r["status"] == "done", r
        assert r["accuracy"]["passed"] and r["accuracy"]["first_mismatch"] is None
        assert r["accuracy"]["cosine_last_step"] >= 0.999 and r["accuracy"]["tokens_checked"] == 6
        assert r["accuracy"]["ppl"] == pytest.approx(status["reference_ppl"], rel=1e-4)  # fp32: same numbers
        assert r["summary"]["ok_runs"] == 1 and r["summary"]["step_ms"] > 0
        assert (out / "logs" / f"{name}.1.log").is_file()
    metrics = json.loads((out / "logs" / "runs" / "attn_ffn_split.1" / "metrics.json").read_text())
    assert metrics["superkernel"]["ran"] and {s["label"] for s in metrics["superkernel"]["scopes"]} == {"attn", "ffn"}
    # ranking: the winner is the fastest SuperKernel candidate; speedups are ratios of medians
    ms = {n: recs[n]["summary"]["step_ms"] for n in measured}
    winner = min((n for n in measured if n != "baseline"), key=ms.get)
    assert status["winner"] == winner and f"winner {winner}" in stdout
    for n in measured:
        assert recs[n]["speedup_vs_baseline"] == pytest.approx(ms["baseline"] / ms[n])
        assert recs[n]["winner_speedup_over"] == pytest.approx(ms[n] / ms[winner])
    table = pd.read_csv(out / "scope_search.csv")
    assert table["steps_on_fewer_threads"].isna().all()  # the governor is off in tests (conftest.py)
    assert list(table["candidate"][:3]) == sorted(measured, key=ms.get)
    assert table["rank"][:3].tolist() == [1, 2, 3]
    assert table["status"].tolist()[-1] == "failed"
    report = (out / "scope_search_report.md").read_text()
    assert "portable measurement on CPU, not an Ascend result" in report.splitlines()[2]
    assert f"**Winner: {winner}**" in report and "other_model" in report
    assert "| worst cosine | PPL (diff) |" in report and f"{status['reference_ppl']:.4f}" in report
    assert (out / "scope_search.png").read_bytes()[:4] == b"\x89PNG"
    results = json.loads((out / "scope_search_results.json").read_text())
    assert results["winner"] == winner and len(results["ranking"]) == 4
    if refused:
        assert config.read_text() == before and not list(dense_search.tmp.glob("recipe.yaml.bak-*"))
        assert [ln for ln in err.splitlines() if "--apply refused" in ln] == [
            f"scope_search: --apply refused, {config} left unchanged: {refused}"
        ]
        ms_winner, ms_base = recs[winner]["summary"]["step_ms"], recs["baseline"]["summary"]["step_ms"]
        assert ms_winner > ms_base and recs[winner]["exceeds_noise_vs_baseline"]
        return
    # --apply: only the SuperKernel keys changed, comments kept, backup holds the old bytes
    after = config.read_text()
    backups = list(dense_search.tmp.glob("recipe.yaml.bak-*"))
    assert len(backups) == 1 and backups[0].read_text() == before
    mc = yaml.safe_load(after)["model_config"]
    assert mc["enable_superkernel"] is True
    assert mc["superkernel"]["plan"] == recs[winner]["superkernel"]["plan"]
    assert "# the configured plan" in after and "# one cache for the whole test session" in after
    assert "--- " in stdout and "+  enable_superkernel: true" in stdout
    a, b = yaml.safe_load(after), yaml.safe_load(before)
    for side in (a, b):
        side["model_config"].pop("superkernel"), side["model_config"].pop("enable_superkernel")
    assert a == b


def test_dense_search_restart_redoes_only_what_is_unfinished(dense_search):
    out, config = dense_search.out, dense_search.config
    status = json.loads((out / "search_status.json").read_text())
    winner = status["winner"]
    measured = [n for n in status["candidates"] if n != "nested"]
    status["candidates"][winner]["status"] = "pending"  # as if the job died while measuring it
    (out / "search_status.json").write_text(json.dumps(status))
    config.write_text(dense_search.before)  # the search is tied to the config it started with
    kept = {n: (out / "logs" / f"{n}.1.log").stat().st_mtime_ns for n in measured if n != winner}
    rc, stdout, err = search_captured(*dense_search.common)
    assert rc == 0, stdout + err
    assert "3 of 4 candidate(s) already finished" in err
    assert f"{winner} run 1/1" in err and all(f"{n} run 1/1" not in err for n in kept)
    assert {n: (out / "logs" / f"{n}.1.log").stat().st_mtime_ns for n in kept} == kept


@pytest.mark.slow
def test_moe_search_on_two_ranks(tmp_path, shared_dir, capsys):
    """The MoE recipe's search, on a multi-rank config (attention DP 2 + expert parallel 2)
    searched unchanged: the eager reference and each candidate's accuracy run go through torchrun
    (tools/rank_generate.py), the measured runs through infer.sh, which starts its own ranks; a
    plan the model has no region for (mlp) is skipped with the reason. (The single-device search
    path is the dense tests'; one MoE search covers the recipe, as each costs about a minute.)
    Its measured runs are also the multi-rank test of tools/sk_compare.py, which measures through
    the same function (tools.measure.measure) and has no rank-specific code of its own."""
    config = recipe_config(tmp_path / "moe.yaml", shared_dir / "tiny_moe", shared_dir / "compile_cache", "qwen3_moe")
    before = config.read_text()
    space = tmp_path / "space.yaml"
    space.write_text("builtin_plans: [mlp, moe]\n")
    out = tmp_path / "search"
    layout = ["parallel_config.world_size=2", "parallel_config.attn_tp_size=1", "scheduler_config.batch_size=2"]
    args = ["--model", "qwen3_moe", "--config", str(config), "--search-space", str(space), "--out", str(out)]
    args += [*PPL_TEXT, "--runs", "1", "--warmup", "0"]
    rc, stdout, err = search(capsys, *args, *[a for s in layout for a in ("--set", s)])
    assert rc == 0, stdout + err
    status = json.loads((out / "search_status.json").read_text())
    assert list(status["candidates"]) == ["baseline", "moe"] and status["winner"] == "moe"
    assert [s["name"] for s in status["skipped"]] == ["mlp"] and "moe" in status["skipped"][0]["reason"]
    for rec in status["candidates"].values():
        assert rec["accuracy"]["passed"] and rec["accuracy"]["cosine_last_step"] >= 0.999, rec["accuracy"]
    moe = status["candidates"]["moe"]
    assert moe["speedup_vs_baseline"] == pytest.approx(
        status["candidates"]["baseline"]["summary"]["step_ms"] / moe["summary"]["step_ms"]
    )
    metrics = json.loads((out / "logs" / "runs" / "moe.1" / "metrics.json").read_text())
    assert metrics["model_type"] == "qwen3_moe" and [s["label"] for s in metrics["superkernel"]["scopes"]] == [
        "layer_0_moe"
    ]
    assert metrics["world_size"] == 2 and metrics["parallel"]["attn_dp"] == 2 and metrics["parallel"]["moe_ep"] == 2
    assert metrics["superkernel"]["ran"] and len(metrics["generated_token_ids"]) == 2
    assert config.read_text() == before
    assert (out / "ranks" / "rank_1.log").is_file()  # the accuracy runs' second rank
    # the measured runs (tools.measure, as sk_compare's: infer.sh starts the ranks): rank 0's
    # metrics and log, every rank's log in the run's directory
    for name, sk_on in (("baseline", False), ("moe", True)):
        run = json.loads((out / "logs" / "runs" / f"{name}.1" / "metrics.json").read_text())
        assert run["world_size"] == 2 and run["superkernel"]["ran"] is sk_on and len(run["decode_ms"]) == 5
        assert (out / "logs" / "runs" / f"{name}.1" / "rank_1.log").is_file()
        assert (out / "logs" / f"{name}.1.log").read_text().count("inference time cost of decode is") == 5
        assert status["candidates"][name]["summary"]["ok_runs"] == 1
    # the decode-path perplexity of the gate, its rows split over the two attention-DP groups (a
    # padded group: one real row) and summed back: the one-device eager value
    from executor.config import load_config
    from executor.platform import detect
    from executor.registry import runner_class
    from tools.measure import generate_in_process

    eager = ["model_config.exe_mode=eager", "model_config.enable_superkernel=false"]
    one = load_config(config, ["scheduler_config.batch_size=2", *eager, "model_config.enable_cache_compile=false"])
    text = Path(PPL_TEXT[1]).read_text()
    *_, ppl = generate_in_process(runner_class("qwen3_moe"), one, detect("cpu"), 1, None, text, int(PPL_TEXT[3]))
    assert status["reference_ppl"] == pytest.approx(ppl, rel=1e-4)
    assert status["candidates"]["moe"]["accuracy"]["ppl"] == pytest.approx(ppl, rel=1e-3)


# ----------------------------------------------------------------------------- pieces
def _gen(tokens: list[list[int]], first: torch.Tensor, last: torch.Tensor) -> Generation:
    return Generation([[1, 2]], tokens, 1.0, [1.0], first, last)


def test_accuracy_rule_rejects_with_numbers():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    ref = _gen([[5, 6, 7, 8]], logits, logits)
    same = check_accuracy(ref, _gen([[5, 6, 7, 8]], logits.clone(), logits * 2), 4, 0.999)
    assert same["passed"] and same["cosine_last_step"] == pytest.approx(1.0)  # cosine ignores scale
    late = check_accuracy(ref, _gen([[5, 6, 7, 9]], logits, logits), 3, 0.999)
    assert late["passed"]  # only the first N tokens must agree
    diverged = check_accuracy(ref, _gen([[5, 6, 9, 8]], logits, logits), 4, 0.999)
    assert not diverged["passed"] and diverged["first_mismatch"] == 2 and "token 2" in diverged["reason"]
    off = torch.tensor([[1.0, 2.0, 4.0, 3.0]])  # cosine = (1+4+12+12)/30 = 29/30
    drift = check_accuracy(ref, _gen([[5, 6, 7, 8]], logits, off), 4, 0.999)
    assert not drift["passed"] and drift["cosine_last_step"] == pytest.approx(29 / 30)
    assert check_accuracy(ref, _gen([[5, 6, 7, 8]], logits, off), 4, 0.9)["passed"]
    # the accuracy tool's perplexity gate: |candidate / reference - 1| < 10% by default
    near = check_accuracy(ref, _gen([[5, 6, 7, 8]], logits, logits), 4, 0.999, (10.0, 10.9))
    assert near["passed"] and near["ppl_diff"] == pytest.approx(0.09)
    far = check_accuracy(ref, _gen([[5, 6, 7, 8]], logits, logits), 4, 0.999, (10.0, 11.5))
    assert not far["passed"] and "PPL differs by +15.00%" in far["reason"]
    assert check_accuracy(ref, _gen([[5, 6, 7, 8]], logits, logits), 4, 0.999, (10.0, 11.5), 0.2)["passed"]
    nan = check_accuracy(ref, _gen([[5, 6, 7, 8]], logits, logits), 4, 0.999, (10.0, float("nan")))
    assert not nan["passed"]  # a NaN perplexity is never within any limit


def test_bad_search_space_and_overrides_exit_2(tmp_path, shared_dir, capsys):
    config = recipe_config(tmp_path / "recipe.yaml", shared_dir / "tiny_dense", shared_dir / "compile_cache")
    cases = {
        "builtin_plans: [attention, everything]\n": "everything",
        "option_variants: {cpu: ['stream-fusion=2']}\n": "stream-fusion",
        "custom: [{name: c, scopes: [{regions: [layer_0], label: x, options: 'bogus=1'}]}]\n": "bogus",
        "custom: [{name: baseline, scopes: [{regions: [layer_0], label: x}]}]\n": "baseline",
        "plans: [attention]\n": "plans",
    }
    for i, (text, word) in enumerate(cases.items()):
        space = tmp_path / f"space{i}.yaml"
        space.write_text(text)
        rc, _, err = search(capsys, "--config", str(config), "--search-space", str(space), "--out", str(tmp_path / "o"))
        assert rc == 2 and err.startswith("error:") and word in err, (text, err)
    rc, _, err = search(capsys, "--config", str(config), "--set", "model_config.superkernel.plan=layer")
    assert rc == 2 and "scope_search sets the SuperKernel switch" in err and "search space" in err
    rc, _, err = search(capsys, "--model", "nope")
    assert rc == 2 and "nope" in err
    assert not (tmp_path / "o").exists()


def test_apply_changes_restores_on_refusal_and_keeps_comments(tmp_path):
    path = tmp_path / "c.yaml"
    original = '# top comment\nmodel_config:\n  exe_mode: "eager"   # modes\n  enable_superkernel: false  # sk\n'
    path.write_text(original)

    def refuse(p: Path):
        assert yaml.safe_load(p.read_text())["model_config"]["enable_superkernel"] is True
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        apply_changes(path, {"model_config.enable_superkernel": True}, validate=refuse)
    assert path.read_text() == original
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp") or ".check." in p.name]
    res = apply_changes(
        path,
        {
            "model_config.enable_superkernel": True,
            "model_config.superkernel.custom": [{"regions": ["layer_*_m??"], "label": "ffn"}],
        },
    )
    new = path.read_text()
    assert "# top comment" in new and "# modes" in new and "# sk" in new
    mc = yaml.safe_load(new)["model_config"]
    assert mc["enable_superkernel"] is True
    assert mc["superkernel"] == {"custom": [{"regions": ["layer_*_m??"], "label": "ffn"}]}
    assert res.backup.read_text() == original and "+  enable_superkernel: true" in res.diff


def test_the_report_notes_candidates_measured_on_fewer_threads():
    from tools.scope_search import _note

    assert _note({"reason": None, "steps_on_fewer_threads": None}) == ""
    assert _note({"reason": None, "steps_on_fewer_threads": 0}) == ""
    assert _note({"reason": "slower", "steps_on_fewer_threads": 3}) == (
        "slower; 3 decode steps on fewer threads (a busy host)"
    )
