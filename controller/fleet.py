"""The fleet's plan: how many of N replicas run SD, and which replica moves next (pure).

Behind a router one replica's restart is a capacity dip of 1/N, so the fleet can hold states
no single replica can: k of N replicas on SD. How the load splits decides what k is worth:

* round-robin sends every replica Λ/N whatever its mode, so the fleet's mean latency is
  linear in k and the best k is 0 or N (the fleet moves there one replica at a time);
* least-outstanding-requests equalizes the requests in system, B_on = B_off = B; by Little's
  law each replica's B = λ·T(λ), so the split solves k·λ_on(B) + (N − k)·λ_off(B) = Λ, and
  the fleet's mean latency is N·B/Λ. A faster mode takes a larger share.

Either way the carried rate at a given occupancy is linear in k, so the best k for the mean
latency is 0 or N; an intermediate k is where the fleet is on its way, or where the rest of
the way does not pay. Each replica computes the plan from the fleet's rate and the
calibration's model, and acts only when it is the replica the plan moves (:func:`mover`:
ranks by replica id, read from the coordination backend's published states), at most one per
dwell: no extra coordination.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from functools import lru_cache

from controller.assessment import Assessment
from controller.config import PolicyConfig
from controller.model import LatencyModel, curves
from controller.observation import Observation
from controller.policy import Action, Decision, Reason
from controller.switch_cost import projected_rate, switch_cost

LatencyAt = Callable[[float], float]  # rate (req/s) -> mean time in system (s), +inf when overloaded
GRID = 160  # occupancy curve points per mode (the split is interpolated between them)


class FleetRouting(StrEnum):
    NONE = "none"  # each replica decides alone (no fleet plan)
    ROUND_ROBIN = "rr"
    LEAST_OUTSTANDING = "lor"


@dataclass(frozen=True)
class ModeCurve:
    """One mode's mean latency against its rate, below its stability limit."""

    latency: LatencyAt
    limit_rps: float


@dataclass(frozen=True)
class FleetPlan:
    """Where the fleet should go from ``sd_now`` replicas on SD, and why."""

    replicas: int
    sd_now: int
    sd_best: int  # the k with the lowest predicted latency at this rate
    sd_target: int  # where the fleet goes now: sd_now unless the thresholds say go and the path pays
    latency_now_s: float
    latency_target_s: float  # of the k the thresholds point to
    gain_request_s: float  # over the horizon, of being there instead of at sd_now
    cost_request_s: float  # of the restarts on the way (one per replica that moves)
    speedup: float = math.nan  # the fleet's L(0)/L(N)

    @property
    def moves(self) -> bool:
        return self.sd_target != self.sd_now


@lru_cache(maxsize=16)  # the same curves serve every k of one plan
def _occupancy_inverse(c: ModeCurve) -> tuple[list[float], list[float]]:
    """(occupancy B = λ·T(λ), rate) on a grid up to the limit, increasing in both."""
    occ, rates = [0.0], [0.0]
    for i in range(1, GRID + 1):
        r = c.limit_rps * (1.0 - (1.0 - i / GRID) ** 2) * (1.0 - 1e-6)  # denser near the limit
        t = c.latency(r)
        if not math.isfinite(t):
            break
        b = r * t
        if b > occ[-1]:
            occ.append(b)
            rates.append(r)
    return occ, rates


def _interp(x: float, xs: list[float], ys: list[float]) -> float | None:
    """ys at x, linear between grid points; None beyond the last (that mode is overloaded)."""
    if x > xs[-1]:
        return None
    lo, hi = 0, len(xs) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if xs[mid] <= x else (lo, mid)
    if hi == lo or xs[hi] == xs[lo]:
        return ys[lo]
    w = (x - xs[lo]) / (xs[hi] - xs[lo])
    return ys[lo] + w * (ys[hi] - ys[lo])


def split(
    routing: FleetRouting, on: ModeCurve, off: ModeCurve, fleet_rate_rps: float, replicas: int, sd: int
) -> tuple[float, float] | None:
    """(rate of each SD replica, rate of each plain one) with ``sd`` of ``replicas`` on SD;
    None when the fleet cannot carry ``fleet_rate_rps`` that way."""
    n, k, lam = replicas, sd, fleet_rate_rps
    if not 0 <= k <= n or n < 1 or lam < 0:
        raise ValueError(f"need 0 <= sd ({k}) <= replicas ({n}) and a rate >= 0 ({lam})")
    share = lam / n
    if routing is not FleetRouting.LEAST_OUTSTANDING or k in (0, n):
        ok = (k == 0 or share < on.limit_rps) and (k == n or share < off.limit_rps)
        return (share, share) if ok else None
    occ_on, r_on = _occupancy_inverse(on)
    occ_off, r_off = _occupancy_inverse(off)

    def carried(b: float) -> float | None:
        a, z = _interp(b, occ_on, r_on), _interp(b, occ_off, r_off)
        return None if a is None or z is None else k * a + (n - k) * z

    lo, hi = 0.0, min(occ_on[-1], occ_off[-1])
    top = carried(hi)
    if top is None or top < lam:
        return None
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        got = carried(mid)
        lo, hi = (mid, hi) if got is not None and got < lam else (lo, mid)
    b = hi
    return _interp(b, occ_on, r_on) or 0.0, _interp(b, occ_off, r_off) or 0.0


def fleet_latency(
    routing: FleetRouting, on: ModeCurve, off: ModeCurve, fleet_rate_rps: float, replicas: int, sd: int
) -> float:
    """Mean latency of the fleet's requests with ``sd`` replicas on SD (+inf when overloaded)."""
    rates = split(routing, on, off, fleet_rate_rps, replicas, sd)
    if rates is None:
        return math.inf
    if fleet_rate_rps <= 0:
        return (sd * on.latency(0.0) + (replicas - sd) * off.latency(0.0)) / replicas
    r_on, r_off = rates
    t_on = on.latency(r_on) if sd else 0.0
    t_off = off.latency(r_off) if sd < replicas else 0.0
    if math.isinf(t_on) or math.isinf(t_off):
        return math.inf
    # Requests weighted by where they went (equal occupancy makes this N·B/Λ under lor).
    return (sd * r_on * t_on + (replicas - sd) * r_off * t_off) / fleet_rate_rps


def plan(
    routing: FleetRouting,
    on: ModeCurve,
    off: ModeCurve,
    fleet_rate_rps: float,
    replicas: int,
    sd_now: int,
    restart_cost_request_s: float,
    horizon_s: float,
    margin: float,
    enable_threshold: float = 1.0,
    disable_threshold: float = 1.0,
) -> FleetPlan:
    """Where the fleet should go from ``sd_now`` replicas on SD.

    The direction is the fleet's speedup S = L(0)/L(N) against the single replica's
    thresholds: more SD above ``enable_threshold``, less below ``disable_threshold``, stay in
    between (the hysteresis that keeps replicas whose estimates differ by noise from undoing
    each other). A fleet whose current state is overloaded goes to the best k whatever S says.
    Then the path must pay: its gain over ``horizon_s`` above ``margin`` times its restarts
    (each priced as one replica's dip); leaving an overloaded state always pays."""
    lat = [fleet_latency(routing, on, off, fleet_rate_rps, replicas, k) for k in range(replicas + 1)]
    # Ties go to the fewest moves: prefer staying, then the nearest k.
    best = min(range(replicas + 1), key=lambda k: (lat[k], abs(k - sd_now)))
    s = _ratio(lat[0], lat[replicas])
    now_s = lat[sd_now]
    if math.isinf(now_s):
        want = best
    elif s > enable_threshold:
        want = replicas
    elif s < disable_threshold:
        want = 0
    else:
        want = sd_now
    want_s = lat[want]
    steps = abs(want - sd_now)
    cost = steps * restart_cost_request_s
    if math.isinf(now_s) and math.isfinite(want_s):
        gain = math.inf
    elif math.isinf(want_s):
        gain = 0.0
    else:
        gain = fleet_rate_rps * horizon_s * (now_s - want_s)
    pays = steps > 0 and (math.isinf(gain) or gain > margin * cost)
    return FleetPlan(replicas, sd_now, best, want if pays else sd_now, now_s, want_s, gain, cost, s)


def _ratio(t_off: float, t_on: float) -> float:
    """L(0)/L(N), the fleet's SD speedup: +inf when only SD keeps up, 0 when only plain does."""
    if math.isinf(t_off) and math.isinf(t_on):
        return math.nan
    if math.isinf(t_on):
        return 0.0
    if math.isinf(t_off):
        return math.inf
    return t_off / t_on if t_on > 0 else math.nan


def mover(fleet: Mapping[str, bool | None], sd_target: int) -> str | None:
    """The replica that moves next toward ``sd_target`` replicas on SD: the lowest-ranked one
    that is off when more are wanted, the highest-ranked one that is on when fewer. Every
    replica reads the same published states, so all name the same mover."""
    ids = sorted(fleet)
    sd_now = sum(1 for i in ids if fleet[i])
    if sd_target > sd_now:
        return next((i for i in ids if fleet[i] is False), None)
    if sd_target < sd_now:
        return next((i for i in reversed(ids) if fleet[i] is True), None)
    return None


# Decisions the fleet plan never overrides: the operator, a change in flight, data that cannot
# be used, backoff, and the safety rules (acceptance floor, observed harm, a growing queue:
# acting, or the floor refusing to re-enable). A safety net held by the switch price is a hold
# like any other: the plan, which prices the switch as a dip of one of N, may still move.
KEEP = frozenset(
    {
        Reason.OVERRIDE,
        Reason.PENDING,
        Reason.OBSERVATION,
        Reason.APPLIED_UNKNOWN,
        Reason.ACCEPTANCE_FLOOR,
        Reason.OBSERVED_SD_HARM,
        Reason.QUEUE_GROWTH,
        Reason.BACKOFF,
        Reason.ALREADY_APPLIED,
    }
)


def steer(
    decision: Decision,
    fleet_plan: FleetPlan,
    me: str,
    fleet: Mapping[str, bool | None],
    published_at: Mapping[str, float],
    now: float,
    dwell_s: float,
    draft_length: int,
) -> Decision:
    """This replica's decision under the fleet's plan: act only as the plan's mover, once its
    own dwell and the fleet's (no replica changed within ``dwell_s``) are over; otherwise hold.
    Decisions in :data:`KEEP` pass unchanged."""
    if decision.reason in KEEP or me not in fleet or fleet[me] is None:
        return decision
    applied = bool(fleet[me])
    k, n = fleet_plan.sd_target, fleet_plan.replicas
    where = f"fleet plan {k} of {n} on SD (now {fleet_plan.sd_now}, fleet speedup {fleet_plan.speedup:.3f})"

    def hold(detail: str) -> Decision:
        return replace(decision, action=Action.NONE, reason=Reason.FLEET_PLAN, detail=detail, desired_enabled=applied)

    who = mover(fleet, k)
    if who != me:
        return hold(f"{where}: {who or 'no replica'} moves" if fleet_plan.moves else f"{where}: stay")
    recent = [r for r, t in published_at.items() if now - t < dwell_s]
    if recent:
        return hold(f"{where}: {', '.join(sorted(recent))} changed within the dwell ({dwell_s:.0f}s)")
    want = not applied
    return replace(
        decision,
        action=Action.ENABLE if want else Action.DISABLE,
        reason=Reason.FLEET_PLAN,
        detail=f"{where}: {me} moves; gain {fleet_plan.gain_request_s:.0f} req·s > cost {fleet_plan.cost_request_s:.0f}",
        desired_enabled=want,
        draft_length=draft_length if want else None,
    )


def decide_for_fleet(
    routing: FleetRouting,
    model: LatencyModel,
    cfg: PolicyConfig,
    decision: Decision,
    a: Assessment,
    obs: Observation,
    me: str,
    fleet: Mapping[str, bool | None],
    published_at: Mapping[str, float],
    now: float,
) -> tuple[Decision, FleetPlan | None]:
    """The policy's ``decision`` under the fleet's plan, with the plan (None: no plan, the
    decision unchanged: no routing set, the fleet's rate unknown, or a replica's state unknown).

    ``model`` should be the calibration's, the same for every replica: a replica's online
    correction is learned from its own mode's traffic only, and replicas whose corrections
    differ would disagree on the plan (the mover holding what the others would do).

    Every replica plans from the same figure, the fleet's rate, not from its own: a replica's
    own rate jumps by N/(N − 1) while another restarts, and its trend with it. The fleet's
    trend (short against long window) projects it ahead, a rise believed, a fall not. Each mode's
    limit loses ``capacity_headroom``; a restart is priced as one replica's dip at the fleet's
    share (``switch_cost`` with N replicas), from this replica's applied mode."""
    if routing is FleetRouting.NONE or obs.fleet_arrival_rate_rps is None or len(fleet) < 2:
        return decision, None
    if me not in fleet or any(v is None for v in fleet.values()):
        return decision, None
    off_c, on_c = curves(model, a.acceptance.alpha, a.draft_length, a.workload)
    head = cfg.capacity_headroom
    on = ModeCurve(on_c.latency_s, head * on_c.stability_limit_rps)
    off = ModeCurve(off_c.latency_s, head * off_c.stability_limit_rps)
    n, rate = len(fleet), obs.fleet_arrival_rate_rps
    if cfg.price_switches:
        # The fleet's own trend, as the single replica's: a rise is believed, a fall is not.
        ahead = projected_rate(
            rate,
            obs.fleet_arrival_rate_long_rps,
            cfg.rate_window_s,
            cfg.long_window_s,
            max(cfg.dwell_s, cfg.trend_lookahead_s),
        )
        rate = max(rate, ahead)
    cur, new = (on, off) if fleet[me] else (off, on)
    cost = switch_cost(rate / n, a.restart_downtime_s, new.limit_rps, n, cur.limit_rps, cur.latency)
    sd_now = sum(1 for v in fleet.values() if v)
    # Direction by the model's break-even (S against 1 both ways): in a fleet a restart is a
    # dip of 1/N, cheap enough that the single replica's wide threshold band would cost more
    # than it saves; the hysteresis is the price (gain > switch_margin × cost) and the dwell.
    p = plan(routing, on, off, rate, n, sd_now, cost, a.gain_horizon_s, cfg.switch_margin, 1.0, 1.0)
    return steer(decision, p, me, fleet, published_at, now, cfg.dwell_s, a.draft_length), p
