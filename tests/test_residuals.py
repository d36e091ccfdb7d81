"""Residuals over history: from the daemon's evidence and from a backtest's recorded steps."""

import math

import pytest

from controller.calibration import load
from controller.correction import scaled_model
from controller.evidence import EvidenceRecord, Excluded
from controller.model import Workload, curves
from controller.observation import Observation
from controller.residuals import format_report, from_evidence, from_steps, summarize
from controller.settings import Settings
from controller.shipped import example_calibration_path
from controller.sim.backtest.history import Step

BASE = load(example_calibration_path()).latency_model()
S = Settings(calibration_file="example", hook_type="none")
T0 = 1_800_000_000.0


def ev(t, mode, observed, predicted, calibrated, excluded=None, rate=2.0):
    return EvidenceRecord(t, mode, 4 if mode == "on" else None, rate, None, None, 512.0, 256.0, 1.0, 0.0,
                          observed, predicted, calibrated, excluded)  # fmt: skip


def test_from_evidence_uses_only_usable_records_and_reports_both_predictions():
    recs = [ev(T0 + i, "off", 2.2, 2.0 + 0.2 * (i % 2), 2.0, rate=1.0 + i) for i in range(10)]
    recs += [ev(T0 + 99, "off", 50.0, 2.0, 2.0, excluded=Excluded.SETTLING)]
    recs += [ev(T0 + 100, "on", 1.0, math.inf, 0.8)]  # overloaded prediction: left out
    rows = summarize(from_evidence(recs))
    assert [r.mode for r in rows] == ["off"] and rows[0].n == 10
    assert rows[0].bias_calibrated == pytest.approx(0.1)
    assert rows[0].mape_corrected == pytest.approx(0.05)
    assert "off" in format_report(rows) and "+10.0%" in format_report(rows)


def test_backtest_steps_in_the_recorded_mode_with_the_correction_learning_along():
    truth = scaled_model(BASE, (1.0, 1.4, 1.0, 1.0))
    steps, t = [], T0
    for i in range(300):
        rate = 1.0 + (i % 6)
        on = i >= 200  # the history switches SD on at step 200
        off_c, on_c = curves(truth, 0.75, 4, Workload(1000, 280))
        lat = (on_c if on else off_c).latency_s(rate)
        obs = Observation(time_s=t, arrival_rate_rps=rate, mean_prompt_tokens=1000, mean_gen_tokens=280,
                          mean_e2e_latency_s=lat, acceptance_rate=0.5 if on else None,
                          mean_draft_tokens=4.0 if on else None, sample_age_s=0.0)  # fmt: skip
        steps.append(Step(t, obs, on, 60.0))
        t += 60.0
    pts = from_steps(S, BASE, steps)
    assert not any(T0 + 200 * 60 <= p.time_s < T0 + 200 * 60 + S.evidence_settle_s for p in pts)  # settling
    rows = {r.mode: r for r in summarize(pts)}
    off = rows["off"]
    assert off.bias_calibrated > 0.1  # the calibration under-predicts this history
    assert abs(off.bias_corrected) < 0.5 * off.bias_calibrated
    assert off.paper_r2 is not None and off.paper_c1_s > 0
    assert rows["on"].n == 100 - S.evidence_settle_s // 60


def test_no_latency_in_the_history_says_so():
    steps = [Step(T0, Observation(time_s=T0, arrival_rate_rps=2.0, sample_age_s=0.0), False, 60.0)]
    assert format_report(summarize(from_steps(S, BASE, steps))).startswith("model residuals: no settled step")
