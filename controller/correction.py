"""Online correction of the latency model from the server's own latency: pure numpy.

The calibration is the prior; each usable tick's observed mean latency of the *running* mode is
evidence. Four multiplicative factors act on the step costs (log space, so a factor and its
inverse are equally far from 1):

* ``target_fixed`` — the target pass's load-independent part (its intercept);
* ``target_load``  — its load-dependent part (per-token slope and knees, KV read, per sequence);
* ``sd_fixed``     — the draft pass's intercept and the per-step SD overhead;
* ``sd_load``      — the draft pass's load-dependent part.

Both modes run the target's forward pass, so SD-off evidence moves the target terms, and
SD-on evidence moves all four (the target terms shared with SD off). That is how the mode that
is not running is corrected: through the shared terms, with the uncertainty the posterior's
covariance gives it (an SD-on residual cannot tell a slower target from a slower draft, so the
target terms move less and stay wider). The posterior is Gaussian, updated by an extended
Kalman step (linearized by finite differences of the real solver), with Huber weights against
outliers and exponential forgetting of the *evidence* (the prior stays: what recent evidence
does not pin down returns to the calibration, and the covariance widens back to the prior's). Factors are clamped to
``[1/max_factor, max_factor]``; a correction that wants to go further raises the
recalibration alarm instead of drifting on.

No clock, file or network here: time is an argument. The shell (controller/learning.py)
records evidence, persists the posterior and exports it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from controller.model import LatencyModel, StepCost

TERMS = ("target_fixed", "target_load", "sd_fixed", "sd_load")
SHARED_TERMS = (0, 1)  # indices of the terms both modes run (the target's pass)
MODES = ("off", "on")
POSTERIOR_SCHEMA = 1
# Factors are rounded to this step in log space before they reach the model: the solver's
# curves are cached per model (a new model rebuilds every γ's curves: milliseconds), and a
# 0.5 % change of a cost is far below what one tick resolves (its mean latency: 5–10 % noise).
LOG_QUANTUM = 5e-3
FD_STEP = 0.02  # finite-difference step (log space) of the Jacobian
ALARM_CLEAR = 0.9  # an alarm clears once its term is back inside this fraction of the clamp (log)


@dataclass(frozen=True)
class CorrectionConfig:
    """How the posterior learns (from settings)."""

    prior_width: float = 0.3  # prior sd of a shared (target) log-factor
    sd_prior_width: float = 0.3  # prior sd of an SD-only log-factor
    half_life_s: float = 6 * 3600.0  # information forgetting
    huber_k: float = 2.0  # residuals beyond k standard deviations get weight k/|z|
    max_factor: float = 2.0  # clamp; wanting more raises the recalibration alarm
    error_half_life_s: float = 300.0  # smoothing of the exported error ratio (the alert adds its `for`)

    common_share: float = 1.0  # how much of the target's prior error the draft's terms share

    def prior_cov(self) -> np.ndarray:
        """Prior covariance of the four log-factors: the draft runs on the same GPU with the same
        kernels as the target, so whatever miscalibrates the target's pass (another GPU, a
        driver, clocks) is expected in the draft's as well. A draft term is the target's term of
        the same kind (fixed, load) plus an error of its own: cov = common_share · σ_target²,
        so SD-off evidence that moves the target also moves the draft's expectation, by the same
        factor when common_share is 1, and leaves it the own part of its width."""
        t, d = self.prior_width**2, self.sd_prior_width**2
        cov = np.diag([t, t, d, d])
        # Never beyond what keeps the prior positive definite (a draft no better known than the target).
        shared = min(self.common_share * min(t, d), 0.95 * math.sqrt(t * d))
        for i, j in ((0, 2), (1, 3)):
            cov[i, j] = cov[j, i] = shared
        return cov


@dataclass(frozen=True)
class Posterior:
    """Gaussian posterior over the four log-factors, plus the smoothed error per mode."""

    mean: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)
    cov: tuple[tuple[float, ...], ...] | None = None  # None: the prior's
    updated_at: float | None = None
    evidence: int = 0  # ticks that updated it
    # Smoothed log(observed / predicted) of each mode's own evidence, and when last seen.
    error_log: tuple[float | None, float | None] = (None, None)
    error_at: tuple[float | None, float | None] = (None, None)
    alarm: tuple[str, ...] = ()  # terms at the clamp that the evidence pushes beyond

    def covariance(self, config: CorrectionConfig) -> np.ndarray:
        return config.prior_cov() if self.cov is None else np.array(self.cov, dtype=float)

    @property
    def factors(self) -> tuple[float, ...]:
        # Toward zero, so a factor at the clamp stays within it.
        return tuple(math.exp(math.trunc(m / LOG_QUANTUM) * LOG_QUANTUM) for m in self.mean)

    def width(self, config: CorrectionConfig) -> tuple[float, ...]:
        """Posterior sd of each log-factor."""
        return tuple(float(math.sqrt(max(v, 0.0))) for v in np.diag(self.covariance(config)))

    def error_ratio(self, mode: str) -> float | None:
        """Smoothed observed / predicted latency of that mode's own evidence (None: none yet)."""
        e = self.error_log[MODES.index(mode)]
        return None if e is None else math.exp(e)

    def mode_factors(self, mode: str, model: LatencyModel, draft_length: int) -> dict[str, float]:
        """Effective (fixed, load) factor of a mode's decode step: SD mixes target and draft."""
        f = self.factors
        if mode == "off":
            return {"fixed": f[0], "load": f[1]}
        t, d, g = model.target, model.draft, float(draft_length)
        a_t, a_d = t.intercept_s, g * d.intercept_s + model.sd_overhead_s
        b_t, b_d = (g + 1.0) * t.slope_s_per_token, g * d.slope_s_per_token
        fixed = (f[0] * a_t + f[2] * a_d) / (a_t + a_d) if a_t + a_d > 0 else f[0]
        load = (f[1] * b_t + f[3] * b_d) / (b_t + b_d) if b_t + b_d > 0 else f[1]
        return {"fixed": fixed, "load": load}

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": POSTERIOR_SCHEMA,
            "terms": list(TERMS),
            "mean": list(self.mean),
            "cov": None if self.cov is None else [list(r) for r in self.cov],
            "updated_at": self.updated_at,
            "evidence": self.evidence,
            "error_log": list(self.error_log),
            "error_at": list(self.error_at),
            "alarm": list(self.alarm),
        }

    @classmethod
    def from_dict(cls, raw: Any) -> Posterior:
        """Rebuild from a saved dict; ValueError (one line) when anything is off."""
        if not isinstance(raw, dict) or raw.get("schema") != POSTERIOR_SCHEMA:
            raise ValueError(f"schema is not {POSTERIOR_SCHEMA}")
        if raw.get("terms") != list(TERMS):
            raise ValueError(f"terms must be {list(TERMS)}")
        mean = raw.get("mean")
        if not isinstance(mean, list) or len(mean) != len(TERMS) or not all(_finite(m) for m in mean):
            raise ValueError("mean must be four finite numbers")
        cov = raw.get("cov")
        if cov is not None:
            arr = np.array(cov, dtype=float) if isinstance(cov, list) else None
            if arr is None or arr.shape != (4, 4) or not np.all(np.isfinite(arr)) or np.any(np.diag(arr) < 0):
                raise ValueError("cov must be a finite 4×4 matrix with a non-negative diagonal")
            cov = tuple(tuple(float(x) for x in row) for row in arr)
        pair = [raw.get("error_log", [None, None]), raw.get("error_at", [None, None])]
        for p in pair:
            if not isinstance(p, list) or len(p) != 2 or not all(v is None or _finite(v) for v in p):
                raise ValueError("error_log and error_at must be pairs of numbers or nulls")
        updated = raw.get("updated_at")
        if updated is not None and not _finite(updated):
            raise ValueError("updated_at must be a number or null")
        evidence = raw.get("evidence", 0)
        if not isinstance(evidence, int) or evidence < 0:
            raise ValueError("evidence must be a non-negative integer")
        alarm = raw.get("alarm", [])
        if not isinstance(alarm, list) or not all(a in TERMS for a in alarm):
            raise ValueError("alarm must list terms")
        return cls(
            tuple(float(m) for m in mean),
            cov,
            None if updated is None else float(updated),
            evidence,
            tuple(None if v is None else float(v) for v in pair[0]),  # type: ignore[arg-type]
            tuple(None if v is None else float(v) for v in pair[1]),  # type: ignore[arg-type]
            tuple(alarm),
        )


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _split(cost: StepCost, fixed: float, load: float) -> StepCost:
    """The pass cost with its intercept times ``fixed`` and every load-dependent term times ``load``."""
    return StepCost(
        cost.intercept_s * fixed,
        cost.slope_s_per_token * load,
        cost.knees_tokens,
        tuple(d * load for d in cost.knee_slope_deltas),
        cost.context_s_per_token * load,
        cost.seq_s * load,
    )


def scaled_model(model: LatencyModel, factors: tuple[float, ...]) -> LatencyModel:
    """The model with the four correction factors applied to its step costs (solver untouched)."""
    tf, tl, sf, sl = factors
    if factors == (1.0, 1.0, 1.0, 1.0):
        return model
    # Schema-1 calibrations: ``verify`` prices the whole SD step (mostly the target's pass) and
    # ``prefill`` a prompt's stand-alone cost (the target's load-dependent part).
    return dataclasses.replace(
        model,
        target=_split(model.target, tf, tl),
        draft=_split(model.draft, sf, sl),
        sd_overhead_s=model.sd_overhead_s * sf,
        verify=None if model.verify is None else _split(model.verify, tf, tl),
        prefill=None if model.prefill is None else _split(model.prefill, tf, tl),
    )


def log_speedup_sd(
    posterior: Posterior,
    config: CorrectionConfig,
    base_model: LatencyModel,
    speedup_at: Callable[[LatencyModel], float],
    step: float = FD_STEP,
) -> float | None:
    """Posterior sd of the log of a predicted speedup: √(gᵀΣg), g its gradient in the four
    log-factors (finite differences of the real solver at the posterior mean), Σ their covariance.

    What the evidence pins down adds nothing; what it does not (the SD-only terms while SD has
    not run, the split between the target's fixed and load terms at one load level) adds its
    whole width. None when the speedup is not a positive finite number there.
    """
    f = posterior.factors
    s0 = speedup_at(scaled_model(base_model, f))
    if not (math.isfinite(s0) and s0 > 0):
        return None
    g = np.zeros(len(f))
    for i in range(len(f)):
        moved = tuple(x * math.exp(step) if j == i else x for j, x in enumerate(f))
        si = speedup_at(scaled_model(base_model, moved))
        if not (math.isfinite(si) and si > 0):
            return None
        g[i] = (math.log(si) - math.log(s0)) / step
    return float(math.sqrt(max(float(g @ posterior.covariance(config) @ g), 0.0)))


@dataclass(frozen=True)
class Update:
    """What one piece of evidence did to the posterior (for the log and the metrics)."""

    posterior: Posterior
    residual_log: float  # log(observed / predicted) before the update
    weight: float  # Huber weight given to it (1 = full)
    alarm_raised: tuple[str, ...]  # the alarm's terms on the tick it was raised (else empty)


def forget(posterior: Posterior, config: CorrectionConfig, now: float) -> Posterior:
    """Decay the evidence (not the prior) by 2^(−Δt/half-life): exponential forgetting.

    In information form the posterior is prior + weighted evidence, Λ = Λ0 + Λ_e and
    Λ·m = Λ0·m0 + η_e (m0 = 0: the calibration). Decaying Λ_e and η_e keeps what the evidence
    pins down (Λ_e ≫ Λ0) and lets what it does not (a direction no recent tick informs, e.g.
    target vs draft cost while one mode runs) return to the calibration, instead of drifting.
    """
    if posterior.updated_at is None or posterior.cov is None:
        return posterior
    dt = max(now - posterior.updated_at, 0.0)
    if dt == 0.0:
        return posterior
    w = 0.5 ** (dt / config.half_life_s)
    info0 = np.linalg.inv(config.prior_cov())
    info = np.linalg.inv(posterior.covariance(config))
    new_info = info0 + w * (info - info0)
    mean = np.linalg.solve(new_info, w * (info @ np.array(posterior.mean)))
    cov = np.linalg.inv(new_info)
    return dataclasses.replace(
        posterior, mean=tuple(float(x) for x in mean), cov=_tuple2(0.5 * (cov + cov.T)), updated_at=now
    )


def update(
    posterior: Posterior,
    config: CorrectionConfig,
    predict_log: Callable[[tuple[float, ...]], float],
    mode: str,
    observed_latency_s: float,
    noise_log_sd: float,
    now: float,
) -> Update:
    """One extended-Kalman step on the evidence ``observed_latency_s`` of ``mode``.

    ``predict_log(factors)`` is log of the model's latency of that mode at the tick's load with
    those factors (the shell closes it over the real solver); it must be finite at the current
    factors. ``noise_log_sd`` is the observation's own spread (a window's mean of a few hundred
    requests), in log units.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    if not (observed_latency_s > 0 and math.isfinite(observed_latency_s)):
        raise ValueError("observed latency must be positive and finite")
    posterior = forget(posterior, config, now)
    m = np.array(posterior.mean, dtype=float)
    p = posterior.covariance(config)
    active = [0, 1] if mode == "off" else [0, 1, 2, 3]
    base = predict_log(tuple(math.exp(x) for x in m))
    if not math.isfinite(base):
        # The exact posterior sits past a stability limit at this load (the model the tick used
        # had rounded factors): there is no gradient to follow, so this tick teaches nothing.
        return Update(posterior, math.nan, 0.0, ())
    jac = np.zeros(4)
    for k in active:
        mk = m.copy()
        mk[k] += FD_STEP
        up = predict_log(tuple(math.exp(x) for x in mk))
        if math.isfinite(up):
            jac[k] = (up - base) / FD_STEP
        else:  # past a stability limit one way: differentiate the other way
            mk[k] -= 2 * FD_STEP
            down = predict_log(tuple(math.exp(x) for x in mk))
            # Both ways overloaded (a knife edge): this term gets no gradient, never a NaN.
            jac[k] = (base - down) / FD_STEP if math.isfinite(down) else 0.0
    r = math.log(observed_latency_s) - base
    s2 = float(jac @ p @ jac) + noise_log_sd**2
    z = abs(r) / math.sqrt(s2)
    weight = 1.0 if z <= config.huber_k else config.huber_k / z
    s2w = float(jac @ p @ jac) + noise_log_sd**2 / weight
    gain = p @ jac / s2w
    m = m + gain * r
    p = p - np.outer(gain, jac @ p)
    p = 0.5 * (p + p.T)
    bound = math.log(config.max_factor)
    wanted = {TERMS[k] for k in range(4) if abs(m[k]) > bound}
    m = np.clip(m, -bound, bound)
    # Hysteresis: a raised alarm stays until the term is back well inside the clamp, so a term
    # riding the bound does not flap the alarm (and the log) tick by tick.
    near = bool(np.any(np.abs(m) >= ALARM_CLEAR * bound))
    kept = set(posterior.alarm) if near else set()
    alarm = tuple(t for t in TERMS if t in wanted | kept)
    tracked = track_error(posterior, config, mode, r, now)
    new = Posterior(
        tuple(float(x) for x in m),
        _tuple2(p),
        now,
        posterior.evidence + 1,
        tracked.error_log,
        tracked.error_at,
        alarm,
    )
    return Update(new, r, weight, alarm if alarm and not posterior.alarm else ())


def track_error(
    posterior: Posterior, config: CorrectionConfig, mode: str, residual_log: float, now: float
) -> Posterior:
    """Fold one residual log(observed / predicted) of ``mode`` into its smoothed error."""
    idx = MODES.index(mode)
    prev, prev_at = posterior.error_log[idx], posterior.error_at[idx]
    if prev is None or prev_at is None:
        err = residual_log
    else:
        a = 0.5 ** (max(now - prev_at, 0.0) / config.error_half_life_s)
        err = a * prev + (1.0 - a) * residual_log
    error_log = tuple(err if i == idx else posterior.error_log[i] for i in range(2))
    error_at = tuple(now if i == idx else posterior.error_at[i] for i in range(2))
    return dataclasses.replace(posterior, error_log=error_log, error_at=error_at)


def _tuple2(a: np.ndarray) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(float(x) for x in row) for row in a)


def paper_fit(rates: np.ndarray, latencies: np.ndarray) -> tuple[float, float] | None:
    """The paper's per-mode production fit L = C1 / (1 − λ·C2): (C1, C2), or None.

    1/L = 1/C1 − (C2/C1)·λ is linear in λ (as in calibration's load-test check); needs two
    distinct rates and a positive intercept.
    """
    rates, latencies = np.asarray(rates, float), np.asarray(latencies, float)
    ok = np.isfinite(rates) & np.isfinite(latencies) & (latencies > 0)
    rates, latencies = rates[ok], latencies[ok]
    if np.unique(np.round(rates, 6)).size < 2:
        return None
    slope, icpt = np.polyfit(rates, 1.0 / latencies, 1)
    if icpt <= 0:
        return None
    c1 = 1.0 / icpt
    return float(c1), float(-slope * c1)
