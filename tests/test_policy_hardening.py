"""Hardening of the decision core and its shell against inputs that lie.

* the safety net checks an observed latency against Little's law before it counts as harm;
* while the hook cannot report the applied state, the state follows what the metrics show;
* a model that cannot price absurd inputs holds the tick instead of failing it;
* an override file that is not UTF-8 is logged and ignored.

Pure-policy cases are tables over timestamps (as in test_policy.py); loop cases run the real
loop on virtual time (as in test_loop.py).
"""

import dataclasses

import pytest
import structlog

from controller.events import EventKind
from controller.hooks.base import ChangeRequest, HookPhase, HookStatus
from controller.loop import Controller, override_from_file
from controller.observation import FailureReason, ObservationFailure
from controller.policy import (
    SERIES_AGREE_TICKS,
    Action,
    Reason,
    SeriesRun,
    decide,
    follow_series,
)
from controller.settings import OverrideMode, Settings
from controller.sources.vllm_metrics import VllmMetricsSource
from controller.state import ControllerState, PendingChange
from tests.support import LEGACY_CALIBRATION
from tests.support.fake_vllm import FakeVllmServer
from tests.test_loop import MODEL, Clock, drive, make, run_ticks
from tests.test_policy import AUTO, T0, assessment, obs, off_state, on_state
from tests.test_policy_safety_net import STEADY, S, harm, run

UNKNOWN = HookStatus(HookPhase.UNKNOWN)  # NoHook, an ExecHook before its first change
READY_ON = HookStatus(HookPhase.READY, applied_enabled=True, applied_draft_length=4)
HARM = (Action.DISABLE, Reason.OBSERVED_SD_HARM)


# --- 1. the safety net and Little's law ------------------------------------------------------
# assessment() predicts 2.0 s with SD off; obs() arrives at 5 req/s. Harm needs 3 ticks (S).


@pytest.mark.parametrize(
    ("name", "observations", "expected_last"),
    [
        # A glitch in the latency sum: 68 s at 5 req/s would keep ~340 requests in the server,
        # and 20 are running: not harm, however many ticks it lasts.
        ("glitch, few in server", harm(5, latency=68.0, running=20.0, waiting=0.0), STEADY),
        ("glitch, a small queue", harm(5, latency=68.0, running=20.0, waiting=30.0), STEADY),
        # 2.5 s at 5 req/s: ~12.5 in the server; 10 running is enough to believe it.
        ("real harm, consistent", harm(3, latency=2.5, running=10.0, waiting=0.0), HARM),
        # 68 s with a queue that carries it (≥ half of 340): harm.
        ("long latency, a queue that carries it", harm(3, latency=68.0, running=64.0, waiting=200.0), HARM),
        # at low load one request of Poisson noise is allowed: 2.5 s at 5 req/s, 6 in the server
        ("just inside the slack", harm(3, latency=2.5, running=5.0, waiting=0.25), HARM),
        ("just outside the slack", harm(3, latency=2.5, running=5.0, waiting=0.0), STEADY),
        # Unknown running or waiting: today's behaviour (the observed latency is taken as is).
        ("running unknown", harm(3, latency=68.0, waiting=0.0), HARM),
        ("waiting unknown", harm(3, latency=68.0, running=20.0), HARM),
        ("neither known", harm(3, latency=68.0), HARM),
    ],
)  # fmt: skip
def test_observed_harm_must_agree_with_littles_law(name, observations, expected_last):
    decisions, _ = run(S, on_state(), observations)
    assert decisions[-1] == expected_last, name
    assert all(d[0] is Action.NONE for d in decisions[:-1]), name


@pytest.mark.parametrize(
    ("name", "observations", "expected_last"),
    [
        # The latency is a window mean over minutes: after a drop it still holds requests that met
        # the heavier load, against a prediction at the lighter one.
        ("a drop from 12 to 5 req/s", harm(3, arrival_rate_long_rps=12.0), STEADY),
        ("a drop to idle, nothing in the server", harm(3, latency=3.5, rate=0.0, arrival_rate_long_rps=10.0,
                                                       running=0.0, waiting=0.0), STEADY),
        # within the long mean's band (10 % and two Poisson sd of a minute's count): steady, harm
        ("steady, the long mean a little higher", harm(3, arrival_rate_long_rps=5.5), HARM),
        ("a rising load", harm(3, arrival_rate_long_rps=3.0), HARM),
    ],
)  # fmt: skip
def test_observed_harm_is_not_read_off_a_load_that_fell(name, observations, expected_last):
    decisions, _ = run(S, on_state(), observations)
    assert decisions[-1] == expected_last, name


def test_an_inconsistent_tick_breaks_the_harm_run():
    # Two real harm ticks, one glitch the server's queue cannot carry, one more harm tick: the
    # run restarts at the glitch, so three ticks in a row are never reached.
    o = harm(4, latency=2.5, running=10.0, waiting=0.0)
    o[2] = dataclasses.replace(o[2], mean_e2e_latency_s=68.0)
    decisions, state = run(S, on_state(), o)
    assert decisions == [STEADY] * 4
    assert state.sd_harm_ticks == 1


# --- 2. following the metrics while the hook cannot say --------------------------------------


def _series(observations, statuses=None, state=None):
    """follow_series over a table of observations; returns the runs after each."""
    state = state or on_state()
    run_, out = SeriesRun(), []
    for i, o in enumerate(observations):
        status = statuses[i] if statuses else UNKNOWN
        run_ = follow_series(run_, state, status, o, S)
        out.append(run_)
    return out


def test_follow_series_counts_usable_observations_that_agree():
    on, off = obs(sd_series_present=True), obs(sd_series_present=False)
    failed = ObservationFailure(FailureReason.UNREACHABLE, "restarting")
    runs = _series([off, off, failed, obs(), off, on, on])
    assert [(r.present, r.ticks) for r in runs] == [
        (False, 1),
        (False, 2),
        (False, 2),  # an unusable observation neither counts nor breaks the run
        (False, 2),  # nor does one that cannot tell
        (False, 3),
        (True, 1),  # a disagreeing one starts a new run
        (True, 2),
    ]


def test_follow_series_is_empty_while_the_hook_reports():
    off = obs(sd_series_present=False)
    assert _series([off] * 4, statuses=[READY_ON] * 4)[-1] == SeriesRun()
    # The hook stops reporting: the run starts from scratch.
    assert _series([off] * 4, statuses=[READY_ON, READY_ON, UNKNOWN, UNKNOWN])[-1] == SeriesRun(False, 2)
    # A change pending that the hook cannot report on: the metrics are all there is to confirm it.
    pending = on_state(pending=PendingChange(False, None, T0, "x"))
    assert _series([off] * 4, state=pending)[-1] == SeriesRun(False, 4)
    assert _series([off] * 4, state=pending, statuses=[READY_ON] * 4)[-1] == SeriesRun()


def _decide_series(state, presents, speedup=1.5, settings=S, start=T0, step=60.0):
    """follow_series + decide tick after tick with an UNKNOWN hook; [(decision, state)]."""
    run_, out = SeriesRun(), []
    for i, present in enumerate(presents):
        now = start + i * step
        o = obs(t=now, sd_series_present=present)
        run_ = follow_series(run_, state, UNKNOWN, o, settings)
        d, state = decide(settings, state, o, assessment(speedup), AUTO, now, series=run_)
        out.append((d, state))
    return out


def test_a_first_inference_from_a_scrape_without_sd_families_is_corrected_without_a_restart():
    # Nothing known; the first usable scrape lacks the spec_decode families (SD "off"), every
    # later one shows them. SD is worth it (1.5 > the enable threshold): the old core took the
    # first scrape's word and enabled SD, a needless restart of a server that already runs it.
    ticks = _decide_series(ControllerState(), [False, True, True, True, True])
    decisions = [d for d, _ in ticks]
    assert not any(d.acts for d in decisions)
    assert [d.reason for d in decisions[:3]] == [Reason.APPLIED_UNKNOWN] * 3
    assert "metrics show SD off for 1 of 3 ticks, the state says unknown" in decisions[0].detail
    assert "metrics show SD on for 2 of 3 ticks" in decisions[2].detail
    d, state = ticks[SERIES_AGREE_TICKS]  # the third scrape in a row with SD series
    assert state.applied_enabled is True and state.last_change_at is None  # a first inference, no change
    assert d.reason is Reason.STEADY and d.events == ()


def test_a_wrong_state_is_corrected_as_an_external_change():
    # The state says off (an earlier inference from a bad scrape); the metrics show SD on.
    ticks = _decide_series(off_state(), [True] * 4)
    assert not any(d.acts for d, _ in ticks)  # the old core enabled SD on the first tick
    assert [d.reason for d, _ in ticks] == [Reason.APPLIED_UNKNOWN] * 2 + [Reason.STEADY] * 2
    d, state = ticks[2]
    assert state.applied_enabled is True and state.last_change_at == T0 + 120
    assert [(e.kind, e.detail) for e in d.events] == [(EventKind.EXTERNAL_CHANGE, "on")]
    assert ticks[3][0].events == ()  # adopted once


def test_an_override_waits_for_the_metrics_to_agree():
    # Override on, nothing known, vLLM runs SD: no restart into what already runs.
    state, run_, out = ControllerState(), SeriesRun(), []
    for i in range(4):
        now = T0 + 60 * i
        o = obs(t=now, sd_series_present=True)
        run_ = follow_series(run_, state, UNKNOWN, o, S)
        d, state = decide(S, state, o, assessment(1.5), OverrideMode.ON, now, series=run_)
        out.append((d.action, d.reason))
    assert out == [(Action.NONE, Reason.APPLIED_UNKNOWN)] * 2 + [(Action.NONE, Reason.ALREADY_APPLIED)] * 2


@pytest.mark.parametrize(
    ("name", "state", "presents", "speedup", "expected"),
    [
        # An operator restarted vLLM without SD; SD still pays (3.0): the adoption counts as a
        # change, so the dwell protects the freshly restarted server.
        ("off adopted, dwell holds", on_state(), [False] * 3, 3.0,
         [(Action.NONE, Reason.APPLIED_UNKNOWN), (Action.NONE, Reason.APPLIED_UNKNOWN), (Action.NONE, Reason.DWELL)]),
        # Two ticks are not enough: the state stays, the decision holds.
        ("two ticks hold", on_state(), [False] * 2, 0.5,
         [(Action.NONE, Reason.APPLIED_UNKNOWN)] * 2),
        # A single odd scrape among agreeing ones: the run restarts, nothing is adopted.
        ("odd scrape", on_state(), [False, False, True, False, False], 1.5,
         [(Action.NONE, Reason.APPLIED_UNKNOWN)] * 2 + [STEADY] + [(Action.NONE, Reason.APPLIED_UNKNOWN)] * 2),
        # The metrics agree with the state: nothing changes.
        ("agrees", off_state(), [False] * 4, 1.1, [STEADY] * 4),
        # A change of ours is pending: the metrics showing the old setting do not move it; three
        # showing its target confirm it (the hook cannot), and the dwell starts.
        ("pending, old setting shown", on_state(pending=PendingChange(False, None, T0, "x")), [True] * 4, 1.5,
         [(Action.NONE, Reason.PENDING)] * 4),
        ("pending, confirmed by the metrics", on_state(pending=PendingChange(False, None, T0, "x")),
         [True, False, False, False], 1.5, [(Action.NONE, Reason.PENDING)] * 3 + [(Action.NONE, Reason.DWELL)]),
    ],
)  # fmt: skip
def test_state_follows_the_metrics_while_the_hook_cannot_say(name, state, presents, speedup, expected):
    ticks = _decide_series(state, presents, speedup)
    assert [(d.action, d.reason) for d, _ in ticks] == expected, name
    if name == "off adopted, dwell holds":
        final = ticks[-1][1]
        assert final.applied_enabled is False and final.last_change_at == T0 + 120
        # After the dwell the model's rule may act again (SD on pays at 3.0).
        later = T0 + 120 + S.dwell_s
        o = obs(t=later, sd_series_present=False)
        d, _ = decide(S, final, o, assessment(3.0), AUTO, later, series=SeriesRun(False, 4))
        assert (d.action, d.reason) == (Action.ENABLE, Reason.SPEEDUP_HIGH)
    if name in ("two ticks hold", "odd scrape", "pending"):
        assert ticks[-1][1].applied_enabled is state.applied_enabled


def test_without_series_decide_keeps_its_old_contract():
    # A caller that does not follow the metrics (series None): a contradicting scrape is not
    # acted upon by the state machine.
    d, state = decide(S, on_state(), obs(sd_series_present=False), assessment(1.5), AUTO, T0)
    assert (d.action, d.reason) == STEADY and state.applied_enabled is True


class UnknownHook:
    """A hook that cannot report what is applied (NoHook, or ExecHook before its first change)."""

    def __init__(self):
        self.requests: list[ChangeRequest] = []

    def request(self, change: ChangeRequest) -> None:
        self.requests.append(change)

    def status(self) -> HookStatus:
        return HookStatus(HookPhase.UNKNOWN)


def _drop_spec_decode(text: str) -> str:
    keep = []
    for line in text.splitlines():
        name = line.split(" ", 3)[2] if line.startswith("#") and len(line.split(" ")) > 2 else line
        if not name.startswith("vllm:spec_decode"):
            keep.append(line)
    return "\n".join(keep) + "\n"


def _unknown_hook_controller(glitch_scrapes=()):
    clock = Clock()
    vllm = FakeVllmServer(clock=clock)
    hook = UnknownHook()
    settings = Settings(calibration_file=LEGACY_CALIBRATION, price_switches=False)
    scrapes = [0]

    def fetch():
        scrapes[0] += 1
        text = vllm.render()
        return _drop_spec_decode(text) if scrapes[0] in glitch_scrapes else text

    ctl = Controller(settings, MODEL, VllmMetricsSource(fetch=fetch), hook, clock)
    return ctl, clock, vllm, hook


def test_loop_corrects_a_first_scrape_without_sd_families_without_restarting():
    # The first scrape warms up; the second, the first usable one, lacks the SD families.
    ctl, clock, vllm, hook = _unknown_hook_controller(glitch_scrapes={2})
    ctl.tick()
    res = run_ticks(ctl, clock, vllm, rate=4, n=6)
    assert hook.requests == []  # the old loop "enabled" SD on a server running it
    assert ctl.state.applied_enabled is True and ctl.state.last_change_at is None  # inferred, not changed
    # Held until the metrics agree: the scrape that lacks the families is itself held by the source
    # (a torn scrape) or, read as usable, contradicted by the ones after it.
    assert all(r.decision.reason in (Reason.APPLIED_UNKNOWN, Reason.OBSERVATION) for r in res[:3])
    assert any(r.decision.reason is Reason.APPLIED_UNKNOWN for r in res[:3])
    assert all(r.decision.reason is Reason.STEADY for r in res[3:])


def test_loop_notices_an_operator_restarting_vllm_without_sd():
    ctl, clock, vllm, hook = _unknown_hook_controller()
    ctl.tick()
    run_ticks(ctl, clock, vllm, rate=4, n=3)
    assert ctl.state.applied_enabled is True
    vllm.restart(sd_enabled=False)  # not through the controller
    res = run_ticks(ctl, clock, vllm, rate=4, n=5)
    assert ctl.state.applied_enabled is False
    changed = [r for r in res if any(e.kind is EventKind.EXTERNAL_CHANGE for e in r.events)]
    assert len(changed) == 1 and ctl.state.last_change_at == changed[0].now
    assert hook.requests == []


# --- 3. an assessment that raises holds the tick ---------------------------------------------


@pytest.mark.parametrize(
    ("where", "exc"),
    [
        # what the model raised on a 1e150-token mean prompt (queueing.cumulative_log_rates)
        ("assess", ValueError("departure rates must be positive\nsecond line")),
        ("learn", OverflowError("(34, 'Numerical result out of range')")),  # the learner prices it too
        ("speedup_log_sd", ZeroDivisionError("float division by zero")),
    ],
)
def test_an_assessment_that_cannot_price_the_inputs_holds_instead_of_failing_the_tick(monkeypatch, where, exc):
    import controller.loop as loop

    ctl, clock, vllm, hook, reg = make()
    ctl.tick()
    run_ticks(ctl, clock, vllm, rate=16, n=1)  # SD off requested and confirmed: SD off from here
    run_ticks(ctl, clock, vllm, rate=16, n=2)
    assert ctl.state.applied_enabled is False and ctl.state.pending is None
    requests = len(hook.requests)

    def boom(*args, **kwargs):
        raise exc

    if where == "assess":
        monkeypatch.setattr(loop, "assess", boom)
    else:
        monkeypatch.setattr(ctl.learner, where, boom)
    with structlog.testing.capture_logs() as logs:
        res = run_ticks(ctl, clock, vllm, rate=1, n=4)  # the old loop raised here, every tick
    for r in res:
        assert (r.decision.action, r.decision.reason) == (Action.NONE, Reason.OBSERVATION)
        assert r.failure is not None and r.failure.reason is FailureReason.IMPLAUSIBLE
        assert r.decision.detail == f"assessment failed: {type(exc).__name__}: {str(exc).splitlines()[0]}"
        assert r.assessment is None
    assert ctl.healthy() == (True, "ok")
    assert len(hook.requests) == requests  # held: no toggle
    assert reg.get_sample_value("sd_controller_observation_failures_total", {"reason": "implausible"}) == 4
    failed = [e for e in logs if e["event"] == "assessment_failed"]
    assert len(failed) == 1 and "\n" not in failed[0]["error"]  # once, one line
    decisions = [e for e in logs if e["event"] == "decision"]
    assert len(decisions) == 4 and all(e["reason"] == "observation_unusable" for e in decisions)
    assert not any("exc_info" in e or "exception" in e for e in logs)  # no traceback
    # The model prices the inputs again: the controller decides again (SD back on at 1 req/s).
    monkeypatch.undo()
    res = run_ticks(ctl, clock, vllm, rate=1, n=6)
    assert all(r.decision.reason is not Reason.OBSERVATION for r in res)


@pytest.mark.parametrize("exc", [ValueError("departure rates must be positive"), OverflowError("math range")])
def test_assessment_errors_are_caught_but_hook_errors_are_not(monkeypatch, exc):
    import controller.loop as loop

    ctl, clock, vllm, hook, _ = make()
    ctl.tick()

    def boom(*args, **kwargs):
        raise exc

    monkeypatch.setattr(loop, "assess", boom)
    r = run_ticks(ctl, clock, vllm, rate=16, n=1)[0]
    assert r.decision.reason is Reason.OBSERVATION and type(exc).__name__ in r.decision.detail
    monkeypatch.undo()
    run_ticks(ctl, clock, vllm, rate=16, n=1)  # assessments work again: SD off is requested

    def bad_status():
        raise ValueError("a hook bug")

    hook.status = bad_status
    clock.t += 60
    with pytest.raises(ValueError, match="a hook bug"):
        ctl.tick()


# --- 4. an override file that is not UTF-8 ---------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        "on\r\n".encode("utf-16"),  # PowerShell's `"on" | Out-File`
        b"\xff",
        b"o\xc3n",
    ],
)
def test_an_override_file_that_is_not_utf8_is_logged_and_ignored(tmp_path, content):
    f = tmp_path / "override"
    f.write_bytes(content)
    read = override_from_file(f, OverrideMode.AUTO)
    with structlog.testing.capture_logs() as logs:
        assert read() is OverrideMode.AUTO  # the old reader raised UnicodeDecodeError
    assert [e["event"] for e in logs] == ["override_file_unreadable"]
    assert logs[0]["log_level"] == "error" and "UTF-8" in logs[0]["error"]


def test_a_non_utf8_override_file_does_not_fail_ticks(tmp_path):
    f = tmp_path / "override"
    f.write_bytes("off".encode("utf-16"))
    ctl, clock, vllm, hook, _ = make()
    ctl.override = override_from_file(f, OverrideMode.AUTO)
    ctl.tick()
    res = run_ticks(ctl, clock, vllm, rate=1, n=3)
    assert all(r.decision.reason is not Reason.OVERRIDE for r in res) and hook.requests == []
    assert ctl.healthy() == (True, "ok")


# --- 5. an engine that stalls while /metrics answers -----------------------------------------


def test_a_hung_engine_holds_the_loop_instead_of_reading_as_queue_growth_under_sd():
    """A GPU fault or a hung collective: the gauges stay up, the API server queues the arrivals,
    no counter moves. Read as a load, the growing queue tripped the safety net, which disabled
    SD (a restart blamed on SD) and remembered SD as congested at this rate for hours."""
    ctl, clock, vllm, hook, registry = make()
    ctl.tick()  # warming up
    vllm.set_gauges(running=20, waiting=0)
    assert all(r.decision.action is Action.NONE for r in run_ticks(ctl, clock, vllm, rate=8, n=10))
    results = []
    for k in range(12):
        clock.t += 60
        vllm.set_gauges(running=20, waiting=480 * (k + 1))  # 8 req/s queued, none served
        results.append(ctl.tick())
    assert hook.requests == []
    # Every tick held from the first: the minute since the last scrape produced nothing.
    assert all(r.decision.reason is Reason.OBSERVATION and r.decision.detail == "stalled" for r in results)
    assert "20 running and 5760 waiting, no token produced" in results[-1].observation.detail
    assert registry.get_sample_value("sd_controller_observation_failures_total", {"reason": "stalled"}) == 12
    assert ctl.state.sd_congested_rate_rps is None
    # It recovers (an operator restarts it, or it unsticks): served again, decided again.
    vllm.set_gauges(running=20, waiting=0)
    after = run_ticks(ctl, clock, vllm, rate=8, n=2)
    assert all(r.decision.reason is not Reason.OBSERVATION for r in after), [r.decision for r in after]


# --- 6. a controller killed with a change pending --------------------------------------------


def test_a_controller_killed_after_starting_an_exec_hook_confirms_the_change_from_the_metrics(tmp_path):
    """SIGKILL after the pending lock is saved and the script started: the script (its own
    session) finishes, vLLM serves SD off. The next process's exec hook vouched for the state
    file's old setting, so the change was never confirmed: 10 minutes pending, a failure
    alert, and the script run a second time."""
    import argparse

    from controller.commands.run import build
    from controller.state_store import FileStateStore

    runs = tmp_path / "runs.log"
    clock = Clock()
    with FakeVllmServer(clock=clock, sd_enabled=False) as vllm:
        state_file = tmp_path / "state.json"
        FileStateStore(state_file).save(
            ControllerState(
                applied_enabled=True, applied_draft_length=4, last_change_at=clock.t - 3600,
                pending=PendingChange(False, None, clock.t - 30, "queue_growth"),
            )
        )  # fmt: skip
        settings = Settings(
            calibration_file=LEGACY_CALIBRATION, vllm_metrics_url=vllm.metrics_url, state_file=state_file,
            hook_type="exec", hook_exec_argv=["sh", "-c", f'echo "$SD_ENABLED" >> {runs}'],
        )  # fmt: skip
        ctl, _ = build(argparse.Namespace(dry_run=False), settings, clock=clock)
        assert ctl.hook.status().applied_enabled is None  # the lock says its word may be stale
        results = []
        for _ in range(6):
            clock.t += 60
            drive(vllm, 16, 60)
            results.append(ctl.tick())
    events = [str(e) for r in results for e in r.events]
    assert "change_confirmed:off" in events and not any(e.startswith("change_failed") for e in events), events
    assert ctl.state.applied_enabled is False and ctl.state.pending is None
    assert not runs.exists()  # the change was made once, by the process that died
