"""Observe vLLM by scraping its /metrics directly; rates from successive scrapes.

Parsing is prometheus-client's text parser. vLLM's counters reset at every restart (and every
SD toggle is a restart): a counter that went down, appeared, or whose ``_created`` timestamp
changed restarted from zero, so its increase over that interval is its new value, never a
negative or a huge jump.

Data that parses but cannot be true is held with reason ``implausible`` and kept out of the
history: a counter that went down while its ``_created`` stayed the same (a glitch, not a
restart), a negative counter, more running requests than ``max_num_seqs`` per engine, or a
completion rate above ``max_rate_rps`` (what the server could possibly serve). After
``MAX_IMPLAUSIBLE_STREAK`` such scrapes in a row the history starts over (warming up again), so
a lasting shift cannot hold the controller forever.

The running batch's KV context (``Observation.running_context_tokens``) comes from the KV-usage
gauges and ``vllm:cache_config_info``, kept apart from the counters and gauges above: a server
that lacks them, or exports nonsense in them, leaves that one field ``None`` and is otherwise
observed as usual.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import requests
from prometheus_client.parser import text_string_to_metric_families
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_fixed

from controller import deadline
from controller.histograms import std_from_buckets
from controller.observation import FailureReason, Observation, ObservationFailure, ObserveResult
from controller.sources.base import TRANSIENT_HTTP_ERRORS
from controller.sources.kv_context import (
    CACHE_CONFIG,
    PROMPT_CACHED,
    USAGE,
    CacheCapacity,
    all_prefix_caching,
    cache_capacity,
    context_tokens,
    held_tokens,
    prefix_caching,
)

SUCCESS = "vllm:request_success"
DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
PROMPT = "vllm:request_prompt_tokens"
GENERATION = "vllm:request_generation_tokens"
E2E = "vllm:e2e_request_latency_seconds"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
MAX_IMPLAUSIBLE_STREAK = 3


@dataclass
class Snapshot:
    """One scrape, summed over the series that belong to this controller's vLLM."""

    time_s: float
    counters: dict[str, float] = field(default_factory=dict)  # key -> value
    created: dict[str, float] = field(default_factory=dict)  # key -> _created timestamp
    gauges: dict[str, float] = field(default_factory=dict)
    sd_present: bool = False
    running_engines: int = 0  # series of vllm:num_requests_running (one per engine)
    # The KV context's inputs, by engine label; never checked for plausibility with the rest.
    kv_usage: dict[str, float] = field(default_factory=dict)
    kv_capacity: dict[str, CacheCapacity] = field(default_factory=dict)
    prompt_cached: float | None = None  # vllm:prompt_tokens_cached_total, summed over engines
    # enable_prefix_caching on each engine's cache_config_info (kv_context.prefix_caching)
    prefix_caching: list[bool | None] = field(default_factory=list)


_WANTED = (
    SUCCESS,
    DRAFTS,
    DRAFT_TOKENS,
    ACCEPTED,
    ACCEPTED_PER_POS,
    RUNNING,
    WAITING,
    USAGE,
    CACHE_CONFIG,
    PROMPT_CACHED,
)
_WANTED_HIST = (PROMPT, GENERATION, E2E)
_SPREAD_HIST = (PROMPT, GENERATION)  # their buckets give the lengths' spread


def _relevant(text: str) -> str:
    """Only the lines of the families we read (vLLM exports ~600 lines, mostly buckets).

    prometheus-client's parser still parses what remains; this only spares it the rest.
    """
    keep = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(" ", 3)
            name = parts[2] if len(parts) > 2 else ""
        else:
            name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.startswith(_WANTED) or (
            name.startswith(_WANTED_HIST) and (not name.endswith("_bucket") or name.startswith(_SPREAD_HIST))
        ):
            keep.append(line)
    return "\n".join(keep) + "\n"


def parse_snapshot(text: str, now: float, model_name: str | None = None) -> Snapshot:
    """Parse exposition text into a Snapshot; ValueError on garbage."""
    snap = Snapshot(now)
    seen_vllm = False
    for family in text_string_to_metric_families(_relevant(text)):
        if not family.name.startswith("vllm:"):
            continue
        seen_vllm = True
        if family.name in (USAGE, CACHE_CONFIG, PROMPT_CACHED, PROMPT_CACHED + "_created"):
            _read_kv(snap, family.name, family.samples, model_name)
            continue
        for s in family.samples:
            if model_name is not None and s.labels.get("model_name") != model_name:
                continue
            value = float(s.value)
            key = _key(family.name, s.name, s.labels)
            if key is None:
                continue
            kind, k = key
            if kind == "created":
                snap.created[k] = min(snap.created.get(k, math.inf), value)
            elif kind == "gauge":
                snap.gauges[k] = snap.gauges.get(k, 0.0) + value
                snap.running_engines += k == RUNNING
            else:
                snap.counters[k] = snap.counters.get(k, 0.0) + value
            if family.name == DRAFTS:
                snap.sd_present = True
    if not seen_vllm:
        raise ValueError("no vllm: metric families in the payload")
    return snap


def _read_kv(snap: Snapshot, family: str, samples: list, model_name: str | None) -> None:
    """The KV context's series into the snapshot's own fields."""
    for s in samples:
        # vllm:cache_config_info has no model_name label (one model per server anyway).
        if model_name is not None and s.labels.get("model_name", model_name) != model_name:
            continue
        engine = s.labels.get("engine", "")
        if family == USAGE:
            snap.kv_usage[engine] = float(s.value)
        elif family == CACHE_CONFIG:
            capacity = cache_capacity(s.labels)
            if capacity is not None:
                snap.kv_capacity[engine] = capacity
            snap.prefix_caching.append(prefix_caching(s.labels))
        elif family == PROMPT_CACHED + "_created" or s.name == PROMPT_CACHED + "_created":
            snap.created[PROMPT_CACHED] = min(snap.created.get(PROMPT_CACHED, math.inf), float(s.value))
        elif s.name == PROMPT_CACHED + "_total":
            snap.prompt_cached = (snap.prompt_cached or 0.0) + float(s.value)


def _key(family: str, sample: str, labels: dict[str, str]) -> tuple[str, str] | None:
    if family.endswith("_created") and family != sample.removesuffix("_created"):
        # vLLM declares each ``_created`` as a gauge family of its own (# TYPE x_created gauge).
        base = family.removesuffix("_created")
        inner = _key(base, base + "_total", labels) or _key(base, base + "_sum", labels)
        return ("created", inner[1]) if inner else None
    if family in (SUCCESS, DRAFTS, DRAFT_TOKENS, ACCEPTED):
        if sample.endswith("_created"):
            return "created", family
        return ("counter", family) if sample.endswith("_total") else None
    if family == ACCEPTED_PER_POS:
        pos = labels.get("position", "?")
        if sample.endswith("_created"):
            return "created", f"{family}:{pos}"
        return ("counter", f"{family}:{pos}") if sample.endswith("_total") else None
    if family in _SPREAD_HIST and sample == family + "_bucket":
        return "counter", f"{family}_bucket:{labels.get('le', '?')}"
    if family in (PROMPT, GENERATION, E2E):
        for suffix in ("_sum", "_count"):
            if sample == family + suffix:
                return "counter", sample
        if sample == family + "_created":
            return "created", family + "_sum"
        return None
    if family in (RUNNING, WAITING):
        return "gauge", family
    return None


def _created_key(key: str) -> str:
    """Histograms carry one _created for _sum, _count and every bucket (stored under _sum)."""
    if "_bucket:" in key:
        return key.split("_bucket:", 1)[0] + "_sum"
    return key[: -len("_count")] + "_sum" if key.endswith("_count") else key


def _restarted(prev: Snapshot, cur: Snapshot, key: str) -> bool:
    created_key = _created_key(key)
    if key not in prev.counters:
        return True
    if cur.counters[key] < prev.counters[key]:
        return True
    c_prev, c_cur = prev.created.get(created_key), cur.created.get(created_key)
    return c_prev is not None and c_cur is not None and abs(c_cur - c_prev) > 1e-6


def implausible(
    prev: Snapshot | None, cur: Snapshot, max_num_seqs: int | None = None, max_rate_rps: float | None = None
) -> str | None:
    """Why ``cur`` (after ``prev``) cannot be true, or None. Pure: a table test reads it."""
    for name, values in (("counter", cur.counters), ("gauge", cur.gauges)):
        for key, value in values.items():
            if value < 0:
                return f"{_series(key)} is negative ({value:g}): a {name} never is"
    running = cur.gauges.get(RUNNING)
    if max_num_seqs is not None and running is not None and running > max_num_seqs * max(cur.running_engines, 1):
        return f"{RUNNING} is {running:g}, above max_num_seqs={max_num_seqs}"
    if prev is None:
        return None
    for key, value in cur.counters.items():
        before = prev.counters.get(key)
        created_key = _created_key(key)
        c_prev, c_cur = prev.created.get(created_key), cur.created.get(created_key)
        same_start = c_prev is not None and c_cur is not None and abs(c_cur - c_prev) <= 1e-6
        if before is not None and value < before and same_start:
            return f"{_series(key)} went down from {before:g} to {value:g} with _created unchanged (no restart)"
    dt = cur.time_s - prev.time_s
    inc = increase([prev, cur], SUCCESS)
    if max_rate_rps is not None and inc is not None and dt > 0 and inc / dt > max_rate_rps:
        return f"{SUCCESS}_total grew {inc:g} in {dt:g}s ({inc / dt:.1f} req/s, above the plausible {max_rate_rps:g})"
    return None


def _series(key: str) -> str:
    """The exposition name of a snapshot key, for messages."""
    if key.startswith(ACCEPTED_PER_POS + ":"):
        return f'{ACCEPTED_PER_POS}_total{{position="{key.rsplit(":", 1)[1]}"}}'
    if key.endswith(("_sum", "_count")) or key in (RUNNING, WAITING):
        return key
    return key + "_total"


def increase(history: list[Snapshot], key: str) -> float | None:
    """Counter increase across the snapshots, reset-aware; None if absent at the end."""
    if key not in history[-1].counters:
        return None
    total = 0.0
    for prev, cur in itertools.pairwise(history):
        if key not in cur.counters:
            continue
        total += cur.counters[key] if _restarted(prev, cur, key) else cur.counters[key] - prev.counters[key]
    return total


class VllmMetricsSource:
    """Scrapes vLLM's /metrics (or any callable returning exposition text) once per observe."""

    def __init__(
        self,
        url: str | None = None,
        fetch: Callable[[], str] | None = None,
        model_name: str | None = None,
        rate_window_s: float = 60.0,
        acceptance_window_s: float = 300.0,
        long_window_s: float = 900.0,
        timeout_s: float = 5.0,
        session: requests.Session | None = None,
        max_num_seqs: int | None = None,
        max_rate_rps: float | None = None,
    ) -> None:
        if (url is None) == (fetch is None):
            raise ValueError("give exactly one of url or fetch")
        self.url = url
        self._fetch = fetch or self._http_fetch
        self.model_name = model_name
        self.rate_window_s = rate_window_s
        self.acceptance_window_s = acceptance_window_s
        self.long_window_s = long_window_s
        self.timeout_s = timeout_s
        self._session = deadline.session(session)
        self.max_num_seqs = max_num_seqs
        self.max_rate_rps = max_rate_rps
        self._history: deque[Snapshot] = deque()
        self._implausible_streak = 0

    @retry(
        retry=retry_if_exception_type(TRANSIENT_HTTP_ERRORS),
        stop=stop_after_attempt(2),
        wait=wait_fixed(0.5),
        reraise=True,
    )
    def _http_fetch(self) -> str:
        assert self.url is not None
        # timeout_s bounds the whole request: a peer that drips bytes cannot hold the tick.
        resp = deadline.request(self._session, "GET", self.url, self.timeout_s)
        if resp.status_code != 200:
            raise _HttpStatus(resp.status_code)
        return resp.text

    def observe(self, now: float) -> ObserveResult:
        try:
            text = self._fetch()
        except requests.RequestException as exc:  # refused, timed out, or cut off mid-body
            return ObservationFailure(FailureReason.UNREACHABLE, f"{self.url}: {type(exc).__name__}")
        except _HttpStatus as exc:
            return ObservationFailure(FailureReason.HTTP_ERROR, f"{self.url}: HTTP {exc.status}")
        try:
            snap = parse_snapshot(text, now, self.model_name)
        except Exception as exc:  # the parser raises several types on garbage
            return ObservationFailure(
                FailureReason.PARSE_ERROR, f"{self.url or 'metrics'}: {type(exc).__name__}: {exc}"[:200]
            )
        values = [*snap.counters.values(), *snap.gauges.values()]
        if not all(math.isfinite(v) for v in values):
            # Keep NaN out of the history, or it would poison every window it is in.
            return ObservationFailure(FailureReason.NAN, "non-finite value in /metrics")
        if self._history and now <= self._history[-1].time_s:
            self._history.clear()  # clock went backwards: start over rather than divide by <= 0
        why = implausible(self._history[-1] if self._history else None, snap, self.max_num_seqs, self.max_rate_rps)
        if why is not None:
            self._implausible_streak += 1
            if self._implausible_streak >= MAX_IMPLAUSIBLE_STREAK:
                # Lasting, not a glitch: believe the new level from here on (rates from scratch).
                self._history.clear()
                self._implausible_streak = 0
                if implausible(None, snap, self.max_num_seqs, self.max_rate_rps) is None:
                    self._history.append(snap)
            return ObservationFailure(FailureReason.IMPLAUSIBLE, f"{self.url or 'metrics'}: {why}"[:300])
        self._implausible_streak = 0
        self._history.append(snap)
        horizon = max(self.rate_window_s, self.acceptance_window_s, self.long_window_s)
        while len(self._history) > 2 and self._history[1].time_s <= now - horizon:
            self._history.popleft()
        return self._observation(now)

    def _window(self, now: float, window_s: float) -> list[Snapshot]:
        """Snapshots covering the last ``window_s``: from the newest one at or before its start."""
        hist = list(self._history)
        start = 0
        for i, s in enumerate(hist):
            if s.time_s <= now - window_s + 1e-9:
                start = i
        return hist[start:]

    def _rate(self, now: float, window_s: float, key: str) -> float | None:
        win = self._window(now, window_s)
        if len(win) < 2:
            return None
        inc = increase(win, key)
        dt = win[-1].time_s - win[0].time_s
        return None if inc is None or dt <= 0 else inc / dt

    def _ratio(self, now: float, window_s: float, num: str, den: str) -> float | None:
        win = self._window(now, window_s)
        if len(win) < 2:
            return None
        a, b = increase(win, num), increase(win, den)
        if a is None or b is None or b <= 0:
            return None
        return a / b

    def _spread(self, now: float, window_s: float, family: str, mean: float | None) -> float | None:
        """Standard deviation of the lengths finished in the window, from the bucket increases."""
        win = self._window(now, window_s)
        if len(win) < 2 or mean is None:
            return None
        prefix = family + "_bucket:"
        bounds, counts = [], []
        for key in win[-1].counters:
            if key.startswith(prefix):
                try:
                    le = float(key[len(prefix) :])
                except ValueError:
                    return None
                inc = increase(win, key)
                if inc is None:
                    return None
                bounds.append(le)
                counts.append(inc)
        if not bounds:
            return None
        order = sorted(range(len(bounds)), key=bounds.__getitem__)
        return std_from_buckets([bounds[i] for i in order], [counts[i] for i in order], mean)

    def _arrival(self, now: float, window_s: float) -> float | None:
        """Completions per second plus the growth of the running and waiting queues."""
        done = self._rate(now, window_s, SUCCESS)
        if done is None:
            return None
        win = self._window(now, window_s)
        first, last = win[0], win[-1]
        queued = sum(last.gauges.get(g, 0.0) - first.gauges.get(g, 0.0) for g in (RUNNING, WAITING))
        return max(done + queued / (last.time_s - first.time_s), 0.0)

    def _peak_completion_rate(self, now: float) -> float | None:
        """Highest completion rate between consecutive scrapes within the long window."""
        win = self._window(now, self.long_window_s)
        rates = []
        for prev, cur in itertools.pairwise(win):
            inc = increase([prev, cur], SUCCESS)
            dt = cur.time_s - prev.time_s
            if inc is not None and dt > 0:
                rates.append(inc / dt)
        return max(rates) if rates else None

    def _running_context(self, now: float) -> float | None:
        """KV tokens per running sequence over the rate window: the time-means of Σ usage ×
        capacity and of the running sequences; None unless every scrape in it has them all."""
        win = self._window(now, self.rate_window_s)
        held, running = [], []
        for s in win:
            h = held_tokens(s.kv_usage, s.kv_capacity)
            r = s.gauges.get(RUNNING)
            if h is None or r is None or len(s.kv_usage) != s.running_engines:
                return None
            held.append(h)
            running.append(r)
        times = [s.time_s for s in win]
        tokens = _time_mean(times, [h.tokens for h in held])
        mean = replace(held[-1], tokens=tokens)
        return context_tokens(mean, _time_mean(times, running), self._cached_prompt_tokens(win))

    @staticmethod
    def _cached_prompt_tokens(win: list[Snapshot]) -> float | None:
        """Prompt tokens per completed request served from the prefix cache; 0 without the
        counter, None when it is garbage or grew with no request completed."""
        if win[-1].prompt_cached is None:
            return 0.0
        if any(
            s.prompt_cached is not None and not (math.isfinite(s.prompt_cached) and s.prompt_cached >= 0) for s in win
        ):
            return None
        # The counter is kept out of Snapshot.counters (garbage in it must not hold the
        # controller): a view of it alone gets the same reset-aware increase.
        view = [
            Snapshot(s.time_s, {} if s.prompt_cached is None else {PROMPT_CACHED: s.prompt_cached}, s.created)
            for s in win
        ]
        cached, done = increase(view, PROMPT_CACHED), increase(win, SUCCESS)
        if not cached:
            return 0.0
        return cached / done if done else None

    def _observation(self, now: float) -> ObserveResult:
        if len(self._history) < 2:
            return ObservationFailure(FailureReason.WARMING_UP, "need two scrapes for a rate")
        cur = self._history[-1]
        if SUCCESS not in cur.counters:
            return ObservationFailure(FailureReason.EMPTY, "vllm:request_success_total not exported")
        arrival = self._arrival(now, self.rate_window_s)
        long_span = now - self._history[0].time_s
        arrival_long = self._arrival(now, self.long_window_s) if long_span >= 2 * self.rate_window_s else None
        arrival_peak = self._peak_completion_rate(now)
        aw = self.acceptance_window_s
        acceptance = positions = mean_draft = None
        if cur.sd_present:
            acceptance = self._ratio(now, aw, ACCEPTED, DRAFT_TOKENS)
            mean_draft = self._ratio(now, aw, DRAFT_TOKENS, DRAFTS)
            pos_keys = sorted(
                (k for k in cur.counters if k.startswith(ACCEPTED_PER_POS + ":")),
                key=lambda k: int(k.rsplit(":", 1)[1]) if k.rsplit(":", 1)[1].isdigit() else 0,
            )
            per_pos = [self._ratio(now, aw, k, DRAFTS) for k in pos_keys]
            if per_pos and all(p is not None for p in per_pos):
                positions = tuple(min(max(p, 0.0), 1.0) for p in per_pos)  # type: ignore[arg-type]
        mean_prompt = self._ratio(now, aw, PROMPT + "_sum", PROMPT + "_count")
        mean_gen = self._ratio(now, aw, GENERATION + "_sum", GENERATION + "_count")
        try:
            return Observation(
                time_s=now,
                arrival_rate_rps=arrival,
                arrival_rate_long_rps=arrival_long,
                arrival_rate_peak_rps=arrival_peak,
                acceptance_rate=None if acceptance is None else min(max(acceptance, 0.0), 1.0),
                position_acceptance=positions,
                mean_draft_tokens=mean_draft,
                mean_prompt_tokens=mean_prompt,
                mean_gen_tokens=mean_gen,
                prompt_tokens_std=self._spread(now, aw, PROMPT, mean_prompt),
                gen_tokens_std=self._spread(now, aw, GENERATION, mean_gen),
                running=cur.gauges.get(RUNNING),
                waiting=cur.gauges.get(WAITING),
                mean_e2e_latency_s=self._ratio(now, aw, E2E + "_sum", E2E + "_count"),
                sd_series_present=cur.sd_present,
                sample_age_s=0.0,
                running_context_tokens=self._running_context(now),
                cached_prompt_tokens=self._cached_prompt_tokens(self._window(now, self.rate_window_s)),
                prefix_caching=all_prefix_caching(cur.prefix_caching),
            )
        except ValueError as exc:  # NaN or inf in the payload
            return ObservationFailure(FailureReason.NAN, str(exc))


def _time_mean(times: list[float], values: list[float]) -> float:
    """Time-weighted mean of a gauge sampled at ``times`` (trapezoids between scrapes)."""
    span = times[-1] - times[0]
    if span <= 0:
        return values[-1]
    area = sum((b - a) * (u + v) / 2 for a, b, u, v in zip(times, times[1:], values, values[1:], strict=False))
    return area / span


class _HttpStatus(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
