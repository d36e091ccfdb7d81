"""The shell around the online correction: evidence in, corrected model out, posterior kept.

Each tick the loop asks :meth:`Learner.model` for the model the assessment should use (the
calibration with the posterior's factors applied), then hands :meth:`Learner.learn` what
the tick saw. ``learn`` records an :class:`~controller.evidence.EvidenceRecord` for the
applied mode (excluded ticks marked with their reason), updates the posterior with usable
evidence (controller/correction.py, pure), persists it, and logs corrections and alarms.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from controller.assessment import AcceptanceSource, Assessment
from controller.atomic import write_bytes_atomic
from controller.correction import (
    TERMS,
    CorrectionConfig,
    Posterior,
    Update,
    log_speedup_sd,
    scaled_model,
    track_error,
    update,
)
from controller.errors import ConfigError
from controller.evidence import EvidenceRecord, Excluded, FileEvidenceStore, MemoryEvidenceStore
from controller.hooks.base import HookPhase, HookStatus
from controller.model import LatencyModel, curves, mode_curve_for, predict_point
from controller.observation import Observation, last_restart, steady_load
from controller.settings import Settings
from controller.state import ControllerState

log = structlog.get_logger("sd_controller.learning")

SAVE_EVERY = 5  # posterior writes: every this many updates
DRIFT_FORGET_SPEEDUP = 8.0  # how much faster the posterior forgets while the error is beyond threshold
RHO_MAX = 0.95  # utilization beyond which a window teaches next to nothing (1/(1 − ρ) = 20)


def correction_config(s: Settings) -> CorrectionConfig:
    return CorrectionConfig(
        prior_width=s.correction_prior_width / 2.0,
        sd_prior_width=s.correction_prior_width,
        half_life_s=s.correction_half_life_s,
        max_factor=s.correction_max_factor,
    )


def calibration_fingerprint(model: LatencyModel) -> str:
    """Identifies the calibration a posterior was learned against (a new one starts afresh)."""
    return hashlib.sha256(repr(model).encode("utf-8")).hexdigest()[:16]


class MemoryPosteriorStore:
    def __init__(self, posterior: Posterior | None = None) -> None:
        self.posterior = posterior

    def load(self, fingerprint: str) -> Posterior | None:
        return self.posterior

    def save(self, posterior: Posterior, fingerprint: str) -> None:
        self.posterior = posterior


class FilePosteriorStore:
    """The posterior as JSON, written atomically; corrupt: set aside with one log line."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.set_aside: Path | None = None

    def load(self, fingerprint: str) -> Posterior | None:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ConfigError(f"setting correction_file: {self.path}: cannot read: {exc.strerror or exc}") from None
        try:
            data = json.loads(raw.decode("utf-8"))
            if not isinstance(data, dict):
                raise ValueError("top level is not an object")
            posterior = Posterior.from_dict(data.get("posterior"))
        except (ValueError, TypeError, RecursionError, ArithmeticError) as exc:
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
            try:
                os.replace(self.path, aside)
            except OSError as err:
                raise ConfigError(
                    f"setting correction_file: {self.path} is corrupt and cannot be set aside: {err.strerror or err}"
                ) from None
            self.set_aside = aside
            log.error("correction_file_corrupt", path=str(self.path), moved_to=str(aside), error=f"{exc}"[:200])
            return None
        if data.get("calibration") != fingerprint:
            log.warning("correction_reset", path=str(self.path), detail="learned against another calibration")
            return None
        return posterior

    def save(self, posterior: Posterior, fingerprint: str) -> None:
        data = {"calibration": fingerprint, "posterior": posterior.to_dict()}
        write_bytes_atomic(self.path, (json.dumps(data, allow_nan=False) + "\n").encode("utf-8"))


@dataclass(frozen=True)
class Learned:
    """One tick's learning, for the exporter and the tick result."""

    record: EvidenceRecord | None
    update: Update | None
    posterior: Posterior


class Learner:
    """Evidence store + posterior + the corrected model for one controller."""

    def __init__(
        self,
        settings: Settings,
        base_model: LatencyModel,
        evidence: MemoryEvidenceStore | None = None,
        posteriors: MemoryPosteriorStore | FilePosteriorStore | None = None,
    ) -> None:
        self.settings = settings
        self.base = base_model
        self.config = correction_config(settings)
        self.evidence = evidence if evidence is not None else MemoryEvidenceStore(settings.evidence_max_records)
        self.posteriors = posteriors if posteriors is not None else MemoryPosteriorStore()
        self.fingerprint = calibration_fingerprint(base_model)
        self.evidence.load()
        self.posterior = self.posteriors.load(self.fingerprint) or Posterior()
        self._model_key: tuple[float, ...] | None = None
        self._model = base_model
        self._write_failed = False

    @classmethod
    def from_settings(cls, settings: Settings, base_model: LatencyModel) -> Learner:
        """File-backed stores next to the state file unless configured elsewhere."""
        here = settings.state_file.parent
        ev = settings.evidence_file or here / "sd-controller-evidence.jsonl"
        co = settings.correction_file or here / "sd-controller-correction.json"
        return cls(settings, base_model, FileEvidenceStore(ev, settings.evidence_max_records), FilePosteriorStore(co))

    def reprice(self, base_model: LatencyModel) -> None:
        """Price from ``base_model`` from now on: the calibration's, with what the server says
        of itself (its prefix caching). The posterior stays: it corrects the same step costs."""
        self.base, self._model_key, self._model = base_model, None, base_model

    @property
    def model(self) -> LatencyModel:
        """The model the assessment uses: corrected when online correction is on."""
        if not self.settings.online_correction:
            return self.base
        key = self.posterior.factors
        if key != self._model_key:
            self._model_key, self._model = key, scaled_model(self.base, key)
        return self._model

    def learn(
        self,
        now: float,
        state: ControllerState,
        obs: object,
        assessment: Assessment | None,
        status: HookStatus,
    ) -> Learned:
        """Record this tick's evidence and learn from it when it may teach the model."""
        on = state.applied_enabled
        if on is None or assessment is None or not isinstance(obs, Observation) or obs.arrival_rate_rps is None:
            return Learned(None, None, self.posterior)
        a = assessment
        mode = "on" if on else "off"
        predicted = a.latency_s(on)
        calibrated = self._latency(self.base, on, obs, a)
        why = self._excluded(now, state, obs, a, status, predicted)
        if why is None and not self.settings.online_correction:
            why_recorded: str | None = Excluded.DISABLED
        else:
            why_recorded = why
        rec = EvidenceRecord(
            time_s=now,
            mode=mode,
            draft_length=a.draft_length if on else None,
            arrival_rate_rps=float(obs.arrival_rate_rps),
            acceptance_rate=obs.acceptance_rate,
            alpha=a.acceptance.alpha if on else None,
            prompt_tokens=float(a.workload.prompt_tokens),
            gen_tokens=float(a.workload.gen_tokens),
            running=obs.running,
            waiting=obs.waiting,
            observed_latency_s=obs.mean_e2e_latency_s,
            predicted_latency_s=predicted,
            calibrated_latency_s=calibrated,
            excluded=why_recorded,
            gen_tokens_std=a.workload.gen_tokens_std,
            prompt_tokens_std=a.workload.prompt_tokens_std,
            running_context_tokens=a.workload.running_context_tokens,
            cached_prompt_tokens=a.workload.cached_prompt_tokens,
        )
        self._persist(self.evidence.append, rec)
        if why is None and not self.settings.online_correction:
            # Not learning, but the drift stays visible: the calibration's own error is tracked.
            assert obs.mean_e2e_latency_s is not None
            r = math.log(obs.mean_e2e_latency_s / predicted)
            self.posterior = track_error(self.posterior, self.config, mode, r, now)
            return Learned(rec, None, self.posterior)
        if why is not None:
            return Learned(rec, None, self.posterior)
        assert obs.mean_e2e_latency_s is not None
        config = self.config
        err = self.posterior.error_log[1 if on else 0]
        if err is not None and abs(err) > math.log1p(self.settings.model_error_threshold):
            # Drift: the old evidence describes another server; let it go faster.
            config = dataclasses.replace(config, half_life_s=config.half_life_s / DRIFT_FORGET_SPEEDUP)

        def predict_log(factors: tuple[float, ...]) -> float:
            t = self._latency(scaled_model(self.base, factors), on, obs, a)
            return math.log(t) if 0 < t < math.inf else math.inf

        rate = float(obs.arrival_rate_rps)
        completed = max(rate * self.settings.evaluation_interval_s, 1.0)
        noise = math.sqrt(self.settings.correction_noise**2 + (1.0 + a.workload.service_scv) / completed)
        noise *= heavy_traffic_inflation(rate, a.stability_limit_on_rps if on else a.stability_limit_off_rps)
        before = self.posterior
        up = update(before, config, predict_log, mode, obs.mean_e2e_latency_s, noise, now)
        self.posterior = up.posterior
        # Every few updates (an fsync'd rewrite costs more than the update): a controller restart
        # loses at most SAVE_EVERY ticks of learning, never the posterior.
        if up.posterior.evidence % SAVE_EVERY == 1 or up.alarm_raised or bool(before.alarm) != bool(up.posterior.alarm):
            self._persist(self.posteriors.save, self.posterior, self.fingerprint)
        if up.alarm_raised:
            log.error(
                "recalibration_alarm",
                terms=list(up.alarm_raised),
                max_factor=self.settings.correction_max_factor,
                factors=dict(zip(TERMS, _round(self.posterior.factors), strict=True)),
                detail="the evidence wants a correction beyond the clamp: recalibrate (sd-controller bench + calibrate)",
            )
        if any(abs(math.log(f1 / f0)) >= 0.01 for f0, f1 in zip(before.factors, up.posterior.factors, strict=True)):
            log.info(
                "model_corrected",
                mode=mode,
                residual=round(up.residual_log, 4),
                weight=round(up.weight, 3),
                factors=dict(zip(TERMS, _round(self.posterior.factors), strict=True)),
            )
        return Learned(rec, up, self.posterior)

    def _persist(self, write, *args) -> None:
        """A full disk must not stop the controller: the evidence stays in memory, logged once."""
        try:
            write(*args)
            self._write_failed = False
        except OSError as exc:
            if not self._write_failed:
                log.error("learning_write_failed", error=exc.strerror or str(exc), detail="kept in memory")
            self._write_failed = True

    def speedup_log_sd(self, a: Assessment) -> float | None:
        """Posterior sd of the log speedup at the rate the decision is evaluated at (None with
        online correction off: the calibration's own interval is all there is)."""
        if not self.settings.online_correction:
            return None
        rate, alpha, gamma, workload = a.projected_rate_rps, a.acceptance.alpha, a.draft_length, a.workload
        return log_speedup_sd(
            self.posterior, self.config, self.base, lambda m: predict_point(m, rate, alpha, gamma, workload).speedup
        )

    def calibrated(self, a: Assessment) -> tuple[float, float]:
        """(off, on) latency the calibration alone predicts at the assessment's rate."""
        en = a.acceptance.accepted_length
        off_c, on_c = curves(self.base, a.acceptance.alpha, a.draft_length, a.workload, en)
        return off_c.latency_s(a.arrival_rate_rps), on_c.latency_s(a.arrival_rate_rps)

    def _excluded(
        self,
        now: float,
        state: ControllerState,
        obs: Observation,
        a: Assessment,
        status: HookStatus,
        predicted: float,
    ) -> str | None:
        s = self.settings
        if state.pending is not None:
            return Excluded.PENDING
        # UNKNOWN is what hook_type=none (and an unreadable status) reports: the server itself
        # may be fine; a restart shows as pending, or as metrics that vanish.
        if status.phase in (HookPhase.RESTARTING, HookPhase.STARTING):
            return Excluded.NOT_READY
        # A launcher says "failed" from a rolled-back switch until the next one succeeds, while
        # the old setting serves: not ready while the failure's backoff runs (the rollback's
        # restart may still be in the metrics), a serving server after it. Otherwise one failed
        # switch stopped the learning until another succeeded, hours or days later.
        if status.phase is HookPhase.FAILED and (
            status.applied_enabled is None
            or status.applied_enabled != state.applied_enabled
            or state.retry_not_before is None
            or now < state.retry_not_before
        ):
            return Excluded.NOT_READY
        # After any restart (a crash's too: its latency window holds the requests that waited
        # through it), not only after a change of ours.
        if now - last_restart(obs, state.last_change_at) < s.evidence_settle_s:
            return Excluded.SETTLING
        if obs.mean_e2e_latency_s is None or obs.mean_e2e_latency_s <= 0:
            return Excluded.NO_LATENCY
        if obs.arrival_rate_rps is None or obs.arrival_rate_rps <= 0:
            return Excluded.NO_LOAD
        if not steady_load(obs.arrival_rate_rps, obs.arrival_rate_long_rps, obs.arrival_rate_peak_rps, s.rate_window_s):
            return Excluded.UNSTEADY
        if state.applied_enabled and a.acceptance.source is not AcceptanceSource.MEASURED:
            return Excluded.NO_ACCEPTANCE
        if not math.isfinite(predicted):
            return Excluded.OVERLOADED
        if a.congested:
            return Excluded.CONGESTED
        return None

    def _latency(self, model: LatencyModel, on: bool, obs: Observation, a: Assessment) -> float:
        # One mode: each of the posterior's probes is a model of its own, whose curves are built anew.
        en = a.acceptance.accepted_length if on else None
        curve = mode_curve_for(model, on, a.acceptance.alpha, a.draft_length, a.workload, en)
        return curve.latency_s(float(obs.arrival_rate_rps or 0.0))


def heavy_traffic_inflation(rate_rps: float, limit_rps: float, rho_max: float = RHO_MAX) -> float:
    """How much noisier one window's mean latency is at utilization ρ = rate / limit: 1/(1 − ρ).

    Near capacity the queue relaxes over ~1/(μ(1 − ρ)²) seconds, so a minute's mean latency holds
    far fewer independent samples than its completions, and the model is least certain there
    too. Without this, the minutes of a busy server (mostly queue fluctuation) outvote the rest
    and drag the factors far from the truth — a slower target and a faster draft "explaining"
    a queue that would have formed anyway, which flips the predicted speedup of the idle mode.
    """
    if not (limit_rps > 0 and math.isfinite(limit_rps)):
        return 1.0
    rho = min(max(rate_rps / limit_rps, 0.0), rho_max)
    return 1.0 / (1.0 - rho)


def _round(xs: tuple[float, ...]) -> list[float]:
    return [round(x, 4) for x in xs]
