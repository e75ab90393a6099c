"""Issue 15 through the real entry points: every bad input is one line (exit 2) naming the key or
file, memory is checked before it is spent, NaN/inf stops the run where it appears, and no
command overwrites another's results.

Runs go through executor.cli.main in this process (what infer.sh and the tools run), on eager
configs of tiny models, so the tables stay cheap; tests/test_config_cli.py holds the older
error-path table and the subprocess checks of infer.sh itself.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from executor.cli import main as cli_main
from executor.config import load_config
from executor.platform import detect
from models.qwen.models.runner_qwen import QwenRunner
from tests.test_config_cli import CompletedRun, assert_user_error
from tests.tool_fixtures import TINY_DENSE, TINY_MOE

REPO = Path(__file__).resolve().parent.parent
EAGER = ["--set", "model_config.exe_mode=eager", "--set", "model_config.enable_superkernel=false"]
EAGER += ["--set", "model_config.enable_cache_compile=false", "--set", "scheduler_config.max_new_tokens=4"]


def run(capsys, *argv: str) -> CompletedRun:
    rc = cli_main(list(argv))
    return CompletedRun(rc, capsys.readouterr())


def write_model(root: Path, config) -> Path:
    """A model directory holding only config.json (random weights), with `config` as its text or JSON."""
    root.mkdir(parents=True, exist_ok=True)
    text = config if isinstance(config, (str, bytes)) else json.dumps(config)
    (root / "config.json").write_bytes(text.encode() if isinstance(text, str) else text)
    return root


# ----------------------------------------------------------------------------- checkpoint config.json
CONFIG_JSON_CASES = {
    "not_an_object": ("[1, 2]", ["config.json", "must be a JSON object"]),
    "size_is_a_string": (dict(TINY_DENSE, hidden_size="64"), ["config.json", "hidden_size must be an integer", '"64"']),
    "size_is_a_float": (dict(TINY_DENSE, intermediate_size=128.0), ["intermediate_size must be an integer"]),
    "size_is_a_bool": (dict(TINY_DENSE, num_hidden_layers=True), ["num_hidden_layers must be an integer"]),
    "zero_heads": (dict(TINY_DENSE, num_attention_heads=0), ["num_attention_heads must be >= 1, got 0"]),
    "negative_layers": (dict(TINY_DENSE, num_hidden_layers=-1), ["num_hidden_layers must be >= 1, got -1"]),
    "heads_not_a_multiple": (dict(TINY_DENSE, num_key_value_heads=3), ["num_attention_heads 4", "multiple"]),
    "odd_head_dim": (dict(TINY_DENSE, head_dim=15), ["head_dim 15 must be even"]),
    "no_head_dim_and_hidden_not_divisible": (
        {k: v for k, v in dict(TINY_DENSE, hidden_size=66).items() if k != "head_dim"},
        ["hidden_size 66", "num_attention_heads 4"],
    ),
    "eps_not_a_number": (dict(TINY_DENSE, rms_norm_eps="1e-6"), ["rms_norm_eps must be a number"]),
    "theta_negative": (dict(TINY_DENSE, rope_theta=-1.0), ["rope_theta must be a finite number > 0"]),
    "tie_not_a_bool": (dict(TINY_DENSE, tie_word_embeddings="yes"), ["tie_word_embeddings must be true or false"]),
    "vocab_smaller_than_tokenizer": (dict(TINY_DENSE, vocab_size=100), ["vocab_size 100", "tokenizer's 512 ids"]),
    "missing_field": ({k: v for k, v in TINY_DENSE.items() if k != "vocab_size"}, ["'vocab_size' is missing"]),
    "not_utf8": (b'{"model_type": "qwen3\xff"}', ["config.json", "not UTF-8"]),
    "not_json": ('{"model_type": ', ["config.json", "not valid JSON"]),
}


@pytest.mark.parametrize("case", list(CONFIG_JSON_CASES))
def test_bad_checkpoint_config_json(case, tmp_path, capsys):
    content, needles = CONFIG_JSON_CASES[case]
    model = write_model(tmp_path / "model", content)
    out = tmp_path / "out"
    proc = run(capsys, "run", *EAGER, "--set", f"model_config.model_path={model}", "--out", str(out))
    assert_user_error(proc, *needles)
    assert not (out / "metrics.json").exists()


MOE_CASES = {
    "top_k_above_experts": (dict(TINY_MOE, num_experts_per_tok=8), ["num_experts_per_tok 8 is more than"]),
    "mlp_only_layer_out_of_range": (dict(TINY_MOE, mlp_only_layers=[3]), ["mlp_only_layers", "0..0"]),
    "zero_experts": (dict(TINY_MOE, num_experts=0), ["num_experts must be >= 1"]),
}


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_bad_moe_config_json(case, tmp_path, capsys):
    content, needles = MOE_CASES[case]
    model = write_model(tmp_path / "model", content)
    args = ["run", "--model", "qwen3_moe", *EAGER, "--set", f"model_config.model_path={model}"]
    assert_user_error(run(capsys, *args, "--out", str(tmp_path / "out")), *needles)


def test_model_path_file_and_config_json_directory(tmp_path, capsys):
    afile = tmp_path / "weights.bin"
    afile.write_bytes(b"x")
    out = str(tmp_path / "out")
    proc = run(capsys, "run", *EAGER, "--set", f"model_config.model_path={afile}", "--out", out)
    assert_user_error(proc, "model_config.model_path", str(afile), "is a file, not a checkpoint directory")
    (tmp_path / "ckpt" / "config.json").mkdir(parents=True)
    proc = run(capsys, "run", *EAGER, "--set", f"model_config.model_path={tmp_path / 'ckpt'}", "--out", out)
    assert_user_error(proc, "config.json", "is a directory")


# ----------------------------------------------------------------------------- memory
@pytest.fixture
def no_allocation(monkeypatch):
    """Fail the test if a run gets as far as allocating weights or the KV cache."""
    import executor.runner as runner_mod

    def forbidden(*args, **kwargs):
        raise AssertionError("the run allocated before its memory check stopped it")

    monkeypatch.setattr(runner_mod, "init_random", forbidden)
    monkeypatch.setattr(runner_mod, "load_weights", forbidden)
    monkeypatch.setattr(runner_mod, "KVCache", forbidden)


MEMORY_CASES = {
    "impossible_batch": (
        ["--set", "model_config.debug_size=qwen3-0.6b", "--set", "scheduler_config.batch_size=100000"],
        ["scheduler_config.batch_size 100000", "28 layers", "GB of host RAM", "available"],
    ),
    "impossible_max_new_tokens": (
        ["--set", "scheduler_config.max_new_tokens=1000000000"],
        ["scheduler_config.max_new_tokens 1000000000", "lower scheduler_config.batch_size"],
    ),
    "impossible_input_len": (
        ["--set", "data_config.input_truncated_len=1000000000"],
        ["data_config.input_truncated_len 1000000000", "KV cache"],
    ),
}


@pytest.mark.parametrize("case", list(MEMORY_CASES))
def test_memory_is_checked_before_it_is_spent(case, tmp_path, capsys, no_allocation):
    """The shipped default config (ge_graph + SuperKernel): stopped before any compile or allocation."""
    args, needles = MEMORY_CASES[case]
    out = tmp_path / "out"
    line = assert_user_error(run(capsys, "run", *args, "--out", str(out)), "memory: this run needs about", *needles)
    m = re.search(r"needs about ([\d.]+) (MB|GB) of host RAM but ([\d.]+) (MB|GB) is available", line)
    unit = {"MB": 2**20, "GB": 2**30}
    assert float(m[1]) * unit[m[2]] > float(m[3]) * unit[m[4]], line
    assert not (out / "metrics.json").exists()


def test_memory_estimate_counts_what_the_run_allocates(tmp_path):
    """The estimate's weights and KV cache equal the bytes the run really allocates."""
    model = write_model(tmp_path / "model", TINY_DENSE)
    cfg = load_config(
        None,
        [
            f"model_config.model_path={model}",
            "model_config.dtype=bfloat16",
            "scheduler_config.batch_size=3",
            "scheduler_config.max_new_tokens=5",
            "data_config.input_truncated_len=11",
        ],
    )
    runner = QwenRunner(cfg, detect("cpu"))
    est = runner.memory
    runner.prepare(3)
    assert est.kv_cache == runner.cache.nbytes() == 2 * 1 * 3 * 2 * (11 + 5) * 16 * 2
    assert est.weights == sum(p.numel() * p.element_size() for p in runner.model.parameters())
    assert est.checked and est.available > 0 and est.peak > est.needed


# ----------------------------------------------------------------------------- NaN / inf
def _poisoned_copy(src: Path, dst: Path, tensor: str, row: int | None = None) -> Path:
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    target = weights[tensor]
    if row is None:
        target[0, 0] = float("nan")
    else:
        target[row] = float("nan")
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_nan_weight_stops_at_prefill_naming_the_region(tmp_path, capsys, qwen3_ckpt):
    model = _poisoned_copy(qwen3_ckpt, tmp_path / "nan", "model.layers.1.mlp.down_proj.weight")
    out = tmp_path / "out"
    args = ["--set", f"model_config.model_path={model}", "--set", "model_config.with_ckpt=true"]
    proc = run(capsys, "run", *EAGER, *args, "--out", str(out))
    assert_user_error(proc, "NaN in the logits at prefill, row 0", "region layer_1_mlp", "(op linear)", str(model))
    assert not (out / "metrics.json").exists()


def test_nan_in_decode_names_the_step(tmp_path, capsys, qwen2_ckpt, make_qwen_runner):
    """An embedding row only decode reads (untied lm_head): prefill is clean, decode step 1 is not."""
    runner = make_qwen_runner(qwen2_ckpt, "model_config.exe_mode=eager", max_new_tokens=2)
    prompt = runner.encode_prompts()
    first = runner.generate(prompt, 1).token_ids[0][0]
    assert first not in prompt[0]
    model = _poisoned_copy(qwen2_ckpt, tmp_path / "nan", "model.embed_tokens.weight", row=first)
    args = ["--set", f"model_config.model_path={model}", "--set", "model_config.with_ckpt=true"]
    proc = run(capsys, "run", *EAGER, *args, "--out", str(tmp_path / "out"))
    assert_user_error(proc, "NaN in the logits at decode step 1, row 0", "outside every layer region", "embedding")


# ----------------------------------------------------------------------------- scopes, cache, output
def test_requested_scope_that_opens_nothing_is_refused_before_the_run(tmp_path, capsys, no_allocation):
    sk = ["--set", "model_config.superkernel.plan=custom"]
    cases = {
        "model_config.superkernel.custom=[{regions: [], label: a}]": ["custom[0].regions", "at least one region"],
        "model_config.superkernel.custom=[{regions: [layer_99_*], label: a}]": ["'layer_99_*' matches no region"],
    }
    for custom, needles in cases.items():
        proc = run(capsys, "run", *sk, "--set", custom, "--out", str(tmp_path / "out"))
        assert_user_error(proc, *needles)


def test_cache_dir_that_is_a_file_or_cannot_be_created(tmp_path, capsys, no_allocation):
    afile = tmp_path / "cache_file"
    afile.write_text("x")
    for cache, needle in ((afile, "is a file"), (afile / "sub", "cannot be created")):
        proc = run(capsys, "run", "--set", f"model_config.cache_dir={cache}", "--out", str(tmp_path / "out"))
        assert_user_error(proc, f"model_config.cache_dir {cache}", needle)
    assert afile.read_text() == "x"


def test_out_that_cannot_be_written_or_holds_another_commands_results(tmp_path, capsys):
    afile = tmp_path / "file"
    afile.write_text("x")
    assert_user_error(run(capsys, "run", *EAGER, "--out", str(afile / "sub")), "--out", "cannot be written")
    other = tmp_path / "compare"
    other.mkdir()
    (other / "results.json").write_text("{}")
    assert_user_error(run(capsys, "run", *EAGER, "--out", str(other)), "sk_compare report", "results.json")
    assert (other / "results.json").read_text() == "{}" and not (other / "metrics.json").exists()


def test_prompt_cut_is_logged_and_recorded(tmp_path, capsys):
    out = tmp_path / "out"
    long_prompt = "The weather today is " * 8
    args = ["--set", f"data_config.prompts=[{long_prompt!r}]", "--set", "data_config.input_truncated_len=6"]
    assert run(capsys, "run", *EAGER, *args, "--out", str(out)).returncode == 0
    cut = json.loads((out / "metrics.json").read_text())["prompt_truncation"]
    assert cut[0]["kept"] == 6 and cut[0]["given"] > 6
    assert f"prompt 0: {cut[0]['given']} tokens, kept the last 6" in (out / "infer.log").read_text()


def test_first_bad_row():
    """The per-step check (one sum) finds NaN, +inf and -inf, names the first bad row, and does
    not mistake finite logits whose sum overflows for non-finite ones."""
    from executor.numerics import first_bad_row

    logits = torch.zeros(3, 7)
    assert first_bad_row(logits) is None
    for value, row in ((float("-inf"), 2), (float("inf"), 1), (float("nan"), 0)):
        logits[row, 5] = value
        assert first_bad_row(logits) == row
    assert first_bad_row(torch.full((2, 4), 3e38)) is None  # the sum is inf, every logit is finite
