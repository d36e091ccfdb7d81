"""The simulator over HTTP: /metrics, /health, and the launcher's admin API contract."""

from __future__ import annotations

import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from controller.calibration import load
from controller.shipped import example_calibration_path
from controller.sim.engine import Engine
from controller.sim.scenarios import Scenario
from controller.sim.server import SimulatedServer

TOKEN = "test-token-123"


@pytest.fixture
def server():
    model = load(example_calibration_path()).latency_model()
    sc = Scenario.model_validate(
        {
            "duration_s": 3600,
            "arrival_rate": {"kind": "constant", "value": 4},
            "engine": {"restart_downtime_s": 1.0, "restart_jitter_s": 0, "drain_limit_s": 0.5},
        }
    )
    engine = Engine(sc, model, epoch_s=time.time())
    with SimulatedServer(engine, token=TOKEN) as s:
        yield s


def auth(token=TOKEN):
    return {"Authorization": f"Bearer {token}"}


def test_metrics_and_health(server):
    time.sleep(1.5)
    r = requests.get(server.metrics_url, timeout=5)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain")
    names = {f.name for f in text_string_to_metric_families(r.text)}
    assert "vllm:request_success" in names and "vllm:spec_decode_num_drafts" in names
    assert requests.get(server.metrics.url + "/health", timeout=5).status_code == 200


def test_admin_auth(server):
    url = server.admin_url
    assert requests.get(url + "/healthz", timeout=5).status_code == 200
    assert requests.get(url + "/admin/status", timeout=5).status_code == 401
    assert requests.get(url + "/admin/status", headers=auth("wrong"), timeout=5).status_code == 401
    assert requests.post(url + "/admin/speculative", json={"enabled": False}, timeout=5).status_code == 401


def test_admin_switch_contract(server):
    url = server.admin_url + "/admin/speculative"
    st = requests.get(server.admin_url + "/admin/status", headers=auth(), timeout=5).json()
    assert set(st) >= {"phase", "applied", "desired", "restart_count", "last_restart_duration_s",
                       "restart_durations_s", "child_pid", "last_error", "vllm_url"}  # fmt: skip
    assert st["applied"] == {"enabled": True, "num_speculative_tokens": 4}
    assert requests.post(url, json={"enabled": True}, headers=auth(), timeout=5).status_code == 200
    as_json = {**auth(), "Content-Type": "application/json"}
    assert requests.post(url, data=b"{nope", headers=as_json, timeout=5).status_code == 400
    # the launcher's contract: a body not sent as JSON is refused before it is read
    assert requests.post(url, data=b'{"enabled": false}', headers=auth(), timeout=5).status_code == 415
    assert requests.post(url, json={"enabled": "yes"}, headers=auth(), timeout=5).status_code == 400
    r = requests.post(url, json={"enabled": False, "reason": "test"}, headers=auth(), timeout=5)
    assert r.status_code == 202 and r.json()["phase"] == "restarting"
    assert requests.post(url, json={"enabled": True}, headers=auth(), timeout=5).status_code == 409
    assert requests.get(server.metrics_url, timeout=5).status_code == 503
    deadline = time.time() + 10
    while time.time() < deadline:
        st = requests.get(server.admin_url + "/admin/status", headers=auth(), timeout=5).json()
        if st["phase"] == "ready":
            break
        time.sleep(0.2)
    assert st["phase"] == "ready" and st["applied"]["enabled"] is False and st["restart_count"] == 1
    assert st["last_restart_duration_s"] is not None
    assert "spec_decode" not in requests.get(server.metrics_url, timeout=5).text
