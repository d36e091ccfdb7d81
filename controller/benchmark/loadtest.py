"""The load test: whole-request latency at constant Poisson arrival rates, one CSV row per rate.

Why: micro-benchmarks miss what only a busy server shows (mixed steps, queueing with variable
lengths), so the calibrator checks and corrects its model against these rows. It uses only
:class:`BenchServer` observables, so a real vLLM and a simulator are measured alike.

A workload is any callable ``make_requests(rate_rps, duration_s, rng) -> list[ProbeRequest]``
(:data:`MakeRequests`); :func:`lognormal_workload` is the built-in one, richer mixes plug in
through the same signature.

Per rate: means, spread and percentiles over requests sent after the warm-up (the first 10 %
of the duration, while the queue fills). ``acceptance_rate`` is vLLM's definition, Δaccepted /
Δdraft tokens over the whole run (the counters cannot be split at the warm-up), empty with SD
off. ``saturated`` = 1 when some request finished later than duration + drain limit, or the
queue is still growing, so the rate is at or past capacity and the means depend on the duration:
the mean e2e latency of the second half of the measured window exceeds 1.5× the first half's, or
it climbs by more than 2 % of the time between the halves (a queue fed 2 % past its capacity
climbs at that slope), by more than three standard errors. The ratio alone misses a queue that
is only a few percent past capacity on long requests: at 1.06× an A100's capacity, 30 minutes
of arrivals climbed from 81 to 120 s (1.48×), and its mean said nothing about the server.
``running_context_tokens`` is the KV context per running sequence over the measured window,
from the batch gauges the server exported during the run (:mod:`controller.occupancy`), empty
when it exported none. ``cached_prompt_tokens`` is Δvllm:prompt_tokens_cached_total / requests sent
(the counter cannot be split at the warm-up either): the mean prompt tokens a request found in the
prefix cache, empty when the server does not export it. ``served_rps`` is the requests that
finished inside the measured window per second of it: the arrival rate while the server keeps
up, and its capacity at a saturated rate (the queue never empties, so the server finishes
requests as fast as it can).
Rates run in ascending order and stop after the first saturated one: a higher rate would only
queue longer.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from controller.benchmark.csvio import LoadRow
from controller.benchmark.micro import check_results, check_sd_config
from controller.benchmark.probe import (
    BenchServer,
    GaugeSample,
    ProbeError,
    ProbeRequest,
    ProbeResult,
    ServerCounters,
    ServerInfo,
)
from controller.occupancy import running_context_tokens

MakeRequests = Callable[[float, float, random.Random], list[ProbeRequest]]

WARMUP_FRACTION = 0.1
SATURATION_GROWTH = 1.5  # second-half / first-half mean e2e above this: the queue is growing
# ... or the mean climbs faster than this (seconds of latency per second of arrivals): where the
# arrival rate is this fraction past capacity. Steady runs of the fidelity truths up to 0.97 of
# their capacity climbed at most 1.5 %; runs past it, 2–5 %.
SATURATION_SLOPE = 0.02
SATURATION_SIGMAS = 3.0  # ... and by more than this many standard errors (a short run's noise)
MAX_DURATION_S = 4 * 3600.0
MAX_REQUESTS = 100_000
DEFAULT_BLOCK_SIZE = 16  # vLLM's on GPUs, when cache_config_info does not say


@dataclass(frozen=True)
class LoadPlan:
    rates: tuple[float, ...]
    duration_s: float
    drain_s: float  # extra time after duration_s for the last requests to finish
    workload: str  # a name for the CSV
    seed: int = 0
    max_requests: int = 20_000  # per rate


def poisson_arrivals(rate_rps: float, duration_s: float, rng: random.Random) -> list[float]:
    """Send times of a Poisson process with ``rate_rps`` over [0, duration_s)."""
    times, t = [], rng.expovariate(rate_rps)
    while t < duration_s:
        times.append(t)
        t += rng.expovariate(rate_rps)
    return times


def lognormal_length(mean: float, cv: float, rng: random.Random) -> int:
    """A length ≥ 1 with the given mean and coefficient of variation (cv 0: exactly the mean)."""
    if cv <= 0:
        return max(1, round(mean))
    sigma2 = math.log1p(cv * cv)
    return max(1, round(rng.lognormvariate(math.log(mean) - sigma2 / 2, math.sqrt(sigma2))))


def lognormal_workload(
    prompt_tokens: float,
    gen_tokens: float,
    length_cv: float,
    kind: str = "",
    max_total_tokens: int | None = None,
    prefix_tokens: int = 0,
    prefix_groups: int = 0,
) -> MakeRequests:
    """Poisson arrivals; prompt and generated lengths lognormal around their means.

    With ``prefix_groups`` > 0 every prompt starts with one of that many shared prefixes of
    ``prefix_tokens`` tokens (a system prompt: vLLM's prefix cache serves it once computed),
    drawn uniformly, and ``prompt_tokens`` is the mean of the rest.
    """
    if (prefix_groups > 0) != (prefix_tokens > 0) or prefix_groups < 0 or prefix_tokens < 0:
        raise ValueError("prefix_tokens and prefix_groups must both be > 0, or both 0")

    def make(rate_rps: float, duration_s: float, rng: random.Random) -> list[ProbeRequest]:
        out = []
        for t in poisson_arrivals(rate_rps, duration_s, rng):
            p = lognormal_length(prompt_tokens, length_cv, rng) + prefix_tokens
            g = lognormal_length(gen_tokens, length_cv, rng)
            if max_total_tokens is not None and p + g > max_total_tokens:
                g = min(g, max_total_tokens - 1)
                p = max(max_total_tokens - g, prefix_tokens + 1)
            group = f"prefix{rng.randrange(prefix_groups)}" if prefix_groups else ""
            out.append(ProbeRequest(t, p, g, kind, prefix_group=group, prefix_tokens=prefix_tokens if group else 0))
        return out

    return make


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def measured_context(
    gauges: Sequence[GaugeSample], info: ServerInfo, lo_s: float, hi_s: float, cached_prompt_tokens: float = 0.0
) -> float | None:
    """KV tokens per running sequence from the gauges scraped in [lo_s, hi_s]; None: no data."""
    inside = [g for g in gauges if lo_s <= g.at_s <= hi_s]
    if not inside or not info.kv_cache_tokens:
        return None
    usage = statistics.fmean(g.kv_usage for g in inside)
    running = statistics.fmean(g.running for g in inside)
    # A prefix shared in the cache is held once but read by every request (see occupancy).
    return running_context_tokens(
        usage, float(info.kv_cache_tokens), running, info.block_size or DEFAULT_BLOCK_SIZE, cached_prompt_tokens
    )


def climbing(first: Sequence[float], second: Sequence[float], apart_s: float) -> bool:
    """Whether the latencies of the second half climbed from the first's faster than
    SATURATION_SLOPE over ``apart_s`` seconds of arrivals, beyond their sampling noise."""
    if len(first) < 2 or len(second) < 2 or apart_s <= 0:
        return False
    rise = statistics.fmean(second) - statistics.fmean(first)
    noise = math.sqrt(statistics.variance(first) / len(first) + statistics.variance(second) / len(second))
    return rise > SATURATION_SLOPE * apart_s and rise > SATURATION_SIGMAS * noise


def summarize(
    rate: float,
    requests: Sequence[ProbeRequest],
    results: Sequence[ProbeResult],
    plan: LoadPlan,
    draft_length: int,
    acceptance_rate: float | None,
    running_context: float | None = None,
    cached_prompt_tokens: float | None = None,
) -> LoadRow:
    """The CSV row of one rate from its requests' observables."""
    warm_s = WARMUP_FRACTION * plan.duration_s
    measured = [r for r in results if r.sent_s >= warm_s] or list(results)
    e2e = [r.done_s - r.sent_s for r in measured]
    mid_s = (warm_s + plan.duration_s) / 2
    first = [r.done_s - r.sent_s for r in measured if r.sent_s < mid_s]
    second = [r.done_s - r.sent_s for r in measured if r.sent_s >= mid_s]
    deadline_s = plan.duration_s + plan.drain_s
    completed = sum(1 for r in results if r.done_s <= deadline_s)
    first_mean, second_mean = _mean(first), _mean(second)
    growing = (
        bool(first)
        and bool(second)
        and (second_mean > SATURATION_GROWTH * first_mean or climbing(first, second, (plan.duration_s - warm_s) / 2))
    )
    gen = [float(r.generated_tokens) for r in measured]
    prompt = [float(r.prompt_tokens) for r in measured]
    return LoadRow(
        rate=rate,
        sd=draft_length > 0,
        draft_length=draft_length,
        acceptance_rate=acceptance_rate,
        mean_e2e_s=_mean(e2e),
        mean_prompt_tokens=_mean(prompt),
        mean_gen_tokens=_mean(gen),
        gen_tokens_std=statistics.pstdev(gen) if gen else 0.0,
        prompt_tokens_std=statistics.pstdev(prompt) if prompt else 0.0,
        duration_s=plan.duration_s,
        sent=len(requests),
        completed=completed,
        e2e_p50_s=float(np.percentile(e2e, 50)) if e2e else 0.0,
        e2e_p90_s=float(np.percentile(e2e, 90)) if e2e else 0.0,
        mean_e2e_first_half_s=first_mean,
        mean_e2e_second_half_s=second_mean,
        saturated=completed < len(results) or growing,
        workload=plan.workload,
        warmup_s=warm_s,
        running_context_tokens=running_context,
        cached_prompt_tokens=cached_prompt_tokens,
        served_rps=sum(1 for r in results if warm_s <= r.done_s < plan.duration_s) / (plan.duration_s - warm_s),
    )


def cached_per_request(rate: float, before: ServerCounters, after: ServerCounters, sent: int) -> float | None:
    """Prompt tokens per request served from the prefix cache over one rate; None: not exported."""
    if before.prompt_cached_tokens is None or after.prompt_cached_tokens is None:
        return None
    delta = after.prompt_cached_tokens - before.prompt_cached_tokens
    if delta < 0:
        raise ProbeError(
            f"rate {rate:g}: vllm:prompt_tokens_cached_total went down "
            f"({before.prompt_cached_tokens:g} -> {after.prompt_cached_tokens:g}): did the server restart?"
        )
    return delta / sent


def rate_rng(seed: int, index: int, rate: float) -> random.Random:
    """The workload's random source at the index-th rate of a plan (a rate given as 1 or 1.0 seeds
    other arrivals: its repr is part of the seed)."""
    return random.Random(f"{seed}:{index}:{rate!r}")


def run_load(
    server: BenchServer,
    make_requests: MakeRequests,
    plan: LoadPlan,
    progress: Callable[[LoadRow], None] | None = None,
    warn: Callable[[str], None] | None = None,
) -> list[LoadRow]:
    """One row per rate, ascending, up to and including the first saturated rate."""
    if not 0 < plan.duration_s <= MAX_DURATION_S:
        raise ProbeError(f"duration {plan.duration_s:g} s is outside (0, {MAX_DURATION_S:g}]")
    info = check_sd_config(server)
    gamma = info.draft_length
    rows: list[LoadRow] = []
    for index, rate in enumerate(sorted(plan.rates)):
        rng = rate_rng(plan.seed, index, rate)
        requests = sorted(make_requests(rate, plan.duration_s, rng), key=lambda r: r.send_at_s)
        if not requests:
            raise ProbeError(f"rate {rate:g}: the workload produced no requests in {plan.duration_s:g} s")
        if len(requests) > plan.max_requests:
            raise ProbeError(f"rate {rate:g}: {len(requests)} requests exceed the limit {plan.max_requests}")
        before = server.counters()
        results = server.probe(requests)
        check_results(requests, results)
        after = server.counters()
        acceptance = None
        if gamma > 0:
            if None in (before.accepted_tokens, before.draft_tokens, after.accepted_tokens, after.draft_tokens):
                raise ProbeError("lost the spec-decode accepted/draft token counters")
            drafted = after.draft_tokens - before.draft_tokens  # type: ignore[operator]
            accepted = after.accepted_tokens - before.accepted_tokens  # type: ignore[operator]
            if drafted <= 0:
                raise ProbeError(f"rate {rate:g}: SD is on but no draft tokens were counted")
            acceptance = min(max(accepted / drafted, 0.0), 1.0)
        cached = cached_per_request(rate, before, after, len(requests))
        warm_s = WARMUP_FRACTION * plan.duration_s
        context = measured_context(server.gauges(), info, warm_s, plan.duration_s, cached or 0.0)
        row = summarize(rate, requests, results, plan, gamma, acceptance, context, cached)
        rows.append(row)
        if progress is not None:
            progress(row)
        if row.saturated:
            skipped = [r for r in sorted(plan.rates) if r > rate]
            if skipped and warn is not None:
                warn(f"rate {rate:g} saturated the server; skipping {', '.join(f'{r:g}' for r in skipped)}")
            break
    return rows
