"""Render vLLM 0.32 ``/metrics`` text exposition from a counters snapshot.

Names, types, label names, bucket boundaries, HELP strings and the separate ``*_created``
gauge families match real captures of vLLM 0.32 (v1 engine) in
``tests/fixtures/vllm-0.32-cpu/``. Only the families the controller, the recording rules and
the dashboards read are rendered. Pure standard library and string building, so a simulator
can serve it on every scrape without cost.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

# Bucket boundaries exactly as vLLM 0.32 exports them (see the fixture captures).
TOKEN_BUCKETS: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0)
E2E_LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
TTFT_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip

# vLLM always exports these five finished_reason values, zero or not.
FINISHED_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error", "repetition")


@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram's state: cumulative counts per upper bound, sum and count.

    ``cumulative[i]`` counts observations ``<= bounds[i]``; ``count`` is the ``+Inf`` bucket.
    """

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    sum: float = 0.0
    count: float = 0.0

    @classmethod
    def empty(cls, bounds: Sequence[float]) -> Histogram:
        """An empty histogram with the given finite upper bounds (ascending)."""
        return cls(bounds=tuple(bounds), cumulative=(0.0,) * len(bounds))

    def observe(self, value: float, n: float = 1) -> Histogram:
        """A copy with ``n`` observations of ``value`` added."""
        if n <= 0:
            return self
        cumulative = tuple(c + n if value <= b else c for b, c in zip(self.bounds, self.cumulative, strict=True))
        return replace(self, cumulative=cumulative, sum=self.sum + value * n, count=self.count + n)


@dataclass(frozen=True)
class SpecDecodeCounters:
    """The ``vllm:spec_decode_*`` counters; present only while SD is configured.

    ``accepted_per_pos[i]`` is the number of accepted tokens at draft position ``i``; its
    length is the configured number of speculative tokens.
    """

    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_pos: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)
    created_ts: float | None = None  # defaults to the engine's created_ts


@dataclass(frozen=True)
class VllmCounters:
    """A snapshot of one vLLM engine's counters, as its /metrics would show them.

    ``request_success`` maps finished_reason to a count; reasons vLLM always exports but that
    are missing here render as 0. ``spec_decode`` is None when SD is not configured, and then
    no ``vllm:spec_decode_*`` series are rendered (as with real vLLM).
    """

    model_name: str = "tiny"
    engine: str = "0"
    created_ts: float = 0.0
    request_success: Mapping[str, float] = field(default_factory=dict)
    prompt_tokens_total: float = 0.0
    prompt_tokens_cached_total: float = 0.0  # served from the prefix cache (0 where none is simulated)
    generation_tokens_total: float = 0.0
    request_prompt_tokens: Histogram = field(default_factory=lambda: Histogram.empty(TOKEN_BUCKETS))
    request_generation_tokens: Histogram = field(default_factory=lambda: Histogram.empty(TOKEN_BUCKETS))
    time_to_first_token_seconds: Histogram = field(default_factory=lambda: Histogram.empty(TTFT_BUCKETS_S))
    inter_token_latency_seconds: Histogram = field(default_factory=lambda: Histogram.empty(TOKEN_LATENCY_BUCKETS_S))
    request_time_per_output_token_seconds: Histogram = field(
        default_factory=lambda: Histogram.empty(TOKEN_LATENCY_BUCKETS_S)
    )
    e2e_request_latency_seconds: Histogram = field(default_factory=lambda: Histogram.empty(E2E_LATENCY_BUCKETS_S))
    num_requests_running: float = 0.0
    num_requests_waiting: float = 0.0
    spec_decode: SpecDecodeCounters | None = None


def format_value(value: float) -> str:
    """Format a sample value the way prometheus_client (and so vLLM) does.

    Python's float repr, except that large positive values switch to Go's exponent form
    sooner (``1.7959994703717847e+09``), and infinities/NaN use Prometheus spelling.
    """
    d = float(value)
    if d == math.inf:
        return "+Inf"
    if d == -math.inf:
        return "-Inf"
    if math.isnan(d):
        return "NaN"
    s = repr(d)
    dot = s.find(".")
    if d > 0 and dot > 6:
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return s


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    # vLLM's output lists labels sorted by name (le sits between engine and model_name).
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(pairs)) + "}"


class _Writer:
    def __init__(self, base: tuple[tuple[str, str], ...]) -> None:
        self.base = base
        self.lines: list[str] = []

    def header(self, name: str, help_text: str, kind: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, value: float, extra: tuple[tuple[str, str], ...] = ()) -> None:
        self.lines.append(f"{name}{_labels(self.base + extra)} {format_value(value)}")

    def counter(
        self,
        stem: str,
        help_text: str,
        series: Sequence[tuple[tuple[tuple[str, str], ...], float]],
        created_ts: float,
    ) -> None:
        self.header(f"{stem}_total", help_text, "counter")
        for extra, value in series:
            self.sample(f"{stem}_total", value, extra)
        self.header(f"{stem}_created", help_text, "gauge")
        for extra, _ in series:
            self.sample(f"{stem}_created", created_ts, extra)

    def gauge(self, name: str, help_text: str, value: float) -> None:
        self.header(name, help_text, "gauge")
        self.sample(name, value)

    def histogram(self, name: str, help_text: str, h: Histogram, created_ts: float) -> None:
        self.header(name, help_text, "histogram")
        for bound, cum in zip(h.bounds, h.cumulative, strict=True):
            self.sample(f"{name}_bucket", cum, (("le", format_value(bound)),))
        self.sample(f"{name}_bucket", h.count, (("le", "+Inf"),))
        self.sample(f"{name}_count", h.count)
        self.sample(f"{name}_sum", h.sum)
        self.header(f"{name}_created", help_text, "gauge")
        self.sample(f"{name}_created", created_ts)


def render(counters: VllmCounters) -> str:
    """The text exposition (format 0.0.4) of ``counters``, ending in a newline."""
    c = counters
    w = _Writer((("engine", c.engine), ("model_name", c.model_name)))
    ts = c.created_ts
    sd = c.spec_decode
    if sd is not None:
        sd_ts = ts if sd.created_ts is None else sd.created_ts
        w.counter(
            "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
            [((), sd.num_drafts)], sd_ts,
        )  # fmt: skip
        w.counter(
            "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
            [((), sd.num_draft_tokens)], sd_ts,
        )  # fmt: skip
        w.counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
            [((), sd.num_accepted_tokens)], sd_ts,
        )  # fmt: skip
        w.counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            [((("position", str(i)),), v) for i, v in enumerate(sd.accepted_per_pos)],
            sd_ts,
        )
    w.gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        c.num_requests_running,
    )
    w.gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        c.num_requests_waiting,
    )
    w.counter(
        "vllm:prompt_tokens", "Number of prefill tokens processed.",
        [((), c.prompt_tokens_total)], ts,
    )  # fmt: skip
    w.counter(
        "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
        [((), c.prompt_tokens_cached_total)], ts,
    )  # fmt: skip
    w.counter(
        "vllm:generation_tokens", "Number of generation tokens processed.",
        [((), c.generation_tokens_total)], ts,
    )  # fmt: skip
    reasons = list(FINISHED_REASONS) + sorted(set(c.request_success) - set(FINISHED_REASONS))
    w.counter(
        "vllm:request_success",
        "Count of successfully processed requests.",
        [((("finished_reason", r),), c.request_success.get(r, 0.0)) for r in reasons],
        ts,
    )
    w.histogram(
        "vllm:request_prompt_tokens", "Number of prefill tokens processed.",
        c.request_prompt_tokens, ts,
    )  # fmt: skip
    w.histogram(
        "vllm:request_generation_tokens", "Number of generation tokens processed.",
        c.request_generation_tokens, ts,
    )  # fmt: skip
    w.histogram(
        "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
        c.time_to_first_token_seconds, ts,
    )  # fmt: skip
    w.histogram(
        "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
        c.inter_token_latency_seconds, ts,
    )  # fmt: skip
    w.histogram(
        "vllm:request_time_per_output_token_seconds",
        "Histogram of time_per_output_token_seconds per request.",
        c.request_time_per_output_token_seconds, ts,
    )  # fmt: skip
    w.histogram(
        "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
        c.e2e_request_latency_seconds, ts,
    )  # fmt: skip
    return "\n".join(w.lines) + "\n"
