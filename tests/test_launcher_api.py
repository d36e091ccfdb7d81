"""The launcher's admin API and restart logic, end to end in one process.

Real code paths throughout: a real Supervisor and AdminServer, real child processes
(tests/support/fake_vllm_child.py), real signals and real HTTP on 127.0.0.1. The fake
child's knobs come from FAKE_VLLM_* environment variables, which every start inherits.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import requests
from structlog.testing import capture_logs

from controller.admin_api import SdConfig
from controller.hooks.base import ChangeRequest
from controller.hooks.http import launcher_hook
from controller.launcher.admin import AdminServer, token_matches
from controller.launcher.child import VllmChild
from controller.launcher.profile import parse_profile, vllm_url
from controller.launcher.state import load_state
from controller.launcher.supervisor import Supervisor, SupervisorOptions, backoff_s
from controller.policy import Action, ControllerPhase, Decision, Reason, begin_request, reconcile
from controller.settings import Settings
from controller.state import ControllerState
from tests.support import fake_vllm_child
from tests.support.waiting import pid_alive, wait_until

TOKEN = "t0ken-that-must-not-leak-4242"
STATUS_KEYS = {
    "phase",
    "applied",
    "desired",
    "restart_count",
    "last_restart_duration_s",
    "restart_durations_s",
    "child_pid",
    "last_error",
    "vllm_url",
}


class Launcher:
    """A running supervisor + admin server with HTTP helpers."""

    def __init__(self, tmp_path: Path, spec: str | None, options: dict, token: str | None) -> None:
        argv = fake_vllm_child.command(fake_vllm_child.free_port(), spec)
        self.profile = parse_profile(argv)
        self.state_file = tmp_path / "state.json"
        opts = {
            "vllm_url": vllm_url(self.profile.base_argv),
            "ready_timeout_s": 10.0,
            "stop_grace_s": 5.0,
            "crash_backoff_s": 0.05,
            "state_file": self.state_file,
            **options,
        }
        self.options = SupervisorOptions(**opts)
        self.fail_next_start = False  # one shot: the next start fails as a missing binary does

        def start_child(argv: list[str]) -> VllmChild:
            if self.fail_next_start:
                self.fail_next_start = False
                raise OSError(2, "No such file or directory")
            return VllmChild(argv)

        self.supervisor = Supervisor(self.profile, self.profile.default_config, self.options, start_child=start_child)
        self.server = AdminServer(("127.0.0.1", 0), self.supervisor, token)
        self.server.start()
        self.result: dict[str, int] = {}
        self.thread = threading.Thread(target=lambda: self.result.update(code=self.supervisor.run()))
        self.thread.start()
        self.session = requests.Session()
        self.session.trust_env = False

    def headers(self, token: str | None = TOKEN) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"} if token else {}

    def status(self) -> dict:
        r = self.session.get(self.server.url + "/admin/status", headers=self.headers(), timeout=5)
        assert r.status_code == 200, r.text
        return r.json()

    def post(self, body, token: str | None = TOKEN) -> requests.Response:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return self.session.post(
            self.server.url + "/admin/speculative",
            data=data,
            headers={**self.headers(token), "Content-Type": "application/json"},
            timeout=5,
        )

    def wait_phase(self, phase: str, timeout_s: float = 15.0) -> dict:
        return wait_until(lambda: (s := self.status())["phase"] == phase and s, timeout_s, f"phase {phase}")

    def child_info(self) -> dict:
        return self.session.get(self.options.vllm_url + "/fake/info", timeout=5).json()

    def close(self) -> None:
        self.supervisor.shutdown()
        self.thread.join(timeout=30)
        self.server.stop()
        self.session.close()
        assert not self.thread.is_alive(), "supervisor did not stop within 30 s"


@pytest.fixture
def start_launcher(tmp_path):
    launchers: list[Launcher] = []

    def start(spec: str | None = fake_vllm_child.NGRAM_K4, token: str | None = TOKEN, **options):
        launcher = Launcher(tmp_path, spec, options, token)
        launchers.append(launcher)
        return launcher

    yield start
    for launcher in launchers:
        launcher.close()


@pytest.fixture(autouse=True)
def _clean_fake_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("FAKE_VLLM_"):
            monkeypatch.delenv(key)


# ---- auth ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expected", "header", "ok"),
    [
        ("abc", "Bearer abc", True),
        ("abc", "bearer abc", True),
        ("abc", "Bearer abd", False),
        ("abc", "Bearer ", False),
        ("abc", "Basic abc", False),
        ("abc", None, False),
        ("abc", "abc", False),
        (None, None, True),
    ],
)
def test_token_matches(expected, header, ok):
    assert token_matches(expected, header) is ok


def test_admin_calls_need_the_token_and_it_never_leaks(start_launcher):
    with capture_logs() as logs:
        launcher = start_launcher()
        url = launcher.server.url
        launcher.wait_phase("ready")
        for token in (None, "wrong", TOKEN + "x"):
            r = launcher.session.get(url + "/admin/status", headers=launcher.headers(token), timeout=5)
            assert r.status_code == 401
            assert r.headers["WWW-Authenticate"].startswith("Bearer")
            r = launcher.post({"enabled": False}, token=token)
            assert r.status_code == 401
            assert TOKEN not in r.text
        assert launcher.status()["phase"] == "ready"  # nothing restarted
        # /healthz is for liveness probes: no token.
        assert launcher.session.get(url + "/healthz", timeout=5).status_code == 200
        bodies = [launcher.post(b"{bad").text, launcher.post({"enabled": False}).text]
        launcher.wait_phase("ready")
        bodies.append(json.dumps(launcher.status()))
    assert any(e["event"] == "admin_unauthorized" for e in logs)
    assert TOKEN not in repr(logs)
    assert all(TOKEN not in body for body in bodies)


def test_query_strings_are_never_logged(start_launcher):
    import socket

    launcher = start_launcher()
    with capture_logs() as logs:
        for path in ("/healthz?token=" + TOKEN, "/admin/status?access_token=" + TOKEN, "/nope?" + TOKEN):
            launcher.session.get(launcher.server.url + path, headers=launcher.headers(), timeout=5)
        port = launcher.server.port
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:  # malformed request line
            raw.sendall(f"GET /admin/status?t={TOKEN} HTTP/9.9 extra\r\n\r\n".encode())
            raw.recv(4096)
    lines = [e.get("line", "") for e in logs if e["event"] == "admin_http"]
    assert lines, logs
    assert TOKEN not in repr(logs)


def test_no_token_configured_means_open(start_launcher):
    launcher = start_launcher(token=None)
    r = launcher.session.get(launcher.server.url + "/admin/status", timeout=5)
    assert r.status_code == 200


def test_a_switch_not_sent_as_json_is_refused_even_without_a_token(start_launcher):
    """What a web page can send to another origin without a preflight: a form or text/plain."""
    launcher = start_launcher(token=None)
    launcher.wait_phase("ready")
    url = launcher.server.url + "/admin/speculative"
    body = json.dumps({"enabled": False})
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"Content-Type": ctype} if ctype else {}
        r = launcher.session.post(url, data=body, headers=headers, timeout=5)
        assert r.status_code == 415 and "application/json" in r.json()["error"], ctype
    assert launcher.status()["applied"]["enabled"] is True and launcher.status()["restart_count"] == 0
    r = launcher.session.post(url, data=body, headers={"Content-Type": "Application/JSON; charset=utf-8"}, timeout=5)
    assert r.status_code == 202


def test_unknown_paths_and_methods(start_launcher):
    launcher = start_launcher()
    url, h = launcher.server.url, launcher.headers()
    assert launcher.session.get(url + "/admin/nope", headers=h, timeout=5).status_code == 404
    assert launcher.session.get(url + "/admin/speculative", headers=h, timeout=5).status_code == 405
    assert launcher.session.post(url + "/admin/status", headers=h, timeout=5).status_code == 405
    assert launcher.session.post(url + "/other", timeout=5).status_code == 404
    # Other methods: a JSON 405 naming what is served, not the stdlib's 501 HTML page.
    for method in ("HEAD", "PUT", "DELETE", "OPTIONS"):
        r = launcher.session.request(method, url + "/admin/speculative", headers=h, data=b"{}", timeout=5)
        assert r.status_code == 405 and r.headers["Allow"] == "GET, POST", method
        if method != "HEAD":
            assert "use GET or POST" in r.json()["error"]
    assert launcher.session.get(url + "/admin/status", headers=h, timeout=5).status_code == 200  # same connection


# ---- requests: 200 / 202 / 400 / 409 ---------------------------------------------------------


def test_status_shape(start_launcher):
    launcher = start_launcher()
    status = launcher.wait_phase("ready")
    assert set(status) == STATUS_KEYS
    assert status["applied"] == {"enabled": True, "num_speculative_tokens": 4}
    assert status["desired"] == status["applied"]
    assert status["restart_count"] == 0
    assert status["last_restart_duration_s"] is None
    assert status["restart_durations_s"] == []
    assert status["child_pid"] == launcher.child_info()["pid"]
    assert status["last_error"] is None
    assert status["vllm_url"] == launcher.options.vllm_url


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b'["enabled"]',
        b'{"num_speculative_tokens": 4}',
        b'{"enabled": "false"}',
        b'{"enabled": false, "num_speculative_tokens": 0}',
        b'{"enabled": true, "num_speculative_tokens": 65}',
        b'{"enabled": true, "num_speculative_tokens": "4"}',
        pytest.param(b'{"enabled": true, "num_speculative_tokens": ' + b"9" * 5000 + b"}", id="5000-digits"),
        pytest.param(b"[" * 60_000, id="deep"),
        pytest.param(b'{"enabled": true, "reason": ' + b"[" * 30_000 + b"]" * 30_000 + b"}", id="deep-note"),
    ],
)
def test_bad_requests_are_400_with_one_line(start_launcher, body):
    launcher = start_launcher()
    launcher.wait_phase("ready")
    r = launcher.post(body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error and "\n" not in error
    assert launcher.status()["restart_count"] == 0


def test_enabling_sd_without_spec_is_400(start_launcher):
    launcher = start_launcher(spec=None)
    status = launcher.wait_phase("ready")
    assert status["applied"] == {"enabled": False, "num_speculative_tokens": None}
    r = launcher.post({"enabled": True})
    assert r.status_code == 400
    assert "no speculative config" in r.json()["error"]


def test_already_applied_is_200_without_restart_and_notes_are_logged(start_launcher):
    launcher = start_launcher()
    pid = launcher.wait_phase("ready")["child_pid"]
    with capture_logs() as logs:
        r = launcher.post(
            {
                "enabled": True,
                "num_speculative_tokens": 4,
                "reason": "steady",
                "predicted_speedup": 1.3,
                "requested_by": "ctl",
            }
        )
    assert r.status_code == 200
    assert r.json()["changed"] is False
    status = launcher.status()
    assert (status["phase"], status["child_pid"], status["restart_count"]) == ("ready", pid, 0)
    noop = [e for e in logs if e["event"] == "switch_noop"]
    assert noop and noop[0]["note_reason"] == "steady" and noop[0]["note_requested_by"] == "ctl"
    # Extra keys named like structlog's own are logged, not a crash.
    r = launcher.post({"enabled": True, "event": "x", "level": "y", "a b": 1})
    assert r.status_code == 200


def test_switch_off_restarts_without_spec_and_409_meanwhile(start_launcher, monkeypatch):
    launcher = start_launcher()
    old_pid = launcher.wait_phase("ready")["child_pid"]
    # Slow starts from now on, so the restart window is wide enough to hit with a request.
    monkeypatch.setenv("FAKE_VLLM_STARTUP_DELAY_S", "1.0")
    with capture_logs() as logs:
        r = launcher.post({"enabled": False, "reason": "low load", "predicted_speedup": 0.97})
        assert r.status_code == 202, r.text
        body = r.json()
        assert body["changed"] is True and body["phase"] == "restarting"
        assert body["desired"] == {"enabled": False, "num_speculative_tokens": None}
        busy = launcher.post({"enabled": True})
    assert busy.status_code == 409
    assert busy.json()["phase"] == "restarting"
    requested = [e for e in logs if e["event"] == "switch_requested"]
    assert requested[0]["note_reason"] == "low load"

    status = launcher.wait_phase("ready")
    assert status["applied"] == {"enabled": False, "num_speculative_tokens": None}
    assert status["restart_count"] == 1
    assert len(status["restart_durations_s"]) == 1
    assert status["last_restart_duration_s"] == status["restart_durations_s"][0] >= 1.0
    assert status["child_pid"] != old_pid
    assert not pid_alive(old_pid)
    info = launcher.child_info()
    assert "--speculative-config" not in info["argv"] and info["spec"] is None
    assert load_state(launcher.state_file) == SdConfig(False, None)


def test_switch_changes_draft_length(start_launcher):
    launcher = start_launcher()
    launcher.wait_phase("ready")
    assert launcher.post({"enabled": True, "num_speculative_tokens": 7}).status_code == 202
    status = launcher.wait_phase("ready")
    assert status["applied"] == {"enabled": True, "num_speculative_tokens": 7}
    spec = launcher.child_info()["spec"]
    assert spec["num_speculative_tokens"] == 7 and spec["method"] == "ngram"
    assert spec["prompt_lookup_max"] == 3


def test_ready_timeout_rolls_back_and_reports_failed(start_launcher, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_HANG_IF_TOKENS", "7")
    launcher = start_launcher(ready_timeout_s=1.5)
    launcher.wait_phase("ready")
    assert launcher.post({"enabled": True, "num_speculative_tokens": 7}).status_code == 202
    status = launcher.wait_phase("failed", timeout_s=20)
    assert status["applied"] == {"enabled": True, "num_speculative_tokens": 4}
    assert status["desired"] == status["applied"]
    assert "not ready" in status["last_error"] and "rolled back" in status["last_error"]
    assert status["restart_count"] == 2  # the attempt and the rollback
    assert status["restart_durations_s"] == []  # no switch happened
    assert launcher.child_info()["spec"]["num_speculative_tokens"] == 4  # old config serves
    # "failed" is not busy: the next request is taken.
    assert launcher.post({"enabled": False}).status_code == 202
    status = launcher.wait_phase("ready")
    assert status["applied"]["enabled"] is False
    assert status["last_error"] is None


def test_child_exit_during_start_rolls_back(start_launcher, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_EXIT_IF_TOKENS", "5")
    launcher = start_launcher()
    launcher.wait_phase("ready")
    assert launcher.post({"enabled": True, "num_speculative_tokens": 5}).status_code == 202
    status = launcher.wait_phase("failed")
    assert "exited with status 3 while starting" in status["last_error"]
    assert status["applied"]["num_speculative_tokens"] == 4
    assert load_state(launcher.state_file) == SdConfig(True, 4)


def test_an_operators_switch_right_after_the_controllers_replaces_its_lock(start_launcher):
    """The controller's hook and lock against the real launcher: its disable completes and an
    operator switches SD back on before the controller's next tick."""
    launcher = start_launcher()
    launcher.wait_phase("ready")
    hook = launcher_hook(launcher.server.url, TOKEN, timeout_s=5, retries=0)
    disable = Decision(Action.DISABLE, Reason.SPEEDUP_LOW, "x", False, None, ControllerPhase.ENABLED)
    state = begin_request(ControllerState(applied_enabled=True), disable, 0.0, hook.status().restart_count)
    hook.request(ChangeRequest(enabled=False, num_speculative_tokens=None, reason="x"))
    assert launcher.wait_phase("ready")["applied"]["enabled"] is False
    assert launcher.post({"enabled": True, "requested_by": "operator"}).status_code == 202
    launcher.wait_phase("ready")
    state, events = reconcile(state, hook.status(), Settings(), 120.0)
    assert tuple(map(str, events)) == ("change_confirmed:off", "external_change:on")
    assert state.pending is None and state.applied_enabled is True and state.last_change_at == 120.0


def test_an_operators_switch_after_the_controllers_rolled_back_replaces_its_lock_unconfirmed(start_launcher):
    launcher = start_launcher()
    launcher.wait_phase("ready")
    hook = launcher_hook(launcher.server.url, TOKEN, timeout_s=5, retries=0)
    disable = Decision(Action.DISABLE, Reason.SPEEDUP_LOW, "x", False, None, ControllerPhase.ENABLED)
    state = begin_request(ControllerState(applied_enabled=True), disable, 0.0, hook.status().restart_count)
    launcher.fail_next_start = True
    hook.request(ChangeRequest(enabled=False, num_speculative_tokens=None, reason="x"))
    assert launcher.wait_phase("failed")["restart_count"] == 2  # the attempt and the rollback
    assert launcher.post({"enabled": True, "num_speculative_tokens": 2}).status_code == 202
    launcher.wait_phase("ready")
    state, events = reconcile(state, hook.status(), Settings(), 120.0)
    assert tuple(map(str, events)) == ("change_superseded:off", "external_change:on")
    assert state.pending is None and state.applied_draft_length == 2 and state.last_change_at == 120.0


def test_crash_is_restarted_with_the_applied_config(start_launcher):
    launcher = start_launcher()
    launcher.wait_phase("ready")
    assert launcher.post({"enabled": True, "num_speculative_tokens": 6}).status_code == 202
    old_pid = launcher.wait_phase("ready")["child_pid"]
    launcher.session.post(launcher.options.vllm_url + "/fake/crash", timeout=5)
    status = wait_until(
        lambda: (s := launcher.status())["phase"] == "ready" and s["child_pid"] not in (None, old_pid) and s,
        15,
        "a new child after the crash",
    )
    assert status["restart_count"] == 2
    assert "exited unexpectedly with status 3" in status["last_error"]
    assert status["applied"] == {"enabled": True, "num_speculative_tokens": 6}
    assert launcher.child_info()["spec"]["num_speculative_tokens"] == 6


def test_crash_recovery_gives_up_after_max_restarts(start_launcher, monkeypatch):
    launcher = start_launcher(max_crash_restarts=2)
    launcher.wait_phase("ready")
    monkeypatch.setenv("FAKE_VLLM_EXIT_IF_TOKENS", "4")  # every restart now dies at start
    launcher.session.post(launcher.options.vllm_url + "/fake/crash", timeout=5)
    launcher.thread.join(timeout=20)
    assert not launcher.thread.is_alive()
    assert launcher.result["code"] == 1
    status = launcher.status()
    assert status["phase"] == "failed"
    assert status["last_error"].startswith("gave up after 2 crash restarts")
    assert status["restart_count"] == 2
    assert status["child_pid"] is None


def test_child_ignoring_sigterm_is_killed_after_grace(start_launcher, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_IGNORE_SIGTERM", "1")
    launcher = start_launcher(stop_grace_s=0.5)
    old_pid = launcher.wait_phase("ready")["child_pid"]
    started = time.monotonic()
    assert launcher.post({"enabled": False}).status_code == 202
    launcher.wait_phase("ready")
    assert time.monotonic() - started >= 0.5
    assert not pid_alive(old_pid)
    monkeypatch.delenv("FAKE_VLLM_IGNORE_SIGTERM")


def test_shutdown_returns_the_child_exit_status(start_launcher, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_SIGTERM_EXIT_CODE", "7")
    launcher = start_launcher()
    pid = launcher.wait_phase("ready")["child_pid"]
    launcher.supervisor.shutdown()
    launcher.thread.join(timeout=15)
    assert launcher.result["code"] == 7
    assert not pid_alive(pid)


@pytest.mark.parametrize(("attempt", "expected"), [(1, 1.0), (2, 2.0), (3, 4.0), (7, 60.0), (30, 60.0)])
def test_backoff(attempt, expected):
    assert backoff_s(attempt, 1.0, 60.0) == expected


def test_shutdown_during_a_slow_start_is_prompt(start_launcher, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_STARTUP_DELAY_S", "60")
    launcher = start_launcher(ready_timeout_s=120)
    status = wait_until(lambda: (s := launcher.status())["child_pid"] and s, 10, "the child to be started")
    assert status["phase"] == "starting"
    assert launcher.post({"enabled": False}).status_code == 409
    started = time.monotonic()
    launcher.supervisor.shutdown()
    launcher.thread.join(timeout=10)
    assert not launcher.thread.is_alive()
    assert time.monotonic() - started < 5
    assert not pid_alive(status["child_pid"])
