"""What a benchmark may ask of a server, and what it gets back.

A :class:`BenchServer` answers one question: "send these requests at these offsets; when did
each one's first token and last token come back?" plus the counters and batch gauges a user
can scrape from vLLM's /metrics. Nothing else: a benchmark that needs a number must derive it from these
observables, which is all a real server offers. A real vLLM over HTTP and a simulated server
implement the same protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ProbeRequest:
    """One request of a probe. ``max_tokens`` are generated exactly (``ignore_eos``)."""

    send_at_s: float  # seconds after the probe starts
    prompt_tokens: int
    max_tokens: int
    # Workload class of the content ("chat", "code", ...): a real server's acceptance depends on
    # what the text is; the HTTP server picks its prompt text by it, a simulator its acceptance.
    kind: str = ""
    # Report when each streamed chunk (one engine step's output) arrived: lets a benchmark
    # count steps and time them directly instead of inferring them from totals.
    trace: bool = False
    # Requests with the same non-empty group share their first ``prefix_tokens`` prompt tokens
    # (a system prompt): vLLM's prefix cache serves them once one request has computed them.
    prefix_group: str = ""
    prefix_tokens: int = 0


@dataclass(frozen=True)
class ProbeResult:
    """Timings of one request, seconds after the probe started."""

    sent_s: float
    first_token_s: float
    done_s: float
    prompt_tokens: int
    generated_tokens: int
    token_times_s: tuple[float, ...] = ()  # arrival of each output chunk (traced requests only)


@dataclass(frozen=True)
class ServerCounters:
    """Cumulative counters scraped from the server (vLLM 0.32 names); None where absent."""

    accepted_tokens: float | None = None  # vllm:spec_decode_num_accepted_tokens_total
    draft_tokens: float | None = None  # vllm:spec_decode_num_draft_tokens_total
    drafts: float | None = None  # vllm:spec_decode_num_drafts_total
    # vllm:prompt_tokens_cached_total: prompt tokens served from the prefix cache (SD on or off)
    prompt_cached_tokens: float | None = None


@dataclass(frozen=True)
class ServerInfo:
    """Static facts about the server being measured."""

    draft_length: int  # γ of its speculative config; 0 = SD off
    kv_cache_tokens: int | None = None  # vllm:cache_config_info num_gpu_blocks × block_size
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None  # vllm:cache_config_info block_size: tokens per KV block
    # vllm:cache_config_info enable_prefix_caching: a preempted request's computed blocks stay
    # cached for its readmission (None: not exported)
    prefix_caching: bool | None = None


@dataclass(frozen=True)
class GaugeSample:
    """vLLM's batch gauges as one scrape saw them during a probe."""

    at_s: float  # seconds after the probe started
    running: float  # vllm:num_requests_running (summed over engines)
    kv_usage: float  # vllm:kv_cache_usage_perc, a fraction of the cache (0–1)


class BenchServer(Protocol):
    """A server under measurement (real vLLM over HTTP, or a simulated one)."""

    def info(self) -> ServerInfo:
        """Static facts: SD config, KV capacity, scheduler limits (None where unknown)."""
        ...

    def counters(self) -> ServerCounters:
        """The counters now (the spec-decode ones None with SD off)."""
        ...

    def probe(self, requests: Sequence[ProbeRequest]) -> list[ProbeResult]:
        """Send the requests at their offsets; wait for all; results in the same order.

        Raises :class:`controller.benchmark.probe.ProbeError` (one line) when a request fails.
        """
        ...

    def gauges(self) -> Sequence[GaugeSample]:
        """The batch gauges scraped about once a second during the last probe (empty: none exported)."""
        ...


class ProbeError(RuntimeError):
    """A request failed or the server misbehaved; ``str()`` is one line."""
