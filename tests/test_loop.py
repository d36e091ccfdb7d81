"""The whole loop on virtual time: real source parsing, fake launcher, real exporter and state file."""

import dataclasses
import json

import pytest
import structlog
from prometheus_client import CollectorRegistry

from controller.calibration import load
from controller.hooks.base import ChangeRequest, HookError, HookPhase, HookStatus
from controller.loop import Controller, override_from_file
from controller.settings import OverrideMode, Settings
from controller.sources.vllm_metrics import VllmMetricsSource
from controller.state_store import FileStateStore, MemoryStateStore
from tests.support import LEGACY_CALIBRATION
from tests.support.fake_vllm import FakeVllmServer

MODEL = load(LEGACY_CALIBRATION).latency_model()
T0 = 1_800_000_000.0


class Clock:
    def __init__(self, t=T0):
        self.t = t

    def __call__(self):
        return self.t


class FakeLauncher:
    """The launcher's behaviour on virtual time: a restart takes ``restart_s``, resets vLLM."""

    def __init__(self, clock, vllm, restart_s=90.0, enabled=True, fail_next=False):
        self.clock, self.vllm, self.restart_s = clock, vllm, restart_s
        self.enabled, self.tokens = enabled, 4
        self.restart_until = None
        self.requests = []
        self.fail_next = fail_next
        self.durations = []
        self.restart_count = 0

    def request(self, change: ChangeRequest):
        if self.restart_until is not None:
            raise HookError("HTTP 409: restart in progress")
        self.requests.append(change)
        self.restart_until = self.clock() + self.restart_s
        self.target = change

    def status(self):
        if self.restart_until is not None and self.clock() >= self.restart_until:
            self.restart_until = None
            if self.fail_next:
                self.fail_next = False
                self.restart_count += 2  # the attempt and the rollback
                return HookStatus(
                    HookPhase.FAILED, self.enabled, self.tokens, tuple(self.durations), "not ready", self.restart_count
                )
            self.enabled = self.target.enabled
            self.tokens = self.target.num_speculative_tokens
            self.durations.append(self.restart_s)
            self.restart_count += 1
            self.vllm.restart(sd_enabled=self.enabled)
        phase = HookPhase.RESTARTING if self.restart_until is not None else HookPhase.READY
        return HookStatus(phase, self.enabled, self.tokens, tuple(self.durations), restart_count=self.restart_count)


def drive(vllm, rate, seconds, acceptance=0.6, sd=True):
    """Requests finishing at ``rate`` for ``seconds`` of virtual time, with SD counters."""
    n = round(rate * seconds)
    if n == 0:
        return
    kw = dict(requests=n, prompt_tokens=n * 512, gen_tokens=n * 256, e2e_latency_s=2.0)
    if vllm.sd_enabled and sd:
        drafts = n * 256 / (1 + 4 * acceptance)
        shape = [1.3, 1.1, 0.9, 0.7]  # per-position acceptance falls with position, sums to 4
        per_pos = [drafts * acceptance * s for s in shape]
        kw.update(
            drafts=drafts, draft_tokens=4 * drafts, accepted_tokens=4 * drafts * acceptance, accepted_per_pos=per_pos
        )
    vllm.advance(**kw)


def make(tmp_path=None, store=None, **settings_kw):
    clock = Clock()
    vllm = FakeVllmServer(clock=clock)  # not started: the loop reads render() directly
    hook = FakeLauncher(clock, vllm)
    base = dict(calibration_file=LEGACY_CALIBRATION, price_switches=False)
    base.update(settings_kw)
    settings = Settings(**base)
    registry = CollectorRegistry()

    def fetch():  # the fake's fault modes, without HTTP
        return "<html>502</html>\n{{{" if vllm.mode == "garbage" else vllm.render()

    ctl = Controller(
        settings, MODEL, VllmMetricsSource(fetch=fetch), hook, clock, registry=registry,
        state_store=store or MemoryStateStore(),
    )  # fmt: skip
    return ctl, clock, vllm, hook, registry


def run_ticks(ctl, clock, vllm, rate, n, acceptance=0.6):
    results = []
    for _ in range(n):
        clock.t += 60
        drive(vllm, rate, 60, acceptance)
        results.append(ctl.tick())
    return results


def test_disables_under_load_then_reenables_with_dwell_and_lock(tmp_path):
    ctl, clock, vllm, hook, reg = make()
    ctl.tick()  # warming up
    # Example calibration: break-even around 14 req/s at this acceptance; 16 req/s is past it.
    res = run_ticks(ctl, clock, vllm, rate=16, n=3)
    assert [r.decision.action.value for r in res][:2] == ["disable", "none"]
    assert res[0].decision.reason.value == "speedup_below_disable_threshold"
    assert res[1].decision.reason.value == "change_pending"
    assert hook.requests[0].enabled is False
    # Restart done at +90 s; SD series are gone; acceptance comes from memory now.
    res = run_ticks(ctl, clock, vllm, rate=1, n=12)
    actions = [r.decision.action.value for r in res]
    assert "enable" in actions
    first_enable = actions.index("enable")
    confirmed_at = ctl.state.last_change_at
    assert res[0].events == () or "change_confirmed:off" in map(str, res[0].events + res[1].events)
    # Not before the dwell: 300 s after the confirmed change.
    enable_time = res[first_enable].now
    assert enable_time - hook.requests[0].requested_at >= 300
    assert res[first_enable].assessment.acceptance.source.value == "last"
    assert reg.get_sample_value("sd_toggles_total", {"direction": "off"}) == 1
    assert confirmed_at is not None


def test_observation_failures_hold_and_are_counted():
    ctl, clock, vllm, hook, reg = make()
    ctl.tick()
    run_ticks(ctl, clock, vllm, rate=1, n=2)
    vllm.set_mode("garbage")
    for _ in range(3):
        clock.t += 60
        r = ctl.tick()
        assert r.decision.action.value == "none" and r.decision.reason.value == "observation_unusable"
        assert r.failure is not None and r.failure.reason.value == "parse_error"  # carried, not re-parsed
    vllm.set_mode("ok")
    assert reg.get_sample_value("sd_controller_observation_failures_total", {"reason": "parse_error"}) == 3
    assert hook.requests == []


def test_failed_change_backs_off_then_retries():
    ctl, clock, vllm, hook, reg = make(pending_timeout_s=120, failure_backoff_s=300)
    hook.fail_next = True
    ctl.tick()
    res = run_ticks(ctl, clock, vllm, rate=16, n=12)
    events = [str(e) for r in res for e in r.events]
    assert "change_failed:hook_reported_failure" in events
    assert reg.get_sample_value("sd_controller_change_failures_total") == 1
    phases = [r.decision.phase.value for r in res]
    assert "failed" in phases
    assert len(hook.requests) == 2  # retried once after the backoff, not every tick
    gap = hook.requests[1].requested_at - hook.requests[0].requested_at
    assert gap >= 300


def test_an_operators_switch_right_after_ours_is_adopted_with_its_dwell():
    ctl, clock, vllm, hook, reg = make()
    ctl.tick()  # warming up
    res = run_ticks(ctl, clock, vllm, rate=16, n=1)
    assert res[0].decision.action.value == "disable" and ctl.state.pending.restarts_before == 0
    # Between two ticks ours completes (SD off) and an operator switches SD back on at once.
    clock.t += 90
    assert hook.status().applied_enabled is False
    hook.request(ChangeRequest(enabled=True, num_speculative_tokens=4, reason="operator"))
    clock.t += 90
    res = run_ticks(ctl, clock, vllm, rate=16, n=1)
    assert tuple(map(str, res[0].events)) == ("change_confirmed:off", "external_change:on")
    assert ctl.state.pending is None and ctl.state.applied_enabled is True
    assert ctl.state.last_change_at == res[0].now and ctl.state.consecutive_failures == 0
    # The operator's restart gets the dwell, not a timeout ten minutes on and its backoff.
    res = run_ticks(ctl, clock, vllm, rate=16, n=4)
    assert {r.decision.reason.value for r in res} == {"dwell"}
    assert not any(str(e).startswith("change_failed") for r in res for e in r.events)
    assert reg.get_sample_value("sd_controller_change_failures_total") == 0
    assert reg.get_sample_value("sd_toggles_total", {"direction": "off"}) == 1  # ours ran
    assert reg.get_sample_value("sd_toggles_total", {"direction": "on"}) == 1
    assert len(hook.requests) == 2  # ours and the operator's


def test_controller_restart_keeps_dwell_and_pending(tmp_path):
    path = tmp_path / "state.json"
    ctl, clock, vllm, hook, _ = make(store=FileStateStore(path))
    ctl.tick()
    run_ticks(ctl, clock, vllm, rate=16, n=3)  # disable issued and confirmed
    saved = json.loads(path.read_text())
    assert saved["applied_enabled"] is False and saved["last_change_at"] is not None
    # A new controller process (same state file, same launcher): the dwell still holds.
    ctl2 = Controller(
        ctl.settings, MODEL, VllmMetricsSource(fetch=vllm.render), hook, clock, state_store=FileStateStore(path)
    )
    assert ctl2.state.last_change_at == saved["last_change_at"]
    ctl2.tick()
    clock.t += 60
    drive(vllm, 1, 60)
    r = ctl2.tick()
    assert r.decision.reason.value in ("dwell", "within_thresholds", "switch_cost_exceeds_gain")
    assert r.decision.action.value == "none"


def test_corrupt_state_file_is_set_aside(tmp_path):
    path = tmp_path / "state.json"
    path.write_text('{"version": 1, "applied_enabled": "maybe"}')
    store = FileStateStore(path)
    with structlog.testing.capture_logs() as logs:
        state = store.load()
    assert state.applied_enabled is None
    assert store.set_aside is not None and store.set_aside.exists() and not path.exists()
    assert any(e["event"] == "state_file_corrupt" for e in logs)


def test_pending_change_survives_a_crash_between_intent_and_request(tmp_path):
    path = tmp_path / "state.json"
    ctl, clock, vllm, hook, _ = make(store=FileStateStore(path))

    def crash(change):
        raise SystemExit("killed mid-request")

    ctl.tick()
    hook.request = crash
    clock.t += 60
    drive(vllm, 16, 60)
    with pytest.raises(SystemExit):
        ctl.tick()
    # The intent was recorded before the hook call: nothing issued is unrecorded.
    assert json.loads(path.read_text())["pending"]["enabled"] is False


def test_override_file_read_every_tick(tmp_path):
    f = tmp_path / "override"
    ctl, clock, vllm, hook, _ = make()
    ctl.override = override_from_file(f, OverrideMode.AUTO)
    ctl.tick()
    run_ticks(ctl, clock, vllm, rate=1, n=1)
    assert hook.requests == []
    f.write_text("off\n")
    r = run_ticks(ctl, clock, vllm, rate=1, n=1)[0]
    assert (r.decision.action.value, r.decision.reason.value, r.decision.phase.value) == (
        "disable",
        "override",
        "override",
    )
    f.write_text("sideways")
    with structlog.testing.capture_logs() as logs:
        assert ctl.override() is OverrideMode.AUTO
    assert logs[0]["event"] == "override_file_invalid"


def test_decision_logged_once_with_reasons():
    ctl, clock, vllm, _hook, _ = make()
    ctl.tick()
    with structlog.testing.capture_logs() as logs:
        run_ticks(ctl, clock, vllm, rate=16, n=1)
    decisions = [e for e in logs if e["event"] == "decision"]
    assert len(decisions) == 1
    d = decisions[0]
    assert d["action"] == "disable" and d["reason"] == "speedup_below_disable_threshold"
    for key in ("arrival_rate_rps", "acceptance_rate", "predicted_speedup", "enable_threshold", "disable_threshold"):
        assert key in d


def test_dry_run_never_calls_the_hook():
    ctl, clock, vllm, hook, _ = make()
    ctl.dry_run = True
    ctl.tick()
    res = run_ticks(ctl, clock, vllm, rate=16, n=3)
    assert hook.requests == [] and all(r.decision.action.value == "disable" for r in res)


def test_future_times_in_the_state_file_are_clamped_and_logged(tmp_path):
    from controller.state import ControllerState, PendingChange

    year = 365 * 86400.0
    future = ControllerState(
        applied_enabled=True,
        applied_draft_length=4,
        last_change_at=T0 + year,  # a restored backup from a clock that ran ahead
        pending=PendingChange(False, None, issued_at=T0 + year, reason="old"),
        retry_not_before=T0 + year,
    )
    ctl, clock, _, _, _ = make(store=MemoryStateStore(future), pending_timeout_s=600)
    with structlog.testing.capture_logs() as logs:
        ctl.tick()
    clamped = [e for e in logs if e["event"] == "state_time_in_future"]
    assert clamped and set(clamped[0]["fields"]) == {"last_change_at", "pending", "retry_not_before"}
    assert ctl.state.last_change_at <= T0 and ctl.state.retry_not_before <= T0 + ctl.settings.failure_backoff_max_s
    # The pending change now times out on schedule instead of locking the controller forever.
    for _ in range(12):
        clock.t += 60
        ctl.tick()
    assert ctl.state.pending is None


def test_healthz_reports_failing_ticks():
    import threading

    from controller.loop import run_loop

    class BrokenStore(MemoryStateStore):
        def save(self, state):  # a read-only state directory
            raise PermissionError(13, "Permission denied")

    ctl, *_ = make(store=BrokenStore())
    assert ctl.healthy() == (True, "starting")
    run_loop(ctl, threading.Event(), interval_s=0, max_ticks=1)
    ok, why = ctl.healthy()
    assert ok and "Permission denied" in why  # one failure: reported, still alive
    run_loop(ctl, threading.Event(), interval_s=0, max_ticks=2)
    ok, why = ctl.healthy()
    assert not ok and why.startswith("failing: 3 ticks in a row") and "PermissionError" in why


def test_healthz_unhealthy_when_no_tick_ever_completes():
    ctl, clock, _, _, _ = make()
    clock.t += 3 * ctl.settings.evaluation_interval_s + 1
    ok, why = ctl.healthy()
    assert not ok and why.startswith("no tick completed")


def test_enabling_is_judged_with_the_posterior_width_while_sd_is_off():
    """SD off: the tick's assessment carries the posterior sd of the log speedup (what SD-off
    evidence cannot pin down); SD on: it is not computed."""
    ctl, clock, vllm, hook, _ = make()
    ctl.tick()
    on = run_ticks(ctl, clock, vllm, rate=4, n=2)
    assert all(r.assessment.speedup_log_sd is None for r in on)
    hook.enabled = False
    vllm.restart(sd_enabled=False)
    off = run_ticks(ctl, clock, vllm, rate=4, n=3)
    sds = [r.assessment.speedup_log_sd for r in off[1:]]
    assert all(sd is not None and 0.01 < sd < 1.0 for sd in sds)


def test_the_kv_full_limit_is_priced_by_the_servers_own_prefix_caching():
    # The calibration recorded nothing (priced as without it); the vLLM reports
    # enable_prefix_caching. The loop's, the learner's and the fleet plan's model follow what
    # the server says, once per setting; a server that stops saying keeps the last setting.
    ctl, clock, vllm, _, _ = make()
    assert ctl.model.prefix_caching is False
    fingerprint = ctl.learner.fingerprint
    vllm.cache_config, vllm.prefix_caching = (8192, 16), True
    with structlog.testing.capture_logs() as logs:
        run_ticks(ctl, clock, vllm, 2.0, 3)
        assert ctl.model.prefix_caching is ctl.learner.base.prefix_caching is ctl.learner.model.prefix_caching is True
        assert ctl.model == dataclasses.replace(MODEL, prefix_caching=True)  # nothing else moves
        vllm.prefix_caching = None  # the label gone: the last setting stands
        run_ticks(ctl, clock, vllm, 2.0, 2)
        assert ctl.learner.model.prefix_caching is True
        vllm.prefix_caching = False  # relaunched without it: what the calibration prices
        run_ticks(ctl, clock, vllm, 2.0, 2)
        assert ctl.model.prefix_caching is ctl.learner.model.prefix_caching is False
    repriced = [e for e in logs if e["event"] == "prefix_caching_repriced"]
    assert [(e["server"], e["calibration"]) for e in repriced] == [(True, False), (False, False)]
    assert "calibrate --prefix-caching on" in repriced[0]["detail"]
    assert "calibrate" not in repriced[1]["detail"]
    assert not [e for e in logs if e["event"] == "prefix_caching_differs"]
    assert ctl.learner.fingerprint == fingerprint  # the same calibration: its evidence stays


def test_a_server_whose_prefix_caching_is_not_what_the_calibration_prices_is_warned_once():
    # follow_prefix_caching off: the calibration's price stays; one warning per setting the
    # server reports, none when they agree.
    ctl, clock, vllm, _, _ = make(follow_prefix_caching=False)
    assert ctl.model.prefix_caching is False
    vllm.cache_config, vllm.prefix_caching = (8192, 16), True
    with structlog.testing.capture_logs() as logs:
        run_ticks(ctl, clock, vllm, 2.0, 3)
        vllm.prefix_caching = False  # relaunched without it: what the calibration prices
        run_ticks(ctl, clock, vllm, 2.0, 2)
        vllm.prefix_caching = True
        run_ticks(ctl, clock, vllm, 2.0, 2)
    warned = [e for e in logs if e["event"] == "prefix_caching_differs"]
    assert [(e["server"], e["calibration"]) for e in warned] == [(True, False), (True, False)]
    assert "calibrate --prefix-caching on" in warned[0]["detail"]
    assert ctl.model.prefix_caching is ctl.learner.model.prefix_caching is False
