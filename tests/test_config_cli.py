"""Config and CLI error paths, run for real: `python -m executor.cli run` / `bash infer.sh`.

Why a subprocess: the contract is what a user sees (exit code 2, one `error: ...` line, no
traceback), which only the real entry point shows. The unit tests below pin the pieces
(executor.config, executor.scope) those messages come from.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from executor.cli import main as cli_main
from executor.config import ConfigError, CustomScope, RunConfig, load_config, to_dict
from executor.scope import (
    ScopeError,
    ScopePlan,
    ScopeRunner,
    ScopeSpec,
    build_plan,
    decoder_regions,
    parse_options,
    scope_impl,
)

REPO = Path(__file__).resolve().parent.parent
TINY = ["--set", "scheduler_config.max_new_tokens=4"]


def run_cli(*args: str, cwd: Path = REPO, bash: str | None = None, timeout: int = 180):
    """Run the CLI (or `bash <script>`) with args; returns the CompletedProcess."""
    cmd = ["bash", bash, *args] if bash else [sys.executable, "-m", "executor.cli", "run", *args]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


class CompletedRun:
    """An in-process run shaped like subprocess.CompletedProcess (returncode, stdout, stderr)."""

    def __init__(self, returncode: int, captured):
        self.returncode, self.stdout, self.stderr = returncode, captured.out, captured.err


def assert_user_error(proc: subprocess.CompletedProcess | CompletedRun, *needles: str) -> str:
    """Exit 2, exactly one stderr line `error: ...` containing every needle, no traceback."""
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, f"rc {proc.returncode}\nstdout:{proc.stdout[-2000:]}\nstderr:{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr + proc.stdout
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


# ----------------------------------------------------------------------------- CLI error paths
SK_ON = ["--set", "model_config.exe_mode=ge_graph", "--set", "model_config.enable_superkernel=true"]
ERROR_CASES = {
    "unknown_key": (
        ["--set", "model_config.enable_superkernal=true"],
        ["model_config.enable_superkernal", "unknown key", "allowed keys", "exe_mode", "superkernel"],
    ),
    "wrong_type": (["--set", "scheduler_config.batch_size=two"], ["scheduler_config.batch_size", "integer"]),
    "wrong_type_bool": (["--set", "model_config.with_ckpt=3"], ["model_config.with_ckpt", "true or false"]),
    "outside_choices": (
        ["--set", "model_config.exe_mode=turbo"],
        ["model_config.exe_mode", "'turbo'", "eager, ge_graph, npugraph_ex"],
    ),
    "eager_with_superkernel": (
        ["--set", "model_config.exe_mode=eager", "--set", "model_config.enable_superkernel=true"],
        ["model_config.enable_superkernel", "eager"],
    ),
    "eager_with_superkernel_in_custom_params": (
        ["--config", str(REPO / "models/qwen/config/qwen3_8b_1tp.yaml"), "--set", "model_config.exe_mode=eager"],
        ["model_config.enable_superkernel", "eager"],
    ),
    "switch_in_two_places_disagrees": (
        ["--set", "model_config.custom_params.enable_superkernel=false"],
        ["model_config.enable_superkernel", "model_config.custom_params.enable_superkernel", "one place"],
    ),
    "static_kernel_outside_npugraph_ex": (
        ["--set", "model_config.enable_static_kernel=true"],
        ["model_config.enable_static_kernel", "npugraph_ex", "ge_graph"],
    ),
    "max_prefill_tokens_below_a_prompt": (
        ["--set", "scheduler_config.max_prefill_tokens=2"],
        ["scheduler_config.max_prefill_tokens", "prompt 0", "limit 2"],
    ),
    "yaml_not_in_recipe": (
        ["--yaml", "qwen3_9b_1tp.yaml"],
        ["--yaml qwen3_9b_1tp.yaml", "builtin.yaml", "qwen3_8b_1tp.yaml"],
    ),
    "yaml_and_config": (["--yaml", "builtin.yaml", "--config", "x.yaml"], ["--config", "--yaml", "one of them"]),
    "empty_model_name": (["--set", "model_config.model_name="], ["model_config.model_name", "empty"]),
    "sk_option_not_ascii_digits": (
        ["--set", "model_config.superkernel.options=debug-aic-num=\u00b2"],
        ["model_config.superkernel.options", "debug-aic-num", "positive integer"],
    ),
    "custom_scope_without_label": (
        ["--set", "model_config.superkernel.plan=custom", "--set", "model_config.superkernel.custom=[{regions: [x]}]"],
        ["model_config.superkernel.custom[0]", "label", "missing"],
    ),
    "custom_scope_empty_label": (
        [
            "--set",
            "model_config.superkernel.plan=custom",
            "--set",
            'model_config.superkernel.custom=[{regions: [x], label: ""}]',
        ],
        ["model_config.superkernel.custom[0].label", "non-empty"],
    ),
    "attn_tp_not_dividing_world_size": (
        ["--set", "parallel_config.world_size=2", "--set", "parallel_config.attn_tp_size=3"],
        ["parallel_config.attn_tp_size: 3 does not divide parallel_config.world_size 2", "allowed values: 1, 2"],
    ),
    "sk_unknown_option": (
        SK_ON + ["--set", "model_config.superkernel.options=feed-sync-al=1"],
        ["model_config.superkernel.options", "unknown option 'feed-sync-al'", "feed-sync-all"],
    ),
    "sk_bad_value": (
        SK_ON + ["--set", "model_config.superkernel.options=stream-fusion=2"],
        ["model_config.superkernel.options", "stream-fusion", "0 or 1"],
    ),
    "sk_bad_ratio": (
        SK_ON + ["--set", "model_config.superkernel.options=debug-aic-num=8:debug-aiv-num=12"],
        ["debug-aic-num:debug-aiv-num", "1:2"],
    ),
    "plan_moe_on_dense": (
        SK_ON + ["--set", "model_config.superkernel.plan=moe"],
        ["'moe'", "marks no region", "attention", "mlp"],
    ),
    "custom_without_scopes": (
        SK_ON + ["--set", "model_config.superkernel.plan=custom"],
        ["model_config.superkernel.custom", "custom"],
    ),
    "missing_checkpoint": (
        ["--set", "model_config.model_path=/nonexistent/qwen_ckpt", "--set", "model_config.with_ckpt=true"],
        ["/nonexistent/qwen_ckpt"],
    ),
    "with_ckpt_no_path": (
        ["--set", 'model_config.model_path=""', "--set", "model_config.with_ckpt=true"],
        ["model_config.model_path", "with_ckpt"],
    ),
    "npugraph_ex_on_cpu": (["--set", "model_config.exe_mode=npugraph_ex"], ["npugraph_ex", "NPU", "ge_graph"]),
    "static_kernel_without_npugraph_ex": (
        ["--set", "model_config.exe_mode=ge_graph", "--set", "model_config.enable_static_kernel=true"],
        ["model_config.enable_static_kernel", "npugraph_ex"],
    ),
    "device_npu_on_cpu": (["--set", "model_config.device=npu"], ["device='npu'"]),
    "set_without_equals": (
        ["--set", "scheduler_config.max_new_tokens"],
        ["scheduler_config.max_new_tokens", "key=value"],
    ),
    "unknown_model": (["--model", "llama"], ["--model", "'llama'", "allowed values", "qwen"]),
    "bad_dataset": (["--set", "data_config.dataset=/nonexistent/prompts.txt"], ["/nonexistent/prompts.txt"]),
    "dataset_is_a_directory": (["--set", f"data_config.dataset={REPO}"], ["data_config.dataset", "is a directory"]),
    "longbench_absent": (
        ["--set", "data_config.dataset=LongBench", "--set", "data_config.dataset_path=/nonexistent/lb"],
        ["LongBench", "local copy", "/nonexistent/lb", "data_config.dataset_path"],
    ),
    # upstream keys this project does not implement: accepted at their default only
    **{
        f"upstream_{key.rsplit('.', 1)[-1]}": (["--set", f"{key}={value}"], [key, "not supported here"])
        for key, value in (
            ("model_config.force_eplb", "true"),
            ("model_config.next_n", "1"),
            ("model_config.enable_hadamard", "true"),
            ("model_config.custom_params.enable_multi_streams", "true"),
            ("scheduler_config.mem_fraction_static", "0.9"),
            ("scheduler_config.block_size", "64"),
            ("parallel_config.cp_size", "2"),
            ("parallel_config.o_proj_tp_size", "2"),
        )
    },
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_cli_user_errors(case, tmp_path, capsys):
    """In process, through executor.cli.main (what infer.sh runs), to keep the table fast; the
    classes are also run through bash infer.sh below."""
    args, needles = ERROR_CASES[case]
    out = tmp_path / "out"
    rc = cli_main(["run", *args, *TINY, "--out", str(out)])
    assert_user_error(CompletedRun(rc, capsys.readouterr()), *needles)
    assert not (out / "metrics.json").exists()


def test_malformed_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_config:\n  exe_mode: [eager\nscheduler_config:\n  batch_size: 1\n")
    assert_user_error(run_cli("--config", str(bad), "--out", str(tmp_path / "o")), str(bad), "malformed YAML")


def test_yaml_file_unknown_nested_key_through_infer_sh(tmp_path):
    cfg = yaml.safe_load((REPO / "models/qwen/config/builtin.yaml").read_text())
    cfg["model_config"]["superkernel"]["enable_superkernal"] = True
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = run_cli("--config", str(path), "--out", str(tmp_path / "o"), bash="infer.sh")
    assert_user_error(proc, "model_config.superkernel.enable_superkernal", "allowed keys: plan, options, custom")


def test_missing_config_file(tmp_path):
    assert_user_error(run_cli("--config", str(tmp_path / "nope.yaml")), str(tmp_path / "nope.yaml"))


# ----------------------------------------------------------------------------- infer.sh runs
def test_infer_sh_help():
    proc = run_cli("--help", bash="infer.sh")
    assert proc.returncode == 0, proc.stderr
    assert "--set" in proc.stdout and "KEY=VALUE" in proc.stdout and "--out" in proc.stdout


# In a fresh Python: executor.cli.main(argv), its output swallowed; prints the exit code and whether
# torch got imported.
WITHOUT_TORCH = """
import contextlib, io, sys
import executor.cli as cli
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    try:
        rc = cli.main(sys.argv[1:])
    except SystemExit as exc:
        rc = exc.code
print(rc, "torch" in sys.modules)
"""


def test_help_and_config_errors_come_before_torch():
    """`--help` of infer.sh and sk_compare, and a wrong recipe, YAML, key or value, are answered
    before anything imports torch (`import torch` alone is 2-3 s)."""
    cases = {
        "run --help": 0,
        "compare --help": 0,
        "run --model nope": 2,
        "run --yaml nope": 2,
        "run --set model_config.nope=1": 2,
        "run --set model_config.exe_mode=eagerr": 2,
    }
    for argv, rc in cases.items():
        cmd = [sys.executable, "-c", WITHOUT_TORCH, *argv.split()]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        assert proc.stdout.split() == [str(rc), "False"], (argv, proc.stdout, proc.stderr[-2000:])


def test_infer_sh_finds_what_is_installed_without_importing_it(tmp_path):
    """infer.sh's `have`: true only when every module named is installed (a dotted name whose
    package is missing too), found without running the module's code."""
    have = next(ln for ln in (REPO / "infer.sh").read_text().splitlines() if ln.startswith("have()"))
    (tmp_path / "loud.py").write_text("raise SystemExit('imported')\n")  # importing it would fail
    cases = {"torch": 0, "torch yaml ruamel.yaml": 0, "loud": 0, "torch no_such_module": 1, "ruamel.nope": 1}
    cases |= {"no_such_package.mod": 1}
    for modules, rc in cases.items():
        script = f'PY="{sys.executable}"\n{have}\nhave {modules}'
        proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(tmp_path)))
        assert proc.returncode == rc, modules


EAGER = ["--set", "model_config.exe_mode=eager", "--set", "model_config.enable_superkernel=false"]
EAGER += ["--set", "model_config.enable_cache_compile=false"]


def test_recipe_infer_sh_from_its_directory(tmp_path):
    out = tmp_path / "out"
    proc = run_cli(*EAGER, *TINY, "--out", str(out), cwd=REPO / "models/qwen", bash="infer.sh")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["recipe"] == "qwen" and len(metrics["generated_token_ids"][0]) == 4
    assert (out / "infer.log").read_text().count("inference time cost of decode is") == 3


DECODE_RE = re.compile(r"^qwen inference time cost of decode is \d+\.\d+ ms$")
AVERAGE_RE = re.compile(r"^qwen average inference time cost is \d+\.\d+ ms$")
THROUGHPUT_RE = re.compile(r"^qwen decode throughput is \d+\.\d+ tokens/s$")
PREFILL_RE = re.compile(r"^qwen inference time cost of prefill is \d+\.\d+ ms$")


def test_default_infer_sh_log_format_and_metrics(tmp_path):
    """The README's first command, as shipped (ge_graph + SuperKernel), with its cache kept apart."""
    out = tmp_path / "out"
    cache = ["--set", f"model_config.cache_dir={tmp_path / 'cache'}"]
    proc = run_cli("--out", str(out), *TINY, *cache, bash="infer.sh", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    decode = [float(line.split()[-2]) for line in lines if DECODE_RE.match(line)]
    assert len(decode) == 3
    assert sum(bool(PREFILL_RE.match(line)) for line in lines) == 1
    assert sum(bool(AVERAGE_RE.match(line)) for line in lines) == 1
    assert sum(bool(THROUGHPUT_RE.match(line)) for line in lines) == 1
    m = json.loads((out / "metrics.json").read_text())
    for key in (
        "platform",
        "device_name",
        "torch_version",
        "exe_mode",
        "superkernel",
        "prefill_ms",
        "decode_ms",
        "decode_ms_median",
        "tokens_per_s",
        "peak_memory_mb",
        "generated_token_ids",
        "text",
    ):
        assert key in m, key
    assert set(m["superkernel"]) >= {"requested", "ran", "plan", "scopes"}
    sk = m["superkernel"]
    assert (sk["requested"], sk["ran"], sk["plan"]) == (True, True, "decoder")
    assert [s["label"] for s in sk["scopes"]] == ["decode_layers"] and sk["scopes"][0][
        "launches"
    ] == 4  # warm-up step + 3 measured
    assert (m["platform"], m["exe_mode"]) == ("cpu", "ge_graph") and m["torch_version"].startswith("2.")
    assert m["compile"]["cache_enabled"] is True
    assert isinstance(m["decode_ms"], list) and len(m["decode_ms"]) == 3
    assert [round(v, 2) for v in m["decode_ms"]] == decode  # the printed lines are the measured steps
    assert m["decode_ms_median"] == statistics.median(m["decode_ms"])
    assert m["tokens_per_s"] == pytest.approx(3 / (sum(m["decode_ms"]) / 1e3))
    assert m["prefill_ms"] > 0 and m["peak_memory_mb"] > 0
    mem = m["memory"]  # the estimate made before allocating, within a sane factor of the measured peak
    assert mem["checked"] and 0.5 <= mem["estimate_mb"]["peak"] / mem["measured_peak_mb"] <= 2.0, mem
    assert len(m["generated_token_ids"]) == 1 and len(m["generated_token_ids"][0]) == 4
    assert isinstance(m["text"], list) and isinstance(m["text"][0], str)
    assert (out / "infer.log").read_text().splitlines()[: len(lines)] == lines


# ----------------------------------------------------------------------------- executor.config
def test_load_config_defaults_and_recipe_file():
    assert load_config(None) == RunConfig()
    cfg = load_config(REPO / "models/qwen/config/builtin.yaml")
    assert (cfg.model_config.exe_mode, cfg.superkernel_on, cfg.model_config.superkernel.plan) == (
        "ge_graph",
        True,
        "decoder",
    )
    assert cfg.model_config.enable_cache_compile and cfg.data_config.input_truncated_len == 64
    assert cfg.data_config.prompts == ("The function returns", "Python is a programming language that")


def test_overrides_are_type_checked():
    cfg = load_config(
        None,
        [
            "scheduler_config.max_new_tokens=8",
            "model_config.exe_mode=ge_graph",
            "data_config.prompts=[a b, c]",
            "model_config.enable_superkernel=true",
        ],
    )
    assert cfg.scheduler_config.max_new_tokens == 8 and cfg.model_config.exe_mode == "ge_graph"
    assert cfg.data_config.prompts == ("a b", "c") and cfg.superkernel_on
    for bad, needle in (
        ("model_config.seed=1.5", "model_config.seed: expected an integer"),
        ("scheduler_config.batch_size=true", "expected an integer"),
        ("model_config.with_ckpt=1", "expected true or false"),
        ("data_config.prompts=hello", "expected a list of str"),
        ("model_config=3", "model_config: expected a mapping"),
        ("model_config.dtype=fp8", "allowed values: auto, float32, bfloat16, float16"),
        ("scheduler_config.batch_size=0", "must be >= 1"),
        ("nope.x=1", "nope: unknown key; allowed keys: model_config, data_config"),
    ):
        with pytest.raises(ConfigError, match=re.escape(needle)):
            load_config(None, [bad])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.scheduler_config.batch_size = 2


def test_custom_scopes_parse_into_custom_scope():
    cfg = load_config(
        None,
        [
            "model_config.exe_mode=ge_graph",
            "model_config.enable_superkernel=true",
            "model_config.superkernel.plan=custom",
            'model_config.superkernel.custom=[{regions: ["layer_*_attn"], label: attn}, '
            '{regions: [layer_1_mlp, layer_2_mlp], label: m, options: "feed-sync-all=1"}]',
        ],
    )
    assert cfg.model_config.superkernel.custom == (
        CustomScope(("layer_*_attn",), "attn", ""),
        CustomScope(("layer_1_mlp", "layer_2_mlp"), "m", "feed-sync-all=1"),
    )
    with pytest.raises(ConfigError, match=r"custom\[0\]\.lable: unknown key; allowed keys: regions, label, options"):
        load_config(None, ["model_config.superkernel.custom=[{regions: [x], lable: y}]"])
    with pytest.raises(ScopeError, match=r"custom\[0\]\.options"):
        load_config(None, ['model_config.superkernel.custom=[{regions: [x], label: y, options: "x=1"}]'])


def test_to_dict_is_plain_data_and_round_trips(tmp_path):
    cfg = load_config(
        None, ["data_config.prompts=[a, b]", "model_config.superkernel.custom=[{regions: [r], label: l}]"]
    )
    data = to_dict(cfg)
    assert data["data_config"]["prompts"] == ["a", "b"]
    assert data["model_config"]["superkernel"]["custom"] == [{"regions": ["r"], "label": "l", "options": ""}]
    json.dumps(data)  # plain data only
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    assert load_config(path) == cfg


# ----------------------------------------------------------------------------- executor.scope
def test_parse_options_valid():
    assert parse_options("") == {}
    opts = (
        "feed-sync-all=1:stream-fusion=0:strict-scope-check=abort:"
        "dcci-before-kernel-start=GroupedMatmul,MoeGatingTopK:debug-aic-num=24:debug-aiv-num=48"
    )
    assert parse_options(opts) == {
        "feed-sync-all": "1",
        "stream-fusion": "0",
        "strict-scope-check": "abort",
        "dcci-before-kernel-start": "GroupedMatmul,MoeGatingTopK",
        "debug-aic-num": "24",
        "debug-aiv-num": "48",
    }
    assert parse_options("debug-aic-num=20:debug-aiv-num=20") == {"debug-aic-num": "20", "debug-aiv-num": "20"}


@pytest.mark.parametrize(
    "options, needle",
    [
        ("bogus=1", "unknown option 'bogus'"),
        ("feed-sync-all", "is not opt=val"),
        ("feed-sync-all=2", "feed-sync-all takes 0 or 1"),
        ("strict-scope-check=maybe", "bypass or abort"),
        ("dcci-after-kernel-end=Grouped-Matmul", "comma separated op types"),
        ("debug-aic-num=0", "positive integer"),
        ("debug-aiv-num=x", "positive integer"),
        ("debug-aic-num=24:debug-aiv-num=36", "must be one of 1:0, 0:1, 1:1, 1:2"),
        ("debug-aic-num=48:debug-aiv-num=24", "must be one of"),
    ],
)
def test_parse_options_invalid(options, needle):
    with pytest.raises(ScopeError, match=re.escape(needle)):
        parse_options(options, key="k.options")


REGIONS = decoder_regions(2, ["mlp", "mlp"])


@pytest.mark.parametrize(
    "plan, regions",
    [
        ("attention", ["layer_0_attn", "layer_1_attn"]),
        ("mlp", ["layer_0_mlp", "layer_1_mlp"]),
        ("layer", ["layer_0", "layer_1"]),
        ("decoder", ["decode_layers"]),
    ],
)
def test_build_plan_builtin(plan, regions):
    built = build_plan(REGIONS, plan, "feed-sync-all=1")
    assert built == ScopePlan(plan, tuple(ScopeSpec(r, r, "feed-sync-all=1") for r in regions))
    assert built.labels == sorted(regions)


def test_build_plan_moe_only_where_there_is_moe():
    with pytest.raises(ScopeError, match="'moe' marks no region of qwen; it has attention, mlp regions"):
        build_plan(REGIONS, "moe", model_name="qwen")
    mixed = decoder_regions(2, ["moe", "mlp"])
    assert [s.region for s in build_plan(mixed, "moe").scopes] == ["layer_0_moe"]
    with pytest.raises(ScopeError, match="'fused' is not a plan"):
        build_plan(REGIONS, "fused")


def test_build_plan_custom_fnmatch_and_errors():
    custom = (CustomScope(("layer_*_attn",), "attn", "stream-fusion=1"), CustomScope(("layer_1_mlp",), "m"))
    plan = build_plan(REGIONS, "custom", "feed-sync-all=0", custom)
    assert plan.scopes == (
        ScopeSpec("layer_0_attn", "attn", "stream-fusion=1"),
        ScopeSpec("layer_1_attn", "attn", "stream-fusion=1"),
        ScopeSpec("layer_1_mlp", "m", "feed-sync-all=0"),
    )  # plan-level options as default
    assert plan.labels == ["attn", "m"]
    with pytest.raises(ScopeError, match="layer_0 and layer_0_attn are nested"):
        build_plan(REGIONS, "custom", custom=[CustomScope(("layer_0", "layer_0_attn"), "x")])
    with pytest.raises(ScopeError, match="nested"):
        build_plan(REGIONS, "custom", custom=[CustomScope(("decode_layers",), "a"), CustomScope(("layer_1_mlp",), "b")])
    with pytest.raises(ScopeError, match=re.escape("'layer_9_*' matches no region")):
        build_plan(REGIONS, "custom", custom=[CustomScope(("layer_9_*",), "x")])
    with pytest.raises(ScopeError, match="layer_0_attn is selected twice"):
        build_plan(REGIONS, "custom", custom=[CustomScope(("layer_0_attn", "layer_*_attn"), "x")])


def test_scope_runner_opens_scopes_only_when_active_and_planned():
    entered: list[tuple[str, str]] = []

    class Recording:
        def __init__(self, label, options):
            entered.append((label, options))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    plan = build_plan(REGIONS, "attention", "feed-sync-all=1")
    with scope_impl(Recording):
        for name in ("decode_layers", "layer_0", "layer_0_attn", "layer_1_mlp"):
            with ScopeRunner(plan, active=False).region(name):
                pass
        assert entered == []  # inactive (prefill): no scope at all
        for name in ("decode_layers", "layer_0", "layer_0_attn", "layer_1_mlp", "layer_1_attn"):
            with ScopeRunner(plan, active=True).region(name):
                pass
    assert entered == [("layer_0_attn", "feed-sync-all=1"), ("layer_1_attn", "feed-sync-all=1")]


@pytest.mark.parametrize("active", [False, True])
def test_scope_markers_reach_the_graph_only_when_active(active):
    """What the portable backend splits on: marker ops around the region, in program order."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    runner = ScopeRunner(build_plan(REGIONS, "attention", "stream-fusion=1"), active=active)

    def step(x):
        with runner.region("layer_0_attn"):
            y = x * 2
        with runner.region("layer_0_mlp"):  # not in the plan: never a scope
            y = y + 1
        return y

    graph = make_fx(step)(torch.randn(3)).graph
    calls = [(str(n.target), n.args) for n in graph.nodes if n.op == "call_function"]
    targets = [t for t, _ in calls]
    if not active:
        assert targets == ["aten.mul.Tensor", "aten.add.Tensor"]
    else:
        assert targets == ["sk.scope_enter.default", "aten.mul.Tensor", "sk.scope_exit.default", "aten.add.Tensor"]
        assert calls[0][1] == ("layer_0_attn", "stream-fusion=1") and calls[2][1] == ("layer_0_attn",)
