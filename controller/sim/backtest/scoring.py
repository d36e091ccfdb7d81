"""Scoring a backtest: what each replayed tick saw and decided, and the model's predicted gain
of the controller's states over the recorded ones (see :mod:`controller.sim.backtest`)."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, field

from controller.sim.backtest.history import Step


@dataclass(frozen=True)
class StepRecord:
    """What the replay saw and decided at one step."""

    time_s: float
    duration_s: float
    arrival_rate_rps: float | None
    acceptance_rate: float | None  # what the decision used
    acceptance_source: str | None  # measured | last | prior
    recorded_enabled: bool | None
    controller_enabled: bool  # after this step's decision (applied at once in the replay)
    predicted_speedup: float | None
    action: str
    reason: str
    detail: str
    failure: str | None  # why the observation was unusable
    switch_cost_request_s: float | None  # of this step's toggle
    projected_gain_request_s: float | None
    gain_request_s: float | None  # this step's latency term; None: no assessment or state unknown


@dataclass
class BacktestResult:
    records: list[StepRecord]
    latency_gain_request_s: float = 0.0  # Σ (L_recorded − L_controller) · λ · Δt over bounded steps
    switch_cost_request_s: float = 0.0  # Σ estimated cost of the controller's toggles
    unbounded_for: int = 0  # steps where only the recorded state is predicted overloaded
    unbounded_against: int = 0  # steps where only the controller's state is predicted overloaded
    requests: float = 0.0  # Σ λ · Δt over steps with an assessment
    beyond_headroom_recorded: int = 0  # steps the recorded state ran past capacity_headroom of its limit
    beyond_headroom_controller: int = 0  # the same for the controller's state
    failures: Counter = field(default_factory=Counter)

    @property
    def net_gain_request_s(self) -> float:
        return self.latency_gain_request_s - self.switch_cost_request_s

    @property
    def decisions(self) -> list[StepRecord]:
        return [r for r in self.records if r.action != "none"]

    @property
    def recorded_toggles(self) -> int:
        known = [r.recorded_enabled for r in self.records if r.recorded_enabled is not None]
        return sum(1 for a, b in itertools.pairwise(known) if a != b)


def score_step(
    result: BacktestResult, settings, step: Step, res, recorded: bool | None, ctl_enabled: bool
) -> StepRecord:
    """The record of one replayed tick; adds its terms to ``result``'s sums."""
    from controller.policy import usable

    a = res.assessment
    obs = res.observation
    unusable = usable(obs, settings)  # the controller's own gate: why it held without an assessment
    failure = unusable.reason.value if unusable is not None else None
    if failure:
        result.failures[failure] += 1
    gain = None
    cost = None
    if a is not None:
        lam_dt = a.arrival_rate_rps * step.duration_s
        result.requests += lam_dt
        if recorded is not None and _beyond_headroom(a, recorded, settings):
            result.beyond_headroom_recorded += 1
        if _beyond_headroom(a, ctl_enabled, settings):
            result.beyond_headroom_controller += 1
        if recorded is not None:
            if recorded == ctl_enabled:
                gain = 0.0
            else:
                l_rec, l_ctl = a.latency_s(recorded), a.latency_s(ctl_enabled)
                if math.isinf(l_rec) and not math.isinf(l_ctl):
                    result.unbounded_for += 1
                elif math.isinf(l_ctl):
                    result.unbounded_against += 1
                else:
                    gain = (l_rec - l_ctl) * lam_dt
                    result.latency_gain_request_s += gain
        if res.acted:
            cost = a.switch_cost_request_s
            result.switch_cost_request_s += cost
    return StepRecord(
        time_s=step.time_s,
        duration_s=step.duration_s,
        arrival_rate_rps=getattr(obs, "arrival_rate_rps", None),
        acceptance_rate=a.acceptance.rate if a is not None else None,
        acceptance_source=a.acceptance.source.value if a is not None else None,
        recorded_enabled=recorded,
        controller_enabled=ctl_enabled,
        predicted_speedup=a.predicted_speedup if a is not None else None,
        action=res.decision.action.value if res.acted else "none",
        reason=res.decision.reason.value,
        detail=res.decision.detail,
        failure=failure,
        switch_cost_request_s=cost,
        projected_gain_request_s=a.projected_gain_request_s if a is not None else None,
        gain_request_s=gain,
    )


def _beyond_headroom(a, enabled: bool, settings) -> bool:
    limit = a.stability_limit_on_rps if enabled else a.stability_limit_off_rps
    return a.arrival_rate_rps > settings.capacity_headroom * limit
