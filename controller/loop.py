"""The tick loop: the imperative shell around the pure model and policy.

    status  = hook.status()                      (what is applied, is a change pending)
    state   = policy.reconcile(state, status)
    obs     = source.observe(now)
    series  = policy.follow_series(series, state, status, obs)   (what the metrics say of SD)
    a       = assessment.assess(model, obs, state)   (when the observation is usable; a model
                                                      that cannot price it holds the tick)
    d, state = policy.decide(state, obs, a, override, now, series)
    hook.request(d) / exporter.record(...) / state_store.save(state)

Everything with I/O is injected (clock, source, hook, registry, state store, override reader,
notifier), so a test, a simulation or a backtest runs this very loop on virtual time.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import requests
import structlog
from prometheus_client import CollectorRegistry

from controller import deadline, policy
from controller.assessment import Assessment, assess
from controller.config import OverrideMode, PolicyConfig
from controller.coordination.gate import RestartGate
from controller.events import Event, EventKind
from controller.exporter import Exporter
from controller.fleet import FleetRouting, decide_for_fleet
from controller.hooks.base import ChangeRequest, Hook, HookError, HookStatus
from controller.learning import Learned, Learner
from controller.model import LatencyModel
from controller.observation import FailureReason, Observation, ObservationFailure, ObserveResult
from controller.policy import Decision
from controller.settings import Settings
from controller.sources.base import Source
from controller.sources.fleet import priced_for_fleet
from controller.state import ControllerState, clamp_to_clock
from controller.state_store import MemoryStateStore, StateStore

log = structlog.get_logger("sd_controller")


@dataclass(frozen=True)
class TickResult:
    now: float
    observation: ObserveResult
    assessment: Assessment | None
    decision: Decision
    state: ControllerState
    events: tuple[Event, ...]
    acted: bool  # the hook accepted a change this tick
    hook_status: HookStatus
    failure: ObservationFailure | None = None  # why the observation could not be used, if it could not
    learned: Learned | None = None  # evidence recorded and what it taught the model


def override_from_file(path: Path | None, default: OverrideMode) -> Callable[[], OverrideMode]:
    """Reader for the runtime override file: auto|on|off; absent file -> the configured mode.

    Unreadable or invalid content is logged and ignored (the configured mode stays): a typo in
    an operator's file must not restart a server.
    """

    def read() -> OverrideMode:
        if path is None:
            return default
        try:
            text = path.read_text(encoding="utf-8").strip().lower()
        except FileNotFoundError:
            return default
        except OSError as exc:
            log.error("override_file_unreadable", path=str(path), error=exc.strerror or str(exc))
            return default
        except ValueError as exc:
            # UnicodeDecodeError (a ValueError): UTF-16 as PowerShell writes it, a binary byte.
            why = f"not UTF-8 text: {exc.reason}" if isinstance(exc, UnicodeDecodeError) else str(exc)
            log.error("override_file_unreadable", path=str(path), error=why.splitlines()[0][:200])
            return default
        if not text:
            return default
        try:
            return OverrideMode(text)
        except ValueError:
            log.error("override_file_invalid", path=str(path), content=text[:40], expected="auto|on|off")
            return default

    return read


class WebhookNotifier:
    """POSTs a JSON notice for events operators must see (floor trips, failed changes)."""

    def __init__(self, url: str | None, timeout_s: float = 5.0, session: requests.Session | None = None):
        self.url = url
        self.timeout_s = timeout_s
        self._session = deadline.session(session)

    def __call__(self, event: str, payload: dict) -> None:
        if not self.url:
            return
        try:
            deadline.request(self._session, "POST", self.url, self.timeout_s, json={"event": event, **payload})
        except requests.RequestException as exc:
            log.warning("webhook_failed", event=event, error=type(exc).__name__)


NOTIFY_EVENTS = (EventKind.ACCEPTANCE_FLOOR_TRIPPED, EventKind.CHANGE_FAILED)
FAILED_TICKS_UNHEALTHY = 3


class Controller:
    """One vLLM server's controller. Call :meth:`tick` once per evaluation interval."""

    def __init__(
        self,
        settings: Settings,
        model: LatencyModel,
        source: Source,
        hook: Hook,
        clock: Callable[[], float],
        registry: CollectorRegistry | None = None,
        state_store: StateStore | None = None,
        dry_run: bool = False,
        override: Callable[[], OverrideMode] | None = None,
        notify: Callable[[str, dict], None] | None = None,
        state: ControllerState | None = None,
        learner: Learner | None = None,
        gate: RestartGate | None = None,
    ) -> None:
        """``state``: the state to start from, when the caller has loaded it already (the
        state file is read once); otherwise ``state_store.load()``."""
        self.settings = settings
        self.policy_config = settings.policy  # all the pure core sees of the settings
        self.model = model
        self.source = source
        self.hook = hook
        self.clock = clock
        self.exporter = Exporter(registry if registry is not None else CollectorRegistry())
        self.exporter.configure(settings.evaluation_interval_s, settings.pending_timeout_s)
        self.store = state_store or MemoryStateStore()
        self.dry_run = dry_run
        self.override = override or (lambda: settings.override)
        self.notify = notify or (lambda event, payload: None)
        self.state = state if state is not None else self.store.load()
        self.started_at = clock()
        self.last_tick_at: float | None = None
        self.failed_ticks = 0  # consecutive ticks that raised
        self.last_tick_error: str | None = None
        self._lock = threading.Lock()  # one tick at a time, even if called from two threads
        # Evidence and online correction (memory-backed unless the daemon passes file stores).
        self.learner = learner if learner is not None else Learner(settings, model)
        self.gate = gate  # fleet mode: a restart slot before each restart (coordination/gate.py)
        if gate is not None:
            gate.register(self.registry)
        self._prefix_caching_seen: bool | None = None  # the server's, last time it said
        # What the metrics have said of SD while the hook cannot (policy.follow_series).
        self._series = policy.SeriesRun()
        self._assessment_error: str | None = None  # the last tick's, so a run of them logs once
        self._calibrated_prefix_caching = model.prefix_caching  # what the calibration recorded

    @property
    def registry(self) -> CollectorRegistry:
        return self.exporter.registry

    def tick(self) -> TickResult:
        with self._lock:
            return self._tick()

    def _tick(self) -> TickResult:
        s = self.policy_config
        now = self.clock()
        state, clamped = clamp_to_clock(self.state, now, s.failure_backoff_max_s)
        if clamped:
            log.warning("state_time_in_future", fields=list(clamped), now=now, detail="clamped to now")
        status = self.hook.status()
        state, events = policy.reconcile(state, status, s, now)
        obs = self.source.observe(now)
        if isinstance(obs, Observation):
            self._check_prefix_caching(obs.prefix_caching)
        s = priced_for_fleet(s, obs)  # fleet mode: a restart is a dip of one of the replicas serving now
        override = self.override()
        failure = policy.usable(obs, s)
        self._series = policy.follow_series(self._series, state, status, obs, s)
        assessment, learned, assess_error = None, None, None
        try:
            assessment, learned = self._assess(s, state, obs, failure, status, now)
        except (ValueError, ArithmeticError) as exc:
            # Absurd but finite inputs (a 1e150-token mean prompt) can break the model's
            # arithmetic. That is one unusable observation, held like the others, not a failing
            # tick: a run of those would get the pod restarted for a bad scrape.
            assess_error = f"assessment failed: {type(exc).__name__}: {exc}".splitlines()[0][:200]
            assessment, learned = None, None
            failure = ObservationFailure(FailureReason.IMPLAUSIBLE, assess_error)
            if assess_error != self._assessment_error:
                log.warning("assessment_failed", error=assess_error, detail="held; logged once while it repeats")
        self._assessment_error = assess_error
        decision, state = policy.decide(
            s, state, obs, assessment, override, now, started_at=self.started_at, series=self._series
        )
        if assess_error is not None and decision.reason is policy.Reason.OBSERVATION:
            decision = dataclasses.replace(decision, detail=assess_error)
        if self.gate is not None and assessment is not None and isinstance(obs, Observation):
            decision = self._fleet_plan(decision, state, obs, assessment, now)  # fleet mode: k of N (fleet.py)
        events = events + decision.events
        acted = False
        if self.gate is not None and not self.dry_run:
            decision = self.gate.admit(decision)
        if decision.acts and not self.dry_run:
            # The pending lock is saved before the hook is called (see policy.begin_request).
            state = policy.begin_request(state, decision, now, status.restart_count)
            self.store.save(state)
            change = ChangeRequest(
                enabled=bool(decision.desired_enabled),
                num_speculative_tokens=decision.draft_length,
                reason=f"{decision.reason.value}: {decision.detail}",
                predicted_speedup=assessment.predicted_speedup if assessment else None,
                requested_at=now,
            )
            uncertain = False
            try:
                self.hook.request(change)
                acted = True
            except HookError as exc:
                uncertain = exc.uncertain
                log.error("hook_request_failed", error=str(exc), desired_enabled=change.enabled, uncertain=uncertain)
            state, more = policy.record_request(state, s, acted, now, uncertain)
            events = events + more
        self.state = state
        if self.gate is not None:
            self.gate.settle(state, events)
        self.store.save(state)
        self.last_tick_at = now
        self.failed_ticks, self.last_tick_error = 0, None
        # While a restart is pending, missing metrics are expected, not a fault worth counting.
        fail_reason = failure.reason if failure is not None and decision.reason is policy.Reason.OBSERVATION else None
        observed = obs.mean_e2e_latency_s if isinstance(obs, Observation) else None
        self.exporter.record(now, state, decision, assessment, fail_reason, observed, events)
        self.exporter.record_learning(self.learner, learned, assessment)
        self._log(now, decision, assessment, failure, override, events, acted)
        for ev in events:
            if ev.kind in NOTIFY_EVENTS:
                self.notify(ev.kind.value, {"detail": str(ev), "reason": decision.reason.value, "time": now})
        return TickResult(now, obs, assessment, decision, state, events, acted, status, failure, learned)

    def _assess(
        self,
        s: PolicyConfig,
        state: ControllerState,
        obs: ObserveResult,
        failure: ObservationFailure | None,
        status: HookStatus,
        now: float,
    ) -> tuple[Assessment | None, Learned]:
        """The model's view of a usable observation, and what it taught the learner.

        Raises what the model raises (ValueError, ArithmeticError) on inputs it cannot price.
        """
        assessment = None
        if failure is None and isinstance(obs, Observation):
            assessment = assess(
                self.learner.model, s, state, obs, state.applied_enabled, state.applied_draft_length, now
            )
        learned = self.learner.learn(now, state, obs, assessment, status)
        if assessment is not None and state.applied_enabled is not None:
            ratio = self.learner.posterior.error_ratio("on" if state.applied_enabled else "off")
            assessment = dataclasses.replace(assessment, model_error_ratio=ratio)
            if state.applied_enabled is False and s.enable_posterior_z > 0 and s.enable_on_pessimistic_speedup:
                # Enabling is judged at the pessimistic end of what the evidence leaves open.
                sd = self.learner.speedup_log_sd(assessment)
                assessment = dataclasses.replace(assessment, speedup_log_sd=sd)
        return assessment, learned

    def _check_prefix_caching(self, said: bool | None) -> None:
        """Price a full KV cache by the server's own prefix caching, once per setting it reports.

        A preemption there recomputes 1 + r² of the prompts with it and 1 + r without, and
        prompts stranded between their chunks waste them only without it (model._kv_thrash_rps),
        so the limit moves with the setting; the step costs do not. With
        ``follow_prefix_caching`` the loop's model, the learner's and the fleet plan's follow
        the server (logged ``prefix_caching_repriced``); without it they keep the calibration's
        and the loop warns (``prefix_caching_differs``). A server that stops saying keeps the
        last setting it said.
        """
        if said is None or said == self._prefix_caching_seen:
            return
        self._prefix_caching_seen = said
        calibrated = self._calibrated_prefix_caching
        if not self.settings.follow_prefix_caching:
            if said != calibrated:
                log.warning(
                    "prefix_caching_differs",
                    server=said,
                    calibration=calibrated,
                    detail="the KV-full limit is priced for the other setting: re-bench, or calibrate --prefix-caching"
                    f" {'on' if said else 'off'}",
                )
            return
        if said == self.model.prefix_caching:
            return
        self.model = dataclasses.replace(self.model, prefix_caching=said)
        self.learner.reprice(dataclasses.replace(self.learner.base, prefix_caching=said))
        log.warning(
            "prefix_caching_repriced",
            server=said,
            calibration=calibrated,
            detail="the KV-full limit is priced as the server runs"
            + ("" if said == calibrated else f"; to record it: calibrate --prefix-caching {'on' if said else 'off'}"),
        )

    def _fleet_plan(
        self, decision: Decision, state: ControllerState, obs: Observation, a: Assessment, now: float
    ) -> Decision:
        """The policy's decision under the fleet's plan (``fleet_routing``), when one is set."""
        routing = FleetRouting(self.settings.fleet_routing)
        if routing is FleetRouting.NONE or self.gate is None:
            return decision
        view = self.gate.fleet_view(state.applied_enabled, now)
        if view is None:
            return decision
        decision, plan = decide_for_fleet(
            routing, self.model, self.policy_config, decision, a, obs, self.gate.replica_id, *view, now
        )
        if plan is not None:
            self.gate.record_plan(plan.sd_now, plan.sd_target)
            log.info(
                "fleet_plan",
                sd_now=plan.sd_now,
                sd_best=plan.sd_best,
                sd_target=plan.sd_target,
                replicas=plan.replicas,
                latency_now_s=_r(plan.latency_now_s),
                latency_target_s=_r(plan.latency_target_s),
                fleet_speedup=None if math.isnan(plan.speedup) else _r(plan.speedup),
                gain_request_s=_r(plan.gain_request_s),
                cost_request_s=_r(plan.cost_request_s),
            )
        return decision

    def _log(
        self,
        now: float,
        d: Decision,
        a: Assessment | None,
        failure: object,
        override: OverrideMode,
        events: tuple[Event, ...],
        acted: bool,
    ) -> None:
        fields: dict = {
            "time": now,
            "action": d.action.value,
            "reason": d.reason.value,
            "detail": d.detail,
            "phase": d.phase.value,
            "applied_enabled": self.state.applied_enabled,
            "override": override.value,
            "enable_threshold": self.settings.enable_threshold,
            "disable_threshold": self.settings.disable_threshold,
            "dry_run": self.dry_run,
            "acted": acted,
        }
        if events:
            fields["events"] = [str(e) for e in events]
        if failure is not None:
            fields["observation_failure"] = getattr(getattr(failure, "reason", None), "value", str(failure))
            fields["observation_detail"] = getattr(failure, "detail", "")
        if a is not None:
            fields.update(
                arrival_rate_rps=round(a.arrival_rate_rps, 4),
                projected_rate_rps=round(a.projected_rate_rps, 4),
                acceptance_rate=round(a.acceptance.rate, 4),
                acceptance_source=a.acceptance.source.value,
                predicted_speedup=_r(a.predicted_speedup),
                decision_speedup=_r(a.decision_speedup),
                draft_length=a.draft_length,
                best_draft_length=a.best_draft_length,
                break_even_rate_rps=None if a.break_even_rate_rps is None else round(a.break_even_rate_rps, 4),
                switch_cost_request_s=_r(a.switch_cost_request_s),
                projected_gain_request_s=_r(a.projected_gain_request_s),
                restart_downtime_s=round(a.restart_downtime_s, 2),
                gain_horizon_s=round(a.gain_horizon_s, 1),
            )
        level = log.warning if (d.acts or any(e.kind is EventKind.CHANGE_FAILED for e in events)) else log.info
        level("decision", **fields)

    def tick_failed(self, exc: BaseException) -> None:
        """Record a tick that raised (the loop goes on; /healthz tells)."""
        self.failed_ticks += 1
        self.last_tick_error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]

    def healthy(self) -> tuple[bool, str]:
        """Alive and ticking: no run of failing ticks, the last good one no older than three intervals.

        One failed tick is reported but still healthy (a transient error must not get the pod
        killed); FAILED_TICKS_UNHEALTHY in a row are not.
        """
        window = 3 * self.settings.evaluation_interval_s
        if self.failed_ticks >= FAILED_TICKS_UNHEALTHY:
            return False, f"failing: {self.failed_ticks} ticks in a row, last: {self.last_tick_error}"
        since = self.clock() - (self.last_tick_at if self.last_tick_at is not None else self.started_at)
        if self.last_tick_at is None:
            if since > window:
                return False, f"no tick completed in {since:.0f}s" + (
                    f", last: {self.last_tick_error}" if self.last_tick_error else ""
                )
            return True, "starting" + (f" (last tick failed: {self.last_tick_error})" if self.failed_ticks else "")
        if since > window:
            return False, f"last tick {since:.0f}s ago"
        if self.failed_ticks:
            return True, f"ok (last tick failed: {self.last_tick_error})"
        return True, "ok"


def _r(x: float) -> float | str:
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def run_loop(
    controller: Controller,
    stop: threading.Event,
    interval_s: float,
    max_ticks: int | None = None,
) -> int:
    """Tick until ``stop`` is set; ``stop.wait`` makes SIGTERM cut the sleep, never a tick.

    Returns the number of ticks run. A tick that raises is logged and the loop goes on: a
    controller that dies on a bad tick would leave its server in whatever state it was.
    """
    ticks = 0
    while not stop.is_set():
        try:
            controller.tick()
        except Exception as exc:
            log.exception("tick_failed")
            controller.exporter.failures.labels("tick_error").inc()
            controller.tick_failed(exc)
        ticks += 1
        if max_ticks is not None and ticks >= max_ticks:
            break
        stop.wait(interval_s)
    return ticks
