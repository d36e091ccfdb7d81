"""Workloads for the simulator: traces over time, length distributions, request classes.

Everything here is a pydantic model (scenario files are validated against it) with a
vectorized ``evaluate``/``sample`` so the engine can draw a whole block of arrivals at once.
Times are seconds since the scenario started.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --------------------------------------------------------------------------------------------
# Traces: value(t) for arrival rates (req/s) and per-token acceptance α
# --------------------------------------------------------------------------------------------


class Constant(_Strict):
    """The same value all the time."""

    kind: Literal["constant"]
    value: float = Field(ge=0)

    def evaluate(self, t: np.ndarray) -> np.ndarray:
        return np.full(np.shape(t), self.value, dtype=float)


class Diurnal(_Strict):
    """A cosine day: ``min`` at ``peak_at_s ± period_s/2``, ``max`` at ``peak_at_s``."""

    kind: Literal["diurnal"]
    min: float = Field(ge=0)
    max: float = Field(ge=0)
    period_s: float = Field(86400.0, gt=0)
    peak_at_s: float = 14 * 3600.0

    def evaluate(self, t: np.ndarray) -> np.ndarray:
        phase = 2.0 * math.pi * (np.asarray(t, dtype=float) - self.peak_at_s) / self.period_s
        return self.min + (self.max - self.min) * 0.5 * (1.0 + np.cos(phase))


class Oscillating(_Strict):
    """A sine wave ``mean + amplitude·sin(2π t / period_s)`` (clipped at 0)."""

    kind: Literal["oscillating"]
    mean: float = Field(ge=0)
    amplitude: float = Field(ge=0)
    period_s: float = Field(gt=0)

    def evaluate(self, t: np.ndarray) -> np.ndarray:
        v = self.mean + self.amplitude * np.sin(2.0 * math.pi * np.asarray(t, dtype=float) / self.period_s)
        return np.maximum(v, 0.0)


class StepPoint(_Strict):
    at_s: float = Field(ge=0)
    value: float = Field(ge=0)


class Steps(_Strict):
    """Piecewise constant: ``initial`` until the first step, then each step's value."""

    kind: Literal["steps"]
    initial: float = Field(ge=0)
    steps: list[StepPoint] = Field(min_length=1)

    def evaluate(self, t: np.ndarray) -> np.ndarray:
        pts = sorted(self.steps, key=lambda p: p.at_s)
        at = np.array([p.at_s for p in pts])
        values = np.array([self.initial] + [p.value for p in pts])
        return values[np.searchsorted(at, np.asarray(t, dtype=float), side="right")]


class Piecewise(_Strict):
    """Linear interpolation between ``[time_s, value]`` points (flat outside them)."""

    kind: Literal["piecewise"]
    points: list[tuple[float, float]] = Field(min_length=1)

    @model_validator(mode="after")
    def _sorted(self) -> Piecewise:
        times = [p[0] for p in self.points]
        if times != sorted(times):
            raise ValueError("points must be in increasing time order")
        if any(p[1] < 0 for p in self.points):
            raise ValueError("values must be >= 0")
        return self

    def evaluate(self, t: np.ndarray) -> np.ndarray:
        xs = np.array([p[0] for p in self.points])
        ys = np.array([p[1] for p in self.points])
        return np.interp(np.asarray(t, dtype=float), xs, ys)


class Spike(_Strict):
    at_s: float = Field(ge=0)
    duration_s: float = Field(gt=0)
    value: float = Field(ge=0)


class Spikes(_Strict):
    """``base`` with short plateaus at ``value`` (the last spike listed wins on overlap)."""

    kind: Literal["spikes"]
    base: float = Field(ge=0)
    spikes: list[Spike] = Field(min_length=1)

    def evaluate(self, t: np.ndarray) -> np.ndarray:
        tt = np.asarray(t, dtype=float)
        v = np.full(tt.shape, self.base, dtype=float)
        for s in self.spikes:
            v = np.where((tt >= s.at_s) & (tt < s.at_s + s.duration_s), s.value, v)
        return v


class Drift(_Strict):
    """Linear from ``start`` (until ``from_s``) to ``end`` (from ``to_s`` on)."""

    kind: Literal["drift"]
    start: float = Field(ge=0)
    end: float = Field(ge=0)
    from_s: float = Field(0.0, ge=0)
    to_s: float = Field(gt=0)

    @model_validator(mode="after")
    def _order(self) -> Drift:
        if self.to_s <= self.from_s:
            raise ValueError("to_s must be greater than from_s")
        return self

    def evaluate(self, t: np.ndarray) -> np.ndarray:
        return np.interp(np.asarray(t, dtype=float), [self.from_s, self.to_s], [self.start, self.end])


Trace = Annotated[
    Constant | Diurnal | Oscillating | Steps | Piecewise | Spikes | Drift,
    Field(discriminator="kind"),
]


# --------------------------------------------------------------------------------------------
# Length distributions (tokens, integers >= 1)
# --------------------------------------------------------------------------------------------


class Fixed(_Strict):
    kind: Literal["fixed"]
    value: int = Field(ge=1)

    @property
    def mean(self) -> float:
        return float(self.value)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.value, dtype=np.int64)


class Uniform(_Strict):
    kind: Literal["uniform"]
    low: int = Field(ge=1)
    high: int = Field(ge=1)

    @model_validator(mode="after")
    def _order(self) -> Uniform:
        if self.high < self.low:
            raise ValueError("high must be >= low")
        return self

    @property
    def mean(self) -> float:
        return 0.5 * (self.low + self.high)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.low, self.high + 1, size=n, dtype=np.int64)


class LogNormal(_Strict):
    """Lognormal with the given *mean* (not median) and log-space ``sigma``, clipped to [1, max]."""

    kind: Literal["lognormal"]
    mean: float = Field(gt=0)
    sigma: float = Field(0.5, ge=0, le=3)
    max: int | None = Field(None, ge=1)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        mu = math.log(self.mean) - 0.5 * self.sigma**2
        x = np.rint(rng.lognormal(mu, self.sigma, size=n))
        return np.clip(x, 1, self.max or np.inf).astype(np.int64)


Lengths = Annotated[Fixed | Uniform | LogNormal, Field(discriminator="kind")]


class RequestClass(_Strict):
    """One kind of request: its share of arrivals, its lengths and its acceptance.

    ``alpha`` fixes the per-token acceptance of this class; when absent the scenario's
    acceptance trace gives it, shifted by ``alpha_offset``.
    """

    name: str = "default"
    weight: float = Field(1.0, gt=0)
    prompt_tokens: Lengths = Fixed(kind="fixed", value=512)
    gen_tokens: Lengths = Fixed(kind="fixed", value=256)
    alpha: float | None = Field(None, ge=0, le=1)
    alpha_offset: float = Field(0.0, ge=-1, le=1)


class Arrivals:
    """A block of arrivals, sorted by time (numpy arrays of equal length)."""

    __slots__ = ("alpha", "gen", "klass", "prompt", "time_s")

    def __init__(self, time_s, prompt, gen, alpha, klass) -> None:
        self.time_s = time_s
        self.prompt = prompt
        self.gen = gen
        self.alpha = alpha
        self.klass = klass

    def __len__(self) -> int:
        return len(self.time_s)


def generate_arrivals(
    rng: np.random.Generator,
    rate: Trace,
    acceptance: Trace,
    classes: list[RequestClass],
    start_s: float,
    tick_s: float,
    n_ticks: int,
    time_scale: float = 1.0,
) -> tuple[Arrivals, np.ndarray]:
    """Poisson arrivals for ``n_ticks`` ticks from ``start_s``; also the per-tick counts.

    The rate is taken at each tick's midpoint (piecewise-constant Poisson process); arrival
    times are uniform within their tick. ``time_scale`` > 1 plays the traces faster than the
    clock (the rate at time t is the trace's value at ``t·time_scale``).
    """
    mids = start_s + (np.arange(n_ticks) + 0.5) * tick_s
    lam = np.maximum(rate.evaluate(mids * time_scale), 0.0)
    counts = rng.poisson(lam * tick_s)
    n = int(counts.sum())
    tick_of = np.repeat(np.arange(n_ticks), counts)
    # Uniform offsets, sorted within each tick (tick index dominates the sort key).
    offsets = rng.random(n)
    order = np.lexsort((offsets, tick_of))
    times = start_s + (tick_of[order] + offsets[order]) * tick_s
    weights = np.array([c.weight for c in classes], dtype=float)
    klass = (
        np.zeros(n, dtype=np.int64)
        if len(classes) == 1
        else rng.choice(len(classes), size=n, p=weights / weights.sum())
    )
    prompt = np.empty(n, dtype=np.int64)
    gen = np.empty(n, dtype=np.int64)
    alpha = np.empty(n, dtype=float)
    trace_alpha = None
    for i, c in enumerate(classes):
        sel = np.flatnonzero(klass == i)
        if sel.size == 0:
            continue
        prompt[sel] = c.prompt_tokens.sample(rng, sel.size)
        gen[sel] = c.gen_tokens.sample(rng, sel.size)
        if c.alpha is not None:
            alpha[sel] = c.alpha
        else:
            if trace_alpha is None:
                trace_alpha = acceptance.evaluate(times * time_scale)
            alpha[sel] = trace_alpha[sel] + c.alpha_offset
    np.clip(alpha, 0.0, 1.0, out=alpha)
    return Arrivals(times, prompt, gen, alpha, klass), counts


def mean_lengths(classes: list[RequestClass]) -> tuple[float, float]:
    """Weighted mean prompt and generated tokens of a class mix."""
    w = np.array([c.weight for c in classes], dtype=float)
    w = w / w.sum()
    p = sum(wi * _mean(c.prompt_tokens) for wi, c in zip(w, classes, strict=True))
    g = sum(wi * _mean(c.gen_tokens) for wi, c in zip(w, classes, strict=True))
    return float(p), float(g)


def _mean(d: Fixed | Uniform | LogNormal) -> float:
    if isinstance(d, LogNormal) and d.max is not None:
        # Clipping lowers the mean; estimate it once with a fixed seed.
        return float(d.sample(np.random.default_rng(0), 20000).mean())
    return float(d.mean)
