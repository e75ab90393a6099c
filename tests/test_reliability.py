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

from executor.backends import packed_linear
from executor.cli import main as cli_main
from executor.config import load_config
from executor.platform import detect
from models.qwen.models.runner_qwen import QwenRunner
from tests.test_config_cli import CompletedRun, assert_user_error
from tests.tool_fixtures import TINY_DENSE, TINY_MOE, recipe_config

REPO = Path(__file__).resolve().parent.parent
EAGER = ["--set", "model_config.exe_mode=eager", "--set", "model_config.enable_superkernel=false"]
EAGER += ["--set", "model_config.enable_cache_compile=false", "--set", "scheduler_config.max_new_tokens=4"]
# The default YAML loads the built-in checkpoint; the model directories written here hold only
# config.json (seeded random weights), so the runs below turn with_ckpt off (a test may turn it on).
EAGER += ["--set", "model_config.with_ckpt=false"]


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


DEBUG_SIZE = ["--set", 'model_config.model_path=""', "--set", "model_config.with_ckpt=false"]  # debug_size applies
MEMORY_CASES = {
    "impossible_batch": (
        [*DEBUG_SIZE, "--set", "model_config.debug_size=qwen3-0.6b", "--set", "scheduler_config.batch_size=100000"],
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


def test_memory_estimate_counts_the_packed_weights_of_a_batched_cpu_graph(tmp_path):
    """With more than one row per decode step, a CPU graph keeps a oneDNN-packed copy of its large
    weights (executor.backends.packed_linear): the estimate adds one more copy of the weights."""
    model = write_model(tmp_path / "model", TINY_DENSE)

    def estimate(*overrides: str):
        cfg = load_config(None, [f"model_config.model_path={model}", "model_config.exe_mode=ge_graph", *overrides])
        return QwenRunner(cfg, detect("cpu")).memory

    one, two = estimate("scheduler_config.batch_size=1"), estimate("scheduler_config.batch_size=2")
    assert two.compile - one.compile == two.weights
    # bf16: oneDNN's copy where it runs bf16 natively, the kernel's where it does not (an AVX2 CPU)
    bf16 = [estimate(f"scheduler_config.batch_size={b}", "model_config.dtype=bfloat16") for b in (1, 2)]
    packed = packed_linear.packs(torch.bfloat16, 2)
    assert bf16[1].compile - bf16[0].compile == (bf16[1].weights if packed else 0)
    if torch.cpu._is_avx2_supported():
        assert packed


GARBAGE_HELD_CODE = """
import gc, sys, torch, executor
from executor import memory, preflight
from executor.config import load_config
from executor.platform import detect
from models.qwen.models.runner_qwen import QwenRunner

gc.disable()  # only the check may collect
base = [f"model_config.model_path={sys.argv[1]}", "model_config.with_ckpt=false", "model_config.exe_mode=eager",
        "model_config.enable_superkernel=false", "scheduler_config.max_new_tokens=4",
        "data_config.input_truncated_len=12"]
runner = QwenRunner(load_config(None, base), detect("cpu"))
params = memory.count_parameters(runner.model)
garbage = [torch.ones(1 << 28)]  # 1 GiB, freed below but held by a reference cycle
garbage.append(garbage)
del garbage

def config(rows):
    cfg = load_config(None, base + [f"scheduler_config.batch_size={rows}"])
    return cfg, memory.estimate(runner.arch, cfg, "cpu", params, runner.dtype)

def over(rows):  # needs more than is free, by half the garbage or more
    est = config(rows)[1]
    return est.needed_here > est.available + (1 << 29)

lo, hi = 1, 2
while not over(hi):
    lo, hi = hi, 2 * hi
while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (lo, mid) if over(mid) else (mid, hi)
cfg, est = config(hi)
print(est.needed_here - est.available >> 20)
print(preflight.check(runner, cfg, detect("cpu"), runner.dtype).memory.source)
"""


def test_the_memory_check_collects_garbage_before_it_refuses(tmp_path):
    """A freed runner is held by reference cycles (its bound methods, a compiled graph's objects)
    until the collector's rare full pass, so its memory looked taken: decode_bench's batch sweep
    was refused its batch 64 with 6.4 of 23 GB said to be free. A run that does not fit is
    estimated again after a full collection: here 1 GiB held by a cycle, and a run needing
    half of it more than was free, fits."""
    import subprocess
    import sys

    model = write_model(tmp_path / "model", TINY_DENSE)
    out = subprocess.run(
        [sys.executable, "-c", GARBAGE_HELD_CODE, str(model)], cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    short_mb, source = out.stdout.strip().splitlines()[-2:]
    # refused had the garbage stayed; fits once its 1 GiB is free (with room for MemAvailable's moves)
    assert 128 <= int(short_mb) < 896, short_mb
    assert "read after a full garbage collection" in source, source


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
    args += ["--set", f"data_config.prompts={json.dumps(runner.prompts()[:1])}"]  # the prompt `first` came from
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


def test_two_runs_started_in_the_same_second_get_their_own_default_directories(tmp_path, capsys, monkeypatch):
    """The default `models/<recipe>/res/<date>/<case>_<HHMMSS>/` is reserved when it is named, so
    two commands in the same second (a script, two test workers) do not meet in one directory
    (the second used to be refused); a results tree that cannot be written is one line."""
    import datetime

    import executor.paths as paths

    monkeypatch.setattr(paths, "MODELS_DIR", tmp_path / "models")
    now = datetime.datetime(2025, 1, 2, 3, 4, 5)
    first, second, third = (paths.results_dir("qwen", "eager_nosk", now) for _ in range(3))
    day = tmp_path / "models" / "qwen" / "res" / "2025-01-02"
    assert [first, second, third] == [
        day / "eager_nosk_030405",
        day / "eager_nosk_030405_2",
        day / "eager_nosk_030405_3",
    ]
    assert all(d.is_dir() and not any(d.iterdir()) for d in (first, second, third))
    # two runs of the CLI with no --out: each has its own directory and its own metrics.json
    for _ in range(2):
        assert run(capsys, "run", *EAGER).returncode == 0
    made = sorted((tmp_path / "models" / "qwen" / "res").glob("*/eager_nosk_*/metrics.json"))
    assert len(made) == 2
    blocked = tmp_path / "blocked"
    blocked.write_text("x")
    monkeypatch.setattr(paths, "MODELS_DIR", blocked)
    proc = run(capsys, "run", *EAGER)
    assert_user_error(proc, str(blocked / "qwen" / "res"), "cannot be created", "--out")


def test_longbench_dataset_path_that_is_a_file(tmp_path, capsys):
    afile = tmp_path / "LongBench.jsonl"
    afile.write_text('{"context": "x"}\n')
    args = ["--set", "data_config.dataset=LongBench", "--set", f"data_config.dataset_path={afile}"]
    proc = run(capsys, "run", *EAGER, *args, "--out", str(tmp_path / "out"))
    assert_user_error(proc, "data_config.dataset_path", str(afile), "is a file")


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


# ----------------------------------------------------------------------------- sk_compare
@pytest.fixture
def tool_config(tmp_path, shared_dir) -> Path:
    return recipe_config(tmp_path / "recipe.yaml", shared_dir / "tiny_dense", shared_dir / "compile_cache")


def upstream_log(path: Path, steps: list[float], extra: tuple[str, ...] = ()) -> Path:
    """A cann-recipes-infer log: logger prefixes, a prefill line, one line per decode step."""
    lines = ["[2025-06-01 10:00:00] [INFO] [rank 0] loading weights ..."]
    lines += ["[2025-06-01 10:00:01] [INFO] [rank 0] qwen3_8b inference time cost of prefill is 41.12 ms"]
    lines += [
        f"[2025-06-01 10:00:02] [INFO] [rank 0] qwen3_8b inference time cost of decode is {x:.2f} ms" for x in steps
    ]
    path.write_text("\n".join([*lines, *extra]) + "\n")
    return path


def steady(ms: float, n: int = 64) -> list[float]:
    """n decode steps around `ms` with a deterministic spread of +-0.2% (well under 1%)."""
    return [ms * (1 + 0.001 * ((i * 7) % 5 - 2)) for i in range(n)]


BAD_TIMINGS = {
    "negative": ("qwen3_8b inference time cost of decode is -1.50 ms", "-1.5 is not a positive time"),
    "zero": ("qwen3_8b inference time cost of decode is 0.00 ms", "0 is not a positive time"),
    "infinite": ("qwen3_8b inference time cost of decode is inf ms", "'inf' is not a number"),
    "overflow": ("qwen3_8b inference time cost of decode is 1e999 ms", "inf is not a positive time"),
    "nan": ("qwen3_8b inference time cost of decode is nan ms", "'nan' is not a number"),
    "zero_average": ("qwen3_8b average inference time cost is 0 ms", "0 is not a positive time"),
}


@pytest.mark.parametrize("case", list(BAD_TIMINGS))
def test_from_logs_rejects_unusable_timings_with_file_and_line(case, tmp_path, capsys, tool_config):
    line, needle = BAD_TIMINGS[case]
    base = upstream_log(tmp_path / "base.log", steady(15.47, 8))
    opt = upstream_log(tmp_path / "opt.log", steady(13.01, 8))
    text = opt.read_text().splitlines()
    opt.write_text("\n".join([*text[:3], line, *text[3:], line]) + "\n")  # line 4 and the last line
    out = tmp_path / "cmp"
    args = ["compare", "--config", str(tool_config), "--from-logs", str(base), str(opt), "--out", str(out)]
    assert_user_error(run(capsys, *args), f"{opt}:4", needle, "2 such lines")
    assert not (out / "results.json").exists()


def test_from_logs_directory_is_not_a_missing_file(tmp_path, capsys, tool_config):
    good = upstream_log(tmp_path / "good.log", steady(10.0, 8))
    args = ["compare", "--config", str(tool_config), "--from-logs", str(tmp_path), str(good)]
    assert_user_error(run(capsys, *args, "--out", str(tmp_path / "o")), str(tmp_path), "is a directory")


def test_from_logs_one_run_a_side_judged_from_the_steps(tmp_path, capsys, tool_config):
    """The issue's upstream example: 64 steps a side, 15.47 vs 13.01 ms/step, spread well under 1%."""
    base = upstream_log(tmp_path / "base.log", steady(15.47) + [40.0], ("done",))  # one outlier, two plain lines
    opt = upstream_log(tmp_path / "opt.log", steady(13.01))
    out = tmp_path / "clear"
    proc = run(capsys, "compare", "--config", str(tool_config), "--from-logs", str(base), str(opt), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    res = json.loads((out / "results.json").read_text())
    s = res["summary"]
    assert s["exceeds_noise"] is True and s["noise_method"].startswith("per-step bootstrap (64 vs 64 decode steps")
    assert s["speedup"] == pytest.approx(15.47 / 13.01, rel=2e-3)
    assert "beyond the noise" in res["conclusion"] and "1.19x" in res["conclusion"]
    assert "does not exceed" not in res["conclusion"]
    assert "decided by per-step bootstrap" in (out / "superkernel_optimization_report.md").read_text()
    # how many lines were left out, and why
    assert f"baseline: {base}: 65 per-step decode line(s), 1 left out as outliers (IQR rule), 2 line(s)" in proc.stdout
    # genuinely overlapping samples: the same step times in another order, 0.01 ms apart
    noisy = [10.0 + 0.4 * ((i * 7) % 11 - 5) / 5 for i in range(64)]
    base = upstream_log(tmp_path / "base2.log", noisy)
    opt = upstream_log(tmp_path / "opt2.log", [noisy[(i * 13) % 64] + 0.01 for i in range(64)])
    out = tmp_path / "noise"
    proc = run(capsys, "compare", "--config", str(tool_config), "--from-logs", str(base), str(opt), "--out", str(out))
    res = json.loads((out / "results.json").read_text())
    assert proc.returncode == 0 and res["summary"]["exceeds_noise"] is False
    assert "does not exceed the noise" in res["conclusion"] and "per-step bootstrap" in res["conclusion"]


def _no_runs(out: Path) -> bool:
    return not list(out.glob("*.log")) and not (out / "runs").exists() and not (out / "results.json").exists()


SK_COMPARE_PREFLIGHT = {
    "plan_moe_on_dense": (["--plan", "moe"], ["'moe' marks no region"]),
    "empty_model_name": (["--set", "model_config.model_name="], ["model_config.model_name", "empty"]),
    "impossible_batch": (["--set", "scheduler_config.batch_size=100000000"], ["memory:", "batch_size 100000000"]),
    "bad_custom_plan": (["--plan", "custom"], ["model_config.superkernel.custom", "custom"]),
}


@pytest.mark.parametrize("case", list(SK_COMPARE_PREFLIGHT))
def test_sk_compare_validates_both_sides_before_running_anything(case, tmp_path, capsys, tool_config):
    args, needles = SK_COMPARE_PREFLIGHT[case]
    out = tmp_path / "cmp"
    proc = run(capsys, "compare", "--config", str(tool_config), *args, "--out", str(out))
    assert_user_error(proc, *needles)
    assert _no_runs(out), list(out.iterdir())


def test_sk_compare_cache_dir_and_out_that_cannot_be_used(tmp_path, capsys, tool_config):
    afile = tmp_path / "file"
    afile.write_text("x")
    base = ["compare", "--config", str(tool_config)]
    proc = run(capsys, *base, "--set", f"model_config.cache_dir={afile}", "--out", str(tmp_path / "c1"))
    assert_user_error(proc, "model_config.cache_dir", "is a file")
    assert _no_runs(tmp_path / "c1")
    assert_user_error(run(capsys, *base, "--out", str(afile)), "--out", "is a file")
    assert_user_error(run(capsys, *base, "--out", str(afile / "sub")), "--out", "cannot be written")
    run_dir = tmp_path / "a_run"
    run_dir.mkdir()
    (run_dir / "metrics.json").write_text("{}")
    assert_user_error(run(capsys, *base, "--out", str(run_dir)), "a run of bash infer.sh", "metrics.json")
    assert afile.read_text() == "x" and (run_dir / "metrics.json").read_text() == "{}"


# ----------------------------------------------------------------------------- scope_search
SPACE = "builtin_plans: [attention, decoder]\n"
BAD_SPACES = {
    "malformed": ("builtin_plans: [attention\n", ["malformed YAML", "line"]),
    "not_a_mapping": ("- attention\n", ["top level must be a mapping"]),
    "duplicate_key": ("builtin_plans: [attention]\nbuiltin_plans: [layer]\n", ["'builtin_plans' appears twice"]),
    "plans_not_a_list": ("builtin_plans: attention\n", ["builtin_plans: expected a list"]),
    "variants_not_a_mapping": ("option_variants: [stream-fusion=1]\n", ["option_variants: expected a mapping"]),
    "variant_not_a_string": ("option_variants: {cpu: [1]}\n", ["option_variants.cpu", "options strings"]),
    "custom_name_not_a_string": ("custom: [{name: [a], scopes: [{regions: [x], label: y}]}]\n", ["custom[0]"]),
    "not_utf8": (b"builtin_plans: [\xff]\n", ["not UTF-8"]),
    "directory": (None, ["is a directory"]),
}


@pytest.mark.parametrize("case", list(BAD_SPACES))
def test_bad_search_space(case, tmp_path, capsys, tool_config):
    content, needles = BAD_SPACES[case]
    space = tmp_path / "space.yaml"
    if content is None:
        space.mkdir()
    else:
        space.write_bytes(content.encode() if isinstance(content, str) else content)
    out = tmp_path / "search"
    proc = run(capsys, "search", "--config", str(tool_config), "--search-space", str(space), "--out", str(out))
    assert_user_error(proc, str(space), *needles)
    assert not out.exists()


def test_search_out_that_cannot_be_used(tmp_path, capsys, tool_config):
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    afile = tmp_path / "file"
    afile.write_text("x")
    run_dir = tmp_path / "a_run"
    run_dir.mkdir()
    (run_dir / "metrics.json").write_text("{}")
    base = ["search", "--config", str(tool_config), "--search-space", str(space)]
    for out, needle in (
        (afile, "is a file"),
        (afile / "sub", "cannot be written"),
        (run_dir, "a run of bash infer.sh"),
    ):
        assert_user_error(run(capsys, *base, "--out", str(out)), "--out", needle)
    assert afile.read_text() == "x" and sorted(p.name for p in run_dir.iterdir()) == ["metrics.json"]


@pytest.mark.parametrize(
    "override, needles",
    [
        ("scheduler_config.batch_size=100000000", ["memory:", "batch_size 100000000"]),
        ("model_config.cache_dir={file}", ["model_config.cache_dir", "is a file"]),
    ],
)
def test_search_checks_what_every_candidate_shares_before_running_anything(
    override, needles, tmp_path, capsys, tool_config
):
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    afile = tmp_path / "file"
    afile.write_text("x")
    out = tmp_path / "search"
    args = ["search", "--config", str(tool_config), "--search-space", str(space), "--out", str(out)]
    proc = run(capsys, *args, "--set", override.format(file=afile))
    assert_user_error(proc, *needles)
    assert not (out / "search_status.json").exists() and not (out / "logs").exists()


@pytest.fixture
def searched(tmp_path, capsys, tool_config, monkeypatch):
    """A search whose eager reference ran but no candidate did (--max-minutes 0), in a results
    tree of its own (MODELS_DIR patched) so that --resume looks there."""
    import tools.scope_search as scope_search

    models = tmp_path / "models"
    monkeypatch.setattr(scope_search, "MODELS_DIR", models)
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    out = models / "qwen" / "res" / "2025-01-01" / "scope_search_000000"
    common = ["--config", str(tool_config), "--search-space", str(space), "--runs", "1", "--warmup", "0"]
    proc = run(capsys, "search", *common, "--out", str(out), "--max-minutes", "0")
    assert proc.returncode == 1 and "unfinished" in proc.stdout, proc.stderr
    return out, common, scope_search


def test_killed_search_says_unfinished_and_resume_finds_it(searched, capsys, monkeypatch):
    out, common, scope_search = searched
    on_disk = []

    def killed(search, cand, rec, position):  # what kill -9 at this moment leaves is what is on disk now
        on_disk.append(json.loads((out / "search_status.json").read_text()))
        raise KeyboardInterrupt

    monkeypatch.setattr(scope_search, "run_candidate", killed)
    assert run(capsys, "search", *common, "--out", str(out)).returncode == 130
    left = on_disk[0]
    assert left["state"] == "running" and left["candidates"]["baseline"]["status"] == "running"
    for state in ("running", "complete"):  # this version's kill -9 state, and an older version's
        left["state"] = state
        (out / "search_status.json").write_text(json.dumps(left))
        proc = run(capsys, "search", *common, "--resume", "--max-minutes", "0")  # no --out: found by --resume
        assert proc.returncode == 1, proc.stderr
        assert f"resuming {out}: 0 of 3 candidate(s) already finished" in proc.stderr
        status = json.loads((out / "search_status.json").read_text())
        assert status["state"] == "budget" and status["candidates"]["baseline"]["status"] == "pending"


def _finish(out: Path, step_ms: dict[str, float]) -> None:
    """Record every candidate as measured (one run each, 16 per-step samples spread +-0.2%), as a
    finished search would have, so that --apply decides on known numbers."""
    path = out / "search_status.json"
    status = json.loads(path.read_text())
    for name, rec in status["candidates"].items():
        ms = step_ms[name]
        samples = steady(ms, 16)
        summary = {"runs": 1, "ok_runs": 1, "failed_runs": 0, "errors": [], "step_ms": ms, "step_ms_runs": [ms]}
        summary |= {"step_ms_samples": samples, "step_ms_min": ms, "step_ms_max": ms, "cv_percent": 0.0}
        summary |= {"stability": "unknown (1 run)", "tokens_per_s": 1000 / ms, "prefill_ms": 1.0, "peak_memory_mb": 1}
        accuracy = {"passed": True, "first_mismatch": None, "cosine_last_step": 1.0}
        rec.update(status="done", reason="ok", summary=summary, accuracy=accuracy)
    status["state"] = "complete"
    path.write_text(json.dumps(status))


def test_apply_never_writes_a_plan_slower_than_the_baseline(searched, capsys, tool_config):
    out, common, _ = searched
    before = tool_config.read_bytes()
    _finish(out, {"baseline": 2.0, "attention": 4.2, "decoder": 4.17})  # the best plan is 0.48x the baseline
    proc = run(capsys, "search", *common, "--out", str(out), "--apply")
    assert proc.returncode == 1
    refusal = [ln for ln in proc.stderr.splitlines() if "--apply" in ln]
    assert len(refusal) == 1 and "refused" in refusal[0] and "decoder" in refusal[0]
    assert "slower than the no-SuperKernel baseline" in refusal[0] and "per-step bootstrap" in refusal[0]
    assert tool_config.read_bytes() == before and not list(tool_config.parent.glob("*.bak-*"))
    report = (out / "scope_search_report.md").read_text()
    assert "--apply refuses to write it" in report and "0.48x" in report
    status = json.loads((out / "search_status.json").read_text())
    assert status["winner"] == "decoder" and status["apply_refused"]


def test_apply_writes_a_plan_not_slower_than_the_baseline(searched, capsys, tool_config):
    out, common, _ = searched
    _finish(out, {"baseline": 4.0, "attention": 3.0, "decoder": 3.5})
    proc = run(capsys, "search", *common, "--out", str(out), "--apply")
    assert proc.returncode == 0, proc.stderr
    assert "--apply: wrote attention" in proc.stdout
    mc = load_config(tool_config).model_config
    assert mc.superkernel_enabled and mc.superkernel.plan == "attention"
