"""Run a scenario with a policy on a simulated clock: the real controller, or a baseline.

The real controller is :class:`controller.loop.Controller` unchanged: it scrapes the
simulator's /metrics text through :class:`~controller.sources.vllm_metrics.VllmMetricsSource`
(``fetch=engine.render_metrics``) and switches SD through :class:`~controller.sim.engine.SimHook`,
once per ``evaluation_interval_s`` of simulated time. Baselines (always on/off, a static
threshold on running requests, a fixed schedule) drive the same engine the same way, so
their numbers are comparable.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from prometheus_client import CollectorRegistry

from controller.hooks.base import ChangeRequest, HookError
from controller.model import LatencyModel
from controller.sim.engine import F_ARR, F_FIN, Engine, SimHook
from controller.sim.scenarios import Scenario

TickCallback = Callable[["TickRecord", Engine], None]


@dataclass(frozen=True)
class TickRecord:
    """What one policy evaluation saw and did (scenario seconds)."""

    t: float
    observed_rate_rps: float | None
    acceptance_rate: float | None
    predicted_speedup: float | None
    action: str
    reason: str
    applied_enabled: bool
    serving: bool


@dataclass
class RunResult:
    """Outcome of one run: the engine (with its logs) and the policy's ticks."""

    policy: str
    scenario: Scenario
    engine: Engine
    ticks: list[TickRecord] = field(default_factory=list)
    warmup_s: float = 0.0

    @property
    def toggles(self) -> int:
        return self.engine.restart_count

    def latencies(self) -> np.ndarray:
        """End-to-end latency of every request that arrived after warm-up: finished ones, and
        the ones still queued or running at the end counted with their time so far (censored,
        so an overloaded policy is not flattered by its unfinished backlog)."""
        e = self.engine
        log = e.finished_log()
        sel = log[:, F_ARR] >= self.warmup_s
        lat = log[sel, F_FIN] - log[sel, F_ARR]
        pending = e.pending_arrivals()
        pending = pending[pending >= self.warmup_s]
        return np.concatenate([lat, e.t - pending])

    def summary(self) -> dict[str, float]:
        lat = self.latencies()
        e = self.engine
        return {
            "requests": float(e.arrived),
            "mean_latency_s": float(lat.mean()) if lat.size else math.nan,
            "p99_latency_s": float(np.percentile(lat, 99)) if lat.size else math.nan,
            "toggles": float(self.toggles),
            "lost": float(e.lost),
            "unfinished": float(e.running + e.waiting),
            "sd_on_fraction": float(np.mean(e.timeline["sd_on"])) if e.timeline["sd_on"] else math.nan,
        }


def _drive(
    engine: Engine,
    interval_s: float,
    duration_s: float,
    decide: Callable[[], TickRecord],
    on_tick: TickCallback | None,
    result: RunResult,
) -> RunResult:
    t = 0.0
    while t < duration_s - 1e-9:
        t = min(t + interval_s, duration_s)
        engine.advance_to(t)
        rec = decide()
        result.ticks.append(rec)
        if on_tick is not None:
            on_tick(rec, engine)
    return result


def default_settings(**overrides):
    """Controller settings for simulations: the daemon's defaults, no hook URL, no env."""
    from controller.hooks.setup import HookType
    from controller.settings import Settings

    values = {"hook_type": HookType.NONE, "hook_url": None, "state_file": "/nonexistent/sim-state.json"}
    values.update(overrides)
    return Settings(**values)


def run_controller(
    scenario: Scenario,
    model: LatencyModel,
    settings=None,
    *,
    controller_model: LatencyModel | None = None,
    on_tick: TickCallback | None = None,
    seed: int | None = None,
    warmup_s: float = 0.0,
) -> RunResult:
    """The real controller loop against the simulator (``model`` drives the simulator;
    ``controller_model``, default the same, is what the controller believes). The launch state
    holds through ``warmup_s`` (unmeasured), as for every plan a benchmark compares it with."""
    from controller.loop import Controller
    from controller.sources.vllm_metrics import VllmMetricsSource
    from controller.state_store import MemoryStateStore

    settings = settings or default_settings()
    engine = Engine(scenario, model, seed=seed)
    hook = SimHook(engine, hold_until_s=warmup_s)
    source = VllmMetricsSource(
        fetch=engine.render_metrics,
        rate_window_s=settings.rate_window_s,
        acceptance_window_s=settings.acceptance_window_s,
        long_window_s=settings.long_window_s,
    )
    ctl = Controller(
        settings=settings,
        model=controller_model or model,
        source=source,
        hook=hook,
        clock=lambda: engine.now,
        registry=CollectorRegistry(),
        state_store=MemoryStateStore(),
    )
    result = RunResult("controller", scenario, engine, warmup_s=warmup_s)

    def decide() -> TickRecord:
        hook.release()
        r = ctl.tick()
        a = r.assessment
        obs = r.observation
        return TickRecord(
            t=engine.t,
            observed_rate_rps=getattr(obs, "arrival_rate_rps", None),
            acceptance_rate=a.acceptance.rate if a is not None else getattr(obs, "acceptance_rate", None),
            predicted_speedup=a.predicted_speedup if a is not None else None,
            action=r.decision.action.value,
            reason=r.decision.reason.value,
            applied_enabled=engine.applied.enabled,
            serving=engine.serving,
        )

    result.controller = ctl  # type: ignore[attr-defined]
    return _drive(engine, settings.evaluation_interval_s, scenario.duration_s, decide, on_tick, result)


def _switch(engine: Engine, enabled: bool, reason: str) -> str:
    if engine.applied.enabled == enabled:
        return "none"
    try:
        engine.request_restart(enabled, None)
    except HookError:
        return "none"
    return "enable" if enabled else "disable"


def run_static(
    scenario: Scenario, model: LatencyModel, enabled: bool, *, seed: int | None = None, warmup_s: float = 0.0
) -> RunResult:
    """SD always on (or always off): never restarts."""
    engine = Engine(scenario.with_changes(engine={"initial_sd": enabled}), model, seed=seed)
    engine.advance_to(scenario.duration_s)
    return RunResult("always-on" if enabled else "always-off", scenario, engine, warmup_s=warmup_s)


def run_threshold(
    scenario: Scenario,
    model: LatencyModel,
    running_threshold: float,
    *,
    interval_s: float = 60.0,
    dwell_s: float = 300.0,
    seed: int | None = None,
    warmup_s: float = 0.0,
) -> RunResult:
    """A static rule: SD on while fewer than ``running_threshold`` requests run (with dwell).

    Used as a baseline: what an operator would script without a model.
    """
    engine = Engine(scenario, model, seed=seed)
    result = RunResult(f"threshold<{running_threshold:g}", scenario, engine, warmup_s=warmup_s)
    last = [-math.inf]

    def decide() -> TickRecord:
        running = engine.running + engine.waiting if engine.serving else None
        action = "none"
        if running is not None and engine.t - last[0] >= dwell_s:
            action = _switch(engine, running < running_threshold, "threshold")
            if action != "none":
                last[0] = engine.t
        return TickRecord(engine.t, None, None, None, action, "threshold", engine.applied.enabled, engine.serving)

    return _drive(engine, interval_s, scenario.duration_s, decide, None, result)


def run_schedule(
    scenario: Scenario,
    model: LatencyModel,
    desired: Sequence[bool],
    interval_s: float,
    *,
    seed: int | None = None,
    warmup_s: float = 0.0,
    name: str = "schedule",
    start_on: bool | None = None,
) -> RunResult:
    """Follow a per-interval on/off schedule (``desired[k]`` for interval k), switching at the
    start of each interval whose state differs (retried while a restart is in flight).

    ``start_on``: the state vLLM was launched in; a schedule that wants the other state first
    pays a restart at t=0. None: launched in the schedule's first state (no restart)."""
    first = bool(desired[0]) if len(desired) else scenario.engine.initial_sd
    launched = first if start_on is None else bool(start_on)
    engine = Engine(scenario.with_changes(engine={"initial_sd": launched}), model, seed=seed)
    if launched != first:
        engine.request_restart(first, None)
    result = RunResult(name, scenario, engine, warmup_s=warmup_s)
    k = [0]

    def decide() -> TickRecord:
        k[0] += 1
        want = bool(desired[min(k[0], len(desired) - 1)])
        action = _switch(engine, want, "schedule") if engine.serving else "none"
        return TickRecord(engine.t, None, None, None, action, "schedule", engine.applied.enabled, engine.serving)

    return _drive(engine, interval_s, scenario.duration_s, decide, None, result)


def change_request(enabled: bool, reason: str = "manual") -> ChangeRequest:
    return ChangeRequest(enabled=enabled, num_speculative_tokens=None, reason=reason)
