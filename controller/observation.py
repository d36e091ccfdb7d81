"""What a source saw: an :class:`Observation`, or an :class:`ObservationFailure` with a reason.

Missing data is never a number: a field the source could not measure is ``None``, and a source
that could not observe at all returns a failure whose reason is counted
(``sd_controller_observation_failures_total{reason}``) and makes the controller hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum


class FailureReason(StrEnum):
    UNREACHABLE = "unreachable"  # connection refused, DNS, timeout
    HTTP_ERROR = "http_error"  # non-2xx from Prometheus or /metrics
    PARSE_ERROR = "parse_error"  # garbage body: not JSON, not exposition format
    QUERY_ERROR = "query_error"  # Prometheus answered status=error
    EMPTY = "empty"  # the query matched no series
    NAN = "nan"  # a value was NaN or infinite
    STALE = "stale"  # the newest sample is older than allowed
    WARMING_UP = "warming_up"  # not enough history yet for a rate
    INCOMPLETE = "incomplete"  # a required field is missing
    IMPLAUSIBLE = "implausible"  # parses, but cannot be true (a counter going back, a rate no server serves)
    STALLED = "stalled"  # requests in the server, and no token produced over the rate window
    ASLEEP = "asleep"  # vLLM's engine is in sleep mode: a restart would wake it and take the GPU back


@dataclass(frozen=True)
class ObservationFailure:
    """The source could not produce a usable observation this tick."""

    reason: FailureReason
    detail: str = ""


@dataclass(frozen=True)
class Observation:
    """One tick's view of the vLLM server. ``None`` means "not measured", never zero.

    Rates are per second over the source's windows; acceptance is vLLM's definition
    (accepted draft tokens / draft tokens) and exists only while SD is configured.
    """

    time_s: float
    arrival_rate_rps: float | None
    arrival_rate_long_rps: float | None = None  # long window, for the trend
    arrival_rate_peak_rps: float | None = None  # highest short-window rate within the long window
    acceptance_rate: float | None = None
    position_acceptance: tuple[float, ...] | None = None  # P(position k accepted) per draft
    mean_draft_tokens: float | None = None  # draft tokens per draft (≤ γ; n-gram may propose fewer)
    mean_prompt_tokens: float | None = None
    mean_gen_tokens: float | None = None
    prompt_tokens_std: float | None = None  # spread of request lengths (from the histograms)
    gen_tokens_std: float | None = None
    running: float | None = None
    waiting: float | None = None
    mean_e2e_latency_s: float | None = None
    sd_series_present: bool | None = None  # SD counters exported: vLLM runs with SD configured
    sample_age_s: float | None = None  # age of the newest underlying sample
    # Fleet mode (sources/fleet.py): the whole fleet's arrival rate and how many replicas serve it.
    fleet_arrival_rate_rps: float | None = None
    fleet_replicas: int | None = None
    fleet_arrival_rate_long_rps: float | None = None  # the fleet's rate over long_window_s, for its trend
    # KV tokens the average running sequence reads, from vLLM's KV-usage gauges over the rate
    # window (controller/occupancy.py); None on servers (or simulators) that do not export them.
    running_context_tokens: float | None = None
    # Prompt tokens per completed request served from vLLM's prefix cache over the rate window
    # (vllm:prompt_tokens_cached_total; 0 where the counter is not exported, None: unreadable).
    cached_prompt_tokens: float | None = None
    # vLLM's enable_prefix_caching on vllm:cache_config_info (None: not exported): whether a
    # preempted request finds its blocks cached; the calibration records what it was benched with.
    prefix_caching: bool | None = None
    # When vLLM's counters started (``vllm:request_success_created``, its clock): its last
    # restart, ours or not (a crash, an operator, a rescheduled pod). None: not exported.
    server_started_at: float | None = None

    def __post_init__(self) -> None:
        for name in (
            "arrival_rate_rps",
            "arrival_rate_long_rps",
            "arrival_rate_peak_rps",
            "acceptance_rate",
            "mean_draft_tokens",
            "mean_prompt_tokens",
            "mean_gen_tokens",
            "prompt_tokens_std",
            "gen_tokens_std",
            "running",
            "waiting",
            "mean_e2e_latency_s",
            "sample_age_s",
            "fleet_arrival_rate_rps",
            "fleet_arrival_rate_long_rps",
            "running_context_tokens",
            "cached_prompt_tokens",
            "server_started_at",
        ):
            v = getattr(self, name)
            if v is not None and not math.isfinite(v):
                raise ValueError(f"Observation.{name} must be finite or None, got {v!r}")

    @property
    def accepted_length(self) -> float | None:
        """E[N] = 1 + Σ P(position k accepted), when per-position counters were read."""
        if not self.position_acceptance:
            return None
        return 1.0 + sum(self.position_acceptance)


ObserveResult = Observation | ObservationFailure


# --------------------------------------------------------------------------------------------
# The load an observation's windows describe
# --------------------------------------------------------------------------------------------
STEADY_TOLERANCE = 0.1  # the load counts as steady within ±10 % (plus Poisson noise) of its long mean


def _band(long_rps: float, window_s: float, tolerance: float) -> float:
    """How far a short window's rate strays from the long mean by ``tolerance`` and two Poisson
    standard deviations of the window's count."""
    return tolerance * long_rps + 2.0 * math.sqrt(long_rps / max(window_s, 1e-9))


def steady_load(
    rate_rps: float,
    long_rps: float | None,
    peak_rps: float | None,
    window_s: float,
    tolerance: float = STEADY_TOLERANCE,
) -> bool:
    """Whether the load held still over the long window: the short window's rate and the
    highest one within the long window both lie within ``tolerance`` (plus two Poisson
    standard deviations of a window's count) of the long window's mean.

    The model predicts the latency of a load that stays; a window after a step or inside an
    oscillation measures a queue filling or emptying. Fitted as if it were stationary, such
    windows drag the factors far off (an oscillating load made a slower fixed cost and a faster
    per-token one "explain" its latencies, and SD looked 1.45× better than it was).
    """
    if long_rps is None or long_rps <= 0:
        return True  # no long window to compare with: nothing says it moved
    band = _band(long_rps, window_s, tolerance)
    if abs(rate_rps - long_rps) > band:
        return False
    return peak_rps is None or peak_rps - long_rps <= band


def load_fell(
    rate_rps: float | None, long_rps: float | None, window_s: float, tolerance: float = STEADY_TOLERANCE
) -> bool:
    """Whether the short window's rate lies below the long window's mean by more than
    :func:`steady_load`'s band: a heavier load ran minutes ago, and a window mean of latency
    still holds requests that saw it (a drop to idle leaves the last minutes' latency behind)."""
    if rate_rps is None or long_rps is None or long_rps <= 0:
        return False
    return long_rps - rate_rps > _band(long_rps, window_s, tolerance)


def last_restart(obs: Observation, last_change_at: float | None) -> float:
    """When the server last restarted: our last change or its counters' start, whichever is
    later (-inf when neither is known). Both a change of ours and a crash leave a backlog that
    drains for minutes, and a latency window that holds the restart."""
    return max(t for t in (last_change_at, obs.server_started_at, -math.inf) if t is not None)
