"""docs/custom_ops.md, followed literally on a copy of the repository.

Why: a guide that nobody runs drifts from the code. This test copies the repository, writes every
code block of the guide marked `file=PATH` to PATH (the example op `cann::my_swiglu`: C++ kernel,
schema + fake + op-table entry, NPU kernel + GE converter) and runs the guide's commands in
order, adding only what makes them small (a tiny checkpoint, few tokens, an output directory).
Then: the op replaced `swiglu` in eager and in ge_graph + SuperKernel (metrics.json `ops`, one
profiler event per layer and step), the tokens are those of a run without it, and torchair's real
converter found the guide's GE converter inside the scope.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GUIDE = REPO / "docs" / "custom_ops.md"
BLOCK = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)
MAX_NEW = 4
ENV = dict(os.environ, PYTHON=sys.executable)  # infer.sh runs $PYTHON: the interpreter running the tests


def guide_blocks() -> list[tuple[str, str | None, str]]:
    """(language, file=PATH or None, body) of every fenced block of the guide, in order."""
    found = []
    for lang, info, body in BLOCK.findall(GUIDE.read_text()):
        target = re.search(r"file=(\S+)", info)
        found.append((lang, target.group(1) if target else None, body))
    return found


def copy_repository(dest: Path) -> None:
    """The tracked and untracked-but-not-ignored files (no results, caches or virtualenvs); outside
    a git checkout, the source directories."""
    proc = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO, capture_output=True
    )
    if proc.returncode != 0:
        skip = shutil.ignore_patterns(".git", "__pycache__", "res", ".venv*", "*.egg-info")
        shutil.copytree(REPO, dest, ignore=skip, dirs_exist_ok=True)
        return
    listed = proc.stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def small(command: str, ckpt: Path, work: Path, index: int) -> list[str]:
    """The guide's command plus only what keeps it small and its results separate."""
    args = shlex.split(command)
    if args[:2] == ["bash", "infer.sh"]:
        return [
            *args,
            *("--set", f"model_config.model_path={ckpt}", "--set", "model_config.with_ckpt=true"),
            *("--set", f"scheduler_config.max_new_tokens={MAX_NEW}", "--set", "data_config.input_truncated_len=16"),
            *("--set", f"model_config.cache_dir={work / 'compile'}", "--out", str(work / f"run{index}")),
        ]
    if args[:2] == ["python", "tools/ge_check.py"]:  # this interpreter, as PYTHON is for infer.sh
        return [
            sys.executable,
            *args[1:],
            "--set",
            f"model_config.model_path={ckpt}",
            "--json",
            str(work / f"run{index}.json"),
            "--dump-dir",  # not the default temporary directory, which the tool leaves for the user to read
            str(work / f"dumps{index}"),
        ]
    raise AssertionError(f"the guide has a command this test does not know how to run: {command}")


@pytest.fixture(scope="module")
def followed(tmp_path_factory, qwen3_ckpt) -> dict:
    work = tmp_path_factory.mktemp("guide")
    repo = work / "repo"
    copy_repository(repo)
    written, runs = [], []
    for lang, target, body in guide_blocks():
        if target:
            assert not (repo / target).exists(), f"the guide's {target} must be a new file"
            (repo / target).write_text(body)
            written.append(target)
        elif lang == "bash":
            for line in filter(None, (ln.strip() for ln in body.splitlines())):
                cmd = small(line, qwen3_ckpt, work, len(runs))
                proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=900, env=ENV)
                assert proc.returncode == 0, f"{line}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
                runs.append((line, work / f"run{len(runs)}", proc.stdout))
    control = small(
        "bash infer.sh --set model_config.exe_mode=eager --set model_config.enable_superkernel=false "
        "--set model_config.enable_cache_compile=false",
        qwen3_ckpt,
        work,
        len(runs),
    )
    proc = subprocess.run(control, cwd=repo, capture_output=True, text=True, timeout=900, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {
        "written": written,
        "runs": runs,
        "control": json.loads((work / f"run{len(runs)}/metrics.json").read_text()),
    }


def _metrics(run) -> dict:
    return json.loads((run[1] / "metrics.json").read_text())


def test_the_guide_adds_the_three_files_of_a_custom_op(followed):
    assert followed["written"] == [
        "executor/custom_ops/csrc/my_swiglu.cpp",
        "executor/custom_ops/my_swiglu.py",
        "executor/backends/npu_my_swiglu.py",
    ]
    assert [line.split()[:2] for line, _, _ in followed["runs"]] == [
        ["bash", "infer.sh"],
        ["bash", "infer.sh"],
        ["python", "tools/ge_check.py"],
    ]


def test_eager_and_graph_mode_run_the_op_and_keep_the_tokens(followed):
    control = followed["control"]
    assert control["ops"]["swiglu"] == "executor.ops.reference.swiglu"
    eager, graph = (_metrics(run) for run in followed["runs"][:2])
    assert (eager["exe_mode"], graph["exe_mode"]) == ("eager", "ge_graph")
    for metrics in (eager, graph):
        assert metrics["ops"]["swiglu"] == "executor.custom_ops.my_swiglu.swiglu"
        assert metrics["generated_token_ids"] == control["generated_token_ids"]
    assert graph["superkernel"]["ran"] is True and graph["superkernel"]["plan"] == "decoder"
    assert graph["compile"]["graphs"] == 1


def test_the_profiled_decode_calls_the_op_once_per_layer_and_token(followed):
    _line, out, _stdout = followed["runs"][1]  # the run with enable_profiler=true
    events = json.loads((out / "decode_trace.json").read_text())["traceEvents"]
    calls = sum(1 for e in events if e.get("name") == "cann::my_swiglu")
    layers = len([r for r in _metrics(followed["runs"][1])["regions"] if re.fullmatch(r"layer_\d+", r)])
    assert calls == layers * MAX_NEW  # prefill and every decode step: the entry replaces swiglu everywhere


def test_ge_check_converts_the_op_inside_the_scope(followed):
    line, out, stdout = followed["runs"][2]
    report = json.loads(out.with_suffix(".json").read_text())
    decoder = report["plans"]["decoder"]
    assert decoder["fx_custom_ops"] == ["cann.my_swiglu.default"] and decoder["without_converter"] == []
    assert "SwiGlu" in decoder["scopes"]["decode_layers"]["ops"] and report["passed"] is True
    assert "custom ops in the FX graph: cann.my_swiglu.default" in stdout and "--plan decoder" in line
