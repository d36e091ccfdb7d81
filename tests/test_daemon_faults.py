"""The daemon as a real process: real Prometheus, a vLLM-format server, a launcher-compatible
admin API, real signals; faults injected while it runs.

Counts the faults injected and the wrong toggles (a toggle not justified by the load, or one
inside the dwell): the latter must be zero.
"""

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.support import LEGACY_CALIBRATION
from tests.support.fake_launcher import FakeLauncherServer
from tests.support.fake_vllm import FakeVllmServer

pytestmark = [pytest.mark.prometheus, pytest.mark.slow]
TOKEN = "daemon-test-token-1234"


class Traffic:
    """Finishing requests at ``rate`` per second on the fake vLLM (bounded in time)."""

    def __init__(self, vllm, rate=2.0, max_s=240):
        self.vllm, self.rate, self.max_s = vllm, rate, max_s
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        end = time.monotonic() + self.max_s
        while not self.stop.is_set() and time.monotonic() < end:
            n = max(1, round(self.rate * 0.5))
            kw = dict(requests=n, prompt_tokens=n * 512, gen_tokens=n * 256, e2e_latency_s=2.0)
            if self.vllm.sd_enabled:
                drafts = n * 256 / 3.4
                kw.update(drafts=drafts, draft_tokens=4 * drafts, accepted_tokens=2.4 * drafts,
                          accepted_per_pos=[0.8 * drafts, 0.65 * drafts, 0.55 * drafts, 0.4 * drafts])  # fmt: skip
            self.vllm.advance(**kw)
            self.stop.wait(0.5)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(5)


def scrape(port):
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))))


def start_daemon(tmp_path, prom_url, launcher_url, port, **extra):
    env = {
        **os.environ,
        "SD_CONTROLLER_HOOK_TOKEN": TOKEN,
        "SD_CONTROLLER_CALIBRATION_FILE": LEGACY_CALIBRATION,
        "SD_CONTROLLER_PROMETHEUS_URL": prom_url,
        "SD_CONTROLLER_PROMETHEUS_SELECTOR": 'job="vllm"',
        "SD_CONTROLLER_HOOK_TYPE": "launcher",
        "SD_CONTROLLER_HOOK_URL": launcher_url,
        "SD_CONTROLLER_HOOK_TIMEOUT_S": "1",
        "SD_CONTROLLER_HOOK_RETRIES": "1",
        "SD_CONTROLLER_EVALUATION_INTERVAL_S": "1",
        "SD_CONTROLLER_DWELL_S": "8",
        "SD_CONTROLLER_PENDING_TIMEOUT_S": "20",
        "SD_CONTROLLER_FAILURE_BACKOFF_S": "5",
        "SD_CONTROLLER_RATE_WINDOW_S": "4",
        "SD_CONTROLLER_ACCEPTANCE_WINDOW_S": "6",
        "SD_CONTROLLER_LONG_WINDOW_S": "12",
        "SD_CONTROLLER_MAX_OBSERVATION_AGE_S": "10",
        "SD_CONTROLLER_PROMETHEUS_TIMEOUT_S": "1",
        "SD_CONTROLLER_PRICE_SWITCHES": "false",
        "SD_CONTROLLER_STATE_FILE": str(tmp_path / "state.json"),
        "SD_CONTROLLER_EXPORTER_HOST": "127.0.0.1",
        "SD_CONTROLLER_EXPORTER_PORT": str(port),
        "SD_CONTROLLER_LOG_FORMAT": "json",
        **extra,
    }
    log = open(tmp_path / "daemon.log", "w")  # noqa: SIM115 - the daemon writes it until it exits
    proc = subprocess.Popen(
        [sys.executable, "-m", "controller.cli", "run"], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except requests.ConnectionError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("daemon did not come up: " + (tmp_path / "daemon.log").read_text()[-2000:])


def decisions(tmp_path):
    out = []
    for line in (tmp_path / "daemon.log").read_text().splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == "decision":
            out.append(e)
    return out


def test_daemon_survives_faults_and_never_toggles_wrongly(tmp_path, prometheus_server):
    from tests.support.prometheus import free_port

    port = free_port()
    with FakeVllmServer() as vllm, FakeLauncherServer(vllm, TOKEN, restart_s=1.0) as launcher:
        prom = prometheus_server({"vllm": [vllm.target]})
        faults = 0
        with Traffic(vllm, rate=2.0):
            prom.wait_for("sum(rate(vllm:request_success_total[4s])) > 0", timeout_s=30)
            daemon = start_daemon(tmp_path, prom.url, launcher.url, port)
            try:
                time.sleep(6)  # healthy ticks at low load: SD pays, nothing to do
                assert launcher.requests == []

                # Prometheus stopped mid-run, then restarted.
                prom.stop()
                faults += 1
                time.sleep(4)
                prom.start()
                prom.wait_for("vllm:num_requests_running", timeout_s=30)
                # vLLM /metrics garbage, then HTTP 500, then hanging (Prometheus sees the target down).
                for mode in ("garbage", "http500", "hang"):
                    vllm.set_mode(mode)
                    faults += 1
                    time.sleep(4)
                    vllm.set_mode("ok")
                time.sleep(3)
                mid = scrape(port)
                assert launcher.requests == [], "a fault must never cause a toggle"
                failures = sum(v for (n, _), v in mid.items() if n == "sd_controller_observation_failures_total")
                assert failures >= 3
                assert value(mid, "sd_enabled") == 1.0

                # Now real load past break-even, with the hook failing: 500s, then hanging.
                launcher.set_mode("http500")
                faults += 1
                traffic_high = Traffic(vllm, rate=30.0, max_s=90)
                with traffic_high:
                    time.sleep(8)
                    hung = scrape(port)
                    assert value(hung, "sd_enabled") == 1.0  # hook refused: still on, held
                    launcher.set_mode("hang")
                    faults += 1
                    time.sleep(5)
                    launcher.set_mode("ok")
                    deadline = time.monotonic() + 40
                    while time.monotonic() < deadline and launcher.applied["enabled"]:
                        time.sleep(0.5)
                    assert launcher.applied["enabled"] is False, "the controller should disable SD under load"
                    time.sleep(3)
                after = scrape(port)
                assert value(after, "sd_toggles_total", direction="off") == 1.0
                assert value(after, "sd_enabled") == 0.0
                assert value(after, "sd_controller_state", sd_controller_state="disabled") == 1.0

                # SIGTERM: finish the tick, exit 0 within a few seconds.
                t0 = time.monotonic()
                daemon.send_signal(signal.SIGTERM)
                assert daemon.wait(10) == 0
                assert time.monotonic() - t0 < 5
            finally:
                if daemon.poll() is None:
                    daemon.kill()
    # Wrong toggles: every applied change must be a justified one, outside the dwell.
    acted = [d for d in decisions(tmp_path) if d.get("acted")]
    wrong = [d for d in acted if d["reason"] != "speedup_below_disable_threshold"]
    times = [d["time"] for d in acted]
    within_dwell = [b for a, b in itertools.pairwise(times) if b - a < 8]
    print(
        f"faults injected: {faults}; changes requested: {len(acted)}; wrong toggles: {len(wrong) + len(within_dwell)}"
    )
    assert wrong == [] and within_dwell == []
    assert len(launcher.requests) == 1
    log = (tmp_path / "daemon.log").read_text()
    assert TOKEN not in log


def test_once_and_config_errors(tmp_path):
    def run(*args, **env):
        e = {k: v for k, v in os.environ.items() if not k.startswith("SD_CONTROLLER_")}
        e.update(env)
        return subprocess.run(
            [sys.executable, "-m", "controller.cli", "run", *args], env=e, capture_output=True, text=True, timeout=60
        )

    cases = [
        (
            {"SD_CONTROLLER_ENABLE_THRESHOLD": "1.0", "SD_CONTROLLER_DISABLE_THRESHOLD": "1.1"},
            "enable_threshold (1.0) must be greater than disable_threshold",
        ),
        (
            {"SD_CONTROLLER_DWELL_S": "-5"},
            "setting dwell_s (SD_CONTROLLER_DWELL_S): Input should be greater than or equal to 0",
        ),
        ({"SD_CONTROLLER_HOOK_TYPE": "telepathy"}, "setting hook_type (SD_CONTROLLER_HOOK_TYPE)"),
        (
            {"SD_CONTROLLER_PROMETHEUS_URL": "prom:9090"},
            "setting prometheus_url (SD_CONTROLLER_PROMETHEUS_URL): must be an http(s) URL",
        ),
        ({"SD_CONTROLLER_CALIBRATION_FILE": str(tmp_path / "nope.json")}, "setting calibration_file: "),
        ({"SD_CONTROLLER_HOOK_TOKEN_FILE": str(tmp_path / "no-token")}, "setting hook_token_file: cannot read"),
    ]
    for env, message in cases:
        env = {
            "SD_CONTROLLER_CALIBRATION_FILE": LEGACY_CALIBRATION,
            "SD_CONTROLLER_STATE_FILE": str(tmp_path / "s.json"),
            **env,
        }
        proc = run("--once", **env)
        assert proc.returncode == 2, (env, proc.stderr)
        assert message in proc.stderr, (message, proc.stderr)
        assert proc.stderr.strip().count("\n") == 0, proc.stderr

    # --once against a live fake vLLM (direct scraping), observe-only hook: two scrapes a rate
    # window apart, so a real decision rather than warming_up.
    with FakeVllmServer() as vllm:
        proc = run(
            "--once", "--dry-run", SD_CONTROLLER_CALIBRATION_FILE=LEGACY_CALIBRATION, SD_CONTROLLER_HOOK_TYPE="none",
            SD_CONTROLLER_VLLM_METRICS_URL=vllm.metrics_url, SD_CONTROLLER_STATE_FILE=str(tmp_path / "s.json"),
            SD_CONTROLLER_RATE_WINDOW_S="1",
        )  # fmt: skip
        assert vllm.scrapes == 2
    assert proc.returncode == 0, proc.stderr
    assert "again in 1s (rate_window_s)" in proc.stderr
    assert proc.stdout.startswith("decision: ") and "warming_up" not in proc.stdout, proc.stdout


def test_config_file_and_set(tmp_path):
    cfg = tmp_path / "sd.yaml"
    cfg.write_text(f"dwell_s: 600\nhook_type: none\ncalibration_file: {LEGACY_CALIBRATION}\n")
    from controller.settings import load_settings

    s = load_settings(cfg, enable_threshold=1.3)
    assert s.dwell_s == 600 and s.enable_threshold == 1.3
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    from controller.errors import ConfigError

    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_settings(bad)
    with pytest.raises(ConfigError, match="setting dwel_s"):
        load_settings(None, dwel_s=3)
