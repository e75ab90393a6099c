"""The compile cache directory is keyed on everything that changes the compiled decode graph.

Why: torchair's `inference.cache_compile` keys its cache on the module's class and str(), the
CompilerConfig and the determinism level only, and on a hit reuses the saved graph without
dynamo's guards; so a run with another plan, dtype or shape would silently get the old graph.
Every backend therefore compiles into `<cache root>/<backend>-<digest>` (executor.backends.base).
Here: through the runner (so its wiring of batch, max length, plan and dtype is what is tested)
each input alone changes the directory and an identical run reuses it; the inputs that are not
config (op table, versions, device) through `cache_key` itself. The NPU backends use the same
function (tests/test_npu_compile.py); a real second run reusing the cache is in test_graph_mode.
"""

from __future__ import annotations

import dataclasses
import gc
import io
import json
import os
import subprocess
import sys
from pathlib import Path

from executor import ops
from executor.backends.base import cache_key, keyed_cache_dir
from executor.config import load_config
from executor.ops import reference
from executor.platform import Platform
from models.qwen.models.runner_qwen import QwenRunner

CPU = Platform("cpu", None, "cpu", "test")
BASE = [
    "model_config.exe_mode=ge_graph",
    "model_config.enable_cache_compile=true",
    "model_config.enable_superkernel=true",
    "model_config.superkernel.plan=attention",
    "data_config.input_truncated_len=16",
    "scheduler_config.max_new_tokens=4",
]
CUSTOM = '[{regions: ["layer_0_attn"], label: "s", options: "stream-fusion=0"}]'
# Each entry changes exactly one input of the key.
CHANGES = {
    "arch": ["model_config.debug_size=bench-overhead"],
    "dtype": ["model_config.dtype=bfloat16"],
    "batch": ["scheduler_config.batch_size=2"],
    "max length (input)": ["data_config.input_truncated_len=18"],  # the KV cache: 22 slots, not 20
    "max length (new tokens)": ["scheduler_config.max_new_tokens=5"],  # 21 slots
    "plan": ["model_config.superkernel.plan=layer"],
    "scope options": ["model_config.superkernel.options=stream-fusion=1"],
    "superkernel off": ["model_config.enable_superkernel=false"],
    "custom scope options": [
        "model_config.superkernel.plan=custom",
        f"model_config.superkernel.custom={CUSTOM.replace('stream-fusion=0', 'stream-fusion=1')}",
    ],
}


def _runner(tmp_path: Path, *extra: str) -> QwenRunner:
    cfg = load_config(None, [*BASE, f"model_config.cache_dir={tmp_path}", *extra])
    return QwenRunner(cfg, CPU, stream=io.StringIO())


def test_each_input_changes_the_directory_and_an_identical_run_reuses_it(tmp_path):
    base = _runner(tmp_path).backend.cache_dir
    assert base == _runner(tmp_path).backend.cache_dir  # identical config: the same directory
    assert Path(base).parent == tmp_path and Path(base).name.startswith("inductor+superkernel-")
    dirs = {"base": base}
    for what, sets in CHANGES.items():
        dirs[what] = _runner(tmp_path, *sets).backend.cache_dir
    assert len(set(dirs.values())) == len(dirs), dirs
    # what sizes the graph is the KV-cache length, not how it is split between prompt and output
    same = ["data_config.input_truncated_len=17", "scheduler_config.max_new_tokens=4"]
    assert _runner(tmp_path, *same).backend.cache_dir == dirs["max length (new tokens)"]
    # the custom plan's own options are in the key too, not only its name
    custom = ["model_config.superkernel.plan=custom", f"model_config.superkernel.custom={CUSTOM}"]
    assert _runner(tmp_path, *custom).backend.cache_dir != dirs["custom scope options"]


def test_the_key_is_recorded_beside_the_artifacts_and_in_the_report(tmp_path):
    runner = _runner(tmp_path, "model_config.superkernel.options=stream-fusion=1")
    key = json.loads((Path(runner.backend.cache_dir) / "cache_key.json").read_text())
    assert key == runner.backend.cache_key
    assert (key["dtype"], key["batch_size"], key["max_len"], key["exe_mode"]) == ("float32", 1, 20, "ge_graph")
    assert key["plan"] == "attention" and {s["options"] for s in key["scopes"]} == {"stream-fusion=1"}
    assert key["arch"]["hidden_size"] == runner.arch.hidden_size and "source" not in key["arch"]
    assert key["op_table"] == ops.implementations("reference") and key["versions"]["torch"]


def test_op_table_versions_and_device_change_the_directory(tmp_path):
    spec = _runner(tmp_path).decode_spec()
    torch_version = {"torch": "2.13.0"}
    base = cache_key(spec, "inductor", "reference", torch_version)
    ops.register("test_compile_cache_alt", {"swiglu": lambda x: reference.swiglu(x)})
    variants = [
        cache_key(spec, "inductor", "test_compile_cache_alt", torch_version),
        cache_key(spec, "inductor", "reference", {"torch": "2.14.0"}),
        cache_key(dataclasses.replace(spec, device="another cpu"), "inductor", "reference", torch_version),
        cache_key(spec, "inductor", "reference", torch_version, {"static_kernel_compile": True}),
    ]
    directories = {keyed_cache_dir(tmp_path, k) for k in [base, *variants]}
    assert len(directories) == 1 + len(variants)
    assert keyed_cache_dir(tmp_path, cache_key(spec, "inductor", "reference", torch_version)) in directories


def test_without_enable_cache_compile_every_run_is_cold(tmp_path):
    first = _runner(tmp_path, "model_config.enable_cache_compile=false").backend.cache_dir
    second = _runner(tmp_path, "model_config.enable_cache_compile=false").backend.cache_dir
    assert first != second and not first.startswith(str(tmp_path))  # fresh temporary directories


def test_a_cold_runs_directory_goes_with_its_runner_and_at_exit(tmp_path):
    """Without enable_cache_compile the fresh directory is removed: nothing piles up in /tmp."""
    runner = _runner(tmp_path, "model_config.enable_cache_compile=false")
    scratch = Path(runner.backend.cache_dir)
    runner.generate([[5, 6, 7]], 3)
    assert any(scratch.rglob("*.so"))  # the step's kernels were built there
    del runner
    gc.collect()
    assert not scratch.exists()
    code = "from executor.backends.scratch_dir import ScratchDir; kept = ScratchDir('sk_exit_'); print(kept.path)"
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    left = Path(proc.stdout.strip())
    assert left.name.startswith("sk_exit_") and not left.exists()  # a process that ends holding one


def test_a_killed_runs_directory_is_removed_by_the_next_one_and_a_live_ones_is_not(tmp_path):
    """SIGKILL (or the OOM killer) runs no finalizer, so the directory stays; the next ScratchDir of
    the same prefix removes it, because nothing holds its lock any more. A live owner's directory
    and a directory that is not a ScratchDir stay."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TMPDIR=str(tmp_path))
    hold = (
        "import sys\nfrom executor.backends.scratch_dir import ScratchDir\n"
        "d = ScratchDir('sk_t_')\nprint(d.path, flush=True)\n"
    )

    def holder() -> tuple[subprocess.Popen, Path]:
        proc = subprocess.Popen(
            [sys.executable, "-c", hold + "sys.stdin.read()\n"],
            cwd=root,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        return proc, Path(proc.stdout.readline().strip())

    live, live_dir = holder()
    killed, killed_dir = holder()
    killed.kill()  # SIGKILL
    killed.wait()
    (tmp_path / "sk_t_not_a_scratch_dir").mkdir()
    assert killed_dir.parent == tmp_path and killed_dir.exists() and live_dir.exists()
    proc = subprocess.run([sys.executable, "-c", hold], cwd=root, env=env, capture_output=True, text=True, check=True)
    assert not killed_dir.exists()
    assert live_dir.exists() and (tmp_path / "sk_t_not_a_scratch_dir").exists()
    assert not Path(proc.stdout.strip()).exists()  # that one went at its own exit
    live.communicate("")
    assert not live_dir.exists()
