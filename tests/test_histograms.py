"""Spread from histogram buckets: checked against samples whose standard deviation is known."""

import math

import numpy as np
import pytest

from controller.histograms import std_from_buckets

VLLM_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, math.inf)


def buckets(values, bounds=VLLM_TOKEN_BUCKETS):
    return [float(np.sum(values <= b)) for b in bounds]


@pytest.mark.parametrize("shape", [1.0, 2.0, 4.0])
def test_gamma_lengths_within_ten_percent(shape):
    rng = np.random.default_rng(0)
    g = np.rint(rng.gamma(shape, 280 / shape, 20_000)).clip(1)
    est = std_from_buckets(VLLM_TOKEN_BUCKETS, buckets(g), mean=float(g.mean()))
    assert est == pytest.approx(float(g.std()), rel=0.1)


@pytest.mark.parametrize("sigma", [0.4, 0.8])
def test_lognormal_lengths_within_fifteen_percent(sigma):
    rng = np.random.default_rng(2)
    x = np.rint(rng.lognormal(math.log(900), sigma, 20_000)).clip(1)
    est = std_from_buckets(VLLM_TOKEN_BUCKETS, buckets(x), mean=float(x.mean()))
    assert est == pytest.approx(float(x.std()), rel=0.15)


def test_fine_buckets_are_nearly_exact():
    rng = np.random.default_rng(1)
    x = rng.normal(500, 80, 50_000)
    bounds = [*range(0, 1000, 10), math.inf]
    assert std_from_buckets(bounds, buckets(x, bounds)) == pytest.approx(80, rel=0.02)


def test_constant_lengths_have_only_the_bucket_width():
    # 256 tokens every time: the bucket (200, 500] is all we know.
    est = std_from_buckets(VLLM_TOKEN_BUCKETS, buckets(np.full(100, 256.0)), mean=256.0)
    assert est < 20


def test_missing_or_torn_is_none_not_zero():
    assert std_from_buckets(VLLM_TOKEN_BUCKETS, [0.0] * len(VLLM_TOKEN_BUCKETS)) is None
    torn = buckets(np.array([3.0, 30.0, 300.0]))
    torn[5] = 0.0  # not cumulative
    assert std_from_buckets(VLLM_TOKEN_BUCKETS, torn) is None
    assert std_from_buckets(VLLM_TOKEN_BUCKETS, [1.0]) is None
    assert std_from_buckets((), ()) is None
