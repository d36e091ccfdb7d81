"""Residuals of the latency model over history: observed vs predicted mean latency per mode.

Two sources: the daemon's own evidence file (controller/evidence.py: each record carries the
corrected and the calibrated prediction it made), or a backtest's steps (controller/sim/
backtest.py), which are replayed here through the online correction in the *recorded* mode
(the one whose latency the history shows). Ticks within ``evidence_settle_s`` of a recorded
mode change, and ticks without an observed latency or with an overloaded prediction, are left
out. Next to the model's figures, the paper's per-mode production fit L = C1 / (1 − λ·C2)
(calibration's own check of a load test) fitted to the same points says how much a two-number
curve explains.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from controller.acceptance import alpha_from_vllm_rate
from controller.calibration import _paper_fit_r2
from controller.correction import Posterior, paper_fit, scaled_model, update
from controller.evidence import EvidenceRecord
from controller.learning import correction_config
from controller.model import LatencyModel, Workload, curves
from controller.observation import Observation


@dataclass(frozen=True)
class Point:
    time_s: float
    mode: str  # "off" | "on"
    arrival_rate_rps: float
    observed_s: float
    calibrated_s: float
    corrected_s: float | None  # None: no correction replayed


@dataclass(frozen=True)
class ModeResiduals:
    mode: str
    n: int
    bias_calibrated: float  # exp(mean log(observed / predicted)) − 1
    mape_calibrated: float
    bias_corrected: float | None
    mape_corrected: float | None
    paper_c1_s: float | None
    paper_c2_s: float | None
    paper_r2: float | None


@dataclass(frozen=True)
class _Row:  # what calibration's paper-fit check reads of a load-test row
    sd: bool
    draft_length: int
    acceptance_rate: float
    rate: float
    mean_e2e_s: float

    @property
    def offered_rps(self) -> float:  # the arrival rate the server saw (a load-test row's sent / duration)
        return self.rate


def summarize(points: Iterable[Point]) -> list[ModeResiduals]:
    """Per-mode residual figures (modes without points are left out)."""
    pts = list(points)
    out = []
    for mode in ("off", "on"):
        sel = [p for p in pts if p.mode == mode and math.isfinite(p.calibrated_s)]
        if not sel:
            continue
        obs = np.array([p.observed_s for p in sel])
        cal = np.array([p.calibrated_s for p in sel])
        cor = [p for p in sel if p.corrected_s is not None and math.isfinite(p.corrected_s)]
        rates = np.array([p.arrival_rate_rps for p in sel])
        fit = paper_fit(rates, obs)
        rows = [_Row(mode == "on", 0, 0.0, p.arrival_rate_rps, p.observed_s) for p in sel]
        r2 = _paper_fit_r2(rows) if fit is not None else None
        c_obs = np.array([p.observed_s for p in cor])
        c_pred = np.array([p.corrected_s for p in cor], dtype=float)
        out.append(
            ModeResiduals(
                mode,
                len(sel),
                float(np.exp(np.mean(np.log(obs / cal))) - 1),
                float(np.mean(np.abs(obs / cal - 1))),
                float(np.exp(np.mean(np.log(c_obs / c_pred))) - 1) if cor else None,
                float(np.mean(np.abs(c_obs / c_pred - 1))) if cor else None,
                fit[0] if fit else None,
                fit[1] if fit else None,
                r2,
            )
        )
    return out


def from_evidence(records: Iterable[EvidenceRecord]) -> list[Point]:
    """The daemon's evidence, usable records only (the predictions are the ones it made)."""
    return [
        Point(
            r.time_s,
            r.mode,
            r.arrival_rate_rps,
            float(r.observed_latency_s),
            r.calibrated_latency_s,
            r.predicted_latency_s,
        )
        for r in records
        if r.usable and r.observed_latency_s and math.isfinite(r.predicted_latency_s)
    ]


def from_steps(settings, model: LatencyModel, steps: Sequence) -> list[Point]:
    """A backtest's steps (``time_s``, ``observation``, ``recorded_enabled``) in the recorded mode,
    with the online correction learning along (prediction first, then the update)."""
    config = correction_config(settings)
    posterior = Posterior()
    last_mode, changed_at = None, -math.inf
    last_alpha = float(alpha_from_vllm_rate(settings.acceptance_prior, settings.draft_length))
    out = []
    for step in steps:
        on, obs = step.recorded_enabled, step.observation
        if on is None or not isinstance(obs, Observation):
            continue
        mode = "on" if on else "off"
        if last_mode is not None and mode != last_mode:
            changed_at = step.time_s
        last_mode = mode
        rate, lat = obs.arrival_rate_rps, obs.mean_e2e_latency_s
        gamma = settings.draft_length
        if obs.acceptance_rate is not None:
            last_alpha = float(alpha_from_vllm_rate(obs.acceptance_rate, max(obs.mean_draft_tokens or gamma, 1.0)))
        if (
            rate is None
            or rate <= 0
            or lat is None
            or lat <= 0
            or step.time_s - changed_at < settings.evidence_settle_s
        ):
            continue
        w = Workload(
            obs.mean_prompt_tokens or settings.default_prompt_tokens,
            obs.mean_gen_tokens or settings.default_gen_tokens,
            obs.gen_tokens_std,
            obs.prompt_tokens_std,
            running_context_tokens=obs.running_context_tokens,
            cached_prompt_tokens=obs.cached_prompt_tokens or 0.0,
        )

        def latency(m: LatencyModel, on=on, rate=rate, w=w, alpha=last_alpha, gamma=gamma) -> float:
            off_c, on_c = curves(m, alpha, gamma, w)
            return (on_c if on else off_c).latency_s(rate)

        calibrated = latency(model)
        corrected = latency(scaled_model(model, posterior.factors))
        if not (math.isfinite(calibrated) and math.isfinite(corrected)):
            continue
        out.append(Point(step.time_s, mode, rate, lat, calibrated, corrected))
        noise = math.sqrt(settings.correction_noise**2 + 2.0 / max(rate * settings.evaluation_interval_s, 1.0))

        def predict_log(factors, latency=latency) -> float:
            t = latency(scaled_model(model, factors))
            return math.log(t) if 0 < t < math.inf else math.inf

        posterior = update(posterior, config, predict_log, mode, lat, noise, step.time_s).posterior
    return out


def format_report(rows: Sequence[ModeResiduals], out_of: int | None = None) -> str:
    """The residuals as a few lines for a terminal."""
    if not rows:
        return "model residuals: no settled step with an observed latency in this history"
    lines = [
        "model residuals (observed vs predicted mean latency, settled steps in the recorded mode):",
        f"  {'mode':>4} {'n':>6} {'calibration bias':>17} {'MAPE':>6} {'corrected bias':>15} {'MAPE':>6}"
        "   paper fit L = C1/(1 − λ·C2)",
    ]
    for r in rows:
        cb = "-" if r.bias_corrected is None else f"{r.bias_corrected:+.1%}"
        cm = "-" if r.mape_corrected is None else f"{r.mape_corrected:.1%}"
        paper = (
            "-"
            if r.paper_c1_s is None
            else f"C1 {r.paper_c1_s:.3f} s, C2 {r.paper_c2_s:.4f} s"
            + ("" if r.paper_r2 is None else f", R² {r.paper_r2:.3f}")
        )
        lines.append(
            f"  {r.mode:>4} {r.n:>6} {r.bias_calibrated:>+17.1%} {r.mape_calibrated:>6.1%} {cb:>15} {cm:>6}   {paper}"
        )
    return "\n".join(lines)
