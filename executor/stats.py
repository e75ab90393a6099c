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

import math
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
    "rank_test_p",
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


MAD_TO_STD = 1.4826  # a normal sample's median absolute deviation times this estimates its std
RANK_TEST_P = 0.10  # two-sided; the smallest p that 3 runs against 3 can reach (they separate completely)


def _spread(vals: list[float]) -> float:
    """A side's run-to-run noise, with a single bad run not counted as noise.

    Why: on a shared VM a whole process now and then runs 1.5-2.5x slow. The plain std of the
    runs then measures that one process, and the rule below asked the medians to differ by twice
    it: 3 of 3 optimized runs 30% faster than 3 of 3 baseline runs got no verdict, and the more
    runs a user added, the likelier a slow one and the rarer a verdict (benchmarks/verdict_bench.py).
    So: 2 runs, their std (nothing to leave out); 3-4 runs, the std of the runs left after
    dropping the one farthest from the median, as the median itself ignores it; 5 or more, the
    median absolute deviation scaled to a std, which ignores up to half the runs.
    """
    if len(vals) >= 5:
        mid = statistics.median(vals)
        return MAD_TO_STD * statistics.median(abs(x - mid) for x in vals)
    if len(vals) >= 3:
        mid = statistics.median(vals)
        rest = sorted(vals, key=lambda x: abs(x - mid))[:-1]
        return _std(rest)
    return _std(vals)


def rank_test_p(a: Sequence[float], b: Sequence[float]) -> float:
    """Exact two-sided p of the Mann-Whitney rank test: could a and b come from one distribution?

    Why a rank test: it assumes nothing about the noise's shape (run times are skewed: a run is
    only ever slowed down), and an outlier counts as one rank, however far out. The null
    distribution of U is counted exactly (the number of orderings of the pooled runs giving each
    U), so it holds for the 3-10 runs a side the tools use. A tie counts half to U; the p is
    taken at the next whole U, which errs towards no verdict.
    """
    a, b = _floats(a, "rank_test_p (a)"), _floats(b, "rank_test_p (b)")
    n, m = len(a), len(b)
    u = sum((x > y) + 0.5 * (x == y) for x in a for y in b)
    k = math.ceil(min(u, n * m - u))
    # ways[j][u]: orderings of i values of a and j values of b with U = u, for i = 0, 1, ..., n
    ways = [[1] + [0] * (n * m) for _ in range(m + 1)]
    for _ in range(n):
        row = [[1] + [0] * (n * m)]
        for j in range(1, m + 1):  # the largest value is a's (adds j to U) or b's (adds nothing)
            row.append([(ways[j][t - j] if t >= j else 0) + row[j - 1][t] for t in range(n * m + 1)])
        ways = row
    return min(1.0, 2 * sum(ways[m][: k + 1]) / math.comb(n + m, n))


def exceeds_noise(base_runs: Sequence[float], opt_runs: Sequence[float]) -> bool:
    """Whether the two sides differ by more than run-to-run noise.

    Rule: |median(opt) - median(base)| > 2 * the larger side's spread (`_spread`: the std with
    one bad run left out, or the scaled MAD from 5 runs), and, when each side has >= 3 runs, the
    rank test (`rank_test_p`) separates them at a two-sided p <= RANK_TEST_P.

    Why: medians ignore a single bad run, and so does the spread; 2x the noisier side's spread
    means a gap that jitter alone rarely produces, and using the larger one keeps one jittery
    side from hiding behind a quiet one. With 3+ runs a side the rank test adds a
    distribution-free check: at 3 vs 3 it passes only when the runs separate completely, which
    chance alone does 10% of the time; from 5 vs 5 on it allows a slow run on either side.
    The price is the false-positive rate. Simulated (benchmarks/verdict_bench.py, 5% jitter,
    5000 comparisons a cell): with 15% of processes 1.5-2.5x slow a 20% gain gets its verdict in
    52-79% of comparisons at 3-10 runs a side, where the plain std with disjoint ranges gave
    37% at 3 runs and 4% at 10; with no gain and no slow process a verdict comes in 9.8% at 3
    runs (was 4.2%), 2.5% at 5 (0.3%) and 0.2% at 10. With fewer than 2 runs on both sides there
    is no noise estimate at all, so no difference can be shown to exceed it and the answer is
    False.
    """
    base = _floats(base_runs, "exceeds_noise (base_runs)")
    opt = _floats(opt_runs, "exceeds_noise (opt_runs)")
    if len(base) < 2 and len(opt) < 2:
        return False
    noise = max(_spread(base), _spread(opt), 1e-9)
    if abs(median(opt) - median(base)) <= 2.0 * noise:
        return False
    return not (len(base) >= 3 and len(opt) >= 3 and rank_test_p(base, opt) > RANK_TEST_P)


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
        base, opt = _floats(base_runs, "judge_difference (base)"), _floats(opt_runs, "judge_difference (opt)")
        gap, spread = abs(median(opt) - median(base)), max(_spread(base), _spread(opt))
        rule = f"|median difference| {gap:.4g} ms against 2 x the larger run spread {spread:.4g} ms"
        if len(base) >= 3 and len(opt) >= 3:
            rule += f"; rank test p = {rank_test_p(base, opt):.3g} (needs <= {RANK_TEST_P:g})"
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
