"""The latency model: request latency with and without speculative decoding at a given load.

Pure numpy, no I/O. See docs/model.md for the equations. In short:

* every engine step of a phase costs ``t(x, z) = a + b·x + Σ_j d_j·max(0, x − k_j) + c·z``
  where ``x`` is the tokens the step processes (batch × tokens per sequence) and ``z`` the KV
  cache it reads (batch × mean context length); the hinge terms are compute knees;
* a request's time in the system at running batch ``B`` is
  ``T(B) = prefill(P) + B·(prefill(P) − a_prefill) + steps · step(B)``, with ``steps = G`` and
  ``step = target(B)`` without SD, ``steps = G / E[N]`` and ``step = γ·draft(B) + verify(B(γ+1))``
  with SD; the second term is the other requests' prefills that stall this one;
* Little's law closes the loop, ``B = λ·T(B)``. ``T`` is piecewise linear in ``B``, so the fixed
  point is solved exactly, segment by segment: ``B = λ·c0 / (1 − λ·c1)``. No root with
  ``B ≤ max_num_seqs`` means the server is overloaded at that rate: reported, never NaN.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike

from controller.acceptance import tokens_per_step

PHASES = ("prefill", "target", "draft", "verify")
DEFAULT_DRAFT_LENGTHS = tuple(range(1, 17))
DEFAULT_THRESHOLDS = (1.0, 1.05, 1.2)


@dataclass(frozen=True)
class StepCost:
    """Cost in seconds of one engine step of one phase.

    ``t(x, z) = intercept_s + slope_s_per_token·x + Σ_j knee_slope_deltas[j]·max(0, x − knees_tokens[j])
    + context_s_per_token·z``: continuous, piecewise linear in the step's tokens ``x``, linear in
    the KV tokens read ``z``.
    """

    intercept_s: float
    slope_s_per_token: float
    knees_tokens: tuple[float, ...] = ()
    knee_slope_deltas: tuple[float, ...] = ()
    context_s_per_token: float = 0.0

    def __post_init__(self) -> None:
        if len(self.knees_tokens) != len(self.knee_slope_deltas):
            raise ValueError("knees_tokens and knee_slope_deltas must have the same length")

    def __call__(self, tokens: ArrayLike, context_tokens: ArrayLike = 0.0) -> np.ndarray:
        x = np.asarray(tokens, dtype=float)
        t = self.intercept_s + self.slope_s_per_token * x
        for knee, delta in zip(self.knees_tokens, self.knee_slope_deltas, strict=True):
            t = t + delta * np.maximum(0.0, x - knee)
        return t + self.context_s_per_token * np.asarray(context_tokens, dtype=float)

    def scalar(self, tokens: float, context_tokens: float = 0.0) -> float:
        """Same as calling it, on plain floats (the fast path)."""
        t = self.intercept_s + self.slope_s_per_token * tokens
        for knee, delta in zip(self.knees_tokens, self.knee_slope_deltas, strict=True):
            if tokens > knee:
                t += delta * (tokens - knee)
        return t + self.context_s_per_token * context_tokens

    def scaled(self, factor: float) -> StepCost:
        return StepCost(
            self.intercept_s * factor,
            self.slope_s_per_token * factor,
            self.knees_tokens,
            tuple(d * factor for d in self.knee_slope_deltas),
            self.context_s_per_token * factor,
        )


ZERO_COST = StepCost(0.0, 0.0)


@dataclass(frozen=True)
class Moe:
    """Mixture-of-experts target: weight traffic follows the distinct experts a step touches."""

    num_experts: int
    top_k: int

    def __post_init__(self) -> None:
        if not (1 <= self.top_k <= self.num_experts):
            raise ValueError("MoE needs 1 <= top_k <= num_experts")

    def effective_tokens(self, tokens: ArrayLike) -> np.ndarray:
        """Tokens-equivalent weight traffic: (E/k)·(1 − (1 − k/E)^x).

        E·(1 − (1 − k/E)^x) distinct experts are read for x tokens; dividing by k makes it equal
        to x for a single token, so the fitted per-token slope keeps its meaning.
        """
        x = np.asarray(tokens, dtype=float)
        e, k = float(self.num_experts), float(self.top_k)
        if k == e:  # every token touches every expert: constant traffic
            return np.where(x > 0, 1.0, 0.0)
        return (e / k) * (1.0 - (1.0 - k / e) ** x)


@dataclass(frozen=True)
class LatencyModel:
    """Calibrated step costs plus the serving limits the fixed point needs."""

    prefill: StepCost
    target: StepCost
    verify: StepCost
    draft: StepCost = ZERO_COST
    max_num_seqs: int = 256
    # vLLM's per-step token budget (max_num_batched_tokens): decode/verify tokens of the batch
    # plus chunked-prefill tokens. Verify steps take γ+1 of it per sequence, leaving less for
    # admitting new prompts. None: no budget (prefill never starves).
    max_num_batched_tokens: int | None = None
    moe: Moe | None = None
    # Load-test correction: multiplies every step cost of that mode (1.0 = micro-benchmark as is).
    scale_off: float = 1.0
    scale_on: float = 1.0


@dataclass(frozen=True)
class Workload:
    """Mean request shape: prompt tokens P and generated tokens G."""

    prompt_tokens: float
    gen_tokens: float

    @property
    def mean_context_tokens(self) -> float:
        # A sequence's context grows from P to P + G while it decodes.
        return self.prompt_tokens + self.gen_tokens / 2.0


# --------------------------------------------------------------------------------------------
# Linearization: T(B) = c0 + c1·B + Σ_h w_h·max(0, B − β_h) (+ MoE terms, then not linear)
# --------------------------------------------------------------------------------------------


@dataclass
class _Mode:
    """T(B) of one mode for every element; arrays broadcast to one shape."""

    c0: np.ndarray
    c1: np.ndarray
    hinge_at: list[np.ndarray] = field(default_factory=list)
    hinge_w: list[np.ndarray] = field(default_factory=list)
    # MoE weight-traffic terms: coef·effective_tokens(B·tokens_per_seq)
    moe_coef: list[np.ndarray] = field(default_factory=list)
    moe_tps: list[np.ndarray] = field(default_factory=list)
    # For the token budget: T(B) = pre_c0 + pre_c1·B + steps·step(B), step tokens per sequence.
    pre_c0: np.ndarray | float = 0.0
    pre_c1: np.ndarray | float = 0.0
    steps: np.ndarray | float = 1.0
    step_tokens: np.ndarray | float = 1.0

    def shape(self) -> tuple[int, ...]:
        parts = [self.c0, self.c1, *self.hinge_at, *self.hinge_w, *self.moe_coef, *self.moe_tps]
        return np.broadcast_shapes(*(np.shape(v) for v in parts))

    def latency(self, batch, moe: Moe | None):
        t = self.c0 + self.c1 * batch
        for at, w in zip(self.hinge_at, self.hinge_w, strict=True):
            t = t + w * np.maximum(0.0, batch - at)
        if moe is not None:
            for coef, tps in zip(self.moe_coef, self.moe_tps, strict=True):
                t = t + coef * moe.effective_tokens(batch * tps)
        return t


def _add_phase(
    mode: _Mode, cost: StepCost, mult: np.ndarray, tps: np.ndarray, ctx: np.ndarray, moe: Moe | None
) -> None:
    """Add ``mult`` steps of ``cost`` at ``tps`` tokens per sequence to T(B)."""
    mode.c0 = mode.c0 + mult * cost.intercept_s
    mode.c1 = mode.c1 + mult * cost.context_s_per_token * ctx
    if moe is None:
        mode.c1 = mode.c1 + mult * cost.slope_s_per_token * tps
    else:
        mode.moe_coef.append(mult * cost.slope_s_per_token)
        mode.moe_tps.append(tps)
    for knee, delta in zip(cost.knees_tokens, cost.knee_slope_deltas, strict=True):
        # max(0, B·m − k) = m·max(0, B − k/m)
        mode.hinge_at.append(knee / tps)
        mode.hinge_w.append(mult * delta * tps)


def _relu(v):
    return np.maximum(0.0, v) if isinstance(v, np.ndarray) else (v if v > 0.0 else 0.0)


def _step(cost: StepCost, tokens, context_tokens):
    """Step cost on floats or arrays (the scalar path must not pay numpy's per-call overhead)."""
    t = cost.intercept_s + cost.slope_s_per_token * tokens + cost.context_s_per_token * context_tokens
    for knee, delta in zip(cost.knees_tokens, cost.knee_slope_deltas, strict=True):
        t = t + delta * _relu(tokens - knee)
    return t


def _linearize(model: LatencyModel, workload: Workload, sd: bool, accepted_length, draft_length) -> _Mode:
    """T(B) for one mode. Inputs are floats (scalar path) or broadcastable arrays."""
    p, g = workload.prompt_tokens, workload.gen_tokens
    ctx = p + g / 2.0
    scale = model.scale_on if sd else model.scale_off
    moe = model.moe
    prefill = model.prefill.scaled(scale) if scale != 1.0 else model.prefill
    own_prefill = _step(prefill, prefill_tokens(p, moe) if moe else p, p)
    # Another request's prefill stalls every running sequence by its marginal (load) cost.
    interference = own_prefill - prefill.intercept_s
    mode = _Mode(c0=own_prefill, c1=interference, pre_c0=own_prefill, pre_c1=interference)
    if not sd:
        target = model.target.scaled(scale) if scale != 1.0 else model.target
        _add_phase(mode, target, g, 1.0, ctx, moe)
        mode.steps, mode.step_tokens = g, 1.0
        return mode
    steps = g / accepted_length
    draft, verify = model.draft, model.verify
    if scale != 1.0:
        draft, verify = draft.scaled(scale), verify.scaled(scale)
    _add_phase(mode, draft, steps * draft_length, 1.0, ctx, None)
    _add_phase(mode, verify, steps, draft_length + 1.0, ctx, moe)
    mode.steps, mode.step_tokens = steps, draft_length + 1.0
    return mode


def _budget_root(mode: _Mode, c0, c1, budget: float, prompt_tokens):
    """Rate at which the token budget binds on a segment T = c0 + c1·B (inf: never there).

    Admitting λ prompts of P tokens per second needs λ·P·t_step(B) prefill tokens per step
    interval, and only N_b − k·B of each step's budget is left once the batch's k tokens per
    sequence are in. With B = λ·c0/(1 − λ·c1) this is a quadratic in λ:
    A·λ² + Bq·λ − N_b = 0, A = (P/steps)(a1·c0 − a0·c1), Bq = (P/steps)·a0 + k·c0 + N_b·c1,
    where t_step = (a0 + a1·B)/steps strips the prefill terms from T.
    """
    a0 = c0 - mode.pre_c0
    a1 = c1 - mode.pre_c1
    p_over = prompt_tokens / mode.steps
    qa = p_over * (a1 * c0 - a0 * c1)
    qb = p_over * a0 + mode.step_tokens * c0 + budget * c1
    disc = qb * qb + 4.0 * qa * budget
    if isinstance(qa, np.ndarray) or isinstance(qb, np.ndarray):
        with np.errstate(divide="ignore", invalid="ignore"):
            root = np.where(
                np.abs(qa) < 1e-300,
                budget / np.where(qb > 0, qb, np.nan),
                (-qb + np.sqrt(np.maximum(disc, 0.0))) / (2.0 * np.where(qa == 0, 1.0, qa)),
            )
        return np.where((disc >= 0) & np.isfinite(root) & (root > 0), root, np.inf)
    if abs(qa) < 1e-300:
        return budget / qb if qb > 0 else math.inf
    if disc < 0:
        return math.inf
    root = (-qb + math.sqrt(disc)) / (2.0 * qa)
    return root if root > 0 else math.inf


def prefill_tokens(prompt_tokens: ArrayLike, moe: Moe | None) -> np.ndarray:
    """Weight-traffic tokens of one prompt's prefill (MoE-aware)."""
    return moe.effective_tokens(prompt_tokens) if moe else np.asarray(prompt_tokens, dtype=float)


# --------------------------------------------------------------------------------------------
# Fixed point B = λ·T(B)
# --------------------------------------------------------------------------------------------


def _segments(mode: _Mode) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per element: segment start, end, intercept and slope of T(B), in increasing B."""
    shape = mode.shape()
    c0, c1 = np.broadcast_to(mode.c0, shape), np.broadcast_to(mode.c1, shape)
    if not mode.hinge_at:
        inf = np.full((*shape, 1), np.inf)
        return np.zeros((*shape, 1)), inf, c0[..., None], c1[..., None]
    at = np.stack([np.broadcast_to(a, shape) for a in mode.hinge_at], axis=-1)
    w = np.stack([np.broadcast_to(x, shape) for x in mode.hinge_w], axis=-1)
    order = np.argsort(at, axis=-1)
    at = np.take_along_axis(at, order, axis=-1)
    w = np.take_along_axis(w, order, axis=-1)
    slopes = np.concatenate([c1[..., None], c1[..., None] + np.cumsum(w, axis=-1)], axis=-1)
    intercepts = np.concatenate([c0[..., None], c0[..., None] - np.cumsum(w * at, axis=-1)], axis=-1)
    starts = np.concatenate([np.zeros((*shape, 1)), at], axis=-1)
    ends = np.concatenate([at, np.full((*shape, 1), np.inf)], axis=-1)
    return starts, ends, intercepts, slopes


@dataclass(frozen=True)
class ModePrediction:
    """One mode (SD on or off) at each rate. Overloaded entries have latency_s = +inf."""

    latency_s: np.ndarray
    batch: np.ndarray
    overloaded: np.ndarray
    stability_limit_rps: np.ndarray


def _stability_limit(mode: _Mode, cap: float, moe: Moe | None) -> np.ndarray:
    """Largest sustainable rate: max over B ≤ cap of the throughput B / T(B).

    Between knees B/T(B) is monotone (its derivative has the sign of the segment intercept), so
    the maximum sits at a knee or at the cap. With MoE terms it is searched on a grid instead.
    """
    c0 = np.broadcast_to(mode.c0, mode.shape())
    grid = np.linspace(0.0, cap, 513)[1:] if moe is not None and mode.moe_coef else np.array([cap], dtype=float)
    candidates = [np.broadcast_to(grid, c0.shape + grid.shape)]
    for at in mode.hinge_at:
        a = np.broadcast_to(at, c0.shape)[..., None]
        candidates.append(np.where((a > 0) & (a < cap), a, cap))
    b = np.concatenate(candidates, axis=-1)
    t = _latency_expanded(mode, b, moe)
    with np.errstate(divide="ignore", invalid="ignore"):
        throughput = np.where(t > 0, b / t, np.inf)
    return throughput.max(axis=-1)


def _latency_expanded(mode: _Mode, batch: np.ndarray, moe: Moe | None) -> np.ndarray:
    """T at a trailing axis of batch values (coefficients broadcast over it)."""
    expanded = _Mode(
        c0=np.asarray(mode.c0)[..., None],
        c1=np.asarray(mode.c1)[..., None],
        hinge_at=[np.asarray(a)[..., None] for a in mode.hinge_at],
        hinge_w=[np.asarray(w)[..., None] for w in mode.hinge_w],
        moe_coef=[np.asarray(c)[..., None] for c in mode.moe_coef],
        moe_tps=[np.asarray(t)[..., None] for t in mode.moe_tps],
    )
    return expanded.latency(batch, moe)


def _solve(
    mode: _Mode, rate: np.ndarray, cap: float, moe: Moe | None, budget: float | None = None, prompt_tokens=0.0
) -> ModePrediction:
    limit = _stability_limit(mode, cap, moe)
    rate, limit = np.broadcast_arrays(rate, limit)

    def batch_at(r: np.ndarray) -> np.ndarray:
        if moe is not None and mode.moe_coef:
            return _solve_numeric(mode, r, cap, moe)
        return _solve_closed_form(mode, r)

    batch = batch_at(rate)
    if budget is not None and np.any(np.asarray(prompt_tokens) > 0):
        if moe is not None and mode.moe_coef:
            b_limit = _budget_limit(mode, limit, batch_at, float(budget), prompt_tokens, moe)
        else:
            b_limit = _budget_limit_closed_form(mode, float(budget), prompt_tokens)
        limit = np.minimum(limit, b_limit)
    # At the limit the queue is null-recurrent: call it overloaded, like ρ = 1 in queueing.
    overloaded = (rate >= limit * (1.0 - 1e-12)) | ~np.isfinite(batch) | (batch > cap)
    safe_batch = np.where(overloaded, cap, batch)
    latency = np.where(overloaded, np.inf, mode.latency(safe_batch, moe))
    return ModePrediction(latency, safe_batch, overloaded, limit)


def _budget_limit(
    mode: _Mode, limit: np.ndarray, batch_at, budget: float, prompt_tokens, moe: Moe | None
) -> np.ndarray:
    """Rate where prefill starves under the token budget, by bisection below the stability limit.

    The excess λ·P·t_step(B(λ)) + k·B(λ) − N_b rises with λ (B and the step time both grow),
    so it crosses zero at most once. (The scalar path solves the same point in closed form.)
    """

    def excess(r: np.ndarray) -> np.ndarray:
        b = batch_at(r)
        b = np.where(np.isfinite(b), b, 0.0)
        t_step = (mode.latency(b, moe) - mode.pre_c0 - mode.pre_c1 * b) / mode.steps
        return r * prompt_tokens * t_step + mode.step_tokens * b - budget

    hi = np.asarray(limit, dtype=float) * (1.0 - 1e-12)
    binds = excess(hi) > 0
    lo = np.zeros_like(hi)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        over = excess(mid) > 0
        lo = np.where(over, lo, mid)
        hi = np.where(over, mid, hi)
    return np.where(binds, 0.5 * (lo + hi), np.inf)


def _budget_limit_closed_form(mode: _Mode, budget: float, prompt_tokens) -> np.ndarray:
    """:func:`_budget_root` on every segment at once; the lowest root whose batch lies on its
    own segment is where prefill starves."""
    starts, ends, intercepts, slopes = _segments(mode)
    ex = _Mode(
        c0=intercepts,
        c1=slopes,
        pre_c0=np.asarray(mode.pre_c0)[..., None],
        pre_c1=np.asarray(mode.pre_c1)[..., None],
        steps=np.asarray(mode.steps)[..., None],
        step_tokens=np.asarray(mode.step_tokens)[..., None],
    )
    root = _budget_root(ex, intercepts, slopes, budget, np.asarray(prompt_tokens, dtype=float)[..., None])
    root = np.asarray(root) * np.ones_like(intercepts)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        denom = 1.0 - root * slopes
        b = np.where(denom > 0, root * intercepts / np.where(denom > 0, denom, 1.0), np.inf)
    tol = 1e-9 * np.maximum(1.0, np.abs(b))
    valid = np.isfinite(root) & (denom > 0) & (b >= starts - tol) & (b <= ends + tol)
    return np.where(valid, root, np.inf).min(axis=-1)


def _solve_closed_form(mode: _Mode, rate: np.ndarray) -> np.ndarray:
    """Smallest B with B = λ·(c0_s + c1_s·B) on its own segment s; +inf when there is none."""
    starts, ends, intercepts, slopes = _segments(mode)
    lam = rate[..., None]
    denom = 1.0 - lam * slopes
    with np.errstate(divide="ignore", invalid="ignore"):
        root = np.where(denom > 0, lam * intercepts / np.where(denom > 0, denom, 1.0), np.inf)
    tol = 1e-12 * np.maximum(1.0, np.abs(root))
    valid = (denom > 0) & (root >= starts - tol) & (root <= ends + tol)
    first = np.argmax(valid, axis=-1)[..., None]
    batch = np.take_along_axis(root, first, axis=-1)[..., 0]
    return np.where(valid.any(axis=-1), batch, np.inf)


def _solve_numeric(mode: _Mode, rate: np.ndarray, cap: float, moe: Moe) -> np.ndarray:
    """First root of λ·T(B) − B on [0, cap] by grid bracketing then bisection (MoE only)."""
    grid = np.linspace(0.0, cap, 257)
    t = _latency_expanded(mode, np.broadcast_to(grid, rate.shape + grid.shape), moe)
    f = rate[..., None] * t - grid
    crossed = f <= 0
    has_root = crossed.any(axis=-1)
    idx = np.maximum(np.argmax(crossed, axis=-1), 1)
    lo = grid[idx - 1]
    hi = grid[idx]
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        above = rate * mode.latency(mid, moe) - mid > 0
        lo = np.where(above, mid, lo)
        hi = np.where(above, hi, mid)
    return np.where(has_root, 0.5 * (lo + hi), np.inf)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    """Both modes at each (rate, acceptance, draft length); ``speedup`` = T_off / T_on.

    When a mode is overloaded its latency is +inf; then speedup is 0 when SD is overloaded and
    has the smaller capacity, +inf when only SD keeps up, and μ_on / μ_off (> 1) when both are
    overloaded but SD falls behind no faster. So S never rises with load past SD's limit.
    """

    off: ModePrediction
    on: ModePrediction
    speedup: np.ndarray
    accepted_length: np.ndarray


def predict(
    model: LatencyModel,
    rate_rps: ArrayLike,
    alpha: ArrayLike,
    draft_length: ArrayLike,
    workload: Workload,
    accepted_length: ArrayLike | None = None,
) -> Prediction:
    """Latency with and without SD, vectorized over broadcastable arrays.

    ``alpha`` is the per-token acceptance (see :mod:`controller.acceptance`); pass
    ``accepted_length`` (E[N], e.g. from per-position counters) to use a measured value
    instead of the geometric one. ``draft_length`` 0 means no drafting: then SD is the plain
    target step and speedup is exactly 1.
    """
    rate = np.asarray(rate_rps, dtype=float)
    if np.any(rate < 0) or not np.all(np.isfinite(rate)):
        raise ValueError("arrival rate must be finite and >= 0")
    gamma = np.asarray(draft_length, dtype=float)
    en = tokens_per_step(alpha, gamma) if accepted_length is None else np.asarray(accepted_length, dtype=float)
    en = np.clip(en, 1.0, gamma + 1.0)
    rate, gamma, en = np.broadcast_arrays(rate, gamma, en)
    cap = float(model.max_num_seqs)
    nb, p = model.max_num_batched_tokens, workload.prompt_tokens
    off = _solve(_linearize(model, workload, False, en, gamma), rate, cap, model.moe, nb, p)
    on_sd = _solve(_linearize(model, workload, True, en, np.maximum(gamma, 1.0)), rate, cap, model.moe, nb, p)
    no_draft = gamma <= 0
    on = ModePrediction(*(np.where(no_draft, a, b) for a, b in zip(_fields(off), _fields(on_sd), strict=True)))
    return Prediction(off, on, _speedup(off, on), en)


def _fields(m: ModePrediction) -> tuple[np.ndarray, ...]:
    return (m.latency_s, m.batch, m.overloaded, m.stability_limit_rps)


def _speedup(off: ModePrediction, on: ModePrediction) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        both_stable = off.latency_s / np.where(on.overloaded, 1.0, on.latency_s)
        capacity_ratio = on.stability_limit_rps / off.stability_limit_rps
    return np.select(
        [off.overloaded & on.overloaded & (capacity_ratio >= 1), on.overloaded, off.overloaded],
        [capacity_ratio, 0.0, np.inf],
        both_stable,
    )


@dataclass(frozen=True)
class RateCurve:
    """T as a function of the arrival rate for one mode, exact and scalar (no numpy).

    On the rates where the fixed point sits on batch segment s, T(λ) = c0_s / (1 − λ·c1_s).
    ``segments`` holds (λ_end, c0_s, c1_s) in increasing λ; the last λ_end is the stability
    limit. A segment on which throughput B/T(B) falls is never where the *smallest* root lives,
    so it is skipped.
    """

    segments: tuple[tuple[float, float, float], ...]

    @property
    def stability_limit_rps(self) -> float:
        return self.segments[-1][0]

    def coefficients(self, rate_rps: float) -> tuple[float, float] | None:
        """(c0, c1) of the segment in force at this rate; None when overloaded."""
        if rate_rps >= self.stability_limit_rps * (1.0 - 1e-12):
            return None
        for end, c0, c1 in self.segments:
            if rate_rps <= end:
                return c0, c1
        return None  # pragma: no cover - guarded by the limit check

    def latency_s(self, rate_rps: float) -> float:
        """Time in system at this rate; +inf when overloaded."""
        c = self.coefficients(rate_rps)
        return math.inf if c is None else c[0] / (1.0 - rate_rps * c[1])

    def batch(self, rate_rps: float, cap: float) -> float:
        t = self.latency_s(rate_rps)
        return cap if math.isinf(t) else rate_rps * t


def rate_curve(mode: _Mode, cap: float, budget: float | None = None, prompt_tokens: float = 0.0) -> RateCurve:
    """Build the exact T(λ) of a scalar (float) linearized mode without MoE terms.

    With a token ``budget`` the curve ends where prefill starves (see :func:`_budget_root`).
    """
    curve = _rate_curve(mode, cap)
    if budget is None or prompt_tokens <= 0:
        return curve
    kept: list[tuple[float, float, float]] = []
    lo = 0.0
    for end, c0, c1 in curve.segments:
        root = _budget_root(mode, c0, c1, float(budget), prompt_tokens)
        if lo <= root < end:
            kept.append((root, c0, c1))
            break
        kept.append((end, c0, c1))
        lo = end
    return RateCurve(tuple(kept))


def _rate_curve(mode: _Mode, cap: float) -> RateCurve:
    c0, c1 = float(mode.c0), float(mode.c1)
    if not mode.hinge_at:  # one line: the limit is the throughput at the cap
        return RateCurve(((cap / (c0 + c1 * cap), c0, c1),))
    hinges = sorted(zip(mode.hinge_at, mode.hinge_w, strict=True))
    segments: list[tuple[float, float, float]] = []
    best = 0.0  # highest throughput B/T(B) reached so far: the rates already covered
    start = 0.0
    for at, w in [*hinges, (math.inf, 0.0)]:
        end = min(at, cap)
        if end > start:
            t_end = c0 + c1 * end
            throughput = end / t_end if t_end > 0 else math.inf
            if throughput > best:
                segments.append((throughput, c0, c1))
                best = throughput
        if at >= cap:
            break
        start = max(start, at)
        c1 += w
        c0 -= w * at
    if not segments:  # degenerate: zero cap
        segments.append((0.0, c0, c1))
    return RateCurve(tuple(segments))


@dataclass(frozen=True)
class PointPrediction:
    """Both modes at one (rate, acceptance, draft length), plain floats."""

    rate_rps: float
    draft_length: int
    accepted_length: float
    latency_off_s: float
    latency_on_s: float
    batch_off: float
    batch_on: float
    stability_limit_off_rps: float
    stability_limit_on_rps: float
    speedup: float

    @property
    def overloaded_off(self) -> bool:
        return math.isinf(self.latency_off_s)

    @property
    def overloaded_on(self) -> bool:
        return math.isinf(self.latency_on_s)


def _accepted_length(alpha: float, draft_length: int) -> float:
    """E[N] on floats, same numerics as :func:`controller.acceptance.tokens_per_step`."""
    if alpha >= 1.0 - 1e-15:
        return draft_length + 1.0
    if alpha <= 0.0:
        return 1.0
    log_a = math.log(alpha)
    return math.expm1((draft_length + 1) * log_a) / math.expm1(log_a)


def curves(
    model: LatencyModel,
    alpha: float,
    draft_length: int,
    workload: Workload,
    accepted_length: float | None = None,
) -> tuple[RateCurve, RateCurve]:
    """(without SD, with SD) exact rate curves; not available for MoE models."""
    if model.moe is not None:
        raise ValueError("rate curves are exact only without MoE; use predict()")
    cap = float(model.max_num_seqs)
    en = _accepted_length(alpha, draft_length) if accepted_length is None else accepted_length
    en = min(max(en, 1.0), draft_length + 1.0)
    nb, p = model.max_num_batched_tokens, float(workload.prompt_tokens)
    off = rate_curve(_linearize(model, workload, False, en, draft_length), cap, nb, p)
    if draft_length <= 0:
        return off, off
    return off, rate_curve(_linearize(model, workload, True, en, float(draft_length)), cap, nb, p)


def _speedup_from(t_off: float, t_on: float, mu_off: float, mu_on: float) -> float:
    if math.isinf(t_off) and math.isinf(t_on) and mu_on >= mu_off:
        return mu_on / mu_off
    if math.isinf(t_on):
        return 0.0
    if math.isinf(t_off):
        return math.inf
    return t_off / t_on


def predict_point(
    model: LatencyModel,
    rate_rps: float,
    alpha: float,
    draft_length: int,
    workload: Workload,
    accepted_length: float | None = None,
) -> PointPrediction:
    """:func:`predict` for one point, in pure Python (about 10 µs); agrees with it exactly."""
    if rate_rps < 0 or not math.isfinite(rate_rps):
        raise ValueError("arrival rate must be finite and >= 0")
    if model.moe is not None:
        p = predict(model, rate_rps, alpha, draft_length, workload, accepted_length)
        return PointPrediction(
            float(rate_rps), int(draft_length), float(p.accepted_length),
            float(p.off.latency_s), float(p.on.latency_s), float(p.off.batch), float(p.on.batch),
            float(p.off.stability_limit_rps), float(p.on.stability_limit_rps), float(p.speedup),
        )  # fmt: skip
    off, on = curves(model, alpha, draft_length, workload, accepted_length)
    cap = float(model.max_num_seqs)
    en = _accepted_length(alpha, draft_length) if accepted_length is None else accepted_length
    t_off, t_on = off.latency_s(rate_rps), on.latency_s(rate_rps)
    return PointPrediction(
        float(rate_rps),
        int(draft_length),
        float(min(max(en, 1.0), draft_length + 1.0)),
        t_off,
        t_on,
        off.batch(rate_rps, cap),
        on.batch(rate_rps, cap),
        off.stability_limit_rps,
        on.stability_limit_rps,
        _speedup_from(t_off, t_on, off.stability_limit_rps, on.stability_limit_rps),
    )


def speedup_point(model: LatencyModel, rate_rps: float, alpha: float, draft_length: int, workload: Workload) -> float:
    """Scalar speedup T_off / T_on at one point (see :class:`Prediction` for overload)."""
    if model.moe is not None:
        return predict_point(model, rate_rps, alpha, draft_length, workload).speedup
    off, on = curves(model, alpha, draft_length, workload)
    return _speedup_from(
        off.latency_s(rate_rps),
        on.latency_s(rate_rps),
        off.stability_limit_rps,
        on.stability_limit_rps,
    )


# --------------------------------------------------------------------------------------------
# Break-even rates, best draft length, stability limits
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BreakEven:
    """Where the speedup falls below ``threshold`` as the rate rises.

    ``rate_rps`` is the lowest such rate: 0.0 when SD is below the threshold even at zero load,
    ``None`` (with ``always_above``) when it stays above at every rate up to the point where
    plain decoding itself saturates.
    """

    threshold: float
    rate_rps: float | None
    always_above: bool


def break_even_rates(
    model: LatencyModel,
    alpha: float,
    draft_length: int,
    workload: Workload,
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    accepted_length: float | None = None,
) -> dict[float, BreakEven]:
    """Lowest rate at which the speedup drops below each threshold.

    Exact: on each interval where both modes sit on one linear segment, S(λ) is a ratio of
    c0/(1 − λ·c1) terms, so S(λ) = s is a linear equation in λ. MoE models use a grid search.
    """
    if model.moe is not None:
        return _break_even_grid(model, alpha, draft_length, workload, thresholds, accepted_length)
    off, on = curves(model, alpha, draft_length, workload, accepted_length)
    mu_off, mu_on = off.stability_limit_rps, on.stability_limit_rps
    # Merge the breakpoints of both curves up to the first overload.
    stop = min(mu_off, mu_on)
    edges = sorted({e for e, _, _ in (*off.segments, *on.segments) if e < stop} | {stop})
    result: dict[float, BreakEven] = {}
    for th in (float(t) for t in thresholds):
        result[th] = _first_crossing(off, on, edges, th, mu_off, mu_on)
    return result


def _first_crossing(
    off: RateCurve, on: RateCurve, edges: list[float], s: float, mu_off: float, mu_on: float
) -> BreakEven:
    if _speedup_from(off.latency_s(0.0), on.latency_s(0.0), mu_off, mu_on) < s:
        return BreakEven(s, 0.0, False)
    lo = 0.0
    for hi in edges:
        mid = 0.5 * (lo + hi)
        (c0o, c1o), (c0s, c1s) = off.coefficients(mid), on.coefficients(mid)  # type: ignore[misc]
        # c0o/(1 − λc1o) = s·c0s/(1 − λc1s)  ⇔  λ·(s·c0s·c1o − c0o·c1s) = s·c0s − c0o
        denom = s * c0s * c1o - c0o * c1s
        s_hi = c0o * (1.0 - hi * c1s) / (c0s * (1.0 - hi * c1o)) if hi * c1o < 1.0 else math.inf
        if s_hi < s and denom != 0.0:
            root = (s * c0s - c0o) / denom
            return BreakEven(s, float(min(max(root, lo), hi)), False)
        lo = hi
    # Past the first overload: SD overloaded first -> S drops to 0 there; otherwise S = inf.
    if mu_on <= mu_off:
        return BreakEven(s, float(mu_on), False)
    return BreakEven(s, None, True)


def _break_even_grid(
    model: LatencyModel,
    alpha: float,
    draft_length: int,
    workload: Workload,
    thresholds: Sequence[float],
    accepted_length: float | None,
) -> dict[float, BreakEven]:
    zero = predict(model, 0.0, alpha, draft_length, workload, accepted_length)
    top = float(max(zero.off.stability_limit_rps, zero.on.stability_limit_rps))
    result: dict[float, BreakEven] = {}
    for th in (float(t) for t in thresholds):
        if float(zero.speedup) < th:
            result[th] = BreakEven(th, 0.0, False)
            continue
        lo, hi, found = 0.0, top, False
        for _ in range(5):  # each round narrows the bracket 200-fold
            rates = np.linspace(lo, hi, 201)[1:]
            below = predict(model, rates, alpha, draft_length, workload, accepted_length).speedup < th
            if not below.any():
                break
            found = True
            i = int(np.argmax(below))
            lo, hi = (rates[i - 1] if i > 0 else lo), rates[i]
        result[th] = BreakEven(th, 0.5 * (lo + hi), False) if found else BreakEven(th, None, True)
    return result


@dataclass(frozen=True)
class DraftChoice:
    """The draft length with the lowest SD latency at one rate, and what it buys."""

    draft_length: int
    speedup: float
    latency_on_s: float


def best_draft_length(
    model: LatencyModel,
    rate_rps: float,
    alpha: float,
    workload: Workload,
    candidates: Iterable[int] = DEFAULT_DRAFT_LENGTHS,
) -> DraftChoice:
    """Best γ from ``candidates`` at this rate and per-token acceptance (ties: the shorter).

    Lowest SD latency wins; if SD is overloaded at every γ, the best capacity ratio does.
    """
    gammas = sorted({int(c) for c in candidates})
    if not gammas or gammas[0] < 1:
        raise ValueError("draft length candidates must be integers >= 1")
    points = [predict_point(model, rate_rps, alpha, g, workload) for g in gammas]
    stable = [p for p in points if not p.overloaded_on]
    best = min(stable, key=lambda p: p.latency_on_s) if stable else max(points, key=lambda p: p.speedup)
    return DraftChoice(best.draft_length, best.speedup, best.latency_on_s)


def throughput_at_batch(
    model: LatencyModel,
    batch: float,
    sd: bool,
    alpha: float,
    draft_length: int,
    workload: Workload,
    accepted_length: float | None = None,
) -> float:
    """Requests per second a mode completes with ``batch`` requests running: B / T(B).

    Past a compute knee this *falls* with the batch, and with a token budget the batch's own
    decode/verify tokens leave less room to admit prompts (γ+1 per sequence with SD), so a
    server pushed to a full batch (the backlog after a restart) can drain slower than its
    stability limit suggests, or not at all.
    """
    if batch <= 0:
        return 0.0
    en = _accepted_length(alpha, draft_length) if accepted_length is None else accepted_length
    en = min(max(en, 1.0), draft_length + 1.0)
    mode = _linearize(model, workload, sd and draft_length > 0, en, float(max(draft_length, 1)))
    t = float(np.asarray(mode.latency(float(batch), model.moe)))
    completed = batch / t if t > 0 else math.inf
    if model.max_num_batched_tokens is None or workload.prompt_tokens <= 0:
        return completed
    # New prompts only get what the batch's own tokens leave of each step's budget.
    t_step = (t - float(mode.pre_c0) - float(mode.pre_c1) * batch) / float(mode.steps)
    left = model.max_num_batched_tokens - float(mode.step_tokens) * batch
    admitted = max(left, 0.0) / (workload.prompt_tokens * t_step) if t_step > 0 else math.inf
    return min(completed, admitted)


def stability_limits(model: LatencyModel, alpha: float, draft_length: int, workload: Workload) -> tuple[float, float]:
    """(limit without SD, limit with SD) in requests per second."""
    p = predict_point(model, 0.0, alpha, draft_length, workload)
    return p.stability_limit_off_rps, p.stability_limit_on_rps
