"""The latency model: hand-computed cases, then properties over random calibrations."""

import math
import types
from dataclasses import replace
from statistics import NormalDist

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from controller.model import (
    CAPACITY_SEARCH_PATIENCE,
    LIMIT_REASONS,
    NEAR_CAPACITY,
    PROMPT_KNEE_BINS,
    LatencyModel,
    Moe,
    StepCost,
    Workload,
    best_draft_length,
    break_even_rates,
    bunched_wait_excess,
    curves,
    cycle_speedup,
    predict,
    predict_point,
    predict_points,
    speedup_point,
    stability_limits,
    stuck_chunks,
)
from controller.queueing import MAX_STATES

ZERO = StepCost(0.0, 0.0)
BIG = 10**7  # max_num_seqs large enough that neither the bound nor the queueing term matters


def simple(max_num_seqs=BIG, **kw):
    """Target pass 10 ms + 1 ms/token; a schema-1 style SD step 12 ms + 1 ms/token; free drafting."""
    base = dict(target=StepCost(0.010, 0.001), verify=StepCost(0.012, 0.001), draft=ZERO)
    base.update(kw)
    return LatencyModel(max_num_seqs=max_num_seqs, **base)


W = Workload(prompt_tokens=0, gen_tokens=100, gen_tokens_std=0.0)


def steps(g=100, en=1.0):
    """Decode steps after the prefill step, plus the prefill step and half a step in flight."""
    return (g - 1) / en + 1.5


# --- hand-computed ------------------------------------------------------------------------


def test_no_sd_closed_form():
    # A request's steps run at batch B + 1: τ = 0.010 + 0.001·(B + 1); T = 100.5·τ.
    c0, c1 = steps() * 0.011, steps() * 0.001
    p = predict(simple(), 2.0, 0.5, 1, W)
    assert float(p.off.latency_s) == pytest.approx(c0 / (1 - 2 * c1))
    assert float(p.off.batch) == pytest.approx(2 * c0 / (1 - 2 * c1))


def test_sd_closed_form_and_speedup():
    # α = 0.5, γ = 1: E[N] = 1.5, 66 verify steps + 1.5 of 12 ms + 2 tokens·1 ms at batch B + 1.
    n = steps(en=1.5)
    c0, c1 = n * (0.012 + 0.002), n * 0.002
    p = predict(simple(), 2.0, 0.5, 1, W)
    t_on = c0 / (1 - 2 * c1)
    assert float(p.on.latency_s) == pytest.approx(t_on)
    t_off = steps() * 0.011 / (1 - 2 * steps() * 0.001)
    assert float(p.speedup) == pytest.approx(t_off / t_on)
    assert float(p.accepted_length) == pytest.approx(1.5)


def test_sd_step_from_target_and_draft_passes():
    # Schema 2: the SD step is a target pass over B·(γ+1) tokens, a draft pass over the same
    # tokens (vLLM v1's proposer catches the draft up on the verified ones), γ − 1 single-token
    # draft passes and the overhead.
    m = LatencyModel(
        target=StepCost(0.010, 0.001), draft=StepCost(0.002, 0.0001), sd_overhead_s=0.0005, max_num_seqs=BIG
    )
    n = steps(en=1.75)  # α = 0.5, γ = 2: E[N] = 1 + 0.5 + 0.25
    tau0 = 0.010 + 0.003 + (0.002 + 0.0003) + (0.002 + 0.0001) + 0.0005  # at batch 1
    tau1 = 0.003 + 0.0003 + 0.0001  # per further sequence
    p = predict_point(m, 1.0, 0.5, 2, W)
    assert p.latency_on_s == pytest.approx(n * tau0 / (1 - n * tau1))


def test_break_even_by_hand():
    # T_off = 1.1055/(1 − 0.1005λ), T_on = 0.945/(1 − 0.135λ): equal where
    # 1.1055·(1 − 0.135λ) = 0.945·(1 − 0.1005λ).
    a0, a1 = steps() * 0.011, steps() * 0.001
    n = steps(en=1.5)
    b0, b1 = n * 0.014, n * 0.002
    lam = (a0 - b0) / (a0 * b1 - b0 * a1)
    be = break_even_rates(simple(), 0.5, 1, W, thresholds=(1.0,))[1.0]
    assert be.rate_rps == pytest.approx(lam, rel=1e-4)
    p = predict_point(simple(), lam, 0.5, 1, W)
    assert p.latency_off_s == pytest.approx(p.latency_on_s, rel=1e-9)


def test_prompt_is_priced_at_its_marginal_cost_on_a_mixed_step():
    # Knee at 100 tokens per pass: 1 ms/token below, 0.2 ms/token above. A 500-token prompt on
    # a step with B + 1 decode tokens costs t(B + 1 + 500) − t(B + 1), not a stand-alone prefill.
    target = StepCost(0.010, 0.001, (100.0,), (-0.0008,))
    m = LatencyModel(target=target, max_num_seqs=BIG)
    w = Workload(500, 100, 0.0)
    off, _ = curves(m, 0.5, 1, w)
    for b in (0.0, 20.0, 150.0):
        expect = target.scalar(b + 1 + 500) - target.scalar(b + 1)
        assert off.prompt(b) == pytest.approx(expect)
    # X = 100.5·τ(B) + (B + 1)·Δ(B), and the wait for the step in flight λ·R with
    # R = Δ·(τ + Δ)/2 (one prompt length: E[Δ²] = Δ²) and λ = B/T: T = X + B·R/T.
    b = 20.0
    tau, delta = off.step(b), off.prompt(b)
    x, r = steps() * tau + (b + 1) * delta, 0.5 * delta * (tau + delta)
    t = off.latency_at_batch(b)
    assert t == pytest.approx(x + b * r / t)
    assert t > x


def _share(steps: float, tau_bound: float, delta_bound: float, bound: float = 256.0) -> float:
    """φ by hand: the others' share decoding, steps/(steps + 1 + Δ/S̄), S̄ the mean step of a full batch."""
    mean_step = tau_bound + bound / (steps + 1.5) * delta_bound
    return steps / (steps + 1 + delta_bound / mean_step)


def test_a_step_decodes_only_the_others_past_their_prompt():
    # 10 ms + 1 ms a token, 500-token prompts, 100 generated: of B others in the batch, a share
    # φ decodes; the rest are in the step of their own prompt (priced by Δ), so τ(B) runs
    # 1 + φ·B decode tokens, not B + 1.
    target = StepCost(0.010, 0.001)
    m = LatencyModel(target=target, max_num_seqs=256)
    off, _ = curves(m, 0.5, 1, Workload(500, 100, 0.0))
    phi = _share(99.0, target.scalar(256), 0.5)
    assert 0.98 < phi < 0.99
    assert off.decoding_share == pytest.approx(phi)
    for b in (0.0, 20.0, 200.0):
        assert off.step(b) == pytest.approx(target.scalar(1 + phi * b))
    # Without prompts every request in the batch decodes.
    bare, _ = curves(m, 0.5, 1, Workload(0, 100, 0.0))
    assert bare.decoding_share == 1.0
    assert bare.step(200.0) == pytest.approx(target.scalar(201))


def test_with_sd_a_prompt_step_still_drafts_but_adds_no_verify_tokens():
    # The target and the draft's first pass run k = γ + 1 tokens a decoder; the draft's γ − 1
    # single-token passes run every scheduled sequence, a prompt's last chunk included.
    target, draft = StepCost(0.010, 0.001), StepCost(0.002, 0.0002)
    m = LatencyModel(target=target, draft=draft, max_num_seqs=256)
    _, on = curves(m, 0.5, 2, Workload(500, 100, 0.0))
    k = 3

    def tau(decoders: float, scheduled: float) -> float:
        return target.scalar(k * decoders) + draft.scalar(k * decoders) + draft.scalar(scheduled)

    phi = _share(on.steps, tau(256, 256), on.prompt(255.0))
    assert 0.96 < phi < 0.99
    for b in (0.0, 20.0, 200.0):
        assert on.step(b) == pytest.approx(tau(1 + phi * b, b + 1))


def test_an_arrival_waits_for_the_step_in_flight_weighted_by_its_length():
    # Steps are τ long, or τ + Δ when a prompt rides in them (λ per second). An arrival lands in a
    # step with probability ∝ its length, so it waits E[S²]/(2E[S]) = τ/2 + λ·(τ·Δ + Δ²)/2:
    # τ/2 is in the 1.5 steps of X, the rest is the λ·R the fixed point adds to T(B).
    target = StepCost(0.010, 0.0001)
    m = LatencyModel(target=target, max_num_seqs=BIG)
    w = Workload(2000, 100, 0.0)
    off, _ = curves(m, 0.5, 1, w)
    lam = 3.0
    b = off.batch(lam)
    t = off.fluid_latency_s(lam)
    assert b == pytest.approx(lam * t)
    tau, delta = off.step(b), off.prompt(b)
    assert delta == pytest.approx(0.0001 * 2000)
    x = steps() * tau + (b + 1) * delta
    assert t == pytest.approx(x + lam * 0.5 * delta * (tau + delta), rel=1e-9)
    # wait_s adds what the prompts' bunching adds (the next test): to first order in ρ the same.
    rho = lam * delta
    bunched = 0.5 * tau / (1.0 - rho) + 0.5 * lam * delta**2 / (1.0 - rho**2)
    assert off.wait_s(lam) == pytest.approx(bunched)
    assert 0.5 * tau < 0.5 * tau + lam * 0.5 * delta * (tau + delta) < off.wait_s(lam)
    # The same in the steps' own terms: the residual of a step sequence with these lengths.
    share_prompt = lam * delta  # of the time spent on prompt work
    steps_per_s = (1.0 - share_prompt) / tau
    mixed_per_s = lam
    e_s2 = (steps_per_s - mixed_per_s) * tau**2 + mixed_per_s * (tau + delta) ** 2  # Σ S² per second, Σ S = 1
    assert 0.5 * e_s2 == pytest.approx(0.5 * tau + lam * 0.5 * delta * (tau + delta))


@pytest.mark.parametrize("rho", [0.05, 0.3, 0.6])
def test_prompts_that_bunch_in_steps_lengthen_the_wait_for_the_step_in_flight(rho):
    # Prompts arriving during a step are prefilled together in the next: S' = τ + Σ_J Δ with
    # J ~ Poisson(λ·S). Simulate the steps (lognormal prompt costs) and weigh each by its length.
    rng = np.random.default_rng(4)
    tau, mean_delta, sigma = 0.05, 0.4, 0.4
    lam = rho / mean_delta
    deltas = mean_delta * rng.lognormal(-0.5 * sigma**2, sigma, 2_000_000)
    q = float(np.mean(deltas**2) / np.mean(deltas) ** 2)
    s, used, lengths = tau, 0, np.empty(200_000)
    for i in range(lengths.size):
        j = rng.poisson(lam * s)
        s = tau + deltas[used : used + j].sum()
        used += j
        lengths[i] = s
    lengths = lengths[1000:]
    waited = float((lengths**2).sum() / (2.0 * lengths.sum()))
    first_order = 0.5 * tau + 0.5 * lam * (tau * mean_delta + q * mean_delta**2)  # τ/2 + λ·R
    model = first_order + bunched_wait_excess(lam, tau, mean_delta, q)
    assert model == pytest.approx(waited, rel=0.03)
    if rho >= 0.3:  # the first-order wait misses by ρ²-ish where prompts take a third of the time
        assert first_order < (1.0 - 0.8 * rho**2) * waited
    assert bunched_wait_excess(lam, tau, mean_delta, q) == pytest.approx(
        rho**2 * (0.5 * tau / (1 - rho) + 0.5 * lam * q * mean_delta**2 / (1 - rho**2))
    )


def test_spread_prompts_wait_longer_for_the_step_in_flight():
    # The same mean prompt, lengths spread: E[Δ²] > E[Δ]², so the wait and the latency grow,
    # while the fixed point's prompt cost (linear in P) stays.
    m = LatencyModel(target=StepCost(0.010, 0.0001), max_num_seqs=BIG)
    same, spread = Workload(2000, 100, 0.0), Workload(2000, 100, 0.0, 1500.0)
    off_same, _ = curves(m, 0.5, 1, same)
    off_spread, _ = curves(m, 0.5, 1, spread)
    assert off_spread.prompt(0.0) == pytest.approx(off_same.prompt(0.0))
    for lam in (1.0, 2.0, 3.0):
        assert off_spread.latency_s(lam) > off_same.latency_s(lam)
    assert off_spread.stability_limit_rps < off_same.stability_limit_rps


def test_draft_prefills_every_prompt_with_sd():
    target, draft = StepCost(0.010, 0.001), StepCost(0.002, 0.0002)
    w = Workload(300, 100, 0.0)
    with_draft = LatencyModel(target=target, draft=draft, max_num_seqs=BIG)
    ngram = LatencyModel(target=target, draft=draft, draft_prefills=False, max_num_seqs=BIG)
    _, on = curves(with_draft, 0.6, 3, w)
    _, on_ngram = curves(ngram, 0.6, 3, w)
    assert on.prompt(5.0) == pytest.approx(300 * 0.001 + 300 * 0.0002)
    assert on_ngram.prompt(5.0) == pytest.approx(300 * 0.001)
    assert predict_point(with_draft, 0.5, 0.6, 3, w).latency_on_s > predict_point(ngram, 0.5, 0.6, 3, w).latency_on_s


def test_context_is_residence_weighted():
    # G with mean 100 and sd 50: E[G²]/(2E[G]) = (100² + 50²)/200 = 62.5 tokens of context on
    # top of the prompt, not G/2 = 50: long generations stay in the batch longer.
    assert Workload(200, 100, 50.0).mean_context_tokens == pytest.approx(262.5)
    assert Workload(200, 100, 0.0).mean_context_tokens == pytest.approx(250.0)
    assert Workload(200, 100).mean_context_tokens == pytest.approx(200 + (100**2 + 100**2) / 200)  # CV 1 default
    m = simple(target=StepCost(0.010, 0.001, context_s_per_token=1e-5))
    slow = predict_point(m, 3.0, 0.5, 1, Workload(0, 100, 80.0)).latency_off_s
    fast = predict_point(m, 3.0, 0.5, 1, Workload(0, 100, 0.0)).latency_off_s
    assert slow > fast


def test_prompt_length_spread_averages_the_marginal_cost():
    # Past a knee with a lower slope the cost is concave in the prompt: spread lowers the mean.
    target = StepCost(0.010, 0.001, (400.0,), (-0.0008,))
    m = LatencyModel(target=target, max_num_seqs=BIG)
    fixed, spread = Workload(500, 100, 0.0, 0.0), Workload(500, 100, 0.0, 300.0)
    nodes = spread.prompt_nodes
    assert sum(w for w, _ in nodes) == pytest.approx(1.0)
    assert sum(w * p for w, p in nodes) == pytest.approx(500.0)
    assert curves(m, 0.5, 1, spread)[0].prompt(3.0) < curves(m, 0.5, 1, fixed)[0].prompt(3.0)


def _lognormal_excess(mean: float, log_sd: float, c: float) -> float:
    """E[max(0, P − c)] for lognormal P of this mean and log-sd (the Black–Scholes call)."""
    if c <= 0.0:
        return mean - c
    d1 = (math.log(mean / c) + 0.5 * log_sd * log_sd) / log_sd
    return mean * NormalDist().cdf(d1) - c * NormalDist().cdf(d1 - log_sd)


@pytest.mark.parametrize("batch", [10.0, 60.0, 150.0, 250.0])
def test_prompt_cost_averages_the_knees_over_the_lognormal(batch):
    # Slopes 20 → 50 → 30 µs a token past knees at 300 and 800 tokens: a kink inside the
    # prompt lengths (mean 900, sd 600). Δ(B) is the lognormal mean of t(B + 1 + P) − t(B + 1),
    # in closed form per knee; three Gauss–Hermite nodes miss it by up to 2.7 % here.
    knees, deltas = (300.0, 800.0), (3e-5, -2e-5)
    m = LatencyModel(target=StepCost(0.006, 2e-5, knees, deltas), max_num_seqs=256)
    w = Workload(900.0, 280.0, 0.0, 600.0)
    log_sd = math.sqrt(math.log1p((600.0 / 900.0) ** 2))
    x0 = batch + 1.0
    exact = 2e-5 * 900.0 + sum(
        d * (_lognormal_excess(900.0, log_sd, k - x0) - max(0.0, x0 - k)) for k, d in zip(knees, deltas, strict=True)
    )
    assert curves(m, 0.5, 1, w)[0].prompt(batch) == pytest.approx(exact, rel=0.005)
    bins = w.prompt_bins
    assert len(bins) == PROMPT_KNEE_BINS
    assert sum(wt for wt, _ in bins) == pytest.approx(1.0)
    assert sum(wt * x for wt, x in bins) == pytest.approx(900.0)
    assert [x for _, x in bins] == sorted(x for _, x in bins)
    assert Workload(900.0, 280.0, 0.0, 0.0).prompt_bins == ((1.0, 900.0),)


def test_knee_segment_by_segment():
    # Knee at 50 tokens, +2 ms/token past it; at batch B + 1 the hinge sits at B = 49.
    m = simple(target=StepCost(0.010, 0.001, (50.0,), (0.002,)))
    c0, c1 = steps() * 0.011, steps() * 0.001
    lam = 6.0
    b = lam * c0 / (1 - lam * c1)
    assert b < 49
    assert float(predict(m, lam, 0.5, 1, W).off.batch) == pytest.approx(b)
    # Past the hinge: T = c0 + c1·B + 100.5·0.002·(B − 49); throughput peaks at the hinge.
    lim_off, _ = stability_limits(m, 0.5, 1, W)
    assert lim_off == pytest.approx(49 / (c0 + c1 * 49))
    assert bool(predict(m, lim_off * 1.001, 0.5, 1, W).off.overloaded)


def chain_latency_s(rate, t_of_others, bound, limit, tail_states=20000, queue_scale=1.0):
    """The birth–death chain summed by hand: π(n) ∝ Π λ/h(k), h(k) = k/T(k − 1), the limit past
    the bound, each request waiting past it counted ``queue_scale``."""
    weight, z, mean, best = 1.0, 1.0, 0.0, 0.0
    for n in range(1, bound + tail_states):
        h = limit if n > bound else max(best, n / t_of_others(n - 1))
        best = h
        weight *= rate / h
        z += weight
        mean += (n - (1.0 - queue_scale) * max(n - bound, 0)) * weight
    return mean / z / rate


def test_max_num_seqs_bounds_the_batch_and_queueing_rises_before_it():
    m = simple(max_num_seqs=10)
    c0, c1 = steps() * 0.011, steps() * 0.001
    limit = 10 / (c0 + c1 * 10)
    p = predict_point(m, 0.5 * limit, 0.5, 1, W)
    fluid = c0 / (1 - 0.5 * limit * c1)
    assert p.latency_off_s > fluid  # states above the mean batch, and the queue past the bound
    # W's lengths are all equal: the queue past the bound holds half the memoryless chain's.
    want = chain_latency_s(0.5 * limit, lambda b: c0 + c1 * b, 10, limit, queue_scale=0.5)
    assert p.latency_off_s == pytest.approx(want, rel=1e-9)
    near = predict_point(m, 0.99 * limit, 0.5, 1, W)
    assert near.latency_off_s > 5 * (c0 + c1 * 10)
    over = predict(m, limit, 0.5, 1, W)
    assert bool(over.off.overloaded) and math.isinf(float(over.off.latency_s))
    assert float(over.off.stability_limit_rps) == pytest.approx(limit)


def test_the_queue_past_a_full_batch_scales_with_the_lengths_spread():
    # A fixed 50-ms step: with max_num_seqs = 8 the batch is M/G/8, each request a server for
    # its (G + 0.5) steps. Those waiting past the bound wait (1 + C_s²)/2 times the memoryless
    # chain's (Allen–Cunneen), C_s the generated lengths' CV; the running batch's law is the chain's.
    m = LatencyModel(target=StepCost(0.05, 0.0), max_num_seqs=8)
    memoryless, _ = curves(m, 0.5, 1, Workload(0, 100, 100.0))
    service = memoryless.alone_s
    assert service == pytest.approx(0.05 * 100.5)
    assert memoryless.queue_variability == 1.0
    for sd, f in ((0.0, 0.5), (50.0, 0.625), (150.0, 1.625)):
        curve, _ = curves(m, 0.5, 1, Workload(0, 100, sd))
        assert curve.queue_variability == pytest.approx(f)
        assert curve.stability_limit_rps == memoryless.stability_limit_rps
        rates = [r * curve.stability_limit_rps for r in (0.3, 0.9, 0.99)]
        want = [service + f * (memoryless.latency_s(x) - service) for x in rates]
        assert [curve.latency_s(x) for x in rates] == pytest.approx(want, rel=1e-9)
        assert curve.latencies_s(rates) == pytest.approx(want, rel=1e-9)
        assert curve.latency_s(curve.stability_limit_rps) == math.inf
    # Unmeasured lengths are taken as geometric: memoryless.
    assert curves(m, 0.5, 1, Workload(0, 100))[0].queue_variability == 1.0
    # Where the KV cache bounds the batch the count it holds moves with the lengths: not applied.
    kv = LatencyModel(target=StepCost(0.05, 0.0), max_num_seqs=256, kv_cache_tokens_off=400)
    bounded, _ = curves(kv, 0.5, 1, Workload(0, 100, 0.0))
    assert bounded.limit_reason == "kv_cache"
    assert bounded.queue_variability == 1.0


def test_kv_cache_bounds_the_batch_with_less_room_for_sd():
    w = Workload(0, 100, 0.0)  # 50 tokens of context per running sequence
    m = LatencyModel(
        target=StepCost(0.010, 0.001), draft=StepCost(0.001, 0.0001), max_num_seqs=256,
        kv_cache_tokens_off=1000, kv_cache_tokens_on=500,
    )  # fmt: skip
    off, on = curves(m, 0.7, 2, w)
    assert off.batch_bound == pytest.approx(20.0)
    assert on.batch_bound == pytest.approx(10.0)
    assert off.stability_limit_rps == pytest.approx(20.0 / off.latency_at_batch(20.0))


def test_a_kv_full_batch_recomputes_prompts_and_finishes_slower():
    # 1,000-token prompts, 250 generated: ~1,250 tokens of context per sequence, so a
    # 100k-token cache holds ~80 sequences, far below max_num_seqs.
    w = Workload(1000.0, 250.0, 250.0)
    m = LatencyModel(
        target=StepCost(0.010, 2e-5, context_s_per_token=2e-8), draft=StepCost(0.001, 2e-6), max_num_seqs=256,
        kv_cache_tokens_off=100_000, kv_cache_tokens_on=100_000,
    )  # fmt: skip
    off, _ = curves(m, 0.7, 2, w)
    b = off.batch_bound
    assert b == pytest.approx(100_000 / w.mean_context_tokens)
    # Each completion is followed by a preemption with probability r, recomputing a prompt.
    r = 250.0 / 1000.0 * (1.0 - math.exp(-1000.0 / 250.0))
    decode, prompts = off.steps * off.step(b), b * off.prompt(b)
    top = math.floor(b)  # the chain's last state: top in the server, top − 1 others
    full = off.sharing_gain * top / off.latency_at_batch(top - 1.0)
    assert off.thrash_rps == pytest.approx(full * (decode + prompts) / (decode + prompts * (1.0 + r)), rel=1e-3)
    assert off.stability_limit_rps == off.thrash_rps < full
    # Up to the full batch's rate the server keeps up until a burst fills the cache: metastable.
    assert off.metastable_band_rps == (off.thrash_rps, off.cache_fill_limit_rps)
    assert off.cache_fill_limit_rps == pytest.approx(full, rel=1e-2)  # the continuous peak at the bound
    between = 0.5 * (off.thrash_rps + full)  # the full batch's rate without recompute would keep up
    assert predict_point(m, between, 0.7, 2, w).overloaded_off
    assert off.throughput_at_batch(2 * b, None, 1000.0) == pytest.approx(off.thrash_rps)
    # Where max_num_seqs bounds the batch first the cache never fills: no recompute.
    roomy, _ = curves(replace(m, max_num_seqs=40), 0.7, 2, w)
    assert roomy.batch_bound == 40 and math.isinf(roomy.thrash_rps)
    assert roomy.metastable_band_rps == (roomy.stability_limit_rps, roomy.stability_limit_rps)
    assert roomy.stability_limit_rps == pytest.approx(roomy.sharing_gain * 40 / roomy.latency_at_batch(40.0), rel=1e-3)


_PLAIN = StepCost(0.010, 2e-5, context_s_per_token=2e-8)
_KNEE = StepCost(0.010, 1e-5, knees_tokens=(64.0,), knee_slope_deltas=(1e-3,))  # compute-bound past 64


@pytest.mark.parametrize(
    ("target", "model_kw", "workload", "reason"),
    [
        (_KNEE, {}, Workload(0.0, 100.0, 0.0), "throughput_peak"),  # B/T(B) peaks at the knee
        (_PLAIN, {"max_num_seqs": 32}, Workload(100.0, 100.0, 0.0), "max_num_seqs"),
        (_PLAIN, {"kv_cache_tokens_off": 1000}, Workload(0.0, 100.0, 0.0), "kv_cache"),  # no prompt to recompute
        (_PLAIN, {"kv_cache_tokens_off": 100_000}, Workload(1000.0, 250.0, 250.0), "kv_recompute"),
        (_PLAIN, {"max_num_batched_tokens": 1024}, Workload(2000.0, 50.0, 0.0), "token_budget"),
    ],
)
def test_the_limit_says_what_sets_it(target, model_kw, workload, reason):
    m = LatencyModel(target=target, draft=StepCost(0.001, 2e-6), **{"max_num_seqs": 256, **model_kw})
    off, _ = curves(m, 0.7, 2, workload)
    assert off.limit_reason == reason
    assert reason in LIMIT_REASONS
    if reason == "throughput_peak":
        assert off.peak_batch < off.batch_bound


def test_prefix_caching_recomputes_only_what_the_growth_evicted():
    # With the victim's blocks cached, its readmission recomputes (X − U)⁺ tokens, at most its
    # prompt: on average r²·P. Checked by sampling the growth X ~ Exp(G) and the leftover U.
    p, g = 1000.0, 250.0
    r = g / p * (1.0 - math.exp(-p / g))
    rng = np.random.default_rng(3)
    x, u = rng.exponential(g, 400_000), rng.uniform(0.0, p, 400_000)
    assert np.mean(x > u) == pytest.approx(r, rel=0.01)  # a preemption per completion
    assert np.mean(np.minimum(np.maximum(x - u, 0.0), p)) / p == pytest.approx(r * r, rel=0.02)
    # The model prices it so: the full batch's rate falls by 1 + r² of the prompts' share, not 1 + r.
    w = Workload(p, g, g)
    m = LatencyModel(
        target=StepCost(0.010, 2e-5, context_s_per_token=2e-8), max_num_seqs=256, kv_cache_tokens_off=100_000
    )
    recompute, _ = curves(m, 0.7, 0, w)
    cached, _ = curves(replace(m, prefix_caching=True), 0.7, 0, w)
    b = cached.batch_bound
    decode, prompts = cached.steps * cached.step(b), b * cached.prompt(b)
    assert cached.thrash_rps / recompute.thrash_rps == pytest.approx(
        (decode + prompts * (1.0 + r)) / (decode + prompts * (1.0 + r * r)), rel=1e-9
    )
    assert recompute.stability_limit_rps < cached.stability_limit_rps == cached.thrash_rps < cached.cache_fill_limit_rps


def test_a_stranded_chunked_prompt_loops_until_a_completion():
    # 4k-token prompts (lognormal, sd 1,650), 2,000 tokens of room a step, 45 running and 195
    # steps a request. Sampled: the room left after the admissions L ~ U[0, P_n); the head
    # prompt computes the ⌊L/c⌋ chunks that fit, then the next finds no block.
    p, sd, room, bound, steps = 4000.0, 1650.0, 2000.0, 45.0, 195.0
    rng = np.random.default_rng(5)
    s = math.sqrt(math.log1p((sd / p) ** 2))
    p_n = rng.lognormal(math.log(p) - 0.5 * s * s, s, 400_000)
    fits = np.floor(rng.uniform(0.0, 1.0, p_n.size) * p_n / room)
    assert (fits >= 2).any()
    # Rounds of j chunk steps and a preempting one, until a completion at a step's end
    # (probability 1 − e^(−B/steps)); a round's chunks are kept if it came after a chunk step.
    first = rng.geometric(-math.expm1(-bound / steps), p_n.size) - 1  # the step it came after
    rounds, at = np.divmod(first, fits + 1)
    wasted = np.mean(np.where(fits > 0, fits * (rounds + (at == fits)), 0.0))
    # Admissions wait on blocks as often as the budget's room outruns the prompt tokens the
    # completions free net of the batch's growth (B·P/steps a step): here 54 % of the time.
    starved = 1.0 - bound * p / (steps * room)
    assert stuck_chunks(p, sd, room, bound, steps) == pytest.approx(starved * wasted, rel=0.02)
    # One length strands too (the room left wanders over [0, P)); prompts shorter than the
    # room never are; nor is any where the budget, not the cache, paces the admissions.
    one = np.floor(rng.uniform(0.0, p, p_n.size) / room)
    rounds, at = np.divmod(first, one + 1)
    wasted_one = np.mean(np.where(one > 0, one * (rounds + (at == one)), 0.0))
    assert stuck_chunks(p, None, room, bound, steps) == pytest.approx(starved * wasted_one, rel=0.02)
    assert stuck_chunks(1900.0, None, room, bound, steps) == 0.0
    assert stuck_chunks(p, sd, room, 100.0, steps) == 0.0  # 100·4000/195 tokens freed a step > 2000
    assert 0.0 < stuck_chunks(p, sd, room, 90.0, steps) < stuck_chunks(p, sd, room, bound, steps)


def test_a_full_cache_without_prefix_caching_pays_for_stranded_chunks():
    # A 2,048-token budget cuts 4k prompts at a full cache. Without prefix caching each stranded
    # prompt recomputes its first chunk every other step until a completion; with it the chunk
    # stays cached and costs nothing again. No knees: the chunks cost what one pass does.
    p, sd, g = 4000.0, 1650.0, 196.0
    w = Workload(p, g, g, sd)
    target = StepCost(0.010, 2e-5, context_s_per_token=2e-8)
    m = LatencyModel(target=target, max_num_seqs=256, kv_cache_tokens_off=190_000, max_num_batched_tokens=2048)
    recompute, _ = curves(m, 0.7, 0, w)
    cached, _ = curves(replace(m, prefix_caching=True), 0.7, 0, w)
    b = cached.batch_bound
    decode, prompts = cached.steps * cached.step(b), b * cached.prompt(b)
    r = g / p * (1.0 - math.exp(-p / g))
    full = cached.thrash_rps * (decode + prompts * (1.0 + r * r)) / (decode + prompts)
    room = 2048.0 - b
    stuck_s = stuck_chunks(p, sd, room, b, cached.steps) * 2e-5 * room  # a chunk of the room
    assert stuck_s > 0.0
    assert recompute.thrash_rps == pytest.approx(
        full * (decode + prompts) / (decode + prompts * (1.0 + r) + b * stuck_s), rel=1e-9
    )
    # A room as wide as the prompts: none is stranded, only the growth's recompute remains.
    roomy = replace(m, max_num_batched_tokens=100_000)
    plain, plain_cached = curves(roomy, 0.7, 0, w)[0], curves(replace(roomy, prefix_caching=True), 0.7, 0, w)[0]
    b2 = plain.batch_bound
    d2, p2 = plain.steps * plain.step(b2), b2 * plain.prompt(b2)
    assert plain_cached.thrash_rps / plain.thrash_rps == pytest.approx(
        (d2 + p2 * (1.0 + r)) / (d2 + p2 * (1.0 + r * r)), rel=1e-9
    )


def test_prediction_interval_is_the_scaled_costs():
    m = replace(simple(max_num_seqs=50), relative_sd_off=0.05, relative_sd_on=0.08)
    p = predict_point(m, 3.0, 0.6, 2, W)
    assert p.latency_off_lo_s < p.latency_off_s < p.latency_off_hi_s
    assert p.latency_on_lo_s < p.latency_on_s < p.latency_on_hi_s
    s = 1 + 1.645 * 0.05
    slower = replace(m, scale_off=s, relative_sd_off=0.0)
    assert p.latency_off_hi_s == pytest.approx(predict_point(slower, 3.0, 0.6, 2, W).latency_off_s, rel=1e-9)
    assert p.speedup_lo < p.speedup < p.speedup_hi


def test_overload_is_explicit_never_nan():
    p = predict(simple(), np.array([0.0, 5.0, 8.0, 10.5, 50.0]), 0.5, 1, W)
    for arr in (p.speedup, p.on.latency_s, p.off.latency_s, p.on.batch, p.off.batch):
        assert not np.isnan(arr).any()
    lim_off, lim_on = stability_limits(simple(), 0.5, 1, W)
    assert lim_on < 8.0 < lim_off < 10.5
    assert list(p.off.overloaded) == [False, False, False, True, True]
    assert float(p.speedup[2]) == 0.0  # only SD is overloaded


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
    p = predict_point(moe, 3.0, 0.7, 4, W)
    assert not p.overloaded_on
    _off, on = curves(moe, 0.7, 4, W)
    assert p.batch_on == pytest.approx(3.0 * on.fluid_latency_s(3.0), rel=1e-9)  # B = λ·T(B)
    # The chain's states around B: MoE's T is concave in the batch, so they average below T(B).
    assert p.latency_on_s == pytest.approx(on.fluid_latency_s(3.0), rel=0.1)


def test_best_draft_length_shrinks_with_load():
    m = simple(verify=StepCost(0.012, 0.002))
    low = best_draft_length(m, 0.1, 0.8, W)
    high = best_draft_length(m, 3.0, 0.8, W)
    assert low.draft_length > high.draft_length
    lat = [predict_point(m, 0.1, 0.8, g, W).latency_on_s for g in range(1, 17)]
    assert low.draft_length == 1 + int(np.argmin(lat))


@pytest.mark.parametrize("cal", ["example", "truth", "legacy"])
def test_the_draft_length_search_that_stops_past_the_best_finds_the_exhaustive_latency(cal):
    """Stopping three candidates past the best costs at most the knees' ripples: SD's latency at
    the choice is within 1 % of the exhaustive search's over loads, acceptances and workloads
    (and the same choice in almost every case)."""
    from controller.calibration import load
    from controller.shipped import example_calibration_path
    from controller.sim.demo_truth import truth_calibration_path
    from tests.support import LEGACY_CALIBRATION

    path = {"example": example_calibration_path(), "truth": truth_calibration_path(), "legacy": LEGACY_CALIBRATION}
    m = load(path[cal]).latency_model()
    same = total = 0
    for alpha in (0.3, 0.6, 0.8, 0.95):
        for w in (Workload(200, 100, 80.0, 140.0), Workload(1000, 280, 280.0, 600.0), Workload(4000, 500)):
            limit = stability_limits(m, alpha, 1, w)[0]
            for f in (0.0, 0.3, 0.6, 0.85, 0.95, 1.05, 1.5, 3.0):
                rate = f * limit
                quick = best_draft_length(m, rate, alpha, w)
                full = best_draft_length(m, rate, alpha, w, patience=None)
                total += 1
                same += quick.draft_length == full.draft_length
                if math.isfinite(full.latency_on_s):
                    assert quick.latency_on_s <= full.latency_on_s * 1.01
                else:
                    assert quick == full  # overloaded at every γ: the highest capacity, as searching all
    assert same >= 0.95 * total


def _search_fake_curves(monkeypatch, limits: dict[int, float], rate: float = 100.0, alone_s: float = 1.0):
    """best_draft_length at ``rate`` over curves whose SD limits are ``limits`` (γ → req/s; SD
    off 10 req/s), each an M/M/1-like latency alone_s/(1 − rate/limit): the draft lengths it
    evaluated, those it built, and its choice."""
    import controller.model as model_mod

    built: list[int] = []
    tried: list[int] = []

    def curve(g: int, limit: float):
        def latency_s(r: float) -> float:
            tried.append(g)
            return alone_s / (1.0 - r / limit) if r < limit else math.inf

        return types.SimpleNamespace(stability_limit_rps=limit, latency_s=latency_s)

    def fake_build(model, workload, keys):
        built.extend(int(g) for sd, _en, g in keys if sd)
        return [curve(int(g), limits[int(g)]) if sd else curve(0, 10.0) for sd, _en, g in keys]

    monkeypatch.setattr(model_mod, "build_curves", fake_build)
    model_mod.mode_curve.cache_clear()
    try:
        choice = best_draft_length(simple(), rate, 0.7, Workload(1000.125, 280.0, 200.0, 500.0))
    finally:
        model_mod.mode_curve.cache_clear()
    return [g for g in tried if g], built, choice


@pytest.mark.parametrize(
    ("limits", "chosen", "tries"),
    [
        # Rises to γ = 4, falls after: three past the peak.
        ([11, 12, 13, 14, 13.5, 13, 12.5, 12, 11, 10, 9, 8, 7, 6, 5, 4], 4, 7),
        # A 1 % ripple past a first peak (a KV-bound capacity): three past it still find the second.
        ([11, 12, 13, 12.9, 13.2, 12.8, 12.5, 12, 11, 10, 9, 8, 7, 6, 5, 4], 5, 8),
        # Falling from the shortest draft.
        ([14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0.5, 0.25], 1, 4),
        # Rising to the longest: all 16.
        ([float(g) for g in range(11, 27)], 16, 16),
    ],
)
def test_a_load_past_every_capacity_stops_three_past_the_highest_capacity(monkeypatch, limits, chosen, tries):
    """Past every limit (plain decoding's too) the choice is the highest capacity, and the search
    stops CAPACITY_SEARCH_PATIENCE past it instead of building all 16 curves."""
    assert CAPACITY_SEARCH_PATIENCE == 3
    tried, built, choice = _search_fake_curves(monkeypatch, dict(enumerate(limits, start=1)), rate=100.0)
    assert tried == list(range(1, tries + 1))
    assert sorted(built) == list(range(1, len(built) + 1)) and len(built) <= max(tries + 1, 3)  # two at a time
    assert choice.draft_length == chosen
    assert choice.speedup == pytest.approx(limits[chosen - 1] / 10.0)
    assert math.isinf(choice.latency_on_s)


@pytest.mark.parametrize(
    ("rate", "chosen", "tries"),
    [
        # 16.35 req/s: γ = 2 carries it at 0.998 of its limit and γ = 3 does not; γ = 4 has more
        # room (the A100 apc calibration at α = 0.9, 4k prompts, its rates ×10: 5.4× faster there).
        (16.35, 4, 7),
        # At 0.6 of the best's limit latency decides alone: one past the best, as ever.
        (9.8, 2, 3),
    ],
)
def test_a_load_near_the_best_drafts_limit_searches_on_while_capacity_rises(monkeypatch, rate, chosen, tries):
    limits = [15.0, 16.39, 16.34, 16.83, 16.64, 16.72, 16.55, 16.33, 16.32, 16.08, 16.0, 15.8, 15.7, 15.5, 15.2, 15.1]
    assert NEAR_CAPACITY == 0.9
    tried, _built, choice = _search_fake_curves(monkeypatch, dict(enumerate(limits, start=1)), rate=rate)
    assert tried == list(range(1, tries + 1))
    assert choice.draft_length == chosen
    assert choice.latency_on_s == pytest.approx(1.0 / (1.0 - rate / limits[chosen - 1]))


def test_break_even_zero_and_always_above():
    slow = simple(verify=StepCost(0.1, 0.01))
    assert break_even_rates(slow, 0.5, 1, W)[1.05].rate_rps == 0.0
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

    legacy = draw(st.booleans())  # schema-1 style (whole SD step and stand-alone prefill fits)
    return LatencyModel(
        target=cost(),
        draft=cost(),
        sd_overhead_s=draw(st.floats(0.0, 0.002)),
        verify=cost() if legacy else None,
        prefill=cost() if legacy else None,
        max_num_seqs=draw(st.integers(1, 1024)),
        max_num_batched_tokens=draw(st.one_of(st.none(), st.integers(64, 16384))),
        kv_cache_tokens_off=draw(st.one_of(st.none(), st.floats(1e4, 1e6))),
        kv_cache_tokens_on=draw(st.one_of(st.none(), st.floats(1e4, 1e6))),
    )


@st.composite
def _workloads(draw):
    """Mean lengths, and spreads up to a coefficient of variation of 3 (real output lengths sit
    near 1). A spread far beyond its mean (454 tokens around a mean of 1) is no length
    distribution a server produces, and at such a point the speedup wiggles by 4e-4 near zero load."""
    prompt = draw(st.floats(0, 4096))
    gen = draw(st.floats(1, 1024))
    gen_std = draw(st.one_of(st.none(), st.floats(0, min(1024.0, 3.0 * gen))))
    prompt_std = draw(st.one_of(st.none(), st.floats(0, min(2048.0, 3.0 * max(prompt, 1.0)))))
    return Workload(prompt, gen, gen_std, prompt_std)


workloads = _workloads()


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
        off, on = curves(model, alpha, gamma, workload)
        curve = on if sd == "on" else off
        b, t = float(mode.batch), curve.fluid_latency_s(rate)
        assert abs(b - rate * t) <= 1e-9 * max(b, 1e-12)  # Little's law at the fluid fixed point
        # The batch's chain averages T over the states around B: never below a request alone.
        assert float(mode.latency_s) >= curve.latency_at_batch(0.0) * (1.0 - 1e-9)
        assert b <= curve.batch_bound * (1 + 1e-12) <= model.max_num_seqs * (1 + 1e-12)


def test_a_full_batch_served_past_what_its_fluid_step_allows_keeps_littles_law():
    # Found by test_fixed_point_holds: two sequences at most, 3-token prompts, 1 token each. The
    # prompts around the step in flight serve the full batch faster than T(bound), so the limit
    # passes bound/T(bound); between the two the fluid batch is full and completes what it is sent.
    c = StepCost(0.03125, 0.00390625)
    m = LatencyModel(target=c, draft=c, max_num_seqs=2)
    workload = Workload(3.0, 1.0)
    off, _ = curves(m, 0.0, 1, workload)
    rate = 0.96875 * off.stability_limit_rps
    assert rate > off.batch_bound / off.latency_at_batch(off.batch_bound)  # past the fluid's own
    assert off.batch(rate) == off.batch_bound
    assert off.batch(rate) == pytest.approx(rate * off.fluid_latency_s(rate), rel=1e-12)


def test_a_request_of_one_step_is_given_no_more_than_its_prompts_allow():
    # Found by test_fixed_point_holds: a 22-token prompt, 1 token generated, prompts dear beside
    # the decode step. The request's life is its prefill step, so (T − wait)/(steps + 1) was the
    # whole prefill of the B + 1 prompts, not a step; counting its arrivals as prompts it never
    # meets halved T near capacity, and the limits (19.0 and 6.27 req/s) passed 1/Δ, what the
    # server's prompts alone allow a second whatever else its steps do.
    cost = StepCost(0.03125, 0.00390625)
    m = LatencyModel(StepCost(0.0078125, 1e-05), cost, verify=cost, prefill=cost, max_num_seqs=7)
    workload = Workload(22.0, 1.0)
    for curve, limit in zip(curves(m, 0.0, 1, workload), stability_limits(m, 0.0, 1, workload), strict=True):
        assert 0.0 < limit < 1.0 / max(curve.prompt(b) for b in range(7))


@settings(max_examples=200, deadline=None)
@given(models(), workloads, st.floats(0.0, 1.0), st.floats(0.0, 3.0))
def test_gamma_zero_speedup_is_one(model, workload, alpha, frac):
    lim, _ = stability_limits(model, alpha, 1, workload)
    assert float(predict(model, frac * lim, alpha, 0, workload).speedup) == 1.0


@settings(max_examples=200, deadline=None)
@given(models(knees=False), workloads, st.floats(0.0, 1.0), st.integers(1, 16))
def test_speedup_never_rises_with_rate_when_sd_has_the_larger_slope(model, workload, alpha, gamma):
    # Lines only, no prompts: T rises with the batch in both modes, and S falls when c1_SD >= c1_off.
    model = LatencyModel(
        target=StepCost(model.target.intercept_s, model.target.slope_s_per_token),
        draft=StepCost(model.draft.intercept_s, model.draft.slope_s_per_token),
        max_num_seqs=MAX_STATES,  # every state of the batch's chain enumerated
    )
    workload = Workload(0.0, workload.gen_tokens, 0.0)
    lim_off, lim_on = stability_limits(model, alpha, gamma, workload)
    # With slopes so flat that both modes reach the batch bound first, the bound sets each
    # limit (bound / T(bound)) and SD, with fewer steps, has the larger one: plain decoding then
    # diverges first and S rises toward it. The slope's claim is about SD saturating first.
    assume(lim_on <= lim_off)
    rates = np.linspace(0.0, lim_on * (1 - 1e-9), 200)
    s = predict(model, rates, alpha, gamma, workload).speedup
    assert np.all(np.isfinite(s))
    assert np.all(np.diff(s) <= 1e-9 * np.maximum(1.0, np.abs(s[:-1])))


def test_a_hair_below_the_limit_the_latency_is_finite_not_nan():
    # 4,096 states of a chain whose sums come near a float's top: the queue past them, 1/(1 − r)²
    # at r = 1 − 1e-9, took them past it and the latency (and the speedup) read NaN.
    model = LatencyModel(target=StepCost(0.029296875, 6.103515625e-05), draft=StepCost(0.029296875, 6.103515625e-05))
    model = replace(model, max_num_seqs=MAX_STATES)
    workload = Workload(0.0, 1.0, 0.0)
    lim_on = stability_limits(model, 0.0, 1, workload)[1]
    rates = np.linspace(0.0, lim_on * (1 - 1e-9), 200)
    p = predict(model, rates, 0.0, 1, workload)
    assert np.all(np.isfinite(p.speedup)) and np.all(np.isfinite(p.on.latency_s))
    near = [float(predict(model, lim_on * (1 - e), 0.0, 1, workload).on.latency_s) for e in (1e-6, 1e-8, 1e-9)]
    assert all(math.isfinite(t) for t in near) and near[0] < near[1] < near[2]  # rising toward the limit


def test_a_bound_that_caps_both_modes_lets_sd_outlast_plain_decoding():
    # The case the slope test sets aside: flat slopes, every state enumerated, both modes at the
    # bound. SD (α = 1, γ = 1: half the steps) then has the larger limit, so S grows near μ_off.
    model = LatencyModel(target=StepCost(0.046875, 1e-6), draft=StepCost(0.015625, 1e-6), max_num_seqs=MAX_STATES)
    w = Workload(0.0, 5.0, 0.0)
    lim_off, lim_on = stability_limits(model, 1.0, 1, w)
    assert lim_on > lim_off
    s = predict(model, [0.5 * lim_off, 0.999 * lim_off], 1.0, 1, w).speedup
    assert s[1] > s[0]


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
            eps = 1e-4 * be.rate_rps  # the crossing is refined to 1e-5 relative
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


def test_token_budget_starves_prefill():
    # Per step the D decoding requests need D tokens and arriving prompts λ·τ·P more
    # (τ = τ_d/(1 − λΔ)): past the rate where that exceeds the budget, prefill cannot keep up.
    # D is Little's, the requests in their decode steps at that step: λ·steps·τ.
    m = simple(max_num_batched_tokens=100)
    w = Workload(prompt_tokens=50, gen_tokens=100, gen_tokens_std=0.0)
    off, _ = curves(m, 0.5, 1, w)
    assert off.limit_reason == "token_budget"
    lam = off.stability_limit_rps

    def step(d):
        return off.step(d) / (1 - lam * off.prompt(d))

    d = off.batch(lam)
    for _ in range(200):
        d = lam * off.steps * step(d)
    used = off.step_tokens * d + lam * 50 * step(d)
    assert used == pytest.approx(100, rel=1e-6)
    assert d < 0.98 * off.batch(lam)  # the fluid batch also holds each request's prompt step
    unbounded, _ = curves(simple(), 0.5, 1, w)
    assert lam < unbounded.stability_limit_rps
    vec = predict(m, [lam * 0.999, lam * 1.001], 0.5, 1, w)
    assert list(vec.off.overloaded) == [False, True]


def test_a_budget_the_full_batch_fills_to_a_rounding_keeps_a_positive_limit():
    # Prompts of next to no tokens: the decoders at the limit come to the batch bound and fill
    # the budget but for a rounding; the room there is never taken as none (a zero limit, and a
    # chain capped at zero, which no rate can be).
    m = LatencyModel(target=StepCost(0.03125, 0.00390625), draft=StepCost(0.03125, 0.00390625))
    m = replace(m, max_num_seqs=209, max_num_batched_tokens=209)
    off, on = curves(m, 0.0, 1, Workload(prompt_tokens=6.188134590586491e-225, gen_tokens=358.75))
    assert off.stability_limit_rps > 0.0 and on.stability_limit_rps > 0.0


def test_past_the_budgets_limit_the_chain_queues():
    """Where the token budget sets the limit no state of the chain completes faster than it (the
    prompts' chunks wait for room), so near the limit requests queue as at a throughput peak:
    without the cap the chain's own rates ran past the limit and its latency stayed low there."""
    m = simple(max_num_batched_tokens=60, max_num_seqs=64)
    w = Workload(prompt_tokens=50, gen_tokens=100, gen_tokens_std=30.0)
    off, _ = curves(m, 0.5, 1, w)
    assert off.limit_reason == "token_budget"
    lam = off.stability_limit_rps
    from controller import model as M

    ((chain, _, _),) = M._chain_rates([M._chain_terms(m, w, False, 1.0, 0.0)])
    raw = np.exp(np.diff(chain))
    assert raw.max() > 1.03 * lam  # the chain alone would outrun the budget
    rates = np.exp(np.diff(off.cum_log_rates))
    assert rates.max() <= lam * (1 + 1e-12)
    np.testing.assert_allclose(rates, np.minimum(raw, lam), rtol=1e-12)
    # a queue at the limit: the latency grows as 1/(1 − λ/μ) into it
    near = [off.latency_s(f * lam) for f in (0.9, 0.99)]
    assert near[1] > 2.5 * near[0]


def test_a_full_steps_later_prompts_cost_the_sharing_gap_less():
    """Short prompts on a budget: every step at the limit holds J = (budget − k·D)/P of them,
    and past a knee each after the first costs less; priced all as the first (the limit of
    stop 58) a 2048-token budget's limit sat 2-3 % under what the truth served (A100, chat)."""
    knee = StepCost(0.010, 0.0001, (256.0,), (-0.00006,))
    m = LatencyModel(target=knee, max_num_seqs=256, max_num_batched_tokens=512)
    w = Workload(prompt_tokens=120, gen_tokens=100, gen_tokens_std=30.0)
    off, _ = curves(m, 0.5, 1, w)
    assert off.limit_reason == "token_budget"
    flat = LatencyModel(target=StepCost(0.010, 0.0001), max_num_seqs=256, max_num_batched_tokens=512)
    assert curves(flat, 0.5, 1, w)[0].limit_reason == "token_budget"
    from controller import model as M

    c = M._chain_terms(m, w, False, 1.0, 0.0)
    assert c.sharing is not None
    alone = M._budget_limit(off, 512.0, 120.0, None if c.chunking is None else c.chunking[0])
    assert off.stability_limit_rps > 1.01 * alone


def test_full_batch_admission_is_limited_by_the_budget():
    from controller.model import throughput_at_batch

    m = simple(max_num_batched_tokens=250, max_num_seqs=1000)
    w = Workload(prompt_tokens=50, gen_tokens=100, gen_tokens_std=0.0)
    # SD γ=1 at B=100: verify takes 200 of the 250 tokens; 50 left per step for one 50-token
    # prompt per step, a step being the verify pass at batch B + 1.
    _, on = curves(m, 0.5, 1, w)
    t_step = on.step(100)
    assert throughput_at_batch(m, 100, True, 0.5, 1, w) == pytest.approx(50 / (50 * t_step))
    assert throughput_at_batch(simple(), 100, True, 0.5, 1, w) > throughput_at_batch(m, 100, True, 0.5, 1, w)


def test_the_wait_weighs_each_prompt_length_by_its_whole_marginal_cost():
    # A pass whose per-token cost sits in a knee (no plain slope) plus attention: q = E[Δ²]/E[Δ]²
    # over the prompt-length nodes must see the knee's share too, not only the attention's.
    target = StepCost(0.010, 0.0, (1.0,), (0.0001,), pair_s=1e-9)
    m = LatencyModel(target=target, max_num_seqs=BIG)
    w = Workload(2000, 100, 0.0, 1200.0)
    off, _ = curves(m, 0.5, 1, w)
    costs = [(wt, target.scalar(1 + x, pairs=0.5 * x * x) - target.scalar(1)) for wt, x in w.prompt_nodes]
    mean = sum(wt * c for wt, c in costs)
    q = sum(wt * c * c for wt, c in costs) / mean**2
    assert 1.0 < q < 2.0
    lam = 2.0
    b = off.batch(lam)
    tau, delta = off.step(b), off.prompt(b)
    first_order = 0.5 * tau + lam * 0.5 * delta * (tau + q * delta)
    assert off.wait_s(lam) == pytest.approx(first_order + bunched_wait_excess(lam, tau, delta, q), rel=1e-6)
    assert curves(m, 0.5, 1, Workload(2000, 100, 0.0, 1e-9))[0].prompt_q == pytest.approx(1.0)
    assert off.prompt_q == pytest.approx(q)


def _shared_prompt_cost(arrivals: float, bunching: float, first: float, second: float) -> float:
    """E[C(J)]/E[J] for the J prompts a step carries, C(j) = first + (j − 1)·second, when each
    step's prompts are those that arrived during the one before: J' ~ Poisson(a + b·J), a = λ·τ,
    b = λ·Δ. Its stationary law by iterating the transition matrix over J = 0..199."""
    j = np.arange(200.0)
    mean = arrivals + bunching * j[:, None]  # the next step's Poisson mean, from each J
    log_pmf = j * np.log(mean) - mean - np.array([math.lgamma(k + 1.0) for k in j])
    step = np.exp(log_pmf)
    law = np.zeros(j.size)
    law[0] = 1.0
    for _ in range(2000):
        law = law @ step
    mu = float(law @ j)
    carried = 1.0 - float(law[0])
    return (first * carried + second * (mu - carried)) / mu


def _with_arrivals_in_flight(t, x, tau, delta, b, q, n_steps):
    """T with what the prompts around the step in flight add: the wait their bunching lengthens
    (bunched_wait_excess), and, at λ = B/T, λ·Δ·(wait − the mean step of the request's life, at
    most twice the wait): the prompts that arrived in the step in flight before it share its
    prefill step, those that arrive in its last step are prefilled after it. ``x``: T without the wait λ·R (t − x is it)."""
    lam = b / t
    excess = bunched_wait_excess(lam, tau, delta, q)
    wait = 0.5 * tau + (t - x) + excess
    t = t + excess
    return t + lam * delta * (wait - np.minimum((t - wait) / (n_steps + 1.0), 2.0 * wait))


@pytest.mark.parametrize(
    ("delta_past_knee", "bound", "states"), [(-0.0008, 50, (1, 10, 40)), (0.0008, 200, (1, 5, 10))]
)
def test_prompts_that_share_a_step_cost_what_their_branching_count_averages(delta_past_knee, bound, states):
    # Past 64 tokens a pass costs 0.2 (concave) or 1.8 (convex) ms/token instead of 1: a second
    # 500-token prompt in the step costs less (more) than the first. A step carries the J prompts
    # that arrived during the one before, J' ~ Poisson(λ·(τ + Δ·J)); every prompt a request meets
    # costs E[C(J)]/E[J], and the chain's T(B) is that fixed point at λ = B/T.
    target = StepCost(0.010, 0.001, (64.0,), (delta_past_knee,))
    m = LatencyModel(target=target, max_num_seqs=bound)
    off, _ = curves(m, 0.5, 1, Workload(500, 100, 0.0, 0.0))
    h = np.exp(np.diff(off.cum_log_rates))  # h(n) = n / T(n − 1), n = 1..bound (while it rises)
    for b in states:
        tau, delta = off.step(b), off.prompt(b)
        kb = b + 1.0
        first = target.scalar(kb + 500) - target.scalar(kb)
        second = target.scalar(kb + 1000) - target.scalar(kb + 500)
        assert delta == pytest.approx(first)
        x, r = steps() * tau + (b + 1) * delta, 0.5 * delta * (tau + delta)
        t = plain = off.latency_at_batch(b)
        for _ in range(200):
            lam = b / t
            shared = _shared_prompt_cost(lam * tau, lam * delta, first, second)
            t = 0.5 * ((x - (b + 1) * (delta - shared)) + math.sqrt((x - (b + 1) * (delta - shared)) ** 2 + 4 * b * r))
        # and what the prompts around the step in flight add (one prompt length: q = 1), at the state's λ.
        t = _with_arrivals_in_flight(t, x - (b + 1) * (delta - shared), tau, delta, b, 1.0, off.steps)
        assert (b + 1) / h[b] == pytest.approx(t, rel=1e-3)  # one pass from the unshared T, not the fixed point
        if abs(first - second) > 1e-9:  # past the knee both cost the same: no gap
            assert (t < plain) == (delta_past_knee < 0)
    # The limit moves with the best state's rate; a drain at the full batch gains as much.
    bunching_only = curves(replace(m, target=StepCost(0.010, 0.001)), 0.5, 1, Workload(500, 100, 0.0, 0.0))[0]
    assert bunching_only.sharing_gain < 1.0  # bunched prompts only ever cost
    assert (off.sharing_gain > bunching_only.sharing_gain) == (delta_past_knee < 0)
    grid = np.linspace(1.0, bound, 4000)
    plain_peak = max(g / off.latency_at_batch(g) for g in grid)
    assert off.stability_limit_rps == pytest.approx(plain_peak * off.sharing_gain, rel=1e-3)
    full = off.throughput_at_batch(bound, None, 500)
    assert full == pytest.approx(off.sharing_gain * bound / off.latency_at_batch(bound))


def test_prompts_share_nothing_where_every_token_costs_the_same():
    # No knee: a second prompt costs what the first does; the chain is T(B) itself, plus what the
    # prompts around the step in flight add at each state's own rate.
    m = LatencyModel(target=StepCost(0.010, 0.001), max_num_seqs=200)
    off, _ = curves(m, 0.5, 1, Workload(500, 100, 0.0, 300.0))
    h = np.exp(np.diff(off.cum_log_rates))
    n = np.arange(1.0, 201.0)
    t = np.array([off.latency_at_batch(b) for b in n - 1.0])
    b = n - 1.0
    tau, delta = np.array([off.step(x) for x in b]), np.array([off.prompt(x) for x in b])
    x = steps() * tau + (b + 1) * delta  # T without the wait λ·R
    t = _with_arrivals_in_flight(t, x, tau, delta, b, off.prompt_q, off.steps)
    want = n / t
    assert off.sharing_gain == pytest.approx(want.max() / (n / np.array([off.latency_at_batch(x) for x in b])).max())
    assert off.sharing_gain < 1.0
    np.testing.assert_allclose(h, np.maximum.accumulate(want), rtol=1e-12)


@pytest.mark.parametrize(
    ("f", "lo", "hi", "root"),
    [
        (lambda x: 3.0 - x, 0.0, 10.0, 3.0),  # a line: one secant step lands on it
        (lambda x: 1.0 - 1.0 / (10.0 - x), 8.0, 9.9, 9.0),  # steepening, as S falls to 0 at μ_on
        (lambda x: math.exp(-x) - 0.5, 0.0, 40.0, math.log(2.0)),  # flat on one side: regula falsi creeps
        (lambda x: 1.0 if x < 2.5 else -1.0, 0.0, 10.0, 2.5),  # a step: no slope to follow at all
    ],
)
def test_crossing_is_bracketed_and_cheaper_than_bisection(f, lo, hi, root):
    from controller.model import BREAK_EVEN_REL_TOL, _crossing

    calls = []

    def counted(x):
        calls.append(x)
        return f(x)

    x = _crossing(counted, lo, hi, f(lo), f(hi))
    assert abs(x - root) <= BREAK_EVEN_REL_TOL * root
    assert all(lo < c < hi for c in calls)
    # Bisection needs log2((hi − lo)/(tol·root)) evaluations; a smooth crossing takes fewer.
    halvings = math.ceil(math.log2((hi - lo) / (BREAK_EVEN_REL_TOL * root)))
    assert len(calls) <= (halvings if f(lo) != 1.0 else 2 * halvings)


def test_crossing_stays_within_twice_bisection_on_bent_monotone_curves():
    """Decreasing piecewise-linear curves whose pieces differ in slope by up to seven orders of
    magnitude (a speedup flat for a while, then falling into SD's limit): the root is found to
    the tolerance inside the bracket, never with more than twice bisection's evaluations (the
    Illinois method this replaced took up to 5.8 times as many on such curves)."""
    from controller.model import BREAK_EVEN_REL_TOL, _crossing

    rng = np.random.default_rng(3)
    for _ in range(300):
        xs = np.concatenate(([0.0], np.sort(rng.uniform(0.0, 10.0, rng.integers(2, 13))), [10.0]))
        ys = np.sort(rng.uniform(-1.0, 1.0, xs.size) * 10.0 ** rng.uniform(-6.0, 1.0, xs.size))[::-1]
        if not ys[0] >= 0.0 > ys[-1]:
            continue
        calls = []

        def f(x, xs=xs, ys=ys, calls=calls):
            calls.append(x)
            return float(np.interp(x, xs, ys))

        x = _crossing(f, 0.0, 10.0, float(ys[0]), float(ys[-1]))
        tol = BREAK_EVEN_REL_TOL * x
        assert f(x - tol) >= 0.0 > f(x + tol) or abs(f(x)) < 1e-12
        calls.pop(), calls.pop()
        assert all(0.0 < c < 10.0 for c in calls)
        assert len(calls) <= 2 * math.ceil(math.log2(10.0 / tol))


def test_thresholds_in_one_bracket_refine_from_each_others_rates(monkeypatch):
    """Speedup falling steeply into SD's own limit: all three thresholds cross between the same
    two grid rates. Each later threshold starts from the rates the earlier ones evaluated, so
    the three cost little more than one (each alone from the grid: 11–12 evaluations)."""
    from controller import calibration
    from controller import model as M
    from controller.shipped import example_calibration_path

    model = calibration.load(example_calibration_path()).latency_model()
    w = Workload(2000.0, 280.0, 200.0, 500.0)
    calls = []
    real = M.ModeCurve.latency_s
    monkeypatch.setattr(M.ModeCurve, "latency_s", lambda self, lam: calls.append(lam) or real(self, lam))
    found = break_even_rates(model, 0.7, 2, w)
    monkeypatch.undo()
    rates = sorted(be.rate_rps for be in found.values())
    _, mu_on = stability_limits(model, 0.7, 2, w)
    assert rates[0] > (1.0 - 1.0 / M.BREAK_EVEN_GRID) * mu_on  # one bracket: the grid's last
    for th, be in found.items():
        eps = M.BREAK_EVEN_REL_TOL * be.rate_rps
        assert (
            speedup_point(model, be.rate_rps - eps, 0.7, 2, w)
            >= th
            > speedup_point(model, be.rate_rps + eps, 0.7, 2, w)
        )
    assert len(calls) / 2 <= 20  # two curves a rate; each threshold alone took 11–12


def test_a_cycles_speedup_is_the_ratio_of_its_requests_mean_latencies():
    """Equal time at each rate: the requests of the busy phase count by their rate, so a cycle
    whose crest loses with SD can lose overall though SD wins at most of its rates."""
    m = simple(max_num_seqs=64)
    rates = [0.5, 0.5, 0.5, 4.0]
    points = [predict_point(m, r, 0.7, 4, W) for r in rates]
    assert all(math.isfinite(p.latency_on_s) for p in points)
    want = sum(r * p.latency_off_s for r, p in zip(rates, points, strict=True)) / sum(
        r * p.latency_on_s for r, p in zip(rates, points, strict=True)
    )
    assert cycle_speedup(points) == pytest.approx(want, rel=1e-12)
    # Not the time-average of the speedups (the quiet phases would outvote the crest).
    assert cycle_speedup(points) != pytest.approx(sum(p.speedup for p in points) / len(points), rel=1e-3)
    # SD overloaded at one point of the cycle (its limit, not plain decoding's): 0, as at one rate.
    mu_off, mu_on = points[0].stability_limit_off_rps, points[0].stability_limit_on_rps
    assert mu_on < mu_off
    over = predict_point(m, 0.5 * (mu_on + mu_off), 0.7, 4, W)
    assert cycle_speedup([*points[:3], over]) == 0.0


def test_many_points_in_one_pass_are_the_single_points():
    m = simple(max_num_seqs=64)
    rates = [0.0, 0.5, 2.0, 4.0, 5.0, 6.0, 9.0]  # idle, loaded, past SD's limit, past both
    many = predict_points(m, rates, 0.7, 4, W)
    for r, p in zip(rates, many, strict=True):
        one = predict_point(m, r, 0.7, 4, W)
        for field in ("latency_off_s", "latency_on_s", "stability_limit_off_rps", "stability_limit_on_rps", "speedup"):
            assert getattr(p, field) == pytest.approx(getattr(one, field), rel=1e-9), (r, field)


def test_a_pass_that_costs_nothing_serves_any_rate_without_a_warning(recwarn):
    # Refused by the calibration loader, but a library user can build it: the chain's per-state
    # terms (the prompts' bunched wait) must not divide zero by zero.
    off, on = curves(LatencyModel(target=StepCost(0.0, 0.0)), 0.5, 2, Workload(500, 100))
    assert math.isinf(off.stability_limit_rps) and math.isinf(on.stability_limit_rps)
    assert 0.0 <= off.latency_s(1.0) < 1e-200
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_a_predicted_grid_is_each_of_its_points_built_once_per_group(monkeypatch):
    """predict() over arrays of rates, acceptances, draft lengths (0 too) and accepted lengths
    (NaN: from the acceptance) is predict_point at each element, each group of equal
    (acceptance, draft length, accepted length) summed in one pass per mode, never point by point."""
    from controller import model as M

    m = simple(max_num_seqs=64)
    rates = np.array([0.0, 0.5, 2.0, 4.0, 5.0, 9.0])[:, None]
    alpha = np.array([0.5, 0.7, 0.7, 0.7])
    gamma = np.array([1, 4, 0, 4])
    accepted = np.array([np.nan, np.nan, np.nan, 2.5])
    scalar = M.ModeCurve.latency_s
    monkeypatch.setattr(M.ModeCurve, "latency_s", lambda self, lam: pytest.fail("evaluated one rate at a time"))
    passes = []
    many = M.ModeCurve.latencies_s
    monkeypatch.setattr(M.ModeCurve, "latencies_s", lambda self, r: passes.append(len(r)) or many(self, r))
    p = predict(m, rates, alpha, gamma, W, accepted)
    monkeypatch.setattr(M.ModeCurve, "latency_s", scalar)
    assert p.speedup.shape == (6, 4)
    assert passes == [6] * 7  # four groups, two modes each but γ = 0's one curve
    for i, r in enumerate(rates[:, 0]):
        for j in range(4):
            en = None if math.isnan(accepted[j]) else float(accepted[j])
            one = predict_point(m, float(r), float(alpha[j]), int(gamma[j]), W, en)
            got = (p.off.latency_s[i, j], p.on.latency_s[i, j], p.off.batch[i, j], p.on.batch[i, j], p.speedup[i, j])
            want = (one.latency_off_s, one.latency_on_s, one.batch_off, one.batch_on, one.speedup)
            assert got == pytest.approx(want, rel=1e-9), (r, j)
            assert p.accepted_length[i, j] == one.accepted_length
            assert p.on.stability_limit_rps[i, j] == one.stability_limit_on_rps


def test_many_rates_are_summed_a_block_at_a_time_and_agree_with_one_at_a_time(monkeypatch):
    from controller import model as M

    curve = curves(simple(max_num_seqs=64), 0.7, 4, Workload(500, 100, 60.0, 200.0))[1]
    rates = np.linspace(0.0, 1.2 * curve.stability_limit_rps, 23)
    whole = curve.latencies_s(rates)
    monkeypatch.setattr(M, "LATENCY_BLOCK", 5)
    blocks = curve.latencies_s(rates)
    assert blocks == pytest.approx(whole, rel=1e-12)
    assert blocks == pytest.approx([curve.latency_s(float(r)) for r in rates], rel=1e-9)
    assert math.isinf(blocks[-1]) and blocks[0] == curve.alone_s


def test_the_grid_places_the_crossings_first_step():
    """A cubic through the grid's rates around a crossing puts the first step within a fraction
    of a per mille of it: the example's crossing of 1.2 takes three evaluations of each mode (the
    secant from the bracket's ends took five)."""
    from controller import calibration
    from controller import model as M
    from controller.shipped import example_calibration_path

    x = [1.0, 2.0, 3.0, 4.0]
    cubic = [(3.2 - t) * (1.0 + 0.1 * t * t) for t in x]  # its root: 3.2
    assert M._interpolated_root(x, cubic, 3.0, 4.0) == pytest.approx(3.2, rel=1e-12)
    assert M._interpolated_root(x, [*cubic[:3], math.inf], 3.0, 4.0) is None
    assert M._interpolated_root(x, [-v for v in cubic], 3.0, 4.0) is None  # rises through the bracket

    model = calibration.load(example_calibration_path()).latency_model()
    w = Workload(1000.0, 280.0, 200.0, 500.0)
    steps = []
    real = M._crossing

    def counted(f, *args):
        return real(lambda lam: steps.append(lam) or f(lam), *args)

    M.mode_curve.cache_clear()
    M.curves.cache_clear()
    import unittest.mock

    with unittest.mock.patch.object(M, "_crossing", counted):
        found = break_even_rates(model, 0.7, 2, w)
    assert found[1.2].rate_rps == pytest.approx(12.0506, rel=1e-4)
    assert len(steps) <= 3


def test_one_mode_curve_is_the_half_of_curves_it_names():
    """mode_curve_for builds one mode alone: the same latencies, limit and batch, to the bit, as
    that mode's half of curves (built there with the other mode beside it)."""
    from controller.model import mode_curve, mode_curve_for

    m = simple(verify=StepCost(0.012, 0.002))
    for sd, gamma, en in ((False, 4, None), (True, 4, None), (True, 3, 2.5), (True, 0, None)):
        mode_curve.cache_clear()
        curves.cache_clear()
        alone = mode_curve_for(m, sd, 0.7, gamma, W, en)
        mode_curve.cache_clear()
        curves.cache_clear()
        off, on = curves(m, 0.7, gamma, W, en)
        both = on if sd and gamma > 0 else off
        assert alone is not both
        assert alone.stability_limit_rps == both.stability_limit_rps
        rates = [f * both.stability_limit_rps for f in (0.1, 0.5, 0.9, 0.99)]
        assert [alone.latency_s(r) for r in rates] == [both.latency_s(r) for r in rates]
        assert [alone.batch(r) for r in rates] == [both.batch(r) for r in rates]
    on_curve = mode_curve_for(m, True, 0.7, 4, W)
    off_curve = mode_curve_for(m, False, 0.7, 4, W)
    assert on_curve.stability_limit_rps != off_curve.stability_limit_rps  # the mode asked for, not the other
