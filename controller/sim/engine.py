"""A vLLM-like serving engine, simulated in fixed ticks (1 s by default) with numpy.

What it models:

* continuous batching with an FCFS waiting queue and at most ``max_num_seqs`` running;
* chunked prefill: each engine step carries the decode tokens of the batch plus up to
  ``max_num_batched_tokens`` − decode tokens of pending prompts, served in admission order;
* speculative decoding: a verify step yields 1 + the number of leading accepted drafts (each
  accepted with the request's own α, at most γ + 1 tokens);
* step costs from a :class:`StepCosts` source: a calibration (:class:`CalibratedCosts`, the
  controller's own :class:`controller.model.StepCost`) or the independent GPU roofline
  (:class:`controller.sim.truth_costs.TruthCosts`), optionally bent by a quadratic term and
  multiplied by per-tick lognormal noise;
* a KV cache bound when the cost source knows one: a waiting request is admitted only while
  the running set's KV (prompt plus generated so far) and its prompt fit (no preemption);
* a restart on every toggle: vLLM stops accepting, drains in-flight requests for up to
  ``drain_limit_s``, aborts the rest (counted lost), is down for ``restart_downtime_s``
  (± jitter) and comes back with fresh counters. Arrivals meanwhile queue up in front of it.

Why ticks and not a per-step event simulation: a day holds ~10⁷ engine steps, far too many
for Python. Within a tick the step cost is taken as constant (batch and KV size at the tick's
start), so the tick holds ``n`` steps of mean duration ``τ = tick/n``; each running request's
progress in the tick (prefill steps, then decode steps × tokens per step) and its finishing
time inside the tick follow in closed form, vectorized over the batch. Arrivals inside a tick
start at their own arrival time when a slot is free. Approximations (documented in
docs/simulator.md): a slot freed mid-tick is refilled at its freeing time but the newcomer's
work starts with the next tick; SD tokens over ``d`` verify steps are drawn from a normal with
the exact mean and variance of a sum of ``d`` truncated-geometric step yields.

Conservation holds exactly: ``arrived == finished + running + waiting + lost``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, runtime_checkable

import numpy as np
import requests

from controller.admin_api import MAX_RESTART_DURATIONS, SdConfig, admin_status
from controller.hooks.base import ChangeRequest, HookError, HookPhase, HookStatus
from controller.model import LatencyModel, StepCost
from controller.sim import vllm_exposition as vx
from controller.sim.scenarios import Scenario
from controller.sim.workload import generate_arrivals

DEFAULT_EPOCH_S = 1_800_000_000.0  # simulated clocks start here (a plausible Unix time)
BLOCK_TICKS = 3600

# Columns of the running-set matrix (one row per running request, in admission order).
ARR, ADM, TTFT, PROMPT, GEN, PF, DONE, ALPHA, EN, SDEV = range(10)
NCOL = 10
# Columns of the waiting FIFO.
Q_ARR, Q_PROMPT, Q_GEN, Q_ALPHA, Q_EN, Q_SDEV, Q_GAMMA = range(7)
QCOL = 7
# Columns of the finished log.
F_ARR, F_ADM, F_TTFT, F_FIN, F_PROMPT, F_GEN, F_SD = range(7)


class Phase(StrEnum):
    READY = "ready"
    DRAINING = "draining"  # shutting down: finishing in-flight requests
    DOWN = "down"  # process restarting: nothing served


class SimulatorDown(requests.ConnectionError):
    """/metrics is unreachable: the simulated vLLM is restarting."""


def tokens_per_step_moments(alpha: np.ndarray, gamma: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean and standard deviation of one verify step's yield N = 1 + leading accepted drafts.

    P(N ≥ n) = α^(n−1) for n = 1..γ+1, so E[N] = Σ α^(n−1) and E[N²] = Σ (2n−1)·α^(n−1).
    """
    a = np.asarray(alpha, dtype=float)
    powers = a[:, None] ** np.arange(gamma + 1)[None, :]
    mean = powers.sum(axis=1)
    second = powers @ (2.0 * np.arange(1, gamma + 2) - 1.0)
    return mean, np.sqrt(np.maximum(second - mean * mean, 0.0))


@runtime_checkable
class StepCosts(Protocol):
    """What one engine step costs: the engine's only view of the hardware."""

    max_num_seqs: int

    def decode_step_s(self, batch: float, ctx_tokens: float, sd: SdConfig) -> tuple[float, float]:
        """(seconds of one decode/verify step over ``batch`` sequences holding ``ctx_tokens`` of KV
        in all, tokens the step computes for them)."""
        ...

    def chunk_extra_s(
        self,
        batch: float,
        decode_tokens: float,
        chunk_tokens: float,
        sd: SdConfig,
        prompt_tokens: float,
        step_chunk_tokens: float,
    ) -> float:
        """Extra seconds steps with decode work pay for ``chunk_tokens`` of prompt (the draft's
        prefill included with SD), when each step carries about ``step_chunk_tokens`` of it in
        prompts of about ``prompt_tokens`` each."""
        ...

    def kv_capacity_tokens(self, sd: SdConfig) -> float | None:
        """KV cache tokens of the server in that mode; None: unbounded (only max_num_seqs)."""
        ...


class CalibratedCosts:
    """Step costs from a calibration (the controller's own latency model): the engine's costs
    for ``simulate`` and the existing tests. Grading the controller on these grades it on its
    own assumptions."""

    def __init__(self, model: LatencyModel) -> None:
        self.model = model
        self.max_num_seqs = int(model.max_num_seqs)
        self._c: dict[str, StepCost | None] = {
            "target": model.target, "verify": model.verify, "draft": model.draft, "prefill": model.prefill,
        }  # fmt: skip

    def scale(self, sd: SdConfig) -> float:
        return self.model.scale_on if sd.enabled else self.model.scale_off

    def decode_step_s(self, batch: float, ctx_tokens: float, sd: SdConfig) -> tuple[float, float]:
        c = self._c
        if sd.enabled:
            g = sd.num_speculative_tokens
            x = batch * (g + 1)
            whole = c["verify"] or c["target"]
            t = (
                g * c["draft"].scalar(batch, ctx_tokens, batch)
                + whole.scalar(x, ctx_tokens, batch)
                + self.model.sd_overhead_s
            )
        else:
            x = batch
            t = c["target"].scalar(batch, ctx_tokens, batch)
        return t * self.scale(sd), float(x)

    def chunk_extra_s(
        self,
        batch: float,
        decode_tokens: float,
        chunk_tokens: float,
        sd: SdConfig,
        prompt_tokens: float = 0.0,
        step_chunk_tokens: float = 0.0,
    ) -> float:
        # Linear in the chunk: how the chunk is split over steps does not matter here.
        c = self._c
        pre = c["prefill"]
        if pre is not None:  # schema-1 calibration: the stand-alone prefill slope
            extra = pre.slope_s_per_token * chunk_tokens
        else:
            t = c["target"]
            extra = t.scalar(decode_tokens + chunk_tokens) - t.scalar(decode_tokens)
            if sd.enabled and self.model.draft_prefills:
                d = c["draft"]
                extra += d.scalar(batch + chunk_tokens) - d.scalar(batch)
        return extra * self.scale(sd)

    def kv_capacity_tokens(self, sd: SdConfig) -> float | None:
        # The calibration-driven engine never bounded the batch by KV: keep its behaviour.
        return None


class _Hist:
    """Histogram counts per bucket (numpy), turned into a :class:`vx.Histogram` on render."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = np.asarray(bounds, dtype=float)
        self.counts = np.zeros(len(bounds) + 1)
        self.total = 0.0

    def observe(self, values: np.ndarray) -> None:
        if values.size:
            idx = np.searchsorted(self.bounds, values, side="left")  # value <= bound
            self.counts += np.bincount(idx, minlength=self.counts.size)
            self.total += float(values.sum())

    def observe_n(self, value: float, n: float) -> None:
        if n > 0:
            self.counts[int(np.searchsorted(self.bounds, value, side="left"))] += n
            self.total += value * n

    def snapshot(self) -> vx.Histogram:
        cum = np.cumsum(self.counts)
        return vx.Histogram(
            bounds=tuple(float(b) for b in self.bounds),
            cumulative=tuple(float(c) for c in cum[:-1]),
            sum=self.total,
            count=float(cum[-1]),
        )


class _Counters:
    """Everything vLLM resets when it restarts."""

    def __init__(self, created_ts: float, sd: SdConfig) -> None:
        self.created_ts = created_ts
        self.success = {"stop": 0.0, "abort": 0.0}
        self.prompt_tokens = 0.0
        self.gen_tokens = 0.0
        self.h_prompt = _Hist(vx.TOKEN_BUCKETS)
        self.h_gen = _Hist(vx.TOKEN_BUCKETS)
        self.h_ttft = _Hist(vx.TTFT_BUCKETS_S)
        self.h_itl = _Hist(vx.TOKEN_LATENCY_BUCKETS_S)
        self.h_tpot = _Hist(vx.TOKEN_LATENCY_BUCKETS_S)
        self.h_e2e = _Hist(vx.E2E_LATENCY_BUCKETS_S)
        self.sd = sd
        self.drafts = 0.0
        self.draft_tokens = 0.0
        self.accepted = 0.0
        self.per_pos = np.zeros(sd.num_speculative_tokens if sd.enabled else 0)


@dataclass(frozen=True)
class EngineTotals:
    """Request accounting since the simulation started (never reset)."""

    arrived: int
    finished: int
    running: int
    waiting: int
    lost: int


class Engine:
    """The simulated server. Drive it with :meth:`advance_to` (scenario seconds)."""

    def __init__(
        self,
        scenario: Scenario,
        model: LatencyModel | StepCosts,
        *,
        epoch_s: float = DEFAULT_EPOCH_S,
        seed: int | None = None,
        model_name: str = "sim",
        record_requests: bool = True,
        trace_speed: float = 1.0,
    ) -> None:
        self.scenario = scenario
        # A LatencyModel is wrapped (the calibration-driven engine); anything else is a StepCosts.
        self.costs: StepCosts = CalibratedCosts(model) if isinstance(model, LatencyModel) else model
        self.model = model if isinstance(model, LatencyModel) else None
        # > 1: the scenario's traces play faster than the engine's clock (see serve.py); the
        # engine's own physics (steps, latencies, restarts) always runs in real seconds.
        self.trace_speed = float(trace_speed)
        spec = scenario.engine
        self.spec = spec
        self.tick_s = float(scenario.tick_s)
        self.epoch_s = float(epoch_s)
        self.model_name = model_name
        self.max_num_seqs = int(spec.max_num_seqs or self.costs.max_num_seqs)
        seed = scenario.seed if seed is None else seed
        self._rng_arrivals = np.random.default_rng([seed, 1])
        self._rng = np.random.default_rng([seed, 2])
        self.t = 0.0  # scenario seconds
        self.tick_index = 0
        self.applied = SdConfig(spec.initial_sd, spec.draft_length)
        self.desired = self.applied
        self.phase = Phase.READY
        self._restart_requested_at: float | None = None
        self._drain_deadline = 0.0
        self._ready_at = 0.0
        self._drain_mark = 0
        self._lost_this_restart = 0
        self._last_tau = 0.01
        self.restart_durations_s: list[float] = []
        self.restart_count = 0
        self.restart_log: list[tuple[float, float, bool, int]] = []  # (requested t, ready t, enabled, lost)
        # running set, waiting FIFO, finished log
        self._run = np.empty((0, NCOL))
        self._q = np.empty((1024, QCOL))
        self._q_head = 0
        self._q_tail = 0
        self.record_requests = record_requests
        self._finished: list[np.ndarray] = []
        self._pending: list[tuple[np.ndarray, np.ndarray, bool]] = []
        self._pending_rows = 0
        self._lost_arrivals: list[np.ndarray] = []
        self.arrived = 0
        self.finished = 0
        self.lost = 0
        self.counters = _Counters(self.now, self.applied)
        # arrivals are drawn a block of ticks at a time
        self._block_start_tick = 0
        self._block = None
        self._block_gamma = -1
        self._block_moments: tuple[np.ndarray, np.ndarray] = (np.empty(0), np.empty(0))
        self._block_offsets = np.zeros(1, dtype=np.int64)
        # per-tick timeline (scenario time at the tick's end)
        self.timeline: dict[str, list[float]] = {
            k: [] for k in ("t", "running", "waiting", "sd_on", "serving", "arrivals", "step_s")
        }

    # ---------------------------------------------------------------------------- clock
    @property
    def now(self) -> float:
        """Simulated Unix time."""
        return self.epoch_s + self.t

    # ---------------------------------------------------------------------------- costs
    def _scale(self, sd: SdConfig) -> float:
        return self.spec.cost_scale_on if sd.enabled else self.spec.cost_scale_off

    def _step_cost(self, batch: float, ctx_tokens: float, sd: SdConfig) -> tuple[float, float]:
        """(seconds of one decode step without prefill, decode tokens in it)."""
        t, x = self.costs.decode_step_s(batch, ctx_tokens, sd)
        return t * self._scale(sd), x

    def _chunk_cost(
        self,
        batch: float,
        decode_tokens: float,
        chunk_tokens: float,
        sd: SdConfig,
        prompt_tokens: float = 0.0,
        step_chunk_tokens: float = 0.0,
    ) -> float:
        """Extra seconds a step pays for carrying ``chunk_tokens`` of prompt (the draft's too with SD)."""
        extra = self.costs.chunk_extra_s(batch, decode_tokens, chunk_tokens, sd, prompt_tokens, step_chunk_tokens)
        return extra * self._scale(sd)

    def _kv_fit(self, k: int) -> int:
        """How many of the next ``k`` waiting requests fit the KV cache (all of them when unbounded)."""
        cap = self.costs.kv_capacity_tokens(self.applied)
        if cap is None or k <= 0:
            return k
        run = self._run
        used = float((run[:, PROMPT] + run[:, DONE]).sum()) if len(run) else 0.0
        prompts = self._q[self._q_head : self._q_head + k, Q_PROMPT]
        fits = int(np.searchsorted(used + np.cumsum(prompts), cap, side="right"))
        # An empty server always takes one request (a prompt larger than the cache is the
        # scenario's error, not a reason to deadlock).
        return max(fits, 1 if len(run) == 0 else 0)

    # ---------------------------------------------------------------------------- arrivals
    def _arrivals_for_tick(self, k: int):
        b = self.scenario
        if self._block is None or k >= self._block_start_tick + len(self._block_offsets) - 1:
            self._block_start_tick = k
            arr, counts = generate_arrivals(
                self._rng_arrivals, b.arrival_rate, b.acceptance, list(b.classes),
                k * self.tick_s, self.tick_s, BLOCK_TICKS, self.trace_speed,
            )  # fmt: skip
            self._block = arr
            self._block_gamma = -1
            self._block_offsets = np.concatenate([[0], np.cumsum(counts)])
        i = k - self._block_start_tick
        lo, hi = int(self._block_offsets[i]), int(self._block_offsets[i + 1])
        return lo, hi

    def _push(self, lo: int, hi: int) -> int:
        n = hi - lo
        if n <= 0:
            return 0
        if self._q_tail + n > len(self._q):
            live = self._q[self._q_head : self._q_tail]
            cap = max(1024, 2 * (len(live) + n))
            q = np.empty((cap, QCOL))
            q[: len(live)] = live
            self._drain_mark -= self._q_head
            self._q, self._q_tail, self._q_head = q, len(live), 0
        a = self._block
        rows = self._q[self._q_tail : self._q_tail + n]
        rows[:, Q_ARR] = a.time_s[lo:hi]
        rows[:, Q_PROMPT] = a.prompt[lo:hi]
        rows[:, Q_GEN] = a.gen[lo:hi]
        rows[:, Q_ALPHA] = a.alpha[lo:hi]
        # Tokens per verify step at the draft length the request will most likely be served with.
        gamma = self.desired.num_speculative_tokens
        if self._block_gamma != gamma:
            self._block_moments = tokens_per_step_moments(a.alpha, gamma)
            self._block_gamma = gamma
        rows[:, Q_EN] = self._block_moments[0][lo:hi]
        rows[:, Q_SDEV] = self._block_moments[1][lo:hi]
        rows[:, Q_GAMMA] = gamma
        self._q_tail += n
        self.arrived += n
        return n

    @property
    def waiting(self) -> int:
        return self._q_tail - self._q_head

    @property
    def running(self) -> int:
        return len(self._run)

    def _admit(self, k: int, at: np.ndarray | float) -> None:
        """Move the first ``k`` waiting requests into the running set, admitted at ``at``."""
        q = self._q[self._q_head : self._q_head + k]
        self._q_head += k
        new = np.empty((k, NCOL))
        new[:, ARR] = q[:, Q_ARR]
        new[:, ADM] = np.maximum(q[:, Q_ARR], at)
        new[:, TTFT] = np.nan
        new[:, PROMPT] = q[:, Q_PROMPT]
        new[:, GEN] = q[:, Q_GEN]
        new[:, PF] = q[:, Q_PROMPT]
        new[:, DONE] = 0.0
        new[:, ALPHA] = q[:, Q_ALPHA]
        if self.applied.enabled:
            gamma = self.applied.num_speculative_tokens
            if np.all(q[:, Q_GAMMA] == gamma):
                new[:, EN] = q[:, Q_EN]
                new[:, SDEV] = q[:, Q_SDEV]
            else:
                new[:, EN], new[:, SDEV] = tokens_per_step_moments(q[:, Q_ALPHA], gamma)
        else:
            new[:, EN] = 1.0
            new[:, SDEV] = 0.0
        self._run = new if len(self._run) == 0 else np.concatenate([self._run, new])

    # ---------------------------------------------------------------------------- restarts
    def request_restart(self, enabled: bool, draft_length: int | None) -> bool:
        """Start a toggle now. False when the config is already applied; raises when busy."""
        if self.phase is not Phase.READY:
            raise HookError(f"a restart is in progress (phase {self.phase.value})")
        target = SdConfig(enabled, int(draft_length or self.spec.draft_length))
        cur = self.applied
        if enabled == cur.enabled and (not enabled or target.num_speculative_tokens == cur.num_speculative_tokens):
            return False
        self.desired = target
        self.phase = Phase.DRAINING
        self._restart_requested_at = self.t
        self._drain_deadline = self.t + self.spec.drain_limit_s
        self._drain_mark = self._q_tail  # arrivals after this wait outside for the new process
        self.restart_count += 1
        return True

    def _finish_drain(self, at_s: float) -> None:
        """Abort whatever is still in the old process; go down for the restart."""
        aborted_running = len(self._run)
        aborted_waiting = max(0, self._drain_mark - self._q_head)
        if self.record_requests and (aborted_running or aborted_waiting):
            self._lost_arrivals.append(
                np.concatenate([self._run[:, ARR], self._q[self._q_head : self._drain_mark, Q_ARR]])
            )
        self._run = np.empty((0, NCOL))
        self._q_head = max(self._q_head, self._drain_mark)
        n = aborted_running + aborted_waiting
        self.lost += n
        self.counters.success["abort"] += n
        jitter = self.spec.restart_jitter_s
        down = self.spec.restart_downtime_s + (self._rng.uniform(-jitter, jitter) if jitter else 0.0)
        self._ready_at = at_s + max(0.0, down)
        self._lost_this_restart = n
        self.phase = Phase.DOWN

    def _come_up(self) -> None:
        self.applied = self.desired
        self.phase = Phase.READY
        started = self._restart_requested_at if self._restart_requested_at is not None else self.t
        self.restart_durations_s.append(self.t - started)
        self.restart_log.append((started, self.t, self.applied.enabled, self._lost_this_restart))
        self._restart_requested_at = None
        self._flush()
        self.counters = _Counters(self.now, self.applied)

    # ---------------------------------------------------------------------------- ticks
    def advance_to(self, t_s: float) -> None:
        """Run whole ticks until scenario time reaches ``t_s`` (or the first tick past it)."""
        while self.t + 1e-9 < t_s:
            self.tick()

    def tick(self) -> None:
        k = self.tick_index
        t0 = self.t
        dt = self.tick_s
        lo, hi = self._arrivals_for_tick(k)
        n_arr = self._push(lo, hi)
        step_s = 0.0
        if self.phase is Phase.DOWN and t0 >= self._ready_at:
            self._come_up()
        if self.phase is not Phase.DOWN:
            step_s = self._serve(t0, dt)
            if self.phase is Phase.DRAINING and (
                t0 + dt >= self._drain_deadline or (len(self._run) == 0 and self._q_head >= self._drain_mark)
            ):
                self._finish_drain(t0 + dt)
        self.t = (k + 1) * dt
        self.tick_index = k + 1
        tl = self.timeline
        tl["t"].append(self.t)
        tl["running"].append(len(self._run))
        tl["waiting"].append(self.waiting)
        tl["sd_on"].append(1.0 if self.applied.enabled else 0.0)
        tl["serving"].append(1.0 if self.phase is Phase.READY else 0.0)
        tl["arrivals"].append(n_arr)
        tl["step_s"].append(step_s)

    def _serve(self, t0: float, dt: float) -> float:
        """Serve one tick. Returns the mean step duration (0 when idle)."""
        m = self.max_num_seqs
        admissible = (self._drain_mark if self.phase is Phase.DRAINING else self._q_tail) - self._q_head
        k = self._kv_fit(min(m - len(self._run), admissible))
        if k > 0:
            self._admit(k, t0)
        run = self._run
        b = len(run)
        if b == 0:
            return 0.0
        sd = self.applied
        c = self.counters
        spec = self.spec
        pf = run[:, PF]
        # The batch the tick's steps see, on average: requests that arrive during the tick and
        # requests that finish during it count for the fraction of the tick they are in.
        present = 1.0 - np.maximum((run[:, ADM] - t0) * (1.0 / dt), 0.0)
        leaving = (run[:, GEN] - run[:, DONE]) / ((dt / self._last_tau) * run[:, EN])
        share = np.maximum(np.minimum(np.minimum(present, leaving), 1.0), 0.0)
        b_eff = max(float(share.sum()), 1.0)
        ctx = float(((run[:, PROMPT] - pf + run[:, DONE]) * share).sum())
        c_dec, x = self._step_cost(b_eff, ctx, sd)
        if spec.cost_noise_sigma > 0:
            s = spec.cost_noise_sigma
            c_dec *= math.exp(s * self._rng.standard_normal() - 0.5 * s * s)
        q = spec.cost_quadratic_s_per_token2
        pending = float(pf.sum())
        budget = max(float(spec.max_num_batched_tokens) - x, 16.0)
        tau0 = c_dec + q * x * x  # a step without prefill
        if pending > 0:
            # a step with a full prefill chunk
            # Prompts arrive spread over the tick, so a real step carries about one prompt, or
            # the backlog's share per step when many are pending (after a restart): a cost
            # source whose per-token prefill cost depends on the chunk size needs to know.
            prompt_mean = float(run[pf > 0, PROMPT].mean())
            step_chunk = min(budget, max(prompt_mean, pending * self._last_tau / dt))
            tau1 = c_dec + self._chunk_cost(b_eff, x, budget, sd, prompt_mean, step_chunk) + q * (x + budget) ** 2
            s1 = pending / budget
            n = s1 + (dt - s1 * tau1) / tau0 if s1 * tau1 <= dt else dt / tau1
        else:
            n = dt / tau0
        tau = dt / n
        self._last_tau = tau
        # --- prefill, in admission order (FCFS chunks of `budget` tokens per step)
        s_adm = np.maximum(run[:, ADM] - t0, 0.0) / tau
        if pending > 0:
            cum = np.cumsum(pf)
            s_pf = np.maximum(cum / budget, s_adm + pf / budget)
            in_pf = pf > 0
            newly = in_pf & (s_pf <= n)
            still = in_pf & ~newly
            processed_before = float(pending)
            if still.any():
                run[still, PF] = np.minimum(np.maximum(cum[still] - n * budget, 1.0), pf[still])
            if newly.any():
                run[newly, PF] = 0.0
                ttft_t = t0 + s_pf[newly] * tau
                run[newly, TTFT] = ttft_t
                run[newly, DONE] = 1.0  # the prefill step emits the first token
                c.h_ttft.observe(ttft_t - run[newly, ARR])
                c.gen_tokens += float(newly.sum())
            c.prompt_tokens += processed_before - float(run[:, PF].sum())
            decoding = ~still
            d = np.where(decoding, np.maximum(n - np.where(in_pf, s_pf, s_adm), 0.0), 0.0)
            s_start = np.where(in_pf, s_pf, s_adm)
        else:
            d = np.maximum(n - s_adm, 0.0)
            s_start = s_adm
        # --- decode
        need = run[:, GEN] - run[:, DONE]
        if sd.enabled:
            mean = d * run[:, EN]
            tok = mean + self._rng.standard_normal(b) * np.sqrt(d) * run[:, SDEV]
            tok = np.minimum(np.maximum(tok, d), d * (sd.num_speculative_tokens + 1))
        else:
            tok = d
        fin = (d > 0) & (tok >= need) | (need <= 0) & (run[:, PF] <= 0)
        frac = np.divide(need, tok, out=np.zeros(b), where=fin & (tok > 0))
        steps = np.where(fin, d * np.minimum(frac, 1.0), d)
        made = np.where(fin, np.maximum(need, 0.0), tok)
        total_steps = float(steps.sum())
        c.gen_tokens += float(made.sum())
        c.h_itl.observe_n(tau, total_steps)
        if sd.enabled and total_steps > 0:
            g = sd.num_speculative_tokens
            accepted = float(made.sum()) - total_steps
            c.drafts += total_steps
            c.draft_tokens += g * total_steps
            c.accepted += accepted
            # Per position k, P(accepted) = α^(k+1); weight by the steps each request made.
            a_mean = float(steps @ run[:, ALPHA]) / total_steps
            w = a_mean ** np.arange(1, g + 1)
            ws = float(w.sum())
            if ws > 0:
                c.per_pos[:g] += w * (accepted / ws)
        run[:, DONE] += np.where(fin, 0.0, made)
        if fin.any():
            done_rows = run[fin]
            fin_t = t0 + (s_start[fin] + steps[fin]) * tau
            self._record_finished(done_rows, fin_t, sd.enabled)
            self._run = run[~fin]
            # Refill the freed slots in order of their freeing times (work starts next tick).
            admissible = (self._drain_mark if self.phase is Phase.DRAINING else self._q_tail) - self._q_head
            k2 = self._kv_fit(min(m - len(self._run), admissible))
            if k2 > 0:
                free_at = np.sort(fin_t)
                if len(free_at) < k2:  # pragma: no cover - slots can only come from finishers
                    free_at = np.concatenate([free_at, np.full(k2 - len(free_at), t0 + dt)])
                self._admit(k2, free_at[:k2])
        return tau

    def _record_finished(self, rows: np.ndarray, fin_t: np.ndarray, sd_on: bool) -> None:
        # Histograms and the log are filled in bulk (see _flush): per-tick numpy calls on a
        # handful of rows would dominate the simulation's run time.
        n = len(rows)
        self.finished += n
        self.counters.success["stop"] += n
        self._pending.append((rows, fin_t, sd_on))
        self._pending_rows += n
        if self._pending_rows > 4096:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        rows = np.concatenate([p[0] for p in self._pending])
        fin_t = np.concatenate([p[1] for p in self._pending])
        sd_flag = np.concatenate([np.full(len(p[1]), 1.0 if p[2] else 0.0) for p in self._pending])
        self._pending = []
        self._pending_rows = 0
        c = self.counters
        n = len(rows)
        e2e = fin_t - rows[:, ARR]
        c.h_e2e.observe(e2e)
        c.h_prompt.observe(rows[:, PROMPT])
        c.h_gen.observe(rows[:, GEN])
        ttft = np.where(np.isnan(rows[:, TTFT]), fin_t, rows[:, TTFT])
        gen = rows[:, GEN]
        multi = gen > 1
        if multi.any():
            c.h_tpot.observe((fin_t[multi] - ttft[multi]) / (gen[multi] - 1.0))
        if self.record_requests:
            log = np.empty((n, 7))
            log[:, F_ARR] = rows[:, ARR]
            log[:, F_ADM] = rows[:, ADM]
            log[:, F_TTFT] = ttft
            log[:, F_FIN] = fin_t
            log[:, F_PROMPT] = rows[:, PROMPT]
            log[:, F_GEN] = gen
            log[:, F_SD] = sd_flag
            self._finished.append(log)

    # ---------------------------------------------------------------------------- results
    def totals(self) -> EngineTotals:
        return EngineTotals(self.arrived, self.finished, self.running, self.waiting, self.lost)

    def finished_log(self) -> np.ndarray:
        """One row per finished request: arrival, admission, first token, finish (scenario s),
        prompt and generated tokens, SD on (1/0). Columns ``F_*``."""
        self._flush()
        return np.concatenate(self._finished) if self._finished else np.empty((0, 7))

    def pending_arrivals(self) -> np.ndarray:
        """Arrival times of the requests running or waiting now."""
        return np.concatenate([self._run[:, ARR], self._q[self._q_head : self._q_tail, Q_ARR]])

    def lost_arrivals(self) -> np.ndarray:
        """Arrival times of the requests aborted by restarts."""
        return np.concatenate(self._lost_arrivals) if self._lost_arrivals else np.empty(0)

    def timeline_arrays(self) -> dict[str, np.ndarray]:
        return {k: np.asarray(v, dtype=float) for k, v in self.timeline.items()}

    # ---------------------------------------------------------------------------- /metrics
    @property
    def serving(self) -> bool:
        return self.phase is Phase.READY

    def counters_snapshot(self) -> vx.VllmCounters:
        self._flush()
        c = self.counters
        spec_decode = None
        if c.sd.enabled:
            spec_decode = vx.SpecDecodeCounters(
                num_drafts=c.drafts,
                num_draft_tokens=c.draft_tokens,
                num_accepted_tokens=c.accepted,
                accepted_per_pos=tuple(float(v) for v in c.per_pos),
            )
        return vx.VllmCounters(
            model_name=self.model_name,
            engine="0",
            created_ts=c.created_ts,
            request_success=dict(c.success),
            prompt_tokens_total=c.prompt_tokens,
            generation_tokens_total=c.gen_tokens,
            request_prompt_tokens=c.h_prompt.snapshot(),
            request_generation_tokens=c.h_gen.snapshot(),
            time_to_first_token_seconds=c.h_ttft.snapshot(),
            inter_token_latency_seconds=c.h_itl.snapshot(),
            request_time_per_output_token_seconds=c.h_tpot.snapshot(),
            e2e_request_latency_seconds=c.h_e2e.snapshot(),
            num_requests_running=float(len(self._run)),
            num_requests_waiting=float(self.waiting),
            spec_decode=spec_decode,
        )

    def render_metrics(self) -> str:
        """vLLM 0.32 /metrics text; raises :class:`SimulatorDown` while restarting."""
        if not self.serving:
            raise SimulatorDown(f"simulated vLLM is restarting (phase {self.phase.value})")
        return vx.render(self.counters_snapshot())

    # ---------------------------------------------------------------------------- admin view
    def admin_status(self, vllm_url: str = "") -> dict:
        """The launcher's /admin/status document for this engine."""
        durations = [round(d, 3) for d in self.restart_durations_s[-MAX_RESTART_DURATIONS:]]

        def served(s: SdConfig) -> SdConfig:  # the engine keeps its draft length while SD is off
            return SdConfig(s.enabled, s.num_speculative_tokens if s.enabled else None)

        return admin_status(
            phase=HookPhase.READY if self.phase is Phase.READY else HookPhase.RESTARTING,
            applied=served(self.applied),
            desired=served(self.desired),
            restart_count=self.restart_count,
            durations_s=durations,
            child_pid=None,
            last_error=None,
            vllm_url=vllm_url,
        )


class SimHook:
    """The :class:`controller.hooks.base.Hook` protocol, applied inside the simulation."""

    def __init__(self, engine: Engine, hold_until_s: float = 0.0) -> None:
        self.engine = engine
        self.requests: list[tuple[float, ChangeRequest]] = []
        # A benchmark's warm-up is unmeasured: a restart in it would hide its own outage, so the
        # launch state holds until then for every plan, and a change asked for earlier starts then.
        self.hold_until_s = hold_until_s
        self.deferred: ChangeRequest | None = None

    def request(self, change: ChangeRequest) -> None:
        self.requests.append((self.engine.t, change))
        if self.engine.t < self.hold_until_s:
            self.deferred = change
            return
        self.engine.request_restart(change.enabled, change.num_speculative_tokens)

    def release(self) -> None:
        """Start a change deferred by the hold once it is over (the runner calls it every tick)."""
        if self.deferred is not None and self.engine.t >= self.hold_until_s and self.engine.phase is Phase.READY:
            change, self.deferred = self.deferred, None
            self.engine.request_restart(change.enabled, change.num_speculative_tokens)

    def status(self) -> HookStatus:
        e = self.engine
        return HookStatus(
            phase=HookPhase.READY if e.phase is Phase.READY and self.deferred is None else HookPhase.RESTARTING,
            applied_enabled=e.applied.enabled,
            applied_draft_length=e.applied.num_speculative_tokens if e.applied.enabled else None,
            restart_durations_s=tuple(e.restart_durations_s[-MAX_RESTART_DURATIONS:]),
            restart_count=e.restart_count,
        )
