"""Multi-device pieces that need no second process: the layout arithmetic, the weight slices a
rank loads, expert parallelism's partial outputs, the CLI's error cases, and what a CPU
SuperKernel scope does with a collective inside it (on a one-process gloo group).

Why in one process: a rank's part of a model can be built and loaded without any process group
(executor.parallel.groups.view gives its shapes and slices), and each rank's partial MoE output
can be computed side by side, so the sharding arithmetic is checked exactly and fast. The
ranks talking to each other are checked in test_parallel_ranks.py.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tests.checkpoints as ckpt
from executor.cli import main as cli_main
from executor.config import ConfigError, load_config
from executor.loader import Concat, Stack, as_source, init_random, load_weights, open_checkpoint, remap
from executor.parallel.groups import view
from executor.parallel.layers import kv_head_range
from executor.parallel.layout import Layout, cpu_cores
from executor.parallel.shards import read_index, shard_spec
from executor.platform import detect
from executor.registry import default_config
from models.qwen.models.modeling_qwen import build_model as build_dense
from models.qwen3_moe.models.runner_qwen3_moe import Qwen3MoeRunner
from tests.test_config_cli import CompletedRun, assert_user_error

REPO = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- layout arithmetic
def test_role_groups_follow_upstream_numbering():
    """8 ranks, attention TP 2 (4 DP groups), dense TP 4, moe TP 2 (EP 4), lm_head TP 8."""
    layout = Layout(world=8, attn_tp=2, dense_tp=4, moe_tp=2, embed_tp=1, lmhead_tp=8)
    p = view(layout, 5)
    assert p.attn.group.ranks == (4, 5) and p.dp_index == 2 and p.local_rows(8) == (4, 6)
    # dense TP 4 spans 2 attention groups: gathers over the members at its attention-TP position
    assert p.dense.group.ranks == (4, 5, 6, 7) and p.dense.gather.ranks == (5, 7) and p.dense.gather.index == 0
    assert p.moe.group.ranks == tuple(range(8)) and p.moe.gather.ranks == (1, 3, 5, 7)
    assert (p.ep_index, p.moe_tp_index) == (2, 1)
    assert p.embed.size == 1 and p.embed.gather.size == 1
    assert p.lmhead.group.index == 5 and p.dp_leaders == [0, 2, 4, 6]
    assert layout.attn_dp == 4 and layout.moe_ep == 4


def test_kv_heads_split_or_replicate():
    assert [kv_head_range(i, 4, 8) for i in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [kv_head_range(i, 4, 2) for i in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert Layout(world=4, attn_tp=4).kv_heads_per_rank(2) == 1


def test_read_index_reads_only_boxes_and_concatenates():
    full = torch.arange(6 * 8).view(6, 8)
    boxes = []

    def box(b):
        boxes.append(b)
        return full[tuple(slice(*r) for r in b)]

    got = read_index(box, (6, 8), (((0, 1), (4, 6)), ((2, 3),)))
    assert torch.equal(got, torch.cat([full[0:1, 2:3], full[4:6, 2:3]]))
    assert boxes == [((0, 1), (2, 3)), ((4, 6), (2, 3))]


def test_lazy_sources_read_parts_of_fused_and_stacked_tensors(tmp_path):
    """q/k/v joined into qkv_proj and experts stacked read exactly the requested parts."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    t = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(6, 4, generator=g),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(2, 4, generator=g),
        "model.layers.0.self_attn.v_proj.weight": torch.randn(2, 4, generator=g),
    }
    save_file(t, tmp_path / "model.safetensors")
    full = torch.cat(list(t.values()))
    with open_checkpoint(tmp_path) as sources:
        qkv = remap(sources)["layers.0.self_attn.qkv_proj.weight"]
        assert isinstance(qkv, Concat) and qkv.shape == (10, 4)
        assert torch.equal(qkv.read(), full)
        index = (((3, 6), (6, 7), (8, 9)), ((1, 3),))  # q rows 3..5, k row 0, v row 0; columns 1..2
        assert torch.equal(qkv.read(index), torch.cat([full[3:6, 1:3], full[6:7, 1:3], full[8:9, 1:3]]))
    experts = Stack([as_source(torch.full((2, 3), float(e))) for e in range(4)])
    assert experts.shape == (4, 2, 3)
    assert torch.equal(experts.read((((1, 3),), None, ((0, 1),))).flatten(), torch.tensor([1.0, 1, 2, 2]))


# ----------------------------------------------------------------------------- a rank's weights
@pytest.fixture(scope="module")
def dense_arch(qwen3_ckpt):
    from executor.arch import load_arch

    return load_arch(str(qwen3_ckpt), "")


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_loads_exactly_its_slices(qwen3_ckpt, dense_arch, rank):
    """TP 2 as qwen3_8b_2tp.yaml (embedding whole, lm_head split): the checkpoint ties them, so
    the two hold different blocks of one tensor. Every parameter equals its slice of the
    one-device model's, and the split ones are half its size."""
    one = build_dense(dense_arch)
    load_weights(one, qwen3_ckpt, torch.float32)
    part = build_dense(dense_arch, view(Layout(world=2, attn_tp=2, dense_tp=2, lmhead_tp=2), rank))
    load_weights(part, qwen3_ckpt, torch.float32)
    whole = one.state_dict()
    split = 0
    for name, param in part.state_dict(keep_vars=True).items():
        spec = shard_spec(param)
        want = spec.take(whole[name]) if spec else whole[name]
        assert torch.equal(param.detach(), want), name
        if spec:
            assert param.numel() * 2 == whole[name].numel(), name
            split += 1
    assert split == 1 + 4 * dense_arch.num_layers  # lm_head; qkv, o, gate_up, down per layer
    assert part.lm_head.weight is not part.embed_tokens.weight and one.lm_head.weight is one.embed_tokens.weight


def test_random_weights_are_the_same_model_on_every_layout(dense_arch):
    one = build_dense(dense_arch)
    init_random(one, seed=3)
    whole = one.state_dict()
    for rank in (0, 1):
        part = build_dense(dense_arch, view(Layout(world=2, attn_tp=2, dense_tp=2, embed_tp=2, lmhead_tp=1), rank))
        init_random(part, seed=3)
        for name, param in part.state_dict(keep_vars=True).items():
            spec = shard_spec(param)
            assert torch.equal(param.detach(), spec.take(whole[name]) if spec else whole[name]), name


# ----------------------------------------------------------------------------- expert parallelism
@pytest.fixture(scope="module")
def moe_one(tmp_path_factory):
    path = ckpt.make_qwen3_moe_checkpoint(tmp_path_factory.mktemp("moe") / "m", num_hidden_layers=1)
    cfg = load_config(
        default_config("qwen3_moe"),
        [f"model_config.model_path={path}", "model_config.with_ckpt=true", "model_config.exe_mode=eager"]
        + ["model_config.enable_superkernel=false", "model_config.enable_cache_compile=false"],
    )
    return Qwen3MoeRunner(cfg, detect("cpu"), stream=io.StringIO())


@pytest.mark.parametrize("layout", [Layout(world=2, attn_tp=2, moe_tp=1), Layout(world=2, attn_tp=2, moe_tp=2)])
@pytest.mark.parametrize("tokens,formulation", [(2, "_gathered"), (6, "_dense"), (6, "_grouped")])
def test_rank_partials_of_a_moe_block_sum_to_the_whole(moe_one, layout, tokens, formulation):
    """EP 2 (4 experts each) or moe TP 2 (half of each expert's intermediate): each rank's partial
    output of every formulation, summed over the ranks, is the one-device output (the all-reduce
    the block ends with)."""
    from models.qwen3_moe.models.modeling_qwen3_moe import SparseMoeBlock

    whole = moe_one.model.layers[0].mlp
    x = torch.randn(tokens, whole.experts_gate_up.shape[-1], generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        weights, idx = whole.route(x)
        want = getattr(whole, formulation)(x, weights, idx)
        total = torch.zeros_like(want)
        for rank in range(layout.world):
            part = SparseMoeBlock(moe_one.arch, view(layout, rank))
            for name, param in part.named_parameters():
                spec = shard_spec(param)
                full = whole.get_parameter(name)
                param.copy_(spec.take(full) if spec else full)
            assert part.experts.num_local * layout.moe_ep == whole.num_experts
            total += getattr(part, formulation)(x, weights, idx)
    assert len({e for row in idx.tolist() for e in row} & set(range(4))) > 0  # both ranks' experts are chosen
    assert len({e for row in idx.tolist() for e in row} & set(range(4, 8))) > 0
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- impossible layouts
W2 = [
    "--set",
    "parallel_config.world_size=2",
    "--set",
    "parallel_config.attn_tp_size=2",
    "--set",
    "model_config.exe_mode=eager",
]
W2 += ["--set", "model_config.enable_superkernel=false", "--set", "model_config.enable_cache_compile=false"]
DP2 = ["--set", "parallel_config.attn_tp_size=1"]  # attention data parallel 2


@pytest.mark.parametrize(
    "extra,needles",
    [
        (["--set", "parallel_config.attn_tp_size=3"], ["parallel_config.attn_tp_size: 3 does not divide", "2"]),
        (["--set", "parallel_config.lmhead_tp_size=4"], ["parallel_config.lmhead_tp_size: 4", "world_size 2"]),
        (DP2 + ["--set", "scheduler_config.batch_size=3"], ["scheduler_config.batch_size: 3", "data parallel size 2"]),
        (
            DP2 + ["--set", "scheduler_config.max_prefill_tokens=8", "--set", "scheduler_config.batch_size=2"],
            ["scheduler_config.max_prefill_tokens", "attention data parallel"],
        ),
    ],
)
def test_impossible_parallel_configs_name_the_keys(tmp_path, capsys, extra, needles):
    args = ["run", *W2, *extra, "--out", str(tmp_path / "o")]
    assert_user_error(CompletedRun(cli_main(args), capsys.readouterr()), *needles)
    assert not (tmp_path / "o" / "metrics.json").exists()


TP2 = ["parallel_config.attn_tp_size=2"]


@pytest.mark.parametrize(
    "recipe,change,layout,needles",
    [
        (
            "qwen",
            {"num_attention_heads": 3, "num_key_value_heads": 1},
            TP2,
            ["attn_tp_size: 2", "num_attention_heads 3"],
        ),
        (
            "qwen",
            {"num_attention_heads": 6, "num_key_value_heads": 3},
            TP2,
            ["attn_tp_size: 2", "num_key_value_heads 3"],
        ),
        (
            "qwen",
            {"vocab_size": 511},
            [*TP2, "parallel_config.embed_tp_size=2"],
            ["embed_tp_size: 2", "vocab_size 511"],
        ),
        (
            "qwen3_moe",
            {"num_experts": 3},
            ["scheduler_config.batch_size=2"],
            ["moe_tp_size", "expert parallel size 2", "num_experts 3"],
        ),
        (
            "qwen3_moe",
            {"moe_intermediate_size": 33},
            [*TP2, "parallel_config.moe_tp_size=2"],
            ["moe_intermediate_size 33"],
        ),
    ],
)
def test_checkpoint_that_cannot_be_split_names_key_and_field(
    tmp_path, capsys, qwen3_ckpt, recipe, change, layout, needles
):
    source = json.loads((qwen3_ckpt / "config.json").read_text())
    if recipe == "qwen3_moe":
        source = ckpt.QWEN3_MOE_CONFIG | {"model_type": "qwen3_moe"}
    path = tmp_path / "ckpt"  # config.json only: the split is checked before any weight is read
    path.mkdir()
    (path / "config.json").write_text(json.dumps(source | change))
    sets = [a for item in [f"model_config.model_path={path}", *layout] for a in ("--set", item)]
    rc = cli_main(["run", "--model", recipe, *W2, *sets, "--out", str(tmp_path / "o")])
    assert_user_error(CompletedRun(rc, capsys.readouterr()), *needles, str(path / "config.json"))


def test_memory_estimate_is_per_rank_and_counts_every_rank_of_the_machine(tmp_path, capsys):
    """Pre-flight on a 2-rank layout: each rank's weights are its meta model's part, its KV cache
    its KV heads (TP) or rows (DP); on CPU both ranks share the host RAM, so both are checked,
    and an impossible batch stops the launcher before any rank starts, naming the keys."""
    from models.qwen.models.runner_qwen import QwenRunner

    cpu = detect("cpu")
    base = ["model_config.debug_size=qwen3-0.6b", "scheduler_config.batch_size=2"]
    one = QwenRunner.check_before_run(load_config(None, base), cpu).memory
    tp = QwenRunner.check_before_run(load_config(None, [*base, "parallel_config.world_size=2", *TP2]), cpu, 2).memory
    dp = load_config(None, [*base, "parallel_config.world_size=2", "parallel_config.attn_tp_size=1"])
    dp = QwenRunner.check_before_run(dp, cpu, 2).memory
    with torch.device("meta"):
        whole = build_dense(QwenRunner.check_before_run(load_config(None, base), cpu).arch)
    tp_parts = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")
    split = sum(p.numel() * 4 for name, p in whole.named_parameters() if name.endswith(tp_parts))
    assert tp.weights == one.weights - split // 2 and dp.weights == one.weights  # DP: attention replicated
    assert tp.kv_cache == dp.kv_cache == one.kv_cache // 2
    assert (tp.ranks_sharing, tp.needed_here) == (2, 2 * tp.needed) and one.ranks_sharing == 1
    args = ["run", *W2, "--set", 'model_config.model_path=""', "--set", "model_config.with_ckpt=false"]
    args += ["--set", "model_config.debug_size=qwen3-0.6b", "--set", "scheduler_config.batch_size=100000"]
    line = assert_user_error(CompletedRun(cli_main([*args, "--out", str(tmp_path / "o")]), capsys.readouterr()))
    assert "memory: 2 ranks on this machine need about" in line and "scheduler_config.batch_size" in line, line
    assert "per rank" in line and not (tmp_path / "o").exists()


def test_more_ranks_than_devices_is_an_error_before_anything_starts(tmp_path, capsys):
    world = 2 * cpu_cores()  # never fits: each rank needs a core
    args = [
        "run",
        *W2,
        "--set",
        f"parallel_config.world_size={world}",
        "--set",
        f"parallel_config.attn_tp_size={world}",
    ]
    args += ["--out", str(tmp_path / "o")]
    line = assert_user_error(CompletedRun(cli_main(args), capsys.readouterr()), "parallel_config.world_size")
    assert f"{world} is larger than the devices present" in line and f"{cpu_cores()} CPU cores" in line
    assert not (tmp_path / "o").exists()


def test_torchrun_options_that_this_command_sets_are_refused(tmp_path, capsys):
    args = ["run", *W2, "--torchrun", "--nproc-per-node 4", "--out", str(tmp_path / "o")]
    assert_user_error(CompletedRun(cli_main(args), capsys.readouterr()), "--torchrun", "--nproc-per-node")
    args = ["run", *W2, "--torchrun", "--nnodes 2 --node-rank 0", "--set", "parallel_config.world_size=3"]
    assert_user_error(CompletedRun(cli_main([*args, "--out", str(tmp_path / "o")]), capsys.readouterr()), "world_size")


def test_dense_tp_size_defaults_to_attention_tp_size():
    cfg = load_config(REPO / "models/qwen/config/qwen3_8b_2tp.yaml")
    assert cfg.parallel_config.dense_tp_size is None
    assert Layout.from_config(cfg.parallel_config).dense_tp == 2
    with pytest.raises(ConfigError, match=r"dense_tp_size: 3 does not divide"):
        load_config(None, ["parallel_config.world_size=2", "parallel_config.dense_tp_size=3"])


# ----------------------------------------------------------------------------- a collective inside a scope
@pytest.fixture
def one_process_group():
    """A real gloo process group of one rank: collectives trace and run, nothing to wait for."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("check", ["", "strict-scope-check=abort"])
def test_cpu_scope_keeps_all_reduce_and_is_cut_at_all_gather(one_process_group, check):
    import torch.distributed._functional_collectives as funcol

    from executor.backends.inductor import ScopeCheckError, compile_inductor
    from executor.scope import superkernel_scope

    group = one_process_group
    w = torch.randn(16, 16, generator=torch.Generator().manual_seed(0))

    def step(x, _positions):
        with superkernel_scope(True, "s", check):
            y = funcol.all_reduce(torch.tanh(x @ w), "sum", group)  # joins the launch unit
            z = funcol.all_gather_single(y * 2, 0, group)  # cannot: cuts the scope
            return torch.relu(z) + 1

    x = torch.randn(2, 16)
    compiled = compile_inductor(step, True, "cpu", cache_dir=None)
    if check:
        with pytest.raises(ScopeCheckError, match=r"scope 's': op .*all_gather_into_tensor.*abort"):
            compiled(x, None)
        return
    torch.testing.assert_close(compiled(x, None), step(x, None))
    scope = compiled.compiler.stats.scopes["s"]
    assert scope.collectives == 1 and scope.segments == 2 and scope.launches == 2
    assert len(scope.cut_reasons) == 1 and "collective all_gather_into_tensor" in scope.cut_reasons[0]


def test_shipped_multi_device_yamls_are_valid_configs():
    for path in sorted((REPO / "models").glob("*/config/*.yaml")):
        cfg = load_config(path)
        if cfg.parallel_config.world_size > 1:
            assert cfg.parallel_config.world_size % cfg.parallel_config.attn_tp_size == 0, path


def test_no_rank_environment_means_no_process_group(tmp_path):
    """A world-size-2 runner outside torchrun is an error saying how to start it, not a hang."""
    from models.qwen.models.runner_qwen import QwenRunner

    assert "RANK" not in os.environ and shutil.which("bash")
    cfg = load_config(None, ["parallel_config.world_size=2", "parallel_config.attn_tp_size=2"])
    with pytest.raises(Exception, match=r"world_size 2 needs one process per rank.*infer\.sh"):
        QwenRunner(cfg, detect("cpu"))


RANK_ENV = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}


# A bug in a rank's command: executor.cli's run_command (bound when runpy runs the module) raises.
BUG = "import executor.errors\ndef bug(*args):\n    raise RuntimeError('a bug')\nexecutor.errors.run_command = bug\n"


@pytest.mark.parametrize(
    ("env", "argv", "bug", "code"),
    [
        (RANK_ENV, ["--help"], False, 0),
        (RANK_ENV, ["run", "--set", "nope.key=1"], False, 2),
        (RANK_ENV, ["run"], True, 1),
        ({}, ["--help"], False, 0),
    ],
    ids=["rank", "rank-user-error", "rank-bug", "not-a-rank"],
)
def test_a_rank_ends_without_finalisation_after_its_exit_handlers(tmp_path, env, argv, bug, code):
    """`python -m executor.cli` in a rank (torchrun's variables set) ends through exit_rank: its
    exit status kept, the atexit handlers run, and no Python finalisation, where a gloo thread
    still running after destroy_process_group could abort the process (SIGABRT) after its
    results were written. A bug's exception keeps its traceback and exit status 1 on the same
    way out, and what C code printed is not lost in libc's buffer. Outside a rank the process ends
    as usual (finalised: the control)."""
    marker = tmp_path / "atexit"
    script = (
        "import atexit, runpy, sys\n"
        f"atexit.register(lambda: open({str(marker)!r}, 'w').write('ran'))\n"
        "class Finalised:\n"
        "    def __del__(self):\n"
        "        print('finalised', flush=True)\n"
        "keep = Finalised()\n"
        "import ctypes\nctypes.CDLL(None).printf(b'from C\\n')\n"  # in libc's buffer: stdout is a pipe
        f"{BUG if bug else ''}"
        f"sys.argv = ['executor.cli', *{argv!r}]\n"
        "runpy.run_module('executor.cli', run_name='__main__')\n"
    )
    # without PYTHONUNBUFFERED (a user's rank may not have it), which makes libc's stdout unbuffered too
    rank_free = {k: v for k, v in os.environ.items() if k not in {*RANK_ENV, "PYTHONUNBUFFERED"}}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=rank_free | env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == code, proc.stderr[-2000:]
    assert marker.read_text() == "ran"
    assert ("finalised" in proc.stdout) == (not env), proc.stdout[-2000:]
    assert "from C" in proc.stdout, proc.stdout[-2000:]
    assert ("RuntimeError: a bug" in proc.stderr and "Traceback" in proc.stderr) == bug, proc.stderr[-2000:]


def test_the_failure_reported_is_the_cause_not_its_consequences(tmp_path):
    """Rank 1 killed; rank 0 then fails on the dead connection and rank 2 is stopped by torchrun
    (SIGTERM), all in the same second: the launcher names rank 1, with the right exit status."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from executor.parallel.launch import last_error, root_cause

    (tmp_path / "rank_0.log").write_text(
        "Traceback ...\nRuntimeError: pair.cc:537 Read error: Connection reset by peer\n"
    )
    (tmp_path / "rank_1.log").write_text("[rank 1/3] pid 101\nqwen inference time cost of decode is 1.00 ms\n")
    failures = {r: ProcessFailure(r, 100 + r, code, "/nonexistent") for r, code in ((0, 1), (1, -9), (2, -15))}
    for f in failures.values():
        f.timestamp = 1000
    assert root_cause(failures, tmp_path)[0] == 1
    (tmp_path / "rank_3.log").write_text("[rank 3/4] pid 103\nerror: model_config.x: bad\n")
    failures[3] = ProcessFailure(3, 103, 2, "/nonexistent")
    failures[3].timestamp = 999
    assert root_cause(failures, tmp_path)[0] == 3 and last_error(tmp_path / "rank_3.log") == "model_config.x: bad"
    assert last_error(tmp_path / "rank_0.log").startswith("RuntimeError: pair.cc")
    assert last_error(tmp_path / "missing.log") == "it failed before writing its log"


def test_torchrun_logs_go_to_a_directory_of_ours_unless_the_user_names_one(tmp_path):
    """torchrun's per-job log directory is one we remove (its default stayed in /tmp for good);
    a `--log-dir` passed with --torchrun is the user's and kept; module arguments are not options."""
    from executor.parallel.launch import _torchrun_log_dir

    job = ["--standalone", "--nproc-per-node", "2", "--module", "executor.cli", "run"]
    with _torchrun_log_dir(job) as args:
        assert args[2:] == job and args[0] == "--log-dir" and Path(args[1]).is_dir()
        ours = Path(args[1])
    assert not ours.exists()
    for given in (["--log-dir", str(tmp_path)], [f"--log_dir={tmp_path}"]):
        with _torchrun_log_dir([*given, *job]) as args:
            assert args == [*given, *job]
    after = [*job, "--log-dir", "x"]  # after --module: the module's own argument
    with _torchrun_log_dir(after) as args:
        assert args[0] == "--log-dir" and args[2:] == after
    assert tmp_path.is_dir()


def test_npu_ranks_use_hccl_through_the_adapter():
    """The NPU side of several devices is the adapter's: bind the rank to its NPU, name HCCL."""
    import tests.npu_doubles as nd
    from executor.backends import npu

    with nd.installed() as doubles:
        assert npu.init_distributed(3) == "hccl" and npu.device_count() == 1
        assert [c.args for c in doubles.torch_npu.named("npu.set_device")] == [(3,)]
