"""Replaying steps through the unchanged :class:`~controller.loop.Controller` on their clock;
the hook applies a requested change at once."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence

from controller.observation import FailureReason, ObservationFailure, ObserveResult
from controller.sim.backtest.history import Step
from controller.sim.backtest.scoring import BacktestResult, score_step


class _ListSource:
    """Returns the prepared observation of the current step."""

    def __init__(self) -> None:
        self.current: ObserveResult = ObservationFailure(FailureReason.EMPTY, "no step")

    def observe(self, now: float) -> ObserveResult:
        return self.current


class _ReplayHook:
    """A requested change is applied at once; ``status`` reports the replay's state."""

    def __init__(self, enabled: bool, draft_length: int) -> None:
        self.enabled = enabled
        self.draft_length = draft_length
        self.requests: list = []

    def request(self, change) -> None:
        self.requests.append(change)
        self.enabled = change.enabled
        if change.num_speculative_tokens:
            self.draft_length = change.num_speculative_tokens

    def status(self):
        from controller.hooks.base import HookPhase, HookStatus

        return HookStatus(phase=HookPhase.READY, applied_enabled=self.enabled, applied_draft_length=self.draft_length)


@contextlib.contextmanager
def _quiet_structlog() -> Iterator[None]:
    """Silence the controller's per-tick log lines, and restore the caller's configuration."""
    import structlog

    old = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    try:
        yield
    finally:
        structlog.configure(**old)


def replay(settings, model, steps: Sequence[Step]) -> BacktestResult:
    """Drive the unchanged Controller through ``steps`` on their clock; see the module doc."""
    from prometheus_client import CollectorRegistry

    from controller.config import OverrideMode
    from controller.loop import Controller
    from controller.state_store import MemoryStateStore

    first = next((s.recorded_enabled for s in steps if s.recorded_enabled is not None), False)
    source, hook = _ListSource(), _ReplayHook(bool(first), settings.draft_length)
    clock = [steps[0].time_s if steps else 0.0]
    ctl = Controller(
        settings,
        model,
        source,
        hook,
        lambda: clock[0],
        CollectorRegistry(),
        MemoryStateStore(),
        override=lambda: OverrideMode.AUTO,  # an operator's override is not history to replay
    )
    result = BacktestResult([])
    recorded: bool | None = None
    with _quiet_structlog():
        for step in steps:
            clock[0] = step.time_s
            source.current = step.observation
            if step.recorded_enabled is not None:
                recorded = step.recorded_enabled  # carried over steps that lack it (restarts, gaps)
            res = ctl.tick()
            result.records.append(score_step(result, ctl.policy_config, step, res, recorded, hook.enabled))
    return result
