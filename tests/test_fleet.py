"""The fleet's plan (controller/fleet.py): tables of rates, curves and fleet states."""

from __future__ import annotations

import math

import pytest
from scipy.optimize import brentq

from controller import fleet
from controller.config import OverrideMode
from controller.fleet import FleetPlan, FleetRouting, ModeCurve
from controller.policy import Action, ControllerPhase, Decision, Reason

LOR, RR = FleetRouting.LEAST_OUTSTANDING, FleetRouting.ROUND_ROBIN


def fluid(c0: float, c1: float) -> ModeCurve:
    """The brief's fluid curve T = c0 / (1 − λ·c1): SD has the smaller c0 and the larger c1."""
    return ModeCurve(lambda r: c0 / (1 - r * c1) if r * c1 < 1 else math.inf, 1.0 / c1)


ON, OFF = fluid(1.0, 0.1), fluid(2.0, 0.05)  # SD: twice as fast idle, saturates at 10 req/s vs 20


def lor_split_by_brentq(c_on, c_off, lam, n, k):
    """The independent solution: B = λ·c0/(1 − λ·c1) inverts to λ = B/(c0 + B·c1); equal B."""
    lam_of = lambda b, c0, c1: b / (c0 + b * c1)  # noqa: E731
    b = brentq(lambda b: k * lam_of(b, *c_on) + (n - k) * lam_of(b, *c_off) - lam, 1e-12, 1e9)
    return lam_of(b, *c_on), lam_of(b, *c_off), b


@pytest.mark.parametrize(("lam", "k"), [(4.0, 1), (20.0, 2), (36.0, 3), (50.0, 1), (45.0, 3)])
def test_lor_split_equalizes_requests_in_system(lam, k):
    r_on, r_off = fleet.split(LOR, ON, OFF, lam, 4, k)
    want_on, want_off, b = lor_split_by_brentq((1.0, 0.1), (2.0, 0.05), lam, 4, k)
    assert r_on == pytest.approx(want_on, rel=2e-3) and r_off == pytest.approx(want_off, rel=2e-3)
    assert k * r_on + (4 - k) * r_off == pytest.approx(lam, rel=1e-3)
    # Little's law: the fleet's mean latency is N·B/Λ when the router equalizes B.
    assert fleet.fleet_latency(LOR, ON, OFF, lam, 4, k) == pytest.approx(4 * b / lam, rel=5e-3)


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4])
def test_round_robin_gives_every_replica_the_same_share(k):
    assert fleet.split(RR, ON, OFF, 20.0, 4, k) == (5.0, 5.0)


@pytest.mark.parametrize(
    ("routing", "lam", "k", "carried"),
    [
        (RR, 39.0, 4, True),  # 9.75 per replica < SD's 10
        (RR, 41.0, 4, False),  # SD replicas past their limit
        (RR, 41.0, 1, False),  # round-robin cannot spare the SD replica its share
        (LOR, 41.0, 1, True),  # least-outstanding sends it less
        (LOR, 79.0, 1, False),  # 1·10 + 3·20 = 70 is the most this fleet carries
        (LOR, 69.0, 1, True),
    ],
)
def test_what_a_fleet_can_carry(routing, lam, k, carried):
    assert (fleet.split(routing, ON, OFF, lam, 4, k) is not None) is carried
    assert math.isfinite(fleet.fleet_latency(routing, ON, OFF, lam, 4, k)) is carried


@pytest.mark.parametrize("lam", [2.0, 10.0, 30.0, 38.0])
def test_round_robin_plans_all_or_nothing(lam):
    lat = [fleet.fleet_latency(RR, ON, OFF, lam, 4, k) for k in range(5)]
    p = fleet.plan(RR, ON, OFF, lam, 4, 2, 0.0, 3600.0, 1.5)
    assert p.sd_best in (0, 4)
    assert lat[p.sd_best] == min(lat)


@pytest.mark.parametrize(
    ("lam", "best"),
    [
        (4.0, 4),  # light load: SD everywhere
        (24.0, 4),  # SD still carries more at the occupancy this load needs
        (28.0, 0),  # past break-even (≈ 27 for the fleet): plain decoding everywhere
        (45.0, 0),  # past SD's fleet limit (40)
    ],
)
def test_least_outstanding_plans_from_the_split(lam, best):
    p = fleet.plan(LOR, ON, OFF, lam, 4, 2, 0.0, 3600.0, 1.5)
    assert p.sd_best == best

    def brute(k):  # the independent solution
        if k in (0, 4):
            c0, c1 = (1.0, 0.1) if k else (2.0, 0.05)
            r = lam / 4
            return c0 / (1 - r * c1) if r * c1 < 1 else math.inf
        return 4 * lor_split_by_brentq((1.0, 0.1), (2.0, 0.05), lam, 4, k)[2] / lam

    assert min(range(5), key=brute) == best


@pytest.mark.parametrize("routing", [RR, LOR])
def test_the_best_k_for_mean_latency_is_all_or_none(routing):
    """At equal occupancy B the fleet carries k·λ_on(B) + (N − k)·λ_off(B): linear in k, so
    the smallest B for a given load (the lowest latency, N·B/Λ) is at k = 0 or k = N. An
    intermediate k is a state on the way (and where the rest of the way does not pay)."""
    for lam in [1.0 + 1.5 * i for i in range(46)]:
        lat = [fleet.fleet_latency(routing, ON, OFF, lam, 4, k) for k in range(5)]
        if all(math.isinf(x) for x in lat):
            continue
        assert min(lat) in (lat[0], lat[4]), (lam, lat)
        finite = [x for x in lat if math.isfinite(x)]
        assert lat == sorted(lat) or lat == sorted(lat, reverse=True) or len(finite) < 5, (lam, lat)


def test_a_fleet_part_way_stays_when_the_rest_of_the_way_does_not_pay():
    # Near break-even the two extremes are worth almost the same: two of four on SD stay.
    p = fleet.plan(LOR, ON, OFF, 27.0, 4, 2, 5_000.0, 3600.0, 1.5)
    assert p.sd_best in (0, 4) and not p.moves and p.sd_target == 2


@pytest.mark.parametrize(
    ("cost", "horizon", "moves"),
    [
        (0.0, 3600.0, True),
        (1e12, 3600.0, False),  # restarts dearer than any gain
        (100.0, 0.001, False),  # the gain does not last long enough to pay them
    ],
)
def test_the_plan_moves_only_when_the_path_pays(cost, horizon, moves):
    p = fleet.plan(LOR, ON, OFF, 4.0, 4, 1, cost, horizon, 1.5)
    assert p.sd_best == 4 and p.moves is moves
    assert p.sd_target == (4 if moves else 1)
    assert p.cost_request_s == 3 * cost


def test_leaving_an_overloaded_fleet_state_always_pays():
    p = fleet.plan(RR, ON, OFF, 45.0, 4, 4, 1e12, 1.0, 1.5)
    assert math.isinf(p.latency_now_s) and p.sd_target == 0 and math.isinf(p.gain_request_s)


@pytest.mark.parametrize(
    ("states", "target", "who"),
    [
        ({"a": True, "b": True, "c": True}, 1, "c"),  # fewer: the highest-ranked SD replica goes off
        ({"a": True, "b": False, "c": True}, 1, "c"),
        ({"a": False, "b": False, "c": False}, 2, "a"),  # more: the lowest-ranked plain one goes on
        ({"a": True, "b": False, "c": False}, 2, "b"),
        ({"a": True, "b": False, "c": False}, 1, None),  # there already
        ({"c": True, "a": False, "b": True}, 3, "a"),  # ranks are by id, not by listing order
    ],
)
def test_the_mover_is_named_by_rank(states, target, who):
    assert fleet.mover(states, target) == who


def _plan(now: int, target: int, n: int = 3) -> FleetPlan:
    return FleetPlan(n, now, target, target, 2.0, 1.0, 1e6, 1e3)


def _decision(reason=Reason.STEADY, action=Action.NONE) -> Decision:
    return Decision(action, reason, "policy says", None, None, ControllerPhase.ENABLED)


STATES = {"r0": True, "r1": True, "r2": True}
LONG_AGO = {"r0": 0.0, "r1": 0.0, "r2": 0.0}


@pytest.mark.parametrize(
    ("me", "changed", "decision", "action", "reason"),
    [
        ("r2", LONG_AGO, _decision(), Action.DISABLE, Reason.FLEET_PLAN),  # the mover acts
        ("r1", LONG_AGO, _decision(), Action.NONE, Reason.FLEET_PLAN),  # the others hold
        # the policy alone would switch this replica; the plan moves another one
        ("r0", LONG_AGO, _decision(Reason.SPEEDUP_LOW, Action.DISABLE), Action.NONE, Reason.FLEET_PLAN),
        ("r2", {**LONG_AGO, "r0": 9_900.0}, _decision(), Action.NONE, Reason.FLEET_PLAN),  # one per dwell
        ("r2", {**LONG_AGO, "r2": 9_950.0}, _decision(), Action.NONE, Reason.FLEET_PLAN),  # its own dwell
        # safety, the operator and a pending change are never overridden
        ("r0", LONG_AGO, _decision(Reason.OBSERVED_SD_HARM, Action.DISABLE), Action.DISABLE, Reason.OBSERVED_SD_HARM),
        ("r2", LONG_AGO, _decision(Reason.OVERRIDE), Action.NONE, Reason.OVERRIDE),
        ("r2", LONG_AGO, _decision(Reason.PENDING), Action.NONE, Reason.PENDING),
        ("r2", LONG_AGO, _decision(Reason.ACCEPTANCE_FLOOR), Action.NONE, Reason.ACCEPTANCE_FLOOR),
    ],
)
def test_steer(me, changed, decision, action, reason):
    d = fleet.steer(decision, _plan(3, 2), me, STATES, changed, 10_000.0, 300.0, 4)
    assert (d.action, d.reason) == (action, reason)
    if d.reason is Reason.FLEET_PLAN:
        assert d.desired_enabled is (action is not Action.NONE) ^ STATES[me]


def test_steer_enabling_carries_the_draft_length():
    states = {"r0": False, "r1": False}
    d = fleet.steer(_decision(), _plan(0, 1, 2), "r0", states, {"r0": 0.0, "r1": 0.0}, 10_000.0, 300.0, 5)
    assert (d.action, d.desired_enabled, d.draft_length) == (Action.ENABLE, True, 5)
    assert "r0 moves" in d.detail


def test_steer_keeps_out_of_a_replica_whose_state_is_unknown():
    d = fleet.steer(_decision(), _plan(2, 1), "r2", {"r0": True, "r1": True, "r2": None}, LONG_AGO, 1e4, 300.0, 4)
    assert d.reason is Reason.STEADY


def test_split_rejects_nonsense():
    with pytest.raises(ValueError, match="sd"):
        fleet.split(LOR, ON, OFF, 1.0, 4, 5)
    assert OverrideMode.AUTO  # the override is the loop's business, not the plan's


@pytest.mark.parametrize(
    ("lam", "sd_now", "thresholds", "target"),
    [
        (20.0, 0, (1.0, 1.0), 4),  # S ≈ 1.33 > 1: more SD
        (20.0, 0, (1.4, 1.05), 0),  # inside the band: stay
        (24.0, 4, (1.2, 1.05), 4),  # S ≈ 1.14: inside the band, stay on
        (26.0, 4, (1.2, 1.05), 4),  # S ≈ 1.04 < 1.05 asks for off, but off is slower: no gain, stay
        (28.0, 4, (1.2, 1.05), 0),  # S ≈ 0.92: off
        (26.0, 0, (1.0, 1.0), 4),  # the same load by break-even alone: SD still wins
        (30.0, 2, (1.2, 1.05), 0),  # S < 1: less SD from part-way too
    ],
)
def test_the_direction_follows_the_fleet_speedup_against_the_thresholds(lam, sd_now, thresholds, target):
    p = fleet.plan(RR, ON, OFF, lam, 4, sd_now, 0.0, 3600.0, 1.5, *thresholds)
    assert p.speedup == pytest.approx(OFF.latency(lam / 4) / ON.latency(lam / 4))
    assert p.sd_target == target
