"""Power arithmetic of qat_app.stats against a simulation and its own definition."""

import math

import numpy as np
import pytest

from qat_app import stats


def test_a_true_difference_at_the_mdd_is_detected_with_the_stated_power():
    rng = np.random.default_rng(0)
    n, sigma, trials = 200, 1.0, 4000
    se = sigma / math.sqrt(n)
    mdd = stats.minimum_detectable_difference(se)
    assert mdd == pytest.approx(2.8016 * se, rel=1e-4)  # 1.95996 + 0.84162
    samples = rng.normal(mdd, sigma, size=(trials, n))
    z = samples.mean(1) / (samples.std(1, ddof=1) / math.sqrt(n))
    power = float(np.mean(np.abs(z) > 1.959964))
    assert abs(power - 0.8) < 3 * math.sqrt(0.8 * 0.2 / trials) + 0.01  # the t vs normal tail at n=200 adds ~0.003


def test_examples_needed_shrinks_the_se_to_the_effect():
    se, n, effect = 0.02, 300, 0.01
    needed = stats.examples_needed(effect, se, n)
    assert stats.minimum_detectable_difference(se * math.sqrt(n / needed)) == pytest.approx(effect)
    assert needed > n and stats.examples_needed(0.0, se, n) == math.inf
