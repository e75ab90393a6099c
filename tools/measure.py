"""The one measurement implementation behind sk_compare and scope_search.

A run is the real entry point (`bash infer.sh --model M --config COPY --set ... --out DIR`) or
any shell command whose stdout is a cann-recipes-infer style log. Its output is teed to a log
file, the log is parsed with executor.logs (the same parser whatever wrote the log) and the
run's metrics.json, when there is one, adds what a log cannot say (did SuperKernel really run,
which scopes, peak memory). Runs that fail are kept as failed and never averaged in.

Also here, because both tools need them: the YAML copies each side runs with (the user's file
is only ever read), the per-side statistics, and an in-process accuracy run that compares a
compiled candidate's greedy tokens and logits with the eager run on the same prompts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from executor import stats
from executor.config import ConfigError, RunConfig, load_config
from executor.errors import RecipeError
from executor.logs import LogParseError, iqr_filter, parse_log_file
from executor.paths import REPO_ROOT
from tools.config_edit import write_copy

INFER_SH = REPO_ROOT / "infer.sh"
SK_KEY = "model_config.superkernel"
_KILL_GRACE_S = 5.0  # a child gets this long to exit after SIGTERM before SIGKILL


class MeasureError(RecipeError):
    """A log or run cannot give the numbers asked for; the message names the file."""


# ----------------------------------------------------------------------------- side configs
SWITCH_KEYS = ("model_config.enable_superkernel", "model_config.custom_params.enable_superkernel")


def reject_superkernel_overrides(overrides: list[str], tool: str) -> None:
    """The tools own the SuperKernel switch and plan of each side; a --set on them would silently win."""
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key in SWITCH_KEYS or key.startswith(SK_KEY + "."):
            hint = "use --plan to choose the plan" if tool == "sk_compare" else "the search space chooses the plans"
            raise ConfigError(f"--set {item}: {tool} sets the SuperKernel switch and {SK_KEY}.* itself ({hint})")


def switch_key(cfg: RunConfig) -> str:
    """Where this config keeps enable_superkernel (custom_params only if that is where it is)."""
    mc = cfg.model_config
    if mc.enable_superkernel is None and mc.custom_params.enable_superkernel is not None:
        return SWITCH_KEYS[1]
    return SWITCH_KEYS[0]


def side_changes(cfg: RunConfig, superkernel: dict[str, Any] | None) -> tuple[dict[str, Any], list[str]]:
    """YAML changes for one side and why, in words. superkernel=None means SuperKernel off.

    As the SuperKernel workflow does, a side differs from the user's YAML in the
    `enable_superkernel` line only (wherever the YAML keeps it), plus the plan when one is asked
    for. SuperKernel needs a graph mode, and a baseline is only comparable in the same mode, so
    an eager config runs ge_graph on every side (the workflow's "edit config: exe_mode
    ge_graph"), and the report says so.
    """
    changes: dict[str, Any] = {}
    notes: list[str] = []
    if cfg.model_config.exe_mode == "eager":
        changes["model_config.exe_mode"] = "ge_graph"
        notes.append(
            "model_config.exe_mode: eager -> ge_graph (SuperKernel needs a graph mode; same mode on every side)"
        )
    key, on = switch_key(cfg), superkernel is not None
    if cfg.model_config.superkernel_enabled != on:
        changes[key] = on
    notes.append(f"{key}: {'true' if on else 'false'}")
    for name in ("plan", "options", "custom"):
        if on and name in superkernel:
            changes[f"{SK_KEY}.{name}"] = superkernel[name]
            notes.append(f"{SK_KEY}.{name}: {json.dumps(superkernel[name])}")
    return changes, notes


def write_side_config(src: Path, dst: Path, changes: dict[str, Any], overrides: list[str]) -> RunConfig:
    """Write the side's YAML copy and validate it exactly as the run will load it."""
    write_copy(src, dst, changes)
    return load_config(dst, overrides)


# ----------------------------------------------------------------------------- one run
@dataclass
class Side:
    name: str  # "baseline", "optimized" or a candidate name
    config: Path | None = None  # YAML copy given to infer.sh
    overrides: tuple[str, ...] = ()
    command: str | None = None  # shell command whose stdout is the log, instead of infer.sh


@dataclass
class RunResult:
    side: str
    index: int  # 0 = warm-up, 1..N measured
    ok: bool
    error: str | None
    log: str
    out_dir: str | None
    wall_s: float
    returncode: int | None = None
    step_ms: float | None = None  # decode ms/step, IQR outliers dropped
    decode_ms: list[float] = field(default_factory=list)
    tokens_per_s: float | None = None  # batch_size * 1000 / step_ms
    prefill_ms: float | None = None
    batch_size: int | None = None
    decode_steps: int | None = None
    peak_memory_mb: float | None = None
    model_name: str | None = None  # as the log lines name it
    metrics: dict | None = field(default=None, repr=False)
    steps_dropped: int | None = None  # per-step lines left out of step_ms by the IQR outlier rule
    lines_ignored: int | None = None  # log lines with no timing (what the run printed besides)

    def row(self) -> dict:
        """Flat view for runs.csv / results.json (per-step list and metrics left out)."""
        return {k: v for k, v in asdict(self).items() if k not in ("metrics", "decode_ms")}

    def kept_steps(self) -> list[float]:
        """Per-step decode times after the IQR rule: the samples the per-step judgement uses."""
        return iqr_filter(self.decode_ms)


def infer_command(model: str, config: Path, overrides: tuple[str, ...], out_dir: Path) -> list[str]:
    sets = [arg for item in overrides for arg in ("--set", item)]
    return ["bash", str(INFER_SH), "--model", model, "--config", str(config), *sets, "--out", str(out_dir)]


def parse_run(
    side: str,
    index: int,
    log: Path,
    out_dir: Path | None,
    batch_hint: int | None,
    wall_s: float = 0.0,
    returncode: int | None = 0,
) -> RunResult:
    """Numbers of one finished run from its log (+ metrics.json); raises MeasureError."""
    try:
        parsed = parse_log_file(log)
        parsed.check_timings()  # a negative, zero, infinite or NaN time is refused, never averaged in
        step = parsed.step_ms()
    except LogParseError as exc:
        raise MeasureError(str(exc)) from None
    metrics = None
    if out_dir is not None and (out_dir / "metrics.json").is_file():
        metrics = json.loads((out_dir / "metrics.json").read_text())
    batch = parsed.batch_size or (metrics or {}).get("batch_size") or batch_hint or 1
    return RunResult(
        side,
        index,
        True,
        None,
        str(log),
        None if out_dir is None else str(out_dir),
        wall_s,
        returncode,
        step,
        list(parsed.decode_ms),
        batch * 1000.0 / step if step > 0 else None,
        parsed.prefill_ms,
        batch,
        parsed.decode_steps or (len(parsed.decode_ms) or None),
        (metrics or {}).get("peak_memory_mb"),
        parsed.model_name,
        metrics,
        len(parsed.decode_ms) - len(iqr_filter(parsed.decode_ms)),
        parsed.lines_ignored,
    )


def _last_error(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("error:") or "Error" in ln.split(":", 1)[0]:
            return ln[:300]
    return lines[-1][:300] if lines else "no output"


def _stop(proc: subprocess.Popen) -> None:
    """End the child's whole process group (it runs in its own session), politely first."""
    for sig, wait in ((signal.SIGTERM, _KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_once(
    model: str, side: Side, index: int, work_dir: Path, batch_hint: int | None, echo: bool = False
) -> RunResult:
    """Run one side once, teeing its output to `<side>.<index>.log` (`<side>.warmup.log`)."""
    tag = "warmup" if index == 0 else str(index)
    log = work_dir / f"{side.name}.{tag}.log"
    out_dir = work_dir / "runs" / f"{side.name}.{tag}"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.json").unlink(missing_ok=True)  # a resumed job must never read an older run's
    if side.command:
        cmd = ["bash", "-c", side.command]
    else:
        cmd = infer_command(model, side.config, side.overrides, out_dir)
    env = dict(os.environ, PYTHONUNBUFFERED="1", SK_SIDE=side.name, SK_RUN=str(index), SK_OUT=str(out_dir))
    t0 = time.monotonic()
    with log.open("w") as fh:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            cwd=REPO_ROOT,
            env=env,
            start_new_session=True,
        )
        try:
            for line in proc.stdout:
                check_interrupt()
                fh.write(line)
                fh.flush()
                if echo:
                    sys.stdout.write(f"  [{side.name} {tag}] {line}")
            rc = proc.wait()
            check_interrupt()
        except BaseException:  # Ctrl-C / SIGTERM: never leave a run behind us
            _stop(proc)
            raise
        finally:
            proc.stdout.close()
    wall = time.monotonic() - t0
    if rc != 0:
        return RunResult(
            side.name, index, False, f"exit code {rc}: {_last_error(log)}", str(log), str(out_dir), wall, rc
        )
    try:
        return parse_run(side.name, index, log, out_dir, batch_hint, wall, rc)
    except MeasureError as exc:
        return RunResult(side.name, index, False, str(exc), str(log), str(out_dir), wall, rc)


class Progress:
    """One line per event on stderr, with the elapsed time: unattended jobs are watched by log."""

    def __init__(self, tool: str, stream=None):
        self.tool, self.t0, self.stream = tool, time.monotonic(), stream or sys.stderr

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def __call__(self, msg: str) -> None:
        e = int(self.elapsed())
        print(f"[{self.tool} {e // 3600}:{e // 60 % 60:02d}:{e % 60:02d}] {msg}", file=self.stream, flush=True)


def _describe(r: RunResult) -> str:
    if not r.ok:
        return f"FAILED after {r.wall_s:.1f} s ({r.error})"
    return f"{r.step_ms:.3f} ms/step, {r.tokens_per_s:.1f} tokens/s ({r.wall_s:.1f} s)"


def measure(
    model: str,
    sides: list[Side],
    runs: int,
    warmup: int,
    work_dir: Path,
    progress: Progress,
    batch_hint: int | None = None,
    echo: bool = False,
) -> dict[str, list[RunResult]]:
    """Warm-up runs, then `runs` measured rounds alternating the sides (drift hits all alike).

    Warm-up runs fill the compile cache and the OS page cache; their numbers are kept in the
    results (index 0) but never enter the statistics.
    """
    results: dict[str, list[RunResult]] = {s.name: [] for s in sides}
    plan = [(s, 0, f"warm-up {w + 1}/{warmup}") for w in range(warmup) for s in sides]
    plan += [(s, k, f"run {k}/{runs}") for k in range(1, runs + 1) for s in sides]
    for side, index, what in plan:
        check_interrupt()
        progress(f"{side.name} {what} ...")
        r = run_once(model, side, index, work_dir, batch_hint, echo)
        progress(f"{side.name} {what}: {_describe(r)}")
        results[side.name].append(r)
    return results


# ----------------------------------------------------------------------------- statistics
def fmt(x, spec: str = ".3f", suffix: str = "", missing: str = "n/a") -> str:
    """A number for a report table; `missing` where there is none (failed or not measured)."""
    return missing if x is None else f"{x:{spec}}{suffix}"


def fewer_threads(metrics: dict) -> int | None:
    """Decode steps of a run that ran on fewer intra-op threads than it started with (the host
    was busy; executor/threads.py); None when its thread governor was off (not a CPU run, several
    ranks, one thread), ran a tiny step on one thread untouched, or the metrics predate it."""
    gov = metrics.get("thread_governor") or {}
    if not gov.get("enabled") or gov.get("one_thread_tiny_step"):
        return None
    return sum(n for threads, n in gov["steps_per_thread_count"].items() if int(threads) < metrics["threads"])


def summarise(results: list[RunResult]) -> dict:
    """Per-side statistics over the measured (index >= 1), successful runs."""
    measured = [r for r in results if r.index >= 1]
    ok = [r for r in measured if r.ok]
    out: dict[str, Any] = {
        "runs": len(measured),
        "ok_runs": len(ok),
        "failed_runs": len(measured) - len(ok),
        "errors": [r.error for r in measured if not r.ok],
    }
    if not ok:
        return out | {"step_ms": None}
    steps = [r.step_ms for r in ok]
    samples = [x for r in ok for x in r.kept_steps()]  # per-step, pooled over the runs
    cv = stats.cv_percent(steps)
    prefills = [r.prefill_ms for r in ok if r.prefill_ms is not None]
    step = stats.median(steps)
    return out | {
        "step_ms": step,
        "step_ms_runs": steps,
        "step_ms_samples": samples,
        "step_ms_min": min(steps),
        "step_ms_max": max(steps),
        "cv_percent": cv,
        "stability": stats.stability_verdict(cv) if len(ok) >= 2 else "unknown (1 run)",
        # from the median step, so the two columns of a report always agree with each other
        "tokens_per_s": (ok[0].batch_size or 1) * 1000.0 / step if step > 0 else None,
        "prefill_ms": stats.median(prefills) if prefills else None,
        "peak_memory_mb": max((r.peak_memory_mb for r in ok if r.peak_memory_mb is not None), default=None),
        "steps_on_fewer_threads": steps_on_fewer_threads([r.metrics for r in ok if r.metrics]),
    }


def steps_on_fewer_threads(runs: list[dict]) -> int | None:
    """`fewer_threads` summed over runs' metrics; None when no run had the governor on."""
    known = [n for n in map(fewer_threads, runs) if n is not None]
    return sum(known) if known else None


def compare(base: list[RunResult], opt: list[RunResult]) -> dict:
    """Improvement of `opt` over `base` and whether it is beyond run-to-run noise."""
    sb, so = summarise(base), summarise(opt)
    out: dict[str, Any] = {"baseline": sb, "optimized": so}
    if sb["step_ms"] is None or so["step_ms"] is None:
        return out | {
            "latency_improvement_percent": None,
            "throughput_gain_percent": None,
            "speedup": None,
            "exceeds_noise": None,
            "noise_method": None,
        }
    judged = judge(sb, so)
    return out | {
        "latency_improvement_percent": stats.improvement_percent(sb["step_ms"], so["step_ms"]),
        "throughput_gain_percent": (
            stats.throughput_gain_percent(sb["tokens_per_s"], so["tokens_per_s"])
            if sb["tokens_per_s"] and so["tokens_per_s"]
            else None
        ),
        "speedup": sb["step_ms"] / so["step_ms"],
        "exceeds_noise": judged["exceeds_noise"],
        "noise_method": judged["method"],
    }


def judge(base: dict, opt: dict) -> dict:
    """stats.judge_difference on two `summarise` results: run-to-run with 2+ runs a side, else
    per-step samples; the returned `method` says which decided."""
    return stats.judge_difference(
        base["step_ms_runs"], opt["step_ms_runs"], base.get("step_ms_samples", ()), opt.get("step_ms_samples", ())
    )


# ----------------------------------------------------------------------------- accuracy
# Cosine floor per dtype. fp32: a different kernel schedule (fusion, reordered reductions)
# moves logits by ~1e-6 relative, so 0.999 only trips on a real error. bf16 keeps ~3 decimal
# digits per value, so a faithful graph still drifts to ~0.995 over a few decode steps.
COSINE_MIN = {"float32": 0.999, "bfloat16": 0.99, "float16": 0.99}


def decode_path_ppl(runner, text: str, tokens: int) -> float:
    """Perplexity of the first `tokens` tokens of `text` through the runner's DECODE path (one
    token at a time through its compiled step); on several ranks every rank calls this and
    gets the whole batch's value."""
    from executor import accuracy

    ids = runner.tokenizer.encode(text)[:tokens]
    if len(ids) < 2:
        raise ConfigError("--text: the evaluation text has fewer than 2 tokens")
    wins = accuracy.windows(ids, runner.max_len)
    return accuracy.perplexity_decode(runner, wins, runner.cfg.scheduler_config.batch_size).ppl


def generate_in_process(
    runner_cls,
    cfg: RunConfig,
    platform,
    max_new_tokens: int,
    prompt_ids: list[list[int]] | None = None,
    ppl_text: str | None = None,
    ppl_tokens: int = 256,
):
    """Build the recipe's runner for `cfg` here, in this process, and greedy-decode once; with
    `ppl_text`, also the perplexity of its first `ppl_tokens` tokens through the DECODE path (one token at a time
    through the same compiled step, so what a SuperKernel scope computes is what is measured).

    Returns (Generation, regions, prompt_ids, ppl or None). Used for the accuracy check, which
    needs the logits that a log cannot carry; the decode step is compiled exactly as a run
    compiles it.
    """
    import io

    from executor.memory import forget_runners

    runner = runner_cls(cfg, platform, None, io.StringIO())
    try:
        prompt_ids = prompt_ids or runner.encode_prompts()
        gen = runner.generate(prompt_ids, max_new_tokens)
        ppl = None if ppl_text is None else decode_path_ppl(runner, ppl_text, ppl_tokens)
        return gen, runner.model.regions(), prompt_ids, ppl
    finally:
        del runner
        forget_runners()  # the compiled step and the runner's memory freed before the next candidate


def generate(
    model: str,
    runner_cls,
    config: Path,
    overrides: list[str],
    platform,
    max_new_tokens: int,
    prompt_ids: list[list[int]] | None = None,
    work_dir: Path | None = None,
    ppl_text: str | None = None,
    ppl_tokens: int = 256,
):
    """generate_in_process for a one-device config; for several devices the same through
    torchrun (generate_ranks), since the ranks cannot share this process. Same return value."""
    cfg = load_config(config, overrides)
    world = cfg.parallel_config.world_size
    if world == 1:
        return generate_in_process(runner_cls, cfg, platform, max_new_tokens, prompt_ids, ppl_text, ppl_tokens)
    job = {"model": model, "config": str(config), "overrides": list(overrides), "tokens": max_new_tokens}
    job |= {"prompt_ids": prompt_ids, "ppl_text": ppl_text, "ppl_tokens": ppl_tokens}
    (result,) = generate_ranks([job], world, platform, work_dir or Path(tempfile.mkdtemp(prefix="ranks_")))
    return as_generation(result), as_regions(result), result["prompt_ids"], result["ppl"]


def generate_ranks(jobs: list[dict], world_size: int, platform, work_dir: Path) -> list[dict]:
    """Run `jobs` ({model, config, overrides, tokens, prompt_ids}) one after another on `world_size`
    ranks started by torchrun (tools/rank_generate.py); rank 0's result per job: the batch's
    tokens and logits and what the decode step reported (a job with an `accuracy` entry: the
    accuracy tool's candidate side instead). Rank logs are in `work_dir`."""
    import torch

    from executor.parallel import launch

    for job in jobs:  # a bad config is this process's one-line error, not every rank's
        load_config(job["config"], job["overrides"])
    work_dir.mkdir(parents=True, exist_ok=True)
    jobs = [dict(job, save=str(work_dir / f"job_{i}.pt")) for i, job in enumerate(jobs)]
    spec = work_dir / "jobs.json"
    spec.write_text(json.dumps({"out": str(work_dir), "jobs": jobs}))
    plan = launch.plan(world_size, "", platform, "tools.rank_generate", ["--jobs", str(spec)])
    if launch.launch(plan, work_dir) != 0:
        raise MeasureError(f"{world_size}-rank run failed (rank logs in {work_dir})")
    return [torch.load(job["save"]) for job in jobs]


def as_generation(result: dict):
    """A rank_generate result as the runner's Generation."""
    from executor.runner import Generation

    fields = ("prompt_ids", "token_ids", "prefill_ms", "decode_ms", "first_logits", "last_logits")
    return Generation(*(result[f] for f in fields))


def as_regions(result: dict) -> list:
    from executor.scope import Region

    return [Region(*r) for r in result["regions"]]


def check_accuracy(
    ref, cand, tokens: int, cosine_min: float, ppl: tuple[float, float] | None = None, ppl_max_diff: float = 0.10
) -> dict:
    """Greedy tokens identical for the first `tokens` tokens, logits cosine >= cosine_min, and,
    given `ppl` = (reference, candidate) decode-path perplexities, |relative difference| below
    `ppl_max_diff` (the accuracy tool's gate, executor/accuracy.py).

    Both the prefill logits and the last decode step's logits are compared (row-wise, the
    minimum over the batch): the prefill ones catch a wrong setup, the decode ones a wrong
    compiled step.
    """
    import torch.nn.functional as F

    from executor.accuracy import relative_difference

    mismatch = None
    for row_ref, row_cand in zip(ref.token_ids, cand.token_ids):
        for i, (a, b) in enumerate(zip(row_ref[:tokens], row_cand[:tokens])):
            if a != b and (mismatch is None or i < mismatch):
                mismatch = i
                break
    cos = [
        float(F.cosine_similarity(a.float(), b.float(), dim=-1).min())
        for a, b in ((ref.first_logits, cand.first_logits), (ref.last_logits, cand.last_logits))
    ]
    diff = relative_difference(ppl[1], ppl[0]) if ppl else None
    why = []
    if mismatch is not None:
        why.append(f"greedy tokens differ from eager at token {mismatch}")
    if not min(cos) >= cosine_min:
        why.append(f"logits cosine {min(cos):.6f} < {cosine_min}")
    if diff is not None and not abs(diff) < ppl_max_diff:
        why.append(f"decode-path PPL differs by {100 * diff:+.2f}% (limit {100 * ppl_max_diff:g}%)")
    return {
        "passed": not why,
        "tokens_checked": tokens,
        "first_mismatch": mismatch,
        "cosine_prefill": cos[0],
        "cosine_last_step": cos[1],
        "cosine_worst": min(cos),
        "cosine_min": cosine_min,
        "ppl_reference": ppl[0] if ppl else None,
        "ppl": ppl[1] if ppl else None,
        "ppl_diff": diff,
        "reason": "; ".join(why) or "ok",
    }


# ----------------------------------------------------------------------------- signals
_pending_signal: int | None = None


@contextlib.contextmanager
def signals_as_interrupt() -> Iterator[None]:
    """SIGINT and SIGTERM (a killed job) unwind as KeyboardInterrupt, so `finally` blocks stop
    children and save state, and the interrupt sticks until the block ends.

    Sticky because Python can lose one: a signal handled while a finalizer or a weakref callback
    runs raises inside it, and the interpreter prints "Exception ignored" and goes on. A full
    suite run once saw Ctrl-C dropped that way and the job start its next run. `check_interrupt`
    (per output line and before each run) raises it again, and leaving the block raises it if
    nothing did.
    """
    global _pending_signal

    def handler(signum, frame):
        global _pending_signal
        _pending_signal = signum
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    _pending_signal = None
    try:
        yield
        check_interrupt()
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        _pending_signal = None


def check_interrupt() -> None:
    """Raise KeyboardInterrupt again if a signal arrived inside `signals_as_interrupt` and was lost."""
    if _pending_signal is not None:
        raise KeyboardInterrupt(f"signal {_pending_signal}")


# ----------------------------------------------------------------------------- plots
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: works on headless machines and inside tests
    import matplotlib.pyplot as plt

    return plt


def plot_steps(path: Path, results: dict[str, list[RunResult]], title: str) -> Path:
    """Per-step decode latency of every measured run, one colour per side."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (name, runs) in enumerate(results.items()):
        for j, r in enumerate(x for x in runs if x.ok and x.index >= 1 and x.decode_ms):
            ax.plot(
                range(1, len(r.decode_ms) + 1),
                r.decode_ms,
                color=f"C{i}",
                alpha=0.8 if j == 0 else 0.4,
                marker=".",
                label=name if j == 0 else None,
            )
    ax.set(xlabel="decode step", ylabel="ms", title=title)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_medians(path: Path, summaries: dict[str, dict], title: str) -> Path:
    """Median ms/step per side with the run-to-run spread (min..max) and each run as a dot."""
    plt = _pyplot()
    names = [n for n, s in summaries.items() if s.get("step_ms") is not None]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.3 * len(names) + 2), 4.5))
    for i, n in enumerate(names):
        s = summaries[n]
        ax.bar(
            i,
            s["step_ms"],
            color=f"C{i % 10}",
            alpha=0.7,
            yerr=[[s["step_ms"] - s["step_ms_min"]], [s["step_ms_max"] - s["step_ms"]]],
            capsize=6,
        )
        ax.scatter([i] * len(s["step_ms_runs"]), s["step_ms_runs"], color="k", s=12, zorder=3)
    ax.set_xticks(
        range(len(names)), names, rotation=20 if len(names) > 3 else 0, ha="right" if len(names) > 3 else "center"
    )
    ax.set(ylabel="decode ms/step (median; whiskers: run min..max)", title=title)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
