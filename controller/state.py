"""The controller's durable state: pure values, (de)serialized to a dict for the state file.

It holds what must survive a controller restart: the applied config, when it last changed (so
the dwell holds), a change still pending, the failure backoff, and the last measured acceptance
(vLLM exports none while SD is off).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from controller.admin_api import MAX_SPEC_TOKENS

STATE_VERSION = 1


@dataclass(frozen=True)
class PendingChange:
    """A change issued to the hook and not yet confirmed; ``restarts_before``: the hook's
    restart count when it was issued (None: the hook keeps none)."""

    enabled: bool
    draft_length: int | None
    issued_at: float
    reason: str
    restarts_before: int | None = None


@dataclass(frozen=True)
class ControllerState:
    applied_enabled: bool | None = None  # None until the hook or the metrics tell
    applied_draft_length: int | None = None
    last_change_at: float | None = None  # when the last change was confirmed applied
    pending: PendingChange | None = None
    consecutive_failures: int = 0
    retry_not_before: float | None = None
    low_acceptance_since: float | None = None
    floor_tripped_at: float | None = None
    last_acceptance_rate: float | None = None  # vLLM-style, as last measured
    last_alpha: float | None = None  # per-token α derived from it
    last_acceptance_at: float | None = None
    last_prompt_tokens: float | None = None
    last_gen_tokens: float | None = None
    restart_durations_s: tuple[float, ...] = field(default_factory=tuple)
    sd_congested_rate_rps: float | None = None  # lowest rate at which SD was seen congested
    sd_congested_at: float | None = None
    # The switch the rule has wanted since when (the excursion filter), and the load history
    # that forecasts the next hours (controller/risk.py): both survive a controller restart.
    switch_wanted_since: float | None = None
    switch_wanted_enabled: bool | None = None
    rate_history: tuple[tuple[float, float], ...] = field(default_factory=tuple)
    # The last hour of measured per-token acceptance α, bucketed (risk.record_acceptance): its
    # trend is what the gain of leaving a drifting draft follows.
    alpha_history: tuple[tuple[float, float], ...] = field(default_factory=tuple)
    # Safety net (policy.safety_net): consecutive ticks of observed SD harm / of a growing queue.
    sd_harm_ticks: int = 0
    queue_growth_ticks: int = 0
    last_waiting: float | None = None
    # The last tick's rate rising beyond the rate windows' noise (None: it did not): a rise
    # that overloads the applied state must show on two ticks running (assessment.assess).
    last_rise_rps: float | None = None
    queue_growth_from: float | None = None  # waiting when the growth run began
    queue_growth_since: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["restart_durations_s"] = list(self.restart_durations_s)
        d["rate_history"] = [list(item) for item in self.rate_history]
        d["alpha_history"] = [list(item) for item in self.alpha_history]
        return {"version": STATE_VERSION, **d}

    @classmethod
    def from_dict(cls, raw: Any) -> ControllerState:
        """Rebuild from a state file's dict; ValueError (one line) if anything is off."""
        if not isinstance(raw, dict):
            raise ValueError("top level is not an object")
        if raw.get("version") != STATE_VERSION:
            raise ValueError(f"version {raw.get('version')!r} is not {STATE_VERSION}")
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(raw) - set(known) - {"version"}
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))}")
        values: dict[str, Any] = {}
        for name, value in raw.items():
            if name == "version":
                continue
            if name == "pending":
                values[name] = _pending(value)
            elif name == "restart_durations_s":
                if not isinstance(value, list) or not all(_finite(v) and v >= 0 for v in value):
                    raise ValueError("restart_durations_s must be a list of non-negative numbers")
                values[name] = tuple(float(v) for v in value)
            elif name == "rate_history":
                values[name] = _history(name, value, "rate", math.inf)
            elif name == "alpha_history":
                values[name] = _history(name, value, "acceptance in [0, 1]", 1.0)
            elif name in ("applied_enabled", "switch_wanted_enabled"):
                if value is not None and not isinstance(value, bool):
                    raise ValueError(f"{name} must be true, false or null")
                values[name] = value
            elif name in ("applied_draft_length", "consecutive_failures", "sd_harm_ticks", "queue_growth_ticks"):
                if value is not None and not _whole(value, 0):
                    raise ValueError(f"{name} must be a non-negative integer")
                if name == "applied_draft_length" and value is not None and value > MAX_SPEC_TOKENS:
                    raise ValueError(f"applied_draft_length {value} is past {MAX_SPEC_TOKENS}")
                values[name] = value
            else:
                if value is not None and not _finite(value):
                    raise ValueError(f"{name} must be a finite number or null")
                values[name] = None if value is None else float(value)
        for name in ("consecutive_failures", "sd_harm_ticks", "queue_growth_ticks"):
            if values.get(name) is None:
                values.pop(name, None)
        return cls(**values)


_PAST_TIMES = (
    "last_change_at",
    "low_acceptance_since",
    "floor_tripped_at",
    "last_acceptance_at",
    "sd_congested_at",
    "switch_wanted_since",
    "queue_growth_since",
)


def clamp_to_clock(state: ControllerState, now: float, max_backoff_s: float) -> tuple[ControllerState, tuple[str, ...]]:
    """The state with times from the future (a clock step back, a restored backup) brought to ``now``.

    A dwell or a pending change dated in the future would hold forever; clamped, each starts
    now and ends on its own schedule. ``retry_not_before`` may lie ahead, but never more than
    ``max_backoff_s``. Returns the new state and the names of the fields that were changed.
    """
    changes: dict[str, Any] = {}
    for name in _PAST_TIMES:
        value = getattr(state, name)
        if value is not None and value > now:
            changes[name] = now
    if state.retry_not_before is not None and state.retry_not_before > now + max_backoff_s:
        changes["retry_not_before"] = now + max_backoff_s
    if state.pending is not None and state.pending.issued_at > now:
        changes["pending"] = dataclasses.replace(state.pending, issued_at=now)
    if not changes:
        return state, ()
    return dataclasses.replace(state, **changes), tuple(sorted(changes))


def _whole(v: Any, least: int) -> bool:
    """An integer of at least ``least`` (JSON's true and false are not numbers here)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _history(name: str, value: Any, what: str, upper: float) -> tuple[tuple[float, float], ...]:
    if not isinstance(value, list):
        raise ValueError(f"{name} must be a list of [time, {what}] pairs")
    out = []
    for item in value:
        ok = isinstance(item, list) and len(item) == 2 and _finite(item[0]) and _finite(item[1])
        if not (ok and 0 <= item[1] <= upper):
            raise ValueError(
                f"{name} must be a list of [time, {'non-negative ' if upper == math.inf else ''}{what}] pairs"
            )
        out.append((float(item[0]), float(item[1])))
    if any(b[0] <= a[0] for a, b in itertools.pairwise(out)):
        raise ValueError(f"{name} times must increase")
    return tuple(out)


def _pending(value: Any) -> PendingChange | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("pending must be an object or null")
    try:
        enabled, issued_at = value["enabled"], value["issued_at"]
        draft_length, reason = value.get("draft_length"), value.get("reason", "")
        restarts_before = value.get("restarts_before")
    except KeyError as exc:
        raise ValueError(f"pending lacks {exc.args[0]}") from None
    if not isinstance(enabled, bool) or not _finite(issued_at):
        raise ValueError("pending.enabled must be a boolean and pending.issued_at a number")
    if draft_length is not None and not _whole(draft_length, 1):
        raise ValueError("pending.draft_length must be a positive integer or null")
    if restarts_before is not None and not _whole(restarts_before, 0):
        raise ValueError("pending.restarts_before must be a non-negative integer or null")
    return PendingChange(enabled, draft_length, float(issued_at), str(reason), restarts_before)
