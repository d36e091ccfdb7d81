"""exec admin hook: run a command (an argv list, never a shell string) to apply a change.

The desired state travels in environment variables (SD_ENABLED=1|0, SD_NUM_SPECULATIVE_TOKENS,
SD_REASON, SD_PREDICTED_SPEEDUP); exit code 0 means applied. The command runs in a background
thread so a long restart script does not block the loop (or its SIGTERM handling); ``status``
says ``restarting`` until it finishes, then what it applied or that it failed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Sequence

import structlog

from controller.hooks.base import ChangeRequest, HookError, HookPhase, HookStatus

log = structlog.get_logger("sd_controller.hooks.exec")


class ExecHook:
    def __init__(self, argv: Sequence[str], timeout_s: float = 900.0, initial_enabled: bool | None = None) -> None:
        if not argv or isinstance(argv, str):
            raise ValueError("argv must be a non-empty list of strings")
        self.argv = list(argv)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._applied_enabled = initial_enabled
        self._applied_tokens: int | None = None
        self._phase = HookPhase.READY if initial_enabled is not None else HookPhase.UNKNOWN
        self._last_error: str | None = None
        self._durations: list[float] = []

    def request(self, change: ChangeRequest) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                raise HookError("exec hook: a previous change is still running")
            self._phase = HookPhase.RESTARTING
            self._thread = threading.Thread(target=self._run, args=(change,), name="sd-exec-hook", daemon=True)
            self._thread.start()

    def _run(self, change: ChangeRequest) -> None:
        import time

        env = {
            **os.environ,
            "SD_ENABLED": "1" if change.enabled else "0",
            "SD_NUM_SPECULATIVE_TOKENS": str(change.num_speculative_tokens or ""),
            "SD_REASON": change.reason,
            "SD_PREDICTED_SPEEDUP": "" if change.predicted_speedup is None else f"{change.predicted_speedup:.4f}",
        }
        t0 = time.monotonic()
        error: str | None = None
        try:
            returncode, out, err = run_in_group(self.argv, env, self.timeout_s)
            if returncode is None:
                error = f"timed out after {self.timeout_s:g}s (process group killed)"
            elif returncode != 0:
                tail = (err or out or "").strip().splitlines()[-1:] or [""]
                error = f"exit code {returncode}: {tail[0][:200]}"
        except OSError as exc:
            error = f"cannot run {self.argv[0]}: {exc.strerror or exc}"
        with self._lock:
            if error is None:
                self._applied_enabled = change.enabled
                self._applied_tokens = change.num_speculative_tokens
                self._phase = HookPhase.READY
                self._durations = [*self._durations, time.monotonic() - t0][-20:]
                self._last_error = None
            else:
                self._phase = HookPhase.FAILED
                self._last_error = error
        log.info("exec_hook_finished", ok=error is None, error=error, argv0=self.argv[0])

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until a running command finishes (for tests and shutdown)."""
        t = self._thread
        if t is not None:
            t.join(timeout_s)

    def status(self) -> HookStatus:
        with self._lock:
            return HookStatus(
                phase=self._phase,
                applied_enabled=self._applied_enabled,
                applied_draft_length=self._applied_tokens,
                restart_durations_s=tuple(self._durations),
                last_error=self._last_error,
            )


def run_in_group(argv: list[str], env: dict[str, str], timeout_s: float) -> tuple[int | None, str, str]:
    """Run ``argv`` in a session of its own; (exit code or None on timeout, stdout, stderr).

    On timeout the whole process group is killed: a restart script's children (a ``kubectl``,
    a ``sleep``) would otherwise live on and hold the output pipes open, so that even reading
    what the script printed would never end.
    """
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            out, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:  # a child that left the group still holds a pipe
            proc.kill()
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
            proc.wait(timeout=5)
            out, err = "", ""
        return None, out or "", err or ""


class NoHook:
    """Observe-only: nothing is ever switched; the applied state comes from the metrics."""

    def request(self, change: ChangeRequest) -> None:
        raise HookError("hook_type is none: the controller only observes")

    def status(self) -> HookStatus:
        return HookStatus(HookPhase.UNKNOWN)
