"""The online correction (pure): the real solver as the truth it must recover, virtual time."""

import dataclasses
import math

import numpy as np
import pytest

from controller.calibration import load
from controller.correction import (
    TERMS,
    CorrectionConfig,
    Posterior,
    forget,
    log_speedup_sd,
    paper_fit,
    scaled_model,
    update,
)
from controller.model import Workload, curves, predict_point
from controller.shipped import example_calibration_path

BASE = load(example_calibration_path()).latency_model()
W = Workload(1000.0, 280.0)
ALPHA, GAMMA = 0.7, 4
CFG = CorrectionConfig(prior_width=0.3, sd_prior_width=0.3, half_life_s=7200.0, max_factor=2.0)
T0 = 1_800_000_000.0


def latency(model, on, rate):
    off_c, on_c = curves(model, ALPHA, GAMMA, W)
    return (on_c if on else off_c).latency_s(rate)


def predictor(on, rate):
    def predict_log(factors):
        t = latency(scaled_model(BASE, factors), on, rate)
        return math.log(t) if math.isfinite(t) else math.inf

    return predict_log


def learn(truth, mode_of, ticks=240, rates=(1.0, 3.0, 6.0, 9.0), noise=0.05, seed=0, p=None, start=T0, cfg=None):
    """Feed ``ticks`` minutes of evidence generated from ``truth`` factors (with lognormal noise)."""
    cfg = cfg or CFG
    rng = np.random.default_rng(seed)
    p = p or Posterior()
    true_model = scaled_model(BASE, truth)
    for i in range(ticks):
        rate = rates[i % len(rates)]
        on = mode_of(i)
        observed = latency(true_model, on, rate) * math.exp(rng.normal(0, noise))
        p = update(p, cfg, predictor(on, rate), "on" if on else "off", observed, noise, start + 60 * i).posterior
    return p


def test_scaled_model_splits_fixed_and_load_terms():
    m = scaled_model(BASE, (1.1, 1.2, 1.3, 1.4))
    assert m.target.intercept_s == pytest.approx(1.1 * BASE.target.intercept_s)
    assert m.target.slope_s_per_token == pytest.approx(1.2 * BASE.target.slope_s_per_token)
    assert m.target.context_s_per_token == pytest.approx(1.2 * BASE.target.context_s_per_token)
    assert m.target.seq_s == pytest.approx(1.2 * BASE.target.seq_s)
    assert m.target.knee_slope_deltas == pytest.approx([1.2 * d for d in BASE.target.knee_slope_deltas])
    assert m.target.knees_tokens == BASE.target.knees_tokens  # where the pass turns compute-bound stays
    assert m.draft.intercept_s == pytest.approx(1.3 * BASE.draft.intercept_s)
    assert m.draft.slope_s_per_token == pytest.approx(1.4 * BASE.draft.slope_s_per_token)
    assert scaled_model(BASE, (1.0, 1.0, 1.0, 1.0)) is BASE


def test_off_mode_recovers_a_load_dependent_error_across_loads():
    truth = (1.0, 1.4, 1.0, 1.0)
    p = learn(truth, lambda i: False)
    corrected = scaled_model(BASE, p.factors)
    for rate in (1.0, 5.0, 9.0):
        err = latency(corrected, False, rate) / latency(scaled_model(BASE, truth), False, rate) - 1
        assert abs(err) < 0.03, (rate, err)
    assert abs(latency(BASE, False, 9.0) / latency(scaled_model(BASE, truth), False, 9.0) - 1) > 0.2
    # The draft runs on the same GPU: its load term is expected off by what the target's is (the
    # prior's common share), its fixed term as the target's fixed term (unmoved here).
    assert p.factors[3] == pytest.approx(p.factors[1], rel=0.05) and p.factors[2] == pytest.approx(1.0, abs=0.02)
    assert p.error_ratio("off") == pytest.approx(1.0, abs=0.06)  # a 5-tick smoothing of 5 % noise


def test_without_a_common_share_sd_off_evidence_leaves_the_draft_terms_alone():
    independent = dataclasses.replace(CFG, common_share=0.0)
    p = learn((1.0, 1.4, 1.0, 1.0), lambda i: False, cfg=independent)
    assert p.factors[2:] == (1.0, 1.0)


def test_the_prior_shares_the_targets_error_with_the_draft_and_stays_positive_definite():
    cfg = CorrectionConfig(prior_width=0.15, sd_prior_width=0.3)
    cov = cfg.prior_cov()
    assert cov[0, 2] == cov[1, 3] == pytest.approx(0.15**2)  # draft = target + its own error
    assert cov[0, 1] == 0.0 and cov[2, 3] == 0.0  # fixed and load errors independent
    # The regression of the draft's term on the target's is 1: the same factor is expected.
    assert cov[1, 3] / cov[1, 1] == pytest.approx(1.0)
    for c in (cfg, CFG, dataclasses.replace(CFG, common_share=5.0)):
        assert np.all(np.linalg.eigvalsh(c.prior_cov()) > 0)


def test_on_mode_evidence_corrects_the_off_mode_through_the_shared_terms_with_wider_uncertainty():
    truth = (1.3, 1.3, 1.0, 1.0)  # the target got slower (both modes run it)
    p_on = learn(truth, lambda i: True)
    p_off = learn(truth, lambda i: False)
    # The SD-on residual is split between the target's and the draft's terms...
    t_true = latency(scaled_model(BASE, truth), False, 6.0)
    before = abs(latency(BASE, False, 6.0) / t_true - 1)
    after = abs(latency(scaled_model(BASE, p_on.factors), False, 6.0) / t_true - 1)
    assert after < 0.5 * before
    # ...so the shared terms stay less certain than when the off mode itself is observed.
    w_on, w_off = p_on.width(CFG), p_off.width(CFG)
    assert w_on[0] > w_off[0] and w_on[1] > w_off[1]


def test_forgetting_widens_back_to_the_prior_but_not_beyond():
    p = learn((1.0, 1.2, 1.0, 1.0), lambda i: False, ticks=60)
    narrow = p.width(CFG)[1]
    later = forget(p, CFG, p.updated_at + 7200.0)
    much_later = forget(p, CFG, p.updated_at + 30 * 86400.0)
    assert narrow < later.width(CFG)[1] < much_later.width(CFG)[1] <= CFG.prior_width + 1e-9
    # What the evidence pinned down stays for a while; with no evidence for a month, it is gone.
    assert later.factors[1] == pytest.approx(p.factors[1], rel=0.02)
    assert much_later.factors == pytest.approx((1.0, 1.0, 1.0, 1.0), abs=0.01)


def test_what_the_running_mode_cannot_tell_apart_does_not_drift():
    """SD on only, truth = the calibration, noisy evidence for two simulated days: the split
    between target and draft costs (weakly identified) stays near the calibration."""
    p = learn((1.0, 1.0, 1.0, 1.0), lambda i: True, ticks=2880, noise=0.08, seed=5)
    assert all(abs(math.log(f)) < 0.15 for f in p.factors), p.factors


def test_an_outlier_is_down_weighted():
    p = learn((1.0, 1.0, 1.0, 1.0), lambda i: False, ticks=60)
    rate = 6.0
    t = latency(BASE, False, rate)
    robust = update(p, CFG, predictor(False, rate), "off", 10 * t, 0.05, p.updated_at + 60)
    naive = update(p, CorrectionConfig(huber_k=1e9), predictor(False, rate), "off", 10 * t, 0.05, p.updated_at + 60)
    assert robust.weight < 0.2 and naive.weight == 1.0
    shift = [abs(math.log(f)) for f in robust.posterior.factors[:2]]
    assert max(shift) < 0.5 * max(abs(math.log(f)) for f in naive.posterior.factors[:2])


def test_a_correction_beyond_the_clamp_raises_the_alarm_once_and_stays_bounded():
    p, raised = Posterior(), []  # ticks on which the alarm was raised
    true_model = scaled_model(BASE, (3.0, 3.0, 1.0, 1.0))
    for i in range(200):
        rate = (0.5, 1.0, 2.0)[i % 3]
        up = update(p, CFG, predictor(False, rate), "off", latency(true_model, False, rate), 0.05, T0 + 60 * i)
        p = up.posterior
        if up.alarm_raised:
            raised.append(i)
    assert max(p.factors) <= 2.0 + 1e-9
    # The target's terms, and the draft's that share its error, all want beyond the clamp.
    assert p.alarm and set(TERMS[:2]) <= set(p.alarm)
    assert len(raised) == 1  # raised once, not every tick


def test_posterior_round_trips_and_rejects_garbage():
    p = learn((1.0, 1.2, 1.0, 1.0), lambda i: i % 2 == 0, ticks=20)
    assert Posterior.from_dict(p.to_dict()) == p
    for bad in (
        None,
        {"schema": 2},
        {**p.to_dict(), "mean": [0, 0]},
        {**p.to_dict(), "mean": [0, 0, 0, float("nan")]},
        {**p.to_dict(), "cov": [[1]]},
        {**p.to_dict(), "terms": ["a", "b", "c", "d"]},
        {**p.to_dict(), "evidence": -1},
    ):
        with pytest.raises(ValueError):
            Posterior.from_dict(bad)


def test_update_refuses_bad_evidence():
    for value in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            update(Posterior(), CFG, predictor(False, 1.0), "off", value, 0.05, T0)
    with pytest.raises(ValueError):
        update(Posterior(), CFG, predictor(False, 1.0), "sideways", 1.0, 0.05, T0)


@pytest.mark.parametrize(
    "predict_log",
    [
        lambda f: math.inf,  # the exact posterior is already past a stability limit
        lambda f: 0.0 if f == (1.0, 1.0, 1.0, 1.0) else math.inf,  # overloaded both ways (a knife edge)
    ],
)
def test_an_update_at_a_stability_limit_never_poisons_the_posterior(predict_log):
    for mode in ("off", "on"):
        up = update(Posterior(), CFG, predict_log, mode, 2.0, 0.05, T0)
        assert all(math.isfinite(x) for x in up.posterior.mean)
        assert np.all(np.isfinite(up.posterior.covariance(CFG)))


def test_paper_fit_recovers_its_constants():
    rates = np.array([1.0, 2.0, 4.0, 6.0])
    c1, c2 = paper_fit(rates, 3.0 / (1 - rates * 0.1))
    assert (c1, c2) == (pytest.approx(3.0), pytest.approx(0.1))
    assert paper_fit(np.array([2.0, 2.0]), np.array([1.0, 1.1])) is None


def test_log_speedup_sd_is_the_gradient_through_the_posterior_covariance():
    """A speedup log-linear in the factors (∂/∂target_fixed = 0.4, ∂/∂sd_fixed = −0.3): its
    sd is exactly √(gᵀΣg), correlations included."""
    t0, d0 = BASE.target.intercept_s, BASE.draft.intercept_s

    def speedup_at(m):
        return 1.5 * (m.target.intercept_s / t0) ** 0.4 * (m.draft.intercept_s / d0) ** -0.3

    independent = dataclasses.replace(CFG, common_share=0.0)
    assert log_speedup_sd(Posterior(), independent, BASE, speedup_at) == pytest.approx(0.3 * math.hypot(0.4, 0.3))
    # With the common share, a slower target and a slower draft go together: they cancel in part.
    assert log_speedup_sd(Posterior(), CFG, BASE, speedup_at) < 0.3 * math.hypot(0.4, 0.3)
    cov = np.diag([0.04, 0.01, 0.09, 0.01])
    cov[0, 2] = cov[2, 0] = 0.03  # a slower target and a slower draft go together
    got = log_speedup_sd(Posterior(cov=tuple(map(tuple, cov))), CFG, BASE, speedup_at)
    g = np.array([0.4, 0.0, -0.3, 0.0])
    assert got == pytest.approx(math.sqrt(g @ cov @ g))
    assert log_speedup_sd(Posterior(), CFG, BASE, lambda m: math.inf) is None  # only SD keeps up


def test_sd_off_evidence_narrows_what_it_identifies_and_leaves_the_sd_terms_open():
    """Many SD-off ticks at one load: the target's terms are pinned where they matter to SD off;
    the speedup's width that remains is the SD-only terms' (the draft has never run)."""

    def speedup_at(m):
        return predict_point(m, 6.0, ALPHA, GAMMA, W).speedup

    post = Posterior()
    for k in range(200):
        rate = 6.0 + 0.5 * math.sin(k)
        truth = latency(BASE, False, rate)
        post = update(post, CFG, predictor(False, rate), "off", truth, 0.02, T0 + 60 * k).posterior
    prior_sd = log_speedup_sd(Posterior(), CFG, BASE, speedup_at)
    after = log_speedup_sd(post, CFG, BASE, speedup_at)
    target_block = np.array(post.cov)
    target_block[2:, :] = 0.0
    target_block[:, 2:] = 0.0
    target_only = log_speedup_sd(dataclasses.replace(post, cov=tuple(map(tuple, target_block))), CFG, BASE, speedup_at)
    assert 0.0 < after < prior_sd
    assert target_only < 0.5 * after  # what is left open is mostly the draft's, which never ran
