"""The heavy-traffic wait (controller/queueing.py) against exact queueing results.

Exact references are computed here: M/M/1 in closed form and M/M/c through Erlang C (the
Erlang B recursion, stable for any c). Sakasegawa's approximation is exact for M/M/1; for
M/M/c it is tight near saturation and overestimates the wait at moderate load (its wait
probability ρ^(√(2(c+1)) − 1) exceeds Erlang C there). The tolerances below are the measured
behaviour: a relative error of at most 8 % for ρ ≥ 0.8 with c ≤ 10, and at every ρ in
[0.5, 0.98] and c ≤ 256 a wait never below the exact one by more than 2 % of the service time
and never above it by more than 4 % (so the time in system, service + wait, is within 4 %).
"""

from __future__ import annotations

import itertools
import math

import pytest

from controller.queueing import POISSON_ARRIVAL_SCV, heavy_traffic_wait_s


def erlang_c_wait_s(servers: int, rate_rps: float, service_s: float) -> float:
    """Exact mean wait of M/M/c: C(c, a)·S / (c·(1 − ρ)), a = λ·S offered Erlangs."""
    a = rate_rps * service_s
    rho = a / servers
    blocking = 1.0
    for k in range(1, servers + 1):  # Erlang B, then C from B
        blocking = a * blocking / (k + a * blocking)
    prob_wait = blocking / (1.0 - rho * (1.0 - blocking))
    return prob_wait * service_s / (servers * (1.0 - rho))


def mmc_wait(servers: int, rho: float, service_s: float = 2.0) -> tuple[float, float]:
    """(approximation, exact) mean wait at utilization rho of c servers of service_s each."""
    capacity = servers / service_s
    rate = rho * capacity
    approx = heavy_traffic_wait_s(rate, capacity, servers, service_s, service_scv=1.0)
    return approx, erlang_c_wait_s(servers, rate, service_s)


@pytest.mark.parametrize("rho", [0.05, 0.3, 0.5, 0.8, 0.95, 0.999])
def test_mm1_is_exact(rho):
    service_s = 0.7
    capacity = 1.0 / service_s
    wait = heavy_traffic_wait_s(rho * capacity, capacity, 1, service_s, service_scv=1.0)
    assert wait == pytest.approx(rho / (1.0 - rho) * service_s, rel=1e-12)


def test_erlang_c_reference_matches_mm1():
    # The reference itself: c = 1 must reduce to ρ/(1 − ρ)·S.
    assert erlang_c_wait_s(1, 0.6, 1.0) == pytest.approx(0.6 / 0.4, rel=1e-12)
    # A textbook value: M/M/2, λ = 1, S = 1 (ρ = 0.5): P(wait) = 1/3, W_q = 1/3.
    assert erlang_c_wait_s(2, 1.0, 1.0) == pytest.approx(1.0 / 3.0, rel=1e-12)


@pytest.mark.parametrize(
    ("rate", "capacity", "service_s"),
    [(0.0, 10.0, 1.0), (-1.0, 10.0, 1.0), (5.0, 10.0, 0.0)],
)
def test_no_load_or_no_service_means_no_wait(rate, capacity, service_s):
    assert heavy_traffic_wait_s(rate, capacity, 4, service_s, 1.0) == 0.0


@pytest.mark.parametrize(("rate", "capacity"), [(10.0, 10.0), (12.0, 10.0), (1.0, 0.0)])
def test_infinite_at_and_past_capacity(rate, capacity):
    assert heavy_traffic_wait_s(rate, capacity, 4, 1.0, 1.0) == math.inf


def test_strictly_increasing_in_rate_and_unbounded_toward_capacity():
    capacity = 8.0
    rates = [capacity * i / 50 for i in range(1, 50)] + [capacity * (1 - 1e-6)]
    waits = [heavy_traffic_wait_s(r, capacity, 6, 1.5, 1.0) for r in rates]
    assert all(b > a for a, b in itertools.pairwise(waits))
    assert waits[-1] > 1e4 * 1.5  # diverges like 1/(1 − ρ)


@pytest.mark.parametrize("rho", [0.3, 0.6, 0.9, 0.97])
def test_more_servers_wait_less_at_the_same_utilization(rho):
    service_s = 1.0
    waits = []
    for c in (1, 2, 4, 8, 16, 64, 256):
        capacity = c / service_s
        waits.append(heavy_traffic_wait_s(rho * capacity, capacity, c, service_s, 1.0))
    assert all(b < a for a, b in itertools.pairwise(waits)), waits


def test_fractional_and_sub_one_servers_are_clamped_to_one():
    # servers < 1 is treated as one server: the M/M/1 result.
    assert heavy_traffic_wait_s(0.5, 1.0, 0.2, 1.0, 1.0) == pytest.approx(1.0)
    # A fractional count sits between its integer neighbours.
    w2, w25, w3 = (heavy_traffic_wait_s(0.8 * c, float(c), c, 1.0, 1.0) for c in (2, 2.5, 3))
    assert w3 < w25 < w2


@pytest.mark.parametrize("servers", range(2, 11))
@pytest.mark.parametrize("rho", [0.8, 0.85, 0.9, 0.95])
def test_mmc_close_to_erlang_c_in_heavy_traffic(servers, rho):
    approx, exact = mmc_wait(servers, rho)
    assert approx == pytest.approx(exact, rel=0.08)


@pytest.mark.parametrize("servers", [2, 3, 5, 8, 10, 20, 50, 100, 256])
@pytest.mark.parametrize("rho", [0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98])
def test_mmc_time_in_system_within_four_percent_of_service(servers, rho):
    service_s = 2.0
    approx, exact = mmc_wait(servers, rho, service_s)
    assert -0.02 * service_s <= approx - exact <= 0.04 * service_s


@pytest.mark.parametrize("servers", range(2, 11))
def test_mmc_overestimates_at_moderate_load(servers):
    # Below heavy traffic the approximation is conservative (latency rises early), and the gap
    # grows with c: it is not "within a few percent of Erlang C" there.
    approx, exact = mmc_wait(servers, 0.5)
    assert approx > exact
    if servers >= 3:
        assert approx > 1.15 * exact


@pytest.mark.parametrize(("ca2", "cs2"), [(1.0, 0.0), (1.0, 0.25), (0.0, 1.0), (2.0, 3.0), (1.0, 1.0)])
def test_variability_scales_linearly(ca2, cs2):
    args = (6.0, 8.0, 5, 1.2)
    base = heavy_traffic_wait_s(*args, service_scv=1.0, arrival_scv=1.0)
    assert heavy_traffic_wait_s(*args, service_scv=cs2, arrival_scv=ca2) == pytest.approx(
        base * (ca2 + cs2) / 2.0, rel=1e-12
    )


def test_deterministic_service_halves_the_mm1_wait():
    # M/D/1 (Pollaczek–Khinchine): W_q = ρ·S / (2·(1 − ρ)); exact for c = 1.
    wait = heavy_traffic_wait_s(0.75, 1.0, 1, 1.0, service_scv=0.0, arrival_scv=POISSON_ARRIVAL_SCV)
    assert wait == pytest.approx(0.75 / (2 * 0.25), rel=1e-12)


def test_wait_scales_with_service_time_at_fixed_utilization():
    w1 = heavy_traffic_wait_s(3.0, 4.0, 4, 1.0, 1.0)
    # Twice the service time at the same ρ (capacity halves with it): twice the wait.
    assert heavy_traffic_wait_s(1.5, 2.0, 4, 2.0, 1.0) == pytest.approx(2.0 * w1, rel=1e-12)
