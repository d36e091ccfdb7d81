"""Reading history for a backtest: the steps to replay.

* A CSV: one row per evaluation (columns ``time_s, arrival_rate_rps, acceptance_rate,
  mean_prompt_tokens, mean_gen_tokens, sd_enabled``; optional ``arrival_rate_long_rps``; empty
  cells are missing data).
* Prometheus: one ``query_range`` per query of the daemon's own PromQL
  (:func:`controller.sources.prometheus.render_queries` with the windows, selector and query
  overrides of the Settings), and per step the very code the daemon runs on an instant query
  (:meth:`PrometheusSource.observe`) answered from those ranges: an empty arrival rate is an
  ``ObservationFailure(EMPTY)``, NaN in any other field is ``None``. The recorded SD state is
  whether vLLM exported SD counters at that step.

Bad input is an InputError (a query Prometheus rejects, no data in the range included); an
unreachable or broken Prometheus is a :class:`BacktestRuntimeError`.
"""

from __future__ import annotations

import csv
import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import requests

from controller.errors import ConfigError, InputError
from controller.observation import FailureReason, Observation, ObservationFailure, ObserveResult
from controller.sources.prometheus import PrometheusSource

COLUMNS = ("time_s", "arrival_rate_rps", "acceptance_rate", "mean_prompt_tokens", "mean_gen_tokens", "sd_enabled")
OPTIONAL_COLUMNS = ("arrival_rate_long_rps", "cached_prompt_tokens")
MAX_STEPS = 200_000
POINTS_PER_QUERY = 10_000  # Prometheus refuses more than 11,000 points per series in one query_range
_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


class BacktestRuntimeError(RuntimeError):
    """A failure of the environment, not of the input (Prometheus unreachable): exit code 1."""


# ------------------------------------------------------------------------------------------
# Times and durations
# ------------------------------------------------------------------------------------------

_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")


def parse_duration(text: str, option: str = "duration") -> float:
    """Seconds from ``90``, ``60s``, ``5m``, ``1h30m``, ``500ms`` (Prometheus-style units)."""
    t = text.strip().lower()
    try:
        value = float(t)
    except ValueError:
        parts = _DURATION_PART.findall(t)
        if not parts or "".join(n + u for n, u in parts) != t:
            raise InputError(f"{option} {text!r}: not a duration (seconds, or e.g. 60s, 5m, 1h30m)") from None
        value = sum(float(n) * _UNIT_S[u] for n, u in parts)
    if not math.isfinite(value):
        raise InputError(f"{option} {text!r}: not a finite duration")
    return value


def parse_time(text: str, option: str = "time", now: float | None = None) -> float:
    """Unix seconds from unix seconds, ISO 8601 (no offset = UTC), ``now`` or ``now-DURATION``."""
    t = text.strip()
    low = t.lower()
    if low == "now" or low.startswith("now-"):
        base = now if now is not None else datetime.now(UTC).timestamp()
        return base - (parse_duration(low[4:], option) if low != "now" else 0.0)
    try:
        value = float(t)
    except ValueError:
        try:
            dt = datetime.fromisoformat(t)
        except ValueError:
            raise InputError(
                f"{option} {text!r}: not a time (unix seconds, ISO 8601 such as 2024-05-01T12:00:00Z, or now-1h)"
            ) from None
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=UTC)
        return dt.timestamp()
    if not math.isfinite(value):
        raise InputError(f"{option} {text!r}: not a finite time")
    return value


def format_time(t: float) -> str:
    """ISO 8601 UTC for wall-clock times, plain seconds for small (relative) ones."""
    if t >= 1e8:
        return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f"{t:.0f}"


# ------------------------------------------------------------------------------------------
# Steps to replay: from a CSV, from Prometheus
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One evaluation to replay: what the source would have returned, and the recorded state."""

    time_s: float
    observation: ObserveResult
    recorded_enabled: bool | None  # SD on in the history; None: unknown at this step
    duration_s: float = 0.0  # the interval this step stands for (until the next one)


def read_rows(path: Path) -> list[dict[str, float | None]]:
    """The CSV's rows as numbers (``None`` for an empty or NaN cell); one-line InputError."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise InputError(f"{path}: not UTF-8 text") from None
    reader = csv.DictReader(text.splitlines())
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise InputError(f"{path}: missing column(s) {', '.join(missing)} (need {', '.join(COLUMNS)})")
    present = [c for c in (*COLUMNS, *OPTIONAL_COLUMNS) if c in (reader.fieldnames or [])]
    rows: list[dict[str, float | None]] = []
    try:
        for raw in reader:
            rows.append(_parse_row(path, reader.line_num, raw, present))
    except csv.Error as exc:
        raise InputError(f"{path}: row {reader.line_num}: {exc}") from None
    if not rows:
        raise InputError(f"{path}: no rows")
    for i in range(1, len(rows)):
        if rows[i]["time_s"] <= rows[i - 1]["time_s"]:  # type: ignore[operator]
            raise InputError(f"{path}: row {i + 2}, column time_s: not after the previous row's time")
    return rows


def _parse_row(path: Path, line: int, raw: Mapping[str, str | None], present: Sequence[str]) -> dict:
    row: dict[str, float | None] = {}
    for c in present:
        v = (raw.get(c) or "").strip()
        if v == "" or v.lower() == "nan":
            row[c] = None
            continue
        if c == "sd_enabled":
            if v.lower() not in _TRUE + _FALSE:
                raise InputError(f"{path}: row {line}, column sd_enabled: {v!r} is not 1/0/true/false")
            row[c] = 1.0 if v.lower() in _TRUE else 0.0
            continue
        try:
            x = float(v)
        except ValueError:
            raise InputError(f"{path}: row {line}, column {c}: {v!r} is not a number") from None
        if not math.isfinite(x):
            raise InputError(f"{path}: row {line}, column {c}: {v!r} is not a finite number")
        if c == "acceptance_rate" and not 0.0 <= x <= 1.0:
            raise InputError(f"{path}: row {line}, column acceptance_rate: {v} is outside [0, 1]")
        if c != "time_s" and x < 0:
            raise InputError(f"{path}: row {line}, column {c}: {v} is negative")
        row[c] = x
    if row["time_s"] is None:
        raise InputError(f"{path}: row {line}, column time_s: empty")
    return row


def steps_from_rows(rows: Sequence[Mapping[str, float | None]]) -> list[Step]:
    """One step per CSV row: an Observation, or ``ObservationFailure(EMPTY)`` without a rate."""
    steps = []
    for i, r in enumerate(rows):
        t = float(r["time_s"])  # type: ignore[arg-type]
        sd = None if r["sd_enabled"] is None else bool(r["sd_enabled"])
        obs: ObserveResult
        if r["arrival_rate_rps"] is None:
            obs = ObservationFailure(FailureReason.EMPTY, "arrival_rate_rps: empty cell")
        else:
            obs = Observation(
                time_s=t,
                arrival_rate_rps=r["arrival_rate_rps"],
                arrival_rate_long_rps=r.get("arrival_rate_long_rps"),
                # vLLM exports acceptance only while SD runs: a value recorded with SD off is ignored.
                acceptance_rate=r["acceptance_rate"] if sd else None,
                mean_prompt_tokens=r["mean_prompt_tokens"] or None,
                mean_gen_tokens=r["mean_gen_tokens"] or None,
                cached_prompt_tokens=r.get("cached_prompt_tokens"),
                sd_series_present=sd,
                sample_age_s=0.0,
            )
        steps.append(Step(t, obs, sd, _duration_at(rows, i)))
    return steps


def _duration_at(rows: Sequence[Mapping[str, float | None]], i: int) -> float:
    times = [float(r["time_s"]) for r in rows]  # type: ignore[arg-type]
    if len(times) < 2:
        return 0.0
    if i + 1 < len(times):
        return times[i + 1] - times[i]
    return times[i] - times[i - 1]


class RecordedPrometheus(PrometheusSource):
    """The daemon's :class:`PrometheusSource`, its instant queries answered from ``query_range``
    results fetched up front, so :meth:`observe` runs unchanged on history."""

    def __init__(
        self,
        url: str,
        selector: str,
        rate_window_s: float,
        acceptance_window_s: float,
        long_window_s: float,
        queries: Mapping[str, str] | None,
        timeout_s: float,
        start_s: float,
        end_s: float,
        step_s: float,
    ) -> None:
        try:
            super().__init__(url, selector, rate_window_s, acceptance_window_s, long_window_s, queries, timeout_s)
        except ValueError as exc:
            raise ConfigError(f"setting queries: {exc}") from None
        self.start_ms = round(start_s * 1000)
        self.step_ms = round(step_s * 1000)
        self.n_steps = (round(end_s * 1000) - self.start_ms) // self.step_ms + 1
        self._recorded: dict[str, dict[int, list[tuple[dict[str, str], float]]]] = {}

    def times(self) -> list[float]:
        return [(self.start_ms + k * self.step_ms) / 1000 for k in range(self.n_steps)]

    def fetch(self) -> None:
        """One ``query_range`` per query (in chunks Prometheus accepts)."""
        for name, promql in self.queries.items():
            by_step: dict[int, list[tuple[dict[str, str], float]]] = {}
            for k0 in range(0, self.n_steps, POINTS_PER_QUERY):
                k1 = min(self.n_steps, k0 + POINTS_PER_QUERY) - 1
                for labels, values in self._query_range(name, promql, k0, k1):
                    for t, v in values:
                        k = round((t * 1000 - self.start_ms) / self.step_ms)
                        by_step.setdefault(k, []).append((labels, v))
            self._recorded[promql] = by_step

    def _query_range(self, name: str, promql: str, k0: int, k1: int) -> list[tuple[dict, list[tuple[float, float]]]]:
        params = {
            "query": promql,
            "start": f"{(self.start_ms + k0 * self.step_ms) / 1000:.3f}",
            "end": f"{(self.start_ms + k1 * self.step_ms) / 1000:.3f}",
            "step": f"{self.step_ms / 1000:.3f}",
        }
        url = f"{self.url}/api/v1/query_range"
        try:
            resp = self._session.get(url, params=params, timeout=max(self.timeout_s, 30.0))
        except (requests.ConnectionError, requests.Timeout) as exc:
            raise BacktestRuntimeError(f"Prometheus {self.url} unreachable: {type(exc).__name__}") from None
        except requests.RequestException as exc:
            raise BacktestRuntimeError(f"Prometheus {self.url}: {type(exc).__name__}") from None
        try:
            body = resp.json()
        except ValueError:
            raise BacktestRuntimeError(
                f"Prometheus {self.url}: HTTP {resp.status_code}, response is not JSON"
            ) from None
        if not isinstance(body, dict) or body.get("status") != "success":
            err = f"{body.get('errorType')}: {body.get('error')}" if isinstance(body, dict) else "malformed body"
            if resp.status_code >= 500 and not (isinstance(body, dict) and body.get("errorType") == "bad_data"):
                raise BacktestRuntimeError(f"Prometheus {self.url}: HTTP {resp.status_code} on query {name}: {err}")
            raise InputError(f"Prometheus rejected query {name} ({promql}): {err}"[:400])
        data = body.get("data")
        try:
            if not isinstance(data, dict) or data.get("resultType") != "matrix":
                raise TypeError(f"resultType {data.get('resultType') if isinstance(data, dict) else None!r}")
            return [
                (dict(item.get("metric", {})), [(float(t), float(v)) for t, v in item["values"]])
                for item in data["result"]
            ]
        except (TypeError, KeyError, ValueError) as exc:
            raise BacktestRuntimeError(
                f"Prometheus {self.url}: malformed query_range result for {name}: {exc}"
            ) from None

    def query(self, promql: str, now: float | None = None) -> list[tuple[dict[str, str], float]]:
        """The recorded value(s) of ``promql`` at ``now`` (a step time): what an instant query
        at that time returns, NaN included; an empty list when the range had no sample there."""
        if now is None:
            raise ValueError("a recorded query needs a time")
        k = round((now * 1000 - self.start_ms) / self.step_ms)
        return list(self._recorded.get(promql, {}).get(k, []))

    def steps(self) -> list[Step]:
        out = []
        step_s = self.step_ms / 1000
        for t in self.times():
            obs = self.observe(t)
            recorded = obs.sd_series_present if isinstance(obs, Observation) else None
            out.append(Step(t, obs, recorded, step_s))
        return out


def prometheus_steps(settings, url: str, start_s: float, end_s: float, step_s: float) -> list[Step]:
    """The steps of ``[start_s, end_s]`` every ``step_s``, from Prometheus with the daemon's PromQL."""
    src = RecordedPrometheus(
        url,
        settings.prometheus_selector,
        settings.rate_window_s,
        settings.acceptance_window_s,
        settings.long_window_s,
        settings.queries,
        settings.prometheus_timeout_s,
        start_s,
        end_s,
        step_s,
    )
    src.fetch()
    steps = src.steps()
    if not any(isinstance(s.observation, Observation) for s in steps):
        reasons = Counter(s.observation.reason.value for s in steps if isinstance(s.observation, ObservationFailure))
        raise InputError(
            f"Prometheus {url} has no usable arrival rate between {format_time(start_s)} and {format_time(end_s)}"
            f" (selector {settings.prometheus_selector or '(none)'!r}; steps: {dict(reasons)})"
        )
    return steps
