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

from controller.queueing import cumulative_log_rates, mean_in_system


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
    return mean_in_system(rate_rps, cumulative_log_rates(rates), limit_rps) / rate_rps


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


def test_many_more_slots_than_requests_is_mm_infinity():
    # M/M/∞ (every request served at once at rate μ): time in system 1/μ at any load.
    mu = 0.5
    h = np.arange(1, 4001) * mu
    for rate in (0.1, 5.0, 200.0):
        assert chain_time_in_system_s(h, rate, h[-1]) == pytest.approx(1.0 / mu, rel=1e-9)


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
    from controller.queueing import mean_time_in_system, mean_time_in_system_many

    h = np.arange(1, 9) / (0.5 + 0.1 * np.arange(8))
    c = cumulative_log_rates(h)
    assert mean_time_in_system(rate, c, 100.0) == pytest.approx(0.5, rel=1e-9)
    assert mean_time_in_system_many(np.array([rate]), c, 100.0)[0] == pytest.approx(0.5, rel=1e-9)
