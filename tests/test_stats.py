"""executor.stats against hand-computed values."""

import math

import pytest

from executor.stats import (
    cv_percent,
    exceeds_noise,
    improvement_percent,
    median,
    stability_verdict,
    throughput_gain_percent,
)


def test_median():
    assert median([3, 1, 2]) == 2.0
    assert median([4, 1, 3, 2]) == 2.5
    with pytest.raises(ValueError):
        median([])


def test_cv_percent():
    # mean 12, sample std sqrt((4 + 0 + 4) / 2) = 2 -> 16.67 %
    assert cv_percent([10, 12, 14]) == pytest.approx(100 * 2 / 12)
    # mean 15.5, std sqrt((0.01+0+0.01)/2) = 0.1 -> 0.645 %
    assert cv_percent([15.4, 15.5, 15.6]) == pytest.approx(100 * 0.1 / 15.5)
    assert cv_percent([7.0]) == 0.0
    assert cv_percent([]) == 0.0
    assert cv_percent([3, 3, 3]) == 0.0


@pytest.mark.parametrize(
    "cv, verdict",
    [
        (0.0, "excellent"),
        (4.999, "excellent"),
        (5.0, "good"),
        (9.999, "good"),
        (10.0, "fair"),
        (20.0, "fair"),
        (20.001, "poor"),
        (math.inf, "poor"),
    ],
)
def test_verdict_boundaries(cv, verdict):
    assert stability_verdict(cv) == verdict


def test_improvement_and_gain():
    assert improvement_percent(20.0, 15.0) == 25.0
    assert improvement_percent(10.0, 12.0) == -20.0
    assert improvement_percent(15.48, 10.35) == pytest.approx(513 / 15.48)
    assert throughput_gain_percent(50.0, 60.0) == 20.0
    assert throughput_gain_percent(64.0, 48.0) == -25.0
    with pytest.raises(ValueError):
        improvement_percent(0.0, 1.0)
    with pytest.raises(ValueError):
        throughput_gain_percent(0.0, 1.0)


def test_exceeds_noise_clear_win_and_loss():
    base, opt = [15.5, 15.6, 15.4], [10.3, 10.4, 10.35]
    assert exceeds_noise(base, opt)
    assert exceeds_noise(opt, base)  # symmetric: a clear regression is also beyond noise


def test_exceeds_noise_within_noise():
    # medians 15.5 vs 15.45: 0.05 <= 2 * 0.1
    assert not exceeds_noise([15.5, 15.6, 15.4], [15.45, 15.35, 15.55])


def test_exceeds_noise_overlapping_ranges():
    # base std = sqrt(30.857/6) = 2.268, 2*std = 4.536 < |5 - 10| = 5, but 4 <= 5 <= 10:
    # the ranges overlap, so with >= 3 runs a side this is not shown to beat noise.
    assert not exceeds_noise([10, 10, 10, 10, 10, 10, 4], [5, 5, 5])


def test_exceeds_noise_few_runs():
    assert exceeds_noise([10.0, 10.2], [5.0, 5.1])  # 2 runs: sigma rule only
    assert exceeds_noise([10.0], [5.0, 5.1])  # one side gives the noise estimate
    assert not exceeds_noise([10.0], [5.0])  # no noise estimate at all
    assert not exceeds_noise([10.0, 10.0, 10.0], [10.0, 10.0, 10.0])
    with pytest.raises(ValueError):
        exceeds_noise([], [1.0, 2.0])
