"""N simulated vLLM replicas behind a router, on one simulated clock.

The fleet draws one arrival stream (the scenario's per-replica rate times N, from the same
seeded generator a single engine uses), and each tick the router (:mod:`controller.sim.router`)
splits that tick's arrivals over the replicas that are ready. Each replica is an ordinary
:class:`~controller.sim.engine.Engine` (its own queue, batch, restarts, counters and
vLLM-format /metrics text) fed by the router instead of by its own generator.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from controller.sim.engine import BLOCK_TICKS, DEFAULT_EPOCH_S, F_ARR, F_FIN, Engine, Phase, StepCosts
from controller.sim.router import Router
from controller.sim.scenarios import Scenario
from controller.sim.workload import Arrivals, generate_arrivals

HISTORY_S = 7200.0  # completions kept for the fleet's rate windows


@dataclass(frozen=True)
class _Scaled:
    """A rate trace times a factor (the fleet's rate from the per-replica scenario's)."""

    inner: object
    factor: float

    def evaluate(self, t: np.ndarray) -> np.ndarray:
        return self.factor * self.inner.evaluate(t)  # type: ignore[attr-defined]


class RoutedEngine(Engine):
    """An engine whose arrivals come from the router (:attr:`inbox`), one tick at a time."""

    inbox: Arrivals | None = None

    def _arrivals_for_tick(self, k: int):
        box = self.inbox
        self.inbox = None
        if box is None or len(box) == 0:
            return 0, 0
        self._block = box
        self._block_gamma = -1  # the block changes every tick: recompute the SD moments
        return 0, len(box)


def _take(a: Arrivals, sel: np.ndarray) -> Arrivals:
    return Arrivals(a.time_s[sel], a.prompt[sel], a.gen[sel], a.alpha[sel], a.klass[sel])


class Fleet:
    """``replicas`` engines on ``costs`` behind a ``router``; advance with :meth:`advance_to`.

    ``scenario`` is one replica's: its rate is what each replica sees on average; the fleet
    receives ``replicas`` times it. ``initial_sd``: one launch state for all, or one per replica.
    """

    def __init__(
        self,
        scenario: Scenario,
        costs: StepCosts,
        replicas: int,
        router: Router,
        *,
        initial_sd: bool | list[bool] | None = None,
        seed: int | None = None,
        epoch_s: float = DEFAULT_EPOCH_S,
        trace_speed: float = 1.0,
    ) -> None:
        """``trace_speed`` > 1 plays the scenario's rate faster than the clock (``simulate``)."""
        if replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {replicas}")
        seed = scenario.seed if seed is None else seed
        launch = scenario.engine.initial_sd if initial_sd is None else initial_sd
        states = list(launch) if isinstance(launch, list) else [bool(launch)] * replicas
        if len(states) != replicas:
            raise ValueError(f"initial_sd names {len(states)} replicas, the fleet has {replicas}")
        self.scenario = scenario
        self.router = router
        self.tick_s = float(scenario.tick_s)
        self.engines = [
            RoutedEngine(scenario.with_changes(engine={"initial_sd": s}), costs, seed=seed * 1000 + i, epoch_s=epoch_s)
            for i, s in enumerate(states)
        ]
        self.trace_speed = float(trace_speed)
        self._rng = np.random.default_rng([seed, 1])
        self._rate = _Scaled(scenario.arrival_rate, replicas)
        self._block: Arrivals | None = None
        self._block_start = 0
        self._offsets = np.zeros(1, dtype=np.int64)
        self.tick_index = 0
        self.t = 0.0
        self.max_unavailable_seen = 0  # the most replicas not ready in any tick
        self.unavailable_ticks = 0
        self._done: deque[tuple[float, list[int]]] = deque()  # (t, completions per replica)

    @property
    def now(self) -> float:
        return self.engines[0].now

    def _arrivals(self, k: int) -> Arrivals:
        if self._block is None or k >= self._block_start + len(self._offsets) - 1:
            sc = self.scenario
            self._block, counts = generate_arrivals(
                self._rng, self._rate, sc.acceptance, list(sc.classes), k * self.tick_s, self.tick_s, BLOCK_TICKS,
                self.trace_speed,
            )  # fmt: skip
            self._block_start = k
            self._offsets = np.concatenate([[0], np.cumsum(counts)])
        i = k - self._block_start
        lo, hi = int(self._offsets[i]), int(self._offsets[i + 1])
        return _take(self._block, np.arange(lo, hi))

    def tick(self) -> None:
        arr = self._arrivals(self.tick_index)
        ready = [e.phase is Phase.READY for e in self.engines]
        outstanding = [e.running + e.waiting for e in self.engines]
        where = self.router.assign(len(arr), ready, outstanding)
        for i, e in enumerate(self.engines):
            e.inbox = _take(arr, np.flatnonzero(where == i))
            e.tick()
        down = sum(e.phase is not Phase.READY for e in self.engines)
        self.max_unavailable_seen = max(self.max_unavailable_seen, down)
        self.unavailable_ticks += down
        self.tick_index += 1
        self.t = self.engines[0].t

    def advance_to(self, t_s: float) -> None:
        while self.t + 1e-9 < t_s:
            self.tick()

    # ------------------------------------------------------------------ the fleet's own view
    def record_completions(self) -> None:
        """Remember each replica's completions counter now (what Prometheus would scrape)."""
        self._done.append((self.t, [e.finished + e.lost for e in self.engines]))
        while self._done and self._done[0][0] < self.t - HISTORY_S:
            self._done.popleft()

    def fleet_rate(self, window_s: float) -> tuple[float, int] | None:
        """(completions per second summed over the replicas, replicas that completed any) over
        the last ``window_s``, like ``sum(rate(vllm:request_success_total[W]))`` and its count;
        None until a window's worth of samples exists."""
        if not self._done:
            return None
        t1, c1 = self._done[-1]
        start = None
        for t0, c0 in reversed(self._done):
            if t0 <= t1 - window_s + 1e-9:
                start = (t0, c0)
                break
        if start is None:
            return None
        t0, c0 = start
        deltas = [b - a for a, b in zip(c0, c1, strict=True)]
        return sum(deltas) / (t1 - t0), sum(d > 0 for d in deltas)

    # ------------------------------------------------------------------ results
    def latencies(self, warmup_s: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """(arrival s, latency s) of every request that arrived after ``warmup_s`` and was not
        aborted by a restart; the ones still queued or running are counted with their time so far."""
        arrs, lats = [], []
        for e in self.engines:
            log = e.finished_log()
            pend = e.pending_arrivals()
            arrs += [log[:, F_ARR], pend]
            lats += [log[:, F_FIN] - log[:, F_ARR], e.t - pend]
        a, lat = np.concatenate(arrs), np.concatenate(lats)
        keep = a >= warmup_s
        return a[keep], lat[keep]
