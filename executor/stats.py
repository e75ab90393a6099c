"""Statistics over repeated benchmark runs (sk_compare, scope_search).

The SuperKernel workflow asks for 3-5 runs per side, the decode-step latency, the
improvement (base - opt) / base, and a stability verdict from the coefficient of
variation. These helpers implement exactly that, plus one guard the workflow leaves
implicit: a speedup smaller than the run-to-run noise is not a speedup.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

__all__ = [
    "cv_percent",
    "exceeds_noise",
    "improvement_percent",
    "median",
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
