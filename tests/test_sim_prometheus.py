"""The simulator behind a real Prometheus: the daemon over HTTP, and the backtest's Prometheus path.

Both tests start the HTTP simulator in-process (engine in real seconds), a real Prometheus
scraping it every second, and a load that steps from 4 req/s to 15 req/s: past the example
calibration's break-even (14.6 req/s at acceptance 0.6, γ = 4, 512/256 tokens) and at 99% of
SD-on's stability limit (15.1 req/s), where SD costs latency and the queue runs away.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from controller.calibration import load
from controller.cli import main
from controller.observation import Observation
from controller.settings import Settings
from controller.sim.backtest.history import prometheus_steps
from controller.sim.backtest.replay import replay
from controller.sim.engine import F_ARR, Engine
from controller.sim.scenarios import Scenario
from controller.sim.server import SimulatedServer
from tests.support import LEGACY_CALIBRATION
from tests.support.prometheus import free_port

pytestmark = [pytest.mark.prometheus, pytest.mark.slow]

TOKEN = "sim-prometheus-token-42"
HIGH_AT_S = 18.0  # wall seconds after the simulator starts
LOW_RPS, HIGH_RPS = 4.0, 15.0


def scenario(high_at_s: float = HIGH_AT_S) -> Scenario:
    return Scenario.model_validate(
        {
            "name": "step-past-break-even",
            "duration_s": 600,
            "seed": 5,
            "arrival_rate": {"kind": "steps", "initial": LOW_RPS, "steps": [{"at_s": high_at_s, "value": HIGH_RPS}]},
            "acceptance": {"kind": "constant", "value": 0.8},  # per-token α: vLLM-style rate ≈ 0.59 at γ = 4
            "classes": [
                {
                    "name": "chat",
                    "prompt_tokens": {"kind": "fixed", "value": 512},
                    "gen_tokens": {"kind": "fixed", "value": 256},
                }
            ],
            "engine": {
                "initial_sd": True,
                "restart_downtime_s": 2.0,
                "restart_jitter_s": 0.0,
                "drain_limit_s": 0.5,
                "cost_noise_sigma": 0.0,
            },
        }
    )


@pytest.fixture
def sim():
    model = load(LEGACY_CALIBRATION).latency_model()
    engine = Engine(scenario(), model, epoch_s=time.time())
    with SimulatedServer(engine, token=TOKEN) as server:
        yield server


def all_arrivals(sim: SimulatedServer) -> np.ndarray:
    """Arrival times (scenario seconds) of every request the simulator has seen."""
    e = sim.engine
    with sim.lock:
        return np.sort(np.concatenate([e.finished_log()[:, F_ARR], e.pending_arrivals(), e.lost_arrivals()]))


def scrape(url: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(requests.get(url, timeout=5).text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def admin_status(sim: SimulatedServer) -> dict:
    r = requests.get(sim.admin_url + "/admin/status", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
    r.raise_for_status()
    return r.json()


def decisions(log_path: Path) -> list[dict]:
    out = []
    for line in log_path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            e = json.loads(line)
            if isinstance(e, dict) and e.get("event") == "decision":
                out.append(e)
    return out


def test_daemon_disables_sd_under_load_through_prometheus(sim, prometheus_server, tmp_path):
    t_start = time.monotonic()
    prom = prometheus_server({"vllm": [sim.metrics_url.split("//", 1)[1].removesuffix("/metrics")]})
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SD_CONTROLLER_")},
        "SD_CONTROLLER_PROMETHEUS_URL": prom.url,
        "SD_CONTROLLER_PROMETHEUS_SELECTOR": 'job="vllm"',
        "SD_CONTROLLER_PROMETHEUS_TIMEOUT_S": "2",
        "SD_CONTROLLER_HOOK_TYPE": "launcher",
        "SD_CONTROLLER_HOOK_URL": sim.admin_url,
        "SD_CONTROLLER_HOOK_TOKEN": TOKEN,
        "SD_CONTROLLER_HOOK_TIMEOUT_S": "2",
        "SD_CONTROLLER_EVALUATION_INTERVAL_S": "1",
        # compressed time: a restart is seconds here, so are the filter and the startup hold
        "SD_CONTROLLER_EXCURSION_FILTER_S": "3",
        "SD_CONTROLLER_STARTUP_HOLD_S": "0",
        "SD_CONTROLLER_DWELL_S": "30",  # longer than the rest of the test: one change at most
        "SD_CONTROLLER_PENDING_TIMEOUT_S": "20",
        "SD_CONTROLLER_RATE_WINDOW_S": "5",
        "SD_CONTROLLER_ACCEPTANCE_WINDOW_S": "10",
        "SD_CONTROLLER_LONG_WINDOW_S": "20",
        "SD_CONTROLLER_MAX_OBSERVATION_AGE_S": "15",
        "SD_CONTROLLER_RESTART_DOWNTIME_S": "3",
        "SD_CONTROLLER_CALIBRATION_FILE": LEGACY_CALIBRATION,
        "SD_CONTROLLER_STATE_FILE": str(tmp_path / "state.json"),
        "SD_CONTROLLER_EXPORTER_HOST": "127.0.0.1",
        "SD_CONTROLLER_EXPORTER_PORT": str(port),
        "SD_CONTROLLER_LOG_FORMAT": "json",
    }
    log_path = tmp_path / "daemon.log"
    metrics_url = f"http://127.0.0.1:{port}/metrics"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "controller.cli", "run"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        # Wait for the disable to be applied (bounded), then watch a few more ticks.
        confirmed_at = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.5)
            assert proc.poll() is None, "daemon exited: " + log_path.read_text()[-2000:]
            with contextlib.suppress(requests.RequestException):
                off = scrape(metrics_url).get(("sd_toggles_total", (("direction", "off"),)))
                if off and off >= 1 and confirmed_at is None:
                    confirmed_at = time.monotonic()
            if confirmed_at is not None and time.monotonic() - confirmed_at > 6:
                break
        status = admin_status(sim)
        samples = scrape(metrics_url)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    wall = time.monotonic() - t_start
    log_text = log_path.read_text()
    assert confirmed_at is not None, "no disable within 60 s:\n" + log_text[-3000:]

    ds = decisions(log_path)
    acting = [d for d in ds if d.get("action") != "none"]
    assert [d["action"] for d in acting] == ["disable"], acting
    d = acting[0]
    e = sim.engine
    with sim.lock:
        requested_t, ready_t, enabled_after, lost_at_restart = e.restart_log[0]
        totals = e.totals()
        restart_count = e.restart_count
        lost_arrivals = e.lost_arrivals().copy()
        lost = e.lost
    disable_t = d["time"] - e.epoch_s
    print(
        f"\ndaemon vs simulator: disable at t={disable_t:.1f}s (load step at {HIGH_AT_S:.0f}s), observed rate"
        f" {d['arrival_rate_rps']:.2f} req/s (projected {d['projected_rate_rps']:.2f}), acceptance"
        f" {d['acceptance_rate']:.3f} ({d['acceptance_source']}), predicted speedup {d['predicted_speedup']}"
        f" (decision {d['decision_speedup']}), switch cost {d['switch_cost_request_s']} req·s vs gain"
        f" {d['projected_gain_request_s']}; restart {requested_t:.1f}s -> {ready_t:.1f}s, lost {lost_at_restart};"
        f" totals {totals}; ticks {len(ds)}; wall {wall:.1f}s"
    )
    # SD was switched off because of the load: after the step, at a rate past the break-even
    # region, with the speedup the model predicts there below the disable threshold.
    assert disable_t > HIGH_AT_S and d["arrival_rate_rps"] > 1.5 * LOW_RPS
    assert d["reason"] == "speedup_below_disable_threshold"
    assert d["decision_speedup"] < 1.05 and d["projected_rate_rps"] > 13.0
    assert d["acceptance_source"] == "measured" and 0.45 < d["acceptance_rate"] < 0.75
    # Before the step the controller kept SD on and saw the low load.
    before = [x for x in ds if "arrival_rate_rps" in x and x["time"] - e.epoch_s < HIGH_AT_S]
    assert before and all(x["action"] == "none" for x in before)
    assert all(x["predicted_speedup"] == "inf" or x["predicted_speedup"] > 1.2 for x in before)
    # The simulator applied it; the controller counted exactly one change, confirmed.
    assert status["phase"] == "ready" and status["applied"]["enabled"] is False
    assert restart_count == 1 and enabled_after is False
    assert samples[("sd_toggles_total", (("direction", "off"),))] == 1
    assert samples[("sd_toggles_total", (("direction", "on"),))] == 0
    assert '"change_confirmed:off"' in log_text or "change_confirmed:off" in log_text
    # Nothing lost outside the restart: every aborted request was in flight when it began.
    assert totals.arrived == totals.finished + totals.running + totals.waiting + totals.lost
    assert lost == lost_at_restart
    assert (lost_arrivals <= requested_t + 1e-9).all()
    assert wall < 90


def test_backtest_reads_simulator_history_from_prometheus(sim, prometheus_server, tmp_path, capsys, monkeypatch):
    for k in list(os.environ):
        if k.startswith("SD_CONTROLLER_"):
            monkeypatch.delenv(k)
    prom = prometheus_server({"vllm": [sim.metrics_url.split("//", 1)[1].removesuffix("/metrics")]})
    start = time.time() + 1.0
    # History: ~10 s at 4 req/s after the windows filled, then the step to 15 req/s.
    end_by = sim.engine.epoch_s + HIGH_AT_S + 11.0
    while time.time() < end_by:
        time.sleep(0.5)
    time.sleep(1.5)  # the last scrape lands
    end = time.time() - 1.0
    values = {
        "rate_window_s": 5,
        "acceptance_window_s": 10,
        "long_window_s": 20,
        "max_observation_age_s": 15,
        "prometheus_selector": 'job="vllm"',
        "restart_downtime_s": 3,
        "dwell_s": 30,
        "excursion_filter_s": 2,  # compressed time: the high phase lasts seconds, not minutes
        "startup_hold_s": 0,
    }
    settings = Settings(hook_type="none", **values)
    model = load(LEGACY_CALIBRATION).latency_model()
    steps = prometheus_steps(settings, prom.url, start, end, 1.0)
    assert len(steps) >= 20

    # Observations match what the simulator served: the arrival rate over the same window.
    arrivals = all_arrivals(sim) + sim.engine.epoch_s
    compared = []
    for s in steps:
        obs = s.observation
        if not isinstance(obs, Observation) or obs.arrival_rate_rps is None:
            continue
        true_rate = np.count_nonzero((arrivals > s.time_s - 5) & (arrivals <= s.time_s)) / 5
        compared.append((s.time_s - sim.engine.epoch_s, obs.arrival_rate_rps, true_rate))
        assert s.recorded_enabled is True  # nothing switched SD in this history
        assert obs.acceptance_rate is None or 0.45 < obs.acceptance_rate < 0.75
    # Only the first steps, while the rate window fills, have no rate.
    first = next(i for i, s in enumerate(steps) if isinstance(s.observation, Observation))
    assert first <= 8 and len(compared) == len(steps) - first, [type(s.observation).__name__ for s in steps]
    low = [(o, t) for ts, o, t in compared if ts < HIGH_AT_S - 1]
    assert len(low) >= 5
    obs_low, true_low = np.mean([o for o, _ in low]), np.mean([t for _, t in low])
    with capsys.disabled():
        print(f"\nbacktest low phase: observed {obs_low:.2f} req/s, simulator {true_low:.2f} req/s, {len(low)} steps")
    assert obs_low == pytest.approx(true_low, rel=0.3) and obs_low == pytest.approx(LOW_RPS, rel=0.35)
    high = [(o, t) for ts, o, t in compared if ts > HIGH_AT_S + 6]  # the 5 s window past the step
    assert len(high) >= 3, compared
    obs_high, true_high = np.mean([o for o, _ in high]), np.mean([t for _, t in high])
    with capsys.disabled():
        print(f"backtest high phase: observed {obs_high:.2f} req/s, simulator {true_high:.2f} req/s, {len(high)} steps")
    assert obs_high == pytest.approx(true_high, rel=0.3) and obs_high > 11.0

    result = replay(settings, model, steps)
    acts = result.decisions
    with capsys.disabled():
        print(
            "backtest decisions: "
            + ", ".join(
                f"{r.action} at t={r.time_s - sim.engine.epoch_s:.0f}s ({r.arrival_rate_rps:.1f} req/s)" for r in acts
            )
        )
    assert [r.action for r in acts] == ["disable"]
    assert acts[0].time_s - sim.engine.epoch_s > HIGH_AT_S
    assert all(r.predicted_speedup is None or r.predicted_speedup > 1.2 for r in result.records[:5])

    # The command line: the same range, settings from --config, and a plot.
    config = tmp_path / "backtest.yaml"
    config.write_text(yaml.safe_dump({k: v for k, v in values.items() if k != "prometheus_selector"}))
    png = tmp_path / "bt.png"
    argv = ["backtest", "--prometheus-url", prom.url, "--start", f"{start:.3f}", "--end", f"{end:.3f}",
            "--step", "1s", "--selector", 'job="vllm"', "--config", str(config), "--plot", str(png)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "disable" in out and "open-loop caveat" in out and "model prediction" in out
    assert png.stat().st_size > 1000
    # A query Prometheus rejects is bad input (2); an unreachable Prometheus a runtime failure (1).
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**values, "queries": {"arrival_rate": "sum(rate(nope[5s]"}}))
    assert main(["backtest", "--prometheus-url", prom.url, "--start", f"{start:.3f}", "--end", f"{end:.3f}",
                 "--config", str(bad)]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "arrival_rate" in err, err
