"""The coordination protocol: a restart slot with a TTL, kept alive while the restart runs.

The TTL is kept by the coordination engine (an etcd lease, a Kubernetes Lease), never by the
controllers' clocks: a controller that dies holding a slot loses it when the engine says so,
whatever the clocks of the controllers read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class CoordinationError(RuntimeError):
    """The backend could not be reached, or answered something that is not what it promises.

    The message is one line naming the backend and endpoint (never a credential).
    """


@dataclass(frozen=True)
class Slot:
    """A restart slot held by ``holder`` (a replica id) until released or expired."""

    key: str
    holder: str
    lease_id: str  # the backend's handle: an etcd lease id, a Lease's name


@dataclass(frozen=True)
class ReplicaState:
    """What one replica's controller last published: the SD setting applied on its server, and
    the publishing process (``instance``, fresh per controller process; "" from an older one)."""

    replica_id: str
    enabled: bool | None
    published_at: float
    instance: str = ""


class Coordinator(Protocol):
    """What the controller relies on. Every method raises :class:`CoordinationError` when the
    backend cannot answer; none blocks longer than the backend's timeout (plus its retries)."""

    max_unavailable: int

    def acquire(self, holder: str) -> Slot | None:
        """A free slot for ``holder`` (the one it holds already, if any), or None when all
        ``max_unavailable`` slots are taken by others."""
        ...

    def keep_alive(self, slot: Slot) -> bool:
        """Renew the slot's TTL; False when it was lost (expired, or taken over)."""
        ...

    def release(self, slot: Slot) -> None:
        """Free the slot now (idempotent: releasing a lost slot is not an error)."""
        ...

    def holders(self) -> list[str]:
        """Who holds a slot right now."""
        ...

    def publish(self, state: ReplicaState) -> None:
        """Record this replica's applied state for the fleet to read."""
        ...

    def fleet_states(self) -> list[ReplicaState]:
        """Every replica's last published state."""
        ...
