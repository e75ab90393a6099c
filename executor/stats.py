"""Statistics over repeated benchmark runs (sk_compare, scope_search).

The SuperKernel workflow asks for 3-5 runs per side, the decode-step latency, the
improvement (base - opt) / base, and a stability verdict from the coefficient of
variation. These helpers implement exactly that, plus one guard the workflow leaves
implicit: a speedup smaller than the noise is not a speedup. With several runs a side the
noise is the run-to-run spread (`exceeds_noise`); with one run a side (two upstream logs) it
is the step-to-step spread of the per-step samples (`per_step_difference`);
`judge_difference` picks the method and says which one decided.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import numpy as np

__all__ = [
    "cv_percent",
    "exceeds_noise",
    "improvement_percent",
    "judge_difference",
    "median",
    "per_step_difference",
    "stability_verdict",
    "throughput_gain_percent",
]


def _floats(xs, what: str) -> list[float]:
    vals = [float(x) for x in xs]
    if not vals:
        raise ValueError(f"{what} needs at least one value")
    return vals


def _std(vals: list[float]) -> float:
    """Sample standard deviation (ddof=1); 0.0 with fewer than 2 values."""
    return statistics.stdev(vals) if len(vals) >= 2 else 0.0


def median(xs) -> float:
    """Median: one slow run (a cold cache, a busy host) must not move the summary."""
    return float(statistics.median(_floats(xs, "median")))


def cv_percent(xs) -> float:
    """Coefficient of variation in percent, sample std (ddof=1) / mean * 100.

    0.0 for fewer than 2 values: one run shows no spread (the verdict then says nothing
    about stability, which is why callers should do 3-5 runs).
    """
    vals = [float(x) for x in xs]
    if len(vals) < 2:
        return 0.0
    mean = statistics.fmean(vals)
    std = _std(vals)
    if std == 0.0:
        return 0.0
    if mean == 0.0:
        raise ValueError("cv_percent: mean is zero, the coefficient of variation is undefined")
    return std / abs(mean) * 100.0


def stability_verdict(cv: float) -> str:
    """The workflow's bands: <5 excellent, [5, 10) good, [10, 20] fair, >20 poor."""
    if cv < 5.0:
        return "excellent"
    if cv < 10.0:
        return "good"
    if cv <= 20.0:
        return "fair"
    return "poor"


def improvement_percent(base: float, opt: float) -> float:
    """Latency improvement (base - opt) / base * 100; positive means opt is faster."""
    if base <= 0:
        raise ValueError(f"improvement_percent: base latency must be > 0, got {base}")
    return (base - opt) / base * 100.0


def throughput_gain_percent(base_tps: float, opt_tps: float) -> float:
    """Throughput gain (opt - base) / base * 100; positive means opt is faster."""
    if base_tps <= 0:
        raise ValueError(f"throughput_gain_percent: base throughput must be > 0, got {base_tps}")
    return (opt_tps - base_tps) / base_tps * 100.0


def exceeds_noise(base_runs: Sequence[float], opt_runs: Sequence[float]) -> bool:
    """Whether the two sides differ by more than run-to-run noise.

    Rule: |median(opt) - median(base)| > 2 * max(std(base), std(opt)) (sample std), and,
    when each side has >= 3 runs, the two ranges [min, max] do not overlap (touching counts
    as overlap).

    Why: medians ignore a single bad run; 2x the noisier side's std means a gap that noise
    alone rarely produces, and using the larger std keeps one jittery side from hiding
    behind a quiet one. With 3+ runs a side, disjoint ranges add a distribution-free check
    (by chance alone 3 vs 3 separate completely 10% of the time). With fewer than 2 runs on
    both sides there is no noise estimate at all, so no difference can be shown to exceed
    it and the answer is False.
    """
    base = _floats(base_runs, "exceeds_noise (base_runs)")
    opt = _floats(opt_runs, "exceeds_noise (opt_runs)")
    if len(base) < 2 and len(opt) < 2:
        return False
    noise = max(_std(base), _std(opt), 1e-9)
    if abs(median(opt) - median(base)) <= 2.0 * noise:
        return False
    return not (len(base) >= 3 and len(opt) >= 3 and not (max(opt) < min(base) or max(base) < min(opt)))


BOOTSTRAP_RESAMPLES = 4000
BOOTSTRAP_SEED = 0  # fixed: the same logs always give the same verdict
MIN_STEPS = 5  # fewer per-step samples a side than this give no usable interval of the median


def per_step_difference(base_steps: Sequence[float], opt_steps: Sequence[float], level: float = 0.95) -> dict:
    """Bootstrap interval of median(opt) - median(base) over per-step samples (ms).

    Why a bootstrap of the median: decode-step times are skewed (a step is only ever slowed
    down), medians ignore the odd slow step, and the percentile bootstrap needs no assumption
    about the distribution. The samples of each side are resampled independently
    (BOOTSTRAP_RESAMPLES times, seed BOOTSTRAP_SEED); the difference is real at `level` when the
    interval excludes 0. Callers pass the samples after the IQR rule. What it cannot see: a
    whole run being slower than another (machine state), which only several runs a side show.
    """
    b = np.asarray(_floats(base_steps, "per_step_difference (base)"))
    o = np.asarray(_floats(opt_steps, "per_step_difference (opt)"))
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    boot_b = np.median(b[rng.integers(0, len(b), size=(BOOTSTRAP_RESAMPLES, len(b)))], axis=1)
    boot_o = np.median(o[rng.integers(0, len(o), size=(BOOTSTRAP_RESAMPLES, len(o)))], axis=1)
    tail = (1.0 - level) / 2 * 100
    low, high = (float(x) for x in np.percentile(boot_o - boot_b, [tail, 100 - tail]))
    return {
        "difference_ms": float(np.median(o) - np.median(b)),
        "interval_ms": [low, high],
        "level": level,
        "exceeds_noise": low > 0 or high < 0,
        "samples": [len(b), len(o)],
    }


def judge_difference(
    base_runs: Sequence[float],
    opt_runs: Sequence[float],
    base_steps: Sequence[float] = (),
    opt_steps: Sequence[float] = (),
) -> dict:
    """Is opt different from base beyond noise, and by which method? (exceeds_noise, method, detail)

    - 2+ runs on both sides: the run-to-run rule (`exceeds_noise`), the workflow's own;
    - otherwise, with >= MIN_STEPS per-step samples a side (after the IQR rule, pooled over the
      runs): the per-step bootstrap (`per_step_difference`);
    - otherwise (one run a side and only an average line in a log): `exceeds_noise`, which can
      only show a difference when one side has several runs; the method says so.
    """
    if len(base_runs) >= 2 and len(opt_runs) >= 2:
        rule = "|median difference| > 2 x the larger run std" + (
            " and the run ranges do not overlap" if len(base_runs) >= 3 and len(opt_runs) >= 3 else ""
        )
        return {
            "exceeds_noise": exceeds_noise(base_runs, opt_runs),
            "method": f"run-to-run ({len(base_runs)} vs {len(opt_runs)} runs): {rule}",
        }
    if len(base_steps) >= MIN_STEPS and len(opt_steps) >= MIN_STEPS:
        d = per_step_difference(base_steps, opt_steps)
        low, high = d["interval_ms"]
        return {
            "exceeds_noise": d["exceeds_noise"],
            "method": (
                f"per-step bootstrap ({len(base_steps)} vs {len(opt_steps)} decode steps after the IQR rule; fewer "
                f"than 2 runs a side): 95% interval of the median difference [{low:+.3f}, {high:+.3f}] ms "
                f"{'excludes' if d['exceeds_noise'] else 'includes'} 0 (step-to-step noise only; run-to-run "
                "variation needs --runs 2 or more)"
            ),
            "per_step": d,
        }
    return {
        "exceeds_noise": exceeds_noise(base_runs, opt_runs),
        "method": (
            f"run-to-run ({len(base_runs)} vs {len(opt_runs)} runs) without per-step samples: a side with one run "
            "and no per-step lines gives no noise estimate"
        ),
    }
