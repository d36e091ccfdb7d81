"""One replica, no coordination: every restart gets its slot (today's behaviour)."""

from __future__ import annotations

from controller.coordination.base import ReplicaState, Slot


class NoCoordinator:
    """Always grants the slot; remembers only this process's published state."""

    max_unavailable = 1

    def __init__(self) -> None:
        self._states: dict[str, ReplicaState] = {}

    def acquire(self, holder: str) -> Slot | None:
        return Slot("local", holder, "local")

    def keep_alive(self, slot: Slot) -> bool:
        return True

    def release(self, slot: Slot) -> None:
        return None

    def holders(self) -> list[str]:
        return []

    def publish(self, state: ReplicaState) -> None:
        self._states[state.replica_id] = state

    def fleet_states(self) -> list[ReplicaState]:
        return list(self._states.values())
