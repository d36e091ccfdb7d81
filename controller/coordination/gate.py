"""The restart gate: what the tick loop asks before a restart, and tells after each tick.

    decision = gate.admit(decision)     acting? take a slot first, or hold with a reason
    gate.settle(state, events)          pending: keep the slot alive; settled: release it

A change is pending from the hook's acceptance until ``policy.reconcile`` confirms it, fails
it, or times it out (``pending_timeout_s``): the slot is released on the first tick that sees
no pending change, so a replica that never comes back frees its slot after the pending
timeout, with its ``change_failed:timeout`` event reported as usual. Coordination errors never
raise out of the tick: unreachable before a restart is a hold, after it a counted error.
"""

from __future__ import annotations

import dataclasses

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from controller import policy
from controller.coordination.base import CoordinationError, Coordinator, ReplicaState, Slot
from controller.events import Event
from controller.policy import Action, Decision
from controller.state import ControllerState

log = structlog.get_logger("sd_controller")


class RestartGate:
    """One replica's side of the fleet's restart slots (``replica_id`` names it to the others)."""

    def __init__(self, coordinator: Coordinator, replica_id: str, backend: str = "none") -> None:
        self.coordinator = coordinator
        self.replica_id = replica_id
        self.backend = backend
        self.slot: Slot | None = None
        self._changes: dict[str, tuple[float, float]] = {}  # replica -> (its published_at, when seen here)
        self._waits: Counter | None = None
        self._errors: Counter | None = None
        self._held: Gauge | None = None
        self._fleet_sd: Gauge | None = None
        self._fleet_target: Gauge | None = None

    def register(self, registry: CollectorRegistry) -> None:
        """Put the gate's metrics on the controller's registry."""
        self._waits = Counter(
            "sd_controller_restart_slot_waits",
            "Ticks a wanted restart was held for want of a slot",
            ["reason"],
            registry=registry,
        )
        self._errors = Counter(
            "sd_controller_coordination_errors", "Coordination backend calls that failed", ["op"], registry=registry
        )
        self._held = Gauge("sd_controller_restart_slot_held", "This replica holds a restart slot", registry=registry)
        g = Gauge("sd_controller_max_unavailable", "Replicas allowed to restart at once", registry=registry)
        g.set(self.coordinator.max_unavailable)
        for reason in (policy.Reason.SLOT_BUSY, policy.Reason.COORDINATION_UNAVAILABLE):
            self._waits.labels(reason.value)
        self._held.set(0)
        self._fleet_sd = Gauge(
            "sd_controller_fleet_sd_replicas", "Replicas of the fleet running SD, as published", registry=registry
        )
        self._fleet_target = Gauge(
            "sd_controller_fleet_sd_target", "Replicas the fleet's plan wants on SD now (fleet.py)", registry=registry
        )

    def record_plan(self, sd_now: int, sd_target: int) -> None:
        """Export the fleet's plan (k of N on SD now, and where it goes)."""
        if self._fleet_sd is not None and self._fleet_target is not None:
            self._fleet_sd.set(sd_now)
            self._fleet_target.set(sd_target)

    def _count_error(self, op: str, exc: CoordinationError) -> None:
        if self._errors is not None:
            self._errors.labels(op).inc()
        log.warning("coordination_error", op=op, backend=self.backend, error=str(exc))

    def _hold(self, decision: Decision, reason: policy.Reason, detail: str) -> Decision:
        if self._waits is not None:
            self._waits.labels(reason.value).inc()
        return dataclasses.replace(decision, action=Action.NONE, reason=reason, detail=detail)

    def admit(self, decision: Decision) -> Decision:
        """The decision unchanged when it does not act or a slot is held; else a hold."""
        if not decision.acts:
            return decision
        if self.slot is not None:
            # Still held from the change confirmed this very tick (settle has not run yet): only
            # good if etcd says so now, never on this controller's memory alone.
            try:
                if not self.coordinator.keep_alive(self.slot):
                    log.warning("slot_lost", slot=self.slot.key, detail="expired before the next restart")
                    self.slot = None
            except CoordinationError as exc:
                self._count_error("keep_alive", exc)
                return self._hold(
                    decision,
                    policy.Reason.COORDINATION_UNAVAILABLE,
                    f"{decision.action.value} held: cannot confirm the restart slot ({exc})",
                )
        if self.slot is None:
            try:
                self.slot = self.coordinator.acquire(self.replica_id)
            except CoordinationError as exc:
                self._count_error("acquire", exc)
                return self._hold(
                    decision,
                    policy.Reason.COORDINATION_UNAVAILABLE,
                    f"{decision.action.value} held: no restart without the fleet's consent ({exc})",
                )
            if self.slot is None:
                holders = self._holders()
                return self._hold(
                    decision,
                    policy.Reason.SLOT_BUSY,
                    f"{decision.action.value} held: all {self.coordinator.max_unavailable} restart slot(s)"
                    f" taken ({', '.join(holders) or '?'})",
                )
            log.info("slot_acquired", slot=self.slot.key, replica_id=self.replica_id)
            self._set_held()
        return decision

    def fleet_view(
        self, applied_enabled: bool | None, now: float
    ) -> tuple[dict[str, bool | None], dict[str, float]] | None:
        """Every replica's published SD state and when it last changed, this replica's own as
        it is now; None when the backend cannot say (the fleet plan then stays out of it).

        When it changed is read on this controller's clock (``now``): a change seen between two
        ticks happened by now, whatever the publisher's clock wrote; a state seen for the first
        time keeps the publisher's time unless that lies in this clock's future. A replica whose
        clock ran an hour ahead had its change "within the dwell" for the hour to every other
        replica, and the fleet's plan held for as long."""
        try:
            states = self.coordinator.fleet_states()
        except CoordinationError as exc:
            self._count_error("fleet_states", exc)
            return None
        enabled = {s.replica_id: s.enabled for s in states}
        changed = {}
        for st in states:
            seen = self._changes.get(st.replica_id)
            if seen is None or seen[0] != st.published_at:
                local = min(st.published_at, now) if seen is None else now
                self._changes[st.replica_id] = seen = (st.published_at, local)
            changed[st.replica_id] = seen[1]
        enabled[self.replica_id] = applied_enabled
        return enabled, changed

    def _holders(self) -> list[str]:
        try:
            return self.coordinator.holders()
        except CoordinationError:
            return []

    def _set_held(self) -> None:
        if self._held is not None:
            self._held.set(1 if self.slot is not None else 0)

    def settle(self, state: ControllerState, events: tuple[Event, ...]) -> None:
        """After the tick: keep the slot while a change is pending, release it once settled."""
        try:
            if self.slot is not None and state.pending is None:
                self.coordinator.release(self.slot)
                log.info("slot_released", slot=self.slot.key, events=[str(e) for e in events])
                self.slot = None
            elif self.slot is not None:
                if not self.coordinator.keep_alive(self.slot):
                    log.error("slot_lost", slot=self.slot.key, detail="the lease expired while the restart ran")
                    self.slot = None
            elif state.pending is not None:
                # A restart in flight without a slot (this controller restarted mid-change):
                # take one if it is free, so the fleet counts this replica as restarting.
                self.slot = self.coordinator.acquire(self.replica_id)
        except CoordinationError as exc:
            self._count_error("settle", exc)
        self._set_held()
        self._publish(state)

    def _publish(self, state: ControllerState) -> None:
        # Every tick, changed or not: the backend keeps a replica's state only while it is renewed
        # (a lease), so a replica whose controller is gone leaves the fleet, and a state the
        # backend lost (keys wiped, a restored snapshot) is back within a tick.
        try:
            self.coordinator.publish(ReplicaState(self.replica_id, state.applied_enabled, state.last_change_at or 0.0))
        except CoordinationError as exc:
            self._count_error("publish", exc)
