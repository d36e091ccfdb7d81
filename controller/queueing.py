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

Where requests bring prompts, each prefill stalls the whole batch and the arrivals during it
stall the next step: requests arrive in bursts, and the law of n is wider than this chain's.
:func:`burst_time_in_system` is the chain the latency is read from then (docs/model.md,
*Arrivals in bursts*); :func:`mean_time_in_window` steps either through a finite load test.
"""

from __future__ import annotations

import bisect
import math
from typing import NamedTuple

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
    rate_rps: float,
    cum_log_rates: np.ndarray,
    tail_rps: float,
    inverse: np.ndarray | None = None,
    queue_scale: float = 1.0,
) -> float:
    """E[n]/λ (Little) for a rate > 0; +inf at or past ``tail_rps``.

    Summed as Σ n·λⁿ⁻¹/Πh over Σ λⁿ/Πh: at a vanishing rate E[n] underflows long before the
    latency it stands for, so the 1/λ is taken inside the sums. With ``inverse``
    (:func:`inverse_rates`) the terms are a running product of λ/h(n): no exponentials, which
    were most of the sums' cost; without, in log space. ``queue_scale`` f: the queue past the
    last state holds f times the chain's (:func:`queue_variability`).
    """
    if rate_rps >= tail_rps:
        return math.inf
    top = cum_log_rates.size - 1
    states, weights = _VIEWS.get(top) or _views(top)
    if inverse is not None:
        q = inverse * rate_rps  # λ/h(n), the first 1/h(1): q(n) = p(n)/λ = λⁿ⁻¹/Π h
        q[0] = inverse[0]
        _PRODUCT(q, out=q)
        z, first = weights.dot(q).tolist()
        return _with_tail(1.0 + rate_rps * z, first, q.item(-1), top, rate_rps, tail_rps, queue_scale)
    log_rate = math.log(rate_rps)
    log_q = states * log_rate  # (n − 1)·ln λ − C[n], n = 1..top: p(n)/λ
    log_q -= cum_log_rates[1:]
    # ufunc.reduce and tolist: ndarray.max's Python wrapper and numpy scalars' arithmetic were
    # a fifth of a repeated evaluation.
    shift = max(float(_MAX(log_q)) + log_rate, 0.0)  # the mode of p (n = 0 has ln p = 0)
    log_q -= shift
    q = np.exp(log_q, out=log_q)
    z, first = weights.dot(q).tolist()
    return _with_tail(math.exp(-shift) + rate_rps * z, first, q.item(-1), top, rate_rps, tail_rps, queue_scale)


def mean_time_in_system_many(
    rates_rps: np.ndarray,
    cum_log_rates: np.ndarray,
    tail_rps: float,
    inverse: np.ndarray | None = None,
    queue_scale: float = 1.0,
) -> np.ndarray:
    """:func:`mean_time_in_system` at many rates > 0 in one pass: the same sums, one row per rate."""
    rates = np.asarray(rates_rps, dtype=float)
    out = np.full(rates.shape, math.inf)
    ok = rates < tail_rps
    if ok.any():
        out[ok] = mean_time_in_system_below(rates[ok], cum_log_rates, tail_rps, inverse, queue_scale)
    return out


def mean_time_in_system_below(
    rates_rps: np.ndarray,
    cum_log_rates: np.ndarray,
    tail_rps: float,
    inverse: np.ndarray | None = None,
    queue_scale: float = 1.0,
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
        return _with_tail(1.0 + lam * z, first, q[:, -1], top, lam, tail_rps, queue_scale)
    log_rate = np.log(lam)
    log_q = log_rate[:, None] * states - cum_log_rates[1:]
    shift = np.maximum(_MAX(log_q, axis=1) + log_rate, 0.0)
    log_q -= shift[:, None]
    q = np.exp(log_q, out=log_q)
    z, first = weights @ q.T
    return _with_tail(np.exp(-shift) + lam * z, first, q[:, -1], top, lam, tail_rps, queue_scale)


def queue_variability(service_scv: float, arrival_scv: float = 1.0) -> float:
    """f = (C_a² + C_s²)/2: how many times the memoryless chain's queue past a full batch of a
    fixed count of sequences the real one holds (the Allen–Cunneen factor of M/G/c: the wait in
    queue scales by f, the law of the running batch stays the chain's).

    With max_num_seqs running, each completion admits the next waiting request: the batch is c
    servers, each holding a request for its service (its decode steps, ∝ its generated tokens,
    squared coefficient of variation C_s²). The c renewal processes' completions over a long
    time have the variance of C_s² Poisson ones, the arrivals C_a² (1: Poisson); near the limit
    the queue is the diffusion of their difference, whose mean scales with (C_a² + C_s²)/2.
    Memoryless lengths give 1, the chain's own tail; the fidelity bench's gamma lengths of shape
    2–2.5 give 0.70–0.75. Where the KV cache bounds the batch the count it holds moves with the
    lengths of the requests in it, and this does not apply."""
    return 0.5 * (max(float(arrival_scv), 0.0) + max(float(service_scv), 0.0))


def stationary_law(rate_rps: float, cum_log_rates: np.ndarray, tail_rps: float) -> tuple[np.ndarray, float]:
    """The chain's stationary law: P(n) for n = 0..N from ``cum_log_rates``, and the mass of the
    queue past N (served at ``tail_rps``; geometric). What a server's time-weighted count of
    requests (vLLM's running plus waiting gauges) should show at this rate, not only its mean
    (:func:`mean_in_system`). A rate at or past ``tail_rps`` has no law: ValueError.
    """
    if not 0.0 < rate_rps < tail_rps:
        raise ValueError(f"a stationary law needs 0 < rate < {tail_rps:g} req/s, got {rate_rps:g}")
    top = cum_log_rates.size - 1
    return _law_with_tail(_STATES[: top + 1] * math.log(rate_rps) - cum_log_rates, rate_rps / tail_rps)


def _law_with_tail(log_p: np.ndarray, r: float) -> tuple[np.ndarray, float]:
    """P(n), n = 0..N, from its unnormalized logs, and the mass of the queue past N, where each
    state's weight is the one before's times r = λ/h_tail."""
    p = np.exp(log_p - log_p.max())
    past = _tail_sums(float(p[-1]), 0, r)[0]
    total = float(p.sum()) + past
    return p / total, past / total


def _tail_sums(last, top: int, r, queue_scale: float = 1.0):
    """(Σ p, Σ n·p) over the queue past ``top``, whose weights are p(top)·rᵏ, k ≥ 1 (scalars,
    or one value per rate): ``last`` p(top) in any unit, the sums in the same. Each request
    waiting past ``top`` counts ``queue_scale`` in Σ n·p (:func:`queue_variability`)."""
    past = last * r / (1.0 - r)
    return past, last * (top * r / (1.0 - r) + queue_scale * r / (1.0 - r) ** 2)


def _with_tail(z, first, last, top: int, rate, tail_rps: float, queue_scale: float = 1.0):
    """Σ n·p/λ over Σ p with the queue past ``top`` added (:func:`_tail_sums`). ``z`` is Σ p,
    ``first`` Σ n·p/λ and ``last`` p(top)/λ over the states up to ``top`` (scalars, or one value
    per rate). A hair below the limit the sums come near a float's top and the queue's
    1/(1 − r)² takes them past it: the same ratio is then taken over p(top)."""
    r = rate / tail_rps

    def ratio(z, first, last):
        past, beyond = _tail_sums(last, top, r, queue_scale)
        return (first + beyond) / (z + rate * past)

    if isinstance(last, float):  # one rate: Python floats overflow to inf without a warning
        out = ratio(z, first, last)
        return out if math.isfinite(out) else ratio(z / last, first / last, 1.0)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        out = ratio(z, first, last)
        if np.all(np.isfinite(out)):
            return out
        return np.where(np.isfinite(out), out, ratio(z / last, first / last, 1.0))


# --------------------------------------------------------------------------------------------
# Arrivals in bursts: prompts stall the batch
# --------------------------------------------------------------------------------------------
# Counted in decode steps the server is an infinite server: every running request advances a
# token a step, however many run. A prompt's prefill stalls the whole batch for Δ, and the
# requests that arrive during the stall are prefilled in the next step, stalling it again: in
# steps, requests arrive in families (Borel, p = λ·Δ), which widens the law of n well past the
# birth–death chain's where prompts are long (docs/model.md, *The law's width*).

# Past this share of the server's time spent on prompts the bunching series and the stalls are cut
# off: there the token budget, not the wait, sets the limit (model._budget_limit).
MAX_PROMPT_SHARE = 0.95


class Bursts(NamedTuple):
    """What turns a chain's departure rates into a chain with arrivals in bursts: per state
    n = 1..N, the time per departure the decode takes (``decode_s`` = 1/h(n) − Δ) and the stall
    of a prompt met there (``prompt_s`` = Δ(n − 1)), and how long two requests that arrive
    together stay together (``overlap``, :func:`length_overlap`)."""

    decode_s: np.ndarray
    prompt_s: np.ndarray
    overlap: float
    levels: list[float]  # the chain's rates, non-decreasing: the state a rate's fixed point is in
    # Rows summed against the running product P(n), n = 1..N: 1, n, the prefill an arrival
    # finding n gets, and the one finding n + 1 (none past N).
    sums: np.ndarray
    prompt_max: float  # the largest Δ: below 0.95/it no stall needs its cap
    # Δ of the first state, the second (the prefill an arrival finding one other gets) and the
    # last, as floats: what every evaluation's sums read.
    prompt_ends: tuple[float, float, float]
    level_array: np.ndarray  # ``levels`` for a column of rates (numpy converts a list each call)

    @property
    def alone_s(self) -> float:
        """A request alone (no load): its decode and its own prefill, 1/h(1)."""
        return self.decode_s.item(0) + self.prompt_s.item(0)

    def arrival_prompt_s(self, law: np.ndarray) -> float:
        """Δ an arrival gets, over a law of n = 0..N: its prefill shares a step with the n there."""
        return (law.item(0) * self.prompt_s.item(0) + float(law[1:] @ self.sums[2])) / float(law.sum())


def bursts_of(cum_log_rates: np.ndarray, prompt_s: np.ndarray, overlap: float) -> Bursts:
    """:class:`Bursts` from a chain's ``cum_log_rates`` and each state's prompt stall Δ (n = 1..N).

    Each state keeps a decode of at least a millionth of its time per departure: a chain that
    prices prompts sharing a step below Δ (or a rate held up past the throughput peak) must not
    leave a state with nothing to decode. No more than that: a request with nothing to generate
    is nearly all prefill, and a larger floor would part the chain from the request alone
    (1/h(1)) at no load."""
    rates = np.exp(cum_log_rates[1:] - cum_log_rates[:-1])  # h(n)
    inverse = 1.0 / rates
    prompt = np.asarray(prompt_s, dtype=float)
    decode = np.maximum(inverse - prompt, 1e-6 * inverse)
    top = prompt.size
    sums = np.zeros((4, top))
    sums[0], sums[1] = 1.0, _STATES[1 : top + 1]
    sums[2, :-1], sums[2, -1] = prompt[1:], prompt[-1]  # one arriving to n shares its prefill's step with n
    sums[3, :-1] = sums[2, 1:]
    ends = (prompt.item(0), sums.item(2, 0), prompt.item(-1))
    levels = _ACCUMULATE(rates)
    return Bursts(decode, prompt, float(overlap), levels.tolist(), sums, float(_MAX(prompt)), ends, levels)


def length_overlap(mean: float, sd: float) -> float:
    """κ = ∫ P(S > x)² dx / E[S] = E[min(S₁, S₂)] / E[S] for a gamma law of this mean and sd:
    how long two requests that arrive together stay together (1 for equal lengths, 1/2 for
    exponential ones). In an infinite-server queue fed by bursts of index I (E[X²]/E[X]),
    Var(n)/E[n] = 1 + (I − 1)·κ.

    E[min] = E[S] − E|S₁ − S₂|/2, and a gamma of shape k has the mean difference
    E|S₁ − S₂| = 2·E[S]·Γ(k + ½)/(√π·Γ(k + 1)): κ = 1 − Γ(k + ½)/(√π·Γ(k + 1)), k = (mean/sd)²
    (1/2 at k = 1, 5/8 at k = 2, 1 − 1/√(πk) as k grows)."""
    if mean <= 0.0 or sd <= 1e-6 * mean:
        return 1.0
    shape = (mean / sd) ** 2
    return 1.0 - math.exp(math.lgamma(shape + 0.5) - math.lgamma(shape + 1.0)) / math.sqrt(math.pi)


def burst_ratio(prompt_share, overlap: float):
    """r of the geometric bursts (P(X ≥ k + 1 | X ≥ k) = r) that give a chain with memoryless
    departures the count's variance of an infinite server fed by Borel bursts.

    Requests that arrive during a stall come in families whose size is Borel with p = λ·Δ (the
    prompts' share of the time), index I = E[X²]/E[X] = 1/(1 − p)². Geometric bursts of ratio r
    have index (1 + r)/(1 − r), and with memoryless departures (overlap 1/2) they give
    Var/E = (1 + I)/2: r matches 1 + 2·κ·(I − 1) (:func:`length_overlap`). Scalars or arrays."""
    if isinstance(prompt_share, float):  # one rate: Python floats
        p = min(max(prompt_share, 0.0), MAX_PROMPT_SHARE)
    else:
        p = np.minimum(np.maximum(prompt_share, 0.0), MAX_PROMPT_SHARE)
    excess = 2.0 * overlap * (1.0 / ((1.0 - p) * (1.0 - p)) - 1.0)  # the index less 1
    return excess / (excess + 2.0)


def burst_ratio_at(rate, bursts: Bursts):
    """:func:`burst_ratio` at a rate, with Δ in the state the rate's fixed point is in (the first
    whose rate reaches λ): the bursts are set before the law is known. Scalars or arrays."""
    top = len(bursts.levels) - 1
    if isinstance(rate, float):
        at = min(bisect.bisect_left(bursts.levels, rate), top)
        return burst_ratio(rate * bursts.prompt_s.item(at), bursts.overlap)
    at = np.minimum(bursts.level_array.searchsorted(rate), top)
    return burst_ratio(rate * bursts.prompt_s[at], bursts.overlap)


def _stretched(rate, bursts: Bursts) -> np.ndarray:
    """``decode_s``/(1 − λ·Δ(n)) per state (a new array): the decode stretched by the others'
    prompts, arriving at λ. ``rate`` a float, or a column of rates (one row each)."""
    stall = bursts.prompt_s * -rate
    stall += 1.0
    if not isinstance(rate, float) or rate * bursts.prompt_max > MAX_PROMPT_SHARE:
        np.maximum(stall, 1.0 - MAX_PROMPT_SHARE, out=stall)
    return np.divide(bursts.decode_s, stall, out=stall)


def _burst_factors(rate, ratio, bursts: Bursts) -> np.ndarray:
    """r + c(n) per state (a new array), c = λ·(1 − r)·decode/(1 − λ·Δ): the decode over
    (1 − λ·Δ)/(λ·(1 − r)), one pass fewer over the states than stretching (:func:`_stretched`)
    and scaling apart. ``rate`` and ``ratio`` floats, or columns (one row per rate)."""
    per = 1.0 / (rate * (1.0 - ratio))
    product = bursts.prompt_s * (-rate * per)
    product += per
    if not isinstance(rate, float) or rate * bursts.prompt_max > MAX_PROMPT_SHARE:
        np.maximum(product, (1.0 - MAX_PROMPT_SHARE) * per, out=product)
    np.divide(bursts.decode_s, product, out=product)
    product += ratio
    return product


def _own_prefill_s(rate, prompt_s):
    """A request's own prefill as a delay: its Δ stretched by the stalls of those arriving during it."""
    if isinstance(prompt_s, float):
        return prompt_s / (1.0 - min(rate * prompt_s, MAX_PROMPT_SHARE))
    return prompt_s / (1.0 - np.minimum(rate * prompt_s, MAX_PROMPT_SHARE))


def burst_time_in_system(
    rate_rps: float, bursts: Bursts, tail_rps: float, fits: bool = True, queue_scale: float = 1.0
) -> float:
    """Mean time in system of the chain with arrivals in bursts, for a rate > 0; +inf at or past
    ``tail_rps``.

    Bursts come at λ·(1 − r), geometric of ratio r (mean 1/(1 − r)). Every prompt a request
    meets is priced as a stall at λ, its own too: h'(n) = (1 − λ·Δ(n − 1))/``decode_s``(n); the
    own is added back as a delay, Δ/(1 − λ·Δ) (the arrivals during it stall its first step),
    with Δ the one an arrival gets, over the law. Across the cut below m the bursts from every
    j < m that reach m balance the departures out of m:
    π(m)·h'(m) = λ·(1 − r)·Σ_{j<m} π(j)·r^(m−1−j), so π(m) = c(m)·Π_{k<m}(r + c(k)),
    c = λ·(1 − r)/h': the chain's running product with r added to each factor. Past the
    chain's states arrivals queue one at a time (a prefill starts only with a completion
    there): the tail is the plain chain's, λ/``tail_rps`` a state. Summed as a running product
    where it ``fits`` a float (:func:`burst_product_fits`), else in log space.
    """
    if rate_rps >= tail_rps:
        return math.inf
    if rate_rps < VANISHING_RPS:
        return bursts.alone_s
    ratio = burst_ratio_at(rate_rps, bursts)
    product = _burst_factors(rate_rps, ratio, bursts)  # r + c(n), then P(n)
    if not fits:
        return _burst_time_log(rate_rps, product, ratio, bursts, tail_rps, queue_scale)
    _PRODUCT(product, out=product)
    return _burst_sums(rate_rps, product, 1.0, ratio, bursts, tail_rps, queue_scale)


# Below this rate a request is alone: p(n) = P(n) − r·P(n − 1) would underflow to denormals (the
# latency's relative error there is λ·T, below 1e-140).
VANISHING_RPS = 1e-150


def burst_product_fits(bursts: Bursts, tail_rps: float) -> bool:
    """Whether :func:`burst_time_in_system`'s running product stays within a float at every rate
    below ``tail_rps``: taken once per curve, as :func:`inverse_rates`.

    With x(n) = λ·``decode_s``/(1 − λ·Δ) (rising with λ) each factor r + (1 − r)·x is below 1
    where x is and at most x where it is not, so ln Π ≤ Σ max(ln x, 0) at the limit bounds the
    product at every rate below it."""
    if not 0.0 < tail_rps < math.inf:
        return False
    x = _stretched(float(tail_rps), bursts)
    bound = float(np.log(np.maximum(x * tail_rps, 1.0)).sum()) + math.log(max(float(_MAX(x)), 1.0))
    return bound < _MAX_LOG_PRODUCT


def _burst_sums(rate, product, empty, ratio, bursts: Bursts, tail_rps: float, queue_scale: float = 1.0):
    """Time in system from the running product P(n) = Π_{k≤n}(r + c(k)), n = 1..N (one row per
    rate), P(0) = ``empty``: E[n]/λ and the own prefill at the Δ an arrival gets, the queue past
    N geometric at λ/``tail_rps``.

    p(n) = c(n)·P(n − 1) = P(n) − r·P(n − 1), so every sum over p is two over P, and P is all a
    rate computes: Σp = S − r·(P(0) + S − P(N)), Σn·p = M − r·(P(0) + M − N·P(N) + S − P(N)),
    S = ΣP(n), M = Σn·P(n)."""
    first_prompt, second_prompt, last_prompt = bursts.prompt_ends
    top = bursts.prompt_s.size
    if product.ndim == 1:  # one rate: Python floats (numpy scalars' arithmetic is slower)
        # ndarray.dot, not @: the matmul ufunc's dispatch is twice the product of 4 rows by 256.
        (s, m, d1, d2), last = bursts.sums.dot(product).tolist(), product.item(-1)
        before = product.item(-2) if top > 1 else empty
    else:
        (s, m, d1, d2), last = bursts.sums @ product.T, product[:, -1]
        before = product[:, -2] if top > 1 else empty
    z = s - ratio * (empty + s - last)  # Σ p(n), n ≥ 1
    first = m - ratio * (empty + m - top * last + s - last)  # Σ n·p(n)
    prefill = d1 - ratio * (second_prompt * empty + d2)  # Σ Δ(n)·p(n), n ≥ 1
    last = last - ratio * before  # p(N)
    past, beyond = _tail_sums(last, top, rate / tail_rps, queue_scale)
    total = empty + z + past
    first = first + beyond
    delta = (empty * first_prompt + prefill + past * last_prompt) / total
    return first / (rate * total) + _own_prefill_s(rate, delta)


def _burst_time_log(
    rate: float, factors: np.ndarray, ratio: float, bursts: Bursts, tail_rps: float, queue_scale: float = 1.0
) -> float:
    """:func:`burst_time_in_system`'s sums in log space, where the running product overflows."""
    log_p = np.cumsum(np.log(factors))
    shift = max(float(_MAX(log_p)), 0.0)
    log_p -= shift
    return float(_burst_sums(rate, np.exp(log_p), math.exp(-shift), ratio, bursts, tail_rps, queue_scale))


def burst_time_in_system_below(
    rates_rps: np.ndarray, bursts: Bursts, tail_rps: float, fits: bool = True, queue_scale: float = 1.0
) -> np.ndarray:
    """:func:`burst_time_in_system` at rates all in (0, ``tail_rps``), one row per rate."""
    lam = np.asarray(rates_rps, dtype=float)
    if not fits:
        return np.array([burst_time_in_system(x, bursts, tail_rps, False, queue_scale) for x in lam.tolist()])
    alone = lam < VANISHING_RPS
    if any_alone := alone.any():  # summed at a rate that stays finite, then set
        lam = np.maximum(lam, VANISHING_RPS)
    ratio = burst_ratio_at(lam, bursts)
    product = _burst_factors(lam[:, None], ratio[:, None], bursts)
    _PRODUCT(product, axis=1, out=product)
    out = _burst_sums(lam, product, 1.0, ratio, bursts, tail_rps, queue_scale)
    if any_alone:
        out[alone] = bursts.alone_s
    return out


def _burst_log_law(rate: float, bursts: Bursts) -> np.ndarray:
    """ln p(n), n = 0..N, of :func:`burst_time_in_system`'s chain, unnormalized (p(0) = 1)."""
    ratio = float(burst_ratio_at(rate, bursts))
    c = _stretched(rate, bursts) * (rate * (1.0 - ratio))
    log_p = np.zeros(c.size + 1)
    log_p[1:] = np.log(c)
    log_p[2:] += np.cumsum(np.log(ratio + c[:-1]))
    return log_p


def burst_law(rate_rps: float, bursts: Bursts, tail_rps: float) -> tuple[np.ndarray, float]:
    """The stationary law of :func:`burst_time_in_system`'s chain: P(n), n = 0..N, and the mass
    of the queue past N (as :func:`stationary_law`)."""
    if not 0.0 < rate_rps < tail_rps:
        raise ValueError(f"a stationary law needs 0 < rate < {tail_rps:g} req/s, got {rate_rps:g}")
    return _law_with_tail(_burst_log_law(rate_rps, bursts), rate_rps / tail_rps)


# --------------------------------------------------------------------------------------------
# A finite test from an empty server
# --------------------------------------------------------------------------------------------
MAX_WINDOW_STEPS = 400_000  # uniformized steps of a window (~8 s); a longer test is taken as stationary
WINDOW_LOG_MASS = 40.0  # states whose stationary weight is below e^-40 of the mode's are left out
WINDOW_RELAXATIONS = 1000.0  # a test this many relaxation times long is taken as stationary,
WARMUP_RELAXATIONS = 10.0  # and so is one whose warm-up lasts this many
# Up to this many states the window is stepped by squaring its transition matrix (log₂ steps
# products of N×N); past it one step at a time.
DENSE_WINDOW_STATES = 640


def mean_time_in_window(
    rate_rps: float,
    cum_log_rates: np.ndarray,
    tail_rps: float,
    duration_s: float,
    warmup_s: float = 0.0,
    bursts: Bursts | None = None,
    queue_scale: float = 1.0,
) -> float:
    """Mean time in system of the requests that arrive in [warmup_s, duration_s) at a server
    that starts empty and gets no arrivals after ``duration_s``: what a load test of that length
    measures. Near the limit the chain relaxes over hours, so a half-hour test sees far less
    than the stationary mean (+inf at the limit, finite in any test).

    The chain's law is stepped forward on its uniformized grid (steps of 1/Λ, Λ = λ + the
    fastest departure rate kept: the law stays a probability; the error is O(1/(Λ·window)),
    3e-5 relative on M/M/∞ over 60 s, 7e-4 over 5 s), the queue past the bound served at
    ``tail_rps``; with ``bursts`` the arrivals below the bound jump as
    :func:`burst_time_in_system`'s do. Started empty, the chain stays stochastically below its
    stationary law, so the states are cut where that law's weight is negligible, or where the
    queue cannot reach within the test. The arrivals of [0, x) spend
    ``∫₀ˣ E[n] dt + E[W(n(x))]`` in the system when arrivals stop at x, W(n) = Σ_{j ≤ n} j/h(j)
    the time n requests take to drain; the window's mean is the difference between
    x = ``duration_s`` and x = ``warmup_s`` over the λ·(duration − warmup) arrivals between
    (exact for FIFO; with the batch sharing its steps the warm-up's requests are slowed by later
    ones, which this charges to neither). Each request waiting past the bound counts
    ``queue_scale`` (:func:`queue_variability`), in the window as in the stationary mean.
    """
    if rate_rps <= 0.0 or not duration_s > warmup_s >= 0.0:
        raise ValueError("a window needs a rate > 0 and 0 <= warmup < duration")
    top = cum_log_rates.size - 1
    if bursts is None:
        ratio = own = 0.0
        h = np.exp(np.diff(cum_log_rates))  # h(1..top)
        log_pi = _STATES[: top + 1] * math.log(rate_rps) - cum_log_rates

        def stationary() -> float:
            return mean_time_in_system(rate_rps, cum_log_rates, tail_rps, queue_scale=queue_scale)
    else:
        ratio = float(burst_ratio_at(rate_rps, bursts))
        h = 1.0 / _stretched(rate_rps, bursts)
        log_pi = _burst_log_law(rate_rps, bursts)
        # The own prefill at the Δ an arrival gets over the stationary law (the test's is near it).
        own = _own_prefill_s(rate_rps, bursts.arrival_prompt_s(np.exp(log_pi - log_pi.max())))

        def stationary() -> float:
            return burst_time_in_system(rate_rps, bursts, tail_rps, queue_scale=queue_scale)

    floor = float(log_pi.max()) - WINDOW_LOG_MASS
    tail = float(tail_rps) if bursts is not None else max(float(tail_rps), float(h[-1]))
    if log_pi[-1] < floor:
        weight = np.exp(log_pi - float(log_pi.max()))
        mean = float(weight @ _STATES[: top + 1]) / float(weight.sum())
        spread = float(weight @ (_STATES[: top + 1] - mean) ** 2) / float(weight.sum())
        # 4·Var(n)/λ bounds the chain's relaxation time (M/M/1: within (1 + √ρ)²/4 of it; M/M/∞:
        # 4×): a warm-up 10 of them long has forgotten the empty start (e^-10), and so has a test
        # 1000 of them long without one (the fill-up is a 0.1 % of it).
        relax = 4.0 * spread / rate_rps
        if warmup_s >= WARMUP_RELAXATIONS * relax or duration_s >= WINDOW_RELAXATIONS * relax:
            return stationary()
        last = int(np.nonzero(log_pi >= floor)[0][-1]) + 2
        rates = np.concatenate(([0.0], h[:last]))
    else:  # the queue past the bound: geometric at λ/tail while stable, and reachable in the test
        reach = 8.0 * math.sqrt(rate_rps * duration_s) + max(rate_rps - tail, 0.0) * duration_s
        if rate_rps < tail:
            reach = min(reach, (float(log_pi[-1]) - floor) / math.log(tail / rate_rps))
        rates = np.concatenate(([0.0], h, np.full(math.ceil(reach) + 16, tail)))
    steps = math.ceil(duration_s * (rate_rps + float(rates.max())))  # the fastest state sets the grid
    if steps > MAX_WINDOW_STEPS:  # hours at hundreds of req/s: seconds of stepping for a test
        return stationary()  # that long is near stationary
    n = _STATES[: rates.size] if rates.size <= _STATES.size else np.arange(rates.size, dtype=float)
    if queue_scale != 1.0 and rates.size > top + 1:  # each waiting past the bound counts f
        n = n.copy()
        n[top + 1 :] -= (1.0 - queue_scale) * (n[top + 1 :] - top)
    drain = np.concatenate(([0.0], np.cumsum(n[1:] / rates[1:])))  # W(n)
    dt = duration_s / steps
    warm_step = round(warmup_s / dt)
    cap = min(top, rates.size - 1)  # bursts land at most on the bound (or the cut)
    up = np.full(rates.size, rate_rps * dt)
    up[-1] = 0.0  # the cut reflects: past it the chain's weight is negligible
    jumps = None
    if ratio > 0.0 and cap > 1:
        up[:cap] = 0.0  # below the bound arrivals come as the bursts' jumps
        jumps = _burst_jumps(rate_rps * (1.0 - ratio) * dt, ratio, cap)
    if rates.size <= DENSE_WINDOW_STATES:
        matrix = np.diag(1.0 - up - rates * dt)
        idx = np.arange(rates.size - 1)
        matrix[idx, idx + 1] = up[:-1]
        matrix[idx + 1, idx] = rates[1:] * dt
        if jumps is not None:
            matrix[:cap, 1 : cap + 1] += jumps
            matrix[idx[:cap], idx[:cap]] -= jumps.sum(axis=1)
        (p_warm, sum_warm), (p_end, sum_end) = _advance(matrix, n, (warm_step, steps))
    else:
        (p_warm, sum_warm), (p_end, sum_end) = _step(up, rates * dt, jumps, n, warm_step, steps)
    # Trapezoids over E[n] at every step; E[n] = 0 at the empty start.
    total_warm = dt * (sum_warm + 0.5 * float(p_warm @ n)) + float(p_warm @ drain)
    total = dt * (sum_end + 0.5 * float(p_end @ n)) + float(p_end @ drain)
    return (total - total_warm) / (rate_rps * (duration_s - warmup_s)) + own


def _burst_jumps(burst_prob: float, ratio: float, cap: int) -> np.ndarray:
    """Probabilities of a step's jump from j < ``cap`` to k = j + 1..``cap``: a burst (of
    probability ``burst_prob``) of geometric size, those past the cap landing on it."""
    j = np.arange(cap)[:, None]
    gap = np.arange(1, cap + 1)[None, :] - j  # k − j
    jumps = np.where(gap >= 1, (1.0 - ratio) * ratio ** np.maximum(gap - 1, 0), 0.0)
    jumps[:, -1] = ratio ** (cap - 1 - j[:, 0])  # P(size ≥ cap − j)
    return burst_prob * jumps


def _advance(matrix: np.ndarray, n: np.ndarray, counts: tuple[int, ...]) -> list[tuple[np.ndarray, float]]:
    """For each count s, the law after s steps from the empty state and Σ_{k<s} E_k[n], by
    squaring: the powers P^(2^j) and Σ_{k<2^j} P^k·n, each count's bits applied as they come
    (the powers commute)."""
    power, mean_sum = matrix, n.copy()  # P^(2^j), Σ_{k<2^j} P^k·n
    out = []
    for count in counts:
        p = np.zeros(n.size)
        p[0] = 1.0
        out.append([p, 0.0, count])
    bit = 1
    while any(count >= bit for *_, count in out):
        for entry in out:
            if entry[2] & bit:
                entry[1] += float(entry[0] @ mean_sum)
                entry[0] = entry[0] @ power
        mean_sum = mean_sum + power @ mean_sum
        power = power @ power
        bit <<= 1
    return [(p, total) for p, total, _ in out]


def _step(
    up: np.ndarray, down: np.ndarray, jumps: np.ndarray | None, n: np.ndarray, warm_step: int, steps: int
) -> list[tuple[np.ndarray, float]]:
    """:func:`_advance` one step at a time, for chains too long to square."""
    stay = 1.0 - up - down
    if jumps is not None:
        stay[: jumps.shape[0]] -= jumps.sum(axis=1)
        cap = jumps.shape[0]
    up, down = up[:-1], down[1:]
    p = np.zeros(n.size)
    p[0] = 1.0
    total = 0.0
    warm = (p, 0.0)
    for k in range(steps):
        if k == warm_step:
            warm = (p, total)
        total += float(p @ n)
        nxt = p * stay
        nxt[1:] += p[:-1] * up
        nxt[:-1] += p[1:] * down
        if jumps is not None:
            nxt[1 : cap + 1] += p[:cap] @ jumps
        p = nxt
    return [warm, (p, total)]
