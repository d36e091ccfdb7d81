"""The admin API's contract: an SD setting, the phases of a server that restarts to change it,
and the ``GET /admin/status`` document.

One schema for its three parties: :mod:`controller.launcher` serves it, :mod:`controller.sim`
imitates it, and :mod:`controller.hooks.http` parses it (docs/launcher.md has the fields).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

MIN_SPEC_TOKENS, MAX_SPEC_TOKENS = 1, 64
MAX_RESTART_DURATIONS = 20  # how many switch durations a status reports
# What a status may say (0: a server reporting "none" while SD is off); a draft length past it
# is garbage the controller would price, and a duration must be one a restart can take.
SpecTokens = Annotated[StrictInt, Field(ge=0, le=MAX_SPEC_TOKENS)]
Duration = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class HookPhase(StrEnum):
    """Where the server stands; the launcher's ``phase`` and the hook's reading of it."""

    READY = "ready"  # serving with the applied config
    RESTARTING = "restarting"  # a change is being applied
    STARTING = "starting"  # initial start or crash recovery
    FAILED = "failed"  # the last change failed (rolled back); applied is the old config
    UNKNOWN = "unknown"  # status could not be read (the hook's own; never served)


BUSY_PHASES = (HookPhase.STARTING, HookPhase.RESTARTING)


@dataclass(frozen=True)
class SdConfig:
    """An SD setting: on/off and, when on, the draft length (None: whatever vLLM defaults to)."""

    enabled: StrictBool
    num_speculative_tokens: SpecTokens | None = None

    def to_json(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "num_speculative_tokens": self.num_speculative_tokens}


OFF = SdConfig(enabled=False, num_speculative_tokens=None)


class AdminStatus(BaseModel):
    """The ``GET /admin/status`` document (exact keys and order as served).

    ``applied`` only ever names a setting vLLM actually came up with; a reader that gets a
    body without ``applied.enabled`` reads it as unknown (None). ``restart_durations_s`` are
    the last successful switches, each from stopping the old vLLM to the new one serving: the
    downtime one switch costs, which the controller uses to price the next one.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    phase: HookPhase = HookPhase.UNKNOWN
    applied: SdConfig | None = None
    desired: SdConfig | None = None
    restart_count: int = 0
    last_restart_duration_s: Duration | None = None
    restart_durations_s: list[Duration] | None = None
    child_pid: int | None = None
    last_error: str | None = None
    vllm_url: str | None = None

    @field_validator("applied", mode="before")
    @classmethod
    def _unknown_applied(cls, v: Any) -> Any:
        if v is None or (isinstance(v, dict) and v.get("enabled") is None):
            return None
        return v

    @property
    def durations_s(self) -> tuple[float, ...]:
        """The switch durations reported, oldest first (the latest alone if only that is)."""
        if self.restart_durations_s:
            return tuple(self.restart_durations_s)
        return (self.last_restart_duration_s,) if self.last_restart_duration_s else ()

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def admin_status(
    phase: HookPhase,
    applied: SdConfig,
    desired: SdConfig,
    restart_count: int,
    durations_s: list[float],
    child_pid: int | None,
    last_error: str | None,
    vllm_url: str,
) -> dict[str, Any]:
    """The status document a server serves (``last_restart_duration_s`` is the latest duration)."""
    return AdminStatus(
        phase=phase,
        applied=applied,
        desired=desired,
        restart_count=restart_count,
        last_restart_duration_s=durations_s[-1] if durations_s else None,
        restart_durations_s=list(durations_s),
        child_pid=child_pid,
        last_error=last_error,
        vllm_url=vllm_url,
    ).to_json()
