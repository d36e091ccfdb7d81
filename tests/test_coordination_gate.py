"""The restart gate in the real tick loop, against a real etcd: one restart at a time across
controllers, hold when the backend is unreachable, release after confirm / failure / pending
timeout, a dead holder's slot freed by etcd's TTL whatever the controllers' clocks say."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import structlog
from prometheus_client import CollectorRegistry

from controller.config import OverrideMode
from controller.coordination.etcd import EtcdCoordinator
from controller.coordination.gate import RestartGate
from controller.coordination.none import NoCoordinator
from controller.errors import ConfigError
from controller.loop import Controller
from controller.policy import Action, Reason
from controller.settings import Settings
from controller.sources.vllm_metrics import VllmMetricsSource
from controller.state_store import MemoryStateStore
from tests.support import LEGACY_CALIBRATION
from tests.support.fake_vllm import FakeVllmServer
from tests.test_loop import MODEL, T0, Clock, FakeLauncher

TTL_S = 2


def replica(etcd, name, clock_offset_s=0.0, restart_s=90.0, coordinator=None, **settings_kw):
    """A controller told to switch SD off now (operator override), with a gate on etcd."""
    clock = Clock(T0 + clock_offset_s)
    vllm = FakeVllmServer(clock=clock)
    hook = FakeLauncher(clock, vllm, restart_s=restart_s)
    kw = dict(calibration_file=LEGACY_CALIBRATION, price_switches=False, override="off", pending_timeout_s=600)
    kw.update(settings_kw)
    settings = Settings(**kw)
    coord = coordinator or EtcdCoordinator([etcd.url], prefix="/gate", ttl_s=TTL_S, timeout_s=0.5)
    gate = RestartGate(coord, name, "etcd")
    notices = []
    ctl = Controller(
        settings, MODEL, VllmMetricsSource(fetch=vllm.render), hook, clock, registry=CollectorRegistry(),
        state_store=MemoryStateStore(), gate=gate, notify=lambda ev, p: notices.append(ev),
    )  # fmt: skip
    ctl.notices = notices
    return ctl, clock, hook


def waits(ctl, reason):
    return ctl.registry.get_sample_value("sd_controller_restart_slot_waits_total", {"reason": reason.value})


def test_two_controllers_restart_one_after_the_other(etcd_server):
    a, ca, _ha = replica(etcd_server, "r1")
    b, cb, hb = replica(etcd_server, "r2")
    ra = a.tick()
    assert ra.acted and ra.decision.action is Action.DISABLE
    assert a.registry.get_sample_value("sd_controller_restart_slot_held") == 1
    with structlog.testing.capture_logs() as logs:
        rb = b.tick()
    assert not rb.acted and hb.requests == []
    assert rb.decision.reason is Reason.SLOT_BUSY and "r1" in rb.decision.detail
    assert rb.decision.action is Action.NONE and rb.decision.desired_enabled is False
    assert waits(b, Reason.SLOT_BUSY) == 1
    assert [e["reason"] for e in logs if e["event"] == "decision"] == ["restart_slot_busy"]
    ca.t += 30
    assert a.tick().state.pending is not None  # still restarting: slot kept alive
    assert not b.tick().acted
    ca.t += 61  # a's restart is done: confirmed, slot released on that tick
    ra = a.tick()
    assert "change_confirmed:off" in map(str, ra.events)
    assert a.registry.get_sample_value("sd_controller_restart_slot_held") == 0
    cb.t += 60
    rb = b.tick()
    assert rb.acted and len(hb.requests) == 1
    assert waits(b, Reason.SLOT_BUSY) == 2


def test_backend_unreachable_means_no_restart(etcd_server):
    a, _, ha = replica(etcd_server, "r1")
    etcd_server.stop()
    for _ in range(3):
        r = a.tick()
        assert not r.acted and r.decision.reason is Reason.COORDINATION_UNAVAILABLE
    assert ha.requests == []
    assert waits(a, Reason.COORDINATION_UNAVAILABLE) == 3
    assert a.registry.get_sample_value("sd_controller_coordination_errors_total", {"op": "acquire"}) == 3
    assert "unreachable" in r.decision.detail
    etcd_server.start()
    assert a.tick().acted


def test_a_slot_remembered_but_unconfirmable_admits_no_new_restart(etcd_server):
    """A change confirmed and a new one wanted in the same tick, etcd down: the slot held in
    memory is not proof; hold. (Found by the fleet test: a replica restarted with etcd down.)"""
    a, ca, ha = replica(etcd_server, "r1", restart_s=5)
    assert a.tick().acted
    etcd_server.stop()
    ca.t += 10
    a.override = lambda: OverrideMode.ON
    r = a.tick()
    assert "change_confirmed:off" in map(str, r.events)
    assert not r.acted and r.decision.reason is Reason.COORDINATION_UNAVAILABLE
    assert len(ha.requests) == 1
    etcd_server.start()
    ca.t += 1
    assert a.tick().acted


def test_a_replica_that_never_comes_back_frees_its_slot_after_the_pending_timeout(etcd_server):
    a, ca, _ha = replica(etcd_server, "r1", restart_s=10_000, pending_timeout_s=120)
    b, cb, _hb = replica(etcd_server, "r2")
    assert a.tick().acted
    assert not b.tick().acted
    ca.t += 121
    ra = a.tick()
    assert "change_failed:timeout" in map(str, ra.events) and "change_failed" in a.notices  # reported
    assert a.registry.get_sample_value("sd_controller_restart_slot_held") == 0
    cb.t += 60
    assert b.tick().acted


def test_a_refused_request_releases_the_slot_in_the_same_tick(etcd_server):
    a, _, ha = replica(etcd_server, "r1")
    b, _, _ = replica(etcd_server, "r2")
    ha.restart_until = 1e18  # the fake launcher answers 409: restart in progress
    r = a.tick()
    assert not r.acted and any(str(e).startswith("change_failed:hook_refused") for e in r.events)
    assert b.tick().acted


def test_slot_ttl_lives_in_etcd_not_in_the_controllers_clocks(etcd_server):
    """The holder's clock is an hour behind, the waiter's a day ahead: the waiter still cannot
    take a live slot, and gets a dead holder's slot only once etcd expires its lease."""
    a, ca, _ = replica(etcd_server, "r1", clock_offset_s=-3600)
    b, cb, hb = replica(etcd_server, "r2", clock_offset_s=+86_400)
    assert a.tick().acted
    for _ in range(5):  # a lives, renewing each tick; b's clock races ahead by 10 min a tick
        ca.t += 1
        cb.t += 600
        a.tick()
        assert b.tick().decision.reason is Reason.SLOT_BUSY
        time.sleep(0.5)
    assert hb.requests == []  # 2.5 s of real time, past the TTL: renewal, not anyone's clock, kept it
    t0 = time.monotonic()  # a stops ticking: dead without releasing
    while not b.tick().acted:
        assert time.monotonic() - t0 < TTL_S + 4, "the dead holder's slot was never freed"
        time.sleep(0.2)
    assert time.monotonic() - t0 <= TTL_S + 1.5


def test_a_killed_holder_process_loses_its_slot_within_the_ttl(etcd_server):
    code = (
        "import sys, time\n"
        "from controller.coordination.etcd import EtcdCoordinator\n"
        f"c = EtcdCoordinator([{etcd_server.url!r}], prefix='/gate', ttl_s={TTL_S})\n"
        "assert c.acquire('victim') is not None\n"
        "print('held', flush=True)\n"
        "for _ in range(600):\n"
        "    c.keep_alive(c.acquire('victim')); time.sleep(0.3)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "held"
        time.sleep(TTL_S + 0.5)  # alive past one TTL: renewing works
        other = EtcdCoordinator([etcd_server.url], prefix="/gate", ttl_s=TTL_S)
        assert other.acquire("r2") is None
        proc.send_signal(signal.SIGKILL)
        proc.wait(5)
        t0 = time.monotonic()
        while other.acquire("r2") is None:
            assert time.monotonic() - t0 < TTL_S + 4
            time.sleep(0.1)
        assert time.monotonic() - t0 <= TTL_S + 1.5
    finally:
        proc.kill()
        proc.wait(5)


def test_a_restarted_controller_takes_a_slot_for_its_restart_in_flight(etcd_server):
    a, _ca, _ = replica(etcd_server, "r1")
    assert a.tick().acted
    # The process restarts: the state (pending change) survives, the gate's memory does not.
    a2, _ca2, ha2 = replica(
        etcd_server, "r1", coordinator=EtcdCoordinator([etcd_server.url], prefix="/gate", ttl_s=TTL_S)
    )
    a2.state = a.state
    ha2.restart_until = 1e18
    # Its predecessor's slot is not its own (it could be a live twin): it waits out etcd's TTL.
    a2.tick()
    assert a2.gate.slot is None and a2.gate._holders() == ["r1"]
    deadline = time.monotonic() + TTL_S + 5
    while a2.gate.slot is None and time.monotonic() < deadline:
        time.sleep(0.2)
        a2.tick()
    assert a2.gate.slot is not None and a2.gate.slot.holder == a2.gate.holder and a2.gate.holder.startswith("r1#")
    # Its predecessor's state on its key is no twin.
    assert a2.registry.get_sample_value("sd_controller_duplicate_replica_id") == 0


def test_two_controllers_given_one_replica_id_restart_one_at_a_time_and_say_so(etcd_server):
    """A shared env file gives two pods one replica id: each took "its own" slot and both
    restarted at once, past max_unavailable, unnoticed."""
    a, ca, ha = replica(etcd_server, "r1")
    b, cb, hb = replica(etcd_server, "r1")
    assert a.tick().acted
    with structlog.testing.capture_logs() as logs:
        rb = b.tick()
    assert not rb.acted and rb.decision.reason is Reason.SLOT_BUSY and hb.requests == []
    for _ in range(2):  # each sees the other's writes on its key from its second tick on
        ca.t += 10
        cb.t += 10
        a.tick()
        with structlog.testing.capture_logs() as more:
            b.tick()
        logs += more
    assert a.registry.get_sample_value("sd_controller_duplicate_replica_id") == 1
    assert b.registry.get_sample_value("sd_controller_duplicate_replica_id") == 1
    dup = [e for e in logs if e["event"] == "duplicate_replica_id"]
    assert len(dup) == 1 and dup[0]["other_instance"] == a.gate.instance  # logged once, not every tick
    assert len(ha.requests) == 1 and hb.requests == []


def test_dry_run_never_asks_for_a_slot(etcd_server):
    a, _, _ha = replica(etcd_server, "r1")
    a.dry_run = True
    b, _, _ = replica(etcd_server, "r2")
    r = a.tick()
    assert r.decision.acts and not r.acted  # it would act; nothing is taken
    assert b.tick().acted


def test_applied_states_are_published_for_the_fleet(etcd_server):
    a, ca, _ = replica(etcd_server, "r1", restart_s=5)
    a.tick()
    ca.t += 10
    a.tick()
    coord = EtcdCoordinator([etcd_server.url], prefix="/gate", ttl_s=TTL_S)
    [st] = coord.fleet_states()
    assert st.replica_id == "r1" and st.enabled is False
    # Published every tick, changed or not: a state the backend lost is back with the next one.
    import etcd3gw

    etcd3gw.Etcd3Client(host="127.0.0.1", port=etcd_server.port).delete_prefix("/gate/replicas/")
    assert coord.fleet_states() == []
    ca.t += 60
    a.tick()
    assert [s.replica_id for s in coord.fleet_states()] == ["r1"]


def test_the_none_backend_always_admits():
    ctl, _, hook = replica(None, "solo", coordinator=NoCoordinator())
    assert ctl.tick().acted and len(hook.requests) == 1


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"coordination_backend": "etcd"}, "coordination_endpoints is required"),
        ({"coordination_backend": "etcd", "coordination_endpoints": ["etcd:2379"]}, "coordination_endpoints"),
        ({"coordination_backend": "zookeeper"}, "coordination_backend"),
        ({"max_unavailable": 0}, "max_unavailable"),
        (
            {"coordination_backend": "etcd", "coordination_endpoints": ["http://127.0.0.1:1"], "restart_slot_ttl_s": 5,
             "evaluation_interval_s": 60},
            "restart_slot_ttl_s",
        ),
        ({"fleet_routing": "lor"}, "fleet_routing=lor needs coordination_backend etcd or kubernetes"),
        (
            {"fleet_routing": "rr", "coordination_backend": "etcd", "coordination_endpoints": ["http://127.0.0.1:1"],
             "restart_slot_ttl_s": 600},
            "fleet_routing=rr needs prometheus_fleet_selector",
        ),
        ({"fleet_routing": "random"}, "fleet_routing"),
    ],
)  # fmt: skip
def test_bad_coordination_settings_name_the_setting(kw, needle):
    from controller.coordination.setup import build_gate
    from controller.settings import load_settings

    with pytest.raises(ConfigError, match=needle) as err:
        build_gate(load_settings(calibration_file=LEGACY_CALIBRATION, **kw))
    assert "\n" not in str(err.value)


def test_when_a_replica_changed_is_read_on_the_observers_clock():
    """A replica whose clock ran an hour ahead published its change "in the future": every
    other replica saw it within the dwell for the hour, and the fleet's plan held as long."""
    from controller.coordination.base import ReplicaState
    from controller.sim.coordinator import InProcessCoordinator

    now = 1_800_000_000.0
    coord = InProcessCoordinator(1, 600.0, clock=lambda: now)
    gate = RestartGate(coord, "observer")
    coord.publish(ReplicaState("ahead", True, now + 3600.0))  # its change, by its clock
    coord.publish(ReplicaState("behind", False, now - 7200.0))  # changed long ago (or its clock lags)
    _, changed = gate.fleet_view(True, now)
    assert changed == {"ahead": now, "behind": now - 7200.0}  # the future is "now", the past as written
    now += 400.0  # past the dwell on this clock
    _, changed = gate.fleet_view(True, now)
    assert changed["ahead"] == now - 400.0
    coord.publish(ReplicaState("behind", True, now - 7000.0))  # a change seen live: it happened by now
    _, changed = gate.fleet_view(True, now)
    assert changed["behind"] == now
