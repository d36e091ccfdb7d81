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
import uuid

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from controller import policy
from controller.coordination.base import CoordinationError, Coordinator, ReplicaState, Slot
from controller.events import Event
from controller.policy import Action, Decision
from controller.state import ControllerState

log = structlog.get_logger("sd_controller")


HOLDER_SEP = "#"  # a slot's holder: <replica id>#<instance>
TWIN_CHECK_TICKS = 5  # without a fleet plan (which reads the states anyway), look for a twin this often


class RestartGate:
    """One replica's side of the fleet's restart slots (``replica_id`` names it to the others).

    A slot is held by this *process* (``holder``: the replica id and an ``instance`` token made
    at start), not by the replica id alone: two controllers given one replica id (a shared env
    file) each took "their own" slot and restarted together, past ``max_unavailable``. A
    restarted controller therefore waits for its predecessor's slot to expire (the TTL) like
    anyone else. The same token on the published state tells such twins apart: each sees the
    other's writes on its own key, counted in ``sd_controller_duplicate_replica_id``.
    """

    def __init__(self, coordinator: Coordinator, replica_id: str, backend: str = "none", instance: str = "") -> None:
        self.coordinator = coordinator
        self.replica_id = replica_id
        self.backend = backend
        self.instance = instance or uuid.uuid4().hex[:12]
        self.holder = f"{replica_id}{HOLDER_SEP}{self.instance}"
        self.slot: Slot | None = None
        self._published = False  # this process has written its state at least once
        self._twin: str | None = None  # the other instance seen writing this replica's state
        self._states: list[ReplicaState] | None = None  # read this tick (fleet_view), for settle
        self._ticks = 0
        self._changes: dict[str, tuple[float, float]] = {}  # replica -> (its published_at, when seen here)
        self._waits: Counter | None = None
        self._errors: Counter | None = None
        self._held: Gauge | None = None
        self._fleet_sd: Gauge | None = None
        self._fleet_target: Gauge | None = None
        self._duplicate: Gauge | None = None

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
        self._duplicate = Gauge(
            "sd_controller_duplicate_replica_id",
            "Another controller process publishes under this replica id (a misconfiguration)",
            registry=registry,
        )
        self._duplicate.set(0)

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
                self.slot = self.coordinator.acquire(self.holder)
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
            log.info("slot_acquired", slot=self.slot.key, replica_id=self.replica_id, instance=self.instance)
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
        self._states = states
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

    def _check_twin(self) -> None:
        """Another process wrote this replica's state since this one last did: a twin."""
        states, self._states = self._states, None
        self._ticks += 1
        if states is None:  # no fleet plan read them this tick: one read every few ticks
            if self._ticks % TWIN_CHECK_TICKS != 2:  # the second tick: after this one's first write
                return
            try:
                states = self.coordinator.fleet_states()
            except CoordinationError as exc:
                self._count_error("fleet_states", exc)
                return
        mine = next((st for st in states if st.replica_id == self.replica_id), None)
        # Before this process's first write the key may still hold its predecessor's (a
        # restart), and a state without a token comes from an older controller: neither counts.
        twin = mine.instance if mine is not None and mine.instance not in ("", self.instance) else None
        if twin is not None and self._published and twin != self._twin:
            log.error(
                "duplicate_replica_id",
                replica_id=self.replica_id,
                instance=self.instance,
                other_instance=twin,
                detail="two controllers publish as one replica; give each its own replica_id (the pod's name)",
            )
        if self._published:
            self._twin = twin
            if self._duplicate is not None:
                self._duplicate.set(1 if twin is not None else 0)

    def _holders(self) -> list[str]:
        try:
            return [h.split(HOLDER_SEP, 1)[0] for h in self.coordinator.holders()]
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
                self.slot = self.coordinator.acquire(self.holder)
        except CoordinationError as exc:
            self._count_error("settle", exc)
        self._set_held()
        self._check_twin()
        self._publish(state)

    def _publish(self, state: ControllerState) -> None:
        # Every tick, changed or not: the backend keeps a replica's state only while it is renewed
        # (a lease), so a replica whose controller is gone leaves the fleet, and a state the
        # backend lost (keys wiped, a restored snapshot) is back within a tick.
        try:
            self.coordinator.publish(
                ReplicaState(self.replica_id, state.applied_enabled, state.last_change_at or 0.0, self.instance)
            )
            self._published = True
        except CoordinationError as exc:
            self._count_error("publish", exc)
