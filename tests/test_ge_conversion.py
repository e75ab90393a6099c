"""The GE conversion tier: our decode graphs through torchair's real FX-to-GE converter, on CPU.

One `tools/ge_check.py` subprocess per recipe (torchair, taken from the torch-npu wheel, cannot
be imported twice in a process, and tests/npu_doubles.py defines scope ops of its own here)
converts the bfloat16 decode step of a 2-layer model for every plan, with our NPU op table, our
scopes and our CompilerConfig; only GE's C++ runtime is stood in for. The assertions are made
here on the tool's JSON, from the facts files (tests/data/ascend_facts/), not by trusting the
tool's own verdict: every FX node found a converter, the fused ops became their GE ops, every GE
op inside a scope carries that scope's label and options and nothing outside does.

No wheel is a failure with the tool's one-line message, never a skip: the tier must run in CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from executor.backends.ge_dump import GeGraph, GeNode
from tests.tool_fixtures import TINY_DENSE, TINY_MOE, tiny_model
from tools.ge_check import check

REPO = Path(__file__).resolve().parent.parent
FUSED = yaml.safe_load((REPO / "tests/data/ascend_facts/fused_ops.yaml").read_text())["ops"]
GE = {name: fact["ge_op"] for name, fact in FUSED.items()}  # npu_rms_norm -> RmsNorm, ...
OPTIONS = "stream-fusion=1:strict-scope-check=bypass"  # on every built-in plan: proves options reach GE
LAYERS = 2
RECIPES = {
    "qwen": {"arch": dict(TINY_DENSE, num_hidden_layers=LAYERS), "ffn": "mlp"},
    "qwen3_moe": {"arch": dict(TINY_MOE, num_hidden_layers=LAYERS), "ffn": "moe"},
}
# The fused ops each region kind calls in decode (models/qwen, models/qwen3_moe), by torch_npu name.
REGION_OPS = {
    "attention": ("npu_rms_norm", "npu_rotary_mul", "npu_fused_infer_attention_score"),
    "mlp": ("npu_add_rms_norm", "npu_swiglu"),
    "moe": ("npu_add_rms_norm", "npu_moe_gating_top_k_softmax", "npu_swiglu"),
}


def _custom(ffn: str) -> list[dict]:
    """Two regions under one label, one FFN with other options, one FFN left out of every scope."""
    return [
        {"regions": ["layer_0_attn", "layer_1_attn"], "label": "attn01", "options": "stream-fusion=1"},
        {"regions": [f"layer_1_{ffn}"], "label": "ffn1", "options": "feed-sync-all=1"},
    ]


def expected_scopes(plan: str, ffn: str) -> dict[str, tuple[str, str]]:
    """label -> (region kind, options) the plan must produce on a LAYERS-layer model."""
    if plan == "none":
        return {}
    if plan == "custom":
        return {e["label"]: ("attention" if "attn" in e["label"] else ffn, e["options"]) for e in _custom(ffn)}
    if plan == "decoder":
        return {"decode_layers": ("decoder", OPTIONS)}
    suffix = {"attention": "_attn", "layer": "", ffn: f"_{ffn}"}[plan]
    return {f"layer_{i}{suffix}": (plan, OPTIONS) for i in range(LAYERS)}


def expected_ge_ops(kind: str, ffn: str) -> set[str]:
    kinds = ("attention", ffn) if kind in ("layer", "decoder") else (kind,)
    return {GE[op] for k in kinds for op in REGION_OPS[k]}


def _plans(ffn: str) -> list[str]:
    return ["none", "attention", ffn, "layer", "decoder", "custom"]


def run_ge_check(recipe: str, workdir: Path, extra_env: dict | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    spec = RECIPES[recipe]
    model = tiny_model(workdir / "model", spec["arch"])
    out = workdir / "ge_check.json"
    custom = json.dumps(_custom(spec["ffn"]))
    cmd = [sys.executable, str(REPO / "tools/ge_check.py"), "--model", recipe, "--json", str(out), "--probe"]
    cmd += ["--set", f"model_config.model_path={model}", "--set", "model_config.with_ckpt=false"]  # config.json only
    cmd += ["--set", f"model_config.superkernel.options={OPTIONS}"]
    cmd += ["--set", f"model_config.superkernel.custom={custom}", "--dump-dir", str(workdir / "dumps")]
    for plan in _plans(spec["ffn"]):
        cmd += ["--plan", plan]
    env = dict(os.environ, **(extra_env or {}))
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=env), out


@pytest.fixture(scope="module", params=list(RECIPES))
def converted(request, tmp_path_factory) -> tuple[str, dict]:
    recipe = request.param
    proc, out = run_ge_check(recipe, tmp_path_factory.mktemp(f"ge_{recipe}"))
    if proc.returncode == 2:  # no wheel, or torchair cannot be set up: a failure, never a skip
        pytest.fail(f"GE conversion tier could not run: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode in (0, 1) and out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return recipe, json.loads(out.read_text())


def test_every_fx_node_found_a_converter(converted):
    recipe, report = converted
    assert set(report["plans"]) == set(_plans(RECIPES[recipe]["ffn"]))
    for plan, result in report["plans"].items():
        assert result["without_converter"] == [], (plan, result.get("problems"))
        assert result["fx_graphs"] == 1 and result["layers"] == LAYERS  # fullgraph: one graph, our model
        assert result["dtype"] == "bfloat16"  # auto resolved as on an NPU
    assert report["probe"]["without_converter"] == []


def test_fused_ops_became_their_ge_ops(converted):
    recipe, report = converted
    ffn = RECIPES[recipe]["ffn"]
    for plan, result in report["plans"].items():
        types = set(result["outside"]["ops"]).union(*(set(s["ops"]) for s in result["scopes"].values()))
        assert expected_ge_ops("decoder", ffn) <= types, plan
    # the probe calls every op of the table, including the MoE prefill ops decode never reaches
    assert set(GE.values()) <= set(report["probe"]["ops"])


def test_scope_labels_and_options_exactly_on_the_scoped_ops(converted):
    recipe, report = converted
    ffn = RECIPES[recipe]["ffn"]
    for plan, result in report["plans"].items():
        want = expected_scopes(plan, ffn)
        assert set(result["scopes"]) == set(want), plan
        for label, (kind, options) in want.items():
            scope = result["scopes"][label]
            assert scope["options"] == [options], (plan, label)  # every GE op of the scope, one value
            missing = expected_ge_ops(kind, ffn) - set(scope["ops"])
            assert not missing, (plan, label, missing)
        assert result["outside"]["with_scope_attrs"] == [], plan
        outside = set(result["outside"]["ops"])
        if plan == "custom":  # layer 0's FFN is in no scope: its fused ops stay outside
            assert expected_ge_ops(ffn, ffn) <= outside
        if plan in ("layer", "decoder"):  # every fused op is inside a scope but the final norm's
            assert not outside & (expected_ge_ops("decoder", ffn) - {"RmsNorm"}), plan
            assert result["outside"]["ops"].count("RmsNorm") == 1, plan


def test_tool_verdict_agrees_and_schemas_match_the_facts_files(converted):
    _recipe, report = converted
    assert report["passed"] is True
    assert all(r["problems"] == [] for r in report["plans"].values()) and report["probe"]["problems"] == []
    assert "not compiled or run on an NPU" in report["what"]
    settings = yaml.safe_load((REPO / "tests/data/ascend_facts/compiler_config.yaml").read_text())["adapter_settings"]
    as_read = {k: ("1" if v is True else str(v)) for k, v in settings.items() if k != "observed"}
    assert all(r["compiler_config"] == as_read for r in report["plans"].values())  # torchair's own config took them
    assert (
        report["torch_npu"]
        == yaml.safe_load((REPO / "tests/data/ascend_facts/fused_ops.yaml").read_text())["torch_npu_version"]
    )
    assert set(report["schemas"]) == set(FUSED)
    for name, schema in report["schemas"].items():  # the wheel's schema = what the doubles are built from
        assert schema == FUSED[name]["schema"], name


def test_no_wheel_is_a_one_line_error(tmp_path):
    env = {"CANN_RECIPES_TORCH_NPU_WHEEL_DIR": str(tmp_path / "empty"), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": ""}
    proc, out = run_ge_check("qwen", tmp_path, env)
    assert proc.returncode == 2 and not out.exists()
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: cannot fetch the torch-npu 2.14.0 wheel")


def test_float32_is_refused_as_on_an_npu_before_anything_is_fetched(tmp_path):
    env = {"CANN_RECIPES_TORCH_NPU_WHEEL_DIR": str(tmp_path / "empty"), "PIP_NO_INDEX": "1"}
    cmd = [sys.executable, str(REPO / "tools/ge_check.py"), "--set", "model_config.dtype=float32"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=dict(os.environ, **env))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("error: model_config.dtype: float32 cannot run on an Ascend NPU")
    assert not (tmp_path / "empty").exists()  # refused before the wheel was looked for


# --------------------------------------------------------------------------- the checks can fail
def _node(name: str, type_: str, scope: str | None = None, options: str | None = None) -> GeNode:
    attrs = {} if scope is None else {"_super_kernel_scope": scope, "_super_kernel_options": options}
    return GeNode(name, type_, [], attrs)


def test_check_reports_stray_attributes_wrong_options_and_missing_ops():
    attention = ["RmsNorm", "RotaryMul", "FusedInferAttentionScore"]
    good = [_node(f"a{i}", t, "s", "stream-fusion=1") for i, t in enumerate(attention)]
    good += [_node("n", "AddRmsNorm"), _node("m", "SwiGlu")]
    scopes = {"s": ("attention", "stream-fusion=1")}
    assert check(GeGraph("g", Path("g"), good), scopes, {"mlp"}) == []
    stray = good + [_node("x", "Mul", None), GeNode("y", "Add", [], {"_super_kernel_options": "stream-fusion=1"})]
    assert any("outside every scope" in p for p in check(GeGraph("g", Path("g"), stray), scopes, {"mlp"}))
    other = good[:-3] + [_node("z", "Mul", "s", "")] + good[-2:]
    problems = check(GeGraph("g", Path("g"), other), scopes, {"mlp"})
    assert any("_super_kernel_options" in p for p in problems) and any("missing" in p for p in problems)
    assert any("labels" in p for p in check(GeGraph("g", Path("g"), good), {"t": scopes["s"]}, {"mlp"}))
