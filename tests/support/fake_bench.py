"""A deterministic BenchServer in virtual time: a continuous-batching engine with known step costs.

Tests compare what the benchmark measures with the costs set here. The engine follows vLLM's
scheduler in the ways the measurement depends on: a step runs every decoding sequence plus
waiting prompts (chunked) up to a token budget; a request arriving during a step waits for
the next one; the prefill step yields the first token; with SD a decode step yields
1 + ``accepted_per_step`` tokens and the counters count what was accepted (also past
``max_tokens``, as vLLM does).

Step cost: ``base_s + per_token_s·T + (SD, decoders present) draft_pass_s·γ +
(SD) draft_per_prompt_token_s·prompt_tokens_in_step``, T = prompt-chunk tokens + Σ tokens
per decoder (1, or γ + 1 with SD).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from controller.benchmark.probe import GaugeSample, ProbeError, ProbeRequest, ProbeResult, ServerCounters, ServerInfo


@dataclass(frozen=True)
class Costs:
    base_s: float = 0.010
    per_token_s: float = 0.0001
    draft_pass_s: float = 0.002
    draft_per_prompt_token_s: float = 0.00002

    def step_s(self, prompt_tokens: int, decoders: int, gamma: int) -> float:
        tokens = prompt_tokens + decoders * (gamma + 1)
        t = self.base_s + self.per_token_s * tokens
        if gamma > 0:
            t += (self.draft_pass_s * gamma if decoders else 0.0) + self.draft_per_prompt_token_s * prompt_tokens
        return t


@dataclass
class _Seq:
    index: int
    arrive_s: float
    prompt_left: int
    max_tokens: int
    generated: int = 0
    first_s: float | None = None
    done_s: float | None = None


@dataclass
class FakeBenchServer:
    costs: Costs = field(default_factory=Costs)
    draft_length: int = 0
    accepted_per_step: int = 0  # accepted drafts per sequence per SD step (≤ draft_length)
    token_budget: int = 8192
    max_num_seqs: int = 256
    kv_cache_tokens: int | None = 100_000
    # Every probe after this many fails (a server that dies mid-run).
    fail_after_probes: int | None = None
    generate_short_by: int = 0
    accepted: float = 0.0
    draft_tokens: float = 0.0
    drafts: float = 0.0
    probes: list[list[ProbeRequest]] = field(default_factory=list)

    def info(self) -> ServerInfo:
        return ServerInfo(self.draft_length, self.kv_cache_tokens, self.max_num_seqs, self.token_budget)

    def counters(self) -> ServerCounters:
        if self.draft_length <= 0:
            return ServerCounters()
        return ServerCounters(self.accepted, self.draft_tokens, self.drafts)

    def gauges(self) -> list[GaugeSample]:
        return []  # exports no batch gauges (an older server): load tests leave the context empty

    def probe(self, requests: Sequence[ProbeRequest]) -> list[ProbeResult]:
        if self.fail_after_probes is not None and len(self.probes) >= self.fail_after_probes:
            raise ProbeError("POST /v1/completions: HTTP 500: engine dead")
        self.probes.append(list(requests))
        order = sorted(range(len(requests)), key=lambda i: requests[i].send_at_s)
        pending = [_Seq(i, requests[i].send_at_s, requests[i].prompt_tokens, requests[i].max_tokens) for i in order]
        seqs = {s.index: s for s in pending}
        running: list[_Seq] = []  # admitted, in arrival order
        gamma = self.draft_length
        now = 0.0
        while pending or running:
            while pending and pending[0].arrive_s <= now and len(running) < self.max_num_seqs:
                running.append(pending.pop(0))
            if not running:
                now = pending[0].arrive_s
                continue
            decoding = [s for s in running if s.prompt_left == 0]
            budget = self.token_budget - len(decoding) * (gamma + 1)
            chunks: list[tuple[_Seq, int]] = []
            for s in running:
                if s.prompt_left > 0 and budget > 0:
                    take = min(s.prompt_left, budget)
                    chunks.append((s, take))
                    budget -= take
            prompt = sum(n for _, n in chunks)
            now += self.costs.step_s(prompt, len(decoding), gamma)
            for s in decoding:
                made = 1
                if gamma > 0:
                    made += self.accepted_per_step
                    self.accepted += self.accepted_per_step
                    self.draft_tokens += gamma
                    self.drafts += 1
                s.generated = min(s.max_tokens, s.generated + made)
            for s, n in chunks:
                s.prompt_left -= n
                if s.prompt_left == 0:
                    s.generated = 1
                    s.first_s = now
            for s in list(running):
                if s.prompt_left == 0 and s.generated >= s.max_tokens:
                    s.done_s = now
                    running.remove(s)
        out = []
        for i, req in enumerate(requests):
            s = seqs[i]
            assert s.first_s is not None and s.done_s is not None and not math.isnan(s.done_s)
            out.append(
                ProbeResult(
                    req.send_at_s, s.first_s, s.done_s, req.prompt_tokens, req.max_tokens - self.generate_short_by
                )
            )
        return out
