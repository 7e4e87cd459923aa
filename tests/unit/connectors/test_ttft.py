"""kvtier.connectors.ttft: the prefill rate a connector fits, and what a load saved."""

from __future__ import annotations

import random

import pytest

from kvtier.connectors.ttft import PrefillRate


def test_the_slope_is_the_marginal_cost_not_the_fixed_one():
    """seconds = 0.2 + 0.001 * tokens (a fixed 200 ms per forward): the rate is 1 ms a token,
    where seconds / tokens would say 3 ms for a 100-token prefill."""
    rate = PrefillRate()
    for n in (100, 300, 500, 900, 1500):
        rate.observe(n, 0.2 + 0.001 * n)
    assert rate.seconds_per_token() == pytest.approx(0.001)
    assert rate.saving(1000, 0.25) == pytest.approx((0.75, 0.0))
    assert rate.saving(100, 0.25) == pytest.approx((0.0, 0.15))  # the load cost more than it saved


def test_one_slow_outlier_barely_moves_it():
    rng = random.Random(0)
    rate = PrefillRate()
    rate.observe(40, 5.0)  # a first call that paid for everything
    for _ in range(30):
        n = rng.randrange(50, 2000)
        rate.observe(n, 0.05 + 0.002 * n * rng.uniform(0.95, 1.05))
    assert rate.seconds_per_token() == pytest.approx(0.002, rel=0.05)


def test_no_prefill_no_estimate_and_equal_lengths_use_the_median():
    rate = PrefillRate()
    assert rate.seconds_per_token() is None and rate.saving(100, 0.0) is None
    for t in (0.1, 0.3, 0.2):
        rate.observe(100, t)
    assert rate.seconds_per_token() == pytest.approx(0.002)
    rate.observe(0, 1.0)  # nothing computed: ignored
    assert len(rate) == 3
