"""The Kubernetes Lease backend through the official client, against a small fake of the
Lease REST API over real HTTP on 127.0.0.1 (tests/support/fake_lease_api.py). No real API
server runs here; what the fake does not model (auth, RBAC enforcement, watches) is untested."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from controller.coordination.base import CoordinationError, ReplicaState
from controller.coordination.kubernetes import KubernetesLeaseCoordinator
from tests.support.fake_lease_api import FakeLeaseApi
from tests.support.prometheus import free_port

ROOT = Path(__file__).resolve().parents[1]


class Monotonic:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def coordinator(url, monotonic=None, **kw):
    from kubernetes import client

    cfg = client.Configuration()
    cfg.host = url
    cfg.retries = 0
    api = client.CoordinationV1Api(client.ApiClient(cfg))
    kw.setdefault("ttl_s", 10)
    return KubernetesLeaseCoordinator(api, "llm", prefix="/sd-controller", monotonic=monotonic or Monotonic(), **kw)


@pytest.fixture
def lease_api():
    with FakeLeaseApi() as api:
        yield api


def test_one_slot_one_holder_then_the_next(lease_api):
    a, b = coordinator(lease_api.url), coordinator(lease_api.url)
    slot = a.acquire("r1")
    assert slot is not None and slot.key == "sd-controller-slot-0"
    assert b.acquire("r2") is None
    assert a.acquire("r1") == slot
    assert b.holders() == ["r1"]
    a.release(slot)
    assert b.acquire("r2") is not None
    assert lease_api.leases[("llm", "sd-controller-slot-0")]["spec"]["holderIdentity"] == "r2"


def test_max_unavailable_slots(lease_api):
    got = [coordinator(lease_api.url, max_unavailable=2).acquire(f"r{i}") for i in range(3)]
    assert [g is not None for g in got] == [True, True, False]


def test_a_dead_holder_loses_the_slot_after_its_duration_on_the_observers_clock(lease_api):
    """Expiry is judged on how long the record stayed unchanged by the waiter's monotonic
    clock, not on renewTime (written by the holder's wall clock, possibly skewed)."""
    a = coordinator(lease_api.url)
    slot = a.acquire("r1")
    lease_api.leases[("llm", slot.key)]["spec"]["renewTime"] = "2001-01-01T00:00:00.000000Z"  # a skewed holder
    clock = Monotonic()
    b = coordinator(lease_api.url, monotonic=clock)
    assert b.acquire("r2") is None  # first sight: never expired, whatever renewTime says
    clock.t += 8
    assert a.keep_alive(slot)  # a renews: the record changes, b's observation restarts
    assert b.acquire("r2") is None
    clock.t += 8
    assert b.acquire("r2") is None  # 8 s since the renewal < 10 s
    clock.t += 3
    got = b.acquire("r2")  # 11 s unchanged: expired
    assert got is not None and got.holder == "r2"
    assert not a.keep_alive(slot)  # a learns it lost it


def test_a_stale_write_loses_the_race(lease_api):
    a, b = coordinator(lease_api.url), coordinator(lease_api.url)
    slot = a.acquire("r1")
    stale = lease_api.leases[("llm", slot.key)]["metadata"]["resourceVersion"]
    assert a.keep_alive(slot)  # the record moves on
    assert b._replace(slot.key, "r2", stale) is False  # 409: b does not get it
    assert lease_api.leases[("llm", slot.key)]["spec"]["holderIdentity"] == "r1"


def test_replica_states_round_trip_and_bad_annotations_name_the_lease(lease_api):
    a = coordinator(lease_api.url)
    a.publish(ReplicaState("vllm-abc", True, 5.0))
    a.publish(ReplicaState("vllm-abc", False, 6.0, "1f2e3d"))
    a.publish(ReplicaState("vllm-def", None, 7.0))
    assert sorted(a.fleet_states(), key=lambda s: s.replica_id) == [
        ReplicaState("vllm-abc", False, 6.0, "1f2e3d"),
        ReplicaState("vllm-def", None, 7.0),
    ]
    lease_api.leases[("llm", "sd-controller-replica-vllm-def")]["metadata"]["annotations"][
        "sd-controller.io/applied-enabled"
    ] = "maybe"
    with pytest.raises(CoordinationError, match=r"^kubernetes lease llm/sd-controller-replica-vllm-def: annotation"):
        a.fleet_states()


def test_server_errors_and_an_unreachable_server_are_one_line_errors(lease_api):
    a = coordinator(lease_api.url)
    lease_api.fail_with = 500
    with pytest.raises(CoordinationError, match=r"^kubernetes lease llm/sd-controller-slot-0: read: HTTP 500"):
        a.acquire("r1")
    down = coordinator(f"http://127.0.0.1:{free_port()}", timeout_s=0.5)
    with pytest.raises(CoordinationError) as err:
        down.acquire("r1")
    assert "unreachable" in str(err.value) and "\n" not in str(err.value)


def test_the_fleet_overlays_role_allows_every_verb_the_backend_uses(lease_api):
    a, b = coordinator(lease_api.url), coordinator(lease_api.url)
    slot = a.acquire("r1")
    b.acquire("r2")
    a.keep_alive(slot)
    a.holders()
    a.release(slot)
    a.publish(ReplicaState("r1", True, 1.0))
    a.publish(ReplicaState("r1", False, 2.0))
    a.fleet_states()
    used = set(lease_api.verbs)
    assert used >= {"get", "list", "create", "update"}
    docs = list(yaml.safe_load_all((ROOT / "deploy/kubernetes/overlays/fleet/rbac.yaml").read_text()))
    [role] = [d for d in docs if d["kind"] == "Role"]
    [rule] = role["rules"]
    assert rule["apiGroups"] == ["coordination.k8s.io"] and rule["resources"] == ["leases"]
    assert used <= set(rule["verbs"]), used - set(rule["verbs"])


def test_a_replica_lease_left_unrenewed_for_its_duration_leaves_the_fleet(lease_api):
    clock = Monotonic()
    live, gone = coordinator(lease_api.url, monotonic=clock), coordinator(lease_api.url)
    live.publish(ReplicaState("vllm-a", True, 1.0))
    gone.publish(ReplicaState("vllm-old", True, 1.0))
    assert {s.replica_id for s in live.fleet_states()} == {"vllm-a", "vllm-old"}
    for _ in range(3):  # ticks of 6 s, each renewing its own; the old pod's lease is never renewed
        clock.t += 6
        live.publish(ReplicaState("vllm-a", True, 1.0))
        seen = {s.replica_id for s in live.fleet_states()}
    assert seen == {"vllm-a"}  # unchanged for 12 s > its 10 s, by this controller's clock
