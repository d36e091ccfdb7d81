"""The coordination settings group and the gate they ask for."""

from __future__ import annotations

import os
import socket
from enum import StrEnum
from pathlib import Path
from typing import Any, Self

import structlog
from pydantic import BaseModel, Field, field_validator, model_validator

from controller.config import GROUP_CONFIG, http_url
from controller.coordination.base import CoordinationError, Coordinator
from controller.coordination.gate import RestartGate
from controller.coordination.none import NoCoordinator
from controller.errors import ConfigError, redact_url
from controller.fleet import FleetRouting

log = structlog.get_logger("sd_controller")
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class CoordinationBackend(StrEnum):
    NONE = "none"
    ETCD = "etcd"
    KUBERNETES = "kubernetes"


class CoordinationSettings(BaseModel):
    """Fleet mode: many replicas, at most max_unavailable restarting at a time (etcd leases or Kubernetes Leases)."""

    model_config = GROUP_CONFIG

    coordination_backend: CoordinationBackend = Field(
        CoordinationBackend.NONE,
        description="none (one replica), etcd (v3 leases) or kubernetes (coordination.k8s.io/v1 Leases, in cluster).",
    )
    coordination_endpoints: list[str] = Field(
        default_factory=list, description='etcd: client URLs tried in order, e.g. ["http://etcd:2379"].'
    )
    coordination_prefix: str = Field(
        "/sd-controller", description="etcd: key prefix; kubernetes: Lease name prefix (one per fleet)."
    )
    coordination_etcd_api_path: str | None = Field(
        None, description="etcd: JSON gateway path (/v3/ on 3.4+, /v3beta/ on 3.3); empty: discovered from /version."
    )
    coordination_ca_bundle: Path | None = Field(None, description="etcd: CA bundle for https endpoints.")
    coordination_timeout_s: float = Field(2.0, gt=0, description="Timeout of one coordination call.")
    kubernetes_namespace: str | None = Field(
        None, description="kubernetes: namespace of the Leases; empty: the pod's own (service account)."
    )
    max_unavailable: int = Field(1, ge=1, le=1000, description="Replicas of the fleet allowed to restart at once.")
    restart_slot_ttl_s: float = Field(
        120.0,
        ge=2,
        le=3600,
        description="Lifetime of a restart slot unless renewed (every tick): a dead holder frees it after this; keep it above a restart's duration.",
    )
    replica_id: str | None = Field(
        None, description="This replica's name in the fleet; empty: $POD_NAME, else the host name."
    )
    fleet_routing: FleetRouting = Field(
        FleetRouting.NONE,
        description="How the router balances the fleet: none (each replica decides alone), rr (round-robin: the fleet goes all on or all off, one replica per dwell) or lor (least outstanding requests: the fleet plans k of N replicas on SD). rr and lor need prometheus_fleet_selector and a coordination backend.",
    )

    @field_validator("coordination_endpoints")
    @classmethod
    def _endpoints(cls, v: list[str]) -> list[str]:
        for url in v:
            try:
                http_url(url)
            except ValueError as exc:
                raise ValueError(f"{redact_url(url)!r}: {exc}") from None
        return v

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.coordination_backend is CoordinationBackend.ETCD and not self.coordination_endpoints:
            raise ValueError("coordination_endpoints is required for coordination_backend=etcd")
        return self


def replica_id(s: CoordinationSettings) -> str:
    return s.replica_id or os.environ.get("POD_NAME") or socket.gethostname()


def build_coordinator(s: CoordinationSettings) -> Coordinator:
    """The backend the settings ask for; ConfigError (one line) when it cannot be built."""
    try:
        if s.coordination_backend is CoordinationBackend.ETCD:
            from controller.coordination.etcd import EtcdCoordinator

            return EtcdCoordinator(
                s.coordination_endpoints,
                prefix=s.coordination_prefix,
                max_unavailable=s.max_unavailable,
                ttl_s=s.restart_slot_ttl_s,
                timeout_s=s.coordination_timeout_s,
                api_path=s.coordination_etcd_api_path or None,
                ca_bundle=str(s.coordination_ca_bundle) if s.coordination_ca_bundle else None,
            )
        if s.coordination_backend is CoordinationBackend.KUBERNETES:
            from controller.coordination.kubernetes import KubernetesLeaseCoordinator

            return KubernetesLeaseCoordinator.in_cluster(
                namespace=s.kubernetes_namespace or _pod_namespace(),
                prefix=s.coordination_prefix,
                max_unavailable=s.max_unavailable,
                ttl_s=s.restart_slot_ttl_s,
                timeout_s=s.coordination_timeout_s,
            )
    except CoordinationError as exc:
        raise ConfigError(f"setting coordination_backend={s.coordination_backend.value}: {exc}") from None
    return NoCoordinator()


def _pod_namespace() -> str:
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text(encoding="utf-8").strip()
    except OSError:
        raise CoordinationError(
            f"no kubernetes_namespace set and {SERVICE_ACCOUNT_NAMESPACE} unreadable (not in a pod?)"
        ) from None


def build_gate(s: Any) -> RestartGate:
    """The restart gate for ``Settings`` ``s`` (the coordination group plus the tick interval).

    The slot is renewed once a tick, so its TTL must outlast a few ticks: a shorter one would
    expire between two renewals of a live holder.
    """
    group = CoordinationSettings.model_validate({f: getattr(s, f) for f in CoordinationSettings.model_fields})
    interval = float(getattr(s, "evaluation_interval_s", 0.0))
    if group.coordination_backend is not CoordinationBackend.NONE and group.restart_slot_ttl_s < 3 * interval:
        raise ConfigError(
            f"setting restart_slot_ttl_s ({group.restart_slot_ttl_s:g}) must be at least 3 × evaluation_interval_s"
            f" ({interval:g}): the slot is renewed once a tick"
        )
    if group.fleet_routing is not FleetRouting.NONE:
        # The plan reads every replica's state from the backend and the fleet's rate from Prometheus.
        if group.coordination_backend is CoordinationBackend.NONE:
            raise ConfigError(
                f"setting fleet_routing={group.fleet_routing.value} needs coordination_backend etcd or kubernetes"
            )
        if not getattr(s, "prometheus_fleet_selector", None):
            raise ConfigError(f"setting fleet_routing={group.fleet_routing.value} needs prometheus_fleet_selector")
    downtime = float(getattr(s, "restart_downtime_s", 0.0))
    if group.coordination_backend is not CoordinationBackend.NONE and group.restart_slot_ttl_s < downtime:
        # A holder that dies as its replica starts restarting frees the slot after the TTL: if
        # that is shorter than the restart, a second replica can go down while the first still is.
        log.warning(
            "slot_ttl_shorter_than_restart",
            restart_slot_ttl_s=group.restart_slot_ttl_s,
            restart_downtime_s=downtime,
            detail="a dead holder's replica may still be restarting when its slot is handed on",
        )
    return RestartGate(build_coordinator(group), replica_id(group), group.coordination_backend.value)
