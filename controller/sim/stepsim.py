"""A step-level simulation of a vLLM v1 engine: one scheduler step at a time, in virtual time.

Semantics follow ``vllm/v1/core/sched/scheduler.py`` (FCFS policy):

* each step first schedules the running requests in admission order (a decode needs 1 token,
  a verify 1 + γ, a partial prefill the rest of its prompt), then — only if nobody was
  preempted — the waiting queue FCFS, chunking prompts into what is left of
  ``max_num_batched_tokens``, up to ``max_num_seqs`` running;
* KV blocks (``block_size`` tokens) are allocated as tokens are scheduled (plus γ lookahead
  slots for the next drafts, as ``allocate_slots(num_lookahead_tokens=γ)``); when a running
  request cannot get its blocks the most recently admitted running request is preempted
  (recompute: its KV is freed, it goes to the front of the waiting queue and later prefills
  its prompt plus what it already generated);
* the step in which a request's last uncomputed token is computed samples: one token, or for a
  verify 1 + the leading accepted drafts (each accepted independently with the request's α);
  the rejected drafts' KV positions are rolled back. With SD, every request that sampled gets
  γ drafts for its next step.

Automatic prefix caching (on by default in vLLM v1; ``kv_cache_manager.py``/``block_pool.py``),
for requests given a ``prefix_group``: requests of a group share their first ``prefix_tokens``
prompt tokens. Modelled:

* a request's full blocks are cached when they are *scheduled* (``allocate_slots`` caches up to
  computed + scheduled tokens): a request admitted later in the same step already hits them
  (the step writes every layer's KV before it attends, so that is safe in vLLM too);
* admission (first, or after a preemption) starts with the longest cached run of the group's
  prefix blocks, capped at ``(prompt + generated − 1) // block_size`` blocks so that at least
  one token is computed (vLLM recomputes the last block of a fully cached prompt); those
  tokens are neither scheduled nor costed, but they are context (target and draft: the draft
  shares the block table);
* a group's cached blocks are held once, in a per-group pool: the request that first computes
  them hands them over and thereafter references them like every later hit;
* ``num_cached_tokens`` (vllm:prompt_tokens_cached_total) adds each request's hit once, at its
  first admission (vLLM sets ``request.num_cached_tokens`` only while it is still −1).

With ``ServerSpec.cache_preempted_blocks`` (off by default, so the stored fidelity runs
reproduce; not modelled together with prefix groups): a preempted request's full computed blocks
stay cached under its name, evictable like any free block (the never-cached free blocks go
first, then the oldest preemption's, from its tail), and its readmission hits what is left of
them, as vLLM's ``get_computed_blocks`` does with the request's block hashes. Without it a
preempted request recomputes everything.

Simplifications: only the declared prefix is shared (vLLM would also hit a preempted request's
own earlier blocks, which ``cache_preempted_blocks`` adds, or identical blocks of unrelated
prompts); a block computed twice by two requests of a group prefilling at once stays a private
duplicate (as in vLLM) and only extends the pool when its request already references the whole
pool; pool blocks nobody references count as free, as vLLM's free queue does (the KV gauge
leaves them out), and are evicted only once the never-cached free blocks are gone, least
recently used group first, from the tail (vLLM's LRU queue can evict an idle prefix before
blocks freed after its last use).

Costs come from :mod:`controller.sim.gpu` (the target's pass over all scheduled tokens, the
draft's pass over the same tokens — it prefills every prompt too — then γ−1 single-token draft
passes per sampling request, plus the rejection sampler), times lognormal noise per step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from controller.sim import gpu as g

DEFAULT_MAX_STEPS = 5_000_000


@dataclass(frozen=True)
class AcceptanceClass:
    """Per-token draft acceptance α of one workload class: Beta with this mean, drawn per request."""

    alpha_mean: float
    concentration: float = 20.0  # a + b of the Beta: larger = requests closer to the mean

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        a = self.alpha_mean * self.concentration
        return rng.beta(a, self.concentration - a, size=n)


DEFAULT_ACCEPTANCE: dict[str, AcceptanceClass] = {
    "chat": AcceptanceClass(0.7),
    "code": AcceptanceClass(0.8),
    "long_prompt": AcceptanceClass(0.75),
    "": AcceptanceClass(0.7),  # requests without a kind
}


@dataclass(frozen=True)
class ServerSpec:
    """A simulated vLLM deployment: models, GPU, speculative and scheduler config."""

    target: g.ModelSpec = g.LLAMA_3_1_8B
    draft: g.ModelSpec | None = None  # None: SD off
    gpu: g.GpuSpec = g.H100_SXM
    draft_length: int = 0  # γ; SD is on when a draft is set and γ > 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_tokens: int | None = None  # None: from gpu.kv_capacity_tokens
    noise_sigma: float = 0.02
    acceptance: dict[str, AcceptanceClass] = field(default_factory=lambda: dict(DEFAULT_ACCEPTANCE), hash=False)
    rejection_overhead_s: float = 50e-6  # rejection sampler, per step with verifies
    max_steps: int = DEFAULT_MAX_STEPS
    # A preempted request's computed blocks stay cached and its readmission hits them (vLLM with
    # prefix caching, its default); off: it recomputes them (see the module docstring).
    cache_preempted_blocks: bool = False

    @property
    def sd_on(self) -> bool:
        return self.draft is not None and self.draft_length > 0

    @property
    def gamma(self) -> int:
        return self.draft_length if self.sd_on else 0

    def kv_tokens(self) -> int:
        if self.kv_cache_tokens is not None:
            return int(self.kv_cache_tokens)
        draft = self.draft if self.sd_on else None
        return g.kv_capacity_tokens(self.gpu, self.target, draft, self.gpu_memory_utilization)

    def alpha_class(self, kind: str) -> AcceptanceClass:
        return self.acceptance.get(kind) or self.acceptance[""]


@dataclass(frozen=True, eq=False)
class SimResult:
    """Per-request accounting (arrays in input order, seconds of virtual time) and counters."""

    arrival_s: np.ndarray
    admitted_s: np.ndarray  # first scheduled
    first_token_s: np.ndarray
    finish_s: np.ndarray
    prompt_tokens: np.ndarray
    generated_tokens: np.ndarray
    preemptions: np.ndarray
    steps: int
    num_drafts: int  # verifies (sequences with drafts, summed over steps)
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: np.ndarray  # [γ]: verifies whose draft at position k was accepted
    step_tokens: np.ndarray  # per step: scheduled tokens (target)
    step_seqs: np.ndarray  # per step: scheduled sequences
    step_s: np.ndarray  # per step: duration
    # After each step, what vLLM's gauges would read: its end, sequences running
    # (vllm:num_requests_running) and KV tokens allocated (vllm:kv_cache_usage_perc × the cache).
    step_end_s: np.ndarray = field(default_factory=lambda: np.empty(0))
    step_running: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    step_kv_tokens: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    token_times: dict[int, list[float]] | None = None  # traced requests: end of each step that emitted
    # Prefix cache: prompt tokens each request found cached at its first admission, and their
    # sum (what vllm:prompt_tokens_cached_total adds).
    cached_tokens: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    num_cached_tokens: int = 0

    @property
    def latency_s(self) -> np.ndarray:
        return self.finish_s - self.arrival_s


@dataclass(frozen=True)
class StepView:
    """One step as :func:`simulate` computed it, per scheduled sequence: the tokens it ran
    (``query_tokens``), the KV it read before them (``context_tokens``), whether it computed
    prompt tokens (``prefill``: a prompt or its chunk, or a preempted request's recompute) rather
    than decoding, whether it drafts for its next step; and the step's noise-free seconds."""

    query_tokens: np.ndarray
    context_tokens: np.ndarray
    prefill: np.ndarray
    drafting: np.ndarray
    seconds: float


StepObserver = Callable[[StepView], None]


def _ceil_div(a, b):
    return -(-a // b)


def step_time_s(spec: ServerSpec, q, ctx, sampled, verify: bool, drafting: np.ndarray) -> float:
    """Noise-free duration of one engine step (target pass, draft passes, rejection sampling)."""
    t = g.forward_time_s(spec.target, spec.gpu, g.Seqs(q, ctx, sampled))
    if spec.sd_on:
        draft, gamma = spec.draft, spec.gamma
        n_draft = int(drafting.sum())
        t += g.forward_time_s(draft, spec.gpu, g.Seqs(q, ctx, drafting.astype(np.int64)), engine_step=False)
        if gamma > 1 and n_draft:
            one = np.ones(n_draft, dtype=np.int64)
            t += (gamma - 1) * g.forward_time_s(draft, spec.gpu, g.Seqs(one, (ctx + q)[drafting]), engine_step=False)
        if verify:
            t += spec.rejection_overhead_s
    return t


class _PrefixCache:
    """Cached prefix blocks per group and who references them (see the module docstring).

    ``held[gi]`` blocks of group ``gi``'s prefix are allocated in its pool (block ``k`` holds
    tokens ``[k·bs, (k+1)·bs)``); a request references the pool's first ``shared[i]`` blocks
    and owns the rest of its blocks privately.
    """

    def __init__(self, group: np.ndarray, prefix: np.ndarray, cap: np.ndarray, bs: int) -> None:
        self.group = group  # per request: group index, −1 none
        self.prefix = prefix  # per request: shared prompt tokens
        self.cap = cap  # per group: whole blocks of its prefix
        self.bs = bs
        self.held = np.zeros(cap.size, dtype=np.int64)
        self.shared = np.zeros(group.size, dtype=np.int64)
        self.refs: list[dict[int, int]] = [{} for _ in range(cap.size)]  # blocks referenced -> holders
        self.last_use = np.zeros(cap.size, dtype=np.int64)  # step: LRU order for eviction

    def _in_use(self, gi: int) -> int:
        return max(self.refs[gi], default=0)

    def evictable(self) -> int:
        """Pool blocks nobody references: free to vLLM, evicted on demand."""
        return int(self.held.sum()) - sum(self._in_use(gi) for gi in range(self.cap.size))

    def evict(self, n: int) -> None:
        for gi in np.argsort(self.last_use, kind="stable").tolist():
            k = min(n, int(self.held[gi]) - self._in_use(gi))
            self.held[gi] -= k  # from the tail: a later hit is the shorter run that is left
            n -= k
            if n == 0:
                return
        raise RuntimeError("prefix cache: evicted more blocks than were evictable")

    def _ref(self, gi: int, k: int, step: int) -> None:
        if k:
            self.refs[gi][k] = self.refs[gi].get(k, 0) + 1
        self.last_use[gi] = step

    def _unref(self, gi: int, k: int, step: int) -> None:
        if k:
            left = self.refs[gi][k] - 1
            if left:
                self.refs[gi][k] = left
            else:
                del self.refs[gi][k]
        self.last_use[gi] = step

    def hit(self, i: int, num_tokens: int, step: int) -> int:
        """Reference request ``i``'s cached blocks at its admission; their count."""
        gi = int(self.group[i])
        if gi < 0:
            return 0
        k = min(int(self.held[gi]), (num_tokens - 1) // self.bs)
        self._ref(gi, k, step)
        self.shared[i] = k
        return k

    def keep(self, i: int, blocks: int, computed: int) -> int:
        """Request ``i`` is preempted: how many of its own ``blocks`` stay cached (none here)."""
        return 0

    def release(self, i: int, step: int) -> None:
        """Request ``i`` finished or was preempted: it stops referencing the pool."""
        gi = int(self.group[i])
        if gi >= 0:
            self._unref(gi, int(self.shared[i]), step)
            self.shared[i] = 0

    def commit(self, i: int, upto: int, blocks: np.ndarray, step: int) -> None:
        """Request ``i`` has ``upto`` tokens scheduled: hand its new full prefix blocks to the pool."""
        gi = int(self.group[i])
        if gi < 0:
            return
        full = min(min(upto, int(self.prefix[i])) // self.bs, int(self.cap[gi]))
        have = int(self.held[gi])
        if full > have and self.shared[i] == have:
            blocks[i] -= full - have
            self._unref(gi, have, step)
            self._ref(gi, full, step)
            self.shared[i] = full
            self.held[gi] = full


class _PreemptedBlocks:
    """The full blocks preempted requests computed, cached under their names (the interface of
    :class:`_PrefixCache` the step loop uses).

    ``own[i]`` blocks of request ``i`` are cached and unreferenced (free to vLLM, evicted on
    demand, oldest preemption first); at its readmission it references up to what it can use as
    ``shared[i]``, and when it finishes or is preempted again they are cached under its name again.
    """

    def __init__(self, n: int, bs: int) -> None:
        self.bs = bs
        self.own = np.zeros(n, dtype=np.int64)
        self.shared = np.zeros(n, dtype=np.int64)
        self.prefix = np.zeros(n, dtype=np.int64)  # nothing is shared between requests
        self.lru: deque[list[int]] = deque()  # [request, blocks] in the order they were cached
        self.total = 0

    @property
    def held(self) -> np.ndarray:
        return np.array([self.total], dtype=np.int64)

    def _cache(self, i: int, k: int) -> None:
        """``k`` blocks cached under request ``i`` (−1: nobody's), newest in the LRU order."""
        if k:
            if i >= 0:
                self.own[i] += k
            self.total += k
            self.lru.append([i, k])

    def evictable(self) -> int:
        return self.total

    def evict(self, n: int) -> None:
        if n > self.total:
            raise RuntimeError("preempted-block cache: evicted more blocks than were cached")
        while n:
            entry = self.lru[0]
            k = min(n, entry[1])
            entry[1] -= k
            if entry[0] >= 0:
                self.own[entry[0]] -= k
            self.total -= k
            n -= k
            if entry[1] == 0:
                self.lru.popleft()

    def keep(self, i: int, blocks: int, computed: int) -> int:
        """Request ``i`` is preempted: its full computed blocks of its own stay cached."""
        k = min(blocks, max(computed // self.bs - int(self.shared[i]), 0))
        self._cache(i, k)
        return k

    def hit(self, i: int, num_tokens: int, step: int) -> int:
        """Reference request ``i``'s cached blocks at its admission; their count (at least one token
        is computed, as vLLM recomputes the last block of a fully cached prompt)."""
        k = min(int(self.own[i]), (num_tokens - 1) // self.bs)
        if self.own[i]:
            self.total -= int(self.own[i])
            self.lru = deque(e for e in self.lru if e[0] != i)
            self._cache(-1, int(self.own[i]) - k)  # past what it can use: cached, nobody's
            self.own[i] = 0
        self.shared[i] = k
        return k

    def release(self, i: int, step: int) -> None:
        """Request ``i`` finished, was preempted or was not admitted: what it referenced is cached."""
        k, self.shared[i] = int(self.shared[i]), 0
        self._cache(i, k)

    def commit(self, i: int, upto: int, blocks: np.ndarray, step: int) -> None:
        """Nothing to hand over: a request's blocks are its own until it is preempted."""


def _prefix_cache(
    prefix_group: np.ndarray | None, prefix_tokens: np.ndarray | None, prompt: np.ndarray, bs: int
) -> _PrefixCache | None:
    """The prefix state, or None when no request can hit (then the run is exactly the cache-less one)."""
    n = prompt.size
    if prefix_group is None and prefix_tokens is None:
        return None
    if prefix_group is None or prefix_tokens is None:
        raise ValueError("prefix_group and prefix_tokens go together")
    group = np.asarray(prefix_group, dtype=np.int64)
    prefix = np.asarray(prefix_tokens, dtype=np.int64)
    if not (group.size == prefix.size == n):
        raise ValueError("prefix_group and prefix_tokens must have one entry per request")
    grouped = group >= 0
    if not grouped.any():
        return None
    if (prefix[grouped] < 0).any() or (prefix[grouped] > prompt[grouped]).any():
        raise ValueError("prefix_tokens must be in [0, prompt_tokens]")
    ids, index = np.unique(group[grouped], return_inverse=True)
    cap = np.zeros(ids.size, dtype=np.int64)
    cap[index] = prefix[grouped]
    if (cap[index] != prefix[grouped]).any():
        raise ValueError("requests of one prefix_group must share the same prefix_tokens")
    if not (cap // bs).any():
        return None  # no whole block to share
    compact = np.full(n, -1, dtype=np.int64)
    compact[grouped] = index
    return _PrefixCache(compact, np.where(grouped, prefix, 0), cap // bs, bs)


def simulate(
    spec: ServerSpec,
    arrival_s: np.ndarray,
    prompt_tokens: np.ndarray,
    gen_tokens: np.ndarray,
    alpha: np.ndarray,
    rng: np.random.Generator,
    trace: np.ndarray | None = None,
    *,
    prefix_group: np.ndarray | None = None,
    prefix_tokens: np.ndarray | None = None,
    on_step: StepObserver | None = None,
) -> SimResult:
    """Serve these requests (each generates exactly ``gen_tokens``) from an idle engine at t=0.

    ``prefix_group`` (int ids, −1: none) and ``prefix_tokens``: requests of a group share their
    first ``prefix_tokens`` prompt tokens, which vLLM's prefix cache serves once computed.
    ``on_step`` sees what each step computed (a diagnostic's view; it changes nothing).
    """
    arrival = np.asarray(arrival_s, dtype=np.float64)
    prompt = np.asarray(prompt_tokens, dtype=np.int64)
    gen_total = np.asarray(gen_tokens, dtype=np.int64)
    alpha = np.asarray(alpha, dtype=np.float64)
    n = arrival.size
    if not (prompt.size == gen_total.size == alpha.size == n):
        raise ValueError("arrival_s, prompt_tokens, gen_tokens and alpha must have the same length")
    if n and (prompt.min() < 1 or gen_total.min() < 1):
        raise ValueError("prompt_tokens and gen_tokens must be ≥ 1")
    bs = spec.block_size
    gamma = spec.gamma
    total_blocks = spec.kv_tokens() // bs
    # The most a request ever holds: all its tokens, a last verify's drafts and the lookahead.
    if n and int(_ceil_div(prompt + gen_total + 2 * gamma, bs).max()) > total_blocks:
        raise ValueError(f"a request needs more KV than the cache holds ({total_blocks * bs} tokens)")
    budget_tokens = spec.max_num_batched_tokens
    pc: _PrefixCache | _PreemptedBlocks | None = _prefix_cache(prefix_group, prefix_tokens, prompt, bs)
    if spec.cache_preempted_blocks:
        if pc is not None:
            raise ValueError("cache_preempted_blocks is not modelled together with prefix groups")
        pc = _PreemptedBlocks(n, bs)
    cached = np.zeros(n, dtype=np.int64)

    computed = np.zeros(n, dtype=np.int64)  # tokens with KV (vLLM num_computed_tokens)
    generated = np.zeros(n, dtype=np.int64)
    blocks = np.zeros(n, dtype=np.int64)
    has_drafts = np.zeros(n, dtype=bool)  # drafts were proposed for its next step
    admitted = np.full(n, np.nan)
    first_tok = np.full(n, np.nan)
    finish = np.full(n, np.nan)
    preempt = np.zeros(n, dtype=np.int64)
    per_pos = np.zeros(gamma, dtype=np.int64)
    drafts = draft_tokens = accepted_total = 0
    log_tokens: list[int] = []
    log_seqs: list[int] = []
    log_s: list[float] = []
    log_end: list[float] = []
    log_running: list[int] = []
    log_kv: list[int] = []
    traced = np.zeros(n, dtype=bool) if trace is None else np.asarray(trace, dtype=bool)
    token_times: dict[int, list[float]] = {int(i): [] for i in np.flatnonzero(traced)}

    order = np.argsort(arrival, kind="stable")
    arr_sorted = arrival[order]
    next_arr = 0
    waiting: deque[int] = deque()
    running = np.empty(0, dtype=np.int64)  # request ids in admission order
    free_blocks = total_blocks

    def take(k: int) -> int:
        """Free blocks left after allocating ``k``, evicting unreferenced prefix blocks first if short."""
        if pc is not None and k > free_blocks:
            pc.evict(k - free_blocks)
            return 0
        return free_blocks - k

    done = 0
    t = 0.0
    steps = 0
    while done < n:
        if steps >= spec.max_steps:
            raise RuntimeError(f"step simulation exceeded max_steps={spec.max_steps}")
        j = int(np.searchsorted(arr_sorted, t, side="right"))
        if j > next_arr:
            waiting.extend(order[next_arr:j].tolist())
            next_arr = j
        if running.size == 0 and not waiting:
            t = float(arr_sorted[next_arr])  # idle: jump to the next arrival
            continue

        # --- running requests, in admission order, within the token budget
        r = running
        remaining = prompt[r] + generated[r] - computed[r]
        spec_k = np.where(has_drafts[r], gamma, 0)
        want = remaining + spec_k
        before = np.cumsum(want) - want
        sched = np.clip(budget_tokens - before, 0, want)
        held = blocks[r] if pc is None else blocks[r] + pc.shared[r]
        need = np.maximum(_ceil_div(computed[r] + sched + gamma, bs) - held, 0)
        preempted = int(need.sum()) > free_blocks + (0 if pc is None else pc.evictable())
        if not preempted:
            blocks[r] += need
            free_blocks = take(int(need.sum()))
        else:
            running, r, sched, free_blocks = _schedule_with_preemption(
                r,
                want,
                computed,
                blocks,
                has_drafts,
                preempt,
                waiting,
                free_blocks,
                budget_tokens,
                bs,
                gamma,
                pc,
                steps,
            )
        keep = sched > 0
        r, sched = r[keep], sched[keep]
        budget = budget_tokens - int(sched.sum())
        if pc is not None:  # vLLM caches the blocks it allocates for the scheduled tokens
            inside = computed[r] < pc.prefix[r]  # only those still computing their prefix can add any
            for rid, upto in zip(r[inside].tolist(), (computed[r] + sched)[inside].tolist(), strict=True):
                pc.commit(rid, upto, blocks, steps)

        # --- waiting requests, FCFS, only when nobody was preempted this step
        new_ids: list[int] = []
        new_sched: list[int] = []
        while not preempted and waiting and budget > 0 and running.size + len(new_ids) < spec.max_num_seqs:
            rid = waiting[0]
            hit = 0 if pc is None else pc.hit(rid, int(prompt[rid] + generated[rid]), steps)
            s = min(int(prompt[rid] + generated[rid] - computed[rid]) - hit * bs, budget)
            nb = _ceil_div(int(computed[rid]) + hit * bs + s + gamma, bs) - int(blocks[rid]) - hit
            if nb > free_blocks + (0 if pc is None else pc.evictable()):
                if pc is not None:
                    pc.release(rid, steps)
                break
            waiting.popleft()
            blocks[rid] += nb
            free_blocks = take(nb)
            budget -= s
            new_ids.append(rid)
            new_sched.append(s)
            computed[rid] += hit * bs
            if np.isnan(admitted[rid]):
                admitted[rid] = t
                cached[rid] = hit * bs  # vLLM counts a request's hit once, at its first scheduling
            if pc is not None:
                pc.commit(rid, int(computed[rid]) + s, blocks, steps)
        if new_ids:
            ids = np.array(new_ids, dtype=np.int64)
            r = np.concatenate([r, ids])
            sched = np.concatenate([sched, np.array(new_sched, dtype=np.int64)])
            running = np.concatenate([running, ids])
        if r.size == 0:
            raise RuntimeError("scheduler made no progress (KV cache too small?)")

        # --- what the step computes and samples
        ctx = computed[r]
        n_tokens = prompt[r] + generated[r]
        k_spec = np.where(has_drafts[r], gamma, 0)
        k_spec = np.minimum(k_spec, np.maximum(ctx + sched - n_tokens, 0))  # drafts cut by the budget
        samples = ctx + sched >= n_tokens
        verify = samples & (k_spec > 0)
        sampled = np.where(samples, 1 + k_spec, 0)
        n_verify = int(verify.sum())
        acc = np.zeros(r.size, dtype=np.int64)
        if n_verify:
            a = alpha[r[verify]]
            kv = k_spec[verify]
            hits = rng.random((n_verify, gamma)) < a[:, None]
            hits &= np.arange(gamma)[None, :] < kv[:, None]
            lead = np.cumprod(hits, axis=1)
            acc[verify] = lead.sum(axis=1)
            per_pos += lead.sum(axis=0)
            drafts += n_verify
            draft_tokens += int(kv.sum())
            accepted_total += int(acc.sum())
        emitted = np.where(samples, 1 + acc, 0)
        emitted = np.minimum(emitted, gen_total[r] - generated[r])
        drafting = samples & (generated[r] + emitted < gen_total[r]) if gamma else samples
        dt = step_time_s(spec, sched, ctx, sampled, n_verify > 0, drafting)
        if on_step is not None:
            on_step(StepView(sched, ctx, ctx + 1 < n_tokens, drafting, dt))
        dt *= g.lognormal_noise(rng, spec.noise_sigma)
        t_end = t + dt

        computed[r] = ctx + sched - np.where(verify, k_spec - acc, 0)  # roll back rejected drafts
        first = (generated[r] == 0) & (emitted > 0)
        first_tok[r[first]] = t_end
        generated[r] += emitted
        has_drafts[r] = drafting if gamma else False
        fin = generated[r] >= gen_total[r]
        if fin.any():
            fid = r[fin]
            finish[fid] = t_end
            free_blocks += int(blocks[fid].sum())
            blocks[fid] = 0
            if pc is not None:
                for rid in fid.tolist():
                    pc.release(rid, steps)
            done += fid.size
            running = running[~np.isin(running, fid)]
        log_tokens.append(int(sched.sum()))
        log_seqs.append(int(r.size))
        log_s.append(dt)
        log_end.append(t_end)
        log_running.append(int(running.size))
        if not 0 <= free_blocks <= total_blocks:
            raise RuntimeError(f"KV block accounting broken: {free_blocks} free of {total_blocks}")
        # vLLM's usage gauge counts referenced blocks: cached ones nobody uses sit in its free queue.
        log_kv.append((total_blocks - free_blocks - (0 if pc is None else pc.evictable())) * bs)
        if token_times:
            for rid in r[(emitted > 0) & traced[r]].tolist():
                token_times[rid].append(t_end)
        t = t_end
        steps += 1

    pooled = 0 if pc is None else int(pc.held.sum())
    if free_blocks + pooled != total_blocks or blocks.any() or (pc is not None and pc.shared.any()):
        raise RuntimeError(f"KV block accounting broken: {free_blocks} free + {pooled} cached of {total_blocks}")
    return SimResult(
        arrival_s=arrival,
        admitted_s=admitted,
        first_token_s=first_tok,
        finish_s=finish,
        prompt_tokens=prompt,
        generated_tokens=generated,
        preemptions=preempt,
        steps=steps,
        num_drafts=drafts,
        num_draft_tokens=draft_tokens,
        num_accepted_tokens=accepted_total,
        accepted_per_pos=per_pos,
        step_tokens=np.asarray(log_tokens, dtype=np.int64),
        step_seqs=np.asarray(log_seqs, dtype=np.int64),
        step_s=np.asarray(log_s),
        step_end_s=np.asarray(log_end),
        step_running=np.asarray(log_running, dtype=np.int64),
        step_kv_tokens=np.asarray(log_kv, dtype=np.int64),
        token_times=token_times or None,
        cached_tokens=cached,
        num_cached_tokens=int(cached.sum()),
    )


def _schedule_with_preemption(
    r, want, computed, blocks, has_drafts, preempt, waiting, free_blocks, budget, bs, lookahead, pc=None, step=0
):
    """The slow path of the running loop: allocate in order, preempting from the back (vLLM FCFS).

    A victim frees its own blocks and stops referencing its group's cached prefix (which stays
    cached). Returns (running survivors, scheduled ids, their tokens, free blocks).
    """
    run = r.tolist()
    want_of = dict(zip(run, want.tolist(), strict=True))
    out_ids: list[int] = []
    out_sched: list[int] = []
    i = 0
    while i < len(run) and budget > 0:
        rid = run[i]
        s = min(want_of[rid], budget)
        held = int(blocks[rid]) + (0 if pc is None else int(pc.shared[rid]))
        need = max(_ceil_div(int(computed[rid]) + s + lookahead, bs) - held, 0)
        self_preempted = False
        while need > free_blocks + (0 if pc is None else pc.evictable()):
            victim = run.pop()
            kept = 0 if pc is None else pc.keep(victim, int(blocks[victim]), int(computed[victim]))
            free_blocks += int(blocks[victim]) - kept
            blocks[victim] = 0
            if pc is not None:
                pc.release(victim, step)
            computed[victim] = 0
            has_drafts[victim] = False
            preempt[victim] += 1
            waiting.appendleft(victim)
            if victim == rid:
                self_preempted = True
                break
        if self_preempted:
            break
        blocks[rid] += need
        if pc is not None and need > free_blocks:
            pc.evict(need - free_blocks)
            free_blocks = need
        free_blocks -= need
        budget -= s
        out_ids.append(rid)
        out_sched.append(s)
        i += 1
    survivors = np.array(run, dtype=np.int64)
    return survivors, np.array(out_ids, dtype=np.int64), np.array(out_sched, dtype=np.int64), free_blocks
