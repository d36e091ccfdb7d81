"""Does the online correction converge? The real loop on a simulated day, a wrong calibration.

The simulated server's step costs are a *truth* model (plus the engine's own deviations:
per-tick cost noise, Poisson arrivals, length spreads, restarts); the controller starts from
another calibration and learns from the server's observed latency only. The figure of merit is
the corrected model's error on the running mode over the last hours of the day, measured on
the evidence the controller itself recorded (predicted latency is what the policy used that
tick, before learning from it): |exp(mean log(observed/predicted)) − 1| (bias) and the mean
absolute relative error of 15-minute means (a tick's mean latency carries sampling noise of a
few percent; averaging over a quarter hour shows the model's error, not the sampler's).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from controller.correction import scaled_model
from controller.model import LatencyModel
from controller.sim.engine import DEFAULT_EPOCH_S
from controller.sim.runner import RunResult, default_settings, run_controller
from controller.sim.scenarios import Scenario


@dataclass(frozen=True)
class Convergence:
    label: str
    ticks_used: int
    bias_calibrated: float  # the calibration alone, same ticks (those it does not call overloaded)
    bias_corrected: float
    mape_15min: float
    mape_15min_calibrated: float
    factors: tuple[float, ...]
    alarm: tuple[str, ...]
    toggles: int
    mean_latency_s: float
    modes: str
    per_mode: tuple = ()  # controller.residuals.ModeResiduals of each mode seen in the window


def measure(result: RunResult, label: str, last_s: float = 6 * 3600.0) -> Convergence:
    """The corrected model's error on the running mode over the last ``last_s`` of the run."""
    ctl = result.controller  # type: ignore[attr-defined]
    recs = [r for r in ctl.learner.evidence.load() if r.usable]
    end = DEFAULT_EPOCH_S + result.scenario.duration_s
    recs = [r for r in recs if r.time_s >= end - last_s and np.isfinite(r.predicted_latency_s)]
    if not recs:
        raise ValueError(f"{label}: no usable evidence in the last {last_s:.0f} s")
    t = np.array([r.time_s for r in recs])
    obs = np.array([r.observed_latency_s for r in recs], dtype=float)
    pred = np.array([r.predicted_latency_s for r in recs])
    cal = np.array([r.calibrated_latency_s for r in recs])
    bins = ((t - t.min()) // 900).astype(int)

    def binned(p: np.ndarray) -> float:
        # A quarter the calibration calls overloaded while the server serves is a 100 % miss.
        errs = [min(abs(obs[bins == b].mean() / p[bins == b].mean() - 1), 1.0) for b in np.unique(bins)]
        return float(np.mean(errs))

    finite = np.isfinite(cal)

    modes = "/".join(sorted({r.mode for r in recs}))
    s = result.summary()
    from controller.residuals import from_evidence, summarize

    return Convergence(
        label,
        len(recs),
        float(np.exp(np.mean(np.log(obs[finite] / cal[finite]))) - 1) if finite.any() else float("nan"),
        float(np.exp(np.mean(np.log(obs / pred))) - 1),
        binned(pred),
        binned(cal),
        ctl.learner.posterior.factors,
        ctl.learner.posterior.alarm,
        int(s["toggles"]),
        float(s["mean_latency_s"]),
        modes,
        tuple(summarize(from_evidence(recs))),
    )


def run_day(scenario: Scenario, truth: LatencyModel, believed: LatencyModel, seed: int | None = None, **settings):
    """The real controller (online correction on) on ``truth``, believing ``believed``."""
    return run_controller(scenario, truth, default_settings(**settings), controller_model=believed, seed=seed)


def off_calibrations(example: LatencyModel) -> dict[str, LatencyModel]:
    """The calibrations the issue asks about: load-dependent costs ×0.7 and ×1.4, and the example."""
    return {
        "load costs ×0.7": scaled_model(example, (1.0, 0.7, 1.0, 0.7)),
        "load costs ×1.4": scaled_model(example, (1.0, 1.4, 1.0, 1.4)),
        "example": example,
    }
