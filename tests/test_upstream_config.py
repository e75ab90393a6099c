"""cann-recipes-infer's configuration, spoken as its users write it (issue: upstream YAMLs run
unchanged, SuperKernel on by default).

Why these checks: users bring upstream YAMLs (`qwen3_8b_1tp.yaml`, ...), launch them with
`--yaml`, and toggle `enable_superkernel` wherever their YAML keeps it. Each check here runs the
real loader, registry, CLI or tool on such files.
"""

from __future__ import annotations

import difflib
import json
import subprocess
from pathlib import Path

import pytest

import tests.checkpoints as ckpt
from executor.cli import main as cli_main
from executor.config import ConfigError, load_config
from executor.registry import config_path, yamls

REPO = Path(__file__).resolve().parent.parent
UPSTREAM_DENSE = REPO / "models" / "qwen" / "config" / "qwen3_8b_1tp.yaml"
EAGER = ["--set", "model_config.exe_mode=eager", "--set", "model_config.enable_superkernel=false"]
EAGER += ["--set", "model_config.enable_cache_compile=false"]


def upstream_copy(tmp_path: Path, model_path: Path, source: Path = UPSTREAM_DENSE) -> Path:
    """The shipped upstream-shaped YAML with only its model_path line edited, as a user would."""
    lines = source.read_text().splitlines(keepends=True)
    edited = [f'  model_path: "{model_path}"\n' if ln.startswith("  model_path:") else ln for ln in lines]
    assert sum(a != b for a, b in zip(lines, edited)) == 1
    path = tmp_path / source.name
    path.write_text("".join(edited))
    return path


def test_upstream_dense_1tp_yaml_runs_unchanged_and_matches_transformers(tmp_path, qwen3_ckpt):
    config = upstream_copy(tmp_path, qwen3_ckpt)
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(REPO / "infer.sh"), "--config", str(config), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads((out / "metrics.json").read_text())
    assert (m["model_name"], m["exe_mode"]) == ("qwen3_8b", "ge_graph")
    assert m["superkernel"]["requested"] and m["superkernel"]["ran"]  # custom_params.enable_superkernel
    prompt = m["prompt_token_ids"][0]
    tokens = m["generated_token_ids"][0]
    assert len(tokens) == 256  # scheduler_config.max_new_tokens of the file
    ref = ckpt.load_reference(qwen3_ckpt)
    assert tokens == ckpt.reference_greedy(ref, prompt, len(tokens))
    assert "qwen3_8b inference time cost of decode is" in proc.stdout


def test_yaml_selects_from_the_recipe_config_dir():
    assert config_path("qwen") == REPO / "models/qwen/config/builtin.yaml"
    assert config_path("qwen", "qwen3_8b_1tp") == UPSTREAM_DENSE
    assert {"builtin.yaml", "qwen3_8b_1tp.yaml", "qwen3_8b_2tp.yaml"} <= set(yamls("qwen"))
    assert {"builtin.yaml", "qwen3_30b_a3b_1tp.yaml"} <= set(yamls("qwen3_moe"))
    with pytest.raises(ConfigError, match=r"--yaml nope\.yaml: models/qwen/config/ has no such file; it has: .*"):
        config_path("qwen", "nope.yaml")


def test_every_shipped_yaml_loads_or_names_what_is_missing(capsys):
    """Every shipped YAML parses with strict keys and a valid layout; one that needs more devices
    than this machine has stops before anything starts, with one line naming the key."""
    from executor.parallel.layout import cpu_cores

    for recipe in ("qwen", "qwen3_moe"):
        for name in yamls(recipe):
            cfg = load_config(config_path(recipe, name))
            if name == "builtin.yaml":  # the default is the optimized one
                mc = cfg.model_config
                assert (mc.exe_mode, cfg.superkernel_on, mc.enable_cache_compile) == ("ge_graph", True, True)
            world = cfg.parallel_config.world_size
            if world > cpu_cores():
                rc = cli_main(["run", "--model", recipe, "--yaml", name])
                err = capsys.readouterr().err
                assert rc == 2 and err.count("\n") == 1, err
                assert f"parallel_config.world_size: {world} is larger than the devices present" in err


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe,yaml_name,checkpoint",
    [("qwen", "qwen3_8b_2tp.yaml", "qwen3"), ("qwen3_moe", "qwen3_30b_a3b_1tp_2ep.yaml", "moe")],
)
def test_upstream_two_device_yaml_runs_unchanged_and_matches_transformers(
    tmp_path, qwen3_ckpt, recipe, yaml_name, checkpoint
):
    from executor.parallel.layout import cpu_cores

    """The 2-device YAMLs with only model_path edited, through infer.sh: two ranks (attention and
    lm_head TP 2; attention DP 2 + expert parallel 2), ge_graph + SuperKernel, 256 tokens per row
    equal to transformers'; rank 0 writes metrics.json with the layout, the others their logs."""
    path = (
        qwen3_ckpt if checkpoint == "qwen3" else ckpt.make_qwen3_moe_checkpoint(tmp_path / "moe", num_hidden_layers=1)
    )
    config = upstream_copy(tmp_path, path, REPO / "models" / recipe / "config" / yaml_name)
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(REPO / "infer.sh"), "--model", recipe, "--config", str(config), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads((out / "metrics.json").read_text())
    assert m["world_size"] == 2 and m["superkernel"]["ran"] and m["exe_mode"] == "ge_graph"
    layout = m["parallel"]
    pc = m["config"]["parallel_config"]
    assert (layout["attn_tp"], layout["moe_tp"], layout["lmhead_tp"]) == (
        pc["attn_tp_size"],
        pc["moe_tp_size"],
        pc["lmhead_tp_size"],
    )
    assert layout["backend"] == "gloo" and len(m["peak_memory_mb_per_rank"]) == 2
    assert m["threads_per_rank"] == [max(1, cpu_cores() // 2)] * 2  # the cores shared, not oversubscribed
    assert m["collectives_per_step"]["count"] > 0
    ref = ckpt.load_reference(path)
    rows = m["generated_token_ids"]
    assert len(rows) == m["batch_size"] == m["config"]["scheduler_config"]["batch_size"]
    for prompt, tokens in zip(m["prompt_token_ids"], rows):
        assert len(tokens) == 256
        assert tokens == ckpt.reference_greedy(ref, prompt, len(tokens))
    assert f"{m['model_name']} inference time cost of decode is" in proc.stdout
    assert (out / "rank_1.log").is_file() and "inference time cost of decode" in (out / "rank_1.log").read_text()
    assert "inference time cost of decode" not in proc.stderr


def test_switch_in_either_place_and_top_level_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "model_name: qwen3_8b\nworld_size: 1\nmodel_config:\n  exe_mode: ge_graph\n"
        "  custom_params: {enable_superkernel: true}\n"
    )
    cfg = load_config(path)
    assert cfg.superkernel_on and cfg.model_config.model_name == "qwen3_8b"
    assert cfg.model_config.enable_superkernel is None  # where the file keeps it is remembered
    path.write_text("model_name: a\nmodel_config:\n  model_name: b\n")
    with pytest.raises(ConfigError, match=r"top-level model_name: 'a' disagrees with model_config\.model_name: 'b'"):
        load_config(path)
    path.write_text("world_size: 2\nparallel_config: {world_size: 1}\n")
    with pytest.raises(ConfigError, match="top-level world_size: 2 disagrees"):
        load_config(path)


def test_duplicate_keys_name_both_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("model_config:\n  exe_mode: eager\n  seed: 1\n  exe_mode: ge_graph\n")
    with pytest.raises(ConfigError, match=r"key 'exe_mode' appears twice, on line 2 and line 4"):
        load_config(path)


@pytest.mark.parametrize(
    "content, needle",
    [
        (b"model_config:\n  model_name: \xff\xfe\n", "not UTF-8"),
        (None, "is a directory"),
    ],
)
def test_config_file_that_is_not_text_or_not_a_file(tmp_path, capsys, content, needle):
    path = tmp_path / "c.yaml"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    rc = cli_main(["run", "--config", str(path), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and str(path) in err and needle in err


def test_dataset_file_blank_or_not_utf8(tmp_path, capsys):
    for content, needle in ((b"\n  \n\n", "has no prompt"), (b"caf\xe9\n", "not UTF-8")):
        data = tmp_path / "prompts.txt"
        data.write_bytes(content)
        args = ["run", "--set", f"data_config.dataset={data}", *EAGER, "--out", str(tmp_path / "o")]
        rc = cli_main(args)
        err = capsys.readouterr().err
        assert rc == 2 and "data_config.dataset" in err and needle in err, err


def test_out_is_never_overwritten(tmp_path, capsys):
    args = ["run", *EAGER, "--set", "scheduler_config.max_new_tokens=2"]
    out = tmp_path / "out"
    assert cli_main([*args, "--out", str(out)]) == 0
    first = (out / "metrics.json").read_bytes()
    capsys.readouterr()
    assert cli_main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and str(out) in err
    assert (out / "metrics.json").read_bytes() == first
    afile = tmp_path / "file"
    afile.write_text("x")
    assert cli_main([*args, "--out", str(afile)]) == 2
    assert "is a file" in capsys.readouterr().err
    # model_config.output_path is where results go when --out is not given
    target = tmp_path / "via_output_path"
    assert cli_main([*args, "--set", f"model_config.output_path={target}"]) == 0
    assert (target / "metrics.json").is_file()


def test_sk_compare_toggles_only_the_switch_where_the_yaml_keeps_it(tmp_path, qwen3_ckpt, capsys):
    """As the sed workflow: the optimized side is the user's file (SuperKernel already on), the
    baseline differs in the custom_params.enable_superkernel line only; the user's file is untouched."""
    config = upstream_copy(tmp_path, qwen3_ckpt)
    before = config.read_bytes()
    line = "qwen3_8b inference time cost of decode is {} ms\\n"
    log = f"printf '{line.format('2.00')}{line.format('2.50')}'"
    out = tmp_path / "cmp"
    rc = cli_main(
        ["compare", "--config", str(config), "--out", str(out), "--runs", "1", "--warmup", "0"]
        + ["--cmd-baseline", log, "--cmd-optimized", log]
    )
    assert rc == 0, capsys.readouterr().err
    assert config.read_bytes() == before
    user = before.decode().splitlines()
    optimized = (out / "optimized.yaml").read_text().splitlines()
    baseline = (out / "baseline.yaml").read_text().splitlines()
    assert optimized == user
    changed = [ln for ln in difflib.unified_diff(user, baseline, lineterm="", n=0) if ln[:1] in "+-"][2:]
    assert changed == [
        "-    enable_superkernel: True  # [False, True] SuperKernel scopes in decode (ge_graph / npugraph_ex)",
        "+    enable_superkernel: False  # [False, True] SuperKernel scopes in decode (ge_graph / npugraph_ex)",
    ]


def test_infer_sh_yaml_option_lists_what_the_recipe_has(tmp_path):
    proc = subprocess.run(
        ["bash", str(REPO / "infer.sh"), "--model", "qwen3_moe", "--yaml", "qwen3_9b.yaml"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "builtin.yaml" in proc.stderr and "qwen3_30b_a3b_1tp.yaml" in proc.stderr
