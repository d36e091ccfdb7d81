"""Pricing a switch: hand-computed costs, gains, trend and horizon."""

import math

import pytest

from controller.switch_cost import (
    backlog_cost,
    downtime_estimate,
    gain_horizon,
    path_gain,
    projected_rate,
    switch_cost,
    switch_gain,
    switch_now_saving,
    trend_slope,
)


def test_backlog_cost_by_hand():
    # λ = 2, D = 90, μ = 12: 2·90²/2 = 8100 waiting, (180)²/(2·10) = 1620 working it off.
    assert backlog_cost(2.0, 90.0, 12.0) == pytest.approx(8100 + 1620)
    assert backlog_cost(0.0, 90.0, 12.0) == 0.0
    assert math.isinf(backlog_cost(12.0, 90.0, 12.0))  # μ ≤ λ: the queue never clears


def test_cost_rises_steeply_toward_saturation():
    costs = [backlog_cost(r, 60.0, 10.0) for r in (1, 5, 9, 9.9)]
    assert costs == sorted(costs) and costs[-1] > 100 * costs[0]


def test_fleet_pays_a_capacity_dip_not_an_outage():
    # 4 replicas: the other 3 take 4/3 of the rate; cost = N·λ·D·(T(4λ/3) − T(λ)).
    def latency(r):
        return 1.0 / (1 - r / 10.0)

    cost = switch_cost(3.0, 60.0, 12.0, replicas=4, capacity_current_rps=10.0, latency_current=latency)
    assert cost == pytest.approx(4 * 3.0 * 60.0 * (latency(4.0) - latency(3.0)))
    assert cost < switch_cost(3.0, 60.0, 12.0, replicas=1)
    # The others saturate: the excess queues.
    saturated = switch_cost(9.0, 60.0, 12.0, replicas=4, capacity_current_rps=10.0, latency_current=latency)
    excess = 4 * 9.0 - 3 * 10.0
    assert saturated == pytest.approx(excess * 60**2 / 2 + (excess * 60) ** 2 / (2 * 4 * (12.0 - 9.0)))


@pytest.mark.parametrize(
    ("cur", "new", "mu_cur", "mu_new", "expected"),
    [
        (2.0, 1.0, 10, 9, 2.0 * 100 * 1.0),  # 1 s saved per request, 2 req/s, 100 s
        (1.0, 2.0, 10, 9, -200.0),
        (math.inf, 1.0, 1, 9, math.inf),  # leaving overload
        (1.0, math.inf, 9, 1, -math.inf),  # entering overload
        (math.inf, math.inf, 5, 6, math.inf),  # both overloaded: the larger capacity wins
        (math.inf, math.inf, 6, 5, -math.inf),
    ],
)
def test_gain(cur, new, mu_cur, mu_new, expected):
    assert switch_gain(2.0, 100.0, cur, new, mu_cur, mu_new) == expected


def test_trend_projection_and_clamps():
    # short 6 req/s over 60 s, long 4 req/s over 900 s: centres 420 s apart -> 2/420 per s
    # (noise_z=0: the windows' difference taken as it is).
    assert trend_slope(6.0, 4.0, 60, 900, noise_z=0.0) == pytest.approx(2 / 420)
    assert projected_rate(6.0, 4.0, 60, 900, 210, noise_z=0.0) == pytest.approx(7.0)
    assert projected_rate(6.0, None, 60, 900, 210) == 6.0
    assert projected_rate(1.0, 100.0, 60, 900, 10_000) == 0.0  # never negative
    assert projected_rate(1.0, 0.0, 60, 900, 10**6) == 3.0  # never beyond 2·rate + 1


def test_trend_is_net_of_the_windows_poisson_noise():
    # λ = 4 over the long window: sd(short − long) = (840/900)·√(4·(1/60 + 1/840)) = 0.2494.
    sd = 840 / 900 * math.sqrt(4.0 * (1 / 60 + 1 / 840))
    assert trend_slope(6.0, 4.0, 60, 900) == pytest.approx((2.0 - 3.0 * sd) / 420)  # TREND_NOISE_Z = 3
    assert trend_slope(2.0, 4.0, 60, 900) == pytest.approx(-(2.0 - 3.0 * sd) / 420)  # falling alike
    assert trend_slope(6.0, 4.0, 60, 900, noise_z=2.0) == pytest.approx((2.0 - 2.0 * sd) / 420)
    # A steady 12 req/s whose last minute counted 13.2 (2.8 sd: it happens a few times a day):
    # noise, no trend at all...
    assert trend_slope(13.2, 12.0, 60, 900) == 0.0
    assert projected_rate(13.2, 12.0, 60, 900, 900) == 13.2
    # ...where the bare difference projected 15 minutes ahead read 15.8 req/s, past the limit
    # of SD on the truth's chat server (14.3): a restart at a noise peak.
    assert projected_rate(13.2, 12.0, 60, 900, 900, noise_z=0.0) == pytest.approx(15.77, abs=0.01)
    # A step from 8 to 12 req/s a minute ago is far beyond it.
    assert trend_slope(12.0, 8.27, 60, 900) > 0.6 * 3.73 / 420


def test_gain_horizon():
    # SD just enabled at 4 req/s, load rising 1 req/s per 1000 s, disable break-even at 10: 6000 s.
    assert gain_horizon(4.0, 0.001, 10.0, rising_undoes=True, min_s=300, max_s=14400) == pytest.approx(6000)
    assert gain_horizon(4.0, -0.001, 10.0, True, 300, 14400) == 14400  # falling: it lasts
    assert gain_horizon(9.99, 0.01, 10.0, True, 300, 14400) == 300  # at least the dwell
    assert gain_horizon(12.0, -0.002, 8.0, rising_undoes=False, min_s=300, max_s=14400) == pytest.approx(2000)
    assert gain_horizon(4.0, 0.5, None, True, 300, 14400) == 14400


def test_downtime_estimate():
    assert downtime_estimate([], 90.0) == 90.0
    assert downtime_estimate([60, 70, 500], 90.0) == 70  # median: one slow restart does not dominate
    assert downtime_estimate([float("nan"), -1, 40], 90.0) == 40


@pytest.mark.parametrize(
    ("points", "expected"),
    [
        ([(2.0, 3.0, 2.0, 10.0, 9.0), (4.0, 4.0, 2.5, 10.0, 9.0)], 2.0 * 1.0 * 10 + 4.0 * 1.5 * 10),  # summed
        ([(2.0, 3.0, 2.0, 10.0, 9.0), (9.5, math.inf, 5.0, 9.0, 10.0)], math.inf),  # the path leaves an overload
        ([(2.0, 3.0, 2.0, 10.0, 9.0), (9.5, 5.0, math.inf, 10.0, 9.0)], -math.inf),  # ...or enters one
        ([(9.5, math.inf, 5.0, 9.0, 10.0), (9.8, 5.0, math.inf, 10.0, 9.0)], -math.inf),  # entering wins
    ],
)
def test_path_gain(points, expected):
    assert path_gain(points, 10.0) == expected


@pytest.mark.parametrize(
    ("costs", "gains", "expected"),
    [
        # the restart gets dearer faster than staying gains: now is cheapest, by 30 against the last
        ([100.0, 120.0, 150.0], [0.0, 10.0, 20.0], (10.0, 30.0)),
        # staying gains more than the restart's price grows: later is cheaper (negative)
        ([100.0, 110.0, 150.0], [0.0, 30.0, 40.0], (-20.0, 10.0)),
        # staying runs into an overload before the last time: every later time is worth anything
        ([100.0, 120.0, 150.0], [0.0, 10.0, -math.inf], (10.0, math.inf)),
        # a restart now would never clear its backlog: never now
        ([math.inf, 120.0], [0.0, 10.0], (-math.inf, -math.inf)),
        # nor later: now, whatever it costs
        ([100.0, math.inf], [0.0, 10.0], (math.inf, math.inf)),
    ],
)
def test_switch_now_saving_weighs_a_dearer_restart_later_against_the_gain_until_then(costs, gains, expected):
    assert switch_now_saving(costs, gains) == expected


def test_switch_now_saving_needs_a_grid():
    with pytest.raises(ValueError, match="same length"):
        switch_now_saving([1.0], [0.0])
    with pytest.raises(ValueError, match="same length"):
        switch_now_saving([1.0, 2.0], [0.0])
