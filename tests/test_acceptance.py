import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.acceptance import (
    alpha_from_positions,
    alpha_from_vllm_rate,
    mean_acceptance_length,
    tokens_per_step,
    tokens_per_step_from_positions,
    vllm_rate_from_alpha,
)


@pytest.mark.parametrize(
    ("alpha", "gamma", "expected"),
    [
        (0.5, 1, 1.5),  # 1 + 0.5
        (0.5, 2, 1.75),  # 1 + 0.5 + 0.25
        (0.8, 4, 1 + 0.8 + 0.64 + 0.512 + 0.4096),
        (0.0, 4, 1.0),  # nothing accepted: only the bonus token
        (1.0, 4, 5.0),  # everything accepted: γ + 1
        (0.7, 0, 1.0),  # no drafting
    ],
)
def test_tokens_per_step_by_hand(alpha, gamma, expected):
    assert float(tokens_per_step(alpha, gamma)) == pytest.approx(expected, rel=1e-12)


def test_tokens_per_step_near_one_is_continuous():
    assert float(tokens_per_step(1 - 1e-9, 4)) == pytest.approx(5.0, rel=1e-7)


def test_vllm_rate_by_hand():
    # γ = 2, α = 0.5: E[N] − 1 = 0.75 accepted out of 2 drafted.
    assert float(vllm_rate_from_alpha(0.5, 2)) == pytest.approx(0.375)
    # For γ = 1 vLLM's rate is α itself.
    assert float(vllm_rate_from_alpha(0.63, 1)) == pytest.approx(0.63)


def test_mean_acceptance_length_from_rate():
    assert float(mean_acceptance_length(0.6, 4)) == pytest.approx(3.4)


@given(st.floats(0.0, 1.0), st.integers(1, 16))
def test_alpha_round_trip(alpha, gamma):
    rate = vllm_rate_from_alpha(alpha, gamma)
    back = float(alpha_from_vllm_rate(rate, gamma))
    # The rate flattens near α = 1 for long drafts; compare through the rate then.
    assert float(vllm_rate_from_alpha(back, gamma)) == pytest.approx(float(rate), abs=1e-10)
    if gamma <= 8:
        assert back == pytest.approx(alpha, abs=1e-6)


def test_alpha_from_rate_vectorized():
    out = alpha_from_vllm_rate(np.array([0.2, 0.4, 0.6]), 4)
    assert out.shape == (3,)
    assert np.all(np.diff(out) > 0)


def test_positions_give_expected_tokens():
    # The real capture metrics-sd-ngram-k4.txt: 128 drafts, per position 104, 72, 32, 8 accepted.
    p = np.array([104, 72, 32, 8]) / 128
    assert tokens_per_step_from_positions(p) == pytest.approx(1 + 216 / 128)
    alpha = alpha_from_positions(p)
    assert float(tokens_per_step(alpha, 4)) == pytest.approx(1 + 216 / 128, rel=1e-9)


@pytest.mark.parametrize("bad", [[], [0.5, float("nan")], [1.2], [-0.1]])
def test_positions_reject_bad(bad):
    with pytest.raises(ValueError):
        tokens_per_step_from_positions(bad)


def test_rates_are_clipped_not_nan():
    assert not math.isnan(float(alpha_from_vllm_rate(1.5, 4)))
    assert float(alpha_from_vllm_rate(-1, 4)) == pytest.approx(0.0, abs=1e-12)
