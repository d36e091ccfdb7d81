"""One vLLM child process: start it in its own process group, wait until it serves, stop it.

vLLM forks helpers (the engine core), so signals go to the whole group, and after the
leader exits any straggler in the group is killed: an orphan holding the port or the
memory would make the next start fail.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence

import requests
import structlog

from controller.launcher.profile import redact_argv

log = structlog.get_logger("controller.launcher.child")

POLL_S = 0.25
PROBE_TIMEOUT_S = 2.0
STRAGGLER_GRACE_S = 5.0


class NotReady(Exception):
    """The child did not become ready; ``str()`` is a one-line reason."""


def exit_status(returncode: int | None) -> int:
    """Shell-style exit status: a death by signal N becomes 128 + N."""
    if returncode is None:
        return 1
    return 128 - returncode if returncode < 0 else returncode


class VllmChild:
    """A started vLLM process (the leader of its own process group)."""

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None) -> None:
        self.argv = list(argv)
        # start_new_session: own process group, and a Ctrl-C in the launcher's terminal does
        # not hit vLLM behind the launcher's back; the launcher decides when vLLM stops.
        self.proc = subprocess.Popen(self.argv, env=env, start_new_session=True)
        self.pid = self.proc.pid
        self.started_at = time.monotonic()
        log.info("child_started", pid=self.pid, argv=redact_argv(self.argv))

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait_ready(
        self,
        base_url: str,
        timeout_s: float,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> float:
        """Block until GET /health and GET /metrics both answer 200; return seconds waited.

        Raises NotReady when the child exits, ``timeout_s`` passes or ``cancelled()`` turns
        true (the launcher is shutting down).
        """
        start = time.monotonic()
        deadline = start + timeout_s
        session = requests.Session()
        session.trust_env = False  # the child is on loopback: never go through a proxy
        try:
            while True:
                code = self.poll()
                if code is not None:
                    raise NotReady(f"vLLM exited with status {exit_status(code)} while starting")
                if cancelled():
                    raise NotReady("launcher is shutting down")
                if _probe(session, base_url + "/health") and _probe(session, base_url + "/metrics"):
                    return time.monotonic() - start
                if time.monotonic() >= deadline:
                    raise NotReady(f"vLLM not ready at {base_url} within {timeout_s:g} s")
                time.sleep(POLL_S)
        finally:
            session.close()

    def stop(self, grace_s: float) -> int:
        """SIGTERM the group, wait up to ``grace_s``, then SIGKILL it; return the exit status."""
        if self.proc.poll() is None:
            log.info("child_stopping", pid=self.pid, grace_s=grace_s)
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                log.warning("child_kill", pid=self.pid, reason=f"still running after {grace_s:g} s")
                self._signal_group(signal.SIGKILL)
                self.proc.wait(timeout=30)
        self.reap_group()
        status = exit_status(self.proc.returncode)
        log.info("child_stopped", pid=self.pid, exit_status=status)
        return status

    def reap_group(self) -> None:
        """After the leader exits, give stragglers in its group a moment, then SIGKILL them."""
        deadline = time.monotonic() + STRAGGLER_GRACE_S
        while _group_alive(self.pid):
            if time.monotonic() >= deadline:
                log.warning("child_group_kill", pgid=self.pid)
                self._signal_group(signal.SIGKILL)
                break
            time.sleep(0.1)

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _probe(session: requests.Session, url: str) -> bool:
    try:
        return session.get(url, timeout=PROBE_TIMEOUT_S).status_code == 200
    except requests.RequestException:
        return False
