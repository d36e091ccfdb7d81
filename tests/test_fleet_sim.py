"""The simulated fleet: a router in front of N truth engines, N real controllers, one clock.

Who restarts is read from the replicas (the fleet's engines), never from the controllers.
Scenarios are compressed (tens of simulated minutes) so each test stays well under a minute.
"""

from __future__ import annotations

import itertools
import logging

import numpy as np
import pytest
import structlog

from controller.coordination.base import ReplicaState
from controller.sim import demo_truth, scenarios
from controller.sim.coordinator import InProcessCoordinator
from controller.sim.decisions import truth_costs
from controller.sim.engine import Phase
from controller.sim.fleet import Fleet
from controller.sim.fleet_runner import run_fleet_controllers, run_fleet_static
from controller.sim.router import Router
from controller.sim.runner import default_settings
from controller.sim.workload import Constant


@pytest.fixture(autouse=True)
def _quiet():
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))


def scenario(rate_rps: float, duration_s: float, downtime_s: float = 30.0):
    """demo-day's request mix on the truth's scheduler at a constant per-replica rate."""
    sc = demo_truth.truth_scenario(scenarios.load("demo-day"))
    return sc.with_changes(
        duration_s=duration_s,
        arrival_rate=Constant(kind="constant", value=rate_rps),
        engine={"restart_downtime_s": downtime_s, "restart_jitter_s": 0.0, "drain_limit_s": 10.0},
    )


def calibration_model():
    from controller import calibration

    return calibration.load(demo_truth.truth_calibration_path()).latency_model()


# ------------------------------------------------------------------------------ router
def test_round_robin_takes_turns_across_ticks_and_skips_replicas_not_ready():
    r = Router("rr")
    assert r.assign(5, [True, True, True], [0, 0, 0]).tolist() == [0, 1, 2, 0, 1]
    assert r.assign(2, [True, True, True], [0, 0, 0]).tolist() == [2, 0]
    assert r.assign(4, [True, False, True], [0, 0, 0]).tolist() == [2, 0, 2, 0]  # rotation kept
    assert set(r.assign(6, [False, False, False], [0, 0, 0]).tolist()) == {0, 1, 2}  # none ready: all


def test_least_outstanding_fills_the_emptiest_first_and_shares_ties():
    r = Router("lor")
    assert r.assign(4, [True, True, True], [5, 2, 3]).tolist() == [1, 2, 1, 2]  # 2 -> 3 ties with 3: turns
    picks = r.assign(30, [True, True, True], [0, 0, 0]).tolist()
    assert [picks.count(i) for i in range(3)] == [10, 10, 10]
    assert 1 not in r.assign(10, [True, False, True], [9, 0, 9]).tolist()


def test_an_unknown_router_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"router 'random': expected one of rr, lor"):
        Router("random")


# ------------------------------------------------------------------------------ coordinator
def test_in_process_slots_are_limited_and_expire_on_the_shared_clock():
    now = [0.0]
    c = InProcessCoordinator(2, 10.0, lambda: now[0])
    a, b = c.acquire("a"), c.acquire("b")
    assert a and b and c.acquire("c") is None and sorted(c.holders()) == ["a", "b"]
    assert c.acquire("a") == a  # the one it holds
    now[0] = 8.0
    assert c.keep_alive(a)  # renewed to 18
    now[0] = 12.0
    assert c.holders() == ["a"]  # b expired at 10
    assert not c.keep_alive(b)
    assert c.acquire("c") is not None
    c.release(a)
    c.release(a)  # idempotent
    assert c.holders() == ["c"] and c.max_held == 2
    c.publish(ReplicaState("b", False, 1.0))
    c.publish(ReplicaState("a", True, 2.0))
    assert [s.replica_id for s in c.fleet_states()] == ["a", "b"]


# ------------------------------------------------------------------------------ the fleet
def test_the_router_splits_one_arrival_stream_and_every_request_is_accounted_for():
    sc = scenario(6.0, 600.0)
    fleet = Fleet(sc, truth_costs(), 3, Router("rr"), initial_sd=False)
    fleet.advance_to(sc.duration_s)
    counts = [e.arrived for e in fleet.engines]
    assert max(counts) - min(counts) <= 1  # round-robin by count
    assert sum(counts) == pytest.approx(3 * 6.0 * 600.0, rel=0.05)
    for e in fleet.engines:
        t = e.totals()
        assert t.arrived == t.finished + t.running + t.waiting + t.lost


def test_every_fleet_sees_the_same_arrivals():
    sc = scenario(6.0, 300.0)
    on = run_fleet_static(sc, truth_costs(), 3, "lor", True)
    off = run_fleet_static(sc, truth_costs(), 3, "lor", False)
    arr_on, _ = on.fleet.latencies()
    arr_off, _ = off.fleet.latencies()
    assert np.array_equal(np.sort(arr_on), np.sort(arr_off))


def test_least_outstanding_sends_less_to_the_slower_replica():
    # 12 req/s per replica is past SD's break-even on the truth: the SD replica is the slow one.
    sc = scenario(12.0, 900.0)
    lor = Fleet(sc, truth_costs(), 3, Router("lor"), initial_sd=[True, False, False])
    rr = Fleet(sc, truth_costs(), 3, Router("rr"), initial_sd=[True, False, False])
    lor.advance_to(sc.duration_s)
    rr.advance_to(sc.duration_s)
    sd, plain = lor.engines[0].arrived, np.mean([e.arrived for e in lor.engines[1:]])
    assert sd < 0.97 * plain
    assert abs(rr.engines[0].arrived - np.mean([e.arrived for e in rr.engines[1:]])) <= 1


def test_a_restarting_replica_gets_no_arrivals_while_the_others_carry_them():
    sc = scenario(6.0, 400.0, downtime_s=60.0)
    fleet = Fleet(sc, truth_costs(), 3, Router("rr"), initial_sd=False)
    fleet.advance_to(100.0)
    e0 = fleet.engines[0]
    e0.request_restart(True, None)
    before = e0.arrived
    fleet.advance_to(130.0)
    assert e0.phase is not Phase.READY and e0.arrived == before
    assert fleet.max_unavailable_seen == 1
    fleet.advance_to(400.0)
    assert e0.phase is Phase.READY and e0.applied.enabled and e0.arrived > before


def test_fleet_rate_is_the_sum_of_the_replicas_completions():
    sc = scenario(5.0, 400.0)
    fleet = Fleet(sc, truth_costs(), 2, Router("rr"), initial_sd=False)
    for t in range(60, 420, 60):
        fleet.advance_to(float(t))
        fleet.record_completions()
    rate, serving = fleet.fleet_rate(120.0)
    assert rate == pytest.approx(10.0, rel=0.15) and serving == 2
    assert Fleet(sc, truth_costs(), 2, Router("rr")).fleet_rate(60.0) is None  # no window yet


# ------------------------------------------------------------------------------ controllers
def _restart_starts(result):
    return sorted(t0 for e in result.fleet.engines for t0, *_ in e.restart_log)


@pytest.mark.parametrize("router", ["rr", "lor"])
def test_a_fleet_pushed_to_switch_at_once_moves_one_replica_per_dwell(router):
    # Launched with SD on at 10.5 req/s per replica (past break-even): every controller wants
    # off, and three replicas can carry the fourth's share while it restarts.
    sc = scenario(10.5, 1500.0)
    r = run_fleet_controllers(sc, truth_costs(), calibration_model(), 4, router)
    assert r.fleet.max_unavailable_seen == 1  # observed from the replicas
    restarts = [x for e in r.fleet.engines for x in e.restart_log]
    assert len(restarts) >= 2 and not any(enabled for _, _, enabled, _ in restarts)  # toward off, never back
    acts = [(d.t, d.reason) for ticks in r.ticks for d in ticks if d.action != "none"]
    planned = [t for t, why in acts if why == "fleet_plan"]
    dwell = r.controllers[0].settings.dwell_s
    assert len(planned) >= 2 and all(b - a >= dwell for a, b in itertools.pairwise(planned)), acts
    sd = sum(e.applied.enabled for e in r.fleet.engines)
    exported = [c.registry.get_sample_value("sd_controller_fleet_sd_replicas") for c in r.controllers]
    assert exported == [sd] * 4  # every controller exports the fleet's k
    # A safety rule may act outside the plan's rhythm; nothing else does.
    assert {why for _, why in acts} <= {"fleet_plan", "observed_sd_harm", "queue_growth"}
    # The plan's mover is the highest-ranked replica still on, not whoever ticked first.
    on = [True] * 4
    for ticks in r.ticks:
        for i, d in enumerate(ticks):
            if d.action != "none":
                if d.reason == "fleet_plan":
                    assert i == max(j for j in range(4) if on[j]), (d.t, i, on)
                on[i] = False


def test_without_the_plan_the_slots_alone_bound_simultaneous_restarts():
    sc = scenario(12.0, 1500.0)
    # Every replica wants SD off from the first ticks on; without the load's age weighed (a
    # load minutes old vouches for little), they all want it at once: what binds is the slots.
    settings = default_settings(replicas=3, fleet_routing="none", load_age_prior=False)
    one = run_fleet_controllers(sc, truth_costs(), calibration_model(), 3, "rr", settings, plan=False)
    two = run_fleet_controllers(
        sc, truth_costs(), calibration_model(), 3, "rr", settings, plan=False, max_unavailable=2
    )
    assert one.fleet.max_unavailable_seen == 1 and one.toggles == 3
    assert "fleet_plan" not in {d.reason for ticks in one.ticks for d in ticks}  # fleet_routing none: no plan
    assert two.fleet.max_unavailable_seen == 2 and two.coordinator.max_held == 2
    assert _restart_starts(two)[0] == _restart_starts(two)[1]  # two at once: the limit is what binds
    waits = sum(
        ctl.registry.get_sample_value("sd_controller_restart_slot_waits_total", {"reason": "restart_slot_busy"})
        for ctl in one.controllers
    )
    assert waits > 0


# ------------------------------------------------------------------------------ over HTTP
def test_the_fleet_over_http_one_metrics_and_admin_api_per_replica_behind_the_router():
    import time

    import requests

    from controller import calibration
    from controller.shipped import EXAMPLE_CALIBRATION, calibration_path
    from controller.sim.engine import CalibratedCosts
    from controller.sim.server import SimulatedFleet

    model = calibration.load(calibration_path(EXAMPLE_CALIBRATION)).latency_model()
    sc = scenarios.load("quick").with_changes(
        arrival_rate=Constant(kind="constant", value=4.0),
        engine={"restart_downtime_s": 2.0, "restart_jitter_s": 0.0, "drain_limit_s": 0.5, "initial_sd": False},
    )
    fleet = Fleet(sc, CalibratedCosts(model), 3, Router("rr"), epoch_s=time.time())
    with SimulatedFleet(fleet) as sim:
        assert len(set(sim.metrics_urls)) == 3 and len(set(sim.admin_urls)) == 3
        time.sleep(1.5)
        for url in sim.metrics_urls:
            r = requests.get(url, timeout=5)
            assert r.status_code == 200 and "vllm:request_success_total" in r.text
        r = requests.post(sim.admin_urls[0] + "/admin/speculative", json={"enabled": True}, timeout=5)
        assert r.status_code in (200, 202), r.text
        deadline = time.monotonic() + 10
        seen_down, others_up, arrived_while_down = False, True, set()

        def phase():
            return requests.get(sim.admin_urls[0] + "/admin/status", timeout=5).json()

        while time.monotonic() < deadline:
            status = phase()
            if status["phase"] == "restarting":
                # Bracket the reads between two status calls: on a loaded machine the restart
                # can end between one request and the next, and only a read made while it
                # surely lasted may be held to 503.
                arrived = fleet.engines[0].arrived
                code = requests.get(sim.metrics_urls[0], timeout=5).status_code
                others = [requests.get(u, timeout=5).status_code for u in sim.metrics_urls[1:]]
                if phase()["phase"] == "restarting":
                    seen_down = True
                    arrived_while_down.add(arrived)
                    assert code == 503
                    others_up &= all(c == 200 for c in others)
            elif seen_down and status["applied"]["enabled"]:
                break
            time.sleep(0.1)
        assert seen_down and others_up and status["applied"]["enabled"] is True
        assert len(arrived_while_down) == 1  # out of rotation while it restarted
