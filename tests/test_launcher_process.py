"""``sd-controller launch`` as a real process: usage errors, signals, exit status, the state
file across launcher restarts, and a token that never reaches the logs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from tests.support import fake_vllm_child
from tests.support.waiting import pid_alive, wait_until

REPO = Path(__file__).resolve().parents[1]
TOKEN = "process-t0ken-never-logged-9876"


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_VLLM_", "SD_LAUNCHER_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


class LauncherProcess:
    def __init__(self, tmp_path: Path, launch_args: list[str], vllm_argv: list[str], env: dict[str, str]):
        self.admin_port = fake_vllm_child.free_port()
        self.stderr_path = tmp_path / f"launcher-{self.admin_port}.log"
        self._stderr = self.stderr_path.open("wb")
        cmd = [
            sys.executable,
            "-m",
            "controller.cli",
            "launch",
            "--admin-port",
            str(self.admin_port),
            *launch_args,
            "--",
            *vllm_argv,
        ]
        self.proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=self._stderr)
        self.url = f"http://127.0.0.1:{self.admin_port}"
        self.session = requests.Session()
        self.session.trust_env = False
        self.child_pids: set[int] = set()

    def status(self) -> dict | None:
        try:
            r = self.session.get(self.url + "/admin/status", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=2)
        except requests.ConnectionError:
            return None
        return r.json() if r.status_code == 200 else None

    def wait_ready(self, timeout_s: float = 20) -> dict:
        def ready():
            assert self.proc.poll() is None, f"launcher exited early: {self.stderr()}"
            s = self.status()
            return s if s and s["phase"] == "ready" else None

        return wait_until(ready, timeout_s, "launcher ready")

    def post(self, body: dict) -> requests.Response:
        return self.session.post(
            self.url + "/admin/speculative",
            json=body,
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=5,
        )

    def terminate(self, timeout_s: float = 30) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout_s)

    def stderr(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        # A launcher killed mid-test must not leave its child (own session) behind.
        for pid in self.child_pids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        self._stderr.close()
        self.session.close()


@pytest.fixture
def launch(tmp_path):
    procs: list[LauncherProcess] = []

    def start(launch_args=(), spec=fake_vllm_child.NGRAM_K4, env=None, port=None):
        argv = fake_vllm_child.command(port or fake_vllm_child.free_port(), spec)
        proc = LauncherProcess(tmp_path, list(launch_args), argv, env or base_env(SD_LAUNCHER_ADMIN_TOKEN=TOKEN))
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.close()


def run_cli(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "controller.cli", "launch", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.parametrize(
    ("args", "env_extra", "message"),
    [
        (["--", "vllm"], {}, "no admin token"),
        (["--admin-token-file", "/nonexistent/token", "--", "vllm"], {}, "--admin-token-file"),
        (["--insecure-no-token"], {}, "missing vLLM command line"),
        (["--", "vllm", "-sc", "{bad"], {"SD_LAUNCHER_ADMIN_TOKEN": "x"}, "not valid JSON"),
        (
            ["--initial-state", "on", "--", "vllm"],
            {"SD_LAUNCHER_ADMIN_TOKEN": "x"},
            "--initial-state on",
        ),
        (
            ["--ready-timeout-s", "0", "--", "vllm"],
            {"SD_LAUNCHER_ADMIN_TOKEN": "x"},
            "--ready-timeout-s",
        ),
    ],
)
def test_usage_errors_exit_2_with_one_line(tmp_path, args, env_extra, message):
    result = run_cli(args, base_env(**env_extra), tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]
    assert not (tmp_path / "sd-launcher-state.json").exists()


def test_sigterm_stops_child_and_exits_with_its_status(launch):
    launcher = launch(env=base_env(SD_LAUNCHER_ADMIN_TOKEN=TOKEN, FAKE_VLLM_SIGTERM_EXIT_CODE="7"))
    child_pid = launcher.wait_ready()["child_pid"]
    assert pid_alive(child_pid)
    assert launcher.terminate() == 7
    assert not pid_alive(child_pid)
    assert '"launcher_exit"' in launcher.stderr()


def test_sigint_exits_0_when_child_exits_0(launch):
    launcher = launch()
    child_pid = launcher.wait_ready()["child_pid"]
    launcher.proc.send_signal(signal.SIGINT)
    assert launcher.proc.wait(timeout=30) == 0
    assert not pid_alive(child_pid)


def test_applied_config_survives_a_launcher_restart(launch, tmp_path):
    port = fake_vllm_child.free_port()
    first = launch(port=port)
    assert first.wait_ready()["applied"] == {"enabled": True, "num_speculative_tokens": 4}
    assert first.post({"enabled": True, "num_speculative_tokens": 9}).status_code == 202
    wait_until(
        lambda: (s := first.status()) and s["phase"] == "ready" and s["applied"]["num_speculative_tokens"] == 9,
        20,
        "switch to k=9",
    )
    assert first.terminate() == 0
    state = json.loads((tmp_path / "sd-launcher-state.json").read_text())
    assert state["applied"] == {"enabled": True, "num_speculative_tokens": 9}

    second = launch(port=port)
    status = second.wait_ready()
    assert status["applied"] == {"enabled": True, "num_speculative_tokens": 9}
    assert status["restart_count"] == 0
    info = requests.get(f"http://127.0.0.1:{port}/fake/info", timeout=5).json()
    assert info["spec"]["num_speculative_tokens"] == 9
    assert second.terminate() == 0

    # --initial-state off wins over the state file.
    third = launch(["--initial-state", "off"], port=port)
    assert third.wait_ready()["applied"] == {"enabled": False, "num_speculative_tokens": None}


def test_corrupt_state_file_is_moved_aside(launch, tmp_path):
    (tmp_path / "sd-launcher-state.json").write_text("{garbage")
    launcher = launch()
    assert launcher.wait_ready()["applied"] == {"enabled": True, "num_speculative_tokens": 4}
    assert (tmp_path / "sd-launcher-state.json.corrupt").read_text() == "{garbage"
    assert json.loads((tmp_path / "sd-launcher-state.json").read_text())["applied"]["enabled"] is True
    assert '"state_file_corrupt"' in launcher.stderr()


def test_token_file_works_and_token_stays_out_of_logs(launch, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    launcher = launch(["--admin-token-file", str(token_file)], env=base_env())
    launcher.wait_ready()
    wrong = requests.get(launcher.url + "/admin/status", headers={"Authorization": "Bearer nope"}, timeout=5)
    assert wrong.status_code == 401
    assert launcher.post({"enabled": False, "reason": "test"}).status_code == 202
    wait_until(lambda: (s := launcher.status()) and s["phase"] == "ready", 20, "switch off")
    assert launcher.terminate() == 0
    logs = launcher.stderr()
    lines = [json.loads(line) for line in logs.splitlines() if line.startswith("{")]
    assert {"launcher_started", "switch_requested", "switch_done", "admin_unauthorized"} <= {
        line["event"] for line in lines
    }
    assert TOKEN not in logs
