"""Pricing a switch: what a restart costs and what the new state gains, in request-seconds.

Pure functions. Every toggle restarts vLLM: for ``downtime_s`` the replica serves nothing and
its arrivals queue up. With arrival rate λ, downtime D and capacity μ after the switch,
a single replica pays about λ·D²/2 request-seconds of waiting during the outage plus
(λ·D)²/(2·(μ − λ)) to work the backlog off, and the queue never clears when μ ≤ λ.
Behind a router with N replicas the others absorb the load: the cost is their latency at
N/(N−1) times the rate, and a backlog only if that exceeds their capacity.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from statistics import median

LatencyAt = Callable[[float], float]  # rate -> mean time in system (s), +inf when overloaded


def backlog_cost(rate_rps: float, downtime_s: float, capacity_rps: float) -> float:
    """Request-seconds lost to an outage of ``downtime_s`` at ``rate_rps`` (one server)."""
    if rate_rps <= 0 or downtime_s <= 0:
        return 0.0
    if capacity_rps <= rate_rps:
        return math.inf
    backlog = rate_rps * downtime_s
    return rate_rps * downtime_s**2 / 2.0 + backlog**2 / (2.0 * (capacity_rps - rate_rps))


def switch_cost(
    rate_rps: float,
    downtime_s: float,
    capacity_new_rps: float,
    replicas: int = 1,
    capacity_current_rps: float | None = None,
    latency_current: LatencyAt | None = None,
) -> float:
    """Cost of one restart in request-seconds (+inf when the backlog would never clear).

    ``rate_rps`` is this replica's arrival rate. With ``replicas`` > 1 the other replicas
    (running the current config) take this one's share during the restart.
    """
    if replicas <= 1 or capacity_current_rps is None or latency_current is None:
        return backlog_cost(rate_rps, downtime_s, capacity_new_rps)
    n = replicas
    shifted = rate_rps * n / (n - 1)
    if shifted < capacity_current_rps:
        # Every request of the fleet during the restart sees the others' higher latency.
        extra = latency_current(shifted) - latency_current(rate_rps)
        return n * rate_rps * downtime_s * max(extra, 0.0)
    # The others saturate: the excess queues like an outage of the fleet's spare capacity.
    excess = n * rate_rps - (n - 1) * capacity_current_rps
    spare_after = n * (capacity_new_rps - rate_rps)
    if spare_after <= 0:
        return math.inf
    return excess * downtime_s**2 / 2.0 + (excess * downtime_s) ** 2 / (2.0 * spare_after)


def switch_gain(
    rate_rps: float,
    horizon_s: float,
    latency_current_s: float,
    latency_new_s: float,
    capacity_current_rps: float,
    capacity_new_rps: float,
) -> float:
    """Request-seconds saved over ``horizon_s`` by being in the new state (negative: lost).

    Overload is decisive: leaving an overloaded state is worth anything (+inf), entering one
    costs everything (−inf); if both are overloaded the larger capacity wins.
    """
    cur_over, new_over = math.isinf(latency_current_s), math.isinf(latency_new_s)
    if cur_over and new_over:
        return math.inf if capacity_new_rps > capacity_current_rps else -math.inf
    if new_over:
        return -math.inf
    if cur_over:
        return math.inf
    return rate_rps * horizon_s * (latency_current_s - latency_new_s)


def path_gain(points: Sequence[tuple[float, float, float, float, float]], step_s: float) -> float:
    """Request-seconds saved along a load path: :func:`switch_gain` summed over its points, each
    ``(rate, latency_current, latency_new, capacity_current, capacity_new)`` held ``step_s``.

    Any point that enters an overload the current state avoids makes the switch worth nothing
    (−inf) — whatever the rest gains; otherwise any point that leaves one makes it worth anything.
    """
    gains = [switch_gain(r, step_s, lc, ln, cc, cn) for r, lc, ln, cc, cn in points]
    if any(g == -math.inf for g in gains):
        return -math.inf
    if any(g == math.inf for g in gains):
        return math.inf
    return float(sum(gains))


def switch_now_saving(costs: Sequence[float], gains: Sequence[float]) -> tuple[float, float]:
    """What a restart now saves against the cheapest later time on a grid, and against the last
    one (negative: later is cheaper). ``costs[k]`` is the restart's price at grid time k (0 = now,
    the last = when it would come anyway), ``gains[k]`` what staying in the current state until
    then gains (``gains[0]`` = 0; −inf once staying enters an overload).

    A restart the load will force anyway (a rising load crossing the break-even) is dearer the
    later it comes, since its backlog grows with the rate; staying pays off only while the gain
    of the current state outruns that growth.
    """
    if len(costs) != len(gains) or len(costs) < 2:
        raise ValueError("costs and gains need the same length, at least 2")
    if not math.isfinite(costs[0]):
        return -math.inf, -math.inf  # a restart now would never clear its backlog
    later = [c - g for c, g in zip(costs[1:], gains[1:], strict=True)]
    return min(later) - costs[0], later[-1] - costs[0]


# The two windows' difference is believed only beyond this many standard deviations of its
# Poisson noise: a minute of a steady 12 req/s differs from its quarter hour by 0.43 req/s (one
# sd), which the slope would carry 15 minutes ahead as a 1 req/s rise. The rule looks every
# minute: past 2 sd comes by chance every 40 minutes, past 3 sd about once in 12 hours.
TREND_NOISE_Z = 3.0


def projected_rate(
    short_rps: float,
    long_rps: float | None,
    short_window_s: float,
    long_window_s: float,
    ahead_s: float,
    noise_z: float = TREND_NOISE_Z,
) -> float:
    """Rate expected ``ahead_s`` from now, by the trend between the short and long windows.

    The two windows' averages sit at their centres, (long − short)/2 apart; the slope between
    them (:func:`trend_slope`, net of its noise) is extrapolated, never below zero and never
    beyond twice the current rate plus one request per second (a forecast from two points must
    not run away).
    """
    if long_rps is None or long_window_s <= short_window_s:
        return short_rps
    ahead = short_rps + trend_slope(short_rps, long_rps, short_window_s, long_window_s, noise_z) * ahead_s
    return min(max(ahead, 0.0), 2.0 * short_rps + 1.0)


def trend_slope(
    short_rps: float,
    long_rps: float | None,
    short_window_s: float,
    long_window_s: float,
    noise_z: float = TREND_NOISE_Z,
) -> float:
    """Load trend in req/s per second from the two windows' averages (0 without a long window).

    Only the part of their difference beyond ``noise_z`` standard deviations of Poisson noise
    counts. The short window lies inside the long one, so with λ the long window's rate,
    Var(short − long) = ((L − S)/L)²·λ·(1/S + 1/(L − S)): the short window against the rest.
    """
    if long_rps is None or long_window_s <= short_window_s:
        return 0.0
    rest_s = long_window_s - short_window_s
    sd = rest_s / long_window_s * math.sqrt(max(long_rps, 0.0) * (1.0 / short_window_s + 1.0 / rest_s))
    diff = short_rps - long_rps
    diff = math.copysign(max(abs(diff) - noise_z * sd, 0.0), diff)
    return diff / (rest_s / 2.0)


def gain_horizon(
    rate_rps: float, slope: float, undo_rate_rps: float | None, rising_undoes: bool, min_s: float, max_s: float
) -> float:
    """How long the new state is expected to stay right: until the trend carries the load to
    ``undo_rate_rps`` (the break-even that would switch back), clamped to [min_s, max_s].

    ``rising_undoes``: SD was just enabled, so rising load ends it; else falling load does.
    """
    if undo_rate_rps is None:
        return max_s
    toward = slope if rising_undoes else -slope
    if toward <= 0:
        return max_s
    distance = (undo_rate_rps - rate_rps) if rising_undoes else (rate_rps - undo_rate_rps)
    return min(max(distance / toward, min_s), max_s)


def downtime_estimate(measured_s: Sequence[float], default_s: float, keep: int = 10) -> float:
    """Rolling restart-downtime estimate: median of the last ``keep`` measured, else the default."""
    recent = [d for d in measured_s if d > 0 and math.isfinite(d)][-keep:]
    return median(recent) if recent else default_s
