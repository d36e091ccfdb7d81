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
from typing import IO

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
        except Exception as exc:  # the phase must settle, whatever broke
            error = f"hook failed: {type(exc).__name__}"
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


# What is kept of a hook's output: its last line makes the error message, and a script that
# prints a build log must not hold it all in the sidecar's memory.
OUTPUT_TAIL_BYTES = 64 * 1024


def _drain(stream: IO[bytes], tail: list[bytes]) -> None:
    """Read ``stream`` to its end, keeping the last OUTPUT_TAIL_BYTES (as ``tail[0]``)."""
    kept = bytearray()
    with contextlib.suppress(OSError, ValueError):  # closed under us after a kill
        while chunk := stream.read1(65536):  # type: ignore[attr-defined]
            kept += chunk
            del kept[:-OUTPUT_TAIL_BYTES]
    tail.append(bytes(kept))


def run_in_group(argv: list[str], env: dict[str, str], timeout_s: float) -> tuple[int | None, str, str]:
    """Run ``argv`` in a session of its own; (exit code or None on timeout, stdout, stderr), each
    output its last OUTPUT_TAIL_BYTES, decoded leniently (a script's bytes need not be UTF-8).

    On timeout the whole process group is killed: a restart script's children (a ``kubectl``,
    a ``sleep``) would otherwise live on and hold the output pipes open, so that even reading
    what the script printed would never end.
    """
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    tails: tuple[list[bytes], list[bytes]] = ([], [])
    readers = [
        threading.Thread(target=_drain, args=(stream, tail), name="sd-exec-hook-output", daemon=True)
        for stream, tail in zip((proc.stdout, proc.stderr), tails, strict=True)
    ]
    for reader in readers:
        reader.start()
    code: int | None
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)
        code = None
    for reader in readers:
        reader.join(timeout=5)  # a child that left the group may still hold a pipe: not waited for
    out, err = (tail[0].decode("utf-8", errors="replace") if tail else "" for tail in tails)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
    return code, out, err


class NoHook:
    """Observe-only: nothing is ever switched; the applied state comes from the metrics."""

    def request(self, change: ChangeRequest) -> None:
        raise HookError("hook_type is none: the controller only observes")

    def status(self) -> HookStatus:
        return HookStatus(HookPhase.UNKNOWN)
