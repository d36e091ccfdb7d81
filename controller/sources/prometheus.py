"""Observe vLLM through Prometheus' HTTP API (``/api/v1/query``), with vLLM 0.32's metric names.

Every query is a template overridable by name (setting ``queries``); ``$SEL`` is replaced by the
label selector of this controller's vLLM, ``$W`` / ``$AW`` / ``$LW`` by the rate, acceptance and
long windows. Prometheus' ``rate()`` already handles counter resets. An empty vector or NaN for
the arrival rate is a failure with a name; for acceptance it only means SD is off (or drafted
nothing), which the assessment handles with the last measured value.

Values that cannot be true are held with reason ``implausible``, never clamped into numbers: an
arrival rate (short, long or peak) below what queue-draining estimates can produce (``deriv`` of
the queues may dip under zero by at most 1.5 × max_num_seqs / window when the queue empties
mid-window), or above ``max_rate_rps``; more running requests than ``max_num_seqs`` per engine;
a ``position`` label that is not an integer; an acceptance above 1 (beyond rounding); a negative
mean, queue or latency, a mean length past ``MAX_TOKENS_PER_REQUEST`` or a mean latency past
``MAX_E2E_LATENCY_S`` (no query says the server's uptime); ±Inf where a ratio's denominator did
not move. NaN (0/0: nothing to measure) stays "not measured". An answer that is not an instant
vector of labelled values (an element that is a list or null, JSON nested past the parser, a
body past ``MAX_BODY_BYTES``) is a parse error; errors show the URL without its credentials.

The running batch's KV context is optional: its queries failing, matching nothing, or answering
nonsense (a usage outside [0, 1]) leave ``running_context_tokens`` None, never fail the tick.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping

import requests
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_fixed

from controller import deadline
from controller.errors import redact_url
from controller.histograms import std_from_buckets
from controller.observation import FailureReason, Observation, ObservationFailure, ObserveResult
from controller.sources.base import (
    MAX_TOKENS_PER_REQUEST,
    TRANSIENT_HTTP_ERRORS,
    BodyTooLarge,
    capped_body,
    observation_limits,
    out_of_range,
    probability,
)
from controller.sources.kv_context import (
    CacheCapacity,
    all_prefix_caching,
    cache_capacity,
    context_tokens,
    held_tokens,
    prefix_caching,
)

DEFAULT_QUERIES: dict[str, str] = {
    # Completions plus queue growth: during overload completions alone cap at capacity.
    "arrival_rate": (
        "sum(rate(vllm:request_success_total{$SEL}[$W]))"
        " + sum(deriv(vllm:num_requests_running{$SEL}[$W]))"
        " + sum(deriv(vllm:num_requests_waiting{$SEL}[$W]))"
    ),
    "arrival_rate_long": (
        "sum(rate(vllm:request_success_total{$SEL}[$LW]))"
        " + sum(deriv(vllm:num_requests_running{$SEL}[$LW]))"
        " + sum(deriv(vllm:num_requests_waiting{$SEL}[$LW]))"
    ),
    # The busiest short window of the last long one: an oscillating load is judged by its peaks.
    "arrival_rate_peak": "max_over_time(sum(rate(vllm:request_success_total{$SEL}[$W]))[$LW:$W])",
    "acceptance_rate": (
        "sum(rate(vllm:spec_decode_num_accepted_tokens_total{$SEL}[$AW]))"
        " / sum(rate(vllm:spec_decode_num_draft_tokens_total{$SEL}[$AW]))"
    ),
    "position_acceptance": (
        "sum by (position) (rate(vllm:spec_decode_num_accepted_tokens_per_pos_total{$SEL}[$AW]))"
        " / scalar(sum(rate(vllm:spec_decode_num_drafts_total{$SEL}[$AW])))"
    ),
    "mean_draft_tokens": (
        "sum(rate(vllm:spec_decode_num_draft_tokens_total{$SEL}[$AW]))"
        " / sum(rate(vllm:spec_decode_num_drafts_total{$SEL}[$AW]))"
    ),
    "mean_prompt_tokens": (
        "sum(rate(vllm:request_prompt_tokens_sum{$SEL}[$AW])) / sum(rate(vllm:request_prompt_tokens_count{$SEL}[$AW]))"
    ),
    "mean_gen_tokens": (
        "sum(rate(vllm:request_generation_tokens_sum{$SEL}[$AW]))"
        " / sum(rate(vllm:request_generation_tokens_count{$SEL}[$AW]))"
    ),
    # Bucket increases by `le`: the spread of the lengths (controller/histograms.py).
    "prompt_tokens_buckets": "sum by (le) (increase(vllm:request_prompt_tokens_bucket{$SEL}[$AW]))",
    "gen_tokens_buckets": "sum by (le) (increase(vllm:request_generation_tokens_bucket{$SEL}[$AW]))",
    "mean_e2e_latency": (
        "sum(rate(vllm:e2e_request_latency_seconds_sum{$SEL}[$AW]))"
        " / sum(rate(vllm:e2e_request_latency_seconds_count{$SEL}[$AW]))"
    ),
    # A stalled engine (sources/vllm_metrics.py): requests in the server through the whole rate
    # window, and neither a token produced nor a request completed in it.
    "busy_min": (
        "sum(min_over_time(vllm:num_requests_running{$SEL}[$W]))"
        " + sum(min_over_time(vllm:num_requests_waiting{$SEL}[$W]))"
    ),
    "progress": (
        "sum(increase(vllm:generation_tokens_total{$SEL}[$W])) + sum(increase(vllm:request_success_total{$SEL}[$W]))"
    ),
    # Engines in vLLM's sleep mode (its GPU given to something else): empty when none.
    "asleep": 'count(vllm:engine_sleep_state{sleep_state="awake",$SEL} < 0.5)',
    "running": "sum(vllm:num_requests_running{$SEL})",
    "waiting": "sum(vllm:num_requests_waiting{$SEL})",
    "sd_present": "count(vllm:spec_decode_num_drafts_total{$SEL})",
    "sample_age": "time() - max(timestamp(vllm:num_requests_running{$SEL}))",
    # When the newest of the servers started counting (its oldest series: one created later
    # is a label seen late, not a restart): a restart's backlog is no load (assessment.py).
    "server_started": "max(min by (instance) (vllm:request_success_created{$SEL}))",
    # The running batch's KV context (sources/kv_context.py): per engine, over the rate window.
    "kv_cache_usage": "avg_over_time(vllm:kv_cache_usage_perc{$SEL}[$W])",
    "running_mean": "avg_over_time(vllm:num_requests_running{$SEL}[$W])",
    # vllm:cache_config_info has no model_name label: its engines are those of the selected series.
    "cache_config": "vllm:cache_config_info and on (job, instance, engine) vllm:num_requests_running{$SEL}",
    "cached_prompt_tokens": (
        "sum(increase(vllm:prompt_tokens_cached_total{$SEL}[$W])) / sum(increase(vllm:request_success_total{$SEL}[$W]))"
    ),
}


OBSERVE_BUDGET_TIMEOUTS = 3  # one observe (about 20 queries) may take this many timeouts in all


def _duration(seconds: float) -> str:
    return f"{round(seconds)}s"


def render_queries(
    selector: str,
    rate_window_s: float,
    acceptance_window_s: float,
    long_window_s: float,
    overrides: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The PromQL this controller runs, with selector and windows filled in."""
    unknown = set(overrides or {}) - set(DEFAULT_QUERIES)
    if unknown:
        raise ValueError(f"unknown query name(s): {', '.join(sorted(unknown))} (known: {', '.join(DEFAULT_QUERIES)})")
    templates = {**DEFAULT_QUERIES, **(overrides or {})}
    sel = selector.strip().strip("{}")
    return {
        name: q.replace("$SEL", sel)
        .replace("$AW", _duration(acceptance_window_s))
        .replace("$LW", _duration(long_window_s))
        .replace("$W", _duration(rate_window_s))
        for name, q in templates.items()
    }


class QueryFailed(Exception):
    def __init__(self, reason: FailureReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class PrometheusSource:
    """One instant query per field each tick, evaluated at ``now``."""

    def __init__(
        self,
        url: str,
        selector: str = "",
        rate_window_s: float = 60.0,
        acceptance_window_s: float = 300.0,
        long_window_s: float = 900.0,
        queries: Mapping[str, str] | None = None,
        timeout_s: float = 5.0,
        session: requests.Session | None = None,
        max_num_seqs: int | None = None,
        max_rate_rps: float | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self._shown_url = redact_url(self.url)  # for errors: no credentials
        self.rate_window_s = rate_window_s
        self.long_window_s = long_window_s
        self.max_num_seqs = max_num_seqs
        self.max_rate_rps = max_rate_rps
        self.queries = render_queries(selector, rate_window_s, acceptance_window_s, long_window_s, queries)
        self.timeout_s = timeout_s
        self._session = deadline.session(session)
        self._observe_deadline: float | None = None  # monotonic; all queries of one observe

    @retry(
        retry=retry_if_exception_type(TRANSIENT_HTTP_ERRORS),
        stop=stop_after_attempt(2),
        wait=wait_fixed(0.5),
        reraise=True,
    )
    def _get(self, promql: str, now: float | None) -> requests.Response:
        params = {"query": promql}
        if now is not None:
            params["time"] = f"{now:.3f}"
        budget = self.timeout_s
        if self._observe_deadline is not None:
            budget = min(budget, self._observe_deadline - time.monotonic())
            if budget <= 0:
                raise deadline.DeadlineExceeded(f"observe took over {OBSERVE_BUDGET_TIMEOUTS} × {self.timeout_s:g}s")
        url = f"{self.url}/api/v1/query"
        return deadline.request(self._session, "GET", url, budget, params=params, hooks=capped_body())

    def query(self, promql: str, now: float | None = None) -> list[tuple[dict[str, str], float]]:
        """Instant vector as (labels, value) pairs; raises :class:`QueryFailed` with a reason."""
        shown = self._shown_url
        try:
            resp = self._get(promql, now)
        except requests.RequestException as exc:  # refused, timed out, or cut off mid-body
            raise QueryFailed(FailureReason.UNREACHABLE, f"{shown}: {type(exc).__name__}") from None
        except BodyTooLarge as exc:
            raise QueryFailed(FailureReason.PARSE_ERROR, f"{shown}: {exc}") from None
        try:
            body = resp.json()
        except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than a parser goes
            if resp.status_code >= 400:
                raise QueryFailed(FailureReason.HTTP_ERROR, f"{shown}: HTTP {resp.status_code}") from None
            what = "nested too deeply" if isinstance(exc, RecursionError) else "not JSON"
            raise QueryFailed(FailureReason.PARSE_ERROR, f"{shown}: response is {what}") from None
        if not isinstance(body, dict):
            raise QueryFailed(FailureReason.PARSE_ERROR, f"{shown}: response is not a JSON object")
        if body.get("status") != "success":
            if resp.status_code >= 500:
                raise QueryFailed(FailureReason.HTTP_ERROR, f"{shown}: HTTP {resp.status_code}")
            raise QueryFailed(FailureReason.QUERY_ERROR, f"{body.get('errorType')}: {body.get('error')}"[:200])
        data = body.get("data")
        if not isinstance(data, dict):
            raise QueryFailed(FailureReason.PARSE_ERROR, "data is not an object")
        kind, result = data.get("resultType"), data.get("result")
        try:
            if kind == "scalar":
                return [({}, float(result[1]))]
            if kind != "vector" or not isinstance(result, list):
                raise QueryFailed(FailureReason.PARSE_ERROR, f"unexpected resultType {kind!r}")
            return [_sample(item) for item in result]
        except (TypeError, KeyError, IndexError, ValueError) as exc:
            raise QueryFailed(
                FailureReason.PARSE_ERROR, f"malformed result: {type(exc).__name__}: {exc}"[:200]
            ) from None

    def _scalar(self, name: str, now: float, required: bool) -> float | None:
        """One value; ``None`` when empty or NaN and not required (else QueryFailed)."""
        result = self.query(self.queries[name], now)
        if not result:
            if required:
                raise QueryFailed(FailureReason.EMPTY, f"{name}: no series matched")
            return None
        value = sum(v for _, v in result)
        if not math.isfinite(value):
            if required:
                raise QueryFailed(FailureReason.NAN, f"{name}: value is {value}")
            return None
        return value

    def _value(self, name: str, now: float) -> float | None:
        """One optional value, summed over its series: None when empty or NaN (0/0, nothing to
        measure); ±Inf is returned, for the caller to hold as implausible."""
        result = self.query(self.queries[name], now)
        value = sum(v for _, v in result) if result else math.nan
        return None if math.isnan(value) else value

    def _check_rate(
        self, name: str, rate: float | None, window_s: float, deriv: bool = True, optional: bool = False
    ) -> float | None:
        """A rate, with estimation noise below zero read as 0; QueryFailed if it lies (an
        ``optional`` one below zero past that noise: None, not measured)."""
        if rate is None:
            return None
        if not math.isfinite(rate):
            raise QueryFailed(FailureReason.IMPLAUSIBLE, f"{name} is {rate} req/s")
        if rate < 0:
            # A queue that empties mid-window makes deriv() overshoot by up to 1.5·Δqueue/window.
            noise = 1.5 * self.max_num_seqs / window_s if self.max_num_seqs and deriv else 0.0
            if rate < -noise - 1e-9:
                if optional:
                    # The long window's deriv() over a history shorter than the window (a server
                    # minutes old) undershoots as well: not measured, rather than a held tick.
                    return None
                raise QueryFailed(FailureReason.IMPLAUSIBLE, f"{name} is negative ({rate:g} req/s)")
            return 0.0
        if self.max_rate_rps is not None and rate > self.max_rate_rps:
            raise QueryFailed(
                FailureReason.IMPLAUSIBLE,
                f"{name} {rate:.1f} req/s is above the plausible {self.max_rate_rps:g}",
            )
        return rate

    def _check_progress(self, now: float) -> None:
        """QueryFailed(stalled) where requests sat in the server through the rate window and
        nothing moved; nothing where a query is empty (no token counter: not judged)."""
        busy = self._value("busy_min", now)
        if busy is None or not busy > 0.0:
            return
        progress = self._value("progress", now)
        if progress is not None and progress == 0.0:
            raise QueryFailed(
                FailureReason.STALLED,
                f"requests in the server for {_duration(self.rate_window_s)} (at least {busy:g} at every"
                " sample) and no token produced nor request completed",
            )

    def _running(self, now: float) -> float | None:
        result = self.query(self.queries["running"], now)
        if not result or not all(math.isfinite(v) for _, v in result):
            return None
        running = sum(v for _, v in result)
        if running < 0:
            raise QueryFailed(FailureReason.IMPLAUSIBLE, f"running is negative ({running:g})")
        if self.max_num_seqs is not None and running > self.max_num_seqs * max(len(result), 1):
            raise QueryFailed(
                FailureReason.IMPLAUSIBLE, f"running is {running:g}, above max_num_seqs={self.max_num_seqs}"
            )
        return running

    def _spread(self, name: str, now: float, mean: float | None) -> float | None:
        """Standard deviation from a ``sum by (le)`` bucket query; None when it cannot be read
        (absent series, a non-numeric ``le``): a spread is optional, never a reason to hold."""
        if mean is None:
            return None
        try:
            rows = self.query(self.queries[name], now)
        except QueryFailed:
            return None
        pairs = [(_le(labels), v) for labels, v in rows]
        if not pairs or any(le is None or not math.isfinite(v) for le, v in pairs):
            return None
        pairs.sort(key=lambda p: p[0])  # type: ignore[arg-type,return-value]
        return std_from_buckets([p[0] for p in pairs], [p[1] for p in pairs], mean)  # type: ignore[misc]

    def _cached_prompt_tokens(self, now: float) -> float | None:
        """Prompt tokens per completed request served from the prefix cache (0 without the
        counter); None when the query fails or reads garbage: a hold, never a zero."""
        try:
            return _per_request(self.query(self.queries["cached_prompt_tokens"], now))
        except QueryFailed:
            return None

    def _cache_config(self, now: float) -> list | None:
        """vllm:cache_config_info's series (labels, value) of the selected engines; None when
        the query fails: what needs them is then unknown, never a failed observation."""
        try:
            return self.query(self.queries["cache_config"], now)
        except QueryFailed:
            return None

    def _running_context(self, now: float, cached: float | None, config: list | None) -> float | None:
        """Σ usage × capacity / Σ running over the rate window, engines matched by their
        (job, instance, engine) labels; None when anything is missing, unreadable or garbage."""
        if config is None:
            return None
        try:
            usage = {_engine(labels): v for labels, v in self.query(self.queries["kv_cache_usage"], now)}
            running_rows = self.query(self.queries["running_mean"], now)
        except QueryFailed:
            return None
        capacity: dict[tuple[str, str, str], CacheCapacity] = {}
        for labels, _ in config:
            cap = cache_capacity(labels)
            if cap is not None:
                capacity[_engine(labels)] = cap
        if set(usage) != {_engine(labels) for labels, _ in running_rows}:
            return None  # an engine runs sequences whose KV usage is not exported
        running = sum(v for _, v in running_rows)
        if not math.isfinite(running) or running < 0:
            return None
        return context_tokens(held_tokens(usage, capacity), running, cached)

    def observe(self, now: float) -> ObserveResult:
        # One budget for all of this tick's queries: a slow Prometheus cannot stretch a tick.
        self._observe_deadline = time.monotonic() + OBSERVE_BUDGET_TIMEOUTS * self.timeout_s
        try:
            return self._observe(now)
        finally:
            self._observe_deadline = None

    def _observe(self, now: float) -> ObserveResult:
        try:
            arrival = self._scalar("arrival_rate", now, required=True)
            arrival = self._check_rate("arrival_rate", arrival, self.rate_window_s)
            age = self._scalar("sample_age", now, required=True)
            asleep = self._value("asleep", now)
            if asleep:
                raise QueryFailed(
                    FailureReason.ASLEEP,
                    f"{asleep:g} engine(s) in sleep mode (vllm:engine_sleep_state): its GPU was given to something else",
                )
            self._check_progress(now)
            sd_present = self._scalar("sd_present", now, required=False) is not None
            acceptance = positions = mean_draft = None
            limits = observation_limits()
            if sd_present:
                acceptance = self._value("acceptance_rate", now)
                mean_draft = self._value("mean_draft_tokens", now)
                pos = self.query(self.queries["position_acceptance"], now)
                for _, v in pos:
                    _hold(out_of_range({"position_acceptance": None if math.isnan(v) else v}, limits))
                if pos and not any(math.isnan(v) for _, v in pos):
                    ordered = sorted(pos, key=lambda lv: _position(lv[0]))
                    positions = tuple(probability(v) for _, v in ordered)
            mean_prompt = self._value("mean_prompt_tokens", now)
            mean_gen = self._value("mean_gen_tokens", now)
            waiting = self._value("waiting", now)
            mean_e2e = self._value("mean_e2e_latency", now)
            means = {"acceptance_rate": acceptance, "mean_draft_tokens": mean_draft, "mean_prompt_tokens": mean_prompt}
            _hold(out_of_range(means | {"mean_gen_tokens": mean_gen, "mean_e2e_latency_s": mean_e2e}, limits))
            _hold(out_of_range({"waiting": waiting}, limits))
            arrival_long = self._check_rate(
                "arrival_rate_long", self._value("arrival_rate_long", now), self.long_window_s, optional=True
            )
            # max_over_time of a rate() alone: no deriv() whose noise could take it under zero
            arrival_peak = self._value("arrival_rate_peak", now)
            arrival_peak = self._check_rate("arrival_rate_peak", arrival_peak, self.rate_window_s, deriv=False)
            cached = self._cached_prompt_tokens(now)
            config = self._cache_config(now)
            started = self._value("server_started", now)
            return Observation(
                time_s=now,
                arrival_rate_rps=arrival,
                arrival_rate_long_rps=arrival_long,
                arrival_rate_peak_rps=arrival_peak,
                acceptance_rate=probability(acceptance),
                position_acceptance=positions,
                mean_draft_tokens=mean_draft,
                mean_prompt_tokens=mean_prompt,
                mean_gen_tokens=mean_gen,
                prompt_tokens_std=self._spread("prompt_tokens_buckets", now, mean_prompt),
                gen_tokens_std=self._spread("gen_tokens_buckets", now, mean_gen),
                running=self._running(now),
                waiting=waiting,
                mean_e2e_latency_s=mean_e2e,
                sd_series_present=sd_present,
                sample_age_s=max(age, 0.0) if age is not None else None,
                running_context_tokens=self._running_context(now, cached, config),
                cached_prompt_tokens=cached,
                prefix_caching=None if config is None else all_prefix_caching([prefix_caching(lb) for lb, _ in config]),
                server_started_at=started if started is not None and math.isfinite(started) else None,
            )
        except QueryFailed as exc:
            return ObservationFailure(exc.reason, exc.detail)


def _engine(labels: dict[str, str]) -> tuple[str, str, str]:
    return labels.get("job", ""), labels.get("instance", ""), labels.get("engine", "")


def _per_request(rows: list[tuple[dict[str, str], float]]) -> float | None:
    """Cached prompt tokens per completed request: 0 without the counter or with nothing
    cached (0/0); None when the ratio is +Inf (cached tokens, no completion), negative, or past
    MAX_TOKENS_PER_REQUEST."""
    if not rows:
        return 0.0
    value = sum(v for _, v in rows)
    if math.isnan(value):
        return 0.0
    return value if math.isfinite(value) and 0 <= value <= MAX_TOKENS_PER_REQUEST else None


def _le(labels: dict[str, str]) -> float | None:
    try:
        return float(labels.get("le", ""))
    except ValueError:
        return None


def _position(labels: dict[str, str]) -> int:
    raw = labels.get("position", "0")
    if not raw.isdigit():
        raise QueryFailed(
            FailureReason.IMPLAUSIBLE, f"position_acceptance: position label {raw[:20]!r} is not an integer"
        )
    return int(raw)


def _hold(why: str | None) -> None:
    """QueryFailed(implausible) with ``why``, when there is one."""
    if why is not None:
        raise QueryFailed(FailureReason.IMPLAUSIBLE, why)


def _sample(item: object) -> tuple[dict[str, str], float]:
    """One element of an instant vector: its labels and value; TypeError when it is not one
    (a list or null where an object belongs, labels that are not strings)."""
    if not isinstance(item, dict):
        raise TypeError(f"vector element is {type(item).__name__}, not an object")
    metric, value = item.get("metric", {}), item["value"]
    if not isinstance(metric, dict) or not all(isinstance(v, str) for v in metric.values()):
        raise TypeError("metric is not an object of strings")
    if not isinstance(value, list) or len(value) != 2 or not isinstance(value[1], str | int | float):
        raise TypeError("value is not [time, number]")
    if isinstance(value[1], bool):
        raise TypeError("value is a boolean")
    return dict(metric), float(value[1])
