"""The loop learning from observed latency: the real Controller on virtual time, real files."""

import dataclasses
import json
import math

import pytest
import structlog
from prometheus_client import CollectorRegistry

from controller.calibration import load
from controller.correction import scaled_model
from controller.evidence import Excluded, FileEvidenceStore
from controller.hooks.base import HookPhase, HookStatus
from controller.learning import SAVE_EVERY, FilePosteriorStore, Learner, heavy_traffic_inflation
from controller.loop import Controller
from controller.model import Workload, curves
from controller.observation import Observation, steady_load
from controller.settings import OverrideMode, Settings
from controller.shipped import example_calibration_path
from controller.state import ControllerState

BASE = load(example_calibration_path()).latency_model()
T0 = 1_800_000_000.0
RATES = (1.0, 2.5, 4.0, 5.5)


class TruthSource:
    """vLLM as a model with other costs: observed latency = ``truth``'s at the tick's rate."""

    def __init__(self, truth, enabled=False):
        self.truth, self.enabled, self.i, self.rate = truth, enabled, 0, 1.0

    def observe(self, now):
        self.rate = RATES[self.i % len(RATES)]
        self.i += 1
        on = self.enabled
        gamma, alpha = 4, 0.75
        off_c, on_c = curves(self.truth, alpha, gamma, Workload(1000, 280))
        lat = (on_c if on else off_c).latency_s(self.rate)
        acc = (0.75 - 0.75**5) / (1 - 0.75) - 1  # E[N] − 1 at α=0.75, γ=4 ...
        return Observation(
            time_s=now, arrival_rate_rps=self.rate, sample_age_s=0.0, mean_prompt_tokens=1000,
            mean_gen_tokens=280, running=self.rate * lat, waiting=0.0, mean_e2e_latency_s=lat,
            acceptance_rate=acc / 4 if on else None, mean_draft_tokens=4.0 if on else None,
            sd_series_present=on,
        )  # fmt: skip


class Hook:
    def __init__(self, enabled=False):
        self.enabled, self.phase = enabled, HookPhase.READY

    def request(self, change):
        self.enabled = change.enabled

    def status(self):
        return HookStatus(self.phase, self.enabled, 4)


def controller(settings, truth, tmp_path, enabled=False, base=BASE):
    # The override pins the mode: these tests are about learning, not deciding.
    s = settings.model_copy(
        update={"state_file": tmp_path / "state.json", "override": OverrideMode.ON if enabled else OverrideMode.OFF}
    )
    now = [T0]
    ctl = Controller(
        s,
        base,
        TruthSource(truth, enabled),
        Hook(enabled),
        clock=lambda: now[0],
        registry=CollectorRegistry(),
        learner=Learner.from_settings(s, base),
    )
    ctl.state = ControllerState(applied_enabled=enabled, applied_draft_length=4, last_change_at=T0 - 86400)
    return ctl, now


SETTINGS = Settings(calibration_file="example", hook_type="none", price_switches=False, safety_net=False)


def run(ctl, now, ticks):
    out = []
    for _ in range(ticks):
        now[0] += 60.0
        out.append(ctl.tick())
    return out


def test_the_corrected_model_follows_the_server_and_the_metrics_show_it(tmp_path):
    truth = scaled_model(BASE, (1.0, 1.4, 1.0, 1.0))
    ctl, now = controller(SETTINGS, truth, tmp_path)
    first = run(ctl, now, 4)
    assert math.exp(max(r.learned.update.residual_log for r in first)) > 1.08  # the calibration under-predicts
    results = run(ctl, now, 240)
    last = [abs(r.learned.update.residual_log) for r in results[-8:]]
    assert max(last) < 0.03, last
    reg = ctl.registry
    assert abs(reg.get_sample_value("sd_model_error_ratio", {"mode": "off"}) - 1) < 0.05
    assert reg.get_sample_value("sd_model_correction", {"mode": "off", "term": "load"}) > 1.2
    assert reg.get_sample_value("sd_model_recalibration_alarm") == 0
    assert reg.get_sample_value("sd_model_evidence_ticks") == 244
    corrected = reg.get_sample_value("sd_predicted_latency_seconds", {"mode": "off"})
    calibrated = reg.get_sample_value("sd_calibrated_latency_seconds", {"mode": "off"})
    observed = reg.get_sample_value("sd_observed_latency_seconds")
    assert abs(corrected / observed - 1) < 0.03 < abs(calibrated / observed - 1)


def test_posterior_and_evidence_survive_a_controller_restart(tmp_path):
    truth = scaled_model(BASE, (1.0, 1.3, 1.0, 1.0))
    ctl, now = controller(SETTINGS, truth, tmp_path)
    run(ctl, now, 120)
    factors = ctl.learner.posterior.factors
    again, _ = controller(SETTINGS, truth, tmp_path)
    assert again.learner.posterior.factors == pytest.approx(factors, rel=0.01)
    assert len(again.learner.evidence.load()) == 120
    saved = json.loads((tmp_path / "sd-controller-correction.json").read_text())
    assert 120 - SAVE_EVERY < saved["posterior"]["evidence"] <= 120  # at most a few ticks lost
    assert again.learner.posterior.evidence == saved["posterior"]["evidence"]


def test_a_new_calibration_starts_from_its_own_prior(tmp_path):
    truth = scaled_model(BASE, (1.0, 1.3, 1.0, 1.0))
    ctl, now = controller(SETTINGS, truth, tmp_path)
    run(ctl, now, 30)
    other = scaled_model(BASE, (1.1, 1.0, 1.0, 1.0))
    with structlog.testing.capture_logs() as logs:
        again, _ = controller(SETTINGS, truth, tmp_path, base=other)
    assert again.learner.posterior.factors == (1.0, 1.0, 1.0, 1.0)
    assert "correction_reset" in [e["event"] for e in logs]


def test_a_corrupt_posterior_file_is_set_aside_with_one_log_line(tmp_path):
    path = tmp_path / "sd-controller-correction.json"
    path.write_text('{"calibration": "x", "posterior": {"schema": 1, "mean": "no"}}')
    with structlog.testing.capture_logs() as logs:
        store = FilePosteriorStore(path)
        assert store.load("x") is None
    assert [e["event"] for e in logs] == ["correction_file_corrupt"]
    assert store.set_aside.exists() and not path.exists()


def test_a_rolled_back_switch_stops_the_learning_only_while_its_backoff_runs(tmp_path):
    """The launcher reports "failed" after a rollback until a later switch succeeds, while the
    old setting serves: hours of a serving server's evidence were thrown away."""
    truth = scaled_model(BASE, (1.0, 1.4, 1.0, 1.0))
    ctl, now = controller(SETTINGS, truth, tmp_path)
    run(ctl, now, 3)
    ctl.hook.phase = HookPhase.FAILED  # applied: still off, as the state says
    ctl.state = dataclasses.replace(ctl.state, consecutive_failures=1, retry_not_before=now[0] + 300.0)
    backoff = run(ctl, now, 4)  # the rollback's restart may still be in these minutes
    assert {r.learned.record.excluded for r in backoff} == {Excluded.NOT_READY}
    after = run(ctl, now, 3)
    assert all(r.learned.record.excluded is None and r.learned.update is not None for r in after)
    ctl.hook.enabled = True  # a FAILED status that contradicts the state is no evidence of it
    assert run(ctl, now, 1)[0].learned.record.excluded == Excluded.NOT_READY


def test_ticks_around_a_restart_are_recorded_but_do_not_teach(tmp_path):
    truth = scaled_model(BASE, (1.0, 1.4, 1.0, 1.0))
    ctl, now = controller(SETTINGS, truth, tmp_path)
    run(ctl, now, 3)
    before = ctl.learner.posterior
    ctl.hook.phase = HookPhase.RESTARTING
    r = run(ctl, now, 1)[0]
    assert r.learned.record.excluded == Excluded.NOT_READY and r.learned.update is None
    ctl.hook.phase = HookPhase.READY
    ctl.state = ctl.state.__class__(**{**ctl.state.__dict__, "last_change_at": now[0]})  # just restarted
    results = run(ctl, now, 9)  # 540 s < evidence_settle_s
    assert {x.learned.record.excluded for x in results} == {Excluded.SETTLING}
    assert ctl.learner.posterior == before
    r = run(ctl, now, 2)[-1]
    assert r.learned.record.excluded is None and ctl.learner.posterior != before
    records = FileEvidenceStore(tmp_path / "sd-controller-evidence.jsonl").load()
    assert len(records) == 3 + 1 + 9 + 2


def test_ticks_after_a_crash_restart_do_not_teach_either(tmp_path):
    """A crash sets no change of ours: vLLM's counters say when it started, and the windows
    after it hold the requests that waited through it."""
    truth = scaled_model(BASE, (1.0, 1.4, 1.0, 1.0))
    ctl, now = controller(SETTINGS, truth, tmp_path)
    run(ctl, now, 3)
    before = ctl.learner.posterior
    observe, crashed_at = ctl.source.observe, now[0]
    ctl.source.observe = lambda t: dataclasses.replace(observe(t), server_started_at=crashed_at)
    results = run(ctl, now, 9)  # 540 s < evidence_settle_s
    assert {x.learned.record.excluded for x in results} == {Excluded.SETTLING}
    assert ctl.learner.posterior == before
    assert run(ctl, now, 2)[-1].learned.record.excluded is None


def test_sd_on_evidence_learns_through_all_four_terms(tmp_path):
    truth = scaled_model(BASE, (1.0, 1.3, 1.0, 1.3))
    ctl, now = controller(SETTINGS, truth, tmp_path, enabled=True)
    results = run(ctl, now, 200)
    assert results[-1].learned.record.mode == "on"
    assert max(abs(r.learned.update.residual_log) for r in results[-8:]) < 0.03
    assert ctl.registry.get_sample_value("sd_model_error_ratio", {"mode": "on"}) is not None
    assert ctl.registry.get_sample_value("sd_model_error_ratio", {"mode": "off"}) is None  # no evidence yet


def test_online_correction_off_keeps_the_calibration_and_still_records(tmp_path):
    truth = scaled_model(BASE, (1.0, 1.4, 1.0, 1.0))
    s = SETTINGS.model_copy(update={"online_correction": False})
    ctl, now = controller(s, truth, tmp_path)
    results = run(ctl, now, 20)
    assert ctl.learner.model is BASE and ctl.learner.posterior.evidence == 0
    assert {r.learned.record.excluded for r in results} == {Excluded.DISABLED}


@pytest.mark.parametrize(
    ("rate", "limit", "expected"),
    [
        (0.0, 10.0, 1.0),  # idle: a window's mean is as good as its completions say
        (5.0, 10.0, 2.0),  # half busy
        (9.0, 10.0, 10.0),  # 90 %: the queue's slow fluctuations dominate a minute's mean
        (12.0, 10.0, 20.0),  # past the limit: capped (ρ ≤ 0.95), never infinite or negative
        (5.0, math.inf, 1.0),  # no limit known
        (5.0, 0.0, 1.0),
    ],
)
def test_a_busy_window_teaches_less(rate, limit, expected):
    assert heavy_traffic_inflation(rate, limit) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("rate", "long", "peak", "steady"),
    [
        (9.0, 9.0, 9.6, True),  # a steady load: the minute's peak within Poisson noise
        (9.4, 9.0, None, True),  # no peak reported
        (12.0, 9.0, 12.0, False),  # a step up in the last minute
        (9.0, 9.0, 12.0, False),  # oscillating: back at the mean now, but it peaked at 12
        (6.0, 9.0, 9.5, False),  # a step down
        (2.5, 2.0, 2.5, True),  # low load: a minute holds 120 requests, +25 % is noise
        (5.0, None, None, True),  # no long window: nothing says it moved
    ],
)
def test_steady_load(rate, long, peak, steady):
    assert steady_load(rate, long, peak, 60.0) is steady


def test_the_evidence_records_the_running_context_the_prediction_used(tmp_path):
    class MeasuredContext(TruthSource):
        def observe(self, now):
            return dataclasses.replace(super().observe(now), running_context_tokens=2400.0)

    ctl, now = controller(SETTINGS, BASE, tmp_path)
    ctl.source = MeasuredContext(BASE)
    r = run(ctl, now, 1)[0]
    assert r.learned.record.running_context_tokens == 2400.0
    measured = curves(BASE, 0.75, 4, Workload(1000, 280, running_context_tokens=2400.0))[0].latency_s(RATES[0])
    assert r.learned.record.calibrated_latency_s == pytest.approx(measured, rel=1e-9)
    assert measured > 1.01 * curves(BASE, 0.75, 4, Workload(1000, 280))[0].latency_s(RATES[0])
    stored = FileEvidenceStore(tmp_path / "sd-controller-evidence.jsonl").load()
    assert stored[-1].running_context_tokens == 2400.0
