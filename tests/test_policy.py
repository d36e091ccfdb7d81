"""The decision state machine, table-tested on virtual time (no clock, no I/O)."""

import dataclasses
import math

import pytest

from controller.assessment import AcceptanceEstimate, AcceptanceSource, Assessment, pessimistic_speedup
from controller.hooks.base import HookPhase, HookStatus
from controller.model import Workload
from controller.observation import FailureReason, Observation, ObservationFailure
from controller.policy import (
    Action,
    ControllerPhase,
    Reason,
    begin_request,
    decide,
    reconcile,
    record_request,
)
from controller.settings import OverrideMode, Settings
from controller.state import ControllerState, PendingChange
from tests.support import LEGACY_CALIBRATION

T0 = 1_000_000.0
S = Settings(calibration_file=LEGACY_CALIBRATION, price_switches=False)
PRICED = Settings(calibration_file=LEGACY_CALIBRATION, price_switches=True, switch_margin=2.0)
AUTO = OverrideMode.AUTO


def obs(t=T0, rate=5.0, **kw):
    return Observation(time_s=t, arrival_rate_rps=rate, sample_age_s=0.0, **kw)


def assessment(speedup=1.5, acc=0.7, source=AcceptanceSource.MEASURED, gain=100.0, cost=10.0):
    return Assessment(
        arrival_rate_rps=5.0, projected_rate_rps=5.0,
        acceptance=AcceptanceEstimate(acc, 0.75, source, 0.0),
        workload=Workload(512, 256), draft_length=4, best_draft_length=4,
        predicted_speedup=speedup, decision_speedup=speedup,
        latency_off_s=2.0, latency_on_s=2.0 / speedup if speedup > 0 else math.inf,
        batch_off=10.0, batch_on=6.0, stability_limit_off_rps=16.0, stability_limit_on_rps=13.0,
        break_even_rate_rps=10.0, restart_downtime_s=90.0,
        switch_cost_request_s=cost, projected_gain_request_s=gain,
    )  # fmt: skip


def on_state(**kw):
    base = dict(applied_enabled=True, applied_draft_length=4, last_change_at=T0 - 3600)
    base.update(kw)
    return ControllerState(**base)


def off_state(**kw):
    return on_state(applied_enabled=False, applied_draft_length=None, **kw)


# --- hysteresis thresholds: every edge -------------------------------------------------------


@pytest.mark.parametrize(
    ("enabled", "speedup", "action", "reason"),
    [
        (True, 1.0499, Action.DISABLE, Reason.SPEEDUP_LOW),
        (True, 1.05, Action.NONE, Reason.STEADY),  # not below
        (True, 1.10, Action.NONE, Reason.STEADY),
        (True, 1.25, Action.NONE, Reason.STEADY),  # already on
        (True, 0.0, Action.DISABLE, Reason.SPEEDUP_LOW),  # SD overloaded
        (False, 1.20, Action.NONE, Reason.STEADY),  # not above
        (False, 1.2001, Action.ENABLE, Reason.SPEEDUP_HIGH),
        (False, 1.10, Action.NONE, Reason.STEADY),
        (False, 1.0, Action.NONE, Reason.STEADY),
        (False, math.inf, Action.ENABLE, Reason.SPEEDUP_HIGH),  # only SD keeps up
    ],
)
def test_thresholds(enabled, speedup, action, reason):
    state = on_state() if enabled else off_state()
    d, _ = decide(S, state, obs(), assessment(speedup), AUTO, T0)
    assert (d.action, d.reason) == (action, reason)
    if d.acts:
        assert d.desired_enabled is (not enabled)
        assert d.draft_length == (4 if d.desired_enabled else None)


def test_thresholds_are_configurable():
    s = Settings(calibration_file=LEGACY_CALIBRATION, price_switches=False, enable_threshold=1.5, disable_threshold=1.3)
    d, _ = decide(s, on_state(), obs(), assessment(1.29), AUTO, T0)
    assert d.action is Action.DISABLE
    d, _ = decide(s, off_state(), obs(), assessment(1.45), AUTO, T0)
    assert d.action is Action.NONE


# --- dwell ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("since", "action"), [(0, Action.NONE), (299.9, Action.NONE), (300.0, Action.DISABLE), (301, Action.DISABLE)]
)
def test_dwell(since, action):
    state = on_state(last_change_at=T0 - since)
    d, _ = decide(S, state, obs(), assessment(0.9), AUTO, T0)
    assert d.action is action
    if action is Action.NONE:
        assert d.reason is Reason.DWELL


# --- pending lock, confirmation, timeout, backoff -------------------------------------------


def test_pending_lock_holds_and_confirmation_releases_it():
    d, state = decide(S, on_state(), obs(), assessment(0.9), AUTO, T0)
    assert d.action is Action.DISABLE
    state = begin_request(state, d, T0)
    state, ev = record_request(state, S, True, T0)
    assert state.pending == PendingChange(False, None, T0, Reason.SPEEDUP_LOW.value)
    # While restarting: locked, whatever the prediction says.
    state, ev = reconcile(state, HookStatus(HookPhase.RESTARTING, applied_enabled=True), S, T0 + 60)
    assert ev == ()
    d, state = decide(S, state, obs(), assessment(3.0), AUTO, T0 + 60)
    assert (d.action, d.reason, d.phase) == (Action.NONE, Reason.PENDING, ControllerPhase.PENDING)
    # Confirmed: applied flips, the dwell clock starts now.
    state, ev = reconcile(
        state, HookStatus(HookPhase.READY, applied_enabled=False, restart_durations_s=(75.0,)), S, T0 + 120
    )
    assert tuple(map(str, ev)) == ("change_confirmed:off",)
    assert state.applied_enabled is False and state.pending is None and state.last_change_at == T0 + 120
    assert state.restart_durations_s == (75.0,)
    d, state = decide(S, state, obs(), assessment(3.0), AUTO, T0 + 120 + 299)
    assert d.reason is Reason.DWELL
    d, state = decide(S, state, obs(), assessment(3.0), AUTO, T0 + 120 + 300)
    assert d.action is Action.ENABLE


def test_pending_timeout_fails_with_doubling_backoff():
    state = on_state(pending=PendingChange(False, None, T0, "x"))
    state, ev = reconcile(state, HookStatus(HookPhase.RESTARTING), S, T0 + S.pending_timeout_s)
    assert ev == () and state.pending is not None  # exactly at the timeout: still pending
    state, ev = reconcile(state, HookStatus(HookPhase.RESTARTING), S, T0 + S.pending_timeout_s + 1)
    assert tuple(map(str, ev)) == ("change_failed:timeout",)
    assert state.pending is None and state.consecutive_failures == 1
    t_fail = T0 + S.pending_timeout_s + 1
    assert state.retry_not_before == t_fail + S.failure_backoff_s
    d, state = decide(S, state, obs(), assessment(0.9), AUTO, t_fail + 10)
    assert (d.action, d.reason, d.phase) == (Action.NONE, Reason.BACKOFF, ControllerPhase.FAILED)
    d, state2 = decide(S, state, obs(), assessment(0.9), AUTO, t_fail + S.failure_backoff_s)
    assert d.action is Action.DISABLE
    # A second failure doubles the wait; the cap holds.
    state2, _ = record_request(begin_request(state2, d, t_fail + 300), S, False, t_fail + 300)
    assert state2.consecutive_failures == 2
    assert state2.retry_not_before == t_fail + 300 + 2 * S.failure_backoff_s
    many = dataclasses.replace(state2, consecutive_failures=20)
    many, _ = record_request(many, S, False, T0)
    assert many.retry_not_before == T0 + S.failure_backoff_max_s


def test_hook_reported_failure_keeps_old_state():
    state = on_state(pending=PendingChange(False, None, T0, "x"))
    state, ev = reconcile(state, HookStatus(HookPhase.FAILED, applied_enabled=True, last_error="not ready"), S, T0 + 30)
    assert tuple(map(str, ev)) == ("change_failed:hook_reported_failure",)
    assert state.applied_enabled is True and state.pending is None


# Our disable (requested with the launcher at 5 restarts), then what its status says a tick later.
SWITCHED_BACK = ("change_confirmed:off", "external_change:on")
REPLACED = ("change_superseded:off", "external_change:on")


@pytest.mark.parametrize(
    ("restarts_before", "status", "events", "pending"),
    [
        # Ours ran (6) and an operator's switch back on ran after it (7): that one serves.
        (5, HookStatus(HookPhase.READY, applied_enabled=True, restart_count=7), SWITCHED_BACK, False),
        # Ours may have rolled back (6, 7) before the operator's (8): replaced, not confirmed.
        (5, HookStatus(HookPhase.READY, applied_enabled=True, restart_count=8), REPLACED, False),
        (5, HookStatus(HookPhase.READY, applied_enabled=True, restart_count=9), REPLACED, False),
        # One restart only: ours has not run yet (a launcher that lost it): the timeout decides.
        (5, HookStatus(HookPhase.READY, applied_enabled=True, restart_count=6), (), True),
        # The last restart was a crash restart (its error stays), not a switch.
        (5, HookStatus(HookPhase.READY, applied_enabled=True, restart_count=7, last_error="vLLM exited"), (), True),
        # A launcher that restarted counts from 0; a hook that keeps no count; a lock from before counts.
        (5, HookStatus(HookPhase.READY, applied_enabled=True, restart_count=2), (), True),
        (5, HookStatus(HookPhase.READY, applied_enabled=True), (), True),
        (None, HookStatus(HookPhase.READY, applied_enabled=True, restart_count=7), (), True),
        # Still switching, or ours serves: not overtaken.
        (5, HookStatus(HookPhase.RESTARTING, applied_enabled=True, restart_count=7), (), True),
        (5, HookStatus(HookPhase.READY, applied_enabled=False, restart_count=7), ("change_confirmed:off",), False),
        # Ours ran (6), the operator's failed and rolled back to ours (7, 8): ours serves.
        (
            5,
            HookStatus(HookPhase.FAILED, applied_enabled=False, restart_count=8, last_error="not ready"),
            ("change_confirmed:off",),
            False,
        ),
        # Ours rolled back: the other setting serves, a failure.
        (
            5,
            HookStatus(HookPhase.FAILED, applied_enabled=True, restart_count=7, last_error="not ready"),
            ("change_failed:hook_reported_failure",),
            False,
        ),
    ],
)
def test_a_switch_after_ours_replaces_the_lock_with_an_external_change(restarts_before, status, events, pending):
    state = on_state(pending=PendingChange(False, None, T0, "x", restarts_before), consecutive_failures=1)
    state, ev = reconcile(state, status, S, T0 + 120)
    assert tuple(map(str, ev)) == events
    assert (state.pending is not None) is pending
    if events in (SWITCHED_BACK, REPLACED):
        # The operator's restart gets the dwell, not a failure's backoff; a failure is
        # forgotten only where ours is known to have worked.
        assert state.applied_enabled is True and state.last_change_at == T0 + 120
        assert state.consecutive_failures == (0 if events == SWITCHED_BACK else 1)
        d, _ = decide(S, state, obs(), assessment(0.5), AUTO, T0 + 180)
        assert (d.action, d.reason) == (Action.NONE, Reason.DWELL)


def test_the_lock_keeps_the_hooks_restart_count_across_the_state_file():
    d, state = decide(S, on_state(), obs(), assessment(0.9), AUTO, T0)
    state = begin_request(state, d, T0, restart_count=5)
    assert state.pending.restarts_before == 5
    assert ControllerState.from_dict(state.to_dict()).pending == state.pending
    raw = state.to_dict()
    raw["pending"]["restarts_before"] = -1
    with pytest.raises(ValueError, match=r"pending\.restarts_before must be a non-negative integer"):
        ControllerState.from_dict(raw)


def test_success_resets_failures():
    state = on_state(pending=PendingChange(False, None, T0, "x"), consecutive_failures=3, retry_not_before=T0)
    state, _ = reconcile(state, HookStatus(HookPhase.READY, applied_enabled=False), S, T0 + 90)
    assert state.consecutive_failures == 0 and state.retry_not_before is None


def test_external_change_is_adopted_and_starts_the_dwell():
    state, ev = reconcile(on_state(), HookStatus(HookPhase.READY, applied_enabled=False), S, T0)
    assert tuple(map(str, ev)) == ("external_change:off",)
    assert state.applied_enabled is False and state.last_change_at == T0
    d, _ = decide(S, state, obs(), assessment(3.0), AUTO, T0 + 10)
    assert d.reason is Reason.DWELL


def test_first_start_learns_applied_state_without_dwell():
    state, ev = reconcile(
        ControllerState(), HookStatus(HookPhase.READY, applied_enabled=True, applied_draft_length=4), S, T0
    )
    assert ev == () and state.applied_enabled is True and state.last_change_at is None
    d, _ = decide(S, state, obs(), assessment(0.5), AUTO, T0)
    assert d.action is Action.DISABLE


def test_unknown_applied_state_holds_until_metrics_tell():
    d, _ = decide(S, ControllerState(), obs(), assessment(0.5), AUTO, T0)
    assert d.reason is Reason.APPLIED_UNKNOWN
    d, state = decide(S, ControllerState(), obs(sd_series_present=True), assessment(0.5), AUTO, T0)
    assert state.applied_enabled is True and d.action is Action.DISABLE


# --- missing, NaN, stale data: hold, never zero ----------------------------------------------


@pytest.mark.parametrize("reason", list(FailureReason))
def test_failed_observation_holds(reason):
    d, state = decide(S, on_state(), ObservationFailure(reason, "x"), None, AUTO, T0)
    assert (d.action, d.reason, d.detail) == (Action.NONE, Reason.OBSERVATION, reason.value)
    assert state.applied_enabled is True


def test_stale_and_incomplete_observations_hold():
    stale = Observation(time_s=T0, arrival_rate_rps=0.0, sample_age_s=S.max_observation_age_s + 1)
    d, _ = decide(S, on_state(), stale, assessment(0.0), AUTO, T0)
    assert (d.reason, d.detail) == (Reason.OBSERVATION, "stale")
    missing = Observation(time_s=T0, arrival_rate_rps=None, sample_age_s=0.0)
    d, _ = decide(S, on_state(), missing, None, AUTO, T0)
    assert d.detail == "incomplete"


def test_nan_cannot_enter_an_observation():
    with pytest.raises(ValueError):
        Observation(time_s=T0, arrival_rate_rps=float("nan"))


# --- acceptance floor ----------------------------------------------------------------------


def test_acceptance_floor_disables_after_the_window_whatever_the_model_says():
    state = on_state()
    low = assessment(speedup=2.0, acc=0.15)
    events = []
    for i in range(11):  # a tick a minute: t = 0 .. 600
        d, state = decide(S, state, obs(), low, AUTO, T0 + 60 * i)
        events.extend(d.events)
        if i < 10:
            assert d.action is Action.NONE, i
    assert (d.action, d.reason) == (Action.DISABLE, Reason.ACCEPTANCE_FLOOR)
    assert [str(e) for e in events] == ["acceptance_floor_tripped"]  # notified once


def test_acceptance_floor_resets_on_recovery_and_ignores_missing_ticks():
    state = on_state()
    _, state = decide(S, state, obs(), assessment(2.0, acc=0.15), AUTO, T0)
    _, state = decide(S, state, ObservationFailure(FailureReason.UNREACHABLE), None, AUTO, T0 + 300)
    assert state.low_acceptance_since == T0  # a missing tick neither trips nor resets
    _, state = decide(S, state, obs(), assessment(2.0, acc=0.5), AUTO, T0 + 360)
    assert state.low_acceptance_since is None
    d, _ = decide(S, state, obs(), assessment(2.0, acc=0.15), AUTO, T0 + 660)
    assert d.action is Action.NONE


def test_floor_ignores_last_or_prior_acceptance():
    d, state = decide(S, off_state(), obs(), assessment(1.1, acc=0.1, source=AcceptanceSource.LAST), AUTO, T0)
    assert state.low_acceptance_since is None and d.action is Action.NONE


def test_measured_acceptance_is_remembered_for_when_sd_is_off():
    _, state = decide(
        S, on_state(), obs(mean_prompt_tokens=300.0, mean_gen_tokens=100.0), assessment(1.5, acc=0.66), AUTO, T0
    )
    assert (state.last_acceptance_rate, state.last_alpha, state.last_acceptance_at) == (0.66, 0.75, T0)
    assert (state.last_prompt_tokens, state.last_gen_tokens) == (300.0, 100.0)


# --- operator override --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "state", "action", "reason"),
    [
        (OverrideMode.OFF, on_state(last_change_at=T0 - 10), Action.DISABLE, Reason.OVERRIDE),  # ignores dwell
        (OverrideMode.ON, off_state(), Action.ENABLE, Reason.OVERRIDE),
        (OverrideMode.ON, on_state(), Action.NONE, Reason.ALREADY_APPLIED),
        (OverrideMode.OFF, on_state(pending=PendingChange(True, 4, T0, "x")), Action.NONE, Reason.PENDING),
        (OverrideMode.OFF, on_state(retry_not_before=T0 + 5, consecutive_failures=1), Action.NONE, Reason.BACKOFF),
    ],
)
def test_override(mode, state, action, reason):
    # Even with no usable observation the override applies.
    d, _ = decide(S, state, ObservationFailure(FailureReason.UNREACHABLE), None, mode, T0)
    assert (d.action, d.reason, d.phase) == (action, reason, ControllerPhase.OVERRIDE)


# --- the switch-cost gate -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gain", "cost", "action"),
    [
        (100.0, 10.0, Action.DISABLE),  # gain > 2 × cost
        (20.0, 10.0, Action.NONE),  # not by the margin
        (math.inf, math.inf, Action.DISABLE),  # leaving an overloaded state is always worth it
        (5.0, math.inf, Action.NONE),  # the backlog would never clear
        (-math.inf, 1.0, Action.NONE),  # entering an overloaded state
    ],
)
def test_switch_cost_gate(gain, cost, action):
    d, _ = decide(PRICED, on_state(), obs(), assessment(0.9, gain=gain, cost=cost), AUTO, T0)
    assert d.action is action
    if action is Action.NONE:
        assert d.reason is Reason.SWITCH_COST


def test_acceptance_floor_is_not_priced():
    state = on_state(low_acceptance_since=T0 - 600)
    d, _ = decide(PRICED, state, obs(), assessment(2.0, acc=0.15, gain=-5.0, cost=1e9), AUTO, T0)
    assert d.reason is Reason.ACCEPTANCE_FLOOR and d.action is Action.DISABLE


def test_thresholds_stay_necessary_with_the_gate():
    d, _ = decide(PRICED, on_state(), obs(), assessment(1.1, gain=1e9, cost=0.0), AUTO, T0)
    assert d.action is Action.NONE and d.reason is Reason.STEADY


def test_uncertain_request_keeps_the_lock():
    d, state = decide(S, on_state(), obs(), assessment(0.9), AUTO, T0)
    state = begin_request(state, d, T0)
    state, ev = record_request(state, S, False, T0, uncertain=True)
    assert (
        tuple(map(str, ev)) == ("change_uncertain",) and state.pending is not None and state.consecutive_failures == 0
    )


def test_seen_congestion_is_remembered():
    a = dataclasses.replace(assessment(0.0), congested=True, arrival_rate_rps=9.0)
    _, state = decide(S, on_state(), obs(), a, AUTO, T0)
    assert (state.sd_congested_rate_rps, state.sd_congested_at) == (9.0, T0)
    a2 = dataclasses.replace(assessment(0.0), congested=True, arrival_rate_rps=11.0)
    _, state = decide(S, state, obs(), a2, AUTO, T0 + 60)
    assert state.sd_congested_rate_rps == 9.0  # the lowest rate seen


def test_pending_wins_over_a_missing_observation():
    # During the restart vLLM's metrics are gone: that is the pending change, not a fault.
    state = on_state(pending=PendingChange(False, None, T0, "x"))
    d, _ = decide(S, state, ObservationFailure(FailureReason.UNREACHABLE), None, AUTO, T0 + 30)
    assert (d.reason, d.phase) == (Reason.PENDING, ControllerPhase.PENDING)


# --- risk terms: startup hold, excursion filter, the restart back ------------------------------

RISK = Settings(calibration_file=LEGACY_CALIBRATION, price_switches=True, switch_margin=1.0, startup_hold_s=600.0)


def risky(speedup, **kw):
    return dataclasses.replace(assessment(speedup, gain=1000.0, cost=10.0), excursion_filter_s=120.0, **kw)


@pytest.mark.parametrize(
    ("enabled", "speedup", "since", "overloaded", "reason"),
    [
        (True, 0.9, T0 - 60, False, Reason.STARTUP),  # SD a bit worse, not overloaded: keep the launch
        (True, 0.0, T0 - 60, True, Reason.SPEEDUP_LOW),  # SD overloaded: clearly wrong, act
        (False, 1.5, T0 - 60, False, Reason.STARTUP),  # enabling is never urgent
        (True, 0.9, T0 - 601, False, Reason.SPEEDUP_LOW),  # the hold is over
        (True, 0.9, None, False, Reason.SPEEDUP_LOW),  # no start time given: no hold
    ],
)
def test_startup_hold_keeps_the_launched_state_unless_clearly_wrong(enabled, speedup, since, overloaded, reason):
    state = (on_state if enabled else off_state)(switch_wanted_since=T0 - 3600, switch_wanted_enabled=not enabled)
    d, _ = decide(RISK, state, obs(), risky(speedup, applied_overloaded=overloaded), AUTO, T0, started_at=since)
    assert d.reason is reason
    assert d.acts is (reason is not Reason.STARTUP)


@pytest.mark.parametrize(
    ("wanted_since", "wanted_enabled", "action", "reason"),
    [
        (None, None, Action.NONE, Reason.EXCURSION),  # the signal appears now
        (T0 - 119, False, Action.NONE, Reason.EXCURSION),  # not yet a restart's length
        (T0 - 120, False, Action.DISABLE, Reason.SPEEDUP_LOW),  # outlasted downtime + drain
        (T0 - 3600, True, Action.NONE, Reason.EXCURSION),  # an old signal the other way does not count
    ],
)
def test_excursion_filter_needs_the_signal_to_outlast_a_restart(wanted_since, wanted_enabled, action, reason):
    state = on_state(switch_wanted_since=wanted_since, switch_wanted_enabled=wanted_enabled)
    d, new = decide(RISK, state, obs(), risky(0.9), AUTO, T0)
    assert (d.action, d.reason) == (action, reason)
    assert new.switch_wanted_enabled is False
    assert new.switch_wanted_since == (wanted_since if wanted_enabled is False else T0)


def test_a_spike_shorter_than_a_restart_never_switches():
    """Table over timestamps: SD loses for 100 s (one tick every 20 s), then recovers."""
    state, actions = on_state(), []
    for i in range(15):
        t = T0 + 20 * i
        speedup = 0.8 if 2 <= i < 7 else 1.5
        d, state = decide(RISK, state, obs(t=t), risky(speedup), AUTO, t)
        actions.append((d.action, d.reason))
    assert all(a is Action.NONE for a, _ in actions)
    assert (Action.NONE, Reason.EXCURSION) in actions
    assert state.switch_wanted_since is None  # the signal ended with the spike


@pytest.mark.parametrize(
    ("dip", "acts"),
    [
        (1.10, True),  # rate noise lifts the speedup to 1.10, under the band's middle (1.125): still wanted
        (1.20, False),  # back above the middle: the load came back, the clock starts over
    ],
)
def test_noise_inside_the_hysteresis_band_does_not_restart_the_excursion_clock(dip, acts):
    """SD loses for 3 minutes on a lasting load; every other tick a noisy rate lifts the
    speedup to ``dip``. The 120 s filter is outlasted only if the dips do not reset it."""
    state, acted = on_state(), False
    for i in range(7):
        t = T0 + 30 * i
        d, state = decide(RISK, state, obs(t=t), risky(0.95 if i % 2 == 0 else dip), AUTO, t)
        acted = acted or d.acts
    assert acted is acts


@pytest.mark.parametrize(
    ("ratio", "overloaded", "acts", "reason"),
    [
        (None, False, True, Reason.SPEEDUP_LOW),  # no evidence yet: the calibration is all there is
        (1.10, False, True, Reason.SPEEDUP_LOW),  # within ±15 %: trusted
        (1.30, False, False, Reason.MODEL_ERROR),  # the model misses the running mode by 30 %: hold
        (0.70, False, False, Reason.MODEL_ERROR),  # ...in either direction
        (1.30, True, True, Reason.SPEEDUP_LOW),  # overloaded is overloaded, whatever the error
        (1.30, "cycling", True, Reason.SPEEDUP_LOW),  # a cycling load's evidence is its transients
    ],
)
def test_a_model_that_misses_the_running_mode_is_not_trusted_with_a_restart(ratio, overloaded, acts, reason):
    state = on_state(switch_wanted_since=T0 - 3600, switch_wanted_enabled=False)
    cycling = overloaded == "cycling"
    a = risky(0.9, model_error_ratio=ratio, applied_overloaded=overloaded is True, cycling=cycling)
    d, _ = decide(RISK, state, obs(), a, AUTO, T0)
    assert (d.acts, d.reason) == (acts, reason)
    assert ("load's cycle" in d.detail) is cycling  # the log says what the speedup was read over


def test_oscillating_signal_never_accumulates():
    state = on_state()
    for i in range(40):
        t = T0 + 30 * i
        d, state = decide(RISK, state, obs(t=t), risky(0.8 if i % 4 < 2 else 1.5), AUTO, t)
        assert not d.acts


def test_the_excursion_filter_never_delays_the_acceptance_floor():
    s = RISK.model_copy(update={"acceptance_floor": 0.5, "acceptance_floor_window_s": 60.0})
    state = on_state(low_acceptance_since=T0 - 120)
    d, _ = decide(
        s, state, obs(), risky(1.5, acceptance=AcceptanceEstimate(0.2, 0.2, AcceptanceSource.MEASURED, 0.0)), AUTO, T0
    )
    assert (d.action, d.reason) == (Action.DISABLE, Reason.ACCEPTANCE_FLOOR)


@pytest.mark.parametrize(
    ("gain", "cost", "back", "action", "reason"),
    [
        (1000.0, 10.0, 0.0, Action.ENABLE, Reason.SPEEDUP_HIGH),  # no peak ahead: the switch alone
        (1000.0, 10.0, 500.0, Action.ENABLE, Reason.SPEEDUP_HIGH),  # pays for both restarts
        (1000.0, 10.0, 995.0, Action.NONE, Reason.ROUND_TRIP),  # not for the way back
        (5.0, 10.0, 0.0, Action.NONE, Reason.SWITCH_COST),  # not even for the first
    ],
)
def test_enabling_pays_for_the_restart_back(gain, cost, back, action, reason):
    state = off_state(switch_wanted_since=T0 - 3600, switch_wanted_enabled=True)
    a = dataclasses.replace(
        risky(1.5), projected_gain_request_s=gain, switch_cost_request_s=cost, undo_cost_request_s=back
    )
    d, _ = decide(RISK, state, obs(), a, AUTO, T0)
    assert (d.action, d.reason) == (action, reason)


def test_disabling_never_pays_for_a_way_back():
    state = on_state(switch_wanted_since=T0 - 3600, switch_wanted_enabled=False)
    a = dataclasses.replace(risky(0.9), undo_cost_request_s=1e9)
    d, _ = decide(RISK, state, obs(), a, AUTO, T0)
    assert (d.action, d.reason) == (Action.DISABLE, Reason.SPEEDUP_LOW)


def test_the_rate_history_is_recorded_and_survives_the_state_file():
    state = on_state()
    for i in range(3):
        _, state = decide(RISK, state, obs(t=T0 + 300 * i, rate=2.0 + i), risky(1.5), AUTO, T0 + 300 * i)
    assert [r for _, r in state.rate_history] == [2.0, 3.0, 4.0]
    assert ControllerState.from_dict(state.to_dict()) == state


def test_the_measured_acceptance_is_recorded_and_survives_the_state_file():
    state = on_state()
    for i, src in enumerate([AcceptanceSource.MEASURED, AcceptanceSource.MEASURED, AcceptanceSource.LAST]):
        a = dataclasses.replace(risky(1.5), acceptance=AcceptanceEstimate(0.5, 0.7 - 0.1 * i, src, 0.0))
        _, state = decide(RISK, state, obs(t=T0 + 300 * i), a, AUTO, T0 + 300 * i)
    assert [alpha for _, alpha in state.alpha_history] == pytest.approx([0.7, 0.6])  # a remembered one is not news
    assert ControllerState.from_dict(state.to_dict()) == state


def test_the_last_ticks_rise_is_kept_for_the_next_and_survives_the_state_file():
    state = on_state()
    for i, rise in enumerate([None, 14.8, 15.1, None]):
        _, state = decide(RISK, state, obs(t=T0 + 60 * i), dataclasses.replace(risky(1.5), rise_rps=rise), AUTO, T0)
        assert state.last_rise_rps == rise
        assert ControllerState.from_dict(state.to_dict()) == state


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([[T0, 1.2]], "alpha_history must be a list of [time, acceptance in [0, 1]] pairs"),
        ([[T0, 0.5], [T0, 0.4]], "alpha_history times must increase"),
        ("0.5", "alpha_history must be a list of [time, acceptance in [0, 1]] pairs"),
        ([[T0, -1.0]], "rate_history must be a list of [time, non-negative rate] pairs"),
    ],
)
def test_a_state_file_history_that_is_off_is_named(value, message):
    raw = on_state().to_dict()
    raw["rate_history" if "rate_history" in message else "alpha_history"] = value
    with pytest.raises(ValueError) as e:
        ControllerState.from_dict(raw)
    assert str(e.value) == message


@pytest.mark.parametrize(("trend", "said"), [(-0.2 / 3600, "acceptance falling 0.20/h"), (None, None)])
def test_a_decision_says_when_its_gain_followed_the_acceptance(trend, said):
    d, _ = decide(RISK, on_state(), obs(), risky(0.9, acceptance_trend_per_s=trend), AUTO, T0)
    assert d.action is Action.NONE  # the filter still waits
    assert (said in d.detail) if said else ("acceptance" not in d.detail)


def test_events_are_typed_and_keep_their_log_form():
    from controller.events import Event, EventKind

    state = on_state(pending=PendingChange(False, None, T0 - 10, "speedup_below_disable_threshold"))
    new, ev = reconcile(state, HookStatus(HookPhase.READY, applied_enabled=False), S, T0)
    assert ev == (Event(EventKind.CHANGE_CONFIRMED, "off"),)
    assert ev[0].toggled == "off" and str(ev[0]) == "change_confirmed:off"
    _, ev = record_request(new, S, accepted=False, now=T0)
    assert (
        ev[0].kind is EventKind.CHANGE_FAILED and ev[0].toggled is None and str(ev[0]) == "change_failed:hook_refused"
    )


def test_a_spike_that_is_over_does_not_keep_the_signal_alive():
    # The recent peak still argues for leaving SD (decision speedup 0.8), but the load that is
    # here says SD is fine (trend speedup 1.5): the filter's clock does not run.
    state = on_state(switch_wanted_since=T0 - 3600, switch_wanted_enabled=False)
    d, new = decide(RISK, state, obs(), risky(0.8, trend_speedup=1.5), AUTO, T0)
    assert (d.action, d.reason) == (Action.NONE, Reason.EXCURSION)
    assert new.switch_wanted_since is None
    d, _ = decide(RISK, state, obs(), risky(0.8, trend_speedup=0.9), AUTO, T0)
    assert d.action is Action.DISABLE  # here and now too: the signal has lasted an hour


@pytest.mark.parametrize(
    ("source", "rate", "reason"),
    [
        (AcceptanceSource.LAST, 0.15, Reason.ACCEPTANCE_FLOOR),  # it tripped the floor last time: no loop
        (AcceptanceSource.LAST, 0.35, Reason.SPEEDUP_HIGH),
        (AcceptanceSource.PRIOR, 0.15, Reason.SPEEDUP_HIGH),  # never measured: the prior is the operator's
    ],
)
def test_no_re_enable_while_the_last_acceptance_is_under_the_floor(source, rate, reason):
    d, _ = decide(S, off_state(), obs(), assessment(1.5, acc=rate, source=source), AUTO, T0)
    assert d.reason is reason and d.acts is (reason is Reason.SPEEDUP_HIGH)


@pytest.mark.parametrize(
    ("on", "lasted", "forecast", "gain", "prior", "acts", "reason"),
    [
        # gain 1000 over a 4 h horizon against a cost of 200 (margin 1): an unforecast load must
        # be old enough that the chance it stays makes its expected gain pass the cost
        (False, 300.0, False, 1000.0, True, False, Reason.NOT_LASTED),  # 5 min vouch for 81 req·s
        (False, 1800.0, False, 1000.0, True, True, Reason.SPEEDUP_HIGH),  # half an hour for 275
        (False, 300.0, True, 1000.0, True, True, Reason.SPEEDUP_HIGH),  # forecast (history, a line)
        (False, 300.0, False, math.inf, True, True, Reason.SPEEDUP_HIGH),  # only SD keeps up: no rent
        (False, 300.0, False, 1000.0, False, True, Reason.SPEEDUP_HIGH),  # load_age_prior off
        (False, 1800.0, False, 150.0, True, False, Reason.SWITCH_COST),  # not even the whole gain pays
        # disabling alike: a busy load minutes old may end before the restart pays back
        (True, 300.0, False, 1000.0, True, False, Reason.NOT_LASTED),
        (True, 1800.0, False, 1000.0, True, True, Reason.SPEEDUP_LOW),
        (True, 300.0, True, 1000.0, True, True, Reason.SPEEDUP_LOW),  # forecast
        (True, 300.0, False, math.inf, True, True, Reason.SPEEDUP_LOW),  # leaving an overload: no rent
        (True, 300.0, False, 1000.0, False, True, Reason.SPEEDUP_LOW),  # load_age_prior off
    ],
)
def test_an_unforecast_load_must_have_lasted_before_a_switch_is_spent_on_it(
    on, lasted, forecast, gain, prior, acts, reason
):
    settings = RISK.model_copy(update={"load_age_prior": prior})
    speedup = 0.9 if on else 1.5
    a = dataclasses.replace(
        risky(speedup),
        projected_gain_request_s=gain,
        switch_cost_request_s=200.0,
        gain_horizon_s=14400.0,
        horizon_forecast=forecast,
    )
    state = (on_state if on else off_state)(switch_wanted_since=T0 - lasted, switch_wanted_enabled=not on)
    d, _ = decide(settings.policy, state, obs(), a, AUTO, T0)
    assert (d.acts, d.reason) == (acts, reason)
    if reason is Reason.NOT_LASTED:
        assert "no forecast of how long this load lasts" in d.detail


@pytest.mark.parametrize(
    ("decision", "projected", "sd", "z", "expected"),
    [
        (1.3, 1.4, None, 1.0, 1.3),  # no posterior width: the calibration's end as it was
        (1.3, 1.4, 0.0, 1.0, 1.3),
        (1.4, 1.4, 0.1, 1.0, 1.4 * math.exp(-0.1)),  # no calibration interval: the posterior's alone
        (1.3, 1.4, 0.1, 1.0, 1.4 * math.exp(-math.hypot(math.log(1.4 / 1.3), 0.1))),  # in quadrature
        (1.3, 1.4, 0.1, 0.0, 1.3),  # z = 0: off
        (math.inf, math.inf, 0.1, 1.0, math.inf),  # only SD keeps up
    ],
)
def test_pessimistic_speedup_combines_the_calibration_interval_and_the_posterior(decision, projected, sd, z, expected):
    a = dataclasses.replace(assessment(1.5), decision_speedup=decision, projected_speedup=projected, speedup_log_sd=sd)
    assert pessimistic_speedup(a, z) == pytest.approx(expected)


@pytest.mark.parametrize(("z", "action"), [(1.0, Action.NONE), (0.0, Action.ENABLE)])
def test_what_the_evidence_leaves_open_keeps_sd_off(z, action):
    """SD predicted 1.25× (above 1.2), but the posterior leaves 10 % open on its log: 1.13× at its
    pessimistic end does not clear the threshold."""
    settings = S.model_copy(update={"enable_posterior_z": z})
    a = dataclasses.replace(assessment(1.25), projected_speedup=1.25, speedup_log_sd=0.1)
    d, _ = decide(settings.policy, off_state(), obs(), a, AUTO, T0)
    assert d.action is action


@pytest.mark.parametrize(
    ("on", "speedup", "saving", "enabled", "wanted_since", "acts", "reason"),
    [
        # SD still wins now, but the rise makes the later restart dearer by more than 20 % of it
        (True, 1.3, 300.0, True, None, True, Reason.RISE_AHEAD),  # no excursion filter: the line is 2 h old
        (True, 1.3, 200.0, True, None, False, Reason.STEADY),  # 20 % of the cost (1000): not enough
        (True, 1.3, 300.0, False, None, False, Reason.STEADY),  # disable_ahead_of_rise off
        (True, 0.9, 300.0, True, None, False, Reason.EXCURSION),  # past the break-even: the rule's own path
        (False, 1.1, 300.0, True, None, False, Reason.STEADY),  # SD off: nothing to anticipate
    ],
)
def test_sd_is_disabled_ahead_of_a_rise_when_the_later_restart_is_dearer(
    on, speedup, saving, enabled, wanted_since, acts, reason
):
    settings = RISK.model_copy(update={"disable_ahead_of_rise": enabled, "rise_saving_margin": 0.2}).policy
    a = dataclasses.replace(
        risky(speedup),
        switch_cost_request_s=1000.0,
        early_disable_saving_request_s=saving,
        rule_disable_in_s=5400.0,
    )
    state = (on_state if on else off_state)(switch_wanted_since=wanted_since)
    d, _ = decide(settings, state, obs(), a, AUTO, T0)
    assert (d.acts, d.reason) == (acts, reason)
    if reason is Reason.RISE_AHEAD:
        assert d.action is Action.DISABLE and d.desired_enabled is False
        assert "in 5400s" in d.detail and "saves 300 req·s" in d.detail


def test_disabling_ahead_of_a_rise_still_waits_for_the_dwell():
    a = dataclasses.replace(risky(1.3), switch_cost_request_s=1000.0, early_disable_saving_request_s=900.0)
    d, _ = decide(RISK.policy, on_state(last_change_at=T0 - 60), obs(), a, AUTO, T0)
    assert (d.action, d.reason) == (Action.NONE, Reason.DWELL)
