"""The latency model: hand-computed cases, then properties over random calibrations."""

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from controller.model import (
    LatencyModel,
    Moe,
    StepCost,
    Workload,
    best_draft_length,
    break_even_rates,
    predict,
    predict_point,
    speedup_point,
    stability_limits,
)

ZERO = StepCost(0.0, 0.0)
BIG = 10**7  # max_num_seqs large enough that the cap does not bind


def simple(max_num_seqs=BIG, **kw):
    """Decode step 10 ms + 1 ms/token, verify 12 ms + 1 ms/token, free prefill and drafting."""
    base = dict(prefill=ZERO, target=StepCost(0.010, 0.001), verify=StepCost(0.012, 0.001), draft=ZERO)
    base.update(kw)
    return LatencyModel(max_num_seqs=max_num_seqs, **base)


W = Workload(prompt_tokens=0, gen_tokens=100)


# --- hand-computed ------------------------------------------------------------------------


def test_no_sd_closed_form():
    # c0 = G·a = 1.0 s, c1 = G·b = 0.1 s per running request; λ = 2: T = 1/(1 − 0.2).
    p = predict(simple(), 2.0, 0.5, 1, W)
    assert float(p.off.latency_s) == pytest.approx(1.25)
    assert float(p.off.batch) == pytest.approx(2.5)


def test_sd_closed_form_and_speedup():
    # α = 0.5, γ = 1: E[N] = 1.5, 66.7 verify steps of 12 ms + 2 tokens·1 ms.
    # c0 = 0.8, c1 = 0.1333; λ = 2: T = 0.8 / (1 − 0.2667) = 1.0909.
    p = predict(simple(), 2.0, 0.5, 1, W)
    assert float(p.on.latency_s) == pytest.approx(0.8 / (1 - 2 * 0.4 / 3))
    assert float(p.speedup) == pytest.approx(1.25 / (0.8 / (1 - 0.8 / 3)))
    assert float(p.accepted_length) == pytest.approx(1.5)


def test_break_even_by_hand():
    # 1·(1 − 0.1333λ) = 0.8·(1 − 0.1λ)  ->  λ = 3.75, where both T are 1.6 s.
    be = break_even_rates(simple(), 0.5, 1, W, thresholds=(1.0,))[1.0]
    assert be.rate_rps == pytest.approx(3.75, rel=1e-9)
    p = predict_point(simple(), 3.75, 0.5, 1, W)
    assert p.latency_off_s == pytest.approx(1.6)
    assert p.latency_on_s == pytest.approx(1.6)


def test_prefill_interference_and_context_terms():
    # Prefill 50 ms + 1 ms/token, P = 100: own prefill 0.15 s, each other request's adds 0.1 s.
    # Context 1e-5 s per KV token, mean context P + G/2 = 150: adds G·1e-5·150 = 0.15 to c1.
    m = simple(prefill=StepCost(0.05, 0.001), target=StepCost(0.010, 0.001, context_s_per_token=1e-5))
    w = Workload(100, 100)
    p = predict(m, 1.0, 0.5, 1, w)
    c0, c1 = 0.15 + 1.0, 0.1 + 0.1 + 0.15
    assert float(p.off.latency_s) == pytest.approx(c0 / (1 - c1))


def test_knee_segment_by_segment():
    # Knee at 50 tokens, +2 ms/token past it: T = 1 + 0.1·B + 0.2·max(0, B − 50).
    m = simple(target=StepCost(0.010, 0.001, (50.0,), (0.002,)))
    assert float(predict(m, 8.0, 0.5, 1, W).off.latency_s) == pytest.approx(5.0)  # B = 40 < 50
    # Throughput B/T(B) peaks at the knee: 50 / 6 req/s; past it the queue grows.
    lim_off, _ = stability_limits(m, 0.5, 1, W)
    assert lim_off == pytest.approx(50 / 6)
    assert bool(predict(m, 8.4, 0.5, 1, W).off.overloaded)


def test_knee_second_segment_root():
    # A gentle knee: T = 1 + 0.1·B + 0.05·max(0, B − 5). λ = 6: first segment root 6/0.4 = 15 > 5;
    # second: intercept 1 − 0.25 = 0.75, slope 0.15 -> B = 6·0.75 / (1 − 0.9) = 45.
    m = simple(target=StepCost(0.010, 0.001, (5.0,), (0.0005,)))
    p = predict(m, 6.0, 0.5, 1, W)
    assert float(p.off.batch) == pytest.approx(45.0)
    assert predict_point(m, 6.0, 0.5, 1, W).batch_off == pytest.approx(45.0)


def test_max_num_seqs_caps_capacity():
    # M = 10: throughput at the cap is 10 / (1 + 0.1·10) = 5 req/s.
    m = simple(max_num_seqs=10)
    assert float(predict(m, 4.9, 0.5, 1, W).off.batch) == pytest.approx(4.9 / (1 - 0.49))
    p = predict(m, 5.0, 0.5, 1, W)
    assert bool(p.off.overloaded)
    assert math.isinf(float(p.off.latency_s))
    assert float(p.off.stability_limit_rps) == pytest.approx(5.0)


def test_overload_is_explicit_never_nan():
    p = predict(simple(), np.array([0.0, 5.0, 9.0, 10.0, 50.0]), 0.5, 1, W)
    for arr in (p.speedup, p.on.latency_s, p.off.latency_s, p.on.batch, p.off.batch):
        assert not np.isnan(arr).any()
    assert list(p.off.overloaded) == [False, False, False, True, True]
    # SD saturates first (7.5 req/s): at 9 SD is overloaded and plain decoding is not.
    assert float(p.speedup[2]) == 0.0


def test_zero_draft_length_is_exactly_no_sd():
    p = predict(simple(), np.linspace(0, 9, 10), 0.8, 0, W)
    np.testing.assert_array_equal(p.speedup, np.ones(10))
    assert speedup_point(simple(), 3.0, 0.8, 0, W) == 1.0


def test_moe_effective_tokens_by_hand():
    moe = Moe(num_experts=8, top_k=2)
    assert float(moe.effective_tokens(1)) == pytest.approx(1.0)
    assert float(moe.effective_tokens(2)) == pytest.approx(4 * (1 - 0.75**2))
    assert float(moe.effective_tokens(10_000)) == pytest.approx(4.0)  # all 8 experts, / k


def test_moe_makes_verify_cheaper_than_dense():
    dense = simple()
    moe = simple(moe=Moe(num_experts=64, top_k=2))
    s_dense = predict(dense, 3.0, 0.7, 4, W).speedup
    s_moe = predict(moe, 3.0, 0.7, 4, W).speedup
    # Verifying γ+1 tokens touches few more experts than 1 token: SD pays more with MoE.
    assert float(s_moe) > float(s_dense)
    # And the numeric MoE fixed point still holds.
    p = predict(moe, 3.0, 0.7, 4, W)
    assert not bool(p.on.overloaded)


def test_best_draft_length_shrinks_with_load():
    m = simple(verify=StepCost(0.012, 0.002))
    low = best_draft_length(m, 0.1, 0.8, W)
    high = best_draft_length(m, 3.0, 0.8, W)
    assert low.draft_length > high.draft_length
    # The choice is the argmin of SD latency over the candidates.
    lat = [predict_point(m, 0.1, 0.8, g, W).latency_on_s for g in range(1, 17)]
    assert low.draft_length == 1 + int(np.argmin(lat))


def test_break_even_zero_and_always_above():
    # Verify costs 10x a decode step: SD never pays.
    slow = simple(verify=StepCost(0.1, 0.01))
    assert break_even_rates(slow, 0.5, 1, W)[1.05].rate_rps == 0.0
    # SD with a smaller per-token cost than plain decoding: it never falls below 1.
    cheap = simple(verify=StepCost(0.010, 0.0001))
    be = break_even_rates(cheap, 0.9, 2, W)[1.0]
    assert be.always_above and be.rate_rps is None


def test_rejects_negative_or_nan_rate():
    with pytest.raises(ValueError):
        predict(simple(), -1.0, 0.5, 1, W)
    with pytest.raises(ValueError):
        predict_point(simple(), float("nan"), 0.5, 1, W)


# --- properties -------------------------------------------------------------------------------

costs = st.builds(
    StepCost,
    st.floats(1e-4, 0.05),
    st.floats(1e-6, 5e-3),
    st.just(()),
    st.just(()),
    st.floats(0.0, 1e-6),
)


@st.composite
def models(draw, knees=True):
    def cost():
        c = draw(costs)
        if knees and draw(st.booleans()):
            k = draw(st.floats(4.0, 400.0))
            d = draw(st.floats(1e-6, 5e-3))
            c = StepCost(c.intercept_s, c.slope_s_per_token, (k,), (d,), c.context_s_per_token)
        return c

    return LatencyModel(
        prefill=cost(),
        target=cost(),
        verify=cost(),
        draft=cost(),
        max_num_seqs=draw(st.integers(1, 1024)),
        max_num_batched_tokens=draw(st.one_of(st.none(), st.integers(64, 16384))),
    )


workloads = st.builds(Workload, st.floats(0, 4096), st.floats(1, 1024))


@settings(max_examples=200, deadline=None)
@given(models(), workloads, st.floats(0.0, 1.0), st.integers(1, 16), st.floats(0.0, 1.5))
def test_fixed_point_holds(model, workload, alpha, gamma, frac):
    lim_off, lim_on = stability_limits(model, alpha, gamma, workload)
    for sd, lim in (("off", lim_off), ("on", lim_on)):
        rate = frac * lim
        mode = getattr(predict(model, rate, alpha, gamma, workload), sd)
        if bool(mode.overloaded):
            assert frac >= 1.0 - 1e-9
            continue
        b, t = float(mode.batch), float(mode.latency_s)
        assert abs(b - rate * t) <= 1e-9 * max(b, 1e-12)
        assert b <= model.max_num_seqs * (1 + 1e-12)


@settings(max_examples=200, deadline=None)
@given(models(), workloads, st.floats(0.0, 1.0), st.floats(0.0, 3.0))
def test_gamma_zero_speedup_is_one(model, workload, alpha, frac):
    lim, _ = stability_limits(model, alpha, 1, workload)
    assert float(predict(model, frac * lim, alpha, 0, workload).speedup) == 1.0


@settings(max_examples=200, deadline=None)
@given(models(knees=False), workloads, st.floats(0.0, 1.0), st.integers(1, 16))
def test_speedup_never_rises_with_rate_when_sd_has_the_larger_slope(model, workload, alpha, gamma):
    # Verify at least as costly per token as decode and no context term: c1_SD >= c1_noSD.
    model = LatencyModel(
        prefill=model.prefill,
        target=model.target,
        verify=StepCost(
            model.verify.intercept_s,
            max(model.verify.slope_s_per_token, model.target.slope_s_per_token),
        ),
        draft=StepCost(model.draft.intercept_s, model.draft.slope_s_per_token),
        max_num_seqs=model.max_num_seqs,
    )
    model = LatencyModel(
        prefill=model.prefill,
        target=StepCost(model.target.intercept_s, model.target.slope_s_per_token),
        verify=model.verify,
        draft=model.draft,
        max_num_seqs=model.max_num_seqs,
    )
    lim_off, lim_on = stability_limits(model, alpha, gamma, workload)
    # Where both modes are stable T = c0/(1 − λ·c1) for each, so S falls when c1_SD >= c1_noSD.
    # (Past a stability limit the capacities decide, see test_overload_is_explicit_never_nan.)
    rates = np.linspace(0.0, min(lim_off, lim_on) * (1 - 1e-9), 200)
    s = predict(model, rates, alpha, gamma, workload).speedup
    assert np.all(np.isfinite(s))
    assert np.all(np.diff(s) <= 1e-9 * np.maximum(1.0, np.abs(s[:-1])))


@settings(max_examples=200, deadline=None)
@given(models(), workloads, st.floats(0.0, 1.0), st.integers(0, 16), st.floats(0.0, 3.0))
def test_overload_reported_never_nan_and_paths_agree(model, workload, alpha, gamma, frac):
    lim_off, lim_on = stability_limits(model, alpha, max(gamma, 1), workload)
    rate = frac * max(lim_off, lim_on)
    vec = predict(model, rate, alpha, gamma, workload)
    point = predict_point(model, rate, alpha, gamma, workload)
    for arr in (vec.speedup, vec.on.latency_s, vec.off.latency_s, vec.on.batch, vec.off.batch):
        assert not np.isnan(arr).any()
    assert bool(vec.off.overloaded) == point.overloaded_off
    assert bool(vec.on.overloaded) == point.overloaded_on
    s_vec, s_pt = float(vec.speedup), point.speedup
    assert s_vec == s_pt or s_vec == pytest.approx(s_pt, rel=1e-9)
    assert float(vec.off.stability_limit_rps) == pytest.approx(point.stability_limit_off_rps, rel=1e-12)


@settings(max_examples=150, deadline=None)
@given(models(), workloads, st.floats(0.05, 0.95), st.integers(1, 16))
def test_break_even_is_where_speedup_crosses(model, workload, alpha, gamma):
    for th, be in break_even_rates(model, alpha, gamma, workload).items():
        if be.always_above:
            lim_off, _ = stability_limits(model, alpha, gamma, workload)
            rates = np.linspace(0, lim_off * 0.999, 50)
            assert np.all(predict(model, rates, alpha, gamma, workload).speedup >= th - 1e-9)
        elif be.rate_rps > 1e-9:
            eps = 1e-6 * be.rate_rps
            below = speedup_point(model, be.rate_rps - eps, alpha, gamma, workload)
            above = speedup_point(model, be.rate_rps + eps, alpha, gamma, workload)
            assert below >= th - 1e-6 and above <= th + 1e-6
            # and no earlier crossing on a fine grid
            grid = np.linspace(0, be.rate_rps - eps, 60)
            assert np.all(predict(model, grid, alpha, gamma, workload).speedup >= th - 1e-6)
        else:  # below the threshold from (just above) zero load
            assert speedup_point(model, 0.0, alpha, gamma, workload) <= th + 1e-9
            lim_off, lim_on = stability_limits(model, alpha, gamma, workload)
            assert speedup_point(model, 1e-6 * min(lim_off, lim_on), alpha, gamma, workload) <= th + 1e-6


@settings(max_examples=100, deadline=None)
@given(models(), workloads, st.floats(0.0, 1.0), st.integers(1, 16))
def test_stability_limit_is_the_boundary(model, workload, alpha, gamma):
    _lim_off, lim_on = stability_limits(model, alpha, gamma, workload)
    assume(lim_on > 1e-9)
    below = predict_point(model, lim_on * (1 - 1e-6), alpha, gamma, workload)
    above = predict_point(model, lim_on * (1 + 1e-6), alpha, gamma, workload)
    assert not below.overloaded_on
    assert above.overloaded_on


def test_token_budget_starves_prefill_by_hand():
    # One line, no SD: T = 1 + 0.1·B (G = 100 steps of 10 ms + 1 ms/token); P = 50 prompt tokens.
    # t_step = T/100. Budget 100 tokens per step: λ·50·(1 + 0.1B)/100 + B = 100 with B = λ/(1 − 0.1λ).
    m = simple(max_num_batched_tokens=100)
    w = Workload(prompt_tokens=50, gen_tokens=100)
    lim_off, _ = stability_limits(m, 0.5, 1, w)
    b = lim_off / (1 - 0.1 * lim_off)
    assert lim_off * 50 * (1 + 0.1 * b) / 100 + b == pytest.approx(100, rel=1e-9)
    assert lim_off < 10  # tighter than the 1/c1 = 10 req/s the line alone allows
    vec = predict(m, [lim_off * 0.999, lim_off * 1.001], 0.5, 1, w)
    assert list(vec.off.overloaded) == [False, True]
    assert float(vec.off.stability_limit_rps[0]) == pytest.approx(lim_off, rel=1e-9)


def test_full_batch_admission_is_limited_by_the_budget():
    from controller.model import throughput_at_batch

    m = simple(max_num_batched_tokens=250, max_num_seqs=1000)
    w = Workload(prompt_tokens=50, gen_tokens=100)
    # SD γ=1 at B=100: verify takes 200 of the 250 tokens; 50 left per step for prompts, i.e.
    # one 50-token prompt per 0.212 s step (4.7/s), below the 100/T(100) = 7.1/s it completes.
    t_step = 0.012 + 0.001 * 200  # verify step at 200 tokens
    assert throughput_at_batch(m, 100, True, 0.5, 1, w) == pytest.approx(50 / (50 * t_step))
    assert throughput_at_batch(simple(), 100, True, 0.5, 1, w) > throughput_at_batch(m, 100, True, 0.5, 1, w)
