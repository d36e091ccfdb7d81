"""The step simulation behind the :class:`controller.benchmark.probe.BenchServer` protocol.

A benchmark reaches this server exactly as it reaches a real vLLM: it sends requests at
offsets and times them, and scrapes cumulative spec-decode counters. Each probe runs a fresh
virtual-time simulation from an idle engine (a real probe waits for the server to drain
before it starts); only the counters persist between probes, like a server that stays up.
That includes the prefix cache's counter but not the cache itself: each probe starts cold.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from controller.benchmark.probe import GaugeSample, ProbeError, ProbeRequest, ProbeResult, ServerCounters, ServerInfo
from controller.sim.stepsim import ServerSpec, SimResult, StepObserver, simulate


class SimulatedServer:
    """A simulated vLLM (virtual time, deterministic for a seed) implementing ``BenchServer``."""

    def __init__(self, spec: ServerSpec, seed: int = 0) -> None:
        self.spec = spec
        self._rng = np.random.default_rng(seed)
        self._drafts = 0
        self._draft_tokens = 0
        self._accepted = 0
        self._cached = 0  # vllm:prompt_tokens_cached_total
        self._kv_tokens = spec.kv_tokens()
        self._gauges: list[GaugeSample] = []

    def info(self) -> ServerInfo:
        return ServerInfo(
            draft_length=self.spec.gamma,
            kv_cache_tokens=self._kv_tokens,
            max_num_seqs=self.spec.max_num_seqs,
            max_num_batched_tokens=self.spec.max_num_batched_tokens,
            block_size=self.spec.block_size,
            # What the model prices: a preempted request's blocks kept for its readmission (its
            # prefix groups' sharing is measured apart, by vllm:prompt_tokens_cached_total). Said
            # only when on, as no label at all: the benches stored before it said anything
            # reproduce byte for byte (their digests tie calibrations to them).
            prefix_caching=True if self.spec.cache_preempted_blocks else None,
        )

    def gauges(self) -> list[GaugeSample]:
        return list(self._gauges)

    def counters(self) -> ServerCounters:
        cached = float(self._cached)  # vLLM exports it with SD off too
        if not self.spec.sd_on:
            return ServerCounters(prompt_cached_tokens=cached)
        return ServerCounters(
            accepted_tokens=float(self._accepted),
            draft_tokens=float(self._draft_tokens),
            drafts=float(self._drafts),
            prompt_cached_tokens=cached,
        )

    def probe(self, requests: Sequence[ProbeRequest]) -> list[ProbeResult]:
        if not requests:
            return []
        for i, r in enumerate(requests):
            if r.prompt_tokens < 1 or r.max_tokens < 1 or not r.send_at_s >= 0:
                raise ProbeError(f"request {i}: prompt_tokens and max_tokens must be ≥ 1, send_at_s ≥ 0 (got {r})")
        try:
            res = serve(self.spec, requests, self._rng)
        except (ValueError, RuntimeError) as e:
            raise ProbeError(f"simulated server: {e}") from e
        self._drafts += res.num_drafts
        self._draft_tokens += res.num_draft_tokens
        self._accepted += res.num_accepted_tokens
        self._cached += res.num_cached_tokens
        self._gauges = _scrapes(res, self._kv_tokens // self.spec.block_size * self.spec.block_size)
        return [
            ProbeResult(
                sent_s=float(res.arrival_s[i]),
                first_token_s=float(res.first_token_s[i]),
                done_s=float(res.finish_s[i]),
                prompt_tokens=requests[i].prompt_tokens,
                generated_tokens=int(res.generated_tokens[i]),
                token_times_s=tuple(res.token_times.get(i, ())) if res.token_times else (),
            )
            for i in range(len(requests))
        ]


def serve(
    spec: ServerSpec, requests: Sequence[ProbeRequest], rng: np.random.Generator, on_step: StepObserver | None = None
) -> SimResult:
    """Run these requests on the step simulation from an idle engine: each kind's acceptance
    drawn from its class, a prefix group's requests sharing their first blocks; ``on_step`` sees
    each step (stepsim.StepView)."""
    prefix = _prefix_arrays(requests)
    alpha = np.empty(len(requests))
    kinds = np.array([r.kind for r in requests])
    for kind in sorted(set(kinds.tolist())):  # sorted: the draws must not depend on set order
        idx = np.flatnonzero(kinds == kind)
        alpha[idx] = spec.alpha_class(kind).draw(rng, idx.size)
    trace = np.array([r.trace for r in requests], dtype=bool)
    return simulate(
        spec,
        np.array([r.send_at_s for r in requests], dtype=np.float64),
        np.array([r.prompt_tokens for r in requests], dtype=np.int64),
        np.array([r.max_tokens for r in requests], dtype=np.int64),
        alpha,
        rng,
        trace if trace.any() else None,
        **prefix,
        on_step=on_step,
    )


def _prefix_arrays(requests: Sequence[ProbeRequest]) -> dict[str, np.ndarray]:
    """simulate's prefix arguments (group strings as ints, "" → −1); none when no request has one."""
    ids: dict[str, int] = {}
    tokens: dict[str, int] = {}
    for i, r in enumerate(requests):
        if not r.prefix_group:
            continue
        if not 0 <= r.prefix_tokens <= r.prompt_tokens:
            raise ProbeError(
                f"request {i}: prefix_tokens {r.prefix_tokens} must be in [0, prompt_tokens {r.prompt_tokens}]"
            )
        first = tokens.setdefault(r.prefix_group, r.prefix_tokens)
        if first != r.prefix_tokens:
            raise ProbeError(
                f"request {i}: prefix_group {r.prefix_group!r} has prefix_tokens {r.prefix_tokens}, earlier {first}"
            )
        ids.setdefault(r.prefix_group, len(ids))
    if not ids:
        return {}
    return {
        "prefix_group": np.array([ids.get(r.prefix_group, -1) if r.prefix_group else -1 for r in requests]),
        "prefix_tokens": np.array([r.prefix_tokens if r.prefix_group else 0 for r in requests]),
    }


SCRAPE_INTERVAL_S = 1.0


def _scrapes(res: SimResult, cache_tokens: int) -> list[GaugeSample]:
    """The gauges a scraper polling once a second would have read: the state after the last
    step that ended by each scrape (an idle engine before the first)."""
    if res.step_end_s.size == 0:
        return []
    at = np.arange(0.0, float(res.step_end_s[-1]) + SCRAPE_INTERVAL_S, SCRAPE_INTERVAL_S)
    last = np.searchsorted(res.step_end_s, at, side="right") - 1
    running = np.where(last >= 0, res.step_running[np.maximum(last, 0)], 0)
    held = np.where(last >= 0, res.step_kv_tokens[np.maximum(last, 0)], 0)
    usage = held / max(cache_tokens, 1)  # vLLM: 1 − free blocks / all blocks
    return [GaugeSample(float(a), float(n), float(u)) for a, n, u in zip(at, running, usage, strict=True)]
