"""A simulated fleet driven by N real controllers, or held static, on one simulated clock.

Each replica gets its own :class:`controller.loop.Controller` (unchanged): its own source
scraping that replica's vLLM-format /metrics text, completed with the fleet's rate the way
``sources/fleet.py`` completes it from Prometheus; its own hook restarting that replica; and a
:class:`~controller.coordination.gate.RestartGate` on one shared
:class:`~controller.sim.coordinator.InProcessCoordinator`, so at most ``max_unavailable``
replicas restart at once. Who restarts is measured from the replicas (``Fleet``), never from
the controllers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from prometheus_client import CollectorRegistry

from controller.model import LatencyModel
from controller.observation import Observation, ObserveResult
from controller.sim.engine import SimHook, StepCosts
from controller.sim.fleet import Fleet
from controller.sim.router import Router
from controller.sim.runner import TickRecord, default_settings
from controller.sim.scenarios import Scenario

FleetTickCallback = Callable[[list[TickRecord], Fleet], None]


class SimFleetSource:
    """A replica's own source, its observation completed with the fleet's rate and replicas."""

    def __init__(self, inner, fleet: Fleet, rate_window_s: float, long_window_s: float | None = None) -> None:
        self.inner = inner
        self.fleet = fleet
        self.rate_window_s = rate_window_s
        self.long_window_s = long_window_s

    def observe(self, now: float) -> ObserveResult:
        obs = self.inner.observe(now)
        got = self.fleet.fleet_rate(self.rate_window_s)
        if not isinstance(obs, Observation) or got is None or got[1] < 1:
            return obs
        long = self.fleet.fleet_rate(self.long_window_s) if self.long_window_s else None
        return dataclasses.replace(
            obs,
            fleet_arrival_rate_rps=got[0],
            fleet_replicas=got[1],
            fleet_arrival_rate_long_rps=long[0] if long is not None else None,
        )


@dataclass
class FleetRunResult:
    """One fleet run: the fleet (with its replicas' logs) and each evaluation's records."""

    policy: str
    scenario: Scenario
    fleet: Fleet
    ticks: list[list[TickRecord]] = field(default_factory=list)  # per evaluation, one per replica
    warmup_s: float = 0.0
    controllers: list = field(default_factory=list)
    coordinator: object | None = None

    @property
    def toggles(self) -> int:
        return sum(e.restart_count for e in self.fleet.engines)

    def summary(self) -> dict[str, float]:
        _, lat = self.fleet.latencies(self.warmup_s)
        engines = self.fleet.engines
        sd_on = [np.mean(e.timeline["sd_on"]) for e in engines if e.timeline["sd_on"]]
        return {
            "replicas": float(len(engines)),
            "requests": float(sum(e.arrived for e in engines)),
            "mean_latency_s": float(lat.mean()) if lat.size else math.nan,
            "p99_latency_s": float(np.percentile(lat, 99)) if lat.size else math.nan,
            "toggles": float(self.toggles),
            "lost": float(sum(e.lost for e in engines)),
            "unfinished": float(sum(e.running + e.waiting for e in engines)),
            "sd_on_fraction": float(np.mean(sd_on)) if sd_on else math.nan,
            "max_restarting": float(self.fleet.max_unavailable_seen),
        }


def run_fleet_static(
    scenario: Scenario,
    costs: StepCosts | LatencyModel,
    replicas: int,
    router: str,
    enabled: bool,
    *,
    seed: int | None = None,
    warmup_s: float = 0.0,
) -> FleetRunResult:
    """Every replica with SD always on (or always off): no restarts."""
    fleet = Fleet(scenario, _costs(costs), replicas, Router(router), initial_sd=enabled, seed=seed)
    fleet.advance_to(scenario.duration_s)
    return FleetRunResult("always-on" if enabled else "always-off", scenario, fleet, warmup_s=warmup_s)


def _costs(costs):
    from controller.sim.engine import CalibratedCosts

    return CalibratedCosts(costs) if isinstance(costs, LatencyModel) else costs


def run_fleet_controllers(
    scenario: Scenario,
    costs: StepCosts | LatencyModel,
    controller_model: LatencyModel,
    replicas: int,
    router: str,
    settings=None,
    *,
    plan: bool = True,
    max_unavailable: int = 1,
    slot_ttl_s: float = 600.0,
    on_tick: FleetTickCallback | None = None,
    seed: int | None = None,
    warmup_s: float = 0.0,
) -> FleetRunResult:
    """N real controllers, one per replica, coordinated by an in-process coordinator.

    ``settings`` (default: the daemon's defaults with ``replicas`` = N and, with ``plan``,
    ``fleet_routing`` = the router: the fleet's plan, controller/fleet.py) is shared by all;
    each controller gets its own ``replica_id`` (``replica-<i>``)."""
    from controller.coordination.gate import RestartGate
    from controller.loop import Controller
    from controller.sim.coordinator import InProcessCoordinator
    from controller.sources.vllm_metrics import VllmMetricsSource
    from controller.state_store import MemoryStateStore

    settings = settings or default_settings(replicas=replicas, fleet_routing=router if plan else "none")
    fleet = Fleet(scenario, _costs(costs), replicas, Router(router), seed=seed)
    coordinator = InProcessCoordinator(max_unavailable, slot_ttl_s, lambda: fleet.now)
    controllers = []
    for i, engine in enumerate(fleet.engines):
        inner = VllmMetricsSource(
            fetch=engine.render_metrics,
            rate_window_s=settings.rate_window_s,
            acceptance_window_s=settings.acceptance_window_s,
            long_window_s=settings.long_window_s,
        )
        controllers.append(
            Controller(
                settings=settings.model_copy(update={"replica_id": f"replica-{i}"}),
                model=controller_model,
                source=SimFleetSource(inner, fleet, settings.rate_window_s, settings.long_window_s),
                hook=SimHook(engine),
                clock=lambda: fleet.now,
                registry=CollectorRegistry(),
                state_store=MemoryStateStore(),
                gate=RestartGate(coordinator, f"replica-{i}", backend="in-process"),
            )
        )
    result = FleetRunResult(
        "controller", scenario, fleet, warmup_s=warmup_s, controllers=controllers, coordinator=coordinator
    )
    interval = settings.evaluation_interval_s
    t = 0.0
    while t < scenario.duration_s - 1e-9:
        t = min(t + interval, scenario.duration_s)
        fleet.advance_to(t)
        fleet.record_completions()
        records = []
        for ctl, engine in zip(controllers, fleet.engines, strict=True):
            r = ctl.tick()
            a = r.assessment
            records.append(
                TickRecord(
                    t=engine.t,
                    observed_rate_rps=getattr(r.observation, "arrival_rate_rps", None),
                    acceptance_rate=a.acceptance.rate if a is not None else None,
                    predicted_speedup=a.predicted_speedup if a is not None else None,
                    action=r.decision.action.value,
                    reason=r.decision.reason.value,
                    applied_enabled=engine.applied.enabled,
                    serving=engine.serving,
                )
            )
        result.ticks.append(records)
        if on_tick is not None:
            on_tick(records, fleet)
    return result
