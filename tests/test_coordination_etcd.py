"""The etcd backend against a real etcd (Debian's etcd-server on 127.0.0.1): slots, leases,
takeover after a holder dies, the backend unreachable, bad responses, replica states."""

from __future__ import annotations

import json
import time

import pytest

from controller.coordination.base import CoordinationError, ReplicaState
from controller.coordination.etcd import EtcdCoordinator
from tests.support.prometheus import free_port


def coordinator(etcd, **kw) -> EtcdCoordinator:
    kw.setdefault("ttl_s", 3)
    kw.setdefault("timeout_s", 1.0)
    return EtcdCoordinator([etcd.url], prefix="/t", **kw)


def test_one_slot_goes_to_one_holder_at_a_time(etcd_server):
    a, b = coordinator(etcd_server), coordinator(etcd_server)
    slot = a.acquire("r1")
    assert slot is not None and slot.holder == "r1"
    assert b.acquire("r2") is None
    assert a.holders() == ["r1"]
    assert a.acquire("r1") == slot  # asking again returns the slot it holds
    a.release(slot)
    assert b.acquire("r2") is not None
    assert a.holders() == ["r2"]


def test_max_unavailable_slots_and_no_more(etcd_server):
    c = [coordinator(etcd_server, max_unavailable=2) for _ in range(4)]
    got = [x.acquire(f"r{i}") for i, x in enumerate(c)]
    assert [g is not None for g in got] == [True, True, False, False]
    assert sorted(c[0].holders()) == ["r0", "r1"]
    assert {g.key for g in got if g} == {"/t/slots/0", "/t/slots/1"}


def test_release_is_idempotent_and_keep_alive_reports_a_lost_slot(etcd_server):
    a = coordinator(etcd_server)
    slot = a.acquire("r1")
    assert a.keep_alive(slot)
    a.release(slot)
    a.release(slot)  # a revoked lease is not an error
    assert not a.keep_alive(slot)


def test_a_holder_that_stops_renewing_loses_the_slot_within_its_ttl(etcd_server):
    a, b = coordinator(etcd_server, ttl_s=2), coordinator(etcd_server, ttl_s=2)
    assert a.acquire("r1") is not None
    t0 = time.monotonic()
    while b.acquire("r2") is None:
        assert time.monotonic() - t0 < 6, "the dead holder's slot never expired"
        time.sleep(0.1)
    waited = time.monotonic() - t0
    assert waited <= 2 + 1.5  # TTL plus etcd's expiry granularity
    assert a.holders() == ["r2"]


def test_renewing_keeps_the_slot_beyond_its_ttl(etcd_server):
    a, b = coordinator(etcd_server, ttl_s=2), coordinator(etcd_server, ttl_s=2)
    slot = a.acquire("r1")
    end = time.monotonic() + 4.5
    while time.monotonic() < end:
        assert a.keep_alive(slot)
        assert b.acquire("r2") is None
        time.sleep(0.5)


def test_unreachable_backend_is_a_one_line_coordination_error():
    c = EtcdCoordinator([f"http://127.0.0.1:{free_port()}"], timeout_s=0.5, api_path="/v3beta/")
    with pytest.raises(CoordinationError) as err:
        c.acquire("r1")
    msg = str(err.value)
    assert "unreachable" in msg and "127.0.0.1" in msg and "\n" not in msg


def test_the_next_endpoint_answers_when_the_first_is_down(etcd_server):
    c = EtcdCoordinator([f"http://127.0.0.1:{free_port()}", etcd_server.url], timeout_s=0.5)
    assert c.acquire("r1") is not None


def test_a_stopped_etcd_is_unreachable_and_a_restarted_one_answers(etcd_server):
    c = coordinator(etcd_server)
    slot = c.acquire("r1")
    etcd_server.stop()
    with pytest.raises(CoordinationError):
        c.keep_alive(slot)
    etcd_server.start()
    assert c.holders() in (["r1"], [])  # the lease may have run out while etcd was down


def test_credentials_in_an_endpoint_never_reach_the_error():
    c = EtcdCoordinator([f"http://user:s3cret@127.0.0.1:{free_port()}"], timeout_s=0.5, api_path="/v3beta/")
    with pytest.raises(CoordinationError) as err:
        c.holders()
    assert "s3cret" not in str(err.value)


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"endpoints": []}, "no endpoint"),
        ({"endpoints": ["etcd:2379"]}, "expected http(s)://host:port"),
        ({"endpoints": ["http://127.0.0.1:2379"], "max_unavailable": 0}, "max_unavailable"),
        ({"endpoints": ["http://127.0.0.1:2379"], "ttl_s": 1}, "TTL"),
    ],
)
def test_bad_configuration_names_what_is_wrong(kw, needle):
    with pytest.raises(CoordinationError, match="^etcd.*" + needle.replace("(", r"\(").replace(")", r"\)")):
        EtcdCoordinator(**kw)


def test_replica_states_round_trip(etcd_server):
    a, b = coordinator(etcd_server), coordinator(etcd_server)
    a.publish(ReplicaState("r1", True, 10.0))
    b.publish(ReplicaState("r2", None, 11.0))
    a.publish(ReplicaState("r1", False, 12.0, "1f2e3d"))
    assert sorted(a.fleet_states(), key=lambda s: s.replica_id) == [
        ReplicaState("r1", False, 12.0, "1f2e3d"),
        ReplicaState("r2", None, 11.0),
    ]


def test_a_malformed_replica_state_names_its_key(etcd_server):
    import etcd3gw

    raw = etcd3gw.Etcd3Client(host="127.0.0.1", port=etcd_server.port)
    raw.put("/t/replicas/r9", json.dumps({"enabled": "yes", "published_at": 1}))
    with pytest.raises(CoordinationError, match=r"^etcd key /t/replicas/r9: not a replica state"):
        coordinator(etcd_server).fleet_states()


@pytest.mark.parametrize(
    ("path", "answer", "needle"),
    [
        ("/version", {"nope": 1}, "refused"),  # not an etcd: no server version to pick the gateway path (3.4+ -> /v3/)
        ("/v3/kv/range", {"kvs": "not a list"}, "unexpected response to holders"),
        ("/v3/kv/range", {"kvs": [{"value": "eA=="}]}, "unexpected response to holders"),
    ],
)
def test_a_gateway_that_answers_nonsense_is_a_one_line_error(path, answer, needle):
    from tests.support.stub_http import StubHttp

    def respond(method, got, body):
        if got == path:
            return 200, "application/json", json.dumps(answer).encode()
        return 200, "application/json", json.dumps({"etcdserver": "3.4.23", "etcdcluster": "3.4.0"}).encode()

    with StubHttp(respond) as stub:
        c = EtcdCoordinator([stub.url], timeout_s=0.5)
        with pytest.raises(CoordinationError) as err:
            c.holders()
    msg = str(err.value)
    assert msg.startswith(f"etcd {stub.url}") and needle in msg and "\n" not in msg


def test_a_replica_whose_controller_is_gone_leaves_the_fleet_within_its_ttl(etcd_server):
    """The replica id is the pod's name: a replaced pod's key, kept for ever, counted in the
    fleet's size and named to move, held the fleet's plan for good."""
    live, gone = coordinator(etcd_server, ttl_s=2), coordinator(etcd_server, ttl_s=2)
    live.publish(ReplicaState("vllm-a", True, 1.0))
    gone.publish(ReplicaState("vllm-old", True, 1.0))
    assert {s.replica_id for s in live.fleet_states()} == {"vllm-a", "vllm-old"}
    deadline = time.monotonic() + 10
    while {s.replica_id for s in live.fleet_states()} != {"vllm-a"} and time.monotonic() < deadline:
        live.publish(ReplicaState("vllm-a", True, 1.0))  # every tick's publish renews its own
        time.sleep(0.5)
    assert {s.replica_id for s in live.fleet_states()} == {"vllm-a"}
    # A state the backend lost (keys wiped) is back with the next publish.
    import etcd3gw

    etcd3gw.Etcd3Client(host="127.0.0.1", port=etcd_server.port).delete_prefix("/t/replicas/")
    assert live.fleet_states() == []
    live.publish(ReplicaState("vllm-a", False, 2.0))
    assert live.fleet_states() == [ReplicaState("vllm-a", False, 2.0)]
