"""The running batch's KV context from vLLM's gauges (controller.occupancy), and what the model does with it."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from controller.model import LatencyModel, StepCost, Workload, predict_point
from controller.occupancy import running_context_tokens


@pytest.mark.parametrize(
    ("usage", "cache", "running", "block", "cached", "expected"),
    [
        # 40 % of a 1M-token cache over 200 sequences: 2,000 tokens each, less half a block.
        (0.4, 1_000_000, 200.0, 16, 0.0, 2000.0 - 7.5),
        (0.4, 1_000_000, 200.0, 1, 0.0, 2000.0),  # one-token blocks: no rounding
        # 500 prompt tokens per request came from the prefix cache: read by each, held once.
        (0.4, 1_000_000, 200.0, 16, 500.0, 2492.5),
        (1.0, 8192 * 128, 64.0, 128, 0.0, 16384.0 - 63.5),  # a full CPU cache, 128-token blocks
        (1e-6, 1_000_000, 5.0, 16, 0.0, 1.0),  # rounding cannot make a context below a token
    ],
)
def test_context_per_running_sequence(usage, cache, running, block, cached, expected):
    assert running_context_tokens(usage, cache, running, block, cached) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("usage", "cache", "running", "block"),
    [
        (0.3, 1e6, 0.5, 16),  # under one sequence on average: too few to say what the mix holds
        (0.0, 1e6, 10.0, 16),  # sequences running in an empty cache: the gauges disagree
        (1.2, 1e6, 10.0, 16),  # a fraction above 1 (a percent, or garbage)
        (-0.1, 1e6, 10.0, 16),
        (0.3, 0.0, 10.0, 16),  # capacity unknown
        (math.nan, 1e6, 10.0, 16),
        (0.3, math.inf, 10.0, 16),
        (0.3, 1e6, 10.0, 0),
    ],
)
def test_unusable_gauges_measure_nothing(usage, cache, running, block):
    assert running_context_tokens(usage, cache, running, block) is None


def test_a_measured_context_replaces_the_independent_lengths_formula():
    w = Workload(2000.0, 300.0, 300.0, 2500.0)
    assert w.mean_context_tokens == pytest.approx(2000.0 + (300.0**2 + 300.0**2) / 600.0)
    assert replace(w, running_context_tokens=1500.0).mean_context_tokens == 1500.0
    assert replace(w, running_context_tokens=0.0).mean_context_tokens == 1.0


def test_a_longer_measured_context_slows_decode_and_fills_the_cache_sooner():
    # Decode steps read the batch's KV (c per token read); the cache holds 400k tokens.
    model = LatencyModel(
        target=StepCost(0.008, 2e-5, context_s_per_token=2e-8),
        kv_cache_tokens_off=400_000.0,
        kv_cache_tokens_on=380_000.0,
    )
    base = Workload(1000.0, 250.0, 250.0)
    short, long_ = replace(base, running_context_tokens=800.0), replace(base, running_context_tokens=3000.0)
    at = [predict_point(model, 6.0, 0.7, 3, w) for w in (short, base, long_)]
    assert at[0].latency_off_s < at[1].latency_off_s < at[2].latency_off_s
    # 3,000 tokens a sequence: the cache, not max_num_seqs, bounds the batch (133 < 256).
    assert at[2].stability_limit_off_rps < at[0].stability_limit_off_rps
