"""The latency model: request latency with and without speculative decoding at a given load.

Pure Python and numpy, no I/O. docs/model.md derives every term; in short:

* One engine step is one forward pass of the target over every token scheduled in it (each
  running sequence's decode or verify tokens plus any prompt chunk), costing
  ``t(x, z) = a + b·x + Σ_j d_j·max(0, x − k_j) + c·z`` for ``x`` tokens and ``z`` KV tokens read
  (:class:`StepCost`; the knee is where the pass turns compute-bound). With SD a step also runs
  the draft γ times and pays a fixed verification overhead.
* A running batch of B sequences reads ``z = B·ctx`` KV tokens per step, where ``ctx`` is the
  *residence-weighted* context (:meth:`Workload.mean_context_tokens`): long generations stay
  longer, so the batch holds more long contexts than the request mix suggests.
* Every arriving prompt rides in one step of the running batch and makes it longer by its
  *marginal* cost on that mixed step, ``Δ(B) = t(k·B + P) − t(k·B)`` (plus the draft's prefill
  of the same prompt with SD); during a request's residence ``λ·T = B`` prompts arrive
  (Little), so it waits ``B·Δ(B)`` behind other prompts. Its own prompt costs one mixed step.
* ``T(B) = (n_steps + 1.5)·τ(B) + (B + 1)·Δ(B)``: ``n_steps = (G − 1)/E[N]`` decode (verify)
  steps after the prefill step, half a step of waiting for the step in flight, and the prompt
  terms. An arrival also waits for the step in flight weighted by its length (a step carrying
  a prompt is Δ longer): ``λ·R(B)`` more, ``R = E[Δ]·(τ + q·E[Δ])/2`` (:func:`_with_wait`). At a
  given λ, T is piecewise quadratic in B, so ``B = λ·T(B)`` is solved exactly, segment by segment.
* The batch is bounded by ``max_num_seqs`` and by the KV cache (with SD the draft's weights and
  KV leave less). The stability limit is the highest throughput ``B/T(B)`` below that bound (or
  where the token budget starves prefill). Arrivals are Poisson, so the number of requests in
  the server wanders around the fixed point: the mean latency is taken over the birth–death
  chain of that number (:mod:`controller.queueing`), which rises smoothly to the limit and
  queues past the bound.
* Prediction intervals scale every step cost by ``1 ± z·σ`` (σ from calibration residuals);
  scaling all costs by ``s`` maps ``T(λ)`` to ``s·T(s·λ)``, so an interval costs no new solve.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import operator
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from statistics import NormalDist
from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike

from controller.acceptance import accepted_length as _accepted_length
from controller.queueing import (
    MAX_PROMPT_SHARE,
    MAX_STATES,
    Bursts,
    burst_product_fits,
    burst_time_in_system,
    burst_time_in_system_below,
    bursts_of,
    cumulative_log_rates,
    inverse_rates,
    length_overlap,
    mean_time_in_system,
    mean_time_in_system_below,
    mean_time_in_window,
    queue_variability,
)
from controller.treads import riser_nodes, table_period

DEFAULT_DRAFT_LENGTHS = tuple(range(1, 17))
DEFAULT_THRESHOLDS = (1.0, 1.05, 1.2)
# The draft-length search stops this many candidates past the best one (see best_draft_length):
# one past chose as trying all 16 in 1,944 of 1,944 cases (the example and the 17 stored truth
# calibrations × acceptances × workloads × loads), and saves a curve build a fresh decision.
DRAFT_SEARCH_PATIENCE = 1
# Where capacity decides (SD overloaded at every γ tried, or the best past NEAR_CAPACITY of its
# limit) the search goes on to this many past the highest capacity:
# a capacity bound by the KV cache ripples by 1–2 % from one γ to the next (the L40S calibrations).
# Over 3,780 loads at or past capacity (the example and the 20 stored calibrations × 6 acceptances
# × 5 workloads × 6 loads; 2,807 overloaded at every γ), two past chose otherwise than trying all
# 16 in 80 cases more than the search had before; three past, in none.
CAPACITY_SEARCH_PATIENCE = 3
# Near its limit a draft's latency is its capacity's: past this share of the best draft's limit
# the search also goes on while a longer draft's capacity still rises (CAPACITY_SEARCH_PATIENCE).
# Stopping one past the best chose a draft up to 5.4× slower than trying all in 48 of those 3,780
# loads (a longer draft with more capacity behind one that overloads); going on, in none, for 2 %
# more curves built over 3,780 loads below the plain limit.
NEAR_CAPACITY = 0.9
# Generated lengths vary; when no source measured their spread, assume what a per-token stop
# probability gives (geometric lengths: standard deviation ≈ mean).
DEFAULT_GEN_CV = 1.0
# Half-width of a prediction interval in units of the calibration's relative residual (≈ 90 %).
INTERVAL_Z = 1.645
PREFILL_WAIT_STEPS = 1.5  # half a step in flight + the prompt's own (mixed) step


@dataclass(frozen=True)
class StepCost:
    """Cost in seconds of one forward pass.

    ``t(x, z, s, a) = intercept_s + slope_s_per_token·x + Σ_j knee_slope_deltas[j]·max(0, x − knees_tokens[j])
    + context_s_per_token·z + seq_s·s + pair_s·a``: continuous, piecewise linear in the pass's
    tokens ``x``, linear in the KV tokens read ``z``, in the sequences ``s`` it carries (sampling
    and scheduling are paid per sequence, so a decode token costs more than a prompt token) and
    in the query–key pairs ``a`` of its prompt chunks' attention (a prompt of P tokens attends
    P²/2 pairs: what makes a long prompt cost more per token than a short one).
    """

    intercept_s: float
    slope_s_per_token: float
    knees_tokens: tuple[float, ...] = ()
    knee_slope_deltas: tuple[float, ...] = ()
    context_s_per_token: float = 0.0
    seq_s: float = 0.0
    pair_s: float = 0.0

    def __post_init__(self) -> None:
        if len(self.knees_tokens) != len(self.knee_slope_deltas):
            raise ValueError("knees_tokens and knee_slope_deltas must have the same length")

    def __call__(
        self, tokens: ArrayLike, context_tokens: ArrayLike = 0.0, seqs: ArrayLike = 0.0, pairs: ArrayLike = 0.0
    ) -> np.ndarray:
        x = np.asarray(tokens, dtype=float)
        t = self.intercept_s + self.slope_s_per_token * x
        for knee, delta in zip(self.knees_tokens, self.knee_slope_deltas, strict=True):
            t = t + delta * np.maximum(0.0, x - knee)
        t = t + self.context_s_per_token * np.asarray(context_tokens, dtype=float)
        return t + self.seq_s * np.asarray(seqs, dtype=float) + self.pair_s * np.asarray(pairs, dtype=float)

    def scalar(self, tokens: float, context_tokens: float = 0.0, seqs: float = 0.0, pairs: float = 0.0) -> float:
        """Same as calling it, on plain floats (the fast path)."""
        t = self.intercept_s + self.slope_s_per_token * tokens
        for knee, delta in zip(self.knees_tokens, self.knee_slope_deltas, strict=True):
            if tokens > knee:
                t += delta * (tokens - knee)
        return t + self.context_s_per_token * context_tokens + self.seq_s * seqs + self.pair_s * pairs

    def scaled(self, factor: float) -> StepCost:
        return StepCost(
            self.intercept_s * factor,
            self.slope_s_per_token * factor,
            self.knees_tokens,
            tuple(d * factor for d in self.knee_slope_deltas),
            self.context_s_per_token * factor,
            self.seq_s * factor,
            self.pair_s * factor,
        )

    @property
    def is_zero(self) -> bool:
        return (
            self.intercept_s == 0.0
            and self.slope_s_per_token == 0.0
            and self.context_s_per_token == 0.0
            and self.seq_s == 0.0
            and self.pair_s == 0.0
            and not any(self.knee_slope_deltas)
        )


ZERO_COST = StepCost(0.0, 0.0)


@dataclass(frozen=True)
class Moe:
    """Mixture-of-experts target: weight traffic follows the distinct experts a step touches."""

    num_experts: int
    top_k: int

    def __post_init__(self) -> None:
        if not (1 <= self.top_k <= self.num_experts):
            raise ValueError("MoE needs 1 <= top_k <= num_experts")

    def effective_tokens(self, tokens: ArrayLike) -> np.ndarray:
        """Tokens-equivalent weight traffic: (E/k)·(1 − (1 − k/E)^x).

        E·(1 − (1 − k/E)^x) distinct experts are read for x tokens; dividing by k makes it equal
        to x for a single token, so the fitted per-token slope keeps its meaning.
        """
        x = np.asarray(tokens, dtype=float)
        e, k = float(self.num_experts), float(self.top_k)
        if k == e:  # every token touches every expert: constant traffic
            return np.where(x > 0, 1.0, 0.0)
        return (e / k) * (1.0 - (1.0 - k / e) ** x)


@functools.lru_cache(maxsize=64)
def _moe_in_tokens(cost: StepCost, moe: Moe, max_tokens: float) -> StepCost:
    """``cost`` (fitted in effective tokens) as a piecewise-linear function of real tokens.

    Effective tokens are concave in x; sampled on a geometric grid and joined by straight lines
    (hinges with negative slope changes), the model stays piecewise linear and exact to ~1 %.
    """
    xs = np.unique(np.concatenate([[0.0, 1.0], np.geomspace(1.0, max(max_tokens, 2.0), 40)]))
    ts = np.asarray(cost(moe.effective_tokens(xs)))
    slopes = np.diff(ts) / np.diff(xs)
    return StepCost(
        float(ts[0]),
        float(slopes[0]),
        tuple(float(x) for x in xs[1:-1]),
        tuple(float(d) for d in np.diff(slopes)),
        cost.context_s_per_token,
        cost.seq_s,
        cost.pair_s,
    )


def _hash_once(obj) -> int:
    """A frozen dataclass's field hash, kept on it: a model and a workload key the curve
    caches, looked up on every evaluation, and their fields need hashing only once."""
    h = obj.__dict__.get("_hash")
    if h is None:
        h = hash(tuple(getattr(obj, f.name) for f in fields(obj)))
        object.__setattr__(obj, "_hash", h)
    return h


@dataclass(frozen=True)
class LatencyModel:
    """Calibrated pass costs plus the serving limits the fixed point needs.

    ``target`` prices every target forward pass (decode, verify, prompt chunks). ``draft`` one
    draft pass (zero for n-gram lookup). ``verify`` and ``prefill`` exist for calibrations from
    before mixed-step benchmarks (schema 1): when set, ``verify`` prices the whole SD step over
    B·(γ+1) tokens and ``prefill`` a prompt's stand-alone cost.
    """

    target: StepCost
    draft: StepCost = ZERO_COST
    sd_overhead_s: float = 0.0  # per SD step: rejection sampling, proposer bookkeeping
    draft_prefills: bool = True  # a draft model prefills every prompt (n-gram lookup does not)
    verify: StepCost | None = None
    prefill: StepCost | None = None
    max_num_seqs: int = 256
    # vLLM's per-step token budget (max_num_batched_tokens); None: prefill never starves.
    max_num_batched_tokens: int | None = None
    # KV cache capacity in tokens of the server without / with SD (vllm:cache_config_info);
    # None: only max_num_seqs bounds the batch.
    kv_cache_tokens_off: float | None = None
    kv_cache_tokens_on: float | None = None
    # The server caches prefixes (vLLM's enable_prefix_caching, on by default since v1): a
    # preempted request's computed blocks stay cached until evicted, so its readmission
    # recomputes only what the running batch's growth evicted (_kv_thrash_rps).
    prefix_caching: bool = False
    moe: Moe | None = None
    # Load-test correction: multiplies every step cost of that mode (1.0 = micro-benchmark as is).
    scale_off: float = 1.0
    scale_on: float = 1.0
    # Relative error of one step's cost (calibration residuals): the prediction interval.
    relative_sd_off: float = 0.0
    relative_sd_on: float = 0.0
    # (batch size, seconds): the SD-off decode step's measured residual from ``target`` per
    # benchmarked batch size (GEMM tiles: a staircase around the fitted line); () = none.
    decode_staircase_off: tuple[tuple[float, float], ...] = ()
    # (target tokens in the step, seconds): the SD step's measured residual from its fitted
    # passes per benchmarked step size, B·(γ + 1), every draft length's together; () = none.
    verify_staircase_on: tuple[tuple[float, float], ...] = ()
    # (draft length, 0 = SD off; share of the tread): what a step carrying a prompt chunk keeps
    # of the staircase (prompt_step_tread); () = the whole tread, as calibrations from before
    # it were read.
    prompt_step_treads: tuple[tuple[float, float], ...] = ()

    def __hash__(self) -> int:  # curves are cached per model
        return _hash_once(self)


def prompt_step_tread(model: LatencyModel, draft_length: float) -> float:
    """The share of the tread a step carrying a prompt chunk pays, for SD off (``draft_length``
    0) or on at that draft length.

    The staircase is the decode (verify) step's residual at its batch: GEMMs run in whole tiles.
    A prompt chunk moves the step's tokens to B + C, anywhere on the tiles, so the target's
    passes cost the line; what stays at the batch's tread is what the chunk does not touch (with
    SD, the draft's γ − 1 single-token passes). The calibration measures it from its mixed rows;
    a draft length it never benched reads the nearest ones' (linear in γ between them).
    """
    sd = draft_length > 0
    known = [(g, share) for g, share in model.prompt_step_treads if (g > 0) == sd]
    if not known:
        return 1.0
    lengths, shares = zip(*known, strict=True)
    return float(np.interp(draft_length, lengths, shares))


_GH3 = ((1.0 / 6.0, -1.0), (2.0 / 3.0, 0.0), (1.0 / 6.0, 1.0))
MAX_PROMPT_CV = 10.0


def _log_sd(p: float, sd: float | None) -> float | None:
    """σ of ln P for a lognormal of mean ``p`` and standard deviation ``sd``; None: no spread."""
    if not sd or p <= 0:
        return None
    return math.sqrt(math.log1p(min(sd / p, MAX_PROMPT_CV) ** 2))


@functools.lru_cache(maxsize=1024)
def _prompt_nodes(p: float, sd: float | None) -> tuple[tuple[float, float], ...]:
    s = _log_sd(p, sd)
    if s is None:
        return ((1.0, p),)
    raw = [(w, math.exp(s * math.sqrt(3.0) * z)) for w, z in _GH3]
    norm = p / sum(w * x for w, x in raw)  # the nodes keep the measured mean exactly
    return tuple((w, x * norm) for w, x in raw)


# Δ(B)'s hinges: equal-probability bins of the prompt lengths, each at its conditional mean.
# The pass's knees make a prompt's marginal cost kinked in P, and Gauss–Hermite nodes (exact for
# smooth costs) miss a kink's mean by up to 4 % (the simulated L40S, 300-token prompts at batch
# 150; 2.0 % on H100 chat at batch 66); eight bins are within 0.7 % on the stored calibrations.
PROMPT_KNEE_BINS = 8


@functools.lru_cache(maxsize=1024)
def _prompt_bins(p: float, sd: float | None) -> tuple[tuple[float, float], ...]:
    s = _log_sd(p, sd)
    if s is None:
        return ((1.0, p),)
    # Bin (z_i, z_i+1) of ln P ~ N(μ, s²) holds 1/m of the prompts, with mean
    # E[P]·(Φ(z_i+1 − s) − Φ(z_i − s))·m: the bins keep the mean exactly.
    m, normal = PROMPT_KNEE_BINS, NormalDist()
    cuts = [normal.inv_cdf(i / m) - s for i in range(1, m)]
    cdf = [0.0, *(normal.cdf(z) for z in cuts), 1.0]
    return tuple((1.0 / m, p * m * (hi - lo)) for lo, hi in itertools.pairwise(cdf))


# What no request can be: no model reads or writes this many tokens. A mean or spread past it
# is a glitch (a counter that jumped, a cell with a stray exponent), never a workload.
MAX_TOKENS_PER_REQUEST = 10_000_000.0


@dataclass(frozen=True)
class Workload:
    """Request shape: mean prompt tokens P (C of them from the prefix cache), mean generated
    tokens G and the spreads."""

    prompt_tokens: float
    gen_tokens: float
    gen_tokens_std: float | None = None  # None: not measured, DEFAULT_GEN_CV·G assumed
    prompt_tokens_std: float | None = None  # None: not measured, every prompt taken as the mean
    # KV tokens the average running sequence holds, measured from vLLM's gauges
    # (controller.occupancy); None: derived from the length distribution.
    running_context_tokens: float | None = None
    # Prompt tokens per request served from vLLM's prefix cache (Δvllm:prompt_tokens_cached_total
    # / Δrequests; on by default in vLLM v1): not computed, but read by what is.
    cached_prompt_tokens: float = 0.0

    def __post_init__(self) -> None:
        # A NaN or a negative length reaches the chain as a non-positive rate, far from its cause.
        for name in ("prompt_tokens", "gen_tokens"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0.0):
                raise ValueError(f"workload {name}: {v!r} must be a finite number >= 0")
        if not math.isfinite(self.cached_prompt_tokens):  # a bad reading of it is clamped (cached_tokens)
            raise ValueError(f"workload cached_prompt_tokens: {self.cached_prompt_tokens!r} must be a finite number")
        for name in ("gen_tokens_std", "prompt_tokens_std", "running_context_tokens"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v >= 0.0):
                raise ValueError(f"workload {name}: {v!r} must be a finite number >= 0 (or None)")
        if self.gen_tokens <= 0.0:
            raise ValueError(f"workload gen_tokens: {self.gen_tokens!r} must be > 0")

    def __hash__(self) -> int:  # a key of every curve cache, looked up on each evaluation
        return _hash_once(self)

    @property
    def cached_tokens(self) -> float:
        """The prefix cache's hits per request, within [0, P − 1]: vLLM computes at least the
        last prompt token (it samples from it), and a bad reading must not cancel the prompt."""
        c = self.cached_prompt_tokens
        return min(c, max(float(self.prompt_tokens) - 1.0, 0.0)) if c > 0.0 else 0.0

    @property
    def computed_prompt_tokens(self) -> float:
        """Prompt tokens a request's prefill computes: P less its prefix-cache hits."""
        return float(self.prompt_tokens) - self.cached_tokens

    @property
    def prompt_nodes(self) -> tuple[tuple[float, float], ...]:
        """(weight, computed prompt tokens) quadrature of the prompt-length distribution.

        What a prompt costs is not linear in its length, so the mean cost is not the cost of
        the mean prompt. Lengths are taken as lognormal with the measured mean and spread;
        three Gauss–Hermite nodes reproduce its first five moments: the smooth terms' (the
        costs' spread q, prompts sharing a step, chunks) quadrature; Δ(B)'s knees are averaged
        over :attr:`prompt_bins`. A cached prefix (a system prompt: the same tokens for every
        request) shifts the mean, not the spread.
        """
        return _prompt_nodes(self.computed_prompt_tokens, self.prompt_tokens_std)

    @property
    def prompt_bins(self) -> tuple[tuple[float, float], ...]:
        """(weight, computed prompt tokens) of :data:`PROMPT_KNEE_BINS` equal-probability bins
        of the same lognormal, each at its conditional mean: what Δ(B)'s knees are averaged
        over (a kink's mean, which the smooth nodes miss)."""
        return _prompt_bins(self.computed_prompt_tokens, self.prompt_tokens_std)

    @property
    def prompt_pairs(self) -> float:
        """Mean query–key pairs of a prompt's own attention: E[P²]/2 (chunking does not change
        it), less the cached prefix's C²/2: the computed tokens at positions C…P still attend
        over the whole prefix, (P² − C²)/2, never less than the computed part's own."""
        sd = self.prompt_tokens_std or 0.0
        c, x = self.cached_tokens, self.computed_prompt_tokens
        return max(0.5 * (self.prompt_tokens * self.prompt_tokens + sd * sd - c * c), 0.5 * x * x)

    @property
    def gen_tokens_var(self) -> float:
        sd = DEFAULT_GEN_CV * self.gen_tokens if self.gen_tokens_std is None else self.gen_tokens_std
        return sd * sd

    @property
    def mean_context_tokens(self) -> float:
        """KV context of the average running sequence: measured, else P + E[G²]/(2·E[G]).

        A request with G tokens is in the batch for G steps, its context growing from P to
        P + G, so the batch's context is the residence-weighted mean: Σ_G G·(P + G/2) / Σ_G G.
        That takes P and G as independent; a measured context (vLLM's KV usage per running
        sequence) also holds when they are not, e.g. long prompts with short answers.

        With prefix-cache hits the measurement is an upper bound: it adds every request's hits
        back to the blocks held, but each prefix in use is held once too, so it counts that
        prefix's tokens once more for the batch (its C/B per sequence: +30 % at 7 running
        sequences behind 4 system prompts of 1.5k tokens, +1 % at 200). The lengths' value
        caps it then.
        """
        g = max(self.gen_tokens, 1e-9)
        lengths = self.prompt_tokens + (g * g + self.gen_tokens_var) / (2.0 * g)
        if self.running_context_tokens is None:
            return lengths
        measured = max(float(self.running_context_tokens), 1.0)
        return min(measured, max(lengths, 1.0)) if self.cached_tokens > 0.0 else measured

    @property
    def held_context_tokens(self) -> float:
        """KV tokens the average running sequence adds to a full cache: its context (capped
        as above) less the cached prefix, whose blocks every request of the prefix shares.

        Not the KV usage per running sequence as measured: that spreads each prefix in use over
        the sequences running then, a few at a light load, where the bound asks for a full
        cache's many (a prefix's one copy is left out: a few system prompts against 10⁵ tokens).
        """
        return max(self.mean_context_tokens - self.cached_tokens, 1.0)

    @property
    def service_scv(self) -> float:
        """Squared coefficient of variation of a request's service (steps ∝ generated tokens)."""
        g = max(self.gen_tokens, 1e-9)
        return self.gen_tokens_var / (g * g)

    def curve_terms(
        self,
    ) -> tuple[float, float, float, tuple[tuple[float, float], ...], tuple[tuple[float, float], ...]]:
        """(mean_context_tokens, E[P], prompt_pairs, prompt_nodes, prompt_bins), computed once
        and kept on the instance: every curve of a decision (both modes, each γ) reads them."""
        terms = self.__dict__.get("_curve_terms")
        if terms is None:
            nodes = self.prompt_nodes
            terms = (self.mean_context_tokens, sum(w * x for w, x in nodes), self.prompt_pairs, nodes, self.prompt_bins)
            object.__setattr__(self, "_curve_terms", terms)
        return terms


# --------------------------------------------------------------------------------------------
# T(B): piecewise linear τ(B) and Δ(B), then piecewise quadratic segments
# --------------------------------------------------------------------------------------------
# Both pieces are lines plus hinges w·max(0, B − at). Every step runs at batch B + 1 (a request
# shares its steps with the B = λ·T others and with itself), so the pieces are kept as functions
# of that shifted B from the start: a knee k of a pass over per_seq·(B + 1) + extra tokens is a
# hinge at (k − extra)/per_seq − 1. A hinge at or below 0 is active on all of B ≥ 0 and folds
# into the line: c0 −= w·at, c1 += w (the same step that switches a hinge on in _sweep).

Hinge = tuple[float, float]  # (at, w): w·max(0, B − at)
_AT = operator.itemgetter(0)


def _step_costs(model: LatencyModel, sd: bool) -> tuple[StepCost, StepCost, StepCost | None, StepCost | None]:
    """(target, draft, verify, prefill) of a mode, with its load-test scale and MoE applied."""
    scale = model.scale_on if sd else model.scale_off
    target, draft, verify, prefill = model.target, model.draft, model.verify, model.prefill
    if model.moe is not None:
        top = float(model.max_num_batched_tokens or 16384)
        target = _moe_in_tokens(target, model.moe, top)
        verify = _moe_in_tokens(verify, model.moe, top) if verify is not None else None
    if scale != 1.0:
        target, draft = target.scaled(scale), draft.scaled(scale)
        verify = verify.scaled(scale) if verify is not None else None
        prefill = prefill.scaled(scale) if prefill is not None else None
    return target, draft, verify, prefill


@dataclass(frozen=True)
class _ModeTerms:
    """What τ(B) and Δ(B) of one mode and draft length take from the calibration alone.

    Built once per (model, mode, γ) and cached: a fresh workload only adds its KV context, its
    prompt lengths and the hinges those lengths move (see :func:`mode_curve`).
    """

    step_tokens: float  # k: tokens each running sequence adds to a step (γ + 1 with SD)
    # τ(B) = step0 + step1·B + Σ step_hinges + step_ctx·ctx·(B + 1): B + 1 sequences read ctx each.
    step0: float
    step1: float
    step_ctx: float
    step_hinges: tuple[tuple[float, float, bool], ...]  # (at > 0, w, True), sorted
    # What of step1, step_ctx and the hinges the decoders' own tokens cost (decoding_share).
    decode1: float
    decode_ctx: float
    decode_hinges: tuple[tuple[float, float, bool], ...]
    # Δ(B) = E_P[Σ_cost t(k·(B + 1) + P) − t(k·(B + 1))] over the costs that price a prompt: the
    # slope terms leave prompt_slope·E[P], attention prompt_pairs·E[P²]/2, each knee a hinge
    # per prompt node (+ its weight, moved by P) and one against it (−, fixed: folded in here).
    prompt0: float
    prompt1: float
    prompt_slope: float
    prompt_pairs: float
    prompt_hinges: tuple[tuple[float, float, bool], ...]  # the fixed −t(k·(B + 1)) halves: (at > 0, w, False)
    prompt_knees: tuple[tuple[float, float], ...]  # (knee tokens, slope change·k)
    prefill: StepCost | None  # schema 1: a prompt costs its stand-alone prefill instead
    priced: tuple[StepCost, ...] = ()  # the passes that price a prompt (target, and the draft's with SD)


def _add_pass(line: list[float], hinges: list[Hinge], cost: StepCost, mult: float, per_seq: float) -> float:
    """Add ``mult`` passes of ``cost`` over ``per_seq·(B + 1)`` tokens of B + 1 sequences to
    ``line`` = [c0, c1] and ``hinges``; returns the passes' cost per KV token per sequence."""
    if mult == 0.0:
        return 0.0
    per_b = mult * (cost.slope_s_per_token * per_seq + cost.seq_s)
    line[0] += mult * cost.intercept_s + per_b
    line[1] += per_b
    for knee, delta in zip(cost.knees_tokens, cost.knee_slope_deltas, strict=True):
        _add_hinge(line, hinges, knee / per_seq - 1.0, mult * delta * per_seq)
    return mult * cost.context_s_per_token


def _add_hinge(line: list[float], hinges: list[Hinge], at: float, w: float) -> None:
    if at <= 0.0:
        line[0] -= w * at
        line[1] += w
    else:
        hinges.append((at, w))


@functools.lru_cache(maxsize=256)
def _mode_terms(model: LatencyModel, sd: bool, draft_length: float) -> _ModeTerms:
    target, draft, verify, prefill = _step_costs(model, sd)
    k = draft_length + 1.0 if sd else 1.0
    # The pass over the decoders' k tokens each (target or verify; schema 1 also the draft's first)
    # apart from the rest (the draft's single-token passes, the step's overhead): a sequence
    # computing its prompt is scheduled, and drafts, but adds no decode tokens (decoding_share).
    decode, decode_hinges = [0.0, 0.0], []
    decode_pass = verify if sd and verify is not None else target
    ctx_dec = _add_pass(decode, decode_hinges, decode_pass, 1.0, k)
    seq_s = decode_pass.seq_s
    step, step_hinges = [0.0, 0.0], []
    ctx = 0.0
    if sd:
        # Schema 1: verify prices the whole SD step in one fit. Schema 2: vLLM v1's proposer runs
        # one draft pass over the step's tokens (the verified γ+1 of each sequence), then γ − 1
        # single-token passes.
        if verify is None:
            ctx_dec += _add_pass(decode, decode_hinges, draft, 1.0, k)
            seq_s += draft.seq_s
            ctx += _add_pass(step, step_hinges, draft, draft_length - 1.0, 1.0)
        else:
            ctx += _add_pass(step, step_hinges, draft, draft_length, 1.0)
        step[0] += model.sd_overhead_s * model.scale_on
    priced = [] if prefill is not None else [target]
    if sd and model.draft_prefills and not draft.is_zero:
        priced.append(draft)
    prompt, prompt_hinges, knees = [0.0, 0.0], [], []
    for cost in priced:
        for knee, delta in zip(cost.knees_tokens, cost.knee_slope_deltas, strict=True):
            knees.append((knee, delta * k))
            _add_hinge(prompt, prompt_hinges, knee / k - 1.0, -delta * k)
    return _ModeTerms(
        k,
        step[0] + decode[0],
        step[1] + decode[1],
        ctx + ctx_dec,
        tuple(sorted((at, w, True) for at, w in step_hinges)),
        decode[1] - seq_s,
        ctx_dec,
        tuple(sorted((at, w, True) for at, w in decode_hinges)),
        prompt[0],
        prompt[1],
        sum(c.slope_s_per_token for c in priced),
        sum(c.pair_s for c in priced),
        tuple(sorted((at, w, False) for at, w in prompt_hinges)),
        tuple(knees),
        prefill,
        tuple(priced),
    )


def _with_wait(x: float, r: float, batch: float) -> float:
    """Time in system with B others when a request also waits λ·R for the step in flight.

    An arrival lands in a step with probability proportional to the step's length, so it waits
    E[S²]/(2·E[S]) for it, not half a mean step: with prompts arriving at λ, each making one step
    Δ longer, that is τ/2 + λ·(τ·E[Δ] + E[Δ²])/2. The τ/2 is in X (PREFILL_WAIT_STEPS); the rest is
    λ·R. At the fixed point λ = B/T, so T = X + B·R/T: the positive root of T² − X·T − B·R.
    """
    if r <= 0.0 or batch <= 0.0:
        return x
    return 0.5 * (x + math.sqrt(x * x + 4.0 * batch * r))


def _sweep(
    lines_at_0: tuple[float, float, float, float],
    hinges: list[tuple[float, float, bool]],
    steps: float,
    cap: float,
    prompt_q: float = 1.0,
):
    """T(B) = (steps + 1.5)·τ(B) + (B + 1)·Δ(B) on [0, cap], from the lines (τ0, τ1, Δ0, Δ1) in force
    at B = 0 in one sweep over the sorted hinges (``is_step``: a hinge of τ, else of Δ), each
    switching on where its segment starts.

    Returns the segments (start, end, c0, c1, c2), the lines (τ0, τ1, Δ0, Δ1) of τ and Δ on each,
    the wait coefficients (r0, r1, r2) on each: R(B) = ½·Δ(B)·(τ(B) + q·Δ(B)) of :func:`_with_wait`
    (``prompt_q`` = q = E[Δ²]/E[Δ]²),
    the segments' ends (the last one +inf, for bisection), the highest throughput B/T(B) up to
    each segment's end, the (batch, throughput) where it peaks, and each segment's
    (c0, c1, c2, r0, r1, r2, τ0, τ1, Δ0, Δ1) in one row (the chain's table, :func:`_chain_rates`).
    """
    m = steps + PREFILL_WAIT_STEPS
    s0, s1, d0, d1 = lines_at_0
    segments, lines, waits, ends, reach, rows = [], [], [], [], [], []
    best_b = best_h = top = lo = 0.0
    for at, w, is_step in (*hinges, (math.inf, 0.0, True)):
        if at > lo:  # the segment [lo, at) ends here
            hi = at if at < cap else cap
            c0, c1, c2 = m * s0 + d0, m * s1 + d0 + d1, d1
            segments.append((lo, hi, c0, c1, c2))
            lines.append((s0, s1, d0, d1))
            # R(B) = ½·Δ·(τ + q·Δ) expanded in B, inline: the sweep is most of a fresh curve's build.
            qd0 = prompt_q * d0
            r0, r1, r2 = (
                0.5 * d0 * (s0 + qd0),
                0.5 * (s0 * d1 + s1 * d0 + 2.0 * qd0 * d1),
                0.5 * d1 * (s1 + prompt_q * d1),
            )
            waits.append((r0, r1, r2))
            rows.append((c0, c1, c2, r0, r1, r2, s0, s1, d0, d1))  # the chain's table (_chain_rates)
            # B/T(B) on the segment peaks at its end or near √(c0/c2) inside (exactly there
            # without the wait, which is small beside X: the envelope moves the peak, not its value).
            bstar = math.sqrt(c0 / c2) if c2 > 0.0 and c0 > 0.0 else hi
            for b in (hi, bstar) if lo < bstar < hi else (hi,):
                t = c0 + c1 * b + c2 * b * b
                rb = r0 + r1 * b + r2 * b * b
                if rb > 0.0 and b > 0.0:  # _with_wait
                    t = 0.5 * (t + math.sqrt(t * t + 4.0 * b * rb))
                h = b / t if t > 0 else math.inf
                if h > best_h * (1.0 + 1e-12):
                    best_b, best_h = b, h
                if h > top:
                    top = h
            reach.append(top)
            if at >= cap:
                ends.append(math.inf)
                break
            ends.append(hi)
            lo = at
        if is_step:
            s0, s1 = s0 - w * at, s1 + w
        else:
            d0, d1 = d0 - w * at, d1 + w
    return tuple(segments), tuple(lines), tuple(waits), tuple(ends), tuple(reach), best_b, best_h, rows


def _fixed_point_on(lam: float, c0: float, c1: float, c2: float) -> float:
    """Smallest B ≥ 0 with B = λ·(c0 + c1·B + c2·B²); +inf when there is none."""
    qa, qb, qc = lam * c2, lam * c1 - 1.0, lam * c0
    if abs(qa) < 1e-300:
        return qc / -qb if qb < 0.0 else math.inf
    disc = qb * qb - 4.0 * qa * qc
    if disc < 0.0:
        return math.inf
    root = math.sqrt(disc)
    # Numerically stable roots; the fixed point reached from B = 0 is the smaller non-negative one.
    q = -0.5 * (qb - root) if qb < 0.0 else -0.5 * (qb + root)
    best = math.inf
    for r in (q / qa, qc / q if q != 0.0 else math.inf):
        if 0.0 <= r < best:
            best = r
    return best


def _latency_at(segments, waits, ends: tuple[float, ...], batch: float) -> float:
    """T(B) on the first segment ending at or above B (the last one past the bound)."""
    i = bisect.bisect_left(ends, batch)
    _lo, _hi, c0, c1, c2 = segments[i]
    r0, r1, r2 = waits[i]
    return _with_wait(c0 + c1 * batch + c2 * batch * batch, r0 + r1 * batch + r2 * batch * batch, batch)


# batch() skips the segments whose throughput stays below the rate by more than this (they hold
# no fixed point; the margin covers the tolerance a root at a segment's end is accepted with).
REACH_MARGIN = 1e-9
# ModeCurve.latencies_s sums this many rates' chains at once: a block's arrays (rates × states)
# stay in cache, where 20k rates at once made each pass a trip through memory.
LATENCY_BLOCK = 512
# What can set a mode's stability limit (ModeCurve.limit_reason): throughput B/T(B) peaks below
# the batch bound; the bound itself (max_num_seqs, or the KV cache's sequences); a KV-full batch
# recomputing preempted prompts (_kv_thrash_rps); prompts starved of the step's token budget.
LIMIT_REASONS = ("throughput_peak", "max_num_seqs", "kv_cache", "kv_recompute", "token_budget")


@dataclass(frozen=True)
class ModeCurve:
    """Time in system of one mode as a function of the arrival rate (plain floats).

    ``segments`` hold T(B) = c0 + c1·B + c2·B² on [start, end] for B up to the batch bound;
    ``lines`` the step τ(B) and a prompt's marginal cost Δ(B) on the same segments; ``reach``
    the highest throughput B/T(B) up to each segment's end.
    """

    segments: tuple[tuple[float, float, float, float, float], ...]
    batch_bound: float  # min(max_num_seqs, KV cache / context per sequence)
    peak_batch: float  # where the throughput B/T(B) peaks
    stability_limit_rps: float
    lines: tuple[tuple[float, float, float, float], ...]
    ends: tuple[float, ...]  # each segment's end, the last one +inf: bisect finds B's segment
    reach: tuple[float, ...]
    steps: float
    step_tokens: float
    # The wait for the step in flight per unit rate, R(B) = r0 + r1·B + r2·B² on each segment.
    waits: tuple[tuple[float, float, float], ...]
    # Σ ln h(k), k ≤ n, n = 0..⌊bound⌋: the birth–death chain's departure rates (latency_s).
    cum_log_rates: np.ndarray = field(compare=False, repr=False)
    # How much the chain's per-state terms move the best throughput from T(B)'s (_chain_rates):
    # prompts sharing a step raise it, their bunching lowers it, the staircase moves it.
    sharing_gain: float = 1.0
    # The rate a KV-full batch finishes at while preemptions recompute prompts (_kv_thrash_rps);
    # +inf where max_num_seqs, not the KV cache, bounds the batch.
    thrash_rps: float = math.inf
    # What sets stability_limit_rps (LIMIT_REASONS): what an operator would change to raise it.
    limit_reason: str = "throughput_peak"
    # Where the limit is kv_recompute, the rate the server keeps up with until a burst fills its
    # KV cache (the full batch's, before recompute): between the two it is metastable, steady
    # for as long as no excursion reaches the cache. NaN: no such band (the same as the limit).
    cache_fill_limit_rps: float = math.nan
    # q = E[Δ²]/E[Δ]² over the prompt lengths: the wait's bunched excess (bunched_wait_excess).
    prompt_q: float = 1.0
    # With prompts, the chain with arrivals in bursts (queueing.burst_time_in_system) the
    # latency is read from; None: the birth–death chain of cum_log_rates.
    bursts: Bursts | None = field(default=None, compare=False, repr=False)
    # Of the others in the batch, the share that decodes in a step (decoding_share): τ(B) runs
    # the decoders' tokens for 1 + φ·B sequences.
    decoding_share: float = 1.0
    # f = (C_a² + C_s²)/2 past a full batch of max_num_seqs: the queue there holds f times the
    # chain's (queueing.queue_variability); 1 where the KV cache bounds the batch.
    queue_variability: float = 1.0

    @property
    def metastable_band_rps(self) -> tuple[float, float]:
        """[limit, the rate kept until the cache fills); empty (lo == hi) without recompute."""
        hi = self.cache_fill_limit_rps
        return self.stability_limit_rps, hi if hi > self.stability_limit_rps else self.stability_limit_rps

    def step(self, batch: float) -> float:
        """τ(B): one decode (verify) step with B other sequences running (B ≤ the bound)."""
        s0, s1, _d0, _d1 = self.lines[bisect.bisect_left(self.ends, batch)]
        return s0 + s1 * batch

    def prompt(self, batch: float) -> float:
        """Δ(B): one arriving prompt's marginal cost on that step (B ≤ the bound)."""
        _s0, _s1, d0, d1 = self.lines[bisect.bisect_left(self.ends, batch)]
        return d0 + d1 * batch

    def latency_at_batch(self, batch: float) -> float:
        return _latency_at(self.segments, self.waits, self.ends, batch)

    def wait_s(self, rate_rps: float) -> float:
        """An arrival's mean wait for the step in flight at this rate's fixed point: τ/2 + λ·R(B)
        and what prompts bunching in steps add to it (:func:`bunched_wait_excess`)."""
        b = self.batch(rate_rps)
        r0, r1, r2 = self.waits[bisect.bisect_left(self.ends, b)]
        tau = self.step(b)
        excess = bunched_wait_excess(rate_rps, tau, self.prompt(b), self.prompt_q)
        return 0.5 * tau + rate_rps * (r0 + r1 * b + r2 * b * b) + float(excess)

    def batch(self, rate_rps: float) -> float:
        """Fluid fixed point B = λ·T(B); the bound when overloaded."""
        if rate_rps >= self.stability_limit_rps * (1.0 - 1e-12):
            return self.batch_bound
        if rate_rps <= 0.0:
            return 0.0
        return self._solve(rate_rps)[0]

    def _solve(self, rate_rps: float) -> tuple[float, float]:
        """(B, T(B)) at the fixed point, for a rate in (0, limit); T on the segment the root was
        found on (neighbours agree at a shared end)."""
        segments = self.segments
        for i in range(bisect.bisect_left(self.reach, rate_rps * (1.0 - REACH_MARGIN)), len(segments)):
            lo, hi, c0, c1, c2 = segments[i]
            r0, r1, r2 = self.waits[i]
            # At a given λ the wait is λ·R(B): T stays quadratic in B and the root closed-form.
            c0, c1, c2 = c0 + rate_rps * r0, c1 + rate_rps * r1, c2 + rate_rps * r2
            b = _fixed_point_on(rate_rps, c0, c1, c2)
            if b <= hi * (1.0 + 1e-12) + 1e-12 and b >= lo * (1.0 - 1e-12) - 1e-12:
                return b, c0 + c1 * b + c2 * b * b
        # No root below the bound: the batch is full. Past what T(bound) allows, below the limit
        # (prompts sharing a step, or the prompts around the step in flight, serve the full batch
        # faster than T(bound)), the full batch completes the λ it is sent: T = bound/λ.
        b = self.batch_bound
        return b, min(_latency_at(segments, self.waits, self.ends, b), b / rate_rps)

    def fluid_latency_s(self, rate_rps: float) -> float:
        if rate_rps >= self.stability_limit_rps * (1.0 - 1e-12):
            return math.inf
        if rate_rps <= 0.0:
            return self.segments[0][2]
        return self._solve(rate_rps)[1]

    def latency_s(self, rate_rps: float) -> float:
        """Mean time in system at this rate over the batch's chain (with bursts where there are prompts); inf past the limit."""
        limit = self.stability_limit_rps
        if rate_rps >= limit * (1.0 - 1e-12):
            return math.inf
        if rate_rps <= 0.0:
            return self.alone_s
        if self.bursts is not None:
            return burst_time_in_system(rate_rps, self.bursts, limit, self.bursts_fit, self.queue_variability)
        return mean_time_in_system(rate_rps, self.cum_log_rates, limit, self.inverse_rates, self.queue_variability)

    @functools.cached_property
    def inverse_rates(self) -> np.ndarray | None:
        """1/h(n) of the chain, taken once: every evaluation after multiplies, not exponentiates."""
        return inverse_rates(self.cum_log_rates, self.stability_limit_rps)

    @functools.cached_property
    def bursts_fit(self) -> bool:
        """Whether the bursts' running product fits a float below the limit, taken once."""
        return self.bursts is not None and burst_product_fits(self.bursts, self.stability_limit_rps)

    @property
    def alone_s(self) -> float:
        """No load: a request alone, the chain's first state (its staircase tread, its chunks)."""
        return math.exp(-float(self.cum_log_rates[1]))

    def latencies_s(self, rates_rps: Sequence[float]) -> list[float]:
        """:meth:`latency_s` at many rates, the chain summed for all of them in one pass (a
        block of LATENCY_BLOCK rates at a time)."""
        rates = np.asarray(rates_rps, dtype=float)
        if rates.size > LATENCY_BLOCK:
            return [
                t for i in range(0, rates.size, LATENCY_BLOCK) for t in self.latencies_s(rates[i : i + LATENCY_BLOCK])
            ]
        limit = self.stability_limit_rps
        live = (rates > 0.0) & (rates < limit * (1.0 - 1e-12))
        at = np.where(live, rates, 0.5 * limit)
        f = self.queue_variability
        if self.bursts is not None:
            t = burst_time_in_system_below(at, self.bursts, limit, self.bursts_fit, f)
        else:
            t = mean_time_in_system_below(at, self.cum_log_rates, limit, self.inverse_rates, f)
        out = np.where(live, t, np.where(rates > 0.0, math.inf, self.alone_s))
        return out.tolist()

    def latencies_below_limit_s(self, rates_rps: np.ndarray) -> np.ndarray:
        """:meth:`latencies_s` at rates all in (0, the limit), unchecked (a grid below it)."""
        limit, f = self.stability_limit_rps, self.queue_variability
        if self.bursts is not None:
            return burst_time_in_system_below(rates_rps, self.bursts, limit, self.bursts_fit, f)
        return mean_time_in_system_below(rates_rps, self.cum_log_rates, limit, self.inverse_rates, f)

    def latency_scaled_s(self, rate_rps: float, cost_scale: float) -> float:
        """Latency if every step cost were ``cost_scale`` times larger: s·T(s·λ)."""
        return cost_scale * self.latency_s(rate_rps * cost_scale)

    def latency_in_window_s(
        self, rate_rps: float, duration_s: float, warmup_s: float = 0.0, cost_scale: float = 1.0
    ) -> float:
        """What a load test of ``duration_s`` measures over its arrivals after ``warmup_s``,
        from an empty server (queueing.mean_time_in_window); +inf where :meth:`latency_s` is.
        Costs ``cost_scale`` times larger are the same server in time units that much longer."""
        if rate_rps >= self.stability_limit_rps * (1.0 - 1e-12) or rate_rps <= 0.0:
            return self.latency_scaled_s(rate_rps, cost_scale)
        s = cost_scale
        return s * mean_time_in_window(
            rate_rps * s,
            self.cum_log_rates,
            self.stability_limit_rps,
            duration_s / s,
            warmup_s / s,
            self.bursts,
            self.queue_variability,
        )

    def throughput_at_batch(self, batch: float, budget: float | None, prompt_tokens: float) -> float:
        """Requests per second completed with ``batch`` running (a backlog being drained)."""
        b = min(batch, self.batch_bound)
        if b <= 0.0:
            return 0.0
        t = self.latency_at_batch(b)
        # A drain runs the full batch and admits as many prompts per step as it finishes: they
        # share steps as at the limit, so its throughput gains what the limit's does.
        done = self.sharing_gain * b / t if t > 0 else math.inf
        if b >= self.batch_bound:
            done = min(done, self.thrash_rps)
        if budget is None or prompt_tokens <= 0:
            return done
        # New prompts get only what the batch's own tokens leave of each step's budget.
        left = budget - self.step_tokens * b
        tau = self.step(b)
        admitted = max(left, 0.0) / (prompt_tokens * tau) if tau > 0 else math.inf
        return min(done, admitted)


def _kv_thrash_rps(
    lines,
    ends,
    steps: float,
    chain: np.ndarray,
    bound: float,
    prompt_tokens: float,
    gen_tokens: float,
    chunked_s: float = 0.0,
    prefix_caching: bool = False,
    stuck_s: float = 0.0,
) -> float:
    """The rate a batch that fills the KV cache finishes at: prompts are recomputed.

    vLLM admits a waiting prompt whenever its blocks are free, so a full cache is left with less
    than the next prompt's worth of blocks, while the running sequences keep growing; when a
    step finds no block for them the newest request is preempted and later recomputed. With the
    leftover U ~uniform on [0, P) and the growth X until the next completion ~exponential with
    mean G (a request grows by G over its life, one finishes per request's worth of steps), a
    completion is followed by a preemption with probability r = P(X > U) = (G/P)·(1 − e^(−P/G)),
    each recomputing about a prompt: every request's prompt work grows by the factor 1 + r. On
    the fidelity bench's truth (heavy-tailed 1.4k-token prompts, 500 generated) r = 0.33; the
    recompute measured was 0.29–0.49 of the prompt tokens once the cache was full.

    With ``prefix_caching`` the victim's computed blocks stay cached when it is preempted (vLLM
    frees them with their hashes; the free queue hands out the least recently freed first), and
    its readmission, at the next completion, recomputes only the blocks the growth took since:
    (X − U)⁺ tokens, at most its prompt. E[min((X − u)⁺, P)] = G·e^(−u/G)·(1 − e^(−P/G)), and
    over u ~ U[0, P) that is r·G·(1 − e^(−P/G)) = r²·P: the factor is 1 + r², not 1 + r.

    The full batch's step is τ(B)·steps + B·Δ(B) per request (T at the bound), of which the
    prompts are B·Δ(B) (and ``chunked_s`` more each where the budget cuts them:
    :func:`chunking_excess`); their share grows by r and the rate falls by as much. ``stuck_s``
    is what each request costs in chunks computed for nothing (:func:`stuck_chunks`), paid B
    times per request as the prompts are.
    """
    p, g = max(prompt_tokens, 1e-9), max(gen_tokens, 1e-9)
    r = min(1.0, g / p * -math.expm1(-p / g))
    if prefix_caching:
        r *= r
    s0, s1, d0, d1 = lines[bisect.bisect_left(ends, bound)]
    decode, prompts = steps * (s0 + s1 * bound), bound * (d0 + d1 * bound + chunked_s)
    full = math.exp(chain[-1] - chain[-2])  # the top state's rate
    paid = decode + prompts * (1.0 + r) + bound * stuck_s
    return full * (decode + prompts) / paid if paid > 0 else full


_GH_FINE = np.polynomial.hermite_e.hermegauss(24)  # nodes and weights for E[f(Z)], Z ~ N(0, 1)


def stuck_chunks(prompt_tokens: float, prompt_sd: float | None, room: float, bound: float, steps: float) -> float:
    """Chunks each request's prompt computes for nothing, on average, at a full KV cache without
    prefix caching where the step budget leaves a waiting prompt ``room`` tokens a step.

    vLLM v1 admits a waiting prompt when its first chunk's blocks are free, not its whole
    prompt's. Where the cache is short of blocks, the room left after the admissions, L, is below
    the next prompt's P_n (else it would have been admitted); as in :func:`_kv_thrash_rps`,
    L ~ U[0, P_n). When L ≥ c the prompt is admitted and computes the j = ⌊L/c⌋ chunks that fit,
    one a step; the next finds no block and the newest request (itself) is preempted with its
    chunks discarded. Nothing is admitted in a step that preempted; in the next its blocks are
    free again, so it loops, j + 1 steps and j chunks a round, until a completion frees enough.
    With a completion at the end of a step with probability p = 1 − e^(−B/steps), a round wastes
    its chunks unless one came at the end of a chunk step, and the loop ends once one came in any
    of its steps: W_j = j·(1 − p)^j / (1 − (1 − p)^(j + 1)). Per completion

        Σ_j Pr(⌊L/c⌋ = j)·W_j,   Pr(L ≥ j·c) = E[(P_n − j·c)⁺ / P_n]

    over lognormal P_n with the measured mean and spread (one length without it).

    The cache is short of blocks only as often as the budget could admit more than the
    completions free: net of the batch's growth they free B·P/steps tokens a step (the G of a
    finished request regrows in the others), the budget admits c. Where B·P/steps ≥ c the
    budget, not the cache, paces admissions and blocks pile up: nothing is stranded. Between,
    the admissions wait on blocks 1 − B·P/(steps·c) of the time, and the loop is counted so much.
    """
    p, c = float(prompt_tokens), float(room)
    if not (p > 0 and c > 0 and bound > 0 and steps > 0):
        return 0.0
    starved = 1.0 - bound * p / (steps * c)
    if starved <= 0.0:
        return 0.0
    if prompt_sd:
        s = math.sqrt(math.log1p(min(prompt_sd / p, MAX_PROMPT_CV) ** 2))
        z, w = _GH_FINE
        x, w = np.exp(math.log(p) - 0.5 * s * s + s * z), w / math.sqrt(2.0 * math.pi)  # P_n at the nodes
    else:
        x, w = np.array([p]), np.array([1.0])
    top = min(math.ceil(float(x.max()) / c), MAX_CHUNKS)  # no room left holds more chunks
    if top < 1:
        return 0.0
    j = np.arange(1.0, top + 2.0)
    above = np.maximum(1.0 - j[:, None] * c / np.maximum(x, 1e-300), 0.0) @ w  # Pr(L ≥ j·c), j = 1..top + 1
    j = j[:-1]
    miss = np.exp(-bound / steps * j)  # (1 − p)^j: no completion at the end of j steps
    rounds = miss / (1.0 - miss * math.exp(-bound / steps))  # W_j / j
    return starved * float(np.sum((above[:-1] - above[1:]) * j * rounds))


def _stuck_s(terms: _ModeTerms, workload: Workload, budget: float, bound: float, steps: float) -> float:
    """Seconds of chunks a request's prompt computes for nothing at the full cache
    (:func:`stuck_chunks`), each a chunk of the room the full batch leaves on a step."""
    decode = terms.step_tokens * bound
    room = budget - decode
    if room < MIN_ROOM_TOKENS:
        return 0.0
    wasted = stuck_chunks(workload.computed_prompt_tokens, workload.prompt_tokens_std, room, bound, steps)
    if wasted <= 0.0:
        return 0.0
    if terms.prefill is not None:
        chunk = terms.prefill.scalar(room, room) - terms.prefill.intercept_s
    else:
        chunk = sum(c.scalar(decode + room, pairs=0.5 * room * room) - c.scalar(decode) for c in terms.priced)
    return wasted * max(chunk, 0.0)


def _budget_limit(
    curve: ModeCurve,
    budget: float,
    prompt_tokens: float,
    chunked_s: np.ndarray | None = None,
    sharing: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> float:
    """Highest rate at which prompts still fit the per-step token budget; inf where it is at or
    past the curve's own limit.

    Per step the D decoding requests need k·D tokens and the prompts λ·τ·P more, τ the mean step
    with its prompts. D is Little's: the requests in their decode steps, D = λ·steps·τ (the fluid
    batch B = λ·T(B) leaves out the chunks' excess: with 4k prompts on a 2048-token budget it
    held a quarter fewer than the truth ran). Where both hold with the budget full, λ·τ = D/steps
    gives J = D/steps = budget/(k·steps + P) prompts a step, and the step lasts
    τ_d(D) + J·Δ(D), so λ = J/(τ_d + J·Δ). Δ is what a prompt adds to the step with what the
    budget's chunks add (``chunked_s``, per state of the chain: :func:`chunking_excess`); past
    one prompt a step's later ones cost the ``sharing`` gap less than its first
    (:func:`_sharing_hinges`), Δ − gap·(1 − 1/J) each. Where D would pass the batch bound the
    full batch leaves the room, J = (budget − k·bound)/P.
    """
    k, steps = curve.step_tokens, max(curve.steps, 0.0)
    shared = budget / (k * steps + prompt_tokens)  # J, with D = J·steps
    d = shared * steps
    if d > curve.batch_bound:  # the room at the bound is at least J's (not less by a rounding)
        d = curve.batch_bound
        shared = max(shared, (budget - k * d) / prompt_tokens)
    tau_d, delta = curve.step(d), curve.prompt(d)
    if chunked_s is not None:  # state index B: B others
        delta += float(np.interp(d, _OTHERS[: chunked_s.size], chunked_s))
    if sharing is not None and shared > 1.0:
        delta -= float(_sharing_gap(sharing, d)) * (1.0 - 1.0 / shared)
    step = tau_d + shared * delta
    limit = shared / step if step > 0.0 else math.inf
    return limit if limit < curve.stability_limit_rps * (1.0 - 1e-9) else math.inf


class _ChainTerms(NamedTuple):
    """What one curve's birth–death chain is built from (:func:`_chain_rates`), and what the
    curve keeps of its build for the rest (:func:`_finish_curve`)."""

    top: int  # states up to the batch bound
    segments: list
    waits: list
    ends: list
    lines: list
    sharing: tuple[np.ndarray, np.ndarray, np.ndarray] | None
    stair_s: np.ndarray | None
    peak_batch: float
    prompt_q: float | None  # q for the chain's bunched wait; None without prompts
    chunking: tuple[np.ndarray, np.ndarray] | None
    steps: float
    prompt_tread: float
    # the rest of the build
    terms: _ModeTerms
    bound: float
    kv_bound: bool
    reach: list
    peak_rps: float
    gen_tokens: float
    mean_prompt: float
    q: float  # what the curve keeps (1.0 without prompts)
    phi: float  # the others' share decoding (decoding_share; 1.0 without prompts)
    table: list  # per segment (c0, c1, c2, r0, r1, r2, τ0, τ1, Δ0, Δ1): the chain's states read it


def _line_at(line: tuple[float, float, Sequence[Hinge]], batch: float) -> float:
    c0, c1, hinges = line
    return c0 + c1 * batch + sum(h[1] * (batch - h[0]) for h in hinges if h[0] < batch)


def decoding_share(steps: float, tau: tuple, delta: tuple, bound: float) -> float:
    """φ: the share of a request's others in the batch that decode in a step, steps/(steps + W).

    Before its ``steps`` decode steps a request spends W = 1 + Δ/S̄ mean steps in the batch
    computing its prompt: its own step, longer than the mean S̄ by its prompt Δ. It is
    scheduled then (a running request, under the batch bound) but adds no decode tokens; its
    chunk is priced by Δ. Taken at a full batch, where τ's slope in B weighs most, with S̄ the
    step there: τ plus the B prompts of a request's stay spread over its steps. ``tau`` and
    ``delta`` are (c0, c1, hinges) lines in B.
    """
    full = max(bound - 1.0, 0.0)  # the others beside one request in a full batch
    tau_b, delta_b = _line_at(tau, full), _line_at(delta, full)
    mean_step = tau_b + (full + 1.0) / (steps + PREFILL_WAIT_STEPS) * delta_b
    if not (mean_step > 0.0 and steps > 0.0):
        return 1.0
    return steps / (steps + 1.0 + max(delta_b, 0.0) / mean_step)


def _chain_terms(
    model: LatencyModel, workload: Workload, sd: bool, accepted_length: float, draft_length: float
) -> _ChainTerms:
    """A curve's build up to its chain: the segments of T(B), the prompts' terms per state."""
    terms = _mode_terms(model, sd, draft_length)
    ctx, mean_p, pairs, nodes, bins = workload.curve_terms()
    bound = float(model.max_num_seqs)
    kv = model.kv_cache_tokens_on if sd else model.kv_cache_tokens_off
    held = workload.held_context_tokens  # a cached prefix's blocks are shared
    kv_bound = kv is not None and kv > 0 and kv / held < bound
    if kv_bound:
        bound = max(1.0, kv / held)
    # Only the hinges inside (0, bound) make segments; the rest fold (as _add_hinge does) or never act.
    p, k = workload.computed_prompt_tokens, terms.step_tokens
    g = max(float(workload.gen_tokens), 1.0)
    steps = (g - 1.0) / accepted_length
    s0, s1 = terms.step0 + terms.step_ctx * ctx, terms.step1 + terms.step_ctx * ctx
    step_hinges = terms.step_hinges[: bisect.bisect_left(terms.step_hinges, bound, key=_AT)]
    decode_hinges = terms.decode_hinges[: bisect.bisect_left(terms.decode_hinges, bound, key=_AT)]
    d0 = d1 = 0.0
    phi = 1.0
    prompt_hinges: list[Hinge] = []
    if p > 0:
        d0, d1 = terms.prompt0 + terms.prompt_slope * mean_p + terms.prompt_pairs * pairs, terms.prompt1
        if terms.prefill is not None:  # schema 1: stand-alone prefill slope, no mixed-step data
            d0 += terms.prefill.scalar(p, p) - terms.prefill.intercept_s
        prompt_hinges += terms.prompt_hinges[: bisect.bisect_left(terms.prompt_hinges, bound, key=_AT)]
        for knee, w_knee in terms.prompt_knees:
            for w, x in bins:
                at = (knee - x) / k - 1.0
                if at <= 0.0:
                    d0 -= w * w_knee * at
                    d1 += w * w_knee
                elif at < bound:
                    prompt_hinges.append((at, w * w_knee, False))
        phi = decoding_share(steps, (s0, s1, (*step_hinges, *decode_hinges)), (d0, d1, prompt_hinges), bound)
        s1 -= (1.0 - phi) * (terms.decode1 + terms.decode_ctx * ctx)
    # The decoders' hinges sit at 1 + φ·B decoders: at B = at/φ, each φ as steep.
    scaled = ((at / phi, w * phi, True) for at, w, _ in decode_hinges if at < bound * phi)
    hinges = sorted([*step_hinges, *scaled, *prompt_hinges])
    q = _prompt_cost_q(terms, nodes) if p > 0 else 1.0
    segments, lines, waits, ends, reach, peak_b, peak_h, rows = _sweep((s0, s1, d0, d1), hinges, steps, bound, q)
    table = model.verify_staircase_on if sd else model.decode_staircase_off
    budget = model.max_num_batched_tokens
    return _ChainTerms(
        min(math.floor(bound), MAX_STATES),
        segments,
        waits,
        ends,
        lines,
        _sharing_hinges(terms, nodes, bound) if p > 0 else None,
        _staircase(table, steps, bound, k) if table else None,  # k = 1 token a sequence without SD
        peak_b,
        q if p > 0 else None,
        chunking_excess(terms, nodes, workload.prompt_tokens_std, budget, bound) if p > 0 and budget else None,
        steps,
        prompt_step_tread(model, draft_length if sd else 0.0),
        terms,
        bound,
        kv_bound,
        reach,
        peak_h,
        g,
        mean_p,
        q,
        phi,
        rows,
    )


def _finish_curve(
    model: LatencyModel, workload: Workload, c: _ChainTerms, chain: np.ndarray, gained: float, stall: np.ndarray | None
) -> ModeCurve:
    """The curve from its chain: the limit and what sets it."""
    # Prompts sharing a step raise every state's departure rate; the continuous peak the sweep
    # found rises with the best state's (the chain's tail is served at the limit), and moves
    # with the staircase's tread at the batch it runs.
    bound, kv_bound, peak_b, lines, ends, steps = c.bound, c.kv_bound, c.peak_batch, c.lines, c.ends, c.steps
    p, budget = workload.computed_prompt_tokens, model.max_num_batched_tokens
    limit, thrash, fill = c.peak_rps * gained, math.inf, math.nan
    reason = "throughput_peak" if peak_b < bound * (1.0 - 1e-9) else "kv_cache" if kv_bound else "max_num_seqs"
    if kv_bound and p > 0:
        thrash = _kv_thrash_rps(
            lines,
            ends,
            steps,
            chain,
            bound,
            c.mean_prompt,
            c.gen_tokens,
            0.0 if c.chunking is None else float(c.chunking[0][-1]),
            model.prefix_caching,
            0.0 if model.prefix_caching or not budget else _stuck_s(c.terms, workload, budget, bound, steps),
        )
        if thrash < limit:
            limit, fill, peak_b, reason = thrash, limit, bound, "kv_recompute"
    curve = ModeCurve(
        c.segments,
        bound,
        peak_b,
        limit,
        lines,
        ends,
        c.reach,
        steps,
        c.terms.step_tokens,
        c.waits,
        chain,
        gained,
        thrash,
        reason,
        fill,
        c.q,
        None
        if stall is None
        else bursts_of(chain, stall, length_overlap(c.gen_tokens, math.sqrt(workload.gen_tokens_var))),
        c.phi,
        1.0 if kv_bound else queue_variability(workload.service_scv),
    )
    if budget is not None and p > 0:
        limit = _budget_limit(curve, float(budget), p, None if c.chunking is None else c.chunking[0], c.sharing)
        if limit < curve.stability_limit_rps:
            # Past it the prompts' chunks wait for room in the steps: no state of the chain
            # completes faster than the budget lets prompts in (as past a throughput peak the
            # extra ones queue), and the bursts ride the capped chain.
            capped = cumulative_log_rates(np.minimum(np.exp(np.diff(chain)), limit), monotone=False)
            curve = replace(
                curve,
                stability_limit_rps=limit,
                peak_batch=curve.batch(limit),
                limit_reason="token_budget",
                cache_fill_limit_rps=math.nan,
                cum_log_rates=capped,
                bursts=None if curve.bursts is None else bursts_of(capped, stall, curve.bursts.overlap),
            )
        elif limit < fill:  # prompts starve before the cache fills: the band ends there
            curve = replace(curve, cache_fill_limit_rps=limit)
    return curve


CurveKey = tuple[bool, float, float]  # (SD on, accepted tokens per step, draft length)
_OFF: CurveKey = (False, 1.0, 0.0)


def build_curves(model: LatencyModel, workload: Workload, keys: Sequence[CurveKey]) -> list[ModeCurve]:
    """The exact rate curves of several modes (or draft lengths) of one workload, uncached.

    Each chain is ~50 numpy operations over its states, and their cost is the calls, not the
    few hundred elements: curves whose chains have the same states (every draft length of one
    server; SD off too, where the KV cache does not bound the batch) are built as the rows of
    one array, the same arithmetic per element as one at a time.
    """
    parts = [_chain_terms(model, workload, *key) for key in keys]
    chains: list[tuple[np.ndarray, float, np.ndarray | None] | None] = [None] * len(parts)
    groups: dict[tuple[int, bool, bool], list[int]] = {}
    for i, c in enumerate(parts):
        groups.setdefault((c.top, c.stair_s is None, c.prompt_q is None), []).append(i)
    for members in groups.values():
        for i, chain in zip(members, _chain_rates([parts[i] for i in members]), strict=True):
            chains[i] = chain
    return [_finish_curve(model, workload, c, *chain) for c, chain in zip(parts, chains, strict=True)]  # type: ignore[misc]


class _CurveCache:
    """The curves built, per (model, workload) and (mode, accepted length, draft length): the
    workloads least recently used out first (as functools.lru_cache), each workload's curves
    built a batch at a time (:func:`build_curves`)."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize  # workloads (× models) kept
        self._curves: OrderedDict[tuple[LatencyModel, Workload], dict[CurveKey, ModeCurve]] = OrderedDict()

    def __call__(
        self, model: LatencyModel, workload: Workload, sd: bool, accepted_length: float, draft_length: float
    ) -> ModeCurve:
        """Build (and cache) the exact rate curve of one mode."""
        return self.many(model, workload, ((sd, accepted_length, draft_length),))[0]

    def many(self, model: LatencyModel, workload: Workload, keys: Sequence[CurveKey]) -> list[ModeCurve]:
        """The curves of ``keys``, those not cached yet built in one batch."""
        at = (model, workload)
        kept = self._curves.get(at)
        if kept is None:
            kept = self._curves[at] = {}
            while len(self._curves) > self.maxsize:
                self._curves.popitem(last=False)
        else:
            self._curves.move_to_end(at)
        missing = [k for k in dict.fromkeys(keys) if k not in kept]
        if missing:
            kept.update(zip(missing, build_curves(model, workload, missing), strict=True))
        return [kept[k] for k in keys]

    def cache_clear(self) -> None:
        self._curves.clear()


mode_curve = _CurveCache(maxsize=512)


_CHAIN_N = np.arange(1.0, MAX_STATES + 1.0)  # n = 1, 2, …; sliced per curve, never rebuilt
_OTHERS = _CHAIN_N - 1.0  # B = n − 1 others
_OTHERS_4 = 4.0 * _OTHERS


@functools.lru_cache(maxsize=64)
def _state_rows(rows: int, top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(n, B, 4·B) over the states of ``rows`` curves built together, each row the same (never
    written to): numpy's fast loops take operands of one shape, and broadcasting one row over
    several cost as much as the arithmetic."""
    a, b, c = (np.ascontiguousarray(np.broadcast_to(x[:top], (rows, top))) for x in (_CHAIN_N, _OTHERS, _OTHERS_4))
    return a, b, c


_MAX = np.maximum.reduce  # ndarray.max goes through a Python wrapper


def _prompt_cost_q(terms: _ModeTerms, nodes: tuple[tuple[float, float], ...]) -> float:
    """E[Δ²]/E[Δ]² of a prompt's marginal cost over the prompt-length nodes, on a step of one
    sequence (its tokens, knees and attention): long prompts make long steps, and the wait for
    the step in flight weighs them by their length."""
    k = terms.step_tokens
    if terms.prefill is not None:
        costs = [(w, terms.prefill.scalar(x, x) - terms.prefill.intercept_s) for w, x in nodes]
    else:
        # Σ over the priced passes of t(k + x, pairs = x²/2) − t(k): their slopes, attention and
        # knees (prompt_knees holds every pass's, slope change·k) without the intercepts.
        costs = []
        for w, x in nodes:
            c = terms.prompt_slope * x + terms.prompt_pairs * (0.5 * x * x)
            for knee, w_knee in terms.prompt_knees:
                if k + x > knee:
                    c += w_knee / k * (k + x - knee - max(k - knee, 0.0))
            costs.append((w, c))
    mean = sum(w * c for w, c in costs)
    if not mean > 0.0:
        return 1.0
    return sum(w * (c / mean) ** 2 for w, c in costs)  # ratios first: a tiny mean squared underflows


# Below this share of prompts longer than any state's room, chunking is not priced (a fresh
# workload on a big budget pays nothing for it).
CHUNKED_SHARE_FLOOR = 1e-4
# Where the decodes leave (almost) no room the budget limit holds (_budget_limit): the room is
# kept this wide and the chunks counted this far, so such states stay finite and cheap.
MIN_ROOM_TOKENS = 16.0
MAX_CHUNKS = 32
CHUNKING_STRIDE = 8


def chunking_excess(
    terms: _ModeTerms,
    nodes: tuple[tuple[float, float], ...],
    prompt_sd: float | None,
    budget: float,
    bound: float,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Per state (B others, B + 1 running): what prompts longer than the step's budget leaves
    beside the batch cost beyond one pass. None where no state's room is exceeded.

    vLLM schedules the running sequences' k·(B + 1) tokens first and gives a waiting prompt the
    room r = budget − k·(B + 1) left; a longer prompt is prefilled in m = ⌈P/r⌉ chunks over m
    steps. Two costs follow, neither in Δ(B) = t(k·(B + 1) + P) − t(k·(B + 1)):

    * the chunks' passes cost ⌊P/r⌋·g(r) + g(P mod r) − g(P), g(c) = t(k·(B + 1) + c) −
      t(k·(B + 1)), beyond the one pass Δ prices: past a knee a pass is cheaper per token, and
      the passes a budget cuts never get there (the bench never ran one, so t above the budget
      is an extrapolation). Every prompt a request meets pays it, its own included (the
      attention pairs are P²/2 however a prompt is cut, and cancel); never below 0;
    * the request's own prompt takes m − 1 more steps of τ(B) before its first token;
      E[m − 1] = Σ_{j ≥ 1} Pr(P > j·r) over the lognormal prompt lengths (a step function of
      r for a fixed P).

    Returns (seconds per prompt met, extra steps of its own), one entry per state.
    """
    top = min(math.floor(bound), MAX_STATES)
    narrowest = max(budget - terms.step_tokens * top, MIN_ROOM_TOKENS)  # the fullest state's room
    mean = sum(w * x for w, x in nodes)
    cv = min((prompt_sd or 0.0) / mean, MAX_PROMPT_CV) if mean > 0 else 0.0
    s = math.sqrt(math.log1p(cv * cv))
    mu = math.log(mean) - 0.5 * s * s if mean > 0 else 0.0
    # Scalars first: a fresh workload that never chunks pays a few float operations.
    reach = 0.5 * math.erfc((math.log(narrowest) - mu) / (s * math.sqrt(2.0))) if s > 0 else float(mean > narrowest)
    if max(x for _, x in nodes) <= narrowest and reach < CHUNKED_SHARE_FLOOR:
        return None
    running, decode, room = _chunking_grid(terms.step_tokens, budget, top)
    width = running.size
    if s > 0:
        longest = math.exp(mu + 6.0 * s)  # Pr(P > it) < 1e-9

        def survival(x: np.ndarray) -> np.ndarray:
            return 0.5 * _erfc((np.log(x) - mu) / (s * math.sqrt(2.0)))
    else:
        longest = mean

        def survival(x: np.ndarray) -> np.ndarray:
            return (mean > x).astype(float)

    chunks = np.arange(1.0, min(math.ceil(longest / narrowest), MAX_CHUNKS) + 1.0)
    extra_steps = survival(chunks[:, None] * room).sum(axis=0)
    per_prompt = np.zeros(width)
    if terms.priced:
        # g(c) = f(k·(B + 1) + c) − f(k·(B + 1)) with f the token part of the priced passes (the
        # intercepts, context and sequence terms cancel): every chunk of every node in one array.
        n = len(nodes)
        prompts = np.array([x for _, x in nodes])[:, None]
        full = np.floor(prompts / room)
        chunk = np.vstack([room[None, :], prompts - full * room, np.broadcast_to(prompts, (n, width))])
        tokens = decode + chunk
        f = sum(c.slope_s_per_token for c in terms.priced) * chunk
        for c in terms.priced:
            for knee, delta in zip(c.knees_tokens, c.knee_slope_deltas, strict=True):
                f += delta * (np.maximum(tokens - knee, 0.0) - np.maximum(decode - knee, 0.0))
        weights = np.array([w for w, _ in nodes])[:, None]
        per_prompt = (weights * (full * f[0] + f[1 : 1 + n] - f[1 + n :])).sum(axis=0)
        # Never cheaper than the one pass: a fit whose knee makes big passes dearer per token
        # would otherwise have the chain outrun the fluid fixed point it rides on.
        np.maximum(per_prompt, 0.0, out=per_prompt)
    states = _CHAIN_N[:top]
    return np.interp(states, running, per_prompt), np.interp(states, running, extra_steps)


@functools.lru_cache(maxsize=64)
def _chunking_grid(step_tokens: float, budget: float, top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(running sequences, their decode tokens, the room they leave) at every
    CHUNKING_STRIDE-th state and the last: both terms move with the room, a few tokens a state
    (a fixed prompt's whole steps blur over a stride), and are interpolated between."""
    running = _CHAIN_N[:top:CHUNKING_STRIDE]
    if running[-1] != top:
        running = np.append(running, float(top))
    decode = step_tokens * running
    return running, decode, np.maximum(budget - decode, MIN_ROOM_TOKENS)


def _erfc(z: np.ndarray) -> np.ndarray:
    """The complementary error function to 1.5e-7 (Abramowitz & Stegun 7.1.26), on arrays."""
    a = np.minimum(np.abs(z), 30.0)  # erfc(30) underflows to 0 already; a² must not overflow
    t = 1.0 / (1.0 + 0.3275911 * a)
    y = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    y *= np.exp(-a * a)
    return np.where(z >= 0.0, y, 2.0 - y)


def _sharing_gap(sharing: tuple[np.ndarray, np.ndarray, np.ndarray], batch):
    """gap(B) = B·Σw − Σw·at over :func:`_sharing_hinges`' hinges at or below B (a float or an
    array of B)."""
    at, cum_w, cum_wat = sharing
    i = at.searchsorted(batch)
    return batch * cum_w[i] - cum_wat[i]


def _sharing_hinges(
    terms: _ModeTerms, nodes: tuple[tuple[float, float], ...], bound: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """gap(B) = E_P[Δ₁ − Δ₂]: how much less a second prompt in the same step costs than the
    first, t(kb + x) − t(kb) − (t(kb + 2x) − t(kb + x)) with kb = k·(B + 1), as hinges
    w·max(0, B − at) below the bound: (sorted at, Σ w and Σ w·at up to each, from "none"), so
    gap(B) = B·Σw − Σw·at over the hinges at or below B.

    Only the token term's knees make it non-zero: the line, the per-sequence term and each
    prompt's own attention cost the second prompt what they cost the first. None without knees.
    """
    if not terms.prompt_knees:
        return None
    # A hinge at or below 0 is on for every B: it folds into the line g0 + g1·B (the entry for
    # "no hinge on"); one at or past the bound never switches on.
    k, g0, g1, hinges = terms.step_tokens, 0.0, 0.0, []
    for knee, w_knee in terms.prompt_knees:  # w_knee = δ·k: a knee's slope change per unit B
        candidates = [(knee / k - 1.0, -w_knee)]
        candidates += [((knee - x) / k - 1.0, 2.0 * wn * w_knee) for wn, x in nodes]
        candidates += [((knee - 2.0 * x) / k - 1.0, -wn * w_knee) for wn, x in nodes]
        for at, w in candidates:
            if at <= 0.0:
                g0 -= w * at
                g1 += w
            elif at < bound:
                hinges.append((at, w))
    hinges.sort()
    at_list, cum_w, cum_wat = [], [g1], [-g0]
    for a, w in hinges:
        at_list.append(a)
        cum_w.append(cum_w[-1] + w)
        cum_wat.append(cum_wat[-1] + w * a)
    return np.array(at_list), np.array(cum_w), np.array(cum_wat)


# GEMMs run in tiles of 64 tokens or more, and with SD a tread is only tile/(γ + 1) sequences
# wide. Step sizes benchmarked close together place each riser between two of them; farther
# apart, interpolating two residuals draws a slope through risers the bench never saw. Across such
# a gap the staircase adds nothing. 40 tokens keeps every gap of the recipe's grid (every 8
# sequences: γ = 4's steps every 40 tokens, both draft lengths' every ≤ 24) and cuts the 50–160
# token gaps of a 17-size grid (on the simulated H100, 64-token tiles: 2.85 → 2.38 % mean error).
STAIR_MAX_GAP_TOKENS = 40.0


@functools.lru_cache(maxsize=64)
def stair_nodes(table: tuple[tuple[float, float], ...]) -> tuple[np.ndarray, np.ndarray]:
    """The table as interpolation nodes: each gap wider than STAIR_MAX_GAP_TOKENS is pinned to
    zero just inside its ends, so the residuals hold at the sizes measured and nowhere between;
    where the table shows a tile period (:func:`treads.table_period`), a gap across a riser rises
    at its multiple of the period, not straight across."""
    period = table_period(table)
    tokens, residual = [table[0][0]], [table[0][1]]
    for x, y in table[1:]:
        if x - tokens[-1] > STAIR_MAX_GAP_TOKENS:
            tokens += [math.nextafter(tokens[-1], math.inf), math.nextafter(x, -math.inf)]
            residual += [0.0, 0.0]
        elif period is not None:
            for at, r in riser_nodes(tokens[-1], residual[-1], x, y, period):
                tokens.append(at)
                residual.append(r)
        tokens.append(x)
        residual.append(y)
    return np.array(tokens), np.array(residual)


@functools.lru_cache(maxsize=64)
def _stair_period(table: tuple[tuple[float, float], ...]) -> float:
    """The table's tile period in tokens where it shows one and spans a whole one, else 0."""
    found = table_period(table)
    return 0.0 if found is None or table[-1][0] - table[0][0] < found.period else float(found.period)


def stair_residual(table: tuple[tuple[float, float], ...], tokens):
    """The staircase's residual (seconds) at these step tokens: :func:`stair_nodes` read between
    the sizes benchmarked. Past the largest, where the table shows a tile period, the last whole
    period benchmarked repeats: the tiles go on, and a draft length or a batch longer than any
    the bench ran lands on the same treads (at 256 sequences every γ's verify step is a whole
    number of 64-token tiles, the cheapest point of a tread, priced at the line without it).
    Without a period nothing is known there: nothing is added. Scalars or arrays."""
    xs, ys = stair_nodes(table)
    period, top = _stair_period(table), xs[-1]
    x = np.asarray(tokens, dtype=float)
    if period:
        x = np.where(x > top, x - np.ceil((x - top) / period) * period, x)
    return np.interp(x, xs, ys, right=0.0)


def _staircase(table: tuple[tuple[float, float], ...], steps: float, bound: float, tokens_per_seq: float) -> np.ndarray:
    """Seconds a request's decode steps (and the half step it waits) add at each state's batch,
    the calibration's residuals per step size (tokens: the batch × ``tokens_per_seq``)
    interpolated between the sizes benchmarked, where they are close enough to place the risers
    (STAIR_MAX_GAP_TOKENS), and repeated by the tile period past the largest (:func:`stair_residual`).
    """
    top = min(math.floor(bound), MAX_STATES)
    return (steps + 0.5) * stair_residual(table, _CHAIN_N[:top] * tokens_per_seq)


def bunched_wait_excess(lam, tau, delta, q: float):
    """Seconds an arrival waits for the step in flight beyond τ/2 + λ·R, when the prompts that
    arrive during a step are prefilled together in the next one.

    τ/2 + λ·R(B) takes each step to carry at most one prompt. But a step's J prompts are the
    Poisson arrivals of the step before (mean λ·S), and a step with more prompts is longer, so
    long steps breed long steps. With S = τ + Σ_J Δ and ρ = λ·E[Δ]: E[S] = τ/(1 − ρ) and
    Var(S) = λ·E[S]·E[Δ²]/(1 − ρ²), so the length-weighted wait E[S²]/(2·E[S]) is

        τ/(2·(1 − ρ)) + λ·E[Δ²]/(2·(1 − ρ²)),

    which is τ/2 + λ·R to first order in ρ. The excess over it,
    ρ²·(τ/(2·(1 − ρ)) + λ·q·E[Δ]²/(2·(1 − ρ²))), is nothing on a quiet server and most of
    the wait when prompts take half of its time: 4k-token prompts at 1.5 req/s on the simulated
    A100 wait 231 ms (fixed lengths) to be scheduled, τ/2 + λ·R says 150 and this 239.
    Scalars or arrays.
    """
    rho = np.minimum(lam * delta, MAX_PROMPT_SHARE)
    # = ρ²·(τ + q·ρ·E[Δ]/(1 + ρ))/(2·(1 − ρ)), with λ·E[Δ]² = ρ·E[Δ]: fewer passes over the states.
    return rho * rho * (tau + q * rho * delta / (1.0 + rho)) / (2.0 - 2.0 * rho)


def prompt_step_share(arrivals, bunching):
    """The share of steps that carry a prompt, when each step's prompts are those that arrived
    during the step before: ``arrivals`` = λ·τ (a bare step's), ``bunching`` = λ·Δ (what each
    prompt a step carries adds to the next one's). Scalars or arrays.

    J' ~ Poisson(λ·(τ + Δ·J)) is a branching process with Poisson(a) immigration and Poisson(b)
    offspring, whose stationary PGF solves G(z) = e^(a(z − 1))·G(e^(b(z − 1))). So the share
    without a prompt is G(0) = exp(−a·S(b)), S(b) = Σ u_k, u_0 = 1, u_(k+1) = 1 − e^(−b·u_k):
    e^(−a) on a quiet server, and more than e^(−a/(1 − b)) (prompts per step averaged first) as
    long steps breed long steps. On the simulated H100 (`chat`, 14 req/s: a = 0.29, b = 0.44)
    37 % of steps carry one, 40 % by the mean, 31 % measured. S depends on b alone: tabulated
    once (_BRANCHING), read by interpolation.
    """
    return -np.expm1(-arrivals * np.interp(bunching, *_BRANCHING))


def _branching_sums(points: int = 384, terms: int = 800) -> tuple[np.ndarray, np.ndarray]:
    """S(b) = Σ u_k on b ∈ [0, MAX_PROMPT_SHARE] (:func:`prompt_step_share`): u_k falls as b^k
    once small, 0.95^800 ≈ 1e-18."""
    b = np.linspace(0.0, MAX_PROMPT_SHARE, points)
    u, total = np.ones_like(b), np.ones_like(b)
    for _ in range(terms):
        u = -np.expm1(-b * u)
        total += u
    return b, total


_BRANCHING = _branching_sums()


def _chain_rates(curves: Sequence[_ChainTerms]) -> list[tuple[np.ndarray, float, np.ndarray | None]]:
    """Each curve's chain, cumulative log departure rates: with n in the server, h(n) =
    n / T(n − 1); and how much prompts sharing a step and the staircase raise the best state's
    rate (1.0 without ``sharing`` and ``stair_s``). The curves have the same states (``top``),
    the same terms present or absent but for ``sharing`` and ``chunking`` (absent: nothing
    added); each is a row of the same arrays.

    ``stair_s`` (seconds per state) is the decode step's staircase around the fitted line. It
    rides on the smooth chain's rates (their running best, as :func:`cumulative_log_rates`
    keeps them) and is not smoothed away: a state on a dear tread finishes slower than the one
    before it, as the server does, which runs every request it has.

    The prompts that arrive during a step are prefilled together in the next one. With J of
    them (mean μ = λ·S, S = τ/(1 − λ·Δ) the mean step with its prompts) and a step's prompt
    cost C(J) = Δ₁ + (J − 1)·Δ₂, a prompt costs on average E[C(J)]/E[J] = Δ₁ − gap·f,
    f = 1 − P(J ≥ 1)/μ, P(J ≥ 1) from the branching count (:func:`prompt_step_share`; long
    steps breed long steps, so fewer steps carry the same prompts than a Poisson count's
    1 − e^{−μ}): each of the B + 1 prompts a request meets costs it that much less. In state n
    the rate is the state's own, λ = B/T(B), so the saving depends on T; one pass from the
    unshared T is within ~5e-4 of the fixed point (the saving is a few % of T and moves μ by
    little). What each prompt met then costs, Δ less the saving (and the chunks past the
    token budget), is the stall of the bursts' chain (:class:`queueing.Bursts`).

    ``prompt_q`` (q = E[Δ²]/E[Δ]²; None without prompts) adds what the step in flight's wait
    misses when prompts bunch: see :func:`bunched_wait_excess`, at the state's own λ = B/T(B).

    ``chunking`` (per state: seconds each prompt met costs beyond one pass, and the steps a
    request's own prompt takes beyond one) prices prompts longer than the step's token budget
    leaves beside the batch: see :func:`chunking_excess`.

    ``prompt_tread``: the share of ``stair_s``'s tread a step carrying a prompt keeps
    (:func:`prompt_step_tread`); :func:`prompt_step_share` of the steps carry one.

    ``steps`` (a request's decode steps; with ``prompt_q``) counts the prompts around the step
    in flight: those that arrived in it before the request share its prefill step, those that
    arrive in its last step are prefilled after it, λ·Δ·(wait − min((T − wait)/(steps + 1), 2·wait)).
    """
    top, rows = curves[0].top, len(curves)
    n, b, b4 = _state_rows(rows, top)
    others = _OTHERS[:top]  # B of one curve

    def column(values) -> np.ndarray:  # one scalar per curve, broadcast over its states
        return np.array(values)[:, None]

    # Each state's segment: its (c0, c1, c2, r0, r1, r2, τ0, τ1, Δ0, Δ1), every curve's segments
    # in one table, taken into one contiguous row per curve and column (strided rows cost the
    # arithmetic below twice as much).
    table = np.array([row for c in curves for row in c.table])
    # State B's segment is the first ending at or above it: each segment holds the states up
    # to its end not held by the one before (counted in floats, as bisect would compare them).
    held = []
    for c in curves:
        below = 0
        for end in c.ends:
            upto = top if end >= top - 1 else math.floor(end) + 1 if end >= 0.0 else 0
            held.append(upto - below)
            below = upto
    which = np.repeat(np.arange(len(held)), held).reshape(rows, top)
    c0, c1, c2, r0, r1, r2, s0, s1, d0, d1 = table.T.take(which, axis=1)
    x = c0 + b * (c1 + b * c2)
    b4r = r0 + b * (r1 + b * r2)
    np.maximum(b4r, 0.0, out=b4r)
    b4r *= b4
    t = 0.5 * (x + np.sqrt(x * x + b4r))  # _with_wait, one row per state
    gained = np.ones(rows)
    stall = None
    stair_s = None if curves[0].stair_s is None else np.array([c.stair_s for c in curves])
    prompt_q = curves[0].prompt_q
    shared = any(c.sharing is not None for c in curves)
    if shared or prompt_q is not None:
        np.maximum(t, 1e-300, out=t)  # a zero-cost pass (refused by its loader): no 0/0 below
        plain = _MAX(n / t, axis=-1)
        tau, delta = s0 + s1 * b, d0 + d1 * b
        lam = b / t
        lam[..., 0] = 1e-300  # B = 0: no one shares the step; f(μ → 0) = 0 without 0/0
        stall = delta  # what each prompt met costs the batch: a stall, in the bursts' chain
        tread = column([c.prompt_tread for c in curves])
        if stair_s is not None and np.any(tread != 1.0):
            # The steps that carry a prompt keep only part of the tread.
            stair_s = stair_s * (1.0 - prompt_step_share(lam * tau, lam * delta) * (1.0 - tread))
        if shared:
            # gap(B) per state (_sharing_hinges); none without the token term's knees.
            gap = np.zeros((rows, top))
            for row, c in enumerate(curves):
                if c.sharing is not None:
                    gap[row] = _sharing_gap(c.sharing, others)
            # The step with its prompts; past a full step of prompts the budget limit holds.
            mu = lam * tau / np.maximum(1.0 - lam * delta, 0.05)
            saved = gap * (1.0 - prompt_step_share(lam * tau, lam * delta) / mu)  # gap·f(μ)
            x -= n * saved
            stall = delta - saved
            t = 0.5 * (x + np.sqrt(x * x + b4r))
        if prompt_q is not None:
            lam = b / t
            excess = bunched_wait_excess(lam, tau, delta, column([c.prompt_q for c in curves]))
            wait = 0.5 * tau + (t - x) + excess
            t += excess
            # The prompts that arrived in the step in flight before it share its prefill
            # step; those that arrive in its last step are prefilled after it. A step of the
            # request's life is no longer than twice the wait for the step in flight, as
            # E[S²]/(2·E[S]) ≥ E[S]/2: with a step or two a request (few tokens, long prefill
            # steps) (T − wait)/(steps + 1) is the whole of its prefill, not a step, and taken
            # as one it halved T near capacity and doubled the limit.
            seen = np.minimum((t - wait) / (column([c.steps for c in curves]) + 1.0), 2.0 * wait)
            t += lam * delta * (wait - seen)
        for row, c in enumerate(curves):
            if c.chunking is not None:
                t[row] += _CHAIN_N[:top] * c.chunking[0] + c.chunking[1] * tau[row]
                stall[row] += c.chunking[0]
        gained = _MAX(n / t, axis=-1) / plain
    # A zero-cost calibration (refused by its loader) must not divide by zero here.
    rates = n / np.maximum(t, 1e-300)
    if stair_s is None:
        chains = cumulative_log_rates(rates)
    else:
        smooth = np.maximum.accumulate(rates, axis=-1)
        rates = n / (n / smooth + stair_s)
        chains = cumulative_log_rates(rates, monotone=False)
        # The state the limit is set at: n = B + 1.
        at = [min(top, math.floor(c.peak_batch) + 1) - 1 for c in curves]
        gained = gained * (rates[range(rows), at] / smooth[range(rows), at])
    # Each its own copy: a curve kept in the cache must not hold its batch's other rows.
    stalls = [None] * rows if stall is None else [row.copy() for row in stall]
    return [(row.copy(), g, st) for row, g, st in zip(chains, gained.tolist(), stalls, strict=True)]


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1024)  # a decision asks it for each γ at one α, every tick
def _clamped_en(alpha: float, draft_length: int, accepted_length: float | None) -> float:
    en = float(_accepted_length(alpha, draft_length)) if accepted_length is None else float(accepted_length)
    if en != en:  # NaN passes min and max
        raise ValueError(f"acceptance: alpha {alpha!r}, accepted length {accepted_length!r}: not a number")
    return min(max(en, 1.0), draft_length + 1.0)


@functools.lru_cache(maxsize=1024)  # one lookup, not two and E[N]'s: a fifth of a repeated evaluation
def curves(
    model: LatencyModel,
    alpha: float,
    draft_length: int,
    workload: Workload,
    accepted_length: float | None = None,
) -> tuple[ModeCurve, ModeCurve]:
    """(without SD, with SD) rate curves; with draft length 0 both are the plain target."""
    if draft_length <= 0:
        off = mode_curve(model, workload, False, 1.0, 0.0)
        return off, off
    on = (True, _clamped_en(alpha, draft_length, accepted_length), float(draft_length))
    off_curve, on_curve = mode_curve.many(model, workload, (_OFF, on))
    return off_curve, on_curve


def mode_curve_for(
    model: LatencyModel,
    sd: bool,
    alpha: float,
    draft_length: int,
    workload: Workload,
    accepted_length: float | None = None,
) -> ModeCurve:
    """One mode's rate curve, the same as its half of :func:`curves`, which builds both (a
    caller that reads one mode, on a model it has just made, pays for one build)."""
    if not sd or draft_length <= 0:
        return mode_curve(model, workload, *_OFF)
    return mode_curve(model, workload, True, _clamped_en(alpha, draft_length, accepted_length), float(draft_length))


def cycle_speedup(points: Sequence[PointPrediction]) -> float:
    """The speedup of a load that cycles through ``points`` (equal time at each): the mean
    latency of its requests without SD over with SD (each point weighted by its rate). SD
    overloaded at any point makes it 0, as at one rate."""
    t_off = sum(p.rate_rps * p.latency_off_s for p in points)
    t_on = sum(p.rate_rps * p.latency_on_s for p in points)
    top = max(points, key=lambda p: p.rate_rps)
    return _speedup_from(t_off, t_on, top.stability_limit_off_rps, top.stability_limit_on_rps)


def _speedup_from(t_off: float, t_on: float, mu_off: float, mu_on: float) -> float:
    if math.isinf(t_off) and math.isinf(t_on):
        return mu_on / mu_off if mu_off > 0 else math.inf
    if math.isinf(t_on):
        return 0.0
    if math.isinf(t_off):
        return math.inf
    return t_off / t_on


@dataclass(frozen=True)
class PointPrediction:
    """Both modes at one (rate, acceptance, draft length), plain floats.

    ``*_lo_s``/``*_hi_s`` bound each latency if every step cost were off by the calibration's
    residual error (``INTERVAL_Z`` σ); ``speedup_lo`` pairs SD's high with plain decoding's low
    latency (the pessimistic speedup), ``speedup_hi`` the reverse.
    """

    rate_rps: float
    draft_length: int
    accepted_length: float
    latency_off_s: float
    latency_on_s: float
    batch_off: float
    batch_on: float
    stability_limit_off_rps: float
    stability_limit_on_rps: float
    speedup: float
    latency_off_lo_s: float = math.nan
    latency_off_hi_s: float = math.nan
    latency_on_lo_s: float = math.nan
    latency_on_hi_s: float = math.nan
    speedup_lo: float = math.nan
    speedup_hi: float = math.nan

    @property
    def overloaded_off(self) -> bool:
        return math.isinf(self.latency_off_s)

    @property
    def overloaded_on(self) -> bool:
        return math.isinf(self.latency_on_s)


def interval_scales(spread: float) -> tuple[float, float]:
    """The cost scales at the ends of a prediction interval of relative half-width ``spread``."""
    return max(1.0 - spread, 0.05), 1.0 + spread


def predict_point(
    model: LatencyModel,
    rate_rps: float,
    alpha: float,
    draft_length: int,
    workload: Workload,
    accepted_length: float | None = None,
) -> PointPrediction:
    """Both modes at one point, with prediction intervals (a few µs once the curves are cached)."""
    if rate_rps < 0 or not math.isfinite(rate_rps):
        raise ValueError("arrival rate must be finite and >= 0")
    off, on = curves(model, alpha, draft_length, workload, accepted_length)
    en = _clamped_en(alpha, draft_length, accepted_length) if draft_length > 0 else 1.0
    t_off, t_on = off.latency_s(rate_rps), on.latency_s(rate_rps)
    s_off = INTERVAL_Z * model.relative_sd_off
    s_on = INTERVAL_Z * model.relative_sd_on if draft_length > 0 else s_off
    off_lo, off_hi = (off.latency_scaled_s(rate_rps, c) for c in interval_scales(s_off))
    on_lo, on_hi = (on.latency_scaled_s(rate_rps, c) for c in interval_scales(s_on))
    mu_off, mu_on = off.stability_limit_rps, on.stability_limit_rps
    return PointPrediction(
        float(rate_rps),
        int(draft_length),
        en,
        t_off,
        t_on,
        off.batch(rate_rps),
        on.batch(rate_rps),
        mu_off,
        mu_on,
        _speedup_from(t_off, t_on, mu_off, mu_on),
        off_lo,
        off_hi,
        on_lo,
        on_hi,
        _speedup_from(off_lo, on_hi, mu_off * (1.0 - s_off), mu_on / (1.0 + s_on)),
        _speedup_from(off_hi, on_lo, mu_off / (1.0 + s_off), mu_on * (1.0 - s_on)),
    )


def predict_points(
    model: LatencyModel,
    rates_rps: Sequence[float],
    alpha: float,
    draft_length: int,
    workload: Workload,
    accepted_length: float | None = None,
) -> list[PointPrediction]:
    """Both modes at many rates, each mode's chain summed for all of them in one pass (a cycle's
    rates): the latencies, limits and speedup of :func:`predict_point`, without the intervals
    or the batch (NaN)."""
    off, on = curves(model, alpha, draft_length, workload, accepted_length)
    en = _clamped_en(alpha, draft_length, accepted_length) if draft_length > 0 else 1.0
    mu_off, mu_on = off.stability_limit_rps, on.stability_limit_rps
    t_off, t_on = off.latencies_s(rates_rps), on.latencies_s(rates_rps)
    return [
        PointPrediction(
            float(r), int(draft_length), en, a, b, math.nan, math.nan, mu_off, mu_on, _speedup_from(a, b, mu_off, mu_on)
        )
        for r, a, b in zip(rates_rps, t_off, t_on, strict=True)
    ]


def speedup_point(model: LatencyModel, rate_rps: float, alpha: float, draft_length: int, workload: Workload) -> float:
    """Scalar speedup T_off / T_on at one point (see :class:`Prediction` for overload)."""
    if rate_rps < 0 or not math.isfinite(rate_rps):
        raise ValueError("arrival rate must be finite and >= 0")
    off, on = curves(model, alpha, draft_length, workload)
    return _speedup_from(
        off.latency_s(rate_rps), on.latency_s(rate_rps), off.stability_limit_rps, on.stability_limit_rps
    )


@dataclass(frozen=True)
class ModePrediction:
    """One mode (SD on or off) at each rate. Overloaded entries have latency_s = +inf."""

    latency_s: np.ndarray
    batch: np.ndarray
    overloaded: np.ndarray
    stability_limit_rps: np.ndarray


@dataclass(frozen=True)
class Prediction:
    """Both modes at each (rate, acceptance, draft length); ``speedup`` = T_off / T_on.

    When a mode is overloaded its latency is +inf; then speedup is 0 when SD is overloaded and
    has the smaller capacity, +inf when only SD keeps up, and μ_on / μ_off when both are
    overloaded. So S never rises with load past SD's limit.
    """

    off: ModePrediction
    on: ModePrediction
    speedup: np.ndarray
    accepted_length: np.ndarray


def predict(
    model: LatencyModel,
    rate_rps: ArrayLike,
    alpha: ArrayLike,
    draft_length: ArrayLike,
    workload: Workload,
    accepted_length: ArrayLike | None = None,
) -> Prediction:
    """:func:`predict_point` over broadcastable arrays (the same solver, element by element;
    curves are cached per (acceptance, draft length), so a sweep over rates is cheap)."""
    rate = np.asarray(rate_rps, dtype=float)
    if np.any(rate < 0) or not np.all(np.isfinite(rate)):
        raise ValueError("arrival rate must be finite and >= 0")
    en_in = np.nan if accepted_length is None else accepted_length
    r, a, g, e = np.broadcast_arrays(
        rate, np.asarray(alpha, dtype=float), np.asarray(draft_length), np.asarray(en_in, dtype=float)
    )
    out = np.empty((8, r.size))
    # One group per (acceptance, draft length, accepted length): its curves once, its rates in
    # one pass of each mode's chain (ModeCurve.latencies_s), as predict_points.
    given = ~np.isnan(e.ravel())
    keys = np.stack([a.ravel(), g.ravel().astype(np.int64), given, np.where(given, e.ravel(), 0.0)])
    groups, which = np.unique(keys, axis=1, return_inverse=True)
    for k, (alpha_k, gamma_k, has_en, en_k) in enumerate(groups.T.tolist()):
        at = np.flatnonzero(which.ravel() == k)
        gamma, accepted = int(gamma_k), en_k if has_en else None
        off, on = curves(model, alpha_k, gamma, workload, accepted)
        rates = r.ravel()[at]
        t_off = off.latencies_s(rates)
        t_on = t_off if on is off else on.latencies_s(rates)
        mu_off, mu_on = off.stability_limit_rps, on.stability_limit_rps
        lam = rates.tolist()
        rows = (
            t_off, [off.batch(x) for x in lam], mu_off,
            t_on, [on.batch(x) for x in lam], mu_on,
            [_speedup_from(x, y, mu_off, mu_on) for x, y in zip(t_off, t_on, strict=True)],
            _clamped_en(alpha_k, gamma, accepted) if gamma > 0 else 1.0,
        )  # fmt: skip
        for row, values in zip(out, rows, strict=True):
            row[at] = values
    out = out.reshape((8, *r.shape))
    off = ModePrediction(out[0], out[1], np.isinf(out[0]), out[2])
    on = ModePrediction(out[3], out[4], np.isinf(out[3]), out[5])
    return Prediction(off, on, out[6], out[7])


# --------------------------------------------------------------------------------------------
# Break-even rates, best draft length, stability limits
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BreakEven:
    """Where the speedup falls below ``threshold`` as the rate rises.

    ``rate_rps`` is the lowest such rate: 0.0 when SD is below the threshold even at zero load,
    ``None`` (with ``always_above``) when it stays above at every rate up to the point where
    plain decoding itself saturates.
    """

    threshold: float
    rate_rps: float | None
    always_above: bool


BREAK_EVEN_GRID = 16  # rates scanned to bracket the first crossing
BREAK_EVEN_REL_TOL = 1e-5


def break_even_rates(
    model: LatencyModel,
    alpha: float,
    draft_length: int,
    workload: Workload,
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    accepted_length: float | None = None,
) -> dict[float, BreakEven]:
    """Lowest rate at which the speedup drops below each threshold.

    A grid over [0, first stability limit) brackets the first crossing, :func:`_crossing`
    refines it to 1e-5 relative. Past SD's own limit the speedup is 0, so SD overloading first is a
    crossing at μ_on.
    """
    off, on = curves(model, alpha, draft_length, workload, accepted_length)
    mu_off, mu_on = off.stability_limit_rps, on.stability_limit_rps
    stop = min(mu_off, mu_on)

    seen: dict[float, float] = {}  # every refined rate's speedup: a later threshold starts from them

    def speedup(lam: float) -> float:
        seen[lam] = value = _speedup_from(off.latency_s(lam), on.latency_s(lam), mu_off, mu_on)
        return value

    grid = [stop * i / BREAK_EVEN_GRID for i in range(BREAK_EVEN_GRID)] + [stop * (1.0 - 1e-9)]
    # The grid in one pass of each mode's chain (the same sums as latency_s, one row per rate);
    # past 0 every rate is below both limits.
    if 0.0 < stop < math.inf:
        inside = np.array(grid[1:])
        lat_off = [off.alone_s, *off.latencies_below_limit_s(inside).tolist()]
        lat_on = [on.alone_s, *on.latencies_below_limit_s(inside).tolist()]
    else:
        lat_off, lat_on = off.latencies_s(grid), on.latencies_s(grid)
    values = [_speedup_from(t_off, t_on, mu_off, mu_on) for t_off, t_on in zip(lat_off, lat_on, strict=True)]
    result: dict[float, BreakEven] = {}
    for th in (float(t) for t in thresholds):
        if values[0] < th:
            result[th] = BreakEven(th, 0.0, False)
            continue
        hit = next((i for i, v in enumerate(values) if v < th), None)
        if hit is None:
            result[th] = BreakEven(th, float(mu_on), False) if mu_on <= mu_off else BreakEven(th, None, True)
            continue
        # The first sign change among the bracket's ends and the rates refined so far in it.
        inside = sorted((x, v) for x, v in seen.items() if grid[hit - 1] < x < grid[hit])
        points = [(grid[hit - 1], values[hit - 1]), *inside, (grid[hit], values[hit])]
        k = next(i for i, (_, v) in enumerate(points) if v < th)
        (lo, v_lo), (hi, v_hi) = points[k - 1], points[k]
        near = slice(max(hit - 2, 1), min(hit + 2, BREAK_EVEN_GRID))  # not 0 nor the limit's edge
        guess = _interpolated_root(grid[near], [v - th for v in values[near]], lo, hi)
        rate = _crossing(lambda lam, th=th: speedup(lam) - th, lo, hi, v_lo - th, v_hi - th, guess)
        result[th] = BreakEven(th, rate, False)
    return result


def _interpolated_root(xs: Sequence[float], values: Sequence[float], lo: float, hi: float) -> float | None:
    """The root in (lo, hi) of the polynomial through the points (x, value) (a cubic through
    four), where it falls through the bracket: a first step for :func:`_crossing` from the
    grid's rates around a crossing. Found by Newton's method on the polynomial from the secant
    (floats, no evaluation of the curve); None where a value is not finite or Newton leaves the
    bracket."""
    if not all(map(math.isfinite, values)):
        return None
    n, c = len(xs), list(values)
    for j in range(1, n):  # divided differences: p(x) = c0 + (x − x0)·(c1 + (x − x1)·(c2 + …))
        for i in range(n - 1, j - 1, -1):
            c[i] = (c[i] - c[i - 1]) / (xs[i] - xs[i - j])

    def value_and_slope(x: float) -> tuple[float, float]:
        p, dp = c[-1], 0.0
        for i in range(n - 2, -1, -1):
            dp = dp * (x - xs[i]) + p
            p = p * (x - xs[i]) + c[i]
        return p, dp

    p_lo, p_hi = value_and_slope(lo)[0], value_and_slope(hi)[0]
    if not p_lo >= 0.0 > p_hi:
        return None
    x = lo + p_lo / (p_lo - p_hi) * (hi - lo)
    for _ in range(8):  # quadratic from the secant's ~1e-3: 1e-12 in three or four
        p, dp = value_and_slope(x)
        if not dp < 0.0:
            return None
        x -= p / dp
        if not lo < x < hi:
            return None
        if abs(p / dp) <= 1e-12 * x:
            break
    return x


def _crossing(
    f: Callable[[float], float],
    lo: float,
    hi: float,
    f_lo: float,
    f_hi: float,
    guess: float | None = None,
) -> float:
    """Where ``f`` turns negative in [lo, hi] (``f_lo`` ≥ 0 > ``f_hi``), to BREAK_EVEN_REL_TOL.

    Chandrupatla's method: inverse quadratic interpolation through the bracket's ends and the
    point dropped last where it is safe (the three values are monotone enough for the parabola
    to stay inside), bisection where it is not. The speedup falls steeply into SD's own limit,
    where a secant from that end creeps; the parabola does not, and the bracket always holds
    the crossing. Every step lands at least half the tolerance inside the bracket, so a step
    onto the crossing closes it with the next one instead of creeping toward it. The first step
    is at ``guess`` where it is inside the bracket (the grid's cubic, :func:`_interpolated_root`),
    else on the secant.
    """
    # a: the newest point, b: the bracket's other end, c: the end a replaced.
    a, fa, b, fb, c, fc = hi, f_hi, lo, f_lo, lo, f_lo
    if guess is not None and lo < guess < hi:  # a step placed by the grid around the bracket
        t = (hi - guess) / (hi - lo)
    else:
        t = f_hi / (f_hi - f_lo) if math.isfinite(f_lo - f_hi) and f_lo != f_hi else 0.5  # the secant
    while (width := abs(b - a)) > (tol := BREAK_EVEN_REL_TOL * max(a, b, 1e-12)):
        edge = 0.5 * tol / width
        x = a + min(max(t, edge), 1.0 - edge) * (b - a)
        fx = f(x)
        if (fx >= 0.0) == (fa >= 0.0):
            c, fc = a, fa
        else:
            c, fc, b, fb = b, fb, a, fa
        a, fa = x, fx
        t = 0.5
        if math.isfinite(fa - fb) and math.isfinite(fc - fb) and fa != fb and fc != fb and fc != fa:
            xi, phi = (a - b) / (c - b), (fa - fb) / (fc - fb)
            if phi * phi < xi and (1.0 - phi) ** 2 < 1.0 - xi:  # the parabola stays in the bracket
                t = fa / (fb - fa) * fc / (fb - fc) + (c - a) / (b - a) * fa / (fc - fa) * fb / (fc - fb)
    return 0.5 * (a + b)


@dataclass(frozen=True)
class DraftChoice:
    """The draft length with the lowest SD latency at one rate, and what it buys."""

    draft_length: int
    speedup: float
    latency_on_s: float


def best_draft_length(
    model: LatencyModel,
    rate_rps: float,
    alpha: float,
    workload: Workload,
    candidates: Iterable[int] = DEFAULT_DRAFT_LENGTHS,
    patience: int | None = DRAFT_SEARCH_PATIENCE,
) -> DraftChoice:
    """Best γ from ``candidates`` at this rate and per-token acceptance (ties: the shorter).

    Lowest SD latency wins; if SD is overloaded at every γ, the best capacity ratio does. The
    candidates are tried from the shortest up, and the search stops ``patience`` past the best
    (``None``: try all): SD's latency falls while a longer draft still adds accepted tokens
    (E[N] is concave in γ) and rises once the draft passes cost more than they add, with only
    the knees' ripples on top (bench/bench_model.py compares the two). Near a limit latency
    follows capacity, which rises and falls with γ the same way: while every γ tried is
    overloaded, or the best runs past ``NEAR_CAPACITY`` of its own limit, the search also goes
    on until ``CAPACITY_SEARCH_PATIENCE`` past the highest capacity (a load past every capacity,
    where a decision matters most, built all 16 curves; one near the best's limit stopped short
    of a longer draft with more room).
    """
    gammas = sorted({int(c) for c in candidates})
    if not gammas or gammas[0] < 1:
        raise ValueError("draft length candidates must be integers >= 1")
    if rate_rps < 0 or not math.isfinite(rate_rps):
        raise ValueError("arrival rate must be finite and >= 0")

    def sd(g: int) -> CurveKey:
        return True, _clamped_en(alpha, g, None), float(g)

    # The curves are built a few at a time (build_curves): SD off and the shortest drafts, which
    # every search tries, then the next two whenever the search goes on past those built.
    batch = len(gammas) if patience is None else patience + 2
    off, *first = mode_curve.many(model, workload, [_OFF, *map(sd, gammas[:batch])])
    on_curves = dict(zip(gammas, first, strict=False))
    t_off, mu_off = off.latency_s(rate_rps), off.stability_limit_rps
    best: tuple[int, float, float] | None = None
    best_overloaded: tuple[int, float, float] | None = None
    best_capacity = top_capacity = -math.inf  # SD's limit at the best γ, and the highest over those tried
    since_best = since_peak = 0
    for i, g in enumerate(gammas):
        if g not in on_curves:
            more = gammas[i : i + 2]
            on_curves.update(zip(more, mode_curve.many(model, workload, [*map(sd, more)]), strict=True))
        on = on_curves[g]
        t_on, capacity = on.latency_s(rate_rps), on.stability_limit_rps
        s = _speedup_from(t_off, t_on, mu_off, capacity)
        since_peak = 0 if capacity > top_capacity else since_peak + 1
        top_capacity = max(top_capacity, capacity)
        if math.isinf(t_on):
            if best_overloaded is None or s > best_overloaded[1]:
                best_overloaded = (g, s, t_on)
            since_best += 1
        elif best is None or t_on < best[2]:
            best, best_capacity, since_best = (g, s, t_on), capacity, 0
        else:
            since_best += 1
        if patience is None:
            continue
        past_peak = since_peak >= CAPACITY_SEARCH_PATIENCE
        if best is None:
            if past_peak:
                break
        elif since_best >= patience and (past_peak or rate_rps < NEAR_CAPACITY * best_capacity):
            break
    return DraftChoice(*(best if best is not None else best_overloaded))  # type: ignore[misc]


def throughput_at_batch(
    model: LatencyModel,
    batch: float,
    sd: bool,
    alpha: float,
    draft_length: int,
    workload: Workload,
    accepted_length: float | None = None,
) -> float:
    """Requests per second a mode completes with ``batch`` requests running: B / T(B).

    Past a compute knee this *falls* with the batch, and with a token budget the batch's own
    decode/verify tokens leave less room to admit prompts (γ+1 per sequence with SD), so a
    server pushed to a full batch (the backlog after a restart) can drain slower than its
    stability limit suggests, or not at all.
    """
    if batch <= 0:
        return 0.0
    curve = mode_curve_for(model, sd, alpha, draft_length, workload, accepted_length)
    return curve.throughput_at_batch(batch, model.max_num_batched_tokens, workload.computed_prompt_tokens)


def stability_limits(model: LatencyModel, alpha: float, draft_length: int, workload: Workload) -> tuple[float, float]:
    """(limit without SD, limit with SD) in requests per second."""
    off, on = curves(model, alpha, draft_length, workload)
    return off.stability_limit_rps, on.stability_limit_rps
