"""An in-process :class:`~controller.coordination.base.Coordinator` for simulated fleets.

The real backends (etcd, Kubernetes Leases) keep a slot's TTL on the engine's side; here the
TTL runs on the simulation's clock, the one every simulated controller shares, so a fleet of
real ``Controller`` instances can be coordinated in one process on virtual time. Not for
deployments: it coordinates nothing outside this process.
"""

from __future__ import annotations

from collections.abc import Callable

from controller.coordination.base import ReplicaState, Slot


class InProcessCoordinator:
    """``max_unavailable`` restart slots with a TTL on ``clock``; replica states in a dict."""

    def __init__(self, max_unavailable: int, ttl_s: float, clock: Callable[[], float]) -> None:
        if max_unavailable < 1:
            raise ValueError(f"max_unavailable must be at least 1, got {max_unavailable}")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.max_unavailable = max_unavailable
        self.ttl_s = ttl_s
        self.clock = clock
        self._slots: dict[int, tuple[str, float]] = {}  # index -> (holder, expires at)
        self._states: dict[str, ReplicaState] = {}
        self.max_held = 0  # the most slots ever held at once (what the fleet's tests check)

    def _expire(self) -> None:
        now = self.clock()
        for i in [i for i, (_, until) in self._slots.items() if until <= now]:
            del self._slots[i]

    def acquire(self, holder: str) -> Slot | None:
        self._expire()
        for i, (who, _) in self._slots.items():
            if who == holder:
                return Slot(f"slot-{i}", holder, str(i))
        for i in range(self.max_unavailable):
            if i not in self._slots:
                self._slots[i] = (holder, self.clock() + self.ttl_s)
                self.max_held = max(self.max_held, len(self._slots))
                return Slot(f"slot-{i}", holder, str(i))
        return None

    def keep_alive(self, slot: Slot) -> bool:
        self._expire()
        i = int(slot.lease_id)
        if self._slots.get(i, ("", 0.0))[0] != slot.holder:
            return False
        self._slots[i] = (slot.holder, self.clock() + self.ttl_s)
        return True

    def release(self, slot: Slot) -> None:
        i = int(slot.lease_id)
        if self._slots.get(i, ("", 0.0))[0] == slot.holder:
            del self._slots[i]

    def holders(self) -> list[str]:
        self._expire()
        return [who for who, _ in self._slots.values()]

    def publish(self, state: ReplicaState) -> None:
        self._states[state.replica_id] = state

    def fleet_states(self) -> list[ReplicaState]:
        return sorted(self._states.values(), key=lambda s: s.replica_id)
