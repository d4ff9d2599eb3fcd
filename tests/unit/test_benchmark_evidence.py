"""benchmarks.evidence's bias statistics (``--only bias``): the per-step bias over seeds and the per-seed bounds."""

import numpy as np
import pytest

from benchmarks.evidence import BIAS_BOUND, OUTLIER, bias_row


def test_bias_row_separates_a_bias_from_the_spread_of_the_seeds():
    rng = np.random.default_rng(0)
    seeds, steps = 400, 750
    err = rng.normal(0.0, 0.05, (seeds, steps))
    err[:, OUTLIER] += -0.3  # a bias at the outlier, as a Gaussian belief has there
    err[:, 10] += rng.choice([-0.5, 0.5], seeds)  # spread without bias
    row = bias_row(err)
    assert row["max_abs_bias_day"] == OUTLIER + 1
    assert row["max_abs_bias"] == pytest.approx(0.3, abs=0.02)
    assert row["bias_day_144"] == pytest.approx(-0.3, abs=0.02)
    assert row["steps_bias_over_bound"] == 1 and row["steps_bias_over_bound_by_2se"] == 1
    assert row["seeds_every_step_within"] == 0  # every seed misses at day 11 (and at the outlier)
    assert row["total_mean"] == pytest.approx(-0.3, abs=0.1)
    assert row["worst_step_any_seed"] > 0.5


def test_bias_row_counts_the_seeds_within_the_bounds():
    err = np.zeros((4, 750))
    err[0, 5] = BIAS_BOUND * 1.5  # one step over: that seed's every-step bound fails, its total (0.15) holds
    err[1, :] = 0.001  # total 0.75: over 0.2
    row = bias_row(err)
    assert row["seeds"] == 4
    assert row["seeds_every_step_within"] == 3
    assert row["seeds_total_within"] == 3
    assert row["steps_bias_over_bound"] == 0
