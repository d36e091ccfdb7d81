"""The decision state machine: pure functions of (settings, state, inputs, now).

``settings`` is a :class:`~controller.config.PolicyConfig`: the decision and pricing groups
only, frozen (``Settings.policy`` builds it), never the environment-reading Settings.

One tick runs, in order:

1. :func:`reconcile` — fold the hook's status into the state: confirm or fail a pending change
   (timeout → failed, with backoff), adopt a change made by someone else.
   :func:`follow_series` — while the hook cannot say what is applied, count the usable scrapes
   in a row that agree on whether vLLM exports SD series (decide adopts what they show).
2. :func:`decide` — override, observation gate, dwell, backoff, acceptance floor, hysteresis
   thresholds and the switch-cost gate, in that order; returns a :class:`Decision`.
3. :func:`record_request` — after the shell asked the hook: pending lock on, or a failure.

No clock, file, environment or network is read here: everything is an argument, so every
edge is a table test and a simulation drives the very same code.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import StrEnum

from controller.assessment import AcceptanceSource, Assessment, pessimistic_speedup
from controller.config import OverrideMode, PolicyConfig
from controller.events import Event, EventKind
from controller.hooks.base import HookPhase, HookStatus
from controller.observation import FailureReason, Observation, ObservationFailure, ObserveResult, load_fell
from controller.risk import (
    HISTORY_BUCKET_S,
    in_startup_hold,
    persisted_since,
    record_acceptance,
    record_rate,
    rented_gain,
)
from controller.state import ControllerState, PendingChange

MAX_RESTART_DURATIONS = 20
# While the hook cannot say what is applied, the metrics decide: this many usable observations
# in a row must agree that vLLM exports (or does not export) SD series before the state follows.
SERIES_AGREE_TICKS = 3
# Little's law: requests in the server ≈ arrival rate × mean latency. An observed latency the
# server's own queue cannot account for (fewer than this fraction of rate × latency running or
# waiting, give or take one request of Poisson noise) is a glitch in the latency sum, not harm.
LITTLE_MIN_FRACTION = 0.5
LITTLE_SLACK_REQUESTS = 1.0
# The rate history the forecast reads: eight days (yesterday and the same weekday last week,
# with room) of HISTORY_BUCKET_S buckets.
HISTORY_KEEP_S = 8 * 86_400.0


class Action(StrEnum):
    NONE = "none"
    ENABLE = "enable"
    DISABLE = "disable"


class Reason(StrEnum):
    # acting
    SPEEDUP_LOW = "speedup_below_disable_threshold"
    SPEEDUP_HIGH = "speedup_above_enable_threshold"
    RISE_AHEAD = "disable_ahead_of_rising_load"  # the restart the rise will force is cheapest now
    ACCEPTANCE_FLOOR = "acceptance_floor"
    OVERRIDE = "override"
    # holding
    STEADY = "within_thresholds"
    ALREADY_APPLIED = "already_applied"
    PENDING = "change_pending"
    DWELL = "dwell"
    BACKOFF = "failure_backoff"
    OBSERVATION = "observation_unusable"
    APPLIED_UNKNOWN = "applied_state_unknown"
    SWITCH_COST = "switch_cost_exceeds_gain"
    ROUND_TRIP = "round_trip_cost_exceeds_gain"  # enabling must also pay the restart back at the peak
    NOT_LASTED = "load_not_lasted_long_enough"  # unforecast load: its gain so far has not paid the restart yet
    EXCURSION = "excursion_shorter_than_restart"  # the signal has not outlasted a restart yet
    STARTUP = "startup_keeps_launched_state"  # no history yet, and the launched state is not wrong
    MODEL_ERROR = "model_error_exceeds_threshold"  # the model misses the running mode: no restart on its word
    # the model-free safety net (safety_net below)
    OBSERVED_SD_HARM = "observed_sd_harm"
    QUEUE_GROWTH = "queue_growth"
    SAFETY_NET_HELD = "safety_net_held_by_switch_cost"
    SLOT_BUSY = "restart_slot_busy"  # fleet: every restart slot is taken (coordination/gate.py)
    COORDINATION_UNAVAILABLE = "coordination_unavailable"  # fleet: no restart without the backend
    FLEET_PLAN = "fleet_plan"  # fleet: k of N on SD, one replica moving per dwell (controller/fleet.py)


class ControllerPhase(StrEnum):
    ENABLED = "enabled"
    DISABLED = "disabled"
    PENDING = "pending"
    FAILED = "failed"
    OVERRIDE = "override"


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: Reason
    detail: str
    desired_enabled: bool | None
    draft_length: int | None
    phase: ControllerPhase
    events: tuple[Event, ...] = ()

    @property
    def acts(self) -> bool:
        return self.action is not Action.NONE


def usable(result: ObserveResult, settings: PolicyConfig) -> ObservationFailure | None:
    """Gate: only fresh, complete observations may move the controller."""
    if isinstance(result, ObservationFailure):
        return result
    if result.sample_age_s is not None and result.sample_age_s > settings.max_observation_age_s:
        return ObservationFailure(FailureReason.STALE, f"newest sample is {result.sample_age_s:.0f}s old")
    if result.arrival_rate_rps is None:
        return ObservationFailure(FailureReason.INCOMPLETE, "no arrival rate")
    if result.arrival_rate_rps < 0:
        return ObservationFailure(FailureReason.INCOMPLETE, "negative arrival rate")
    return None


def _backoff(settings: PolicyConfig, failures: int) -> float:
    return min(settings.failure_backoff_s * 2 ** max(failures - 1, 0), settings.failure_backoff_max_s)


def _fail(state: ControllerState, settings: PolicyConfig, now: float, why: str) -> tuple[ControllerState, Event]:
    failures = state.consecutive_failures + 1
    new = dataclasses.replace(
        state, pending=None, consecutive_failures=failures, retry_not_before=now + _backoff(settings, failures)
    )
    return new, Event(EventKind.CHANGE_FAILED, why)


def _confirm(state: ControllerState, draft_length: int | None, now: float) -> tuple[ControllerState, Event]:
    """The pending change took effect: applied, the dwell starts, failures forgotten."""
    p = state.pending
    assert p is not None
    state = dataclasses.replace(
        state,
        applied_enabled=p.enabled,
        applied_draft_length=draft_length or p.draft_length,
        last_change_at=now,
        pending=None,
        consecutive_failures=0,
        retry_not_before=None,
        low_acceptance_since=None,
    )
    return state, Event(EventKind.CHANGE_CONFIRMED, "on" if p.enabled else "off")


def _restarts_past(p: PendingChange, status: HookStatus) -> int | None:
    """How many restarts the hook made since our request, where that says a later switch
    replaced ours: it serves the other setting, ``ready``, with no ``last_error`` (the launcher
    clears it only on a switch that worked; a rollback reports ``failed``, a crash restart keeps
    its error), two restarts or more on. Exactly two: ours, then theirs. More: ours may have
    rolled back (two restarts) before theirs. None otherwise, the pending timeout's case: a
    request still in flight, a crash restart, a hook that keeps no count."""
    if (
        status.phase is HookPhase.READY
        and status.applied_enabled is not None
        and status.applied_enabled != p.enabled
        and status.last_error is None
        and status.restart_count is not None
        and p.restarts_before is not None
        and status.restart_count >= p.restarts_before + 2
    ):
        return status.restart_count - p.restarts_before
    return None


def _adopt(state: ControllerState, status: HookStatus, now: float) -> tuple[ControllerState, Event]:
    """Someone else switched it (an operator, a redeploy): adopt it, and count it as a change so
    the dwell protects the freshly restarted server."""
    state = dataclasses.replace(
        state,
        applied_enabled=status.applied_enabled,
        applied_draft_length=status.applied_draft_length,
        last_change_at=now,
        low_acceptance_since=None,
    )
    return state, Event(EventKind.EXTERNAL_CHANGE, "on" if status.applied_enabled else "off")


def reconcile(
    state: ControllerState, status: HookStatus, settings: PolicyConfig, now: float
) -> tuple[ControllerState, tuple[Event, ...]]:
    """Fold what the hook reports into the state; returns the new state and events."""
    events: list[Event] = []
    if status.restart_durations_s:
        state = dataclasses.replace(
            state, restart_durations_s=tuple(status.restart_durations_s)[-MAX_RESTART_DURATIONS:]
        )
    p = state.pending
    if p is not None:
        # Ours serves: confirmed. "failed" with ours applied is a later switch (someone else's)
        # that rolled back to ours; our own rollback leaves the other setting.
        if status.phase in (HookPhase.READY, HookPhase.FAILED) and status.applied_enabled == p.enabled:
            state, ev = _confirm(state, status.applied_draft_length, now)
            events.append(ev)
        elif status.phase is HookPhase.FAILED:
            state, ev = _fail(state, settings, now, "hook_reported_failure")
            events.append(ev)
            if status.applied_enabled is not None:
                state = dataclasses.replace(state, applied_enabled=status.applied_enabled)
        elif (past := _restarts_past(p, status)) is not None:
            # Another switch (an operator's, between two ticks) followed ours and serves now.
            # Waiting on would time out a change that is gone, raise a false failure, and give
            # the operator's fresh restart a backoff instead of the dwell. Ours is confirmed
            # where the count says it ran; otherwise it is only superseded (no failure counted,
            # none forgotten).
            if past == 2:
                state, ev = _confirm(state, None, now)
            else:
                state, ev = (
                    dataclasses.replace(state, pending=None),
                    Event(EventKind.CHANGE_SUPERSEDED, "on" if p.enabled else "off"),
                )
            events.append(ev)
            state, adopted = _adopt(state, status, now)
            events.append(adopted)
        elif now - p.issued_at > settings.pending_timeout_s:
            state, ev = _fail(state, settings, now, "timeout")
            events.append(ev)
        return state, tuple(events)
    if status.phase is HookPhase.READY and status.applied_enabled is not None:
        if state.applied_enabled is None:
            state = dataclasses.replace(
                state, applied_enabled=status.applied_enabled, applied_draft_length=status.applied_draft_length
            )
        elif status.applied_enabled != state.applied_enabled:
            state, adopted = _adopt(state, status, now)
            events.append(adopted)
        elif status.applied_draft_length and status.applied_draft_length != state.applied_draft_length:
            state = dataclasses.replace(state, applied_draft_length=status.applied_draft_length)
    return state, tuple(events)


@dataclass(frozen=True)
class SeriesRun:
    """How many usable observations in a row agree on whether vLLM exports SD series.

    Kept by the caller (the loop) between ticks, updated by :func:`follow_series` and read by
    :func:`decide`; empty while the hook reports the applied state or a change is pending.
    """

    present: bool | None = None
    ticks: int = 0


def follow_series(
    run: SeriesRun, state: ControllerState, status: HookStatus, observation: ObserveResult, settings: PolicyConfig
) -> SeriesRun:
    """The run after this tick's observation (``state`` after :func:`reconcile`).

    Only while the hook cannot report the applied state (``applied_enabled`` None: NoHook, an
    ExecHook before its first change or started on a pending lock, an unreadable status);
    otherwise the hook's word rules and the run is empty. With a change of ours pending the run
    can confirm it (:func:`_follow_metrics`). An unusable observation, or one that cannot tell,
    neither counts nor breaks the run.
    """
    if status.applied_enabled is not None:
        return SeriesRun() if run != SeriesRun() else run
    if usable(observation, settings) is not None or not isinstance(observation, Observation):
        return run
    present = observation.sd_series_present
    if present is None:
        return run
    return SeriesRun(present, run.ticks + 1 if run.present == present else 1)


def _follow_metrics(
    state: ControllerState, series: SeriesRun | None, now: float
) -> tuple[ControllerState, Event | None, str | None]:
    """Adopt what the metrics have shown for SERIES_AGREE_TICKS usable ticks when it differs from
    the state. Nothing known yet: it is the first inference (one scrape that lacked the SD
    families must not decide it). Known otherwise: an external change (an operator restarting
    vLLM, or an earlier inference that was wrong). Returns the state, the event, and, while the
    metrics have not agreed for long enough, why the decision should hold.

    With a change of ours pending (the hook cannot say: a controller killed after starting an
    exec hook's script, which finished without it), the metrics showing its target for
    SERIES_AGREE_TICKS confirm it; until then the lock holds (and times out as ever)."""
    if state.pending is not None:
        p = state.pending
        if series is not None and series.present is p.enabled and series.ticks >= SERIES_AGREE_TICKS:
            return (*_confirm(state, None, now), None)
        return state, None, None
    if series is None or series.present is None or series.present == state.applied_enabled:
        return state, None, None
    shown = "on" if series.present else "off"
    if series.ticks < SERIES_AGREE_TICKS:
        held = "unknown" if state.applied_enabled is None else "on" if state.applied_enabled else "off"
        why = f"metrics show SD {shown} for {series.ticks} of {SERIES_AGREE_TICKS} ticks, the state says {held}"
        return state, None, why
    if state.applied_enabled is None:
        return dataclasses.replace(state, applied_enabled=series.present), None, None
    # Counted as a change, as reconcile counts one the hook reports, so the dwell protects the
    # freshly restarted server.
    state = dataclasses.replace(
        state,
        applied_enabled=series.present,
        applied_draft_length=None,
        last_change_at=now,
        low_acceptance_since=None,
    )
    return state, Event(EventKind.EXTERNAL_CHANGE, shown), None


def _phase(state: ControllerState, override: OverrideMode, now: float) -> ControllerPhase:
    if override is not OverrideMode.AUTO:
        return ControllerPhase.OVERRIDE
    if state.pending is not None:
        return ControllerPhase.PENDING
    if state.consecutive_failures and state.retry_not_before is not None and now < state.retry_not_before:
        return ControllerPhase.FAILED
    return ControllerPhase.ENABLED if state.applied_enabled else ControllerPhase.DISABLED


def _remember(state: ControllerState, obs: Observation, a: Assessment, now: float) -> ControllerState:
    """Keep what we will need while SD is off (acceptance) or the server idles (workload)."""
    changes: dict = {"last_rise_rps": a.rise_rps} if a.rise_rps != state.last_rise_rps else {}
    if a.acceptance.source is AcceptanceSource.MEASURED:
        changes.update(
            last_acceptance_rate=a.acceptance.rate,
            last_alpha=a.acceptance.alpha,
            last_acceptance_at=now,
            alpha_history=record_acceptance(state.alpha_history, now, a.acceptance.alpha),
        )
    if obs.arrival_rate_rps is not None:
        changes.update(
            rate_history=record_rate(state.rate_history, now, obs.arrival_rate_rps, HISTORY_BUCKET_S, HISTORY_KEEP_S)
        )
    if obs.mean_prompt_tokens is not None and obs.mean_gen_tokens is not None and obs.mean_gen_tokens > 0:
        changes.update(last_prompt_tokens=obs.mean_prompt_tokens, last_gen_tokens=obs.mean_gen_tokens)
    if a.congested and state.applied_enabled:
        seen = state.sd_congested_rate_rps
        changes.update(
            sd_congested_rate_rps=a.arrival_rate_rps if seen is None else min(seen, a.arrival_rate_rps),
            sd_congested_at=now,
        )
    return dataclasses.replace(state, **changes) if changes else state


def _floor(
    state: ControllerState, a: Assessment, settings: PolicyConfig, now: float
) -> tuple[ControllerState, bool, tuple[Event, ...]]:
    """Track rolling acceptance below the floor; True once it has stayed there long enough."""
    if not state.applied_enabled or a.acceptance.source is not AcceptanceSource.MEASURED:
        return state, False, ()
    if a.acceptance.rate >= settings.acceptance_floor:
        return dataclasses.replace(state, low_acceptance_since=None, floor_tripped_at=None), False, ()
    since = state.low_acceptance_since if state.low_acceptance_since is not None else now
    state = dataclasses.replace(state, low_acceptance_since=since)
    if now - since < settings.acceptance_floor_window_s:
        return state, False, ()
    if state.floor_tripped_at is None:
        return dataclasses.replace(state, floor_tripped_at=now), True, (Event(EventKind.ACCEPTANCE_FLOOR_TRIPPED),)
    return state, True, ()


def _below_floor(a: Assessment, settings: PolicyConfig) -> bool:
    """The acceptance the decision uses was measured (now or last time SD ran) under the floor."""
    return a.acceptance.source is not AcceptanceSource.PRIOR and a.acceptance.rate < settings.acceptance_floor


def decide(
    settings: PolicyConfig,
    state: ControllerState,
    observation: ObserveResult,
    assessment: Assessment | None,
    override: OverrideMode,
    now: float,
    started_at: float | None = None,
    series: SeriesRun | None = None,
) -> tuple[Decision, ControllerState]:
    """The tick's decision and the state after it (before the hook is called).

    ``started_at``: when this controller process started (the startup hold); None: no hold.
    ``series``: what the metrics have said of SD (:func:`follow_series`) while the hook cannot
    report the applied state; None: the caller does not follow the metrics.
    """
    events: list[Event] = []
    gamma = settings.draft_length

    net_hold: tuple[Reason, str] | None = None  # the safety net tripped but does not insist

    def out(action: Action, reason: Reason, detail: str, desired: bool | None, st: ControllerState):
        if action is Action.NONE and net_hold is not None:
            # The net's hold is the news; the model's own reason follows it.
            reason, detail = net_hold[0], f"{net_hold[1]}; model: {reason.value}: {detail}"
        dl = (assessment.draft_length if assessment else gamma) if desired else None
        return Decision(action, reason, detail, desired, dl, _phase(st, override, now), tuple(events)), st

    failure = usable(observation, settings)
    if (
        series is None  # (a caller that follows the metrics waits for them to agree)
        and isinstance(observation, Observation)
        and state.applied_enabled is None
        and observation.sd_series_present is not None
    ):
        state = dataclasses.replace(state, applied_enabled=observation.sd_series_present)
    state, external, contradicted = _follow_metrics(state, series, now)
    if external is not None:
        events.append(external)
    if failure is None and assessment is not None and isinstance(observation, Observation):
        state = _remember(state, observation, assessment, now)

    # 1. Operator override: thresholds and dwell do not apply; the pending lock and backoff do.
    if override is not OverrideMode.AUTO:
        want = override is OverrideMode.ON
        if state.pending is not None:
            return out(Action.NONE, Reason.PENDING, "override waits for the pending change", want, state)
        if contradicted is not None:
            return out(Action.NONE, Reason.APPLIED_UNKNOWN, f"override waits: {contradicted}", want, state)
        if state.applied_enabled == want:
            return out(Action.NONE, Reason.ALREADY_APPLIED, f"override {override.value} is applied", want, state)
        if state.retry_not_before is not None and now < state.retry_not_before:
            return out(Action.NONE, Reason.BACKOFF, f"retry after {state.retry_not_before - now:.0f}s", want, state)
        action = Action.ENABLE if want else Action.DISABLE
        return out(action, Reason.OVERRIDE, f"operator override {override.value}", want, state)

    # 2. A change in flight: hold (vLLM is restarting, so its metrics are expected to be gone).
    if state.pending is not None:
        return out(
            Action.NONE,
            Reason.PENDING,
            f"waiting for {'on' if state.pending.enabled else 'off'}",
            state.pending.enabled,
            state,
        )
    # 3. Never act on missing, NaN, empty or stale data: hold.
    if failure is not None or assessment is None:
        why = failure.reason.value if failure else "no assessment"
        return out(Action.NONE, Reason.OBSERVATION, why, state.applied_enabled, state)
    if contradicted is not None:
        # Acting on a state the metrics contradict would restart vLLM into what it already runs.
        return out(Action.NONE, Reason.APPLIED_UNKNOWN, contradicted, state.applied_enabled, state)
    if state.applied_enabled is None:
        return out(Action.NONE, Reason.APPLIED_UNKNOWN, "hook and metrics do not say whether SD is on", None, state)

    state, floor_hit, floor_events = _floor(state, assessment, settings, now)
    events.extend(floor_events)
    state, net = safety_net(settings, state, observation, assessment, now)
    if net is not None and not floor_hit:
        acted, net_hold = _act_on_net(settings, state, net, assessment, now, out)
        if acted is not None:
            return acted
        # The net does not insist (staying is cheaper than the restart, or the harm is too young
        # to have paid for it): the model's own rule decides, and may still act.
    on = state.applied_enabled
    s = assessment.decision_speedup
    if not on and settings.enable_on_pessimistic_speedup:
        # Enabling is a restart on the model's word: its word net of what the evidence leaves open.
        s = pessimistic_speedup(assessment, settings.enable_posterior_z)
    want_off = on and (floor_hit or s < settings.disable_threshold)
    want_on = (not on) and s > settings.enable_threshold
    # A steady rise toward SD's break-even will force the restart off anyway; once its backlog
    # grows faster than SD's last gains, now is the cheapest time for it.
    early = (
        bool(on)
        and not want_off
        and settings.price_switches
        and settings.disable_ahead_of_rise
        and assessment.early_disable_saving_request_s > settings.rise_saving_margin * assessment.switch_cost_request_s
    )
    want_off = want_off or early
    if want_on and _below_floor(assessment, settings):
        # SD is off and the acceptance it last showed is under the floor: the model may still
        # like SD, but re-enabling would trip the floor again ten minutes later (a flapping loop).
        return out(
            Action.NONE,
            Reason.ACCEPTANCE_FLOOR,
            f"speedup {s:.3f} > {settings.enable_threshold}, but the last measured acceptance "
            f"{assessment.acceptance.rate:.3f} is below the floor {settings.acceptance_floor}",
            on,
            state,
        )
    # The signal the excursion filter times: the switch is wanted *and* the load that is here
    # (or coming by the history) wants it too — not only the recent peak or the two windows'
    # trend the decision weighs.
    t = assessment.trend_speedup
    signal = (want_off and (math.isnan(t) or t < settings.disable_threshold or assessment.applied_overloaded)) or (
        want_on and (math.isnan(t) or t > settings.enable_threshold)
    )
    since, since_enabled = persisted_since(
        state.switch_wanted_since,
        state.switch_wanted_enabled,
        (not on) if signal else None,
        now,
        holding=_short_of_release(settings, state, on, s, t),
    )
    if (since, since_enabled) != (state.switch_wanted_since, state.switch_wanted_enabled):
        state = dataclasses.replace(state, switch_wanted_since=since, switch_wanted_enabled=since_enabled)
    if not (want_off or want_on):
        detail = (
            f"SD on, speedup {s:.3f} >= disable threshold {settings.disable_threshold}"
            if on
            else f"SD off, speedup {s:.3f} <= enable threshold {settings.enable_threshold}"
        )
        return out(Action.NONE, Reason.STEADY, detail, on, state)

    if floor_hit:
        reason, detail = (
            Reason.ACCEPTANCE_FLOOR,
            (
                f"acceptance {assessment.acceptance.rate:.3f} < {settings.acceptance_floor} for "
                f"{now - (state.low_acceptance_since or now):.0f}s"
            ),
        )
    elif early:
        reason, detail = (
            Reason.RISE_AHEAD,
            f"speedup {s:.3f}, but the load's rise makes the rule disable SD in "
            f"{assessment.rule_disable_in_s or 0.0:.0f}s at a dearer restart: now saves "
            f"{assessment.early_disable_saving_request_s:.0f} req·s",
        )
    elif want_off:
        reason, detail = Reason.SPEEDUP_LOW, f"speedup {s:.3f} < {settings.disable_threshold}"
    else:
        reason, detail = Reason.SPEEDUP_HIGH, f"speedup {s:.3f} > {settings.enable_threshold}"
    if assessment.cycling and not floor_hit:
        detail += " over the load's cycle (through the break-even three times in two hours)"
    if assessment.acceptance_trend_per_s is not None and not floor_hit:
        per_h = assessment.acceptance_trend_per_s * 3600.0
        detail += f", the gain following acceptance {'falling' if per_h < 0 else 'rising'} {abs(per_h):.2f}/h"

    # 4. Necessary conditions on top of the thresholds: startup hold, dwell, backoff, the
    #    excursion filter, and the price of the switch (with the way back when enabling).
    # The risk terms belong to the priced rule: price_switches=false is thresholds, dwell and lock only.
    risk = settings.price_switches and not floor_hit
    if risk and not assessment.applied_overloaded and in_startup_hold(now, started_at, settings.startup_hold_s):
        left = settings.startup_hold_s - (now - (started_at or now))
        return out(
            Action.NONE,
            Reason.STARTUP,
            f"{detail}; launched state kept {left:.0f}s more (it is not overloaded)",
            on,
            state,
        )
    err = assessment.model_error_ratio
    if (
        risk
        and not assessment.applied_overloaded
        and not assessment.cycling
        and err is not None
        and err > 0
        and abs(math.log(err)) > math.log1p(settings.model_error_threshold)
    ):
        # A model that mispredicts the state it watches (a calibration from another server,
        # a driver upgrade) would price the other state just as wrongly: the correction
        # catches up first. Overload and the safety net still act, and so does a cycling load,
        # whose few steady ticks are its turns, with the crest's queue still draining.
        return out(
            Action.NONE,
            Reason.MODEL_ERROR,
            f"{detail}; observed/predicted latency {err:.2f} beyond ±{settings.model_error_threshold:.0%}",
            on,
            state,
        )
    if state.last_change_at is not None and now - state.last_change_at < settings.dwell_s:
        left = settings.dwell_s - (now - state.last_change_at)
        return out(Action.NONE, Reason.DWELL, f"{detail}; dwell holds {left:.0f}s more", on, state)
    if state.retry_not_before is not None and now < state.retry_not_before:
        left = state.retry_not_before - now
        return out(Action.NONE, Reason.BACKOFF, f"{detail}; retry after {left:.0f}s", on, state)
    lasted = now - (state.switch_wanted_since if state.switch_wanted_since is not None else now)
    if risk and not early and lasted < assessment.excursion_filter_s:
        return out(
            Action.NONE,
            Reason.EXCURSION,
            f"{detail}; wanted for {lasted:.0f}s < {assessment.excursion_filter_s:.0f}s (restart + drain)",
            on,
            state,
        )
    if settings.price_switches and not floor_hit and not early:
        # (Disabling ahead of the rise was priced against the later restart it replaces.)
        gain, cost = assessment.projected_gain_request_s, assessment.switch_cost_request_s
        back = assessment.undo_cost_request_s if want_on else 0.0
        rented = gain
        if risk and settings.load_age_prior and not assessment.horizon_forecast:
            # Unless something forecasts the load, a switch's gain counts only as far as the
            # load's age vouches for it, either way: a quiet load that turns catches SD with a
            # dear restart back, and a busy one that ends leaves SD off at low load after a
            # restart at the worst time. Leaving an overload (an infinite gain) pays no rent.
            rented = rented_gain(gain, lasted, assessment.gain_horizon_s)
        if gain > settings.switch_margin * (cost + back) and not rented > settings.switch_margin * (cost + back):
            return out(
                Action.NONE,
                Reason.NOT_LASTED,
                f"{detail}; no forecast of how long this load lasts: its gain over the {lasted:.0f}s it "
                f"has held, {rented:.0f} req·s, < {settings.switch_margin}× (cost {cost:.0f} req·s"
                + (f" + the restart back {back:.0f} req·s)" if back else ")"),
                on,
                state,
            )
        if not (math.isinf(gain) and gain > 0) and not gain > settings.switch_margin * (cost + back):
            why = Reason.SWITCH_COST if gain <= settings.switch_margin * cost else Reason.ROUND_TRIP
            extra = f" + the restart back at the expected peak {back:.0f} req·s" if back else ""
            return out(
                Action.NONE,
                why,
                f"{detail}; gain {gain:.0f} req·s < {settings.switch_margin}× (cost {cost:.0f} req·s{extra})",
                on,
                state,
            )
    action = Action.DISABLE if want_off else Action.ENABLE
    return out(action, reason, detail, not on, state)


def _short_of_release(settings: PolicyConfig, state: ControllerState, on: bool, s: float, t: float) -> bool:
    """Whether a switch signal that lapsed this tick is still short of the hysteresis band's
    middle (both the decision's speedup and the trend's): its persistence clock keeps running."""
    mid = (settings.disable_threshold + settings.enable_threshold) / 2.0
    if state.switch_wanted_enabled is None or state.switch_wanted_enabled == on:
        return False
    speeds = [x for x in (s, t) if not math.isnan(x)]
    if on:
        return all(x < mid for x in speeds)
    return all(x > mid for x in speeds)


@dataclass(frozen=True)
class NetTrip:
    """The safety net wants SD off: why, and what staying on is expected to cost (request·s)."""

    reason: Reason
    detail: str
    stay_cost_request_s: float
    horizon_s: float = 0.0  # what the stay cost is counted over


def safety_net(
    settings: PolicyConfig, state: ControllerState, obs: Observation, a: Assessment, now: float
) -> tuple[ControllerState, NetTrip | None]:
    """Model-free checks with SD on; counts consecutive ticks in the state.

    * **observed SD harm**: the observed mean latency exceeds ``sd_harm_margin`` times what the
      (corrected) model predicts for SD *off* at the same load. Not while the load is falling
      (:func:`observation.load_fell`): the latency is a window mean over minutes, and after a
      drop it still holds requests that met the heavier load, against a prediction at the lighter
      one (a drop to idle read as harm and disabled SD where it pays most);
    * **queue growth**: vLLM's waiting queue is non-empty and grows tick after tick.

    Each trips after ``safety_net_ticks`` ticks in a row. Ticks with SD off, during the settle
    time after a restart (a backlog drains) or without the data reset the counts.
    """
    reset = dataclasses.replace(
        state, sd_harm_ticks=0, queue_growth_ticks=0, last_waiting=None, queue_growth_from=None, queue_growth_since=None
    )
    settling = state.last_change_at is not None and now - state.last_change_at < settings.evidence_settle_s
    if not settings.safety_net or not state.applied_enabled or settling:
        return (reset if state != reset else state), None
    n = settings.safety_net_ticks
    horizon = max(a.gain_horizon_s, settings.dwell_s)
    rate = a.arrival_rate_rps
    observed, off = obs.mean_e2e_latency_s, a.latency_off_s
    harm = (
        observed is not None
        and math.isfinite(off)
        and observed > settings.sd_harm_margin * off
        and _little_consistent(obs, observed)
        and not load_fell(rate, obs.arrival_rate_long_rps, settings.rate_window_s)
    )
    harm_ticks = state.sd_harm_ticks + 1 if harm else 0
    waiting, last = obs.waiting, state.last_waiting
    growing = waiting is not None and last is not None and waiting > 0 and waiting > last
    grow_ticks = state.queue_growth_ticks + 1 if growing else 0
    grow_from = (state.queue_growth_from if state.queue_growth_ticks else last) if growing else None
    # The run began at the previous tick, when the queue held ``last``.
    start = now - settings.evaluation_interval_s
    grow_since = (state.queue_growth_since if state.queue_growth_ticks else start) if growing else None
    state = dataclasses.replace(
        state,
        sd_harm_ticks=harm_ticks,
        queue_growth_ticks=grow_ticks,
        last_waiting=waiting,
        queue_growth_from=grow_from,
        queue_growth_since=grow_since,
    )
    if grow_ticks >= n and waiting is not None:
        span = max(now - (grow_since if grow_since is not None else start), settings.evaluation_interval_s)
        slope = (waiting - (grow_from or 0.0)) / span  # requests per second the queue gains
        # Staying: today's queue waits the whole horizon, and it keeps growing (a triangle).
        stay = waiting * horizon + 0.5 * slope * horizon * horizon
        detail = f"waiting queue grew {grow_ticks} ticks in a row to {waiting:.0f} (+{slope * 60:.1f}/min)"
        return state, NetTrip(Reason.QUEUE_GROWTH, detail, stay, horizon)
    if harm_ticks >= n and observed is not None:
        stay = rate * horizon * (observed - off)
        detail = (
            f"observed {observed:.2f}s > {settings.sd_harm_margin}× predicted SD-off {off:.2f}s for {harm_ticks} ticks"
        )
        return state, NetTrip(Reason.OBSERVED_SD_HARM, detail, stay, horizon)
    return state, None


def _little_consistent(obs: Observation, latency_s: float) -> bool:
    """Whether the requests in the server could carry ``latency_s`` at the observed arrival rate.

    The latency is a window mean of vLLM's sum/count, which one glitch in the sum can make
    absurd; running + waiting are gauges read independently of it. By Little's law a real mean
    latency W at rate λ keeps about λ·W requests in the server, so far fewer than that means the
    latency is not what the server is doing. Unknown running or waiting: no check.
    """
    if obs.running is None or obs.waiting is None or obs.arrival_rate_rps is None:
        return True
    in_server = obs.running + obs.waiting
    return in_server + LITTLE_SLACK_REQUESTS >= LITTLE_MIN_FRACTION * obs.arrival_rate_rps * latency_s


def _act_on_net(settings: PolicyConfig, state: ControllerState, net: NetTrip, a: Assessment, now: float, out):
    """Disable on a safety-net trip, unless dwell or backoff hold: ``(decision, None)``.
    ``(None, (reason, detail))`` when the net does not insist: the harm is shorter than a
    restart's recovery, staying is cheaper than the priced restart, or, with nothing to forecast
    the load, the harm is too young to have paid for it (risk.rented_gain). Then the model's own
    rule decides."""
    on = state.applied_enabled
    if state.last_change_at is not None and now - state.last_change_at < settings.dwell_s:
        left = settings.dwell_s - (now - state.last_change_at)
        return out(Action.NONE, Reason.DWELL, f"{net.detail}; dwell holds {left:.0f}s more", on, state), None
    if state.retry_not_before is not None and now < state.retry_not_before:
        left = state.retry_not_before - now
        return out(Action.NONE, Reason.BACKOFF, f"{net.detail}; retry after {left:.0f}s", on, state), None
    ticks = state.queue_growth_ticks if net.reason is Reason.QUEUE_GROWTH else state.sd_harm_ticks
    lasted = ticks * settings.evaluation_interval_s
    if settings.price_switches and lasted < a.excursion_filter_s:
        # The same excursion filter as the model's signal: harm shorter than a restart is over
        # before the restart could help.
        detail = f"{net.detail}; for {lasted:.0f}s < {a.excursion_filter_s:.0f}s (restart + drain)"
        return None, (Reason.EXCURSION, detail)
    cost = a.switch_cost_request_s
    stay = net.stay_cost_request_s
    if settings.price_switches and not stay > settings.switch_margin * cost:
        detail = (
            f"{net.reason.value}: {net.detail}; staying costs {stay:.0f} req·s "
            f"< {settings.switch_margin}× restart {cost:.0f} req·s"
        )
        return None, (Reason.SAFETY_NET_HELD, detail)
    if (
        settings.price_switches
        and settings.load_age_prior
        and net.reason is Reason.OBSERVED_SD_HARM
        and not a.horizon_forecast
    ):
        # Nothing says how long this load lasts: what the harm has cost so far must pay for the
        # restart first (a growing queue needs no rent: it does not end by itself).
        paid = rented_gain(stay, lasted, net.horizon_s)
        if not paid > settings.switch_margin * cost:
            detail = (
                f"{net.reason.value}: {net.detail}; no forecast of how long this load lasts: the harm "
                f"over the {lasted:.0f}s it has held, {paid:.0f} req·s, < {settings.switch_margin}× "
                f"restart {cost:.0f} req·s"
            )
            return None, (Reason.NOT_LASTED, detail)
    # Remember it like a seen congestion, so the model cannot re-enable SD into it right away.
    seen = state.sd_congested_rate_rps
    state = dataclasses.replace(
        state,
        sd_congested_rate_rps=a.arrival_rate_rps if seen is None else min(seen, a.arrival_rate_rps),
        sd_congested_at=now,
    )
    detail = f"{net.detail}; staying costs {stay:.0f} req·s, restart {cost:.0f} req·s"
    return out(Action.DISABLE, net.reason, detail, False, state), None


def begin_request(
    state: ControllerState, decision: Decision, now: float, restart_count: int | None = None
) -> ControllerState:
    """The pending lock, written *before* the hook is called: a crash then cannot leave a change
    issued but unrecorded (at worst a pending change that times out and is retried).
    ``restart_count``: the hook's, this tick (a later switch is told from ours by it)."""
    assert decision.acts and decision.desired_enabled is not None
    return dataclasses.replace(
        state,
        pending=PendingChange(
            decision.desired_enabled, decision.draft_length, now, decision.reason.value, restart_count
        ),
    )


def record_request(
    state: ControllerState, settings: PolicyConfig, accepted: bool, now: float, uncertain: bool = False
) -> tuple[ControllerState, tuple[Event, ...]]:
    """After the hook call: keep the lock if accepted, else count a failure and back off.

    An uncertain outcome (the request timed out after it was sent) keeps the lock too: the
    change may be in flight, and the hook's status (or the pending timeout) will tell.
    """
    if accepted:
        return state, (Event(EventKind.CHANGE_REQUESTED),)
    if uncertain:
        return state, (Event(EventKind.CHANGE_UNCERTAIN),)
    state, ev = _fail(state, settings, now, "hook_refused")
    return state, (ev,)
