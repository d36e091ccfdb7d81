"""The launcher's state machine around one vLLM child: initial start, requested switches
(stop, start with the new arguments, roll back on failure), crash recovery and shutdown.

One worker thread owns the child; HTTP handlers only read a snapshot or queue a switch,
under one lock. Phases: ``starting`` (initial start or crash recovery), ``ready``,
``restarting`` (a requested switch or its rollback is in flight) and ``failed`` (the last
requested switch did not happen and the old setting is served again, or crash recovery gave
up). ``applied`` only ever names a setting vLLM actually came up with.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from controller.admin_api import BUSY_PHASES, MAX_RESTART_DURATIONS, HookPhase, SdConfig, admin_status
from controller.errors import EXIT_RUNTIME
from controller.launcher.child import NotReady, VllmChild, exit_status
from controller.launcher.profile import Profile, build_argv, resolve_config
from controller.launcher.state import SwitchRequest, save_state

log = structlog.get_logger("controller.launcher.supervisor")

STARTING, READY, RESTARTING, FAILED = HookPhase.STARTING, HookPhase.READY, HookPhase.RESTARTING, HookPhase.FAILED
LOOP_POLL_S = 0.2
EXIT_GAVE_UP = EXIT_RUNTIME


@dataclass(frozen=True)
class SupervisorOptions:
    """How the supervisor runs the child; the CLI fills it from flags and the vLLM argv."""

    vllm_url: str
    ready_timeout_s: float = 600.0
    stop_grace_s: float = 30.0
    max_crash_restarts: int = 5
    crash_backoff_s: float = 1.0
    crash_backoff_max_s: float = 60.0
    # A child that stays up this long has recovered: the crash counter starts over.
    stable_after_s: float = 60.0
    state_file: Path | None = None


class Busy(Exception):
    """A switch or start is in flight; ``phase`` says which."""

    def __init__(self, phase: HookPhase) -> None:
        super().__init__(f"a restart is in progress (phase {phase})")
        self.phase = phase


@dataclass(frozen=True)
class SwitchOutcome:
    changed: bool
    snapshot: dict[str, Any]


def backoff_s(attempt: int, base_s: float, max_s: float) -> float:
    """Exponential backoff before crash restart number ``attempt`` (1-based)."""
    return min(max_s, base_s * (2 ** max(0, attempt - 1)))


def describe(config: SdConfig) -> str:
    if not config.enabled:
        return "SD off"
    k = config.num_speculative_tokens
    return "SD on" if k is None else f"SD on (k={k})"


class Supervisor:
    """Owns the vLLM child. ``run()`` blocks (call it in a thread) until ``shutdown()``."""

    def __init__(
        self,
        profile: Profile,
        initial: SdConfig,
        options: SupervisorOptions,
        start_child: Callable[[Sequence[str]], VllmChild] = VllmChild,
    ) -> None:
        self.profile = profile
        self.options = options
        self._start_child = start_child
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._phase = STARTING
        self._applied = initial
        self._desired = initial
        self._pending: SdConfig | None = None
        self._child: VllmChild | None = None
        self._restart_count = 0
        self._durations: deque[float] = deque(maxlen=MAX_RESTART_DURATIONS)
        self._last_error: str | None = None
        self._crash_attempts = 0
        self._ready_since: float | None = None
        self._gave_up = False

    # ---- called from HTTP handlers -------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The /admin/status document (:class:`controller.admin_api.AdminStatus`)."""
        with self._lock:
            return self._snapshot_locked()

    def _snapshot_locked(self) -> dict[str, Any]:
        child = self._child
        return admin_status(
            phase=self._phase,
            applied=self._applied,
            desired=self._desired,
            restart_count=self._restart_count,
            durations_s=list(self._durations),
            child_pid=child.pid if child is not None and child.poll() is None else None,
            last_error=self._last_error,
            vllm_url=self.options.vllm_url,
        )

    def request_switch(self, request: SwitchRequest) -> SwitchOutcome:
        """Queue a switch. Raises InputError (bad for this command line) or Busy.

        Returns changed=False when the setting is already applied (nothing restarts).
        """
        target = resolve_config(self.profile, request.enabled, request.num_speculative_tokens)
        with self._lock:
            if self._phase in BUSY_PHASES or self._pending is not None:
                raise Busy(self._phase)
            if target == self._applied:
                return SwitchOutcome(False, self._snapshot_locked())
            self._pending = target
            self._desired = target
            self._phase = RESTARTING
            snap = self._snapshot_locked()
        log.info(
            "switch_requested",
            applied=snap["applied"],
            desired=target.to_json(),
            **request.log_fields(),
        )
        self._wake.set()
        return SwitchOutcome(True, snap)

    def shutdown(self) -> None:
        """Ask ``run()`` to stop the child gracefully and return."""
        self._stop.set()
        self._wake.set()

    # ---- the worker ----------------------------------------------------------------------

    def run(self) -> int:
        """Start the child and keep it serving the applied setting until ``shutdown()``.

        Returns the child's exit status after a shutdown, or 1 when crash recovery gave up.
        """
        try:
            if not self._start(self._applied, STARTING) and not self._recover():
                return EXIT_GAVE_UP
            while not self._stop.is_set():
                with self._lock:
                    target, self._pending = self._pending, None
                if target is not None:
                    self._switch(target)
                    continue
                child = self._child
                if child is not None and child.poll() is not None:
                    child.reap_group()
                    self._set_error(f"vLLM exited unexpectedly with status {_status(child)}")
                    if not self._recover():
                        return EXIT_GAVE_UP
                    continue
                self._note_stable()
                self._wake.wait(LOOP_POLL_S)
                self._wake.clear()
            status = self._stop_child()
            return EXIT_GAVE_UP if self._gave_up else status
        finally:
            if self._child is not None and self._child.poll() is None:
                self._stop_child()

    def _start(
        self,
        config: SdConfig,
        phase: HookPhase,
        ready_phase: HookPhase = READY,
        switch_started: float | None = None,
    ) -> bool:
        """Start a child for ``config`` and wait until it serves; False (error kept) if not.

        On success the state file is written first, then ``applied``, the phase and (for a
        switch) its duration change in one step: a poller never sees "ready" with stale parts.
        """
        argv = build_argv(self.profile, config)
        if self._stop.is_set():
            return False  # shutting down: starting a vLLM only to stop it wastes a minute
        with self._lock:
            self._phase = phase
            self._desired = config
            self._ready_since = None
        try:
            child = self._start_child(argv)
        except OSError as exc:
            self._set_error(f"cannot start vLLM ({argv[0]}): {exc.strerror or exc}")
            return False
        with self._lock:
            self._child = child
        try:
            waited_s = child.wait_ready(self.options.vllm_url, self.options.ready_timeout_s, self._stop.is_set)
        except NotReady as exc:
            self._set_error(str(exc))
            child.stop(self.options.stop_grace_s)
            return False
        self._persist(config)
        with self._lock:
            now = time.monotonic()
            self._applied = config
            self._phase = ready_phase
            self._ready_since = now
            if switch_started is not None:
                self._durations.append(round(now - switch_started, 3))
                self._last_error = None
                self._crash_attempts = 0
        log.info("child_ready", pid=child.pid, config=config.to_json(), waited_s=round(waited_s, 3))
        return True

    def _switch(self, target: SdConfig) -> None:
        old = self._applied
        started = time.monotonic()
        log.info("switch_start", applied=old.to_json(), desired=target.to_json())
        self._stop_child()
        self._count_restart()
        if self._start(target, RESTARTING, switch_started=started):
            log.info("switch_done", applied=target.to_json(), duration_s=self._durations[-1])
            return
        if self._stop.is_set():
            return
        reason = self._last_error
        error = f"switch to {describe(target)} failed: {reason}; rolled back to {describe(old)}"
        log.error("switch_failed", desired=target.to_json(), error=reason)
        self._count_restart()
        self._set_error(error)
        if self._start(old, RESTARTING, ready_phase=FAILED):
            log.warning("rollback_done", applied=old.to_json())
        elif not self._stop.is_set():
            self._set_error(f"{error}, but the rollback failed too: {self._last_error}")
            if not self._recover():
                self.shutdown()

    def _recover(self) -> bool:
        """Restart the applied setting after a crash, with bounded exponential backoff."""
        while not self._stop.is_set():
            with self._lock:
                self._crash_attempts += 1
                attempt = self._crash_attempts
                self._phase = STARTING
                self._desired = self._applied
            if attempt > self.options.max_crash_restarts:
                with self._lock:
                    self._phase = FAILED
                    self._last_error = (
                        f"gave up after {self.options.max_crash_restarts} crash restarts: {self._last_error}"
                    )
                    self._gave_up = True
                log.error("crash_recovery_gave_up", error=self._last_error)
                return False
            delay_s = backoff_s(attempt, self.options.crash_backoff_s, self.options.crash_backoff_max_s)
            log.warning("crash_restart", attempt=attempt, delay_s=delay_s, error=self._last_error)
            if self._stop.wait(delay_s):
                return True
            self._count_restart()
            if self._start(self._applied, STARTING):
                return True
        return True

    def _note_stable(self) -> None:
        with self._lock:
            since = self._ready_since
            if since is not None and time.monotonic() - since >= self.options.stable_after_s:
                self._crash_attempts = 0

    def _stop_child(self) -> int:
        child = self._child
        if child is None:
            return EXIT_GAVE_UP
        status = child.stop(self.options.stop_grace_s)
        with self._lock:
            self._ready_since = None
        return status

    def _count_restart(self) -> None:
        with self._lock:
            self._restart_count += 1

    def _set_error(self, message: str) -> None:
        with self._lock:
            self._last_error = message
        log.warning("child_error", error=message)

    def _persist(self, config: SdConfig) -> None:
        if self.options.state_file is None:
            return
        try:
            save_state(self.options.state_file, config)
        except OSError as exc:
            # Not fatal: vLLM serves; only the memory across launcher restarts is lost.
            log.error("state_file_write_failed", path=str(self.options.state_file), error=str(exc))


def _status(child: VllmChild) -> int:
    return exit_status(child.poll())
