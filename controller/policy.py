"""The decision state machine: pure functions of (settings, state, inputs, now).

``settings`` is a :class:`~controller.config.PolicyConfig`: the decision and pricing groups
only, frozen (``Settings.policy`` builds it), never the environment-reading Settings.

One tick runs, in order:

1. :func:`reconcile` — fold the hook's status into the state: confirm or fail a pending change
   (timeout → failed, with backoff), adopt a change made by someone else.
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

from controller.assessment import AcceptanceSource, Assessment
from controller.config import OverrideMode, PolicyConfig
from controller.hooks.base import HookPhase, HookStatus
from controller.observation import FailureReason, Observation, ObservationFailure, ObserveResult
from controller.risk import in_startup_hold, persisted_since, record_rate
from controller.state import ControllerState, PendingChange

MAX_RESTART_DURATIONS = 20
# The rate history the forecast reads: one bucket per 5 minutes, eight days (yesterday and
# the same weekday last week, with room): at most 2305 pairs in the state file.
HISTORY_BUCKET_S = 300.0
HISTORY_KEEP_S = 8 * 86_400.0


class Action(StrEnum):
    NONE = "none"
    ENABLE = "enable"
    DISABLE = "disable"


class Reason(StrEnum):
    # acting
    SPEEDUP_LOW = "speedup_below_disable_threshold"
    SPEEDUP_HIGH = "speedup_above_enable_threshold"
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
    EXCURSION = "excursion_shorter_than_restart"  # the signal has not outlasted a restart yet
    STARTUP = "startup_keeps_launched_state"  # no history yet, and the launched state is not wrong
    SLOT_BUSY = "restart_slot_busy"  # fleet: every restart slot is taken (coordination/gate.py)
    COORDINATION_UNAVAILABLE = "coordination_unavailable"  # fleet: no restart without the backend


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
    events: tuple[str, ...] = ()

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


def _fail(state: ControllerState, settings: PolicyConfig, now: float, why: str) -> tuple[ControllerState, str]:
    failures = state.consecutive_failures + 1
    new = dataclasses.replace(
        state, pending=None, consecutive_failures=failures, retry_not_before=now + _backoff(settings, failures)
    )
    return new, f"change_failed:{why}"


def reconcile(
    state: ControllerState, status: HookStatus, settings: PolicyConfig, now: float
) -> tuple[ControllerState, tuple[str, ...]]:
    """Fold what the hook reports into the state; returns the new state and events."""
    events: list[str] = []
    if status.restart_durations_s:
        state = dataclasses.replace(
            state, restart_durations_s=tuple(status.restart_durations_s)[-MAX_RESTART_DURATIONS:]
        )
    p = state.pending
    if p is not None:
        if status.phase is HookPhase.READY and status.applied_enabled == p.enabled:
            state = dataclasses.replace(
                state,
                applied_enabled=p.enabled,
                applied_draft_length=status.applied_draft_length or p.draft_length,
                last_change_at=now,
                pending=None,
                consecutive_failures=0,
                retry_not_before=None,
                low_acceptance_since=None,
            )
            events.append(f"change_confirmed:{'on' if p.enabled else 'off'}")
        elif status.phase is HookPhase.FAILED:
            state, ev = _fail(state, settings, now, "hook_reported_failure")
            events.append(ev)
            if status.applied_enabled is not None:
                state = dataclasses.replace(state, applied_enabled=status.applied_enabled)
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
            # Someone else switched it (an operator, a redeploy): adopt it, and count it as a
            # change so the dwell protects the freshly restarted server.
            state = dataclasses.replace(
                state,
                applied_enabled=status.applied_enabled,
                applied_draft_length=status.applied_draft_length,
                last_change_at=now,
                low_acceptance_since=None,
            )
            events.append(f"external_change:{'on' if status.applied_enabled else 'off'}")
        elif status.applied_draft_length and status.applied_draft_length != state.applied_draft_length:
            state = dataclasses.replace(state, applied_draft_length=status.applied_draft_length)
    return state, tuple(events)


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
    changes: dict = {}
    if a.acceptance.source is AcceptanceSource.MEASURED:
        changes.update(last_acceptance_rate=a.acceptance.rate, last_alpha=a.acceptance.alpha, last_acceptance_at=now)
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
) -> tuple[ControllerState, bool, tuple[str, ...]]:
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
        return dataclasses.replace(state, floor_tripped_at=now), True, ("acceptance_floor_tripped",)
    return state, True, ()


def decide(
    settings: PolicyConfig,
    state: ControllerState,
    observation: ObserveResult,
    assessment: Assessment | None,
    override: OverrideMode,
    now: float,
    started_at: float | None = None,
) -> tuple[Decision, ControllerState]:
    """The tick's decision and the state after it (before the hook is called).

    ``started_at``: when this controller process started (the startup hold); None: no hold.
    """
    events: list[str] = []
    gamma = settings.draft_length

    def out(action: Action, reason: Reason, detail: str, desired: bool | None, st: ControllerState):
        dl = (assessment.draft_length if assessment else gamma) if desired else None
        return Decision(action, reason, detail, desired, dl, _phase(st, override, now), tuple(events)), st

    failure = usable(observation, settings)
    if (
        isinstance(observation, Observation)
        and state.applied_enabled is None
        and observation.sd_series_present is not None
    ):
        state = dataclasses.replace(state, applied_enabled=observation.sd_series_present)
    if failure is None and assessment is not None and isinstance(observation, Observation):
        state = _remember(state, observation, assessment, now)

    # 1. Operator override: thresholds and dwell do not apply; the pending lock and backoff do.
    if override is not OverrideMode.AUTO:
        want = override is OverrideMode.ON
        if state.pending is not None:
            return out(Action.NONE, Reason.PENDING, "override waits for the pending change", want, state)
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
    if state.applied_enabled is None:
        return out(Action.NONE, Reason.APPLIED_UNKNOWN, "hook and metrics do not say whether SD is on", None, state)

    state, floor_hit, floor_events = _floor(state, assessment, settings, now)
    events.extend(floor_events)
    on = state.applied_enabled
    s = assessment.decision_speedup
    want_off = on and (floor_hit or s < settings.disable_threshold)
    want_on = (not on) and s > settings.enable_threshold
    since, since_enabled = persisted_since(
        state.switch_wanted_since, state.switch_wanted_enabled, (not on) if (want_off or want_on) else None, now
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
    elif want_off:
        reason, detail = Reason.SPEEDUP_LOW, f"speedup {s:.3f} < {settings.disable_threshold}"
    else:
        reason, detail = Reason.SPEEDUP_HIGH, f"speedup {s:.3f} > {settings.enable_threshold}"

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
    if state.last_change_at is not None and now - state.last_change_at < settings.dwell_s:
        left = settings.dwell_s - (now - state.last_change_at)
        return out(Action.NONE, Reason.DWELL, f"{detail}; dwell holds {left:.0f}s more", on, state)
    if state.retry_not_before is not None and now < state.retry_not_before:
        left = state.retry_not_before - now
        return out(Action.NONE, Reason.BACKOFF, f"{detail}; retry after {left:.0f}s", on, state)
    lasted = now - (state.switch_wanted_since if state.switch_wanted_since is not None else now)
    if risk and lasted < assessment.excursion_filter_s:
        return out(
            Action.NONE,
            Reason.EXCURSION,
            f"{detail}; wanted for {lasted:.0f}s < {assessment.excursion_filter_s:.0f}s (restart + drain)",
            on,
            state,
        )
    if settings.price_switches and not floor_hit:
        gain, cost = assessment.projected_gain_request_s, assessment.switch_cost_request_s
        back = assessment.undo_cost_request_s if want_on else 0.0
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


def begin_request(state: ControllerState, decision: Decision, now: float) -> ControllerState:
    """The pending lock, written *before* the hook is called: a crash then cannot leave a change
    issued but unrecorded (at worst a pending change that times out and is retried)."""
    assert decision.acts and decision.desired_enabled is not None
    return dataclasses.replace(
        state,
        pending=PendingChange(decision.desired_enabled, decision.draft_length, now, decision.reason.value),
    )


def record_request(
    state: ControllerState, settings: PolicyConfig, accepted: bool, now: float, uncertain: bool = False
) -> tuple[ControllerState, tuple[str, ...]]:
    """After the hook call: keep the lock if accepted, else count a failure and back off.

    An uncertain outcome (the request timed out after it was sent) keeps the lock too: the
    change may be in flight, and the hook's status (or the pending timeout) will tell.
    """
    if accepted:
        return state, ("change_requested",)
    if uncertain:
        return state, ("change_uncertain",)
    state, ev = _fail(state, settings, now, "hook_refused")
    return state, (ev,)
