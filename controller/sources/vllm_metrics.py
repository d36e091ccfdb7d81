"""Observe vLLM by scraping its /metrics directly; rates from successive scrapes.

Parsing is prometheus-client's text parser. vLLM's counters reset at every restart (and every
SD toggle is a restart): a counter that went down, or one of whose series has a new ``_created``
timestamp, restarted from zero, so its increase over that interval is its new value, never a
negative or a huge jump. ``_created`` is compared series by series (vLLM gives each its own, a
few microseconds apart), so a series that appears or goes missing is not a restart. A counter
that appears counts from zero only when it was born after the scrape before (its ``_created``, or
another counter's restart, says so).

Data that parses but cannot be true is held with reason ``implausible`` and kept out of the
history: a counter that went down while its ``_created`` stayed the same (a glitch, not a
restart), a negative counter, a counter past 2**53 (where a float loses its increments), more
running requests than ``max_num_seqs`` per engine, a completion rate above ``max_rate_rps`` (what
the server could possibly serve), a histogram ``_sum`` that grew more or less than its buckets
allow, or more tokens accepted than drafted. A scrape that lacks a counter or queue gauge the last
one had, with no restart in between, is held as ``incomplete``. After ``MAX_IMPLAUSIBLE_STREAK``
such scrapes in a row the history starts over (warming up again), so a lasting shift cannot hold
the controller forever. Means over the window that no request can have (a length past
``MAX_TOKENS_PER_REQUEST``, a latency longer than the server has been up) are held too.

An engine that stalls while its HTTP server still answers (a GPU fault, a hung collective: the
gauges stay up, the waiting queue grows as requests keep coming) or a payload frozen by a cache
in front of it shows no token produced (``vllm:generation_tokens_total``) and no request
completed over a whole rate window with requests in the server at every scrape of it: that is
held as ``stalled``, never read as an arrival rate (the queue's growth), a latency or a load
that fell to nothing. A server that does not export the token counter is not judged.

An engine put to sleep (vLLM's sleep mode: ``vllm:engine_sleep_state{sleep_state="awake"}`` 0,
its weights offloaded so something else can use the GPU) is held as ``asleep``: a restart would
wake it and take the GPU back from whoever was given it.

A body past ``MAX_BODY_BYTES`` is a parse error, read no further; errors show the URL without
its credentials or query string.

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
from controller.errors import redact_url
from controller.histograms import std_from_buckets
from controller.observation import FailureReason, Observation, ObservationFailure, ObserveResult
from controller.sources.base import (
    MAX_E2E_LATENCY_S,
    MAX_TOKENS_PER_REQUEST,
    PROBABILITY_SLACK,
    TRANSIENT_HTTP_ERRORS,
    BodyTooLarge,
    capped_body,
    observation_limits,
    out_of_range,
    probability,
)
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
GEN_TOKENS = "vllm:generation_tokens"  # moves with every engine step that decodes
DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
PROMPT = "vllm:request_prompt_tokens"
GENERATION = "vllm:request_generation_tokens"
E2E = "vllm:e2e_request_latency_seconds"
RUNNING = "vllm:num_requests_running"
SLEEP = "vllm:engine_sleep_state"  # one series per engine and state; "awake" 0: in sleep mode
WAITING = "vllm:num_requests_waiting"
MAX_IMPLAUSIBLE_STREAK = 3
MAX_EXACT_COUNTER = 2.0**53  # past it a float counter's increments are lost in rounding
# vLLM's _created is its host's clock, a scrape's time ours: they may differ by this much.
CLOCK_SKEW_S = 60.0

Series = tuple[tuple[str, str], ...]  # a sample's labels, sorted, without ``le``


@dataclass
class Snapshot:
    """One scrape, summed over the series that belong to this controller's vLLM."""

    time_s: float
    counters: dict[str, float] = field(default_factory=dict)  # key -> value
    # key -> series -> _created timestamp: each series its own, so one that appears or goes
    # missing does not look like a restart of the rest.
    created: dict[str, dict[Series, float]] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    sd_present: bool = False
    running_engines: int = 0  # series of vllm:num_requests_running (one per engine)
    # The KV context's inputs, by engine label; never checked for plausibility with the rest.
    kv_usage: dict[str, float] = field(default_factory=dict)
    kv_capacity: dict[str, CacheCapacity] = field(default_factory=dict)
    prompt_cached: float | None = None  # vllm:prompt_tokens_cached_total, summed over engines
    # enable_prefix_caching on each engine's cache_config_info (kv_context.prefix_caching)
    prefix_caching: list[bool | None] = field(default_factory=list)
    asleep_engines: int = 0  # engines whose vllm:engine_sleep_state{sleep_state="awake"} is 0


_WANTED = (
    SUCCESS,
    GEN_TOKENS,
    DRAFTS,
    DRAFT_TOKENS,
    ACCEPTED,
    ACCEPTED_PER_POS,
    RUNNING,
    WAITING,
    SLEEP,
    USAGE,
    CACHE_CONFIG,
    PROMPT_CACHED,
)
_WANTED_HIST = (PROMPT, GENERATION, E2E)  # with their buckets: they bound what _sum can grow by
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
        if name.startswith(_WANTED) or name.startswith(_WANTED_HIST):
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
        if family.name == SLEEP:
            snap.asleep_engines += sum(
                1
                for s in family.samples
                if s.labels.get("sleep_state") == "awake"
                and (model_name is None or s.labels.get("model_name") == model_name)
                and not s.value > 0.5  # NaN too: an engine that cannot say it is awake is not used
            )
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
                snap.created.setdefault(k, {})[_series_id(s.labels)] = value
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
            snap.created.setdefault(PROMPT_CACHED, {})[_series_id(s.labels)] = float(s.value)
        elif s.name == PROMPT_CACHED + "_total":
            snap.prompt_cached = (snap.prompt_cached or 0.0) + float(s.value)


def _series_id(labels: dict[str, str]) -> Series:
    return tuple(sorted((k, v) for k, v in labels.items() if k != "le"))


def _key(family: str, sample: str, labels: dict[str, str]) -> tuple[str, str] | None:
    if family.endswith("_created") and family != sample.removesuffix("_created"):
        # vLLM declares each ``_created`` as a gauge family of its own (# TYPE x_created gauge).
        base = family.removesuffix("_created")
        inner = _key(base, base + "_total", labels) or _key(base, base + "_sum", labels)
        return ("created", inner[1]) if inner else None
    if family in (SUCCESS, GEN_TOKENS, DRAFTS, DRAFT_TOKENS, ACCEPTED):
        if sample.endswith("_created"):
            return "created", family
        return ("counter", family) if sample.endswith("_total") else None
    if family == ACCEPTED_PER_POS:
        pos = labels.get("position", "?")
        if sample.endswith("_created"):
            return "created", f"{family}:{pos}"
        return ("counter", f"{family}:{pos}") if sample.endswith("_total") else None
    if family in _WANTED_HIST and sample == family + "_bucket":
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


def _start_moved(prev: Snapshot, cur: Snapshot, key: str) -> bool | None:
    """Whether a series of ``key`` has a new ``_created`` (a restart); None when no series has
    one in both scrapes (not exported, or every series replaced)."""
    before, after = prev.created.get(_created_key(key), {}), cur.created.get(_created_key(key), {})
    common = before.keys() & after.keys()
    if not common:
        return None
    return any(abs(after[s] - before[s]) > 1e-6 for s in common)


def _restarted(last: Snapshot, cur: Snapshot, key: str) -> bool:
    """``key``, in both scrapes, restarted from zero between them."""
    return cur.counters[key] < last.counters[key] or _start_moved(last, cur, key) is True


def _born_since(prev: Snapshot, cur: Snapshot, key: str) -> bool:
    """``key``, absent from ``prev``, started counting after it: its ``_created`` is later than
    ``prev``'s scrape, or another counter restarted in between (SD switched on by a restart)."""
    starts = cur.created.get(_created_key(key))
    if starts and min(starts.values()) > prev.time_s:
        return True
    return any(_restarted(prev, cur, k) for k in prev.counters.keys() & cur.counters.keys())


def _started(snap: Snapshot, key: str) -> float | None:
    """When the oldest series of ``key`` was created (vLLM's clock), if exported."""
    starts = snap.created.get(_created_key(key))
    return min(starts.values()) if starts else None


def _uptime_s(snap: Snapshot, key: str) -> float:
    """The longest any observation of ``key`` can have lasted at ``snap``: since its counter was
    created (plus the clocks' skew), and never past MAX_E2E_LATENCY_S."""
    started = _started(snap, key)
    if started is None:
        return MAX_E2E_LATENCY_S
    return min(snap.time_s - started + CLOCK_SKEW_S, MAX_E2E_LATENCY_S)


def implausible(
    prev: Snapshot | None, cur: Snapshot, max_num_seqs: int | None = None, max_rate_rps: float | None = None
) -> str | None:
    """Why ``cur`` (after ``prev``) cannot be true, or None. Pure: a table test reads it."""
    for name, values in (("counter", cur.counters), ("gauge", cur.gauges)):
        for key, value in values.items():
            if value < 0:
                return f"{_series(key)} is negative ({value:g}): a {name} never is"
    for key, value in cur.counters.items():
        if value > MAX_EXACT_COUNTER:
            return f"{_series(key)} is {value:g}, past 2**53 where a counter's increments are lost"
    running = cur.gauges.get(RUNNING)
    if max_num_seqs is not None and running is not None and running > max_num_seqs * max(cur.running_engines, 1):
        return f"{RUNNING} is {running:g}, above max_num_seqs={max_num_seqs}"
    if prev is None:
        return None
    for key, value in cur.counters.items():
        before = prev.counters.get(key)
        if before is not None and value < before and _start_moved(prev, cur, key) is False:
            return f"{_series(key)} went down from {before:g} to {value:g} with _created unchanged (no restart)"
    dt = cur.time_s - prev.time_s
    inc = increase([prev, cur], SUCCESS)
    if max_rate_rps is not None and inc is not None and dt > 0 and inc / dt > max_rate_rps:
        return f"{SUCCESS}_total grew {inc:g} in {dt:g}s ({inc / dt:.1f} req/s, above the plausible {max_rate_rps:g})"
    return (
        _histogram_lie(prev, cur, PROMPT, MAX_TOKENS_PER_REQUEST)
        or _histogram_lie(prev, cur, GENERATION, MAX_TOKENS_PER_REQUEST)
        or _histogram_lie(prev, cur, E2E, _uptime_s(cur, E2E + "_sum"))
        or _accepted_past_drafted(prev, cur)
    )


def _histogram_lie(prev: Snapshot, cur: Snapshot, family: str, top: float) -> str | None:
    """Why ``family``'s ``_sum`` grew by more or less than its buckets allow between the scrapes:
    each observation lies within its bucket, the last (``+Inf``) one's at most ``top``. None when
    consistent, or when the buckets are not exported."""
    pair, prefix = [prev, cur], family + "_bucket:"
    rows = []
    for key in cur.counters:
        if key.startswith(prefix):
            le, inc = _float(key[len(prefix) :]), increase(pair, key)
            if le is None or inc is None:
                return None
            rows.append((le, inc))
    grew = increase(pair, family + "_sum")
    if not rows or grew is None:
        return None
    rows.sort()
    low = high = below = lower_le = widest = 0.0
    for le, cumulative in rows:
        n = max(cumulative - below, 0.0)
        low += n * lower_le
        high += n * (le if math.isfinite(le) else top)
        below, lower_le = max(below, cumulative), le
        widest = le if math.isfinite(le) else widest
    # One observation may be torn between the sum and its bucket while the scrape is written.
    slack = widest + PROBABILITY_SLACK * high
    if low - slack <= grew <= high + slack:
        return None
    return f"{family}_sum grew {grew:g}, outside the [{low:g}, {high:g}] its buckets allow"


def _accepted_past_drafted(prev: Snapshot, cur: Snapshot) -> str | None:
    """More tokens accepted than drafted, or a position accepted more often than drafts were made."""
    pair = [prev, cur]
    drafted, drafts = increase(pair, DRAFT_TOKENS), increase(pair, DRAFTS)
    checks = [(ACCEPTED, drafted, "draft tokens")]
    checks += [(k, drafts, "drafts") for k in cur.counters if k.startswith(ACCEPTED_PER_POS + ":")]
    for key, most, what in checks:
        grew = increase(pair, key)
        if grew is not None and most is not None and grew > most * (1.0 + PROBABILITY_SLACK) + 1e-9:
            return f"{_series(key)} grew {grew:g}, more than the {most:g} {what}"
    return None


def missing(prev: Snapshot, cur: Snapshot) -> str | None:
    """A counter or queue gauge ``prev`` had and ``cur`` lacks, with no restart between them: a
    torn or partial scrape, whose gap would turn the next increase into a lifetime's. Pure."""
    gauges = [g for g in prev.gauges if g not in cur.gauges]
    if gauges:
        return f"{gauges[0]} missing from this scrape (the last one had it)"
    counters = sorted((k for k in prev.counters if k not in cur.counters), key=lambda k: "_bucket:" in k)
    if not counters or any(_restarted(prev, cur, k) for k in prev.counters.keys() & cur.counters.keys()):
        return None  # a restart may drop families (SD switched off)
    return f"{_series(counters[0])} missing from this scrape (the last one had it, and nothing restarted)"


def _float(text: str) -> float | None:
    """A bucket's ``le``; None when it is not a number."""
    try:
        value = float(text)
    except ValueError:
        return None
    return None if math.isnan(value) else value


def _series(key: str) -> str:
    """The exposition name of a snapshot key, for messages."""
    if key.startswith(ACCEPTED_PER_POS + ":"):
        return f'{ACCEPTED_PER_POS}_total{{position="{key.rsplit(":", 1)[1]}"}}'
    if "_bucket:" in key:
        family, le = key.split("_bucket:", 1)
        return f'{family}_bucket{{le="{le}"}}'
    if key.endswith(("_sum", "_count")) or key in (RUNNING, WAITING):
        return key
    return key + "_total"


def increase(history: list[Snapshot], key: str) -> float | None:
    """Counter increase across the snapshots, reset-aware; None if absent at the end.

    A snapshot without ``key`` (a scrape that lacked its family) is stepped over: the next one is
    paired with the last that had it. A key new in ``history`` counts from zero only when it was
    born after the snapshot before it; otherwise that snapshot is its baseline.
    """
    if key not in history[-1].counters:
        return None
    total = 0.0
    last = history[0] if key in history[0].counters else None
    for prev, cur in itertools.pairwise(history):
        if key not in cur.counters:
            continue
        if last is not None:
            total += cur.counters[key] if _restarted(last, cur, key) else cur.counters[key] - last.counters[key]
        elif _born_since(prev, cur, key):
            total += cur.counters[key]
        last = cur
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
        self._shown_url = redact_url(url) if url else "metrics"  # for errors: no credentials
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
        resp = deadline.request(self._session, "GET", self.url, self.timeout_s, hooks=capped_body())
        if resp.status_code != 200:
            raise _HttpStatus(resp.status_code)
        return resp.text

    def observe(self, now: float) -> ObserveResult:
        try:
            text = self._fetch()
        except requests.RequestException as exc:  # refused, timed out, or cut off mid-body
            return ObservationFailure(FailureReason.UNREACHABLE, f"{self._shown_url}: {type(exc).__name__}")
        except _HttpStatus as exc:
            return ObservationFailure(FailureReason.HTTP_ERROR, f"{self._shown_url}: HTTP {exc.status}")
        except BodyTooLarge as exc:
            return ObservationFailure(FailureReason.PARSE_ERROR, f"{self._shown_url}: {exc}")
        try:
            snap = parse_snapshot(text, now, self.model_name)
        except Exception as exc:  # the parser raises several types on garbage
            return ObservationFailure(
                FailureReason.PARSE_ERROR, f"{self._shown_url}: {type(exc).__name__}: {exc}"[:200]
            )
        # The prefix-cache counter's _created is left to its own check: garbage there must not hold.
        starts = [v for k, series in snap.created.items() if k != PROMPT_CACHED for v in series.values()]
        if not all(math.isfinite(v) for v in [*snap.counters.values(), *snap.gauges.values(), *starts]):
            # Keep NaN out of the history, or it would poison every window it is in (a NaN
            # _created would read as a restart, a lifetime counted as one interval).
            return ObservationFailure(FailureReason.NAN, "non-finite value in /metrics")
        if self._history and now <= self._history[-1].time_s:
            self._history.clear()  # clock went backwards: start over rather than divide by <= 0
        prev = self._history[-1] if self._history else None
        why, reason = implausible(prev, snap, self.max_num_seqs, self.max_rate_rps), FailureReason.IMPLAUSIBLE
        if why is None and prev is not None:
            why, reason = missing(prev, snap), FailureReason.INCOMPLETE
        if why is not None:
            self._implausible_streak += 1
            if self._implausible_streak >= MAX_IMPLAUSIBLE_STREAK:
                # Lasting, not a glitch: believe the new level from here on (rates from scratch).
                self._history.clear()
                self._implausible_streak = 0
                if implausible(None, snap, self.max_num_seqs, self.max_rate_rps) is None:
                    self._history.append(snap)
            return ObservationFailure(reason, f"{self._shown_url}: {why}"[:300])
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
        if not all(math.isfinite(v) for s in win for v in s.created.get(PROMPT_CACHED, {}).values()):
            return None  # a NaN _created would read as a restart
        # The counter is kept out of Snapshot.counters (garbage in it must not hold the
        # controller): a view of it alone gets the same reset-aware increase.
        view = [
            Snapshot(s.time_s, {} if s.prompt_cached is None else {PROMPT_CACHED: s.prompt_cached}, s.created)
            for s in win
        ]
        cached, done = increase(view, PROMPT_CACHED), increase(win, SUCCESS)
        if not cached:
            return 0.0
        per_request = cached / done if done else None
        return per_request if per_request is not None and per_request <= MAX_TOKENS_PER_REQUEST else None

    def _stalled(self, now: float) -> str | None:
        """Why the engine looks stalled: requests in the server at every scrape of a whole rate
        window and neither a token produced nor a request completed in it. None where it moved,
        sat idle at some scrape, the history is shorter than the window, or the server does not
        export the token counter (then nothing here can tell a stall from long requests)."""
        win = self._window(now, self.rate_window_s)
        if len(win) < 2 or win[-1].time_s - win[0].time_s < self.rate_window_s * (1.0 - 1e-9):
            return None
        if any(GEN_TOKENS not in s.counters for s in win):
            return None
        if not all(s.gauges.get(RUNNING, 0.0) + s.gauges.get(WAITING, 0.0) > 0.0 for s in win):
            return None
        tokens, done = increase(win, GEN_TOKENS), increase(win, SUCCESS)
        if tokens is None or done is None or tokens > 0.0 or done > 0.0:
            return None
        cur = win[-1]
        return (
            f"{self._shown_url}: {cur.gauges.get(RUNNING, 0.0):g} running and {cur.gauges.get(WAITING, 0.0):g}"
            f" waiting, no token produced and no request completed in {cur.time_s - win[0].time_s:.0f}s"
        )

    def _e2e_limit_s(self, now: float, window_s: float) -> float:
        """The longest mean latency the window's requests can have: the server's uptime, since
        the oldest ``_created`` in the window (a restart in it leaves older requests counted)."""
        starts = [t for s in self._window(now, window_s) if (t := _started(s, E2E + "_sum")) is not None]
        return min(now - min(starts) + CLOCK_SKEW_S, MAX_E2E_LATENCY_S) if starts else MAX_E2E_LATENCY_S

    def _observation(self, now: float) -> ObserveResult:
        if len(self._history) < 2:
            return ObservationFailure(FailureReason.WARMING_UP, "need two scrapes for a rate")
        cur = self._history[-1]
        if SUCCESS not in cur.counters:
            return ObservationFailure(FailureReason.EMPTY, "vllm:request_success_total not exported")
        if cur.asleep_engines:
            return ObservationFailure(
                FailureReason.ASLEEP,
                f"{self._shown_url}: {cur.asleep_engines} engine(s) in sleep mode (vllm:engine_sleep_state):"
                " its GPU was given to something else",
            )
        if (stall := self._stalled(now)) is not None:
            return ObservationFailure(FailureReason.STALLED, stall)
        arrival = self._arrival(now, self.rate_window_s)
        long_span = now - self._history[0].time_s
        arrival_long = self._arrival(now, self.long_window_s) if long_span >= 2 * self.rate_window_s else None
        arrival_peak = self._peak_completion_rate(now)
        aw = self.acceptance_window_s
        acceptance = positions = mean_draft = None
        per_pos: list[float | None] = []
        if cur.sd_present:
            acceptance = self._ratio(now, aw, ACCEPTED, DRAFT_TOKENS)
            mean_draft = self._ratio(now, aw, DRAFT_TOKENS, DRAFTS)
            pos_keys = sorted(
                (k for k in cur.counters if k.startswith(ACCEPTED_PER_POS + ":")),
                key=lambda k: int(k.rsplit(":", 1)[1]) if k.rsplit(":", 1)[1].isdigit() else 0,
            )
            per_pos = [self._ratio(now, aw, k, DRAFTS) for k in pos_keys]
        mean_prompt = self._ratio(now, aw, PROMPT + "_sum", PROMPT + "_count")
        mean_gen = self._ratio(now, aw, GENERATION + "_sum", GENERATION + "_count")
        mean_e2e = self._ratio(now, aw, E2E + "_sum", E2E + "_count")
        # The scrapes' checks keep these in range; a window that still is not (a server without
        # buckets, a jump they missed) is held, never clamped into a number.
        limits = observation_limits(self._e2e_limit_s(now, aw))
        means = {"acceptance_rate": acceptance, "mean_draft_tokens": mean_draft, "mean_prompt_tokens": mean_prompt}
        means |= {"mean_gen_tokens": mean_gen, "mean_e2e_latency_s": mean_e2e}
        why = out_of_range(means, limits)
        for p in per_pos:
            why = why or out_of_range({"position_acceptance": p}, limits)
        if why is not None:
            return ObservationFailure(FailureReason.IMPLAUSIBLE, f"{self._shown_url}: {why}"[:300])
        if per_pos and all(p is not None for p in per_pos):
            positions = tuple(probability(p) for p in per_pos)  # type: ignore[misc]
        try:
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
                prompt_tokens_std=self._spread(now, aw, PROMPT, mean_prompt),
                gen_tokens_std=self._spread(now, aw, GENERATION, mean_gen),
                running=cur.gauges.get(RUNNING),
                waiting=cur.gauges.get(WAITING),
                mean_e2e_latency_s=mean_e2e,
                sd_series_present=cur.sd_present,
                server_started_at=_started(cur, SUCCESS),
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
