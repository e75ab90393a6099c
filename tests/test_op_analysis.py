"""tools/op_analysis.py on a tiny Qwen3, and the pieces it is built from.

Why these checks: an analysis is only useful if its numbers are right where they can be known
exactly (the FLOPs of every linear from the architecture, the source line of each op in the
model file, the regions the model declares), if the Ascend mapping is torchair's answer and
not ours (so one run asks the real converter, from the wheel), and if the opportunities it
ranks first are the ones the model really has: the static-cache attention (gone once the custom
op decode_attention is on), the residual add before an RMSNorm, q/k RMSNorm feeding rotary,
fp32 RoPE tables in a bf16 run. Timings themselves are not asserted (a shared machine).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from executor import cli
from executor.analysis import findings, roofline
from executor.analysis.analyze import analyze
from executor.analysis.trace import PYTHON, OpCall, OpRecorder, OpTime, RegionMarker, footprint, profile_times
from executor.config import load_config
from executor.errors import run_command
from executor.platform import detect
from executor.registry import default_config, runner_class
from tests.tool_fixtures import TINY_DENSE, tiny_model
from tools import op_analysis

REPO = Path(__file__).resolve().parent.parent
MODEL_FILE = REPO / "models/qwen/models/modeling_qwen.py"
ARCH = dict(TINY_DENSE, num_hidden_layers=2)
BASE = ["model_config.dtype=bfloat16", "data_config.input_truncated_len=16", "scheduler_config.max_new_tokens=8"]
BASE += ["model_config.with_ckpt=false"]  # the tiny model directory holds config.json only (random weights)


def model_line(source: str) -> str:
    path, line = source.rsplit(":", 1)
    assert path == "models/qwen/models/modeling_qwen.py", source
    return MODEL_FILE.read_text().splitlines()[int(line) - 1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("analysis") / "model", ARCH)


@pytest.fixture(scope="module")
def cli_run(model_dir, tmp_path_factory) -> dict:
    """The command, as a user runs it (subprocess), with the GE converter check."""
    out = tmp_path_factory.mktemp("analysis_out") / "report"
    cmd = [sys.executable, str(REPO / "tools/op_analysis.py"), "--model", "qwen", "--steps", "3", "--out", str(out)]
    cmd += ["--threads", "1"]  # a shared machine: no OpenMP region waits for a descheduled thread
    for item in [*BASE, f"model_config.model_path={model_dir}"]:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"out": out, "stdout": proc.stdout, "json": json.loads((out / "op_analysis.json").read_text())}


def test_outputs_are_written_and_say_what_the_timings_are(cli_run):
    out, a = cli_run["out"], cli_run["json"]
    assert (out / "op_analysis.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "op_analysis.png").stat().st_size > 10_000
    assert "portable CPU measurement, not an Ascend result" in a["what"]
    assert a["threads"] == 1 and "1 torch thread," in a["what"]
    assert "torchair from the torch-npu 2.14.0 wheel" in a["graph"]["converters"]
    md = (out / "op_analysis.md").read_text().splitlines()
    first = a["opportunities"][0]
    assert md[2] == a["headline"] and md[2].startswith(f"Biggest opportunity: {first['what']} (~")  # the first line
    assert first["action"] in md[2] and "not an Ascend result" in md[4]
    first_row = next(line for line in md if line.startswith("| 1 |"))
    assert first["what"] in first_row
    assert f"[analyze] {a['headline']}" in cli_run["stdout"]


def test_opportunities_are_ranked_biggest_first(cli_run):
    savings = [o["saving_ms"] for o in cli_run["json"]["opportunities"]]
    blockers = [s for s in savings if s is None]
    assert savings[: len(blockers)] == blockers  # blockers (they stop graph mode) first
    rest = savings[len(blockers) :]
    assert rest == sorted(rest, reverse=True) and len(rest) >= 3


def test_regions_are_the_models_and_shares_add_up(cli_run):
    for phase in ("decode", "prefill"):
        rows = cli_run["json"][phase]["regions"]
        names = {r["region"] for r in rows}
        assert {"layer_0_attn", "layer_1_attn", "layer_0_mlp", "layer_1_mlp", "lm_head", "embed"} <= names, phase
        assert sum(r["share"] for r in rows) == pytest.approx(1.0, abs=1e-6)
        assert [r["ms"] for r in rows] == sorted((r["ms"] for r in rows), reverse=True)


def test_linear_flops_are_exactly_the_architectures(cli_run):
    h, hq, hkv, d, i, v = (ARCH[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                             "intermediate_size", "vocab_size"))  # fmt: skip
    per_layer = 2 * h * (hq + 2 * hkv) * d + 2 * hq * d * h + 2 * h * 2 * i + 2 * i * h  # qkv, o, gate_up, down
    ops = {o["op"]: o for o in cli_run["json"]["decode"]["op_types"]}
    assert ops["aten::mm"]["flops"] == ARCH["num_hidden_layers"] * per_layer + 2 * h * v  # + lm_head, batch 1
    slots = cli_run["json"]["run"]["max_len"]  # masked attention scores every slot: q.k and p.v
    assert ops["aten::bmm"]["flops"] == ARCH["num_hidden_layers"] * 2 * (2 * hq * slots * d)
    assert ops["aten::mm"]["bytes"] > 2 * (per_layer // 2 + h * v)  # every weight read once, bf16 (2 bytes)
    assert {o["bound"] for o in ops.values()} <= {"bandwidth", "compute", "overhead", "python"}


def test_mapping_names_torchairs_converters_and_the_fused_npu_ops(cli_run):
    g = cli_run["json"]["graph"]
    rows = {m["target"]: m for m in g["mapping"]}
    mm = rows["aten.mm.default"]
    assert mm["converter"] == "converter" and mm["entries"] == ["linear"]  # ops.linear: plain aten on NPU too
    assert mm["npu"] == ["linear: plain aten ops in the NPU table too"]
    for source in mm["sources"]:
        assert re.search(r"proj|lm_head", model_line(source)), source
    rsqrt = rows["aten.rsqrt.default"]
    assert set(rsqrt["entries"]) == {"rms_norm", "add_rms_norm"} and rsqrt["in_model_code"] == 0
    assert "npu_rms_norm (GE RmsNorm)" in rsqrt["npu"] and rsqrt["fused_converter"] == ["converter"]
    assert all(m["problems"] == [] for m in g["mapping"]) and g["breaks"] == [] and g["graphs"] == 1
    assert all(m["converter"] in ("converter", "not needed") for m in g["mapping"])
    assert g["communication_ops_per_step"] == 0


def test_the_models_real_opportunities_with_their_lines(cli_run):
    by_kind = {}
    for o in cli_run["json"]["opportunities"]:
        by_kind.setdefault(o["kind"], []).append(o)
    (attention,) = [o for o in by_kind["custom op"] if "KV-cache slots" in o["what"]]
    assert "decode_attention" in attention["action"] and attention["saving_ms"] > 0
    assert [model_line(s).strip() for s in attention["where"]] == [
        "out = ops.attention(q, k_all, v_all, ctx.mask, self.scale)  # (B, Hq, S, D)"
    ]
    (add,) = [o for o in by_kind["fusion"] if "add_rms_norm" in o["action"]]
    assert [model_line(s).strip() for s in add["where"]] == ["h = h + self.mlp(x)"]
    (qk,) = [o for o in by_kind["custom op"] if "q/k RMSNorm" in o["what"]]
    assert any("rotary_mul" in model_line(s) for s in qk["where"])
    # the KV-cache write (ops.kv_update, an index_put_) stays in place in graph mode: no whole-cache
    # copy per layer is found (while it was a scatter_, this finding named its 4 writes)
    assert "graph" not in by_kind
    (dtype,) = by_kind["dtype"]
    functions = {re.search(r"def (\w+)", _function_of(s)).group(1) for s in dtype["where"]}
    assert functions == {"rope_cos_sin", "logits"}  # fp32 RoPE tables and the fp32 logits cast


def _function_of(source: str) -> str:
    """The name of the def a model line belongs to."""
    lines = MODEL_FILE.read_text().splitlines()[: int(source.rsplit(":", 1)[1])]
    return next(line for line in reversed(lines) if line.lstrip().startswith("def "))


def test_with_decode_attention_the_attention_opportunity_is_gone_and_its_converter_found(model_dir):
    overrides = [*BASE, f"model_config.model_path={model_dir}", "model_config.custom_ops=[decode_attention]"]
    runner = runner_class("qwen")(load_config(default_config("qwen"), overrides), detect("cpu"), None)
    a = analyze(runner, steps=2, ge=True, log=lambda _line: None)
    rows = {m["target"]: m for m in a["graph"]["mapping"]}
    custom = rows["cann.decode_attention.default"]
    assert custom["converter"] == "converter" and custom["entries"] == ["attention"]
    assert not any("KV-cache slots" in o["what"] for o in a["opportunities"])
    ops = {o["op"] for o in a["decode"]["op_types"]}
    assert "cann::decode_attention" in ops and "aten::bmm" not in ops  # prefill keeps bmm; decode does not


# --------------------------------------------------------------------------- the pieces
def test_footprint_counts_an_expanded_dim_once():
    x = torch.zeros(4, 1, 8)
    assert footprint(x) == 4 * 8 * 4 and footprint(x.expand(4, 100, 8)) == 4 * 8 * 4
    assert footprint(torch.zeros(10, 10)[:, :3]) == 10 * 3 * 4  # a strided slice: the elements, not the span


def test_recorder_bytes_flops_views_and_in_place():
    marker = RegionMarker()
    a, b, cache, index, src = (
        torch.randn(8, 16),
        torch.randn(16, 4),
        torch.zeros(2, 32),
        torch.tensor([3]),
        torch.ones(2, 1),
    )
    with OpRecorder(marker) as rec, marker.region("layer_0_attn"):
        a @ b  # mm
        a.view(16, 8)  # a view: nothing moves
        cache.index_copy_(1, index, src)  # in place: writes what it reads
    mm, view, copy = rec.calls
    assert (mm.op, mm.flops, mm.bytes, mm.region) == (
        "aten::mm",
        2 * 8 * 16 * 4,
        (8 * 16 + 16 * 4 + 8 * 4) * 4,
        "layer_0_attn",
    )
    assert (view.op, view.bytes, view.flops) == ("aten::view", 0, 0)
    assert copy.op == "aten::index_copy_" and copy.bytes == 2 * (8 + 2 * 4)  # index (int64) + source, read and written
    assert mm.source == "" and mm.entry is None  # not called from a model file


def test_profile_attributes_ops_to_the_innermost_region():
    marker = RegionMarker()
    x = torch.randn(64, 64)

    def step():
        with marker.region("layer_0"), marker.region("layer_0_attn"):
            x @ x
        x.sum()

    times = {(t.region, t.op): t for t in profile_times(step, 3, {"layer_0", "layer_0_attn"})}
    assert times[("layer_0_attn", "aten::mm")].calls == 1 and times[("other", "aten::sum")].calls == 1
    assert ("layer_0", "aten::mm") not in times and ("layer_0_attn", "(python)") in times


def test_roofline_bound_classification():
    m = roofline.Machine(read_gbs=10.0, peak_gflops=100.0, dtype="float32")  # balance 10 FLOP/byte
    assert roofline.bound(flops=1e6, nbytes=1e6, ms=0.2, machine=m) == "bandwidth"  # floor 0.1 ms
    assert roofline.bound(flops=1e8, nbytes=1e6, ms=1.5, machine=m) == "compute"  # floor 1 ms
    assert roofline.bound(flops=1e6, nbytes=1e6, ms=5.0, machine=m) == "overhead"  # 50x the floor
    assert roofline.bound(flops=0, nbytes=0, ms=0.01, machine=m) == "overhead"


def test_overhead_in_a_graph_mode_leaves_out_the_python_dynamo_removed():
    """Eager: op time above the roofline + Python between ops; ge_graph with a narrower plan: the
    per-op excess only (dynamo traced the Python away); ge_graph + decoder: nothing to suggest."""
    m = roofline.Machine(read_gbs=10.0, peak_gflops=100.0, dtype="float32")
    times = [OpTime("layer_0_mlp", "aten::mm", 0.5, 1), OpTime("layer_0_mlp", PYTHON, 2.0, 1)]
    calls = [OpCall("aten::mm", "layer_0_mlp", 2 * 10**6, 10**6, "float32", "", None)]  # roofline 0.1 ms
    run = {"exe_mode": "eager", "superkernel": False, "plan": "none", "dtype": "float32"}
    (eager,) = findings._overhead(times, calls, m, run)
    assert eager.saving_ms == pytest.approx(0.4 + 2.0) and "exe_mode: ge_graph" in eager.action
    (moe,) = findings._overhead(times, calls, m, dict(run, exe_mode="ge_graph", superkernel=True, plan="moe"))
    assert moe.saving_ms == pytest.approx(0.4) and "plan moe scopes part of the step" in moe.what
    assert "superkernel.plan: decoder" in moe.action
    assert findings._overhead(times, calls, m, dict(run, exe_mode="ge_graph", superkernel=True, plan="decoder")) == []


def test_bad_input_is_exit_2_and_one_line(capsys, tmp_path):
    assert run_command(op_analysis.main, ["--steps", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --steps: must be >= 1, got 0"
    assert run_command(op_analysis.main, ["--threads", "-1"]) == 2
    assert capsys.readouterr().err.strip() == "error: --threads: must be >= 0 (0 = torch default), got -1"
    assert run_command(op_analysis.main, ["--set", "model_config.custom_ops=[nope]", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'nope' is not a custom op; available: decode_attention" in err


def test_cli_analyze_help_and_bad_input(capsys):
    """`cann-recipes-infer analyze` is the tool: listed by --help, its own --help, exit 2 on bad input."""
    assert cli.main(["--help"]) == 0
    assert re.search(r"^  analyze +where decode time goes", capsys.readouterr().out, re.M)
    with pytest.raises(SystemExit) as done:  # argparse's --help
        cli.main(["analyze", "--help"])
    own = capsys.readouterr().out
    assert done.value.code == 0 and own.startswith("usage: ")
    for option in ("--model", "--config", "--set", "--steps", "--threads", "--out", "--no-ge", "op_analysis.png"):
        assert option in own, option
    assert "exit codes: 0 report written, 2 bad input" in own
    assert cli.main(["analyze", "--config", "/nonexistent/recipe.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "/nonexistent/recipe.yaml" in err


def test_capture_flags_a_scatter_into_a_graph_input_but_not_an_index_put():
    """The detector behind the whole-cache-copy finding: AOT turns an in-place scatter_ into a graph
    input into a functional scatter (a new tensor per step, copied back); ops.kv_update's index_put_
    is what Inductor keeps in place, so it is not flagged."""
    from executor.analysis import mapping
    from executor.ops import reference

    def scatter_write(cache, new, pos):
        return cache.scatter_(2, pos.view(1, 1, 1, 1).expand(1, 2, 1, 8), new).sum()

    def index_put_write(cache, new, pos):
        return reference.kv_update(cache, new, pos.view(1, 1)).sum()

    args = (torch.zeros(1, 2, 16, 8), torch.ones(1, 2, 1, 8), torch.tensor([3]))
    flagged = {fn.__name__: [n.target for n in mapping.capture(fn, args).nodes if n.rewrites_input]
               for fn in (scatter_write, index_put_write)}  # fmt: skip
    assert flagged == {"scatter_write": ["aten.scatter.src"], "index_put_write": []}
