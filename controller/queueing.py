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
_MAX = np.maximum.reduce
_MIN = np.minimum.reduce
_ACCUMULATE = np.maximum.accumulate
_SUM = np.add.accumulate
_PRODUCT = np.multiply.accumulate
_VIEWS: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # per chain length: slicing anew cost ~0.5 µs a call


def _views(top: int) -> tuple[np.ndarray, np.ndarray]:
    _VIEWS[top] = _STATES[:top], _WEIGHTS[:, 1 : top + 1]
    return _VIEWS[top]


def cumulative_log_rates(departure_rps: np.ndarray, monotone: bool = True) -> np.ndarray:
    """``C[n] = Σ_{k ≤ n} ln h(k)`` for n = 0..N from the departure rates h(1..N), N at most
    :data:`MAX_STATES` (a batch bound past it is only reached when thousands run at once).

    The rates are made non-decreasing: a server never finishes more slowly because more
    requests wait (it keeps running its best batch; past the throughput peak the extra ones
    queue). The queue past the last state is served at the stability limit, which
    :func:`mean_in_system` takes as ``tail_rps``. ``monotone=False`` keeps them as given (a
    staircase of step costs the caller put on rates it made non-decreasing itself). Several
    chains at once: one per row (the last axis is the states).
    """
    raw = np.asarray(departure_rps, dtype=float)
    if raw.size == 0 or not _MIN(raw, axis=None) > 0.0:  # NaN fails it too
        raise ValueError("departure rates must be positive")
    h = _ACCUMULATE(raw[..., :MAX_STATES], axis=-1) if monotone else raw[..., :MAX_STATES]
    out = np.empty((*h.shape[:-1], h.shape[-1] + 1))  # C[0] = 0, then the running sum in place
    out[..., 0] = 0.0
    body = out[..., 1:]
    _SUM(np.log(h, out=body), axis=-1, out=body)  # ufuncs, not their Python wrappers
    return out


def mean_in_system(rate_rps: float, cum_log_rates: np.ndarray, tail_rps: float) -> float:
    """E[n] of the chain: states 0..N from ``cum_log_rates``, then a queue served at
    ``tail_rps``; +inf at or past it, 0 at no load."""
    if rate_rps <= 0.0:
        return 0.0
    return rate_rps * mean_time_in_system(rate_rps, cum_log_rates, tail_rps)


# e^700 < 1.8e308: the running product's largest term stays below it even times 4096 states.
_MAX_LOG_PRODUCT = 700.0 - math.log(MAX_STATES)


def inverse_rates(cum_log_rates: np.ndarray, tail_rps: float) -> np.ndarray | None:
    """1/h(n), n = 1..N, from ``cum_log_rates``: what :func:`mean_time_in_system` multiplies
    instead of exponentiating, at every rate below ``tail_rps``; a curve takes them once and
    evaluates at many rates. None where the product could overflow below ``tail_rps`` (its
    largest term, λⁿ⁻¹/Π h at the mode, grows with λ: past e^700 with hundreds in the server).
    """
    top = cum_log_rates.size - 1
    if top == 0 or not 0.0 < tail_rps < math.inf:
        return None
    states, _ = _VIEWS.get(top) or _views(top)
    log_q = states * math.log(tail_rps)
    log_q -= cum_log_rates[1:]
    if float(_MAX(log_q)) > _MAX_LOG_PRODUCT:
        return None
    inverse = np.subtract(cum_log_rates[:-1], cum_log_rates[1:], out=log_q)  # −ln h(n)
    return np.exp(inverse, out=inverse)


def mean_time_in_system(
    rate_rps: float, cum_log_rates: np.ndarray, tail_rps: float, inverse: np.ndarray | None = None
) -> float:
    """E[n]/λ (Little) for a rate > 0; +inf at or past ``tail_rps``.

    Summed as Σ n·λⁿ⁻¹/Πh over Σ λⁿ/Πh: at a vanishing rate E[n] underflows long before the
    latency it stands for, so the 1/λ is taken inside the sums. With ``inverse``
    (:func:`inverse_rates`) the terms are a running product of λ/h(n): no exponentials, which
    were most of the sums' cost; without, in log space.
    """
    if rate_rps >= tail_rps:
        return math.inf
    top = cum_log_rates.size - 1
    states, weights = _VIEWS.get(top) or _views(top)
    if inverse is not None:
        q = inverse * rate_rps  # λ/h(n), the first 1/h(1): q(n) = p(n)/λ = λⁿ⁻¹/Π h
        q[0] = inverse[0]
        _PRODUCT(q, out=q)
        z, first = (weights @ q).tolist()
        return _with_tail(1.0 + rate_rps * z, first, q.item(-1), top, rate_rps, tail_rps)
    log_rate = math.log(rate_rps)
    log_q = states * log_rate  # (n − 1)·ln λ − C[n], n = 1..top: p(n)/λ
    log_q -= cum_log_rates[1:]
    # ufunc.reduce and tolist: ndarray.max's Python wrapper and numpy scalars' arithmetic were
    # a fifth of a repeated evaluation.
    shift = max(float(_MAX(log_q)) + log_rate, 0.0)  # the mode of p (n = 0 has ln p = 0)
    log_q -= shift
    q = np.exp(log_q, out=log_q)
    z, first = (weights @ q).tolist()
    return _with_tail(math.exp(-shift) + rate_rps * z, first, q.item(-1), top, rate_rps, tail_rps)


def mean_time_in_system_many(
    rates_rps: np.ndarray, cum_log_rates: np.ndarray, tail_rps: float, inverse: np.ndarray | None = None
) -> np.ndarray:
    """:func:`mean_time_in_system` at many rates > 0 in one pass: the same sums, one row per rate."""
    rates = np.asarray(rates_rps, dtype=float)
    out = np.full(rates.shape, math.inf)
    ok = rates < tail_rps
    if ok.any():
        out[ok] = mean_time_in_system_below(rates[ok], cum_log_rates, tail_rps, inverse)
    return out


def mean_time_in_system_below(
    rates_rps: np.ndarray, cum_log_rates: np.ndarray, tail_rps: float, inverse: np.ndarray | None = None
) -> np.ndarray:
    """:func:`mean_time_in_system_many` at rates all in (0, ``tail_rps``), unchecked: a grid
    below the limit (break-even rates) pays no masks."""
    lam, top = rates_rps, cum_log_rates.size - 1
    states, weights = _VIEWS.get(top) or _views(top)
    if inverse is not None:
        q = lam[:, None] * inverse
        q[:, 0] = inverse[0]
        _PRODUCT(q, axis=1, out=q)
        z, first = weights @ q.T
        return _with_tail(1.0 + lam * z, first, q[:, -1], top, lam, tail_rps)
    log_rate = np.log(lam)
    log_q = log_rate[:, None] * states - cum_log_rates[1:]
    shift = np.maximum(_MAX(log_q, axis=1) + log_rate, 0.0)
    log_q -= shift[:, None]
    q = np.exp(log_q, out=log_q)
    z, first = weights @ q.T
    return _with_tail(np.exp(-shift) + lam * z, first, q[:, -1], top, lam, tail_rps)


def stationary_law(rate_rps: float, cum_log_rates: np.ndarray, tail_rps: float) -> tuple[np.ndarray, float]:
    """The chain's stationary law: P(n) for n = 0..N from ``cum_log_rates``, and the mass of the
    queue past N (served at ``tail_rps``; geometric). What a server's time-weighted count of
    requests (vLLM's running plus waiting gauges) should show at this rate, not only its mean
    (:func:`mean_in_system`). A rate at or past ``tail_rps`` has no law: ValueError.
    """
    if not 0.0 < rate_rps < tail_rps:
        raise ValueError(f"a stationary law needs 0 < rate < {tail_rps:g} req/s, got {rate_rps:g}")
    top = cum_log_rates.size - 1
    log_p = _STATES[: top + 1] * math.log(rate_rps) - cum_log_rates
    log_p -= log_p.max()
    p = np.exp(log_p)
    r = rate_rps / tail_rps
    past = float(p[-1]) * r / (1.0 - r)  # Σ_{k ≥ 1} p(N)·rᵏ
    total = float(p.sum()) + past
    return p / total, past / total


def _with_tail(z, first, last, top: int, rate, tail_rps: float):
    """Σ n·p/λ over Σ p with the queue past ``top`` added: there each state's weight is the one
    before's times r = λ/h_tail. ``z`` is Σ p, ``first`` Σ n·p/λ and ``last`` p(top)/λ over the
    states up to ``top`` (scalars, or one value per rate)."""
    r = rate / tail_rps
    z = z + rate * last * r / (1.0 - r)
    first = first + last * (top * r / (1.0 - r) + r / (1.0 - r) ** 2)
    return first / z


MAX_WINDOW_STEPS = 400_000  # uniformized steps of a window (~8 s); a longer test is taken as stationary
WINDOW_LOG_MASS = 40.0  # states whose stationary weight is below e^-40 of the mode's are left out
WINDOW_RELAXATIONS = 1000.0  # a test this many relaxation times long is taken as stationary,
WARMUP_RELAXATIONS = 10.0  # and so is one whose warm-up lasts this many


def mean_time_in_window(
    rate_rps: float,
    cum_log_rates: np.ndarray,
    tail_rps: float,
    duration_s: float,
    warmup_s: float = 0.0,
) -> float:
    """Mean time in system of the requests that arrive in [warmup_s, duration_s) at a server
    that starts empty and gets no arrivals after ``duration_s``: what a load test of that length
    measures. Near the limit the chain relaxes over hours, so a half-hour test sees far less
    than the stationary mean (+inf at the limit, finite in any test).

    The chain's law is stepped forward on its uniformized grid (steps of 1/Λ, Λ = λ + the
    fastest departure rate kept: the law stays a probability; the error is O(1/(Λ·window)),
    3e-5 relative on M/M/∞ over 60 s, 7e-4 over 5 s), the queue past the bound served at
    ``tail_rps``. Started empty, a birth–death chain stays stochastically below its stationary
    law, so the states are cut where that law's weight is negligible, or where the queue cannot
    reach within the test. The arrivals of [0, x) spend ``∫₀ˣ E[n] dt + E[W(n(x))]`` in the
    system when arrivals stop at x, W(n) = Σ_{j ≤ n} j/h(j) the time n requests take to drain;
    the window's mean is the difference between x = ``duration_s`` and x = ``warmup_s`` over the
    λ·(duration − warmup) arrivals between (exact for FIFO; with the batch sharing its steps the
    warm-up's requests are slowed by later ones, which this charges to neither).
    """
    if rate_rps <= 0.0 or not duration_s > warmup_s >= 0.0:
        raise ValueError("a window needs a rate > 0 and 0 <= warmup < duration")
    top = cum_log_rates.size - 1
    log_pi = _STATES[: top + 1] * math.log(rate_rps) - cum_log_rates
    floor = float(log_pi.max()) - WINDOW_LOG_MASS
    h = np.exp(np.diff(cum_log_rates))  # h(1..top)
    tail = max(float(tail_rps), float(h[-1]))
    if log_pi[-1] < floor:
        weight = np.exp(log_pi - float(log_pi.max()))
        mean = float(weight @ _STATES[: top + 1]) / float(weight.sum())
        spread = float(weight @ (_STATES[: top + 1] - mean) ** 2) / float(weight.sum())
        # 4·Var(n)/λ bounds the chain's relaxation time (M/M/1: within (1 + √ρ)²/4 of it; M/M/∞:
        # 4×): a warm-up 10 of them long has forgotten the empty start (e^-10), and so has a test
        # 1000 of them long without one (the fill-up is a 0.1 % of it).
        relax = 4.0 * spread / rate_rps
        if warmup_s >= WARMUP_RELAXATIONS * relax or duration_s >= WINDOW_RELAXATIONS * relax:
            return mean_time_in_system(rate_rps, cum_log_rates, tail_rps)
        last = int(np.nonzero(log_pi >= floor)[0][-1]) + 2
        rates = np.concatenate(([0.0], h[:last]))
    else:  # the queue past the bound: geometric at λ/tail while stable, and reachable in the test
        reach = 8.0 * math.sqrt(rate_rps * duration_s) + max(rate_rps - tail, 0.0) * duration_s
        if rate_rps < tail:
            reach = min(reach, (float(log_pi[-1]) - floor) / math.log(tail / rate_rps))
        rates = np.concatenate(([0.0], h, np.full(math.ceil(reach) + 16, tail)))
    n = _STATES[: rates.size] if rates.size <= _STATES.size else np.arange(rates.size, dtype=float)
    drain = np.concatenate(([0.0], np.cumsum(n[1:] / rates[1:])))  # W(n)
    steps = math.ceil(duration_s * (rate_rps + float(rates.max())))  # the fastest state sets the grid
    if steps > MAX_WINDOW_STEPS:  # hours at hundreds of req/s: seconds of stepping for a test
        return mean_time_in_system(rate_rps, cum_log_rates, tail_rps)  # that long is near stationary
    dt = duration_s / steps
    up = np.full(rates.size, rate_rps * dt)
    up[-1] = 0.0  # the cut reflects: past it the chain's weight is negligible
    down = rates * dt
    stay = 1.0 - up - down
    up, down = up[:-1], down[1:]
    p = np.zeros(rates.size)
    p[0] = 1.0
    warm_step = round(warmup_s / dt)
    area = total_warm = 0.0
    level = 0.0  # E[n] now (the server starts empty); the area by trapezoids
    for k in range(steps):
        if k == warm_step:
            total_warm = area + float(p @ drain)
        nxt = p * stay
        nxt[1:] += p[:-1] * up
        nxt[:-1] += p[1:] * down
        p = nxt
        after = float(p @ n)
        area += 0.5 * (level + after) * dt
        level = after
    total = area + float(p @ drain)
    return (total - total_warm) / (rate_rps * (duration_s - warmup_s))
