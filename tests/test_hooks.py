"""Admin hooks against real local servers and real processes."""

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import structlog

from controller.errors import ConfigError
from controller.hooks.base import ChangeRequest, HookError, HookPhase
from controller.hooks.exec import ExecHook
from controller.hooks.http import HttpHook, launcher_hook, parse_status
from controller.tokens import read_token
from tests.support.waiting import wait_until

TOKEN = "s3cr3t-token-value"


class AdminServer:
    """A launcher-like admin API on 127.0.0.1 whose answers a test scripts."""

    def __init__(self):
        self.responses = []  # queue of (status, body) for POSTs; empty -> 202
        self.delay_s = 0.0
        self.received = []
        self.applied = {"enabled": True, "num_speculative_tokens": 4}
        self.phase = "ready"
        srv = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self):
                return self.headers.get("Authorization") == f"Bearer {TOKEN}"

            def do_GET(self):
                if not self._authorized():
                    return self._reply(401, {"error": "unauthorized"})
                self._reply(200, {"phase": srv.phase, "applied": srv.applied, "restart_durations_s": [61.5]})

            def do_POST(self):
                time.sleep(srv.delay_s)
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length))
                srv.received.append((self.headers.get("Authorization"), body))
                if not self._authorized():
                    return self._reply(401, {"error": "unauthorized"})
                code, reply = srv.responses.pop(0) if srv.responses else (202, {"accepted": True})
                self._reply(code, reply)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def admin():
    s = AdminServer()
    yield s
    s.close()


CHANGE = ChangeRequest(
    enabled=False, num_speculative_tokens=None, reason="speedup_below_disable_threshold", predicted_speedup=0.9
)


def test_post_body_and_status(admin):
    hook = launcher_hook(admin.url, TOKEN, retries=0)
    hook.request(CHANGE)
    auth, body = admin.received[0]
    assert auth == f"Bearer {TOKEN}"
    assert body == {
        "enabled": False,
        "reason": CHANGE.reason,
        "predicted_speedup": 0.9,
        "requested_by": "sd-controller",
    }
    st = hook.status()
    assert (st.phase, st.applied_enabled, st.applied_draft_length, st.restart_durations_s) == (
        HookPhase.READY,
        True,
        4,
        (61.5,),
    )


def test_wrong_token_is_refused_and_never_echoed(admin):
    hook = launcher_hook(admin.url, "wrong-token", retries=0)
    with structlog.testing.capture_logs() as logs, pytest.raises(HookError) as exc:
        hook.request(CHANGE)
    assert "401" in str(exc.value) and "wrong-token" not in str(exc.value)
    assert "wrong-token" not in repr(hook) and "wrong-token" not in str(logs)
    assert hook.status().phase is HookPhase.UNKNOWN


def test_5xx_is_retried_4xx_is_not(admin):
    admin.responses = [(500, {"error": "boom"}), (503, {"error": "busy"}), (202, {})]
    launcher_hook(admin.url, TOKEN, retries=3).request(CHANGE)
    assert len(admin.received) == 3
    admin.received.clear()
    admin.responses = [(409, {"error": "restart in progress (phase restarting)"})]
    with pytest.raises(HookError, match="HTTP 409: restart in progress"):
        launcher_hook(admin.url, TOKEN, retries=3).request(CHANGE)
    assert len(admin.received) == 1
    admin.responses = [(500, {})] * 4
    with pytest.raises(HookError, match="HTTP 500 after retries"):
        launcher_hook(admin.url, TOKEN, retries=2).request(CHANGE)


def test_slow_hook_times_out_bounded(admin):
    admin.delay_s = 2.0
    hook = launcher_hook(admin.url, TOKEN, retries=1, timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(HookError, match="timed out"):
        hook.request(CHANGE)
    assert time.monotonic() - t0 < 4
    admin.delay_s = 0.1  # slow but within the timeout: fine
    launcher_hook(admin.url, TOKEN, retries=0, timeout_s=2).request(CHANGE)


def test_unreachable_hook():
    hook = HttpHook("http://127.0.0.1:9/admin", "http://127.0.0.1:9/status", TOKEN, retries=0, timeout_s=0.5)
    with pytest.raises(HookError, match="connection failed"):
        hook.request(CHANGE)
    assert hook.status().phase is HookPhase.UNKNOWN


def test_credentials_in_url_are_redacted():
    hook = HttpHook("http://user:pw@127.0.0.1:9/x", None, None, retries=0, timeout_s=0.2)
    with pytest.raises(HookError) as exc:
        hook.request(CHANGE)
    assert "pw" not in str(exc.value) and "pw" not in repr(hook)


@pytest.mark.parametrize(
    ("body", "phase", "enabled"),
    [
        (
            {"phase": "restarting", "applied": {"enabled": True, "num_speculative_tokens": 4}},
            HookPhase.RESTARTING,
            True,
        ),
        (
            {"phase": "failed", "applied": {"enabled": False, "num_speculative_tokens": None}, "last_error": "x"},
            HookPhase.FAILED,
            False,
        ),
        ({"enabled": False}, HookPhase.READY, False),
    ],
)
def test_parse_status(body, phase, enabled):
    st = parse_status(body)
    assert (st.phase, st.applied_enabled) == (phase, enabled)


@pytest.mark.parametrize("body", [[], {"phase": "dancing", "applied": {}}, {"applied": {"enabled": "yes"}}])
def test_parse_status_rejects(body):
    with pytest.raises((ValueError, TypeError)):
        parse_status(body)


def test_token_file_and_env(tmp_path, monkeypatch):
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    assert read_token(f, "X", "setting hook_token_file") == TOKEN
    monkeypatch.setenv("MY_TOKEN", "from-env")
    assert read_token(None, "MY_TOKEN", "setting hook_token_file") == "from-env"
    assert read_token(None, "UNSET_TOKEN_VAR", "setting hook_token_file") is None
    with pytest.raises(ConfigError, match="setting hook_token_file: cannot read"):
        read_token(tmp_path / "missing", "X", "setting hook_token_file")
    (tmp_path / "empty").write_text("")
    with pytest.raises(ConfigError, match="is empty"):
        read_token(tmp_path / "empty", "X", "setting hook_token_file")


# --- exec hook: a real process, argv not shell, env carries the state -----------------------


def test_exec_hook_success_env_and_status(tmp_path):
    out = tmp_path / "out.json"
    script = f"import json,os; json.dump({{k: os.environ[k] for k in ('SD_ENABLED','SD_NUM_SPECULATIVE_TOKENS','SD_REASON')}}, open({str(out)!r},'w'))"
    hook = ExecHook([sys.executable, "-c", script], timeout_s=30, initial_enabled=False)
    hook.request(ChangeRequest(True, 4, "speedup_above_enable_threshold; $(rm -rf /)"))
    assert hook.status().phase is HookPhase.RESTARTING or out.exists()
    hook.wait(30)
    st = hook.status()
    assert (st.phase, st.applied_enabled, st.applied_draft_length) == (HookPhase.READY, True, 4)
    env = json.loads(out.read_text())
    assert env == {
        "SD_ENABLED": "1",
        "SD_NUM_SPECULATIVE_TOKENS": "4",
        "SD_REASON": "speedup_above_enable_threshold; $(rm -rf /)",
    }


def test_exec_hook_nonzero_exit_and_timeout():
    hook = ExecHook(
        [sys.executable, "-c", "import sys; print('no GPU', file=sys.stderr); sys.exit(3)"], initial_enabled=True
    )
    hook.request(CHANGE)
    hook.wait(30)
    st = hook.status()
    assert st.phase is HookPhase.FAILED and st.applied_enabled is True and "exit code 3: no GPU" in st.last_error
    slow = ExecHook([sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=0.5, initial_enabled=True)
    t0 = time.monotonic()
    slow.request(CHANGE)
    with pytest.raises(HookError, match="still running"):
        slow.request(CHANGE)
    slow.wait(10)
    assert time.monotonic() - t0 < 10
    assert "timed out" in slow.status().last_error


def test_exec_hook_rejects_shell_string():
    with pytest.raises(ValueError):
        ExecHook("toggle-sd --on")


def test_exec_hook_timeout_kills_the_whole_process_group(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    # A restart script that starts a long child and waits for it (as `kubectl rollout` would).
    script = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "child.wait()\n"
    )
    hook = ExecHook([sys.executable, "-c", script], timeout_s=1.0, initial_enabled=True)
    t0 = time.monotonic()
    hook.request(CHANGE)
    hook.wait(20)
    assert time.monotonic() - t0 < 10  # the grandchild holds stdout: without the group kill, ~60 s
    assert "timed out" in hook.status().last_error
    grandchild = int(pid_file.read_text())
    wait_until(lambda: not _running(grandchild), 5, "the grandchild to die")


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed orphan may wait for its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
