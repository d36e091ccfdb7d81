"""The batch's birth–death chain (controller/queueing.py) against exact queueing results.

Exact references are computed here: M/M/1 and M/M/∞ in closed form, M/M/c through Erlang C
(the Erlang B recursion, stable for any c). The chain with departure rate h(n) is each of them
exactly for the right h: constant (one server), min(n, c)·μ (c servers), n·μ (no queue).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from controller import queueing
from controller.queueing import (
    cumulative_log_rates,
    inverse_rates,
    mean_in_system,
    mean_time_in_system,
    mean_time_in_system_below,
    mean_time_in_system_many,
    mean_time_in_window,
    queue_variability,
    stationary_law,
)


def erlang_c_time_in_system_s(servers: int, rate_rps: float, service_s: float) -> float:
    """Exact mean time in system of M/M/c: S + C(c, a)·S / (c·(1 − ρ)), a = λ·S offered Erlangs."""
    a = rate_rps * service_s
    rho = a / servers
    blocking = 1.0
    for k in range(1, servers + 1):  # Erlang B, then C from B
        blocking = a * blocking / (k + a * blocking)
    prob_wait = blocking / (1.0 - rho * (1.0 - blocking))
    return service_s + prob_wait * service_s / (servers * (1.0 - rho))


def chain_time_in_system_s(rates: np.ndarray, rate_rps: float, limit_rps: float) -> float:
    """The chain's time in system, summed in log space and, where it cannot overflow, as the
    running product a curve evaluates (the two must agree)."""
    c = cumulative_log_rates(rates)
    logs = mean_in_system(rate_rps, c, limit_rps) / rate_rps
    inverse = inverse_rates(c, limit_rps)
    if inverse is not None:
        assert mean_time_in_system(rate_rps, c, limit_rps, inverse) == pytest.approx(logs, rel=1e-12)
        many = mean_time_in_system_many(np.array([rate_rps, rate_rps]), c, limit_rps, inverse)
        np.testing.assert_allclose(many, logs, rtol=1e-12)
    return logs


def test_erlang_c_reference_matches_mm1():
    # The reference itself: c = 1 must reduce to S/(1 − ρ).
    assert erlang_c_time_in_system_s(1, 0.6, 1.0) == pytest.approx(1.0 / 0.4, rel=1e-12)
    # A textbook value: M/M/2, λ = 1, S = 1 (ρ = 0.5): P(wait) = 1/3, W_q = 1/3.
    assert erlang_c_time_in_system_s(2, 1.0, 1.0) == pytest.approx(4.0 / 3.0, rel=1e-12)


@pytest.mark.parametrize("rho", [0.05, 0.3, 0.5, 0.8, 0.95, 0.999])
@pytest.mark.parametrize("states", [1, 7, 256])
def test_constant_rate_is_mm1_wherever_the_tail_starts(rho, states):
    mu = 1.0 / 0.7
    t = chain_time_in_system_s(np.full(states, mu), rho * mu, mu)
    assert t == pytest.approx(0.7 / (1.0 - rho), rel=1e-9)


@pytest.mark.parametrize("servers", [1, 2, 3, 5, 8, 10, 20, 50, 100, 256])
@pytest.mark.parametrize("rho", [0.1, 0.5, 0.8, 0.9, 0.95, 0.98])
def test_c_servers_is_erlang_c(servers, rho):
    service_s = 2.0
    capacity = servers / service_s
    h = np.minimum(np.arange(1, servers + 1), servers) / service_s
    got = chain_time_in_system_s(h, rho * capacity, capacity)
    assert got == pytest.approx(erlang_c_time_in_system_s(servers, rho * capacity, service_s), rel=1e-9)


@pytest.mark.parametrize("servers", [1, 8, 256])
@pytest.mark.parametrize("rho", [0.5, 0.9, 0.99])
def test_a_queue_variability_scales_the_wait_past_the_servers_as_allen_cunneen(servers, rho):
    # M/G/c: W_q ≈ (C_a² + C_s²)/2 · W_q(M/M/c), the law of the c running unchanged. Every path
    # a curve sums (one rate, many, a window long enough to be stationary) takes it the same.
    service_s = 2.0
    capacity = servers / service_s
    c = cumulative_log_rates(np.arange(1, servers + 1) / service_s)
    lam = rho * capacity
    wait = erlang_c_time_in_system_s(servers, lam, service_s) - service_s
    inverse = inverse_rates(c, capacity)
    for f in (queue_variability(0.0), queue_variability(0.5), queue_variability(1.0), queue_variability(1.8)):
        want = service_s + f * wait
        assert mean_time_in_system(lam, c, capacity, queue_scale=f) == pytest.approx(want, rel=1e-9)
        assert mean_time_in_system(lam, c, capacity, inverse, f) == pytest.approx(want, rel=1e-9)
        below = mean_time_in_system_below(np.array([lam, 0.5 * lam]), c, capacity, inverse, f)
        assert below[0] == pytest.approx(want, rel=1e-9)
    if servers == 8 and rho <= 0.9:  # stepped, not taken as stationary: 10⁴ s is ~500 relaxations
        for f in (0.5, 1.0):
            window = mean_time_in_window(lam, c, capacity, 10_000.0, 1_000.0, queue_scale=f)
            assert window == pytest.approx(service_s + f * wait, rel=1e-6)


def test_queue_variability_is_the_mean_of_the_two_squared_cvs():
    assert queue_variability(1.0) == 1.0  # exponential lengths: the chain's own tail
    assert queue_variability(0.0) == 0.5  # equal lengths: half the wait
    assert queue_variability(0.5) == 0.75  # gamma of shape 2
    assert queue_variability(0.5, arrival_scv=2.0) == 1.25  # bursty arrivals wait longer
    assert queue_variability(-0.1) == 0.5  # a negative variance (a bad input) counts as none


def test_many_more_slots_than_requests_is_mm_infinity():
    # M/M/∞ (every request served at once at rate μ): time in system 1/μ at any load.
    mu = 0.5
    h = np.arange(1, 4001) * mu
    for rate in (0.1, 5.0, 200.0):
        assert chain_time_in_system_s(h, rate, h[-1]) == pytest.approx(1.0 / mu, rel=1e-9)


@pytest.mark.parametrize("rho", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("states", [1, 7, 64])
def test_the_stationary_law_of_a_constant_rate_is_geometric_past_any_bound(rho, states):
    mu = 3.0
    p, past = stationary_law(rho * mu, cumulative_log_rates(np.full(states, mu)), mu)
    np.testing.assert_allclose(p, (1.0 - rho) * rho ** np.arange(states + 1), rtol=1e-9)
    assert past == pytest.approx(rho ** (states + 1), rel=1e-9)


@pytest.mark.parametrize("load", [0.5, 4.0, 30.0])
def test_the_stationary_law_of_mm_infinity_is_poisson(load):
    mu = 0.5
    p, past = stationary_law(load * mu, cumulative_log_rates(np.arange(1, 201) * mu), 200 * mu)
    n = np.arange(201)
    poisson = np.exp(n * math.log(load) - load - np.array([math.lgamma(k + 1) for k in n]))
    np.testing.assert_allclose(p, poisson, rtol=1e-9, atol=1e-300)
    assert past < 1e-80  # Poisson(≤ 30) past 200


def test_the_stationary_law_has_the_mean_the_latency_is_read_from():
    # A departure rate that flattens (a batch whose step grows): the law's mean, its queue past
    # the bound included, is Little's λ·T of mean_time_in_system.
    h = np.arange(1, 33) / (2.0 + 0.05 * np.arange(32))
    c, limit, rate = cumulative_log_rates(h), float(h.max()), 0.9 * float(h.max())
    p, past = stationary_law(rate, c, limit)
    r = rate / limit
    mean = float(p @ np.arange(p.size)) + past * (p.size - 1) + p[-1] * r / (1.0 - r) ** 2
    assert p.sum() + past == pytest.approx(1.0, rel=1e-12)
    assert mean == pytest.approx(rate * mean_time_in_system(rate, c, limit), rel=1e-9)


@pytest.mark.parametrize("rate", [0.0, -1.0, 2.0, 5.0])
def test_no_stationary_law_without_load_or_past_the_limit(rate):
    with pytest.raises(ValueError, match="stationary law"):
        stationary_law(rate, cumulative_log_rates(np.array([1.0, 2.0])), 2.0)


def test_no_load_means_nobody_in_the_server():
    c = cumulative_log_rates(np.array([1.0, 2.0]))
    assert mean_in_system(0.0, c, 2.0) == 0.0
    assert mean_in_system(-1.0, c, 2.0) == 0.0


@pytest.mark.parametrize("rate", [2.0, 2.5])
def test_infinite_at_and_past_the_tail_rate(rate):
    c = cumulative_log_rates(np.array([1.0, 2.0]))
    assert mean_in_system(rate, c, 2.0) == math.inf


def test_rates_are_made_non_decreasing():
    # Past the throughput peak the extra requests queue: the server keeps its best batch.
    c = cumulative_log_rates(np.array([1.0, 3.0, 2.0, 5.0]))
    assert np.exp(np.diff(c)) == pytest.approx([1.0, 3.0, 3.0, 5.0])


@pytest.mark.parametrize("bad", [[], [1.0, 0.0], [-1.0]])
def test_non_positive_or_missing_rates_are_refused(bad):
    with pytest.raises(ValueError, match="positive"):
        cumulative_log_rates(np.array(bad))


def test_strictly_increasing_in_rate_and_unbounded_toward_the_limit():
    service_s, servers = 1.5, 6
    h = np.arange(1, servers + 1) / service_s
    capacity = servers / service_s
    rates = [capacity * i / 50 for i in range(1, 50)] + [capacity * (1 - 1e-6)]
    times = [chain_time_in_system_s(h, r, capacity) for r in rates]
    assert all(b > a for a, b in itertools.pairwise(times))
    assert times[-1] > 1e4 * service_s  # diverges like 1/(1 − ρ)


def test_a_throughput_that_flattens_waits_more_than_its_fixed_point():
    # T(B) = 1 + 0.05·B: the fluid fixed point B = λ·T(B) misses the states above the mean,
    # where T is longer; the chain's mean is above it and still diverges at the same limit.
    bound = 100
    n = np.arange(1, bound + 1)
    h = n / (1.0 + 0.05 * (n - 1))
    limit = float(h[-1])
    for rho in (0.3, 0.6, 0.9):
        lam = rho * limit
        fluid_b = lam / (1.0 - 0.05 * lam)  # B = λ(1 + 0.05·B)
        assert chain_time_in_system_s(h, lam, limit) > (1.0 + 0.05 * fluid_b) * 0.999


@pytest.mark.parametrize("rate", [5e-324, 1e-300, 1e-12])
def test_a_vanishing_rate_keeps_the_time_of_a_request_alone(rate):
    # E[n] underflows long before the latency it stands for: the time is summed with 1/λ inside.
    h = np.arange(1, 9) / (0.5 + 0.1 * np.arange(8))
    c = cumulative_log_rates(h)
    inverse = inverse_rates(c, 100.0)
    assert inverse is not None
    for inv in (None, inverse):
        assert mean_time_in_system(rate, c, 100.0, inv) == pytest.approx(0.5, rel=1e-9)
        assert mean_time_in_system_many(np.array([rate]), c, 100.0, inv)[0] == pytest.approx(0.5, rel=1e-9)


def test_the_running_product_is_the_log_space_sum_on_rising_and_stepped_rates():
    # A curve's rates: rising to a peak, then flat (the running best), or a staircase that dips.
    gen = np.random.default_rng(7)
    for _ in range(40):
        states = int(gen.integers(1, 600))
        h = np.cumsum(gen.uniform(0.0, 2.0, states)) + gen.uniform(0.01, 1.0)
        monotone = bool(gen.integers(2))
        if not monotone:
            h *= gen.uniform(0.9, 1.0, states)
        c = cumulative_log_rates(h, monotone=monotone)
        limit = float(np.exp(np.diff(c)).max())
        inverse = inverse_rates(c, limit)
        assert inverse is not None
        rates = limit * np.array([1e-6, 0.01, 0.3, 0.7, 0.95, 0.999])
        logs = mean_time_in_system_many(rates, c, limit)
        np.testing.assert_allclose(mean_time_in_system_many(rates, c, limit, inverse), logs, rtol=1e-11)
        for rate, want in zip(rates, logs, strict=True):
            assert mean_time_in_system(float(rate), c, limit, inverse) == pytest.approx(want, rel=1e-11)


def test_no_running_product_where_it_could_overflow():
    # M/M/∞ with 4,000 slots near its limit holds ~4,000 requests: λⁿ/Π h peaks past e^700,
    # which a product of floats cannot hold; the curve sums in log space instead.
    h = np.arange(1, 4001) * 0.5
    c = cumulative_log_rates(h)
    assert inverse_rates(c, float(h[-1])) is None
    assert inverse_rates(c, 50.0) is not None  # ~100 in the server: e^~100 at the mode
    # ~2,000 in the server: the product's terms overflow (inf/inf), the log-space sum holds.
    with np.errstate(over="ignore", invalid="ignore"):
        product = mean_time_in_system(1000.0, c, float(h[-1]), np.exp(-np.diff(c)))
    assert not math.isfinite(product)
    assert mean_time_in_system(1000.0, c, float(h[-1])) == pytest.approx(2.0, rel=1e-9)


# ------------------------------------------------------------------------------ a finite test
@pytest.mark.parametrize(("duration_s", "warmup_s"), [(60.0, 0.0), (60.0, 6.0), (20.0, 15.0)])
def test_a_window_of_independent_servers_sees_their_service_time(duration_s, warmup_s, monkeypatch):
    # M/M/∞: no one waits for anyone, so every arrival of any window stays 1/μ, filling or not.
    monkeypatch.setattr(queueing, "WINDOW_RELAXATIONS", math.inf)
    monkeypatch.setattr(queueing, "WARMUP_RELAXATIONS", math.inf)
    cum = cumulative_log_rates(0.5 * np.arange(1.0, 400.0))
    assert mean_time_in_window(20.0, cum, 1e9, duration_s, warmup_s) == pytest.approx(2.0, rel=1e-3)  # O(1/(Λ·window))


def _fifo_window_mean_s(
    rate: float, service_rate: float, duration_s: float, warmup_s: float, reps: int
) -> tuple[float, float]:
    """Monte Carlo of an M/M/1 FIFO queue started empty (Lindley): the mean sojourn of the
    arrivals in [warmup, duration), and its standard error over ``reps`` replications."""
    rng = np.random.default_rng(7)
    means = []
    for _ in range(reps):
        gaps = rng.exponential(1.0 / rate, int(rate * duration_s * 2) + 100)
        arrive = np.cumsum(gaps)
        arrive = arrive[arrive < duration_s]
        service = rng.exponential(1.0 / service_rate, arrive.size)
        wait, sojourn = 0.0, np.empty(arrive.size)
        for k in range(arrive.size):
            if k:
                wait = max(0.0, wait + service[k - 1] - (arrive[k] - arrive[k - 1]))
            sojourn[k] = wait + service[k]
        means.append(float(sojourn[arrive >= warmup_s].mean()))
    return float(np.mean(means)), float(np.std(means) / math.sqrt(reps))


def test_a_test_shorter_than_the_queue_relaxes_sees_far_less_than_the_stationary_mean():
    # M/M/1 at ρ = 0.99 relaxes over ~1/(μ·(1 − √ρ)²) ≈ 4000 s: a 300 s test from an empty server
    # measures well under the stationary 10 s, and (FIFO: later arrivals never slow earlier ones)
    # exactly what its arrivals after the warm-up spend, by simulation.
    cum = cumulative_log_rates(np.full(60, 10.0))
    window = mean_time_in_window(9.9, cum, 10.0, 300.0, 30.0)
    assert window < 0.5 * mean_time_in_system(9.9, cum, 10.0)
    sim, se = _fifo_window_mean_s(9.9, 10.0, 300.0, 30.0, reps=300)
    assert abs(window - sim) < 3.5 * se + 0.005 * sim, (window, sim, se)


def test_a_long_test_measures_the_stationary_mean(monkeypatch):
    # Past 1000 relaxation times (or a warm-up of 10) the window is the stationary mean, by the
    # shortcut; stepping the chain instead lands within a fraction of a per cent of it.
    cum = cumulative_log_rates(np.full(200, 10.0))
    stationary = mean_time_in_system(5.0, cum, 10.0)
    assert mean_time_in_window(5.0, cum, 10.0, 1800.0, 180.0) == stationary
    monkeypatch.setattr(queueing, "WINDOW_RELAXATIONS", math.inf)
    monkeypatch.setattr(queueing, "WARMUP_RELAXATIONS", math.inf)
    assert mean_time_in_window(5.0, cum, 10.0, 1800.0, 180.0) == pytest.approx(stationary, rel=1e-4)
    assert mean_time_in_window(5.0, cum, 10.0, 1800.0, 0.0) == pytest.approx(stationary, rel=2e-3)
    assert mean_time_in_window(5.0, cum, 10.0, 1800.0, 0.0) < stationary  # the first arrivals find it empty


def test_a_window_past_the_step_budget_is_taken_as_stationary():
    # Four hours at 99 req/s near a 100 req/s limit would take 2.9 M steps: the stationary mean.
    cum = cumulative_log_rates(np.full(50, 100.0))
    assert math.ceil(4 * 3600.0 * 199.0) > queueing.MAX_WINDOW_STEPS
    assert mean_time_in_window(99.0, cum, 100.0, 4 * 3600.0) == mean_time_in_system(99.0, cum, 100.0)


@pytest.mark.parametrize(("rate", "duration_s", "warmup_s"), [(0.0, 10.0, 0.0), (1.0, 10.0, 10.0), (1.0, 10.0, -1.0)])
def test_a_window_refuses_what_is_no_window(rate, duration_s, warmup_s):
    with pytest.raises(ValueError, match="window"):
        mean_time_in_window(rate, cumulative_log_rates(np.full(10, 5.0)), 5.0, duration_s, warmup_s)


# ------------------------------------------------------------------- arrivals in bursts
def _infinite_server(decode_s: float, prompt_s: float, overlap: float, states: int = 800) -> tuple:
    """T(B) = a + (B + 1)·Δ: its decode, its own prompt and the B others' (the chain's h(n) = n/T)."""
    n = np.arange(1.0, states + 1.0)
    cum = cumulative_log_rates(n / (decode_s + n * prompt_s))
    return cum, queueing.bursts_of(cum, np.full(states, prompt_s), overlap)


def _mean_var(law: np.ndarray) -> tuple[float, float]:
    n = np.arange(law.size)
    mean = float(law @ n)
    return mean, float(law @ (n - mean) ** 2)


def test_length_overlap_is_how_long_two_requests_stay_together():
    assert queueing.length_overlap(280.0, 0.0) == 1.0  # equal lengths leave together
    assert queueing.length_overlap(280.0, 280.0) == pytest.approx(0.5, abs=1e-6)  # exponential: E[min] = E/2
    # Gamma of shape 2 (mean 1, rate 2): ∫ ((1 + 2x)·e^(−2x))² dx = 1/4 + 1/4 + 1/8.
    assert queueing.length_overlap(1.0, 1.0 / math.sqrt(2.0)) == pytest.approx(0.625, abs=1e-5)
    # The closed form against E[min(S₁, S₂)]/E[S] drawn, for a shape above 1 and one below.
    rng = np.random.default_rng(3)
    for cv in (0.5, 1.5):
        shape = 1.0 / cv**2
        s1, s2 = (rng.gamma(shape, 280.0 / shape, 400_000) for _ in range(2))
        drawn = float(np.minimum(s1, s2).mean()) / 280.0
        assert abs(queueing.length_overlap(280.0, 280.0 * cv) - drawn) < 0.006, (cv, drawn)


def test_burst_ratio_matches_the_borel_familys_index():
    assert queueing.burst_ratio(0.0, 0.7) == 0.0  # no prefill, no bursts
    # Memoryless departures (κ = 1/2): the geometric index (1 + r)/(1 − r) is the Borel's 1/(1 − p)².
    r = float(queueing.burst_ratio(0.4, 0.5))
    assert (1.0 + r) / (1.0 - r) == pytest.approx(1.0 / 0.6**2, rel=1e-12)
    assert queueing.burst_ratio(0.4, 1.0) > r > queueing.burst_ratio(0.4, 0.3)  # lengths that stay together widen it
    np.testing.assert_allclose(queueing.burst_ratio(np.array([0.0, 0.4]), 0.5), [0.0, r])


@pytest.mark.parametrize("rate", [0.3, 1.2, 1.9])
def test_without_prompts_the_bursts_chain_is_the_birth_death_chain(rate):
    # A chain that flattens, its queue served at 2 req/s: no stall, no bursts (r = 0 whatever κ).
    h = np.minimum(np.arange(1.0, 41.0) * 0.1, 2.0)
    cum = cumulative_log_rates(h)
    bursts = queueing.bursts_of(cum, np.zeros(h.size), 0.7)
    assert queueing.burst_time_in_system(rate, bursts, 2.0) == pytest.approx(
        mean_time_in_system(rate, cum, 2.0), rel=1e-12
    )
    law, past = queueing.burst_law(rate, bursts, 2.0)
    chain_law, chain_past = stationary_law(rate, cum, 2.0)
    np.testing.assert_allclose(law, chain_law, rtol=1e-9)
    assert past == pytest.approx(chain_past, rel=1e-9)


@pytest.mark.parametrize("overlap", [0.5, 0.625, 1.0])
def test_an_infinite_server_with_stalls_is_its_fixed_point_whatever_the_bursts(overlap):
    # The others' prompts as stalls at λ: an infinite server of rate (1 − λΔ)/a per request, fed by
    # geometric bursts; its own prompt a delay Δ/(1 − λΔ). The mean is the fixed point
    # T = (a + Δ)/(1 − λΔ) of T = a + (λ·T + 1)·Δ, and the bursts make Var/E = 1/(1 − r)
    # (M^X/M/∞: (1 + E[X²]/E[X])/2).
    a, delta, rate = 2.0, 0.05, 6.0
    cum, bursts = _infinite_server(a, delta, overlap)
    fixed_point = (a + delta) / (1.0 - rate * delta)
    assert queueing.burst_time_in_system(rate, bursts, 1e9) == pytest.approx(fixed_point, rel=1e-9)
    law, past = queueing.burst_law(rate, bursts, 1e9)
    mean, var = _mean_var(law)
    r = float(queueing.burst_ratio(rate * delta, overlap))
    assert r > 0.0 and past < 1e-12
    assert mean == pytest.approx(rate * a / (1.0 - rate * delta), rel=1e-9)
    assert var / mean == pytest.approx(1.0 / (1.0 - r), rel=1e-9)
    # The birth–death chain of the same T holds the same mean only at no load: it prices the
    # prompts at each state's own rate, and its law is narrower.
    chain_law, _ = stationary_law(rate, cum, 1e9)
    assert _mean_var(chain_law)[1] < var


def test_the_bursts_chain_at_many_rates_is_the_one_at_each_and_sums_in_log_space_past_a_float():
    # T(B) = 2 + (B + 1)·Δ(B), Δ growing with the batch, the throughput held at 12 req/s.
    n, delta = np.arange(1.0, 301.0), np.linspace(0.02, 0.03, 300)
    cum = cumulative_log_rates(np.minimum(n / (2.0 + n * delta), 12.0))
    bursts = queueing.bursts_of(cum, delta, 0.6)
    rates = np.array([0.5, 3.0, 9.0, 11.5, 11.99])
    one_by_one = [queueing.burst_time_in_system(float(x), bursts, 12.0) for x in rates]
    np.testing.assert_allclose(queueing.burst_time_in_system_below(rates, bursts, 12.0), one_by_one, rtol=1e-12)
    assert all(np.diff(one_by_one) > 0.0)
    # 4,000 requests near the limit: the running product overflows, the log-space sum holds.
    n = np.arange(1.0, 4001.0)
    cum = cumulative_log_rates(0.5 * n)
    bursts = queueing.bursts_of(cum, np.full(n.size, 1e-4), 0.6)
    assert not queueing.burst_product_fits(bursts, 2000.0)
    assert queueing.burst_product_fits(bursts, 50.0)  # ~100 in the server
    with np.errstate(over="ignore", invalid="ignore"):
        product = queueing.burst_time_in_system(1500.0, bursts, 2000.0)
    assert not math.isfinite(product)
    big = queueing.burst_time_in_system(1500.0, bursts, 2000.0, fits=False)
    assert big == pytest.approx(2.0, rel=1e-3)  # an infinite server whose T is 2 s at any load
    below = queueing.burst_time_in_system_below(np.array([1500.0]), bursts, 2000.0, fits=False)
    assert below[0] == pytest.approx(big, rel=1e-12)
    # past the limit nothing is stationary
    assert queueing.burst_time_in_system(2000.0, bursts, 2000.0) == math.inf


@pytest.mark.parametrize(("duration_s", "warmup_s"), [(60.0, 0.0), (20.0, 15.0)])
def test_a_window_of_independent_servers_with_bursts_sees_their_service_time(duration_s, warmup_s, monkeypatch):
    # M^X/M/∞: bursts or not, no one waits for anyone; every arrival stays a/(1 − λΔ) and its own
    # prompt's Δ/(1 − λΔ): the fixed point, filling or not.
    monkeypatch.setattr(queueing, "WINDOW_RELAXATIONS", math.inf)
    monkeypatch.setattr(queueing, "WARMUP_RELAXATIONS", math.inf)
    a, delta, rate = 2.0, 0.05, 6.0
    cum, bursts = _infinite_server(a, delta, 0.6, states=200)
    window = mean_time_in_window(rate, cum, 1e9, duration_s, warmup_s, bursts)
    assert window == pytest.approx((a + delta) / (1.0 - rate * delta), rel=2e-3)


def _fifo_batch_window_mean_s(
    rate: float, ratio: float, service_rate: float, duration_s: float, warmup_s: float, reps: int
) -> tuple[float, float]:
    """Monte Carlo of an M^X/M/1 FIFO queue started empty: bursts at λ·(1 − r), geometric of
    ratio r; the mean sojourn of the arrivals in [warmup, duration), and its standard error."""
    rng = np.random.default_rng(11)
    means = []
    for _ in range(reps):
        starts = np.cumsum(rng.exponential(1.0 / (rate * (1.0 - ratio)), int(rate * duration_s * 2) + 100))
        starts = starts[starts < duration_s]
        arrive = np.repeat(starts, rng.geometric(1.0 - ratio, starts.size))
        service = rng.exponential(1.0 / service_rate, arrive.size)
        done, sojourn = 0.0, np.empty(arrive.size)
        for k in range(arrive.size):
            done = max(done, arrive[k]) + service[k]
            sojourn[k] = done - arrive[k]
        means.append(float(sojourn[arrive >= warmup_s].mean()))
    return float(np.mean(means)), float(np.std(means) / math.sqrt(reps))


def test_a_window_of_one_server_fed_by_bursts_is_what_its_arrivals_spend(monkeypatch):
    # One server (h' = μ in every state) fed by geometric bursts, far below its bound: FIFO, so the
    # window's arrivals spend exactly ∫E[n] + the drain; against the queue simulated, plus the own
    # prompt's delay the chain adds.
    monkeypatch.setattr(queueing, "WINDOW_RELAXATIONS", math.inf)
    monkeypatch.setattr(queueing, "WARMUP_RELAXATIONS", math.inf)
    rate, delta, mu, states = 3.0, 0.1, 5.0, 300
    stall = 1.0 - rate * delta
    cum = cumulative_log_rates(np.full(states, 1.0 / (stall / mu + delta)))  # 1/h = a + Δ, a = stall/μ
    bursts = queueing.bursts_of(cum, np.full(states, delta), 0.5)
    ratio = float(queueing.burst_ratio(rate * delta, 0.5))
    window = mean_time_in_window(rate, cum, mu, 120.0, 20.0, bursts) - delta / stall
    sim, se = _fifo_batch_window_mean_s(rate, ratio, mu, 120.0, 20.0, reps=300)
    assert abs(window - sim) < 3.5 * se + 0.005 * sim, (window, sim, se)
    # and a long window is the stationary mean
    monkeypatch.setattr(queueing, "WINDOW_RELAXATIONS", 1000.0)
    monkeypatch.setattr(queueing, "WARMUP_RELAXATIONS", 10.0)
    assert mean_time_in_window(rate, cum, mu, 3600.0, 600.0, bursts) == queueing.burst_time_in_system(rate, bursts, mu)


def test_a_window_too_long_to_square_steps_one_at_a_time_to_the_same_law(monkeypatch):
    monkeypatch.setattr(queueing, "WINDOW_RELAXATIONS", math.inf)
    monkeypatch.setattr(queueing, "WARMUP_RELAXATIONS", math.inf)
    rate, delta, mu = 3.0, 0.1, 5.0
    stall = 1.0 - rate * delta
    cum = cumulative_log_rates(np.full(300, 1.0 / (stall / mu + delta)))
    bursts = queueing.bursts_of(cum, np.full(300, delta), 0.5)
    squared = mean_time_in_window(rate, cum, mu, 30.0, 5.0, bursts)
    plain = mean_time_in_window(rate, cum, mu, 30.0, 5.0)
    monkeypatch.setattr(queueing, "DENSE_WINDOW_STATES", 0)
    assert mean_time_in_window(rate, cum, mu, 30.0, 5.0, bursts) == pytest.approx(squared, rel=1e-9)
    assert mean_time_in_window(rate, cum, mu, 30.0, 5.0) == pytest.approx(plain, rel=1e-9)


@pytest.mark.parametrize("rate", [1e-300, 1e-12, 1e-6])
def test_the_bursts_chain_at_a_vanishing_rate_is_a_request_alone(rate):
    # A request that is 97 % prefill (one generated token): 1/h(1) = 0.674 s, Δ = 0.654 s. At no
    # load the chain is the request alone, 1/h(1), without a floor on the decode that would add
    # to it, and without sums that underflow at a denormal rate.
    n = np.arange(1.0, 9.0)
    cum = cumulative_log_rates(n / (0.02 + n * 0.654))
    bursts = queueing.bursts_of(cum, np.full(n.size, 0.654), 0.6)
    alone = 0.674
    assert queueing.burst_time_in_system(rate, bursts, 1.5) == pytest.approx(alone, rel=1e-5)
    assert queueing.burst_time_in_system_below(np.array([rate]), bursts, 1.5)[0] == pytest.approx(alone, rel=1e-5)
