"""Restart slots as Kubernetes Leases (coordination.k8s.io/v1), through the official client.

Slot ``i`` is the Lease ``<prefix>-slot-<i>`` in the pod's namespace; its ``holderIdentity``
is the replica holding it, renewed (``renewTime``) every tick. Like client-go's leader
election, expiry is judged on *observed* time: a Lease whose record (resourceVersion) has not
changed for ``leaseDurationSeconds`` on this controller's monotonic clock is expired, so skew
between the controllers' wall clocks cannot hand out a live slot. Every write is a replace
carrying the resourceVersion read, so two controllers racing for one slot cannot both win
(the API server answers 409 to the second).

Not tested against a real API server (none can run here): tests/test_coordination_kubernetes.py
runs it through the official client against a small fake of the Lease REST API over real HTTP
(get/list/create/update, 404, 409 on a stale resourceVersion); auth, RBAC enforcement and the
real server's validation are not exercised.
RBAC: get, list, create, update, delete on leases in the namespace (deploy/fleet/).
"""

from __future__ import annotations

import datetime as dt
import re
import time
from collections.abc import Callable
from typing import Any

from urllib3.exceptions import HTTPError

from controller.coordination.base import CoordinationError, ReplicaState, Slot

ENABLED_ANNOTATION = "sd-controller.io/applied-enabled"
PUBLISHED_ANNOTATION = "sd-controller.io/published-at"
INSTANCE_ANNOTATION = "sd-controller.io/instance"


def _name(prefix: str) -> str:
    """A DNS-1123 name from the prefix ("/sd-controller" -> "sd-controller")."""
    name = re.sub(r"[^a-z0-9-]+", "-", prefix.lower()).strip("-")
    return name or "sd-controller"


class KubernetesLeaseCoordinator:
    """:class:`~controller.coordination.base.Coordinator` on Kubernetes Leases."""

    def __init__(
        self,
        api: Any,
        namespace: str,
        prefix: str = "sd-controller",
        max_unavailable: int = 1,
        ttl_s: float = 60.0,
        timeout_s: float = 2.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        self._client, self._ApiException = client, ApiException
        self.api = api
        self.namespace = namespace
        self.prefix = _name(prefix)
        self.max_unavailable = max_unavailable
        self.ttl_s = int(max(2, round(ttl_s)))
        self.timeout_s = timeout_s
        self.monotonic = monotonic
        self._observed: dict[str, tuple[str, float]] = {}  # name -> (resourceVersion, first seen)

    @classmethod
    def in_cluster(cls, namespace: str, **kw: Any) -> KubernetesLeaseCoordinator:
        try:
            from kubernetes import client, config
        except ImportError:
            raise CoordinationError(
                "coordination_backend=kubernetes needs the kubernetes package (pip install 'sd-controller[fleet]')"
            ) from None
        try:
            config.load_incluster_config()
        except config.ConfigException as exc:
            raise CoordinationError(f"kubernetes: not in a cluster: {exc}") from None
        return cls(client.CoordinationV1Api(), namespace, **kw)

    # ------------------------------------------------------------------ plumbing
    def _call(self, op: str, name: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except self._ApiException as exc:
            if exc.status in (404, 409):
                raise
            raise CoordinationError(
                f"kubernetes lease {self.namespace}/{name}: {op}: HTTP {exc.status} {exc.reason}"
            ) from None
        except (HTTPError, OSError) as exc:  # connection refused, timeouts, TLS
            raise CoordinationError(
                f"kubernetes lease {self.namespace}/{name}: {op}: unreachable ({type(exc).__name__})"
            ) from None

    def _read(self, name: str) -> Any | None:
        try:
            return self._call(
                "read",
                name,
                lambda: self.api.read_namespaced_lease(name, self.namespace, _request_timeout=self.timeout_s),
            )
        except self._ApiException as exc:
            if exc.status == 404:
                return None
            raise CoordinationError(f"kubernetes lease {self.namespace}/{name}: read: HTTP {exc.status}") from None

    def _write(self, op: str, name: str, fn: Callable[[], Any]) -> bool:
        """True when written; False on a conflict (someone else wrote first)."""
        try:
            self._call(op, name, fn)
            return True
        except self._ApiException as exc:
            if exc.status == 409:
                return False
            raise CoordinationError(f"kubernetes lease {self.namespace}/{name}: {op}: HTTP {exc.status}") from None

    def _now(self) -> dt.datetime:
        return dt.datetime.now(dt.UTC)

    def _body(self, name: str, holder: str | None, rv: str | None, annotations: dict | None = None) -> Any:
        c = self._client
        now = self._now()
        return c.V1Lease(
            metadata=c.V1ObjectMeta(name=name, namespace=self.namespace, resource_version=rv, annotations=annotations),
            spec=c.V1LeaseSpec(
                holder_identity=holder,
                lease_duration_seconds=self.ttl_s,
                acquire_time=now if holder else None,
                renew_time=now if holder else None,
            ),
        )

    def _expired(self, name: str, lease: Any) -> bool:
        """The record has not changed for its duration, by this controller's monotonic clock."""
        rv = lease.metadata.resource_version
        seen = self._observed.get(name)
        if seen is None or seen[0] != rv:
            self._observed[name] = (rv, self.monotonic())
            return False
        duration = lease.spec.lease_duration_seconds or self.ttl_s
        return self.monotonic() - seen[1] > duration

    def _slot_names(self) -> list[str]:
        return [f"{self.prefix}-slot-{i}" for i in range(self.max_unavailable)]

    # ------------------------------------------------------------------ protocol
    def acquire(self, holder: str) -> Slot | None:
        leases = {name: self._read(name) for name in self._slot_names()}
        for name, lease in leases.items():
            if lease is not None and lease.spec and lease.spec.holder_identity == holder:
                return Slot(name, holder, name)
        for name, lease in leases.items():
            if lease is None:
                created = self._write(
                    "create",
                    name,
                    lambda n=name: self.api.create_namespaced_lease(
                        self.namespace, self._body(n, holder, None), _request_timeout=self.timeout_s
                    ),
                )
                if created:
                    return Slot(name, holder, name)
                continue
            free = not (lease.spec and lease.spec.holder_identity) or self._expired(name, lease)
            if free and self._replace(name, holder, lease.metadata.resource_version):
                return Slot(name, holder, name)
        return None

    def _replace(self, name: str, holder: str | None, rv: str) -> bool:
        return self._write(
            "replace",
            name,
            lambda: self.api.replace_namespaced_lease(
                name, self.namespace, self._body(name, holder, rv), _request_timeout=self.timeout_s
            ),
        )

    def keep_alive(self, slot: Slot) -> bool:
        lease = self._read(slot.key)
        if lease is None or not lease.spec or lease.spec.holder_identity != slot.holder:
            return False
        return self._replace(slot.key, slot.holder, lease.metadata.resource_version)

    def release(self, slot: Slot) -> None:
        lease = self._read(slot.key)
        if lease is None or not lease.spec or lease.spec.holder_identity != slot.holder:
            return
        self._replace(slot.key, None, lease.metadata.resource_version)

    def holders(self) -> list[str]:
        out = []
        for name in self._slot_names():
            lease = self._read(name)
            if lease is not None and lease.spec and lease.spec.holder_identity:
                out.append(lease.spec.holder_identity)
        return out

    def publish(self, state: ReplicaState) -> None:
        name = f"{self.prefix}-replica-{_name(state.replica_id)}"
        ann = {
            ENABLED_ANNOTATION: str(state.enabled).lower(),
            PUBLISHED_ANNOTATION: str(state.published_at),
            INSTANCE_ANNOTATION: state.instance,
        }
        lease = self._read(name)
        if lease is None:
            self._write(
                "create",
                name,
                lambda: self.api.create_namespaced_lease(
                    self.namespace, self._body(name, state.replica_id, None, ann), _request_timeout=self.timeout_s
                ),
            )
        else:
            self._write(
                "replace",
                name,
                lambda: self.api.replace_namespaced_lease(
                    name,
                    self.namespace,
                    self._body(name, state.replica_id, lease.metadata.resource_version, ann),
                    _request_timeout=self.timeout_s,
                ),
            )

    def fleet_states(self) -> list[ReplicaState]:
        result = self._call(
            "list", "*", lambda: self.api.list_namespaced_lease(self.namespace, _request_timeout=self.timeout_s)
        )
        out = []
        for lease in result.items:
            if not lease.metadata.name.startswith(f"{self.prefix}-replica-"):
                continue
            # Every tick's publish renews it: one left unchanged for its duration (by this
            # controller's monotonic clock) belongs to a controller that is gone.
            if self._expired(lease.metadata.name, lease):
                continue
            ann = lease.metadata.annotations or {}
            raw = ann.get(ENABLED_ANNOTATION)
            if raw not in ("true", "false", "none"):
                raise CoordinationError(
                    f"kubernetes lease {self.namespace}/{lease.metadata.name}: annotation {ENABLED_ANNOTATION}={raw!r}"
                    " is not true/false/none"
                )
            try:
                at = float(ann.get(PUBLISHED_ANNOTATION, "0"))
            except ValueError:
                raise CoordinationError(
                    f"kubernetes lease {self.namespace}/{lease.metadata.name}: annotation {PUBLISHED_ANNOTATION} is not a number"
                ) from None
            enabled = {"true": True, "false": False, "none": None}[raw]
            out.append(
                ReplicaState(
                    lease.spec.holder_identity or lease.metadata.name, enabled, at, ann.get(INSTANCE_ANNOTATION, "")
                )
            )
        return out
