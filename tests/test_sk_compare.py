"""tools/sk_compare.py end to end on CPU: both sides really run, the user's config survives
signals and crashes byte for byte, cann-recipes-infer logs parse, every error path exits 2.

Runs use a 1-layer model (config.json only, random weights) and a compile cache shared by the
whole session, so each real run costs seconds, not minutes.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from executor.cli import main as cli_main
from executor.config import load_config
from executor.logs import decode_average_ms
from tests.tool_fixtures import recipe_config
from tools import measure

SIDES = ("baseline", "optimized")

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "tools" / "sk_compare.py"


@pytest.fixture
def user_config(tmp_path, shared_dir) -> Path:
    return recipe_config(tmp_path / "my_recipe.yaml", shared_dir / "tiny_dense", shared_dir / "compile_cache")


def compare(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli_main(["compare", *argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


# ----------------------------------------------------------------------------- real runs
def test_end_to_end_both_sides_run(tmp_path, user_config, capsys, monkeypatch):
    monkeypatch.setenv("CANN_RECIPES_ADAPTIVE_THREADS", "1")  # the project's default, off elsewhere in tests
    before = user_config.read_bytes()
    out = tmp_path / "report"
    rc, _stdout, err = compare(
        capsys, "--config", str(user_config), "--plan", "decoder", "--runs", "2", "--warmup", "0", "--out", str(out)
    )
    assert rc == 0, err
    assert user_config.read_bytes() == before
    assert "baseline run 2/2" in err and "optimized run 1/2" in err  # progress: side, run k of N
    res = json.loads((out / "results.json").read_text())
    summary = res["summary"]
    for side, sk_on in (("baseline", False), ("optimized", True)):
        assert summary[side]["ok_runs"] == 2 and summary[side]["failed_runs"] == 0
        steps = []
        for k in (1, 2):
            metrics = json.loads((out / "runs" / f"{side}.{k}" / "metrics.json").read_text())
            assert metrics["superkernel"]["ran"] is sk_on and metrics["exe_mode"] == "ge_graph"
            assert len(metrics["decode_ms"]) == 5  # max_new_tokens 6: the first token comes from prefill
            # the log prints 2 decimals; the tool must parse exactly what the runner measured
            steps.append(decode_average_ms([round(x, 2) for x in metrics["decode_ms"]]))
            assert (out / f"{side}.{k}.log").read_text().count("inference time cost of decode is") == 5
        assert summary[side]["step_ms_runs"] == pytest.approx(steps, abs=0.006)
        assert summary[side]["step_ms"] == pytest.approx(sum(steps) / 2, abs=0.006)
        assert summary[side]["tokens_per_s"] == pytest.approx(1000 / summary[side]["step_ms"])
    scopes = json.loads((out / "runs" / "optimized.1" / "metrics.json").read_text())["superkernel"]["scopes"]
    assert [s["label"] for s in scopes] == ["decode_layers"]
    assert summary["latency_improvement_percent"] == pytest.approx(
        (summary["baseline"]["step_ms"] - summary["optimized"]["step_ms"]) / summary["baseline"]["step_ms"] * 100
    )
    checks = {c["item"]: c["status"] for c in res["checklist"]}
    assert checks == {
        "exe_mode is ge_graph": "PASS",
        "hardware is Atlas A3": "WARN",
        "framework is PyTorch": "PASS",
        "prefill and decode are separate": "PASS",
        "model declares regions and the plan marks at least one": "PASS",
        "SuperKernel really ran in the optimized runs": "PASS",
    }
    # no item on the intra-op threads: the test model's step is tiny, so every run decoded on one
    # thread by design where the governor is on (executor/threads.py, TINY_MACS), which says
    # nothing about the host
    runs = [json.loads((out / "runs" / f"{side}.{k}" / "metrics.json").read_text()) for side in SIDES for k in (1, 2)]
    assert all(m["thread_governor"]["one_thread_tiny_step"] == m["thread_governor"]["enabled"] for m in runs)
    assert [summary[side]["steps_on_fewer_threads"] for side in SIDES] == [None, None]
    # the copies differ only in the SuperKernel keys and keep the user's comments
    base, opt = (yaml.safe_load((out / f"{s}.yaml").read_text()) for s in ("baseline", "optimized"))
    assert (base["model_config"]["enable_superkernel"], base["model_config"]["superkernel"]) == (
        False,
        {"plan": "attention"},
    )
    assert (opt["model_config"]["enable_superkernel"], opt["model_config"]["superkernel"]) == (
        True,
        {"plan": "decoder"},
    )
    for side in (base, opt):
        side["model_config"].pop("enable_superkernel"), side["model_config"].pop("superkernel")
    assert base == opt
    assert "# the configured plan" in (out / "optimized.yaml").read_text()
    report = (out / "superkernel_optimization_report.md").read_text()
    assert "portable measurement on CPU, not an Ascend result" in "\n".join(report.splitlines()[:3])
    for section in (
        "## Model",
        "## Scope strategy",
        "## Date",
        "## Config changes",
        "## Code changes",
        "## Environment",
        "## Results",
        "## Prerequisite checklist",
        "## Conclusion",
        "## How to reproduce",
    ):
        assert section in report
    runs = pd.read_csv(out / "runs.csv")
    assert sorted(zip(runs["side"], runs["index"])) == [
        ("baseline", 1),
        ("baseline", 2),
        ("optimized", 1),
        ("optimized", 2),
    ]
    assert runs["ok"].all() and (runs["step_ms"] > 0).all()
    for png in ("decode_step_latency.png", "decode_latency_runs.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _children_with(marker: str) -> list[int]:
    """Processes whose command line mentions `marker` (our unique output path)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline and "sk_compare.py" not in cmdline:
                pids.append(int(entry.name))
    return pids


def _wait_for(predicate, what: str, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.2)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_mid_run_leaves_config_identical_and_no_child(tmp_path, user_config, sig):
    """Ctrl-C (or a job killer's SIGTERM) while a real infer.sh run is in flight."""
    before = user_config.read_bytes()
    out = tmp_path / "interrupted"
    cmd = [sys.executable, str(TOOL), "--config", str(user_config), "--runs", "2", "--warmup", "0", "--out", str(out)]
    if sig == signal.SIGTERM:  # a long command whose process tree we can find again
        cmd += [
            "--cmd-baseline",
            f"{sys.executable} -c 'import time; print(\"started\", flush=True); time.sleep(97)' {out}",
        ]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        log = out / "baseline.1.log"
        _wait_for(
            lambda: log.is_file() and log.read_text().strip() and _children_with(str(out)), "the first run to start"
        )
        proc.send_signal(sig)
        _stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr
    assert user_config.read_bytes() == before
    _wait_for(lambda: not _children_with(str(out)), "the run's processes to end", 15)


_drops_an_exception = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


class _LosesItsInterrupt:
    """Raises the signal inside a finalizer: the interpreter prints "Exception ignored" and drops
    the KeyboardInterrupt, as a real Ctrl-C landing in one would be dropped."""

    def __del__(self):
        signal.raise_signal(signal.SIGINT)


@_drops_an_exception
def test_an_interrupt_lost_in_a_finalizer_still_stops_the_run(tmp_path):
    side = measure.Side("baseline", command="for i in $(seq 100); do echo step $i; sleep 0.05; done")
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt), measure.signals_as_interrupt():
        _LosesItsInterrupt()  # the exception is gone: only the flag is left
        measure.run_once("qwen", side, 1, tmp_path, None)
    log = (tmp_path / "baseline.1.log").read_text()
    assert "step 100" not in log and len(log.splitlines()) <= 1, log  # stopped at its first line
    assert signal.getsignal(signal.SIGINT) is before  # handlers given back


@_drops_an_exception
def test_an_interrupt_lost_between_runs_stops_before_the_next(tmp_path):
    sides = [measure.Side(name, command="echo 'qwen inference time cost of decode is 2.00 ms'") for name in SIDES]
    progress = measure.Progress("test", stream=sys.stdout)
    with pytest.raises(KeyboardInterrupt), measure.signals_as_interrupt():
        _LosesItsInterrupt()
        measure.measure("qwen", sides, 2, 0, tmp_path, progress)
    assert not list(tmp_path.glob("*.log"))


@_drops_an_exception
def test_an_interrupt_lost_after_the_last_run_is_raised_on_leaving():
    with pytest.raises(KeyboardInterrupt), measure.signals_as_interrupt():
        _LosesItsInterrupt()
    with measure.signals_as_interrupt():  # and a later block starts clean
        pass


def test_crashed_side_reported_as_failed_config_identical(tmp_path, user_config, capsys):
    before = user_config.read_bytes()
    out = tmp_path / "crash"
    base_cmd = (
        "printf 'qwen inference time cost of prefill is 5.00 ms\\n"
        "qwen inference time cost of decode is 2.00 ms\\nqwen inference time cost of decode is 4.00 ms\\n'"
    )
    rc, _stdout, _err = compare(
        capsys,
        *("--config", str(user_config), "--out", str(out), "--runs", "2", "--warmup", "1"),
        *("--cmd-baseline", base_cmd, "--cmd-optimized", "echo 'error: device lost' >&2; false"),
    )
    assert rc == 1
    assert user_config.read_bytes() == before
    res = json.loads((out / "results.json").read_text())
    assert res["summary"]["baseline"]["step_ms"] == pytest.approx(3.0)
    assert res["summary"]["optimized"]["ok_runs"] == 0 and res["summary"]["optimized"]["failed_runs"] == 2
    assert res["summary"]["optimized"]["errors"] == ["exit code 1: error: device lost"] * 2
    runs = pd.read_csv(out / "runs.csv")
    assert len(runs) == 6 and runs.loc[runs["side"] == "optimized", "ok"].eq(False).all()
    assert "every run of optimized failed" in (out / "superkernel_optimization_report.md").read_text()


def test_eager_config_with_graph_only_override_runs_both_sides_in_ge_graph(tmp_path, user_config, capsys):
    """The shipped configs are eager; `--set model_config.enable_cache_compile=true` is only valid
    in a graph mode, which the tool switches both sides to, so it must not be rejected up front."""
    user_config.write_text(
        user_config.read_text()
        .replace('exe_mode: "ge_graph"', 'exe_mode: "eager"')
        .replace("enable_cache_compile: true", "enable_cache_compile: false")
    )
    before = user_config.read_bytes()
    log = "printf 'qwen inference time cost of decode is 2.00 ms\\nqwen inference time cost of decode is 2.50 ms\\n'"
    out = tmp_path / "eager"
    rc, _, err = compare(
        capsys,
        *("--config", str(user_config), "--out", str(out), "--runs", "1", "--warmup", "0"),
        *("--set", "model_config.enable_cache_compile=true", "--cmd-baseline", log, "--cmd-optimized", log),
    )
    assert rc == 0, err
    assert user_config.read_bytes() == before
    for side in ("baseline", "optimized"):  # each side runs its copy plus the --set overrides
        cfg = load_config(out / f"{side}.yaml", ["model_config.enable_cache_compile=true"])
        assert cfg.model_config.exe_mode == "ge_graph" and cfg.model_config.enable_cache_compile


# ----------------------------------------------------------------------------- --from-logs
# cann-recipes-infer's own lines, with what its loggers put around them.
UPSTREAM_BASE = """\
[2025-06-01 10:00:00] [INFO] [rank 0] qwen3_8b inference time cost of prefill is 41.12 ms
[2025-06-01 10:00:01] [INFO] [rank 0] qwen3_8b inference time cost of decode is 10.00 ms
[2025-06-01 10:00:01] [INFO] [rank 0] qwen3_8b inference time cost of decode is 10.20 ms\r
\x1b[32mqwen3_8b inference time cost of decode is 9.80ms\x1b[0m
qwen3_8b inference time cost of decode is 10.00 ms
qwen3_8b inference time cost of decode is 30.00 ms
qwen3_8b average inference time cost is 14.00 ms
"""
# sorted 9.8 10.0 10.0 10.2 30.0: Q1 = 10.0, Q3 = 10.2, limit 10.5 -> 30.0 dropped, mean 10.0
UPSTREAM_OPT = """\
qwen3_8b inference time cost of prefill is 40.00 ms
qwen3_8b decode average inference time cost is 8.00 ms
"""


def test_from_logs_upstream_format(tmp_path, user_config, capsys):
    base, opt = tmp_path / "base.log", tmp_path / "opt.log"
    base.write_text(UPSTREAM_BASE)
    opt.write_text(UPSTREAM_OPT)
    out = tmp_path / "parsed"
    rc, _stdout, err = compare(
        capsys, "--config", str(user_config), "--from-logs", str(base), str(opt), "--out", str(out)
    )
    assert rc == 0, err
    s = json.loads((out / "results.json").read_text())["summary"]
    assert s["baseline"]["step_ms"] == pytest.approx(10.0)
    assert s["optimized"]["step_ms"] == pytest.approx(8.0)
    assert (s["baseline"]["prefill_ms"], s["optimized"]["prefill_ms"]) == (41.12, 40.0)
    assert (s["baseline"]["tokens_per_s"], s["optimized"]["tokens_per_s"]) == (
        pytest.approx(100.0),
        pytest.approx(125.0),
    )
    assert s["latency_improvement_percent"] == pytest.approx(20.0)
    assert s["throughput_gain_percent"] == pytest.approx(25.0)
    assert s["exceeds_noise"] is False  # one run a side: no noise estimate, no claim
    report = (out / "superkernel_optimization_report.md").read_text()
    assert "portable measurement" not in report.splitlines()[2]  # the logs may come from an A3
    assert "qwen3_8b" in report
    checks = {c["item"]: c["status"] for c in json.loads((out / "results.json").read_text())["checklist"]}
    assert checks["prefill and decode are separate"] == "PASS"
    assert checks["SuperKernel really ran in the optimized runs"] == "WARN"
    opt.write_text("qwen3_8b average inference time cost is 8.00 ms\n")  # no prefill line
    rc, _, err = compare(capsys, "--config", str(user_config), "--from-logs", str(base), str(opt), "--out", str(out))
    assert rc == 2 and "already holds a run" in err  # a comparison never overwrites another one's results
    out2 = tmp_path / "parsed_again"
    rc, _, _ = compare(capsys, "--config", str(user_config), "--from-logs", str(base), str(opt), "--out", str(out2))
    checks = {c["item"]: c["status"] for c in json.loads((out2 / "results.json").read_text())["checklist"]}
    assert rc == 0 and checks["prefill and decode are separate"] == "WARN"


def test_fewer_threads_counts_the_steps_below_the_run_thread_count():
    def metrics(enabled: bool, counts: dict, tiny: bool = False) -> dict:
        gov = {"enabled": enabled, "one_thread_tiny_step": tiny, "steps_per_thread_count": counts}
        return {"threads": 2, "thread_governor": gov}

    assert measure.fewer_threads(metrics(True, {"2": 40, "1": 8})) == 8
    assert measure.fewer_threads(metrics(True, {"2": 48})) == 0
    assert measure.fewer_threads(metrics(False, {"2": 48})) is None  # governor off: nothing to say
    assert measure.fewer_threads(metrics(True, {"1": 48}, tiny=True)) is None  # one thread by design, not a busy host
    assert measure.fewer_threads({"threads": 2}) is None  # metrics.json of an older run


# ----------------------------------------------------------------------------- errors
def test_error_paths_exit_2(tmp_path, user_config, capsys):
    good = tmp_path / "good.log"
    good.write_text(UPSTREAM_OPT)
    missing = tmp_path / "missing.log"
    rc, _, err = compare(capsys, "--from-logs", str(missing), str(good), "--out", str(tmp_path / "o"))
    assert rc == 2 and err.startswith("error:") and str(missing) in err
    no_timing = tmp_path / "prefill_only.log"
    no_timing.write_text("qwen3_8b inference time cost of prefill is 41.12 ms\nloading weights...\n")
    rc, _, err = compare(capsys, "--from-logs", str(good), str(no_timing), "--out", str(tmp_path / "o"))
    assert rc == 2 and str(no_timing) in err and "no decode timing" in err
    rc, _, err = compare(capsys, "--model", "no_such_model")
    assert rc == 2 and "no_such_model" in err and "qwen" in err
    rc, _, err = compare(capsys, "--config", str(user_config), "--set", "model_config.enable_superkernel=true")
    assert rc == 2 and "--plan" in err
    rc, _, err = compare(capsys, "--config", str(user_config), "--plan", "custom", "--out", str(tmp_path / "o"))
    assert rc == 2 and "custom" in err  # invalid optimized side: refused before any run
    assert not list((tmp_path / "o").glob("*.log"))


def test_require_a3_and_help_via_script(tmp_path, user_config):
    before = user_config.read_bytes()
    res = subprocess.run(
        [sys.executable, str(TOOL), "--config", str(user_config), "--require-a3", "--out", str(tmp_path / "a3")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2
    assert res.stderr.startswith("error: --require-a3") and "not an Atlas A3" in res.stderr
    assert not (tmp_path / "a3").exists() and user_config.read_bytes() == before
    res = subprocess.run(
        [sys.executable, str(TOOL), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0
    for flag in (
        "--runs",
        "--warmup",
        "--plan",
        "--set",
        "--cmd-baseline",
        "--cmd-optimized",
        "--from-logs",
        "--require-a3",
    ):
        assert flag in res.stdout
