"""The admin-hook contract: how the controller asks for SD on/off and learns what is applied."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from controller.admin_api import HookPhase

__all__ = ["ChangeRequest", "Hook", "HookError", "HookPhase", "HookStatus"]


@dataclass(frozen=True)
class ChangeRequest:
    """What the controller wants applied, and why (the reason travels to the hook)."""

    enabled: bool
    num_speculative_tokens: int | None
    reason: str
    predicted_speedup: float | None = None
    requested_at: float = 0.0


@dataclass(frozen=True)
class HookStatus:
    """What the hook reports: the phase, the applied setting (None: unknown), the durations of
    the last switches (oldest first), the last error, safe to log, and how many times the
    server restarted (None: the hook cannot say; the launcher counts switches, rollbacks and
    crash restarts)."""

    phase: HookPhase
    applied_enabled: bool | None = None
    applied_draft_length: int | None = None
    restart_durations_s: tuple[float, ...] = field(default_factory=tuple)
    last_error: str | None = None
    restart_count: int | None = None


class HookError(RuntimeError):
    """The hook refused or failed a request; the message is safe to log (no secrets).

    ``uncertain``: the request may have been carried out (a timeout after sending it), so the
    controller keeps its pending lock and lets the hook's status settle the question.
    """

    def __init__(self, message: str, uncertain: bool = False) -> None:
        super().__init__(message)
        self.uncertain = uncertain


class Hook(Protocol):
    """How the controller switches SD, and learns what is applied.

    Implementations: :mod:`controller.hooks.http` (any HTTP endpoint, and ``sd-controller
    launch``'s admin API), :mod:`controller.hooks.exec` (a command, and the observe-only
    ``NoHook``); the simulator's ``SimHook`` and the backtest's replay hook.

    What the controller relies on:

    * ``request`` returns once the change was accepted, not applied: the controller holds a
      pending lock until ``status`` reports ``READY`` with the requested ``applied_enabled``
      (confirmed: the dwell starts), ``FAILED`` (backoff), or ``pending_timeout_s`` passes.
    * ``request`` raises :class:`HookError` when refused; ``uncertain=True`` when the change may
      have happened anyway (a timeout after sending), so the lock stays until status settles it.
    * ``status`` is called every tick and never raises.
    * ``restart_durations_s`` are measured switch downtimes: they replace the
      ``restart_downtime_s`` assumption in the price of the next switch.
    * An ``applied_enabled`` that changes without a request is adopted as an external change
      (an operator, a redeploy) and restarts the dwell.
    """

    def request(self, change: ChangeRequest) -> None:
        """Ask for a change. Returns once the hook accepted it; raises :class:`HookError`."""

    def status(self) -> HookStatus:
        """What is applied now (never raises: an unreadable status is ``HookPhase.UNKNOWN``)."""
