"""The micro-benchmark: step costs of a server, measured only through :class:`BenchServer` observables.

Why only observables: the same code must calibrate a real vLLM and a simulated one, so it may
use send, first-token and done times, token counts, the spec-decode counters and ``info()``,
never anything a real server would not show. Rows (``csvio.BenchRow``), per batch size B:

* ``prefill``: B concurrent P-token prompts with ``max_tokens=1``: the batch's wall time
  (last done − first sent). On an SD server it includes the draft model's prefill, so run it
  against both servers: the difference is the draft's prefill cost.
* ``target`` (SD off) / ``verify`` (SD on, γ = draft_length): B concurrent requests of N
  tokens, streamed with a chunk trace. Each chunk is one engine step's output, so the step time
  is the mean chunk interval between the last first token and the first finish (every sequence
  decoding: no prompt still prefilling, no sequence gone). Without a trace: the mean decode
  duration over the mean step count ((B·(N − 1) − Δaccepted) / B from vLLM's counter).
  tokens_per_seq = 1 (target) or γ + 1 (verify); context_len = P + N/2.
* ``mixed``: one engine step carrying B decoders plus one prefill chunk of C prompt tokens.
  Run A: B decoders alone (N₂ tokens) give the decode step τ. Run B: the same decoders plus M
  single requests (C-token prompt, ``max_tokens=1``) injected after the decoders' prefill and
  spaced several step times apart, so each lands in a step of its own. The decoders' window
  grows by M chunk costs: extra = (window_B − steps_B·τ) / M and latency_s = τ + extra.
  N₂ is chosen from a pilot run so the window covers every injection; an injection outside
  the window is an error, not a silent bias. Cross-check (warning only): an injected request
  waits ≈ τ/2 for the running step, then takes the mixed step.
  Error sources: run-to-run drift of τ (the extra is a difference of two long windows, so
  noise in τ is multiplied by the step count: use several iterations and the median); a chunk
  larger than the room the token budget leaves (max_num_batched_tokens − B·tokens_per_seq)
  would span steps, so it is measured at that room (``chunks_beside``; the budget must be
  known); acceptance differs between runs A and B (corrected by the counter delta of run B).
* ``kv_cache`` (one row per server, when ``info()`` knows it): context_len = KV capacity in
  tokens, batch_size = tokens_per_seq = 1, latency_s = 0.
* ``prefix_caching`` (one row per server, when ``info()`` knows it): context_len = 1 when it
  caches prefixes (vllm:cache_config_info enable_prefix_caching), 0 when not; the model prices
  a preempted request's recompute by it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from controller.benchmark.csvio import BenchRow
from controller.benchmark.probe import BenchServer, ProbeError, ProbeRequest, ProbeResult, ServerInfo

PHASES = ("prefill", "target", "verify", "mixed")
DEFAULT_CHUNK_TOKENS = (128, 512, 1024, 2048)
# GEMMs run in whole tiles (64–256 rows of tokens) and waves of tiles. With a chunk a multiple
# of the tile, a mixed step's B + C tokens waste exactly what B alone wastes, while a served
# prompt lands anywhere: such a bench prices a prompt riding a batch that fills its tiles (B
# near 256) too cheaply, 2–11 % on a 128-token-tile GPU. Offsets over this many tokens walk the
# phases instead.
TILE_PHASE_TOKENS = 128
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
CROSS_CHECK_TOLERANCE = 0.25  # relative gap between the two mixed-step estimates that earns a warning
# N₂ over what the mean acceptance needs, for a mixed run whose injection outlasted a decoder.
MIXED_RETRY_MARGIN = 1.3
MIXED_RETRIES = 2
# A decode run in which no step had every decoder decoding (a staggered prefill) is run again
# longer at most this many times (decode_together).
DECODE_RERUNS = 3

Warn = Callable[[str], None]


@dataclass(frozen=True)
class MicroPlan:
    phases: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    prompt_tokens: int
    gen_tokens: int
    iterations: int
    warmup: int = 0
    chunk_tokens: tuple[int, ...] = DEFAULT_CHUNK_TOKENS
    injections: int = 4  # M: injected chunk requests per mixed run
    max_gen_tokens: int = 4096  # cap on the mixed decoders' length N₂
    # Further prompt lengths at which the decode phase is repeated: with one context only, the
    # KV read per token cannot be told from the per-sequence cost (both grow with B).
    context_prompt_tokens: tuple[int, ...] = ()
    # Run a decode run again longer when no step had every decoder decoding (decode_together).
    # Off only to reproduce a bench from before it (the shipped truth calibration).
    rerun_staggered: bool = True
    # Each mixed run's chunk is its planned size plus an offset below this (tile_phase_offset),
    # so the step's tokens B + C do not sit at B's phase of every GEMM tile; 0: as planned.
    chunk_phase_tokens: int = TILE_PHASE_TOKENS


@dataclass(frozen=True)
class DecodeRun:
    """B decoders started together: their decode window and step time."""

    step_s: float
    steps_per_seq: float
    first_token_max_s: float  # the decoders' prefill is over by then
    done_min_s: float
    window_s: float  # last done − last first token
    mean_duration_s: float  # mean over sequences of done − first token
    # Steps the first decoders streamed before the last one's first token (the batch's staggered
    # prefill, read off the chunk trace; 0 without one).
    lead_steps: int = 0
    # Not decoded together, and decode_together could not run it longer: the longer decoders
    # would outgrow the KV cache.
    outgrew_cache: bool = False

    @property
    def decoded_together(self) -> bool:
        """False when the trace shows a staggered prefill and no step with every decoder decoding
        (the last began after the first finished): step_s is then the sequences' mean step,
        prefill steps and a shrinking batch included."""
        return self.lead_steps == 0 or self.done_min_s > self.first_token_max_s


def check_sd_config(server: BenchServer) -> ServerInfo:
    """``info()``, cross-checked with the counters: SD series present ⇔ draft_length > 0."""
    info = server.info()
    counters = server.counters()
    has_sd = counters.accepted_tokens is not None or counters.drafts is not None
    if has_sd and info.draft_length <= 0:
        raise ProbeError("the server exports spec-decode counters (SD on) but draft_length is 0: pass --draft-length")
    if not has_sd and info.draft_length > 0:
        raise ProbeError(f"draft_length is {info.draft_length} but the server has no spec-decode counters: is SD on?")
    return info


def check_results(requests: Sequence[ProbeRequest], results: Sequence[ProbeResult]) -> None:
    """Every request came back with exactly the asked-for token counts."""
    if len(results) != len(requests):
        raise ProbeError(f"sent {len(requests)} requests, got {len(results)} results")
    for req, res in zip(requests, results, strict=True):
        if res.generated_tokens != req.max_tokens or res.prompt_tokens != req.prompt_tokens:
            raise ProbeError(
                f"asked for {req.prompt_tokens}+{req.max_tokens} tokens, "
                f"server reported {res.prompt_tokens}+{res.generated_tokens}"
            )


def accepted_now(server: BenchServer) -> float:
    value = server.counters().accepted_tokens
    if value is None:
        raise ProbeError("lost the spec-decode accepted-tokens counter")
    return value


def steps_per_seq(gen_tokens: int, batch_size: int, draft_length: int, accepted_delta: float) -> float:
    """Decode steps per sequence after the prefill step (which yields the first token)."""
    if draft_length <= 0:
        return float(gen_tokens - 1)
    return (batch_size * (gen_tokens - 1) - accepted_delta) / batch_size


def probe_checked(server: BenchServer, requests: Sequence[ProbeRequest]) -> list[ProbeResult]:
    results = server.probe(requests)
    check_results(requests, results)
    return results


def decoders(batch_size: int, prompt_tokens: int, gen_tokens: int) -> list[ProbeRequest]:
    return [ProbeRequest(0.0, prompt_tokens, gen_tokens, trace=True) for _ in range(batch_size)]


def traced_step_s(results: Sequence[ProbeResult], lo_s: float, hi_s: float) -> float | None:
    """Mean step time while every decoder was decoding: the chunk intervals inside [lo, hi].

    A streamed chunk is one engine step's output, so counting a sequence's chunks counts steps,
    whatever its acceptance; steps in which other prompts were still prefilling (before the
    last first token) or the batch was shrinking (after the first finish) are left out.
    """
    span = intervals = 0.0
    for r in results:
        inside = [t for t in r.token_times_s if lo_s - 1e-9 <= t <= hi_s + 1e-9]
        if len(inside) >= 2:
            span += inside[-1] - inside[0]
            intervals += len(inside) - 1
    return span / intervals if intervals > 0 else None


def decode_window(results: Sequence[ProbeResult], steps: float) -> DecodeRun:
    """Step time of a decode run: from the chunk trace where the server streams one, else from
    the sequences' own decode durations.

    With SD the sequences need different numbers of steps (each has its own acceptance), and
    only the mean is known (from the counter): the mean duration over the mean step count is
    unbiased, while the batch's whole window is set by its slowest sequence and would not be.
    """
    if steps <= 0:
        raise ProbeError(f"no decode steps to divide by ({steps:g}): gen tokens too few for the accepted count")
    first = max(r.first_token_s for r in results)
    last_start = min(r.done_s for r in results)
    window = max(max(r.done_s for r in results) - first, 0.0)
    mean_duration = statistics.fmean(max(r.done_s - r.first_token_s, 0.0) for r in results)
    step = traced_step_s(results, first, last_start)
    if step is None:
        step = mean_duration / steps
    lead = max(sum(1 for t in r.token_times_s if t < first - 1e-9) for r in results)
    return DecodeRun(step, steps, first, last_start, window, mean_duration, lead)


def decode_together(
    server: BenchServer,
    batch: int,
    prompt_tokens: int,
    gen_tokens: int,
    gamma: int,
    reruns: int = DECODE_RERUNS,
    kv_cache_tokens: int | None = None,
) -> tuple[DecodeRun, int]:
    """A decode run in which some steps had every decoder decoding, and the tokens each
    generated (pass them to the next run of the same batch).

    On a step budget the batch's prompts take ⌈B·P/budget⌉ steps to prefill, and the first
    decoders run ahead meanwhile: with 2048 tokens, 100 decoders of 2048-token prompts take 100
    steps to start, and 256 tokens at γ = 4 end the first before the last begins, so no step is
    all-decode and the run times prefills. The chunk trace shows it (and vLLM's /metrics does
    not show the budget): such a run is repeated longer by the steps the first decoders
    streamed before the last one's first token, γ + 1 tokens each, at most ``reruns``
    times. The batch's mean context over the all-decode window is still P + N/2. Not where the
    longer decoders would outgrow ``kv_cache_tokens`` (vLLM would preempt): the run is returned
    marked ``outgrew_cache``.
    """
    gen = gen_tokens
    run = decode_run(server, batch, prompt_tokens, gen, gamma)
    for _ in range(reruns):
        if run.decoded_together:
            break
        longer = gen + (gamma + 1) * run.lead_steps
        if kv_cache_tokens is not None and batch * (prompt_tokens + longer + gamma) > kv_cache_tokens:
            run = replace(run, outgrew_cache=True)
            break
        gen = longer
        run = decode_run(server, batch, prompt_tokens, gen, gamma)
    return run, gen


def decode_run(server: BenchServer, batch: int, prompt_tokens: int, gen_tokens: int, gamma: int) -> DecodeRun:
    before = accepted_now(server) if gamma > 0 else 0.0
    results = probe_checked(server, decoders(batch, prompt_tokens, gen_tokens))
    delta = accepted_now(server) - before if gamma > 0 else 0.0
    return decode_window(results, steps_per_seq(gen_tokens, batch, gamma, delta))


def prefill_latency_s(server: BenchServer, batch: int, prompt_tokens: int) -> float:
    results = probe_checked(server, decoders(batch, prompt_tokens, 1))
    return max(r.done_s for r in results) - min(r.sent_s for r in results)


@dataclass(frozen=True)
class MixedLayout:
    """Where the injections go and how long the decoders must run to cover them."""

    gen_tokens: int  # N₂
    injections_at_s: tuple[float, ...]


class InjectionOutsideWindow(ProbeError):
    """An injected chunk was not served while every decoder was still decoding."""


class MixedOutgrowsCache(ProbeError):
    """A mixed run whose decoders and chunk would not fit the server's KV cache together."""


def kv_shortfall(info: ServerInfo, batch: int, prompt_tokens: int, chunk: int, layout: MixedLayout) -> str | None:
    """Why a mixed run cannot be timed in this server's KV cache, or None when it fits.

    At their end the decoders hold P + N₂ tokens each (and γ of lookahead), beside the chunk
    being injected. Past the cache vLLM preempts a decoder and the injection waits for blocks:
    the run would time recomputation, or not finish inside the decoders' window at all.
    """
    cap = info.kv_cache_tokens
    if cap is None:
        return None
    block = info.block_size or 16
    per_decoder = math.ceil((prompt_tokens + layout.gen_tokens + info.draft_length) / block) * block
    need = batch * per_decoder + math.ceil(chunk / block) * block
    if need <= cap:
        return None
    return (
        f"mixed B={batch} C={chunk}: {batch} decoders of {prompt_tokens} + {layout.gen_tokens} tokens beside the chunk"
        f" need {need} KV tokens, the cache holds {cap} (vLLM would preempt); skipped"
    )


def mixed_layout(
    pilot: DecodeRun, gen_tokens: int, chunk_latency_s: float, plan: MicroPlan, margin: float = 1.0
) -> MixedLayout:
    """Injections after twice the decoders' prefill time, ``2·t_chunk + 3·τ`` apart (so each
    finishes, at most one step late, before the next arrives); N₂ long enough for all plus one
    spacing of tail, times ``margin``."""
    tau = pilot.step_s
    if tau <= 0:
        raise ProbeError("mixed: the pilot decode step took no time; cannot place injections")
    tokens_per_step = (gen_tokens - 1) / pilot.steps_per_seq
    start = 2 * pilot.first_token_max_s + 2 * tau
    spacing = 2 * chunk_latency_s + 3 * tau
    window = start + (plan.injections + 1) * spacing
    n2 = max(gen_tokens, math.ceil(margin * window / tau * tokens_per_step) + 1)
    if n2 > plan.max_gen_tokens:
        raise ProbeError(
            f"mixed: decoders would need {n2} tokens (> {plan.max_gen_tokens}) to cover "
            f"{plan.injections} injections of {chunk_latency_s:.3f} s chunks; use smaller --chunk-tokens"
        )
    return MixedLayout(n2, tuple(start + k * spacing for k in range(plan.injections)))


def _traced_mixed_steps(
    dec_results: Sequence[ProbeResult], inj_results: Sequence[ProbeResult], tau_s: float
) -> float | None:
    """Mean duration of the steps that carried an injected prompt, read off the chunk trace.

    The injected request's only token comes out of the step that prefilled it, at the same
    moment as the decoders' chunks of that step: the decoders' chunk interval ending there is
    the mixed step. None when the trace does not show it (no trace, or no chunk lines up).
    """
    tolerance = 0.3 * tau_s
    steps = []
    for inj in inj_results:
        gaps = []
        for r in dec_results:
            times = r.token_times_s
            if len(times) < 2:
                continue
            j = min(range(len(times)), key=lambda k: abs(times[k] - inj.done_s))
            if j > 0 and abs(times[j] - inj.done_s) <= tolerance:
                gaps.append(times[j] - times[j - 1])
        if gaps:
            steps.append(statistics.median(gaps))
    return statistics.fmean(steps) if len(steps) == len(inj_results) else None


def mixed_step_s(
    server: BenchServer,
    batch: int,
    prompt_tokens: int,
    chunk_tokens: int,
    layout: MixedLayout,
    gamma: int,
    warn: Warn | None = None,
) -> float:
    """One mixed-step measurement: run A (decoders alone) then run B (with injections)."""
    base = decode_run(server, batch, prompt_tokens, layout.gen_tokens, gamma)
    dec = decoders(batch, prompt_tokens, layout.gen_tokens)
    injected = [ProbeRequest(t, chunk_tokens, 1) for t in layout.injections_at_s]
    before = accepted_now(server) if gamma > 0 else 0.0
    results = probe_checked(server, dec + injected)
    delta = accepted_now(server) - before if gamma > 0 else 0.0
    dec_results, inj_results = results[:batch], results[batch:]
    run = decode_window(dec_results, steps_per_seq(layout.gen_tokens, batch, gamma, delta))
    for r in inj_results:
        if r.sent_s < run.first_token_max_s or r.done_s > run.done_min_s:
            raise InjectionOutsideWindow(
                f"mixed B={batch}: a {chunk_tokens}-token injection at {r.sent_s:.3f}–{r.done_s:.3f} s fell "
                f"outside the decoders' window {run.first_token_max_s:.3f}–{run.done_min_s:.3f} s "
                f"(N₂ = {layout.gen_tokens} tokens; server timing unstable?)"
            )
    traced = _traced_mixed_steps(dec_results, inj_results, base.step_s)
    if traced is not None:
        latency_s = traced
    else:
        extra_s = (run.mean_duration_s - run.steps_per_seq * base.step_s) / len(injected)
        latency_s = base.step_s + extra_s
    own_s = statistics.fmean(r.done_s - r.sent_s for r in inj_results) - base.step_s / 2
    if warn is not None and abs(own_s - latency_s) > CROSS_CHECK_TOLERANCE * max(latency_s, 1e-9):
        warn(
            f"mixed B={batch} C={chunk_tokens}: step {latency_s * 1e3:.2f} ms from the decoders, "
            f"{own_s * 1e3:.2f} ms from the injected requests"
        )
    return max(latency_s, 0.0)


def tile_phase_offset(step_tokens: int, row: int, span: int) -> int:
    """Tokens added to a planned chunk so that the mixed step's tokens (``step_tokens``: the
    decoders' and the planned chunk's) land at the ``row``-th phase of a golden-ratio walk over
    [0, span): the plan's (B, C) pairs, numbered in order, then cover the tile phases evenly, and
    the same plan always runs the same chunks.

    The walk is over the step's phase, not the offset's: a bench's batches are often a tile's
    divisor apart (every 8), and an offset walking by the batch alone moved with it (8·φ is
    0.94 past a whole number), so B + C sat within a few tokens of one phase over a chunk's
    rows and the line fitted through them read the tiles' cheapest or dearest corner."""
    if span <= 1:
        return 0
    want = int(((row * _GOLDEN) % 1.0) * span)
    return (want - step_tokens) % span


def chunks_beside(
    chunks: Sequence[int], batch: int, tokens_per_seq: int, budget: int | None, warn: Warn | None = None
) -> list[int]:
    """The prompt chunks one step can carry beside ``batch`` decoding sequences, in plan order.

    vLLM schedules the running sequences first and gives a waiting prompt what is left of the
    step's token budget, so a larger chunk never rides one step: it would span several and the
    run would time neither a mixed step nor a prefill. Such a chunk is measured at the budget's
    remainder instead (once, however many planned chunks exceed it); none fits when the decode
    tokens alone fill the budget.
    """
    if budget is None:
        return list(chunks)
    room = budget - batch * tokens_per_seq
    out: list[int] = []
    for chunk in chunks:
        fits = min(chunk, room)
        if fits < chunk and warn is not None:
            warn(
                f"mixed B={batch} C={chunk}: the step budget {budget} leaves {max(room, 0)} tokens beside"
                f" {batch * tokens_per_seq} decode tokens; " + (f"measured at C={fits}" if fits >= 1 else "skipped")
            )
        if fits >= 1 and fits not in out:
            out.append(fits)
    return out


def _mixed_step_with_retries(
    server: BenchServer,
    batch: int,
    plan: MicroPlan,
    chunk: int,
    pilot: DecodeRun,
    pilot_gen_tokens: int,
    single: ProbeResult,
    layout: MixedLayout,
    info: ServerInfo,
    warn: Warn | None,
) -> tuple[float, MixedLayout]:
    """A mixed step and the layout it ran with; when an injection outlasts a decoder, again
    with longer decoders.

    With SD each decoder accepts at its own rate, and in a big batch the luckiest one finishes
    well before the mean the layout was sized by: N₂ grows by ``MIXED_RETRY_MARGIN`` per retry,
    as long as the longer decoders still fit the KV cache (:class:`MixedOutgrowsCache` if not).
    """
    for retry in range(1, MIXED_RETRIES + 1):
        try:
            return mixed_step_s(server, batch, plan.prompt_tokens, chunk, layout, info.draft_length, warn), layout
        except InjectionOutsideWindow:
            margin = MIXED_RETRY_MARGIN**retry
            layout = mixed_layout(pilot, pilot_gen_tokens, single.done_s - single.sent_s, plan, margin)
            if (why := kv_shortfall(info, batch, plan.prompt_tokens, chunk, layout)) is not None:
                raise MixedOutgrowsCache(why) from None
    return mixed_step_s(server, batch, plan.prompt_tokens, chunk, layout, info.draft_length, warn), layout


def _timed_together(
    phase: str, batch: int, prompt_tokens: int, run: DecodeRun, warn: Warn | None, said: set[tuple[int, int]]
) -> bool:
    """False for a run with no step that had every decoder decoding, which the KV cache kept
    from being run longer: said once per batch and prompt length, and the row is left out.

    On a small step budget a batch of long prompts takes a step or more each to prefill, and a
    run long enough to outlast that stagger would outgrow the KV cache (decode_together stops
    there): the mean step it saw carries prefill chunks, 16–67 % above the decode step on the
    simulated A100 at 2048 tokens, 120–144 sequences of 2048-token prompts, and just under the
    cache, where calibrate keeps it. A run still staggered after its reruns (requests reaching
    the server further apart than its steps) is kept, its mean step as before: without it a
    bench could end with no decode rows at all.
    """
    if not run.outgrew_cache:
        return True
    if warn is not None and (batch, prompt_tokens) not in said:
        said.add((batch, prompt_tokens))
        warn(
            f"{phase} B={batch} at {prompt_tokens}-token prompts: no step had every decoder decoding"
            f" (their prefill staggered over {run.lead_steps} steps, and a longer run would outgrow the"
            " KV cache); skipped"
        )
    return False


def run_micro(
    server: BenchServer,
    plan: MicroPlan,
    progress: Callable[[int], None] | None = None,
    warn: Warn | None = None,
) -> list[BenchRow]:
    """Every phase of ``plan`` against ``server``; warm-up iterations are run, not returned."""
    info = check_sd_config(server)
    gamma = info.draft_length
    if "target" in plan.phases and gamma > 0:
        raise ProbeError(f"phase target needs a server without SD (this one has draft_length {gamma}): use verify")
    if "verify" in plan.phases and gamma <= 0:
        raise ProbeError("phase verify needs a server with SD (draft_length > 0)")
    decode_phase = next((p for p in plan.phases if p in ("target", "verify")), None)
    tokens_per_seq = gamma + 1
    reruns = DECODE_RERUNS if plan.rerun_staggered else 0
    rows: list[BenchRow] = []
    said: set[tuple[int, int]] = set()  # (batch, prompt tokens) of the decode runs left out
    for batch_index, batch in enumerate(plan.batch_sizes):
        pilot: DecodeRun | None = None
        gen = plan.gen_tokens
        for it in range(plan.warmup + plan.iterations):
            recorded = it - plan.warmup
            if "prefill" in plan.phases:
                t = prefill_latency_s(server, batch, plan.prompt_tokens)
                if recorded >= 0:
                    rows.append(BenchRow("prefill", batch, plan.prompt_tokens, plan.prompt_tokens, recorded, t, gamma))
            if decode_phase is not None:
                pilot, gen = decode_together(
                    server, batch, plan.prompt_tokens, gen, gamma, reruns, info.kv_cache_tokens
                )
                if recorded >= 0 and _timed_together(decode_phase, batch, plan.prompt_tokens, pilot, warn, said):
                    context_len = plan.prompt_tokens + gen // 2
                    rows.append(
                        BenchRow(decode_phase, batch, tokens_per_seq, context_len, recorded, pilot.step_s, gamma)
                    )
        if decode_phase is not None:
            for extra_p in plan.context_prompt_tokens:
                extra_gen = plan.gen_tokens
                for it in range(plan.warmup + plan.iterations):
                    run, extra_gen = decode_together(
                        server, batch, extra_p, extra_gen, gamma, reruns, info.kv_cache_tokens
                    )
                    if it >= plan.warmup and _timed_together(decode_phase, batch, extra_p, run, warn, said):
                        ctx = extra_p + extra_gen // 2
                        rows.append(
                            BenchRow(decode_phase, batch, tokens_per_seq, ctx, it - plan.warmup, run.step_s, gamma)
                        )
        full = info.max_num_seqs is not None and batch >= info.max_num_seqs
        if "mixed" in plan.phases and full and warn is not None:
            warn(
                f"mixed B={batch}: no free slot for a prompt beside a full batch (max_num_seqs {info.max_num_seqs}); skipped"
            )
        if "mixed" in plan.phases and not full:
            if pilot is None:
                pilot, gen = decode_together(
                    server, batch, plan.prompt_tokens, gen, gamma, reruns, info.kv_cache_tokens
                )
            first_row = batch_index * len(plan.chunk_tokens)
            planned = [
                c + tile_phase_offset(batch * tokens_per_seq + c, first_row + i, plan.chunk_phase_tokens)
                for i, c in enumerate(plan.chunk_tokens)
            ]
            for chunk in chunks_beside(planned, batch, tokens_per_seq, info.max_num_batched_tokens, warn):
                single = probe_checked(server, [ProbeRequest(0.0, chunk, 1)])[0]
                layout = mixed_layout(pilot, gen, single.done_s - single.sent_s, plan)
                if (why := kv_shortfall(info, batch, plan.prompt_tokens, chunk, layout)) is not None:
                    if warn is not None:
                        warn(why)
                    continue
                for it in range(plan.warmup + plan.iterations):
                    # A layout that needed longer decoders keeps them for the next iterations.
                    try:
                        t, layout = _mixed_step_with_retries(
                            server, batch, plan, chunk, pilot, gen, single, layout, info, warn
                        )
                    except MixedOutgrowsCache as exc:  # the iterations already timed stay
                        if warn is not None:
                            warn(str(exc))
                        break
                    if it >= plan.warmup:
                        ctx = plan.prompt_tokens + layout.gen_tokens // 2
                        rows.append(BenchRow("mixed", batch, tokens_per_seq, ctx, it - plan.warmup, t, gamma, chunk))
        if progress is not None:
            progress(batch)
    if info.kv_cache_tokens is not None:
        rows.append(BenchRow("kv_cache", 1, 1, info.kv_cache_tokens, 0, 0.0, gamma))
    if info.prefix_caching is not None:  # a fact as context_len: 1 on, 0 off
        rows.append(BenchRow("prefix_caching", 1, 1, int(info.prefix_caching), 0, 0.0, gamma))
    return rows
