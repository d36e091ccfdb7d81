"""The running batch as a birth–death chain: what the fluid fixed point leaves out.

The fixed point B = λ·T(B) treats arrivals as a steady flow. Real arrivals are Poisson, so the
number of requests in the server wanders around that mean, and because T grows with the batch
(and throughput flattens near capacity) the mean latency over those states is not the latency
at the mean state. With ``n`` requests in the server the engine runs them all in every step and
finishes them at the rate ``h(n) = n / T(n − 1)`` (each shares its steps with the n − 1 others:
the same T the fixed point solves); past the batch bound the rest wait in the queue and the
server keeps finishing at the full batch's rate. That is a birth–death chain with arrival rate
λ and departure rate h(n), whose stationary law is

    π(n) ∝ λⁿ / (h(1)·h(2)·…·h(n)),

and the mean latency is E[n]/λ (Little). It is exact for M/M/1 (h constant), M/M/c (Erlang C)
and M/M/∞ (tests/test_queueing.py), and for the processor-sharing batch it is insensitive to
the shape of the length distribution. Near the stability limit it rises smoothly to the limit
instead of following the fixed point's fold, and past the bound the queue tail is geometric,
so the chain is summed to the bound and the tail in closed form.
"""

from __future__ import annotations

import math

import numpy as np

MAX_STATES = 4096  # enumerated states; past them (or the bound) the queue tail in closed form
_STATES = np.arange(0.0, MAX_STATES + 1.0)  # n = 0, 1, 2, …: sliced, never rebuilt per call
_WEIGHTS = np.stack((np.ones_like(_STATES), _STATES))  # Σ p and Σ n·p in one product


def cumulative_log_rates(departure_rps: np.ndarray) -> np.ndarray:
    """``C[n] = Σ_{k ≤ n} ln h(k)`` for n = 0..N from the departure rates h(1..N), N at most
    :data:`MAX_STATES` (a batch bound past it is only reached when thousands run at once).

    The rates are made non-decreasing: a server never finishes more slowly because more
    requests wait (it keeps running its best batch; past the throughput peak the extra ones
    queue). The queue past the last state is served at the stability limit, which
    :func:`mean_in_system` takes as ``tail_rps``.
    """
    raw = np.asarray(departure_rps, dtype=float)
    if raw.size == 0 or not (raw > 0.0).all():
        raise ValueError("departure rates must be positive")
    h = np.maximum.accumulate(raw[:MAX_STATES])
    return np.concatenate(([0.0], np.cumsum(np.log(h))))


def mean_in_system(rate_rps: float, cum_log_rates: np.ndarray, tail_rps: float) -> float:
    """E[n] of the chain: states 0..N from ``cum_log_rates``, then a queue served at
    ``tail_rps``; +inf at or past it, 0 at no load."""
    if rate_rps <= 0.0:
        return 0.0
    if rate_rps >= tail_rps:
        return math.inf
    top = cum_log_rates.size - 1
    log_p = _STATES[: top + 1] * math.log(rate_rps)
    log_p -= cum_log_rates
    log_p -= log_p.max()  # the mode's weight is 1: nothing overflows
    z, first = _WEIGHTS[:, : top + 1] @ np.exp(log_p, out=log_p)
    # Past the bound every state's weight is the last one's times r = λ/h_tail, once more.
    r = rate_rps / tail_rps
    last = float(log_p[top])
    z += last * r / (1.0 - r)
    first += last * (top * r / (1.0 - r) + r / (1.0 - r) ** 2)
    return float(first / z)


def mean_in_system_many(rates_rps: np.ndarray, cum_log_rates: np.ndarray, tail_rps: float) -> np.ndarray:
    """:func:`mean_in_system` at many rates in one pass: the same sums, one row per rate."""
    rates = np.asarray(rates_rps, dtype=float)
    out = np.where(rates >= tail_rps, math.inf, 0.0)
    ok = (rates > 0.0) & (rates < tail_rps)
    if ok.any():
        lam, top = rates[ok], cum_log_rates.size - 1
        log_p = np.log(lam)[:, None] * _STATES[: top + 1] - cum_log_rates
        log_p -= log_p.max(axis=1, keepdims=True)
        z, first = _WEIGHTS[:, : top + 1] @ np.exp(log_p, out=log_p).T
        r, last = lam / tail_rps, log_p[:, top]
        z += last * r / (1.0 - r)
        first += last * (top * r / (1.0 - r) + r / (1.0 - r) ** 2)
        out[ok] = first / z
    return out
