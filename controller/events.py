"""What happened in a tick besides the decision: typed events, not strings to re-parse.

The policy emits them (a change confirmed, failed, adopted; the acceptance floor tripped; the
hook's answer to a request); the exporter counts them, the loop notifies and logs them. Their
``str`` is the ``kind:detail`` form the decision log line has always carried.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class EventKind(StrEnum):
    CHANGE_CONFIRMED = "change_confirmed"  # detail: on | off
    EXTERNAL_CHANGE = "external_change"  # detail: on | off (an operator or a redeploy switched it)
    CHANGE_FAILED = "change_failed"  # detail: timeout | hook_reported_failure | hook_refused
    CHANGE_REQUESTED = "change_requested"
    CHANGE_UNCERTAIN = "change_uncertain"  # the request timed out after it was sent
    CHANGE_SUPERSEDED = "change_superseded"  # detail: on | off (ours, run or rolled back; a later switch replaced it)
    ACCEPTANCE_FLOOR_TRIPPED = "acceptance_floor_tripped"


@dataclass(frozen=True)
class Event:
    kind: EventKind
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind.value}:{self.detail}" if self.detail else self.kind.value

    @property
    def toggled(self) -> str | None:
        """``on``/``off`` when the applied state changed (by us or by someone else), else None."""
        if self.kind in (EventKind.CHANGE_CONFIRMED, EventKind.EXTERNAL_CHANGE):
            return self.detail
        return None
