"""Two ranks for real (torchrun, gloo, fp32) against one device and against transformers.

Why: tensor, expert and attention data parallelism are only right if two processes exchanging
partial results produce the one-device model's tokens and logits. Every layout and mode runs
through the production path (tools.measure.generate_ranks: torchrun -> tools/rank_generate.py
-> the recipe runner), all in one torchrun job so the ranks start (and import torch) once.
World size 1 and HF transformers run here, in the test process, on the same checkpoints.

Also here: a failing rank (a user error, and a rank killed mid-run) ends the whole job with
that rank's one line, never a hang.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tests.checkpoints as ckpt
from executor.config import load_config
from executor.platform import detect
from executor.registry import default_config, runner_class
from tests.tool_fixtures import DENSE_TP, MOE_DP, sk, world2
from tools.measure import generate_ranks

REPO = Path(__file__).resolve().parent.parent
NEW = 8
PROMPTS = [[7, 42, 133, 250, 9, 311, 77, 400, 15], [5, 99, 301]]  # rows of different lengths (padding)
EAGER = ["model_config.exe_mode=eager", "model_config.enable_superkernel=false"]
GRAPH = ["model_config.exe_mode=ge_graph", "model_config.enable_superkernel=false"]

MOE_TP = world2("attn_tp_size=2", "moe_tp_size=2", "lmhead_tp_size=2", "embed_tp_size=2")  # experts' halves

# name -> (recipe, checkpoint fixture, layout, mode, expected collectives per decode step)
JOBS = {
    "dense_tp_eager": ("qwen", "qwen3", DENSE_TP, EAGER, {"all_reduce": 4, "all_gather": 1}),
    "dense_tp_graph": ("qwen", "qwen3", DENSE_TP, GRAPH, {"all_reduce": 4, "all_gather": 1}),
    "dense_tp_sk_decoder": ("qwen", "qwen3", DENSE_TP, sk("decoder"), {"all_reduce": 4, "all_gather": 1}),
    # q/k/v biases split with their heads; vocabulary-parallel embedding (one more all-reduce)
    "qwen2_tp_eager": ("qwen", "qwen2", world2("attn_tp_size=2", "embed_tp_size=2"), EAGER, {"all_reduce": 5}),
    # one KV head for two attention ranks: replicated, not split
    "kv1_tp_eager": ("qwen", "kv1", DENSE_TP, EAGER, {"all_reduce": 4, "all_gather": 1}),
    "moe_tp_eager": ("qwen3_moe", "moe", MOE_TP, EAGER, {"all_reduce": 3, "all_gather": 1}),
    "moe_tp_graph": ("qwen3_moe", "moe", MOE_TP, GRAPH, {"all_reduce": 3, "all_gather": 1}),
    "moe_tp_sk_decoder": ("qwen3_moe", "moe", MOE_TP, sk("decoder"), {"all_reduce": 3, "all_gather": 1}),
    "moe_dp_eager": ("qwen3_moe", "moe", MOE_DP, EAGER, {"all_reduce": 2}),  # token gather + combine
    "moe_dp_sk_moe": ("qwen3_moe", "moe", MOE_DP, sk("moe"), {"all_reduce": 2}),
    "moe_dp_sk_decoder": ("qwen3_moe", "moe", MOE_DP, sk("decoder"), {"all_reduce": 2}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, qwen2_ckpt, qwen3_ckpt) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("rank_ckpts")
    return {
        "qwen2": qwen2_ckpt,
        "qwen3": qwen3_ckpt,
        "kv1": ckpt.make_qwen3_checkpoint(tmp / "kv1", num_key_value_heads=1, seed=5),
        "moe": ckpt.make_qwen3_moe_checkpoint(tmp / "moe", num_hidden_layers=1, seed=2),
    }


def overrides(path: Path, layout: list[str], mode: list[str], cache: Path) -> list[str]:
    common = [
        f"model_config.model_path={path}",
        "model_config.with_ckpt=true",
        f"scheduler_config.max_new_tokens={NEW}",
    ]
    common += ["scheduler_config.batch_size=2", "data_config.input_truncated_len=16", f"model_config.cache_dir={cache}"]
    cache_on = "model_config.exe_mode=eager" not in mode
    return [*common, f"model_config.enable_cache_compile={'true' if cache_on else 'false'}", *layout, *mode]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, checkpoints) -> dict[str, dict]:
    """Every job of JOBS on 2 ranks, one torchrun job; rank 0's result per job."""
    work = tmp_path_factory.mktemp("ranks")
    jobs = [
        {
            "model": recipe,
            "config": str(default_config(recipe)),
            "overrides": overrides(checkpoints[ck], layout, mode, work / "compile_cache"),
            "tokens": NEW,
            "prompt_ids": PROMPTS,
        }
        for recipe, ck, layout, mode, _ in JOBS.values()
    ]
    before = signal.getsignal(signal.SIGINT)
    results = generate_ranks(jobs, 2, detect("cpu"), work)
    assert signal.getsignal(signal.SIGINT) is before  # torchrun's handlers do not outlive the launch
    return dict(zip(JOBS, results))


@pytest.fixture(scope="module")
def one_device(checkpoints) -> dict[str, dict]:
    """World size 1, eager, same checkpoints and prompts, and transformers' greedy tokens per row."""
    out = {}
    for name, recipe in (("qwen2", "qwen"), ("qwen3", "qwen"), ("kv1", "qwen"), ("moe", "qwen3_moe")):
        cfg = load_config(default_config(recipe), overrides(checkpoints[name], [], EAGER, Path("/nonexistent")))
        runner = runner_class(recipe)(cfg, detect("cpu"), None, io.StringIO())
        gen = runner.generate(PROMPTS, NEW)
        ref = ckpt.load_reference(checkpoints[name])
        hf = [ckpt.reference_greedy(ref, p, NEW) for p in PROMPTS]
        shapes = {k: tuple(v.shape) for k, v in runner.model.state_dict().items()}
        out[name] = {"gen": gen, "hf": hf, "runner": runner, "shapes": shapes}
    return out


def cosines(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    return F.cosine_similarity(a.double(), b.double(), dim=-1).tolist()


@pytest.mark.parametrize("name", list(JOBS))
def test_two_ranks_match_one_device_and_transformers(ranks, one_device, name):
    _, ck, _, mode, collectives = JOBS[name]
    got, ref = ranks[name], one_device[ck]
    assert got["token_ids"] == ref["hf"] == ref["gen"].token_ids
    assert all(len(set(row)) > 2 for row in got["token_ids"])  # not degenerate: the check means something
    for ours, theirs in ((got["first_logits"], ref["gen"].first_logits), (got["last_logits"], ref["gen"].last_logits)):
        assert ours.shape == theirs.shape == (2, 512)
        assert min(cosines(ours, theirs)) > 0.9999
    assert got["collectives_per_step"]["by_op"] == collectives
    if "model_config.exe_mode=ge_graph" in mode:
        assert (got["graphs"], got["recompiles"]) == (1, 0)  # one decode graph, collectives inside


@pytest.mark.parametrize("name", [n for n in JOBS if "_sk_" in n])
def test_superkernel_scopes_hold_their_all_reduces(ranks, name):
    """Every scope stays one CPU launch unit with its all-reduces inside (no cut), every step."""
    got = ranks[name]
    assert got["superkernel_ran"]
    for scope in got["scopes"]:
        assert scope["segments"] == 1 and not scope["cut_reasons"], scope
        assert scope["collectives"] >= 1 and scope["launches"] == NEW - 1, scope


def test_moe_batch_rows_pick_different_experts(one_device):
    """The DP 2 + EP 2 rows run on different ranks and route to experts held by both ranks, so
    the dispatch really crosses ranks (routing of the MoE block's real input, one device)."""
    from executor.kv_cache import KVCache
    from executor.scope import PREFILL_SCOPES

    runner = one_device["moe"]["runner"]
    block, seen = runner.model.layers[0].mlp, []
    hook = block.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        with torch.no_grad():
            for prompt in PROMPTS:
                cache = KVCache(1, 1, runner.arch.num_kv_heads, 32, runner.arch.head_dim, torch.float32)
                runner.model(torch.tensor([prompt]), torch.arange(len(prompt)).view(1, -1), cache, PREFILL_SCOPES)
    finally:
        hook.remove()
    with torch.no_grad():
        chosen = [{e for row in block.route(x[0])[1].tolist() for e in row} for x in seen]
    assert chosen[0] != chosen[1]
    assert all(c & set(range(4)) and c & set(range(4, 8)) for c in chosen), chosen


@pytest.mark.parametrize(
    "name,halved",
    [
        ("dense_tp_graph", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"]),
        ("moe_tp_graph", ["qkv_proj", "o_proj", "experts_gate_up", "experts_down", "embed_tokens", "lm_head"]),
        ("moe_dp_eager", ["experts_gate_up", "experts_down"]),  # attention replicated: data parallel
    ],
)
def test_each_rank_holds_its_share_of_the_weights(ranks, one_device, name, halved):
    """The split parameters are half their one-device size on each rank, the rest replicated, and
    both ranks hold the same number of bytes; the pre-flight's memory estimate of a rank (made
    before anything was allocated) is exactly its weights and KV cache."""
    got, whole = ranks[name], one_device[JOBS[name][1]]["shapes"]
    assert set(got["param_shapes"]) == set(whole)
    for param, shape in got["param_shapes"].items():
        n, n_full = torch.Size(shape).numel(), torch.Size(whole[param]).numel()
        split = any(f"{part}." in param or param.endswith(part) for part in halved)
        assert n * (2 if split else 1) == n_full, (param, shape, whole[param])
    assert len(set(got["param_bytes_per_rank"])) == 1
    whole_runner = one_device[JOBS[name][1]]["runner"]
    for param_bytes, memory in zip(got["param_bytes_per_rank"], got["memory_per_rank"]):
        assert memory["weights"] == param_bytes < whole_runner.memory.weights
        assert memory["kv_cache"] == memory["kv_cache_allocated"] == whole_runner.memory.kv_cache // 2


# ----------------------------------------------------------------------------- failures
def infer(*args: str, tmpdir: Path | None = None, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONWARNINGS="ignore") | ({"TMPDIR": str(tmpdir)} if tmpdir else {})
    return subprocess.Popen(
        ["bash", str(REPO / "infer.sh"), *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        **kw,
    )


def test_a_user_error_the_launcher_can_see_stops_before_any_rank_starts(tmp_path, qwen3_ckpt):
    """The pre-flight (config.json, recipe, layout, memory of every rank) runs before torchrun."""
    proc = infer(
        "--model", "qwen3_moe", "--set", f"model_config.model_path={qwen3_ckpt}",
        "--set", "model_config.with_ckpt=true", *(f"--set={s}" for s in DENSE_TP), "--out", str(tmp_path),
    )  # fmt: skip
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "does not belong to the qwen3_moe recipe" in lines[0], err
    assert not lines[0].startswith("error: rank ") and not list(tmp_path.glob("rank_*.log"))


def test_a_rank_with_a_user_error_ends_the_job_with_its_line(tmp_path, qwen3_ckpt):
    """A NaN weight only the ranks can find (in rank 0's half of a row-parallel layer): every rank
    sees the same NaN logits after the all-reduce, re-runs the step to locate it, and stops.
    The job leaves nothing in the temporary directory (torchrun's log directory is ours, removed)."""
    from safetensors.torch import load_file, save_file

    model = tmp_path / "nan"
    shutil.copytree(qwen3_ckpt, model)
    weights = load_file(str(model / "model.safetensors"))
    weights["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    out_dir, tmpdir = tmp_path / "out", tmp_path / "tmp"
    tmpdir.mkdir()
    proc = infer(
        "--set", f"model_config.model_path={model}", "--set", "model_config.with_ckpt=true",
        "--set", "model_config.exe_mode=eager", "--set", "model_config.enable_superkernel=false",
        "--set", "model_config.enable_cache_compile=false", *(f"--set={s}" for s in DENSE_TP), "--out", str(out_dir),
        tmpdir=tmpdir,
    )  # fmt: skip
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: rank "), err
    assert "exited with code 2" in lines[0] and "NaN in the logits at prefill, row 0" in lines[0], err
    assert "region layer_1_mlp" in lines[0], err
    assert "Traceback" not in out + err and not (out_dir / "metrics.json").exists()
    assert not list(tmpdir.iterdir())  # torchrun's torchelastic_* directory used to stay behind


def test_a_killed_rank_ends_the_job_quickly(tmp_path, qwen3_ckpt):
    proc = infer(
        "--set", f"model_config.model_path={qwen3_ckpt}", "--set", "model_config.with_ckpt=true",
        "--set", "model_config.exe_mode=eager", "--set", "model_config.enable_superkernel=false",
        "--set", "model_config.enable_cache_compile=false", "--set", "scheduler_config.max_new_tokens=3000",
        "--set", "data_config.input_truncated_len=16", *(f"--set={s}" for s in DENSE_TP), "--out", str(tmp_path),
    )  # fmt: skip
    log = tmp_path / "rank_1.log"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and "inference time cost of decode" not in _read(log):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        header = _read(log).splitlines()[0]  # "[rank 1/2] pid N logs to ..."
        os.kill(int(header.split(" pid ")[1].split()[0]), signal.SIGKILL)  # rank 1, mid-decode
        killed = time.monotonic()
        _, err = proc.communicate(timeout=120)
        ended = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1 and ended < 60, (proc.returncode, ended, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error: rank 1 " in lines[0] and "was killed by SIGKILL" in lines[0], err
    assert not (tmp_path / "metrics.json").exists()


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""
