"""benchmarks/perf_samples.py and `step_profile.py --perf`: how perf's samples are named and summed,
the errors without perf, and (where perf can attach here) a real profile of the eager CPU step."""

import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from benchmarks.perf_samples import PerfError, PerfRecorder, group, rows, tally

ROOT = Path(__file__).resolve().parent.parent
INDUCTOR = "/root/.cache/x/compile/inductor-8ab5/ay/caydqtmrfkdqqfosjo25bpegxtqdv6rm7ot6mwbgjhpf2jddb567.main.so"


@pytest.mark.parametrize(
    ("dso", "expected"),
    [
        (f"({INDUCTOR})", "Inductor's kernels"),
        ("(/tmp/x/qi/cqinpnremtkhjuopy7nm23we6upzkzsz4fk4p7ddynh3fgpn6cd7.so)", "Inductor's kernels"),
        (
            "(/root/.cache/cann-recipes-infer/extensions/cann_cpu_rows_linear-79eb/cann_cpu_rows_linear.so)",
            "cann_cpu_rows_linear",
        ),
        ("(/tmp/perf-11665.map)", "JIT or unnamed code (oneDNN)"),
        ("([unknown])", "JIT or unnamed code (oneDNN)"),
        ("(/venv/lib/python3.11/site-packages/torch/lib/libgomp.so.1)", "libgomp (barriers, waits)"),
        ("(/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0)", "Python"),
        ("([kernel.kallsyms])", "kernel"),
        ("(/venv/torch/lib/libtorch_cpu.so)", "libtorch_cpu"),
        ("(/usr/lib/x86_64-linux-gnu/libc.so.6)", "libc"),
        ("(/usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.30)", "libstdc++"),
    ],
)
def test_each_shared_object_lands_in_its_row(dso, expected):
    assert group(dso) == expected


def test_samples_are_summed_by_their_period_per_thread():
    script = "\n".join(
        [
            f"  100     500000      7fe496e1de62 ({INDUCTOR})",
            "  100     250000      7fe497dabab9 (/lib/libpython3.11.so.1.0)",
            f"  100     250000      7fe496e1de00 ({INDUCTOR})",
            "  101    1000000      7fe496e1de62 (/torch/lib/libgomp.so.1)",
            "not a sample line",
            "",
        ]
    )
    counts = tally(script)
    assert counts == {
        100: Counter({"Inductor's kernels": 750_000, "Python": 250_000}),
        101: Counter({"libgomp (barriers, waits)": 1_000_000}),
    }


def test_rows_put_the_main_thread_first_and_drop_stray_threads():
    counts = {
        7: Counter({"libgomp (barriers, waits)": 3_000_000, "Inductor's kernels": 1_000_000}),
        5: Counter({"Inductor's kernels": 3_000_000, "Python": 1_000_000}),  # the main thread: fewer ns, first
        9: Counter({"Python": 50_000}),  # under 1% of all samples: a stray thread
    }
    out = rows(counts, main_tid=5, steps=2, top=5)
    assert out == [
        ("main", "Inductor's kernels", 1.5, 0.75),
        ("main", "Python", 0.5, 0.25),
        ("thread 1", "libgomp (barriers, waits)", 1.5, 0.75),
        ("thread 1", "Inductor's kernels", 0.5, 0.25),
    ]
    top1 = rows(counts, main_tid=5, steps=2, top=1)
    assert [r[1] for r in top1] == ["Inductor's kernels", "libgomp (barriers, waits)"]


def _no_perf_env(tmp_path: Path) -> dict:
    return {**os.environ, "PATH": str(tmp_path)}  # an empty directory: no perf, no anything


def test_without_perf_the_recorder_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(PerfError, match="needs Linux perf on PATH"):
        PerfRecorder(tmp_path / "perf.data")


def test_without_perf_step_profile_fails_before_building_a_model(tmp_path):
    out = subprocess.run(
        [sys.executable, "benchmarks/step_profile.py", "--perf", "--size", "qwen3-0.6b"],
        cwd=ROOT,
        env=_no_perf_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr.strip() == "error: --perf needs Linux perf on PATH (not found); install linux-tools or perf"
    assert "Traceback" not in out.stderr and "== " not in out.stdout


def _perf_can_attach() -> bool:
    exe = shutil.which("perf")
    if exe is None:
        return False
    probe = subprocess.run([exe, "stat", "-e", "cpu-clock", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _perf_can_attach(), reason="Linux perf is not installed or may not profile here")
def test_a_real_profile_of_the_eager_step_accounts_for_its_wall_time():
    import argparse

    from benchmarks.step_profile import profile_mode

    cache = Path.home() / ".debug"  # perf's build-id cache: perf record copies sampled libraries there by default
    cached = sorted(cache.rglob("*")) if cache.exists() else None

    args = argparse.Namespace(
        device="cpu", size="debugmodel", dtype="float32", batch=1, prompt_len=8,
        steps=40, warmup=1, timed=4, trace_dir="", perf=True, top=50,
    )  # fmt: skip
    summary = profile_mode(args, "eager")
    main = [r for r in summary["perf"] if r[0] == "main"]
    assert main, summary["perf"]
    assert sum(share for *_, share in main) == pytest.approx(1.0)
    # the main thread runs the whole step, so its CPU time per step (the profiled steps' total over
    # their count) is at most their mean wall time, and a fair part of it even on a busy machine (in
    # the full suite, 2 workers on 2 cores: 0.29 of it); a wrong period unit or per-step division would
    # be off by 1000x or by the step count (40). Against the median wall it failed once in a full suite
    # on the Intel AMX kind (24.3 CPU ms against a 7.6 ms median): a few slow steps raise the mean only.
    cpu_ms, wall_ms = sum(ms for _, _, ms, _ in main), summary["wall_mean_ms"]
    assert 0.05 * wall_ms < cpu_ms < 1.5 * wall_ms, (cpu_ms, wall_ms, summary["wall_ms"])
    assert any(grp == "Python" for _, grp, _, _ in main)
    assert (sorted(cache.rglob("*")) if cache.exists() else None) == cached  # no copies of the libraries left behind
