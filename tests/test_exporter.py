"""The exporter, read back from its own registry and from its HTTP endpoint."""

import math

import pytest
import requests
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from controller.assessment import AcceptanceEstimate, AcceptanceSource, Assessment
from controller.events import Event, EventKind
from controller.exporter import Exporter, MetricsServer
from controller.model import LIMIT_REASONS, Workload
from controller.observation import FailureReason
from controller.policy import Action, ControllerPhase, Decision, Reason
from controller.state import ControllerState, PendingChange

A = Assessment(
    arrival_rate_rps=3.0, projected_rate_rps=3.5, acceptance=AcceptanceEstimate(0.55, 0.78, AcceptanceSource.LAST, 120.0),
    workload=Workload(512, 256), draft_length=4, best_draft_length=5, predicted_speedup=1.8, decision_speedup=1.7,
    latency_off_s=1.9, latency_on_s=math.inf, batch_off=5.7, batch_on=2.9, stability_limit_off_rps=16.2,
    stability_limit_on_rps=15.1, break_even_rate_rps=None, restart_downtime_s=75.0, switch_cost_request_s=math.inf,
    projected_gain_request_s=-1234.0, gain_horizon_s=14400.0,
)  # fmt: skip
D = Decision(Action.NONE, Reason.STEADY, "x", True, 4, ControllerPhase.PENDING)


def test_record_and_read_back():
    reg = CollectorRegistry()
    ex = Exporter(reg)
    ex.configure(60, 600)
    state = ControllerState(applied_enabled=True, pending=PendingChange(False, None, 100.0, "r"))
    ex.record(
        160.0, state, D, A, FailureReason.STALE, 2.1,
        (Event(EventKind.CHANGE_CONFIRMED, "on"), Event(EventKind.CHANGE_FAILED, "timeout")),
    )  # fmt: skip
    g = reg.get_sample_value
    assert g("sd_predicted_speedup") == 1.8 and g("sd_decision_speedup") == 1.7
    assert g("sd_acceptance_rate") == 0.55
    assert g("sd_acceptance_source", {"source": "last"}) == 1 and g("sd_acceptance_source", {"source": "measured"}) == 0
    assert g("sd_enabled") == 1 and g("sd_desired_enabled") == 1
    assert g("sd_effective_batch_size") == 2.9  # the applied (on) state's batch
    assert g("sd_controller_state", {"sd_controller_state": "pending"}) == 1
    assert g("sd_controller_pending_age_seconds") == 60.0 and g("sd_controller_pending_timeout_seconds") == 600
    assert g("sd_toggles_total", {"direction": "on"}) == 1 and g("sd_toggles_total", {"direction": "off"}) == 0
    assert g("sd_controller_change_failures_total") == 1
    assert g("sd_controller_observation_failures_total", {"reason": "stale"}) == 1
    assert g("sd_controller_observation_failures_total", {"reason": "nan"}) == 0  # present from the start
    assert g("sd_predicted_latency_seconds", {"mode": "on"}) == math.inf  # overloaded: +Inf, not NaN
    assert g("sd_break_even_rate_rps") is None  # unknown is absent, not 0
    assert g("sd_controller_last_decision_timestamp_seconds") == 160.0
    assert g("sd_controller_build_info", {"version": "0.1.0"}) == 1
    assert g("sd_observed_latency_seconds") == 2.1
    assert g("sd_load_cycling") == 0
    assert g("sd_acceptance_trend_per_hour") == 0
    # What sets each limit: one reason at 1 per mode, every other present at 0.
    assert g("sd_stability_limit_reason", {"mode": "off", "reason": "throughput_peak"}) == 1
    assert g("sd_stability_limit_reason", {"mode": "on", "reason": "kv_recompute"}) == 0


def test_the_limit_reason_follows_the_assessment():
    from dataclasses import replace

    reg = CollectorRegistry()
    ex = Exporter(reg)
    a = replace(A, limit_reason_off="max_num_seqs", limit_reason_on="kv_recompute")
    ex.record(1.0, ControllerState(applied_enabled=True), D, a, None, 2.1, ())
    g = reg.get_sample_value
    on = {r: g("sd_stability_limit_reason", {"mode": "on", "reason": r}) for r in LIMIT_REASONS}
    off = {r: g("sd_stability_limit_reason", {"mode": "off", "reason": r}) for r in LIMIT_REASONS}
    assert on == {r: float(r == "kv_recompute") for r in LIMIT_REASONS}
    assert off == {r: float(r == "max_num_seqs") for r in LIMIT_REASONS}


def test_a_cycling_load_is_shown():
    from dataclasses import replace

    reg = CollectorRegistry()
    Exporter(reg).record(160.0, ControllerState(applied_enabled=True), D, replace(A, cycling=True), None, None, ())
    assert reg.get_sample_value("sd_load_cycling") == 1


def test_a_drifting_acceptance_is_shown_per_hour():
    from dataclasses import replace

    reg = CollectorRegistry()
    a = replace(A, acceptance_trend_per_s=-0.2 / 3600.0)
    Exporter(reg).record(160.0, ControllerState(applied_enabled=True), D, a, None, None, ())
    assert reg.get_sample_value("sd_acceptance_trend_per_hour") == pytest.approx(-0.2)


def test_served_over_http_and_parsed_back():
    reg = CollectorRegistry()
    ex = Exporter(reg)
    ex.record(1.0, ControllerState(applied_enabled=False), D, A, None, None, ())
    server = MetricsServer(reg, "127.0.0.1", 0, lambda: (True, "ok")).start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        text = requests.get(f"{base}/metrics", timeout=5).text
        names = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
        for required in ("sd_predicted_speedup", "sd_acceptance_rate", "sd_draft_length", "sd_enabled", "sd_desired_enabled",
                         "sd_effective_batch_size", "sd_arrival_rate_rps", "sd_controller_state", "sd_toggles_total",
                         "sd_controller_observation_failures_total", "sd_controller_last_decision_timestamp_seconds",
                         "sd_controller_build_info"):  # fmt: skip
            assert required in names, required
        assert requests.get(f"{base}/healthz", timeout=5).status_code == 200
        assert requests.get(f"{base}/nope", timeout=5).status_code == 404
    finally:
        server.stop()
    sick = MetricsServer(reg, "127.0.0.1", 0, lambda: (False, "last tick 500s ago")).start()
    try:
        r = requests.get(f"http://127.0.0.1:{sick.port}/healthz", timeout=5)
        assert r.status_code == 503 and "500s" in r.text
    finally:
        sick.stop()


def test_head_probes_get_gets_status_and_headers_and_other_methods_405():
    reg = CollectorRegistry()
    Exporter(reg).record(1.0, ControllerState(applied_enabled=False), D, A, None, None, ())
    health = {"ok": True}
    server = MetricsServer(reg, "127.0.0.1", 0, lambda: (health["ok"], "why")).start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        got = requests.get(f"{base}/metrics", timeout=5)
        head = requests.head(f"{base}/metrics", timeout=5)
        assert head.status_code == 200 and head.content == b""
        assert head.headers["Content-Type"] == got.headers["Content-Type"]
        assert int(head.headers["Content-Length"]) > 1000  # the exposition's length, not an error page's
        health["ok"] = False
        assert requests.head(f"{base}/healthz", timeout=5).status_code == 503
        assert requests.head(f"{base}/nope", timeout=5).status_code == 404
        for method in ("POST", "PUT", "DELETE"):
            r = requests.request(method, f"{base}/metrics", data=b"x", timeout=5)
            assert r.status_code == 405 and r.headers["Allow"] == "GET, HEAD", method
    finally:
        server.stop()


def test_prediction_gauges_go_absent_when_data_turns_bad():
    from dataclasses import replace

    from controller.exporter import PREDICTION_GAUGES

    reg = CollectorRegistry()
    ex = Exporter(reg)
    state = ControllerState(applied_enabled=True)
    ex.record(1.0, state, D, replace(A, break_even_rate_rps=9.0), None, 2.1, ())
    g = reg.get_sample_value
    assert g("sd_predicted_speedup") == 1.8 and g("sd_break_even_rate_rps") == 9.0
    ex.record(2.0, state, D, A, None, 2.1, ())  # break-even no longer known
    assert g("sd_break_even_rate_rps") is None
    ex.record(3.0, state, D, None, FailureReason.NAN, None, ())  # the next tick's data is bad
    exported = {s.name for fam in reg.collect() for s in fam.samples}
    assert not exported & set(PREDICTION_GAUGES), exported & set(PREDICTION_GAUGES)
    assert g("sd_observed_latency_seconds") is None
    assert g("sd_enabled") == 1  # what is applied is still known
    ex.record(4.0, state, D, A, None, 2.1, ())
    assert g("sd_predicted_speedup") == 1.8


def test_the_measured_running_context_is_shown_and_absent_when_not_measured():
    from dataclasses import replace

    reg = CollectorRegistry()
    ex = Exporter(reg)
    state = ControllerState(applied_enabled=True)
    g = reg.get_sample_value
    ex.record(1.0, state, D, A, None, None, ())  # Workload(512, 256): the lengths' formula
    assert g("sd_running_context_tokens") is None
    measured = replace(A, workload=Workload(512, 256, running_context_tokens=1430.0))
    ex.record(2.0, state, D, measured, None, None, ())
    assert g("sd_running_context_tokens") == 1430.0
    ex.record(3.0, state, D, A, None, None, ())  # the server stopped exporting its KV usage
    assert g("sd_running_context_tokens") is None
    ex.record(4.0, state, D, measured, None, None, ())
    ex.record(5.0, state, D, None, FailureReason.NAN, None, ())  # no assessment at all
    assert g("sd_running_context_tokens") is None


def test_prefix_cache_hits_are_shown_as_the_model_priced_them():
    from dataclasses import replace

    reg = CollectorRegistry()
    ex = Exporter(reg)
    state = ControllerState(applied_enabled=True)
    g = reg.get_sample_value
    ex.record(1.0, state, D, A, None, None, ())
    assert g("sd_cached_prompt_tokens") == 0.0
    ex.record(2.0, state, D, replace(A, workload=Workload(512, 256, cached_prompt_tokens=384.0)), None, None, ())
    assert g("sd_cached_prompt_tokens") == 384.0
    # A reading past the prompt is priced as all but its last token, and shown so.
    ex.record(3.0, state, D, replace(A, workload=Workload(512, 256, cached_prompt_tokens=900.0)), None, None, ())
    assert g("sd_cached_prompt_tokens") == 511.0
    ex.record(4.0, state, D, None, FailureReason.NAN, None, ())
    assert g("sd_cached_prompt_tokens") is None
