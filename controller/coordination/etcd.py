"""Restart slots on etcd v3, through its JSON gateway (the maintained ``etcd3gw`` client).

Slot ``i`` is the key ``<prefix>/slots/<i>``, ``i < max_unavailable``, created only if absent
(a transaction comparing its create_revision with 0) and attached to a lease of ``ttl_s``: the
slot lives exactly as long as etcd keeps the lease, which the holder renews while its restart
runs. A holder that dies stops renewing and etcd deletes the key when the lease runs out, by
etcd's clock alone. Replica states are keys ``<prefix>/replicas/<id>`` (JSON) on a lease of
their own (the same TTL), renewed by every tick's publish: a replica whose controller is gone (a
replaced pod: the replica id is the pod's name) leaves the fleet when etcd drops its lease,
instead of counting in the fleet's size and being named to move for ever.

The gateway's path (``/v3beta/`` on etcd 3.4, ``/v3/`` on 3.5+) is discovered by the client
from the server's /version unless given.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

import requests
import structlog
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_fixed

from controller.coordination.base import CoordinationError, ReplicaState, Slot

log = structlog.get_logger("sd_controller")
T = TypeVar("T")


def _etcd3gw():
    try:
        import etcd3gw
        from etcd3gw import exceptions
        from etcd3gw.lease import Lease
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise CoordinationError("coordination_backend=etcd needs the etcd3gw package (pip install etcd3gw)") from exc
    return etcd3gw, exceptions, Lease


def endpoint_label(url: str) -> str:
    """scheme://host:port of an endpoint: what a log line or an error may show (no credentials)."""
    p = urlsplit(url)
    return f"{p.scheme}://{p.hostname}:{p.port or 2379}"


class EtcdCoordinator:
    """:class:`~controller.coordination.base.Coordinator` on etcd v3.

    ``endpoints``: URLs tried in order until one answers (``http://127.0.0.1:2379``).
    ``ttl_s``: the slot's lease, whole seconds (etcd's unit), at least 2.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        prefix: str = "/sd-controller",
        max_unavailable: int = 1,
        ttl_s: float = 60.0,
        timeout_s: float = 2.0,
        api_path: str | None = None,
        ca_bundle: str | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if not endpoints:
            raise CoordinationError("etcd: no endpoint (setting coordination_endpoints)")
        if max_unavailable < 1:
            raise CoordinationError(f"etcd: max_unavailable must be >= 1, got {max_unavailable}")
        if ttl_s < 2:
            raise CoordinationError(f"etcd: slot TTL must be >= 2 s, got {ttl_s}")
        etcd3gw, self._exc, self._Lease = _etcd3gw()
        self.prefix = "/" + prefix.strip("/")
        self.max_unavailable = max_unavailable
        self.ttl_s = math.ceil(ttl_s)
        self._clients: list[tuple[str, Any]] = []
        self._presence_id: int | None = None  # the lease this replica's published state lives on
        for url in endpoints:
            p = urlsplit(url)
            if p.scheme not in ("http", "https") or not p.hostname:
                raise CoordinationError(f"etcd endpoint {url!r}: expected http(s)://host:port")
            client = etcd3gw.Etcd3Client(
                host=p.hostname,
                port=p.port or 2379,
                protocol=p.scheme,
                ca_cert=ca_bundle,
                timeout=timeout_s,
                api_path=api_path,
            )
            self._clients.append((endpoint_label(url), client))

    # ------------------------------------------------------------------ plumbing
    def _call(self, op: str, fn: Callable[[Any], T]) -> T:
        """``fn(client)`` on the first endpoint that answers; one-line CoordinationError if none."""
        transient = (self._exc.ConnectionFailedError, self._exc.ConnectionTimeoutError, requests.ConnectionError)
        errors: list[str] = []
        for label, client in self._clients:
            attempt = retry(
                retry=retry_if_exception_type(transient),
                stop=stop_after_attempt(2),
                wait=wait_fixed(0.2),
                reraise=True,
            )(fn)
            try:
                return attempt(client)
            except transient as exc:
                errors.append(f"{label}: unreachable ({type(exc).__name__})")
            except self._exc.Etcd3Exception as exc:
                detail = getattr(exc, "detail_text", None) or str(exc)
                raise CoordinationError(f"etcd {label}: {op} refused: {str(detail).splitlines()[0][:160]}") from None
            except (KeyError, ValueError, TypeError, AttributeError) as exc:
                raise CoordinationError(
                    f"etcd {label}: unexpected response to {op}: {type(exc).__name__}: {exc}"
                ) from None
        raise CoordinationError(f"etcd {op}: " + "; ".join(errors))

    def _slot_key(self, i: int) -> str:
        return f"{self.prefix}/slots/{i}"

    def _slots(self, client: Any) -> list[tuple[str, str, str]]:
        """(key, holder, lease id) of every taken slot."""
        out = []
        for value, meta in client.get_prefix(f"{self.prefix}/slots/"):
            out.append((_text(meta["key"]), _text(value), str(meta.get("lease", "0"))))
        return out

    # ------------------------------------------------------------------ protocol
    def acquire(self, holder: str) -> Slot | None:
        def go(client: Any) -> Slot | None:
            taken = self._slots(client)
            for key, h, lease_id in taken:
                if h == holder:  # ours already (a restarted controller with a restart in flight)
                    return Slot(key, holder, lease_id)
            if len(taken) >= self.max_unavailable:
                return None
            lease = client.lease(ttl=self.ttl_s)
            for i in range(self.max_unavailable):
                if client.create(self._slot_key(i), holder, lease=lease):
                    return Slot(self._slot_key(i), holder, str(lease.id))
            lease.revoke()
            return None

        return self._call("acquire", go)

    def keep_alive(self, slot: Slot) -> bool:
        def go(client: Any) -> bool:
            ttl = self._Lease(int(slot.lease_id), client).refresh()
            if ttl <= 0:
                return False
            values = client.get(slot.key)
            return bool(values) and _text(values[0]) == slot.holder

        return self._call("keep_alive", go)

    def release(self, slot: Slot) -> None:
        def go(client: Any) -> None:
            try:
                self._Lease(int(slot.lease_id), client).revoke()
            except self._exc.Etcd3Exception as exc:
                if "not found" not in str(getattr(exc, "detail_text", "") or exc):
                    raise

        self._call("release", go)

    def holders(self) -> list[str]:
        return self._call("holders", lambda c: [h for _, h, _ in self._slots(c)])

    def publish(self, state: ReplicaState) -> None:
        body = json.dumps({"enabled": state.enabled, "published_at": state.published_at, "instance": state.instance})

        def go(client: Any) -> None:
            lease = None if self._presence_id is None else self._Lease(self._presence_id, client)
            if lease is None or lease.refresh() <= 0:  # none yet, or expired (the tick stalled)
                lease = client.lease(ttl=self.ttl_s)
                self._presence_id = int(lease.id)
            client.put(f"{self.prefix}/replicas/{state.replica_id}", body, lease=lease)

        self._call("publish", go)

    def fleet_states(self) -> list[ReplicaState]:
        def go(client: Any) -> list[ReplicaState]:
            out = []
            base = f"{self.prefix}/replicas/"
            for value, meta in client.get_prefix(base):
                key = _text(meta["key"])
                try:
                    doc = json.loads(_text(value))
                    enabled, at, instance = doc["enabled"], float(doc["published_at"]), doc.get("instance", "")
                    if enabled not in (True, False, None):
                        raise ValueError("enabled is not true/false/null")
                    if not isinstance(instance, str):
                        raise ValueError("instance is not a string")
                except (ValueError, KeyError, TypeError, AttributeError) as exc:
                    raise CoordinationError(f"etcd key {key}: not a replica state: {exc}") from None
                out.append(ReplicaState(key.removeprefix(base), enabled, at, instance))
            return out

        return self._call("fleet_states", go)


def _text(v: bytes | str) -> str:
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)
