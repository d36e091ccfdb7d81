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
    return rate_rps * mean_time_in_system(rate_rps, cum_log_rates, tail_rps)


def mean_time_in_system(rate_rps: float, cum_log_rates: np.ndarray, tail_rps: float) -> float:
    """E[n]/λ (Little) for a rate > 0; +inf at or past ``tail_rps``.

    Summed as Σ n·λⁿ⁻¹/Πh over Σ λⁿ/Πh: at a vanishing rate E[n] underflows long before the
    latency it stands for, so the 1/λ is taken inside the sums (in log space).
    """
    if rate_rps >= tail_rps:
        return math.inf
    top = cum_log_rates.size - 1
    log_rate = math.log(rate_rps)
    log_q = _STATES[:top] * log_rate  # (n − 1)·ln λ − C[n], n = 1..top: p(n)/λ
    log_q -= cum_log_rates[1:]
    shift = max(float(log_q.max()) + log_rate, 0.0)  # the mode of p (n = 0 has ln p = 0)
    log_q -= shift
    q = np.exp(log_q, out=log_q)
    z, first = _WEIGHTS[:, 1 : top + 1] @ q
    return float(_with_tail(math.exp(-shift) + rate_rps * z, first, float(q[-1]), top, rate_rps, tail_rps))


def mean_time_in_system_many(rates_rps: np.ndarray, cum_log_rates: np.ndarray, tail_rps: float) -> np.ndarray:
    """:func:`mean_time_in_system` at many rates > 0 in one pass: the same sums, one row per rate."""
    rates = np.asarray(rates_rps, dtype=float)
    out = np.full(rates.shape, math.inf)
    ok = rates < tail_rps
    if ok.any():
        lam, top = rates[ok], cum_log_rates.size - 1
        log_rate = np.log(lam)
        log_q = log_rate[:, None] * _STATES[:top] - cum_log_rates[1:]
        shift = np.maximum(log_q.max(axis=1) + log_rate, 0.0)
        log_q -= shift[:, None]
        q = np.exp(log_q, out=log_q)
        z, first = _WEIGHTS[:, 1 : top + 1] @ q.T
        out[ok] = _with_tail(np.exp(-shift) + lam * z, first, q[:, -1], top, lam, tail_rps)
    return out


def _with_tail(z, first, last, top: int, rate, tail_rps: float):
    """Σ n·p/λ over Σ p with the queue past ``top`` added: there each state's weight is the one
    before's times r = λ/h_tail. ``z`` is Σ p, ``first`` Σ n·p/λ and ``last`` p(top)/λ over the
    states up to ``top`` (scalars, or one value per rate)."""
    r = rate / tail_rps
    z = z + rate * last * r / (1.0 - r)
    first = first + last * (top * r / (1.0 - r) + r / (1.0 - r) ** 2)
    return first / z
