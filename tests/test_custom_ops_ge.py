"""The custom op `cann::decode_attention` through torchair's real FX-to-GE converter, inside scopes.

Why: on an NPU the op only helps if ge_graph converts it, inside the SuperKernel scope it was
traced in, to the GE op our converter registers (executor/backends/npu_decode_attention.py):
FusedInferAttentionScore fed `actual_seq_lengths_kv`, computed in the graph from the mask. One
`tools/ge_check.py` subprocess (torchair from the torch-npu wheel cannot be imported twice per
process) converts the bf16 decode step of a 2-layer Qwen3 with `custom_ops: [decode_attention]`
for several plans, and a second one the 2-layer Qwen3-MoE for the `moe` plan and a scope shared by
layer 0's attention and MoE; the assertions are made here on their JSON and GE node lists. A run without
the custom op (tests/test_ge_conversion.py) is the control: there FIA's input is unfed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tool_fixtures import TINY_DENSE, TINY_MOE, tiny_model

REPO = Path(__file__).resolve().parent.parent
LAYERS = 2
OPTIONS = "stream-fusion=1"
LENGTH_OPS = {"LogicalNot", "Cast", "Mul", "ReduceMax"}  # the converter's in-graph actual_seq_lengths_kv
SCOPE_OF_LAYER = {  # plan -> label of the scope layer i's attention is in (None: outside every scope)
    "none": lambda i: None,
    "attention": lambda i: f"layer_{i}_attn",
    "layer": lambda i: f"layer_{i}",
    "decoder": lambda i: "decode_layers",
}


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("ge_custom")
    model = tiny_model(work / "model", dict(TINY_DENSE, num_hidden_layers=LAYERS))
    out = work / "ge_check.json"
    cmd = [sys.executable, str(REPO / "tools/ge_check.py"), "--model", "qwen", "--json", str(out)]
    cmd += ["--set", f"model_config.model_path={model}", "--set", "model_config.custom_ops=[decode_attention]"]
    cmd += ["--set", f"model_config.superkernel.options={OPTIONS}", "--dump-dir", str(work / "dumps")]
    for plan in SCOPE_OF_LAYER:
        cmd += ["--plan", plan]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    if proc.returncode == 2:  # no wheel, or torchair cannot be set up: a failure, never a skip
        pytest.fail(f"GE conversion tier could not run: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0 and out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "custom ops in the FX graph: cann.decode_attention.default" in proc.stdout
    return json.loads(out.read_text())


def test_the_custom_op_node_found_our_converter(report):
    assert report["passed"] is True and set(report["plans"]) == set(SCOPE_OF_LAYER)
    for plan, result in report["plans"].items():
        assert result["without_converter"] == [], plan
        assert result["fx_custom_ops"] == ["cann.decode_attention.default"], plan
        assert result["dtype"] == "bfloat16" and result["layers"] == LAYERS


def test_it_became_fia_fed_valid_lengths_in_the_scope_it_was_traced_in(report):
    for plan, result in report["plans"].items():
        fia = result["attention_kv_lengths"]
        assert len(fia) == LAYERS, plan
        assert [f["from"] for f in fia] == ["ReduceMax"] * LAYERS, plan  # not unfed: only valid slots are read
        assert [f["scope"] for f in fia] == [SCOPE_OF_LAYER[plan](i) for i in range(LAYERS)], plan
        assert not any("actual_seq_lengths_kv" in note for note in result["known"]), plan


def test_the_length_computation_carries_the_scope_attributes_too(report):
    for plan in ("attention", "layer", "decoder"):
        result = report["plans"][plan]
        for label, scope in result["scopes"].items():
            assert scope["options"] == [OPTIONS], (plan, label)  # every GE op of the scope, one value
            assert LENGTH_OPS | {"FusedInferAttentionScore"} <= set(scope["ops"]), (plan, label)
        assert not LENGTH_OPS & set(result["outside"]["ops"]) - {"Cast", "Mul"}, plan  # RoPE uses Cast/Mul outside
        assert result["outside"]["with_scope_attrs"] == []
    outside = report["plans"]["none"]["outside"]["ops"]
    assert outside.count("ReduceMax") == LAYERS and outside.count("FusedInferAttentionScore") == LAYERS


# --------------------------------------------------------------------------- the MoE recipe
MOE_SCOPE = "model_config.superkernel.custom=[{regions: [layer_0_attn, layer_0_moe], label: attn_moe}]"


@pytest.fixture(scope="module")
def moe_report(tmp_path_factory) -> dict:
    """qwen3_moe (2 MoE layers): the `moe` plan, and one scope over layer 0's attention and MoE."""
    work = tmp_path_factory.mktemp("ge_custom_moe")
    model = tiny_model(work / "model", dict(TINY_MOE, num_hidden_layers=LAYERS))
    out = work / "ge_check.json"
    cmd = [sys.executable, str(REPO / "tools/ge_check.py"), "--model", "qwen3_moe", "--json", str(out)]
    cmd += ["--set", f"model_config.model_path={model}", "--set", "model_config.custom_ops=[decode_attention]"]
    cmd += ["--set", f"model_config.superkernel.options={OPTIONS}", "--set", MOE_SCOPE, "--plan", "moe"]
    cmd += ["--plan", "custom", "--dump-dir", str(work / "dumps")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    if proc.returncode == 2:
        pytest.fail(f"GE conversion tier could not run: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0 and out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_in_the_moe_recipe_it_converts_inside_a_scope_shared_with_the_moe_ops(moe_report):
    assert moe_report["passed"] is True
    custom, moe = moe_report["plans"]["custom"], moe_report["plans"]["moe"]
    for result in (custom, moe):
        assert result["without_converter"] == [] and result["fx_custom_ops"] == ["cann.decode_attention.default"]
        assert [f["from"] for f in result["attention_kv_lengths"]] == ["ReduceMax"] * LAYERS
    assert [f["scope"] for f in custom["attention_kv_lengths"]] == ["attn_moe", None]  # layer 1: outside
    scope = custom["scopes"]["attn_moe"]
    assert scope["options"] == [OPTIONS]
    assert LENGTH_OPS | {"FusedInferAttentionScore", "MoeGatingTopKSoftmax", "SwiGlu"} <= set(scope["ops"])
    assert [f["scope"] for f in moe["attention_kv_lengths"]] == [None, None]  # the moe plan leaves attention out
    assert set(moe["scopes"]) == {"layer_0_moe", "layer_1_moe"}
    assert not {"FusedInferAttentionScore", "ReduceMax"} & {op for s in moe["scopes"].values() for op in s["ops"]}
