"""``sd-controller backtest``: replay history through the real decision logic.

Two inputs:

* ``--csv FILE``: one row per evaluation (columns ``time_s, arrival_rate_rps, acceptance_rate,
  mean_prompt_tokens, mean_gen_tokens, sd_enabled``; optional ``arrival_rate_long_rps``; empty
  cells are missing data).
* ``--prometheus-url URL --start T --end T [--step 60s] [--selector ...]``: one
  ``query_range`` per query of the daemon's own PromQL
  (:func:`controller.sources.prometheus.render_queries` with the windows, selector and query
  overrides of the Settings), and per step the very code the daemon runs on an instant query
  (:meth:`PrometheusSource.observe`) answered from those ranges: an empty arrival rate is an
  ``ObservationFailure(EMPTY)``, NaN in any other field is ``None``. The recorded SD state is
  whether vLLM exported SD counters at that step.

Each step's observation is fed to the unchanged :class:`~controller.loop.Controller` on a clock
set to the step's time; the hook applies a requested change at once. The output is the list of
decisions it would have taken and the model's predicted gain: Σ over steps of (latency in the
recorded state − latency in the controller's state) × arrival rate × step, minus the estimated
switch cost (``Assessment.switch_cost_request_s``) of each toggle.

Open-loop caveat (printed with the output): history with SD off carries no acceptance (vLLM
exports none), so the replay uses the last measured value, then the prior; and the controller's
own toggles would have changed the latency and queueing that the history shows, which a replay
cannot observe. The gain is the model's prediction, not a measurement.

Exit codes: 0 done; 2 bad input (arguments, times, CSV, settings, calibration, a query
Prometheus rejects, no data in the range); 1 runtime failure (Prometheus unreachable, HTTP 5xx,
not JSON). Each error is one line on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import itertools
import logging
import math
import re
import sys
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

import requests

from controller.commands._common import EXAMPLE_CALIBRATION, calibration_path, exits_on_input_error
from controller.errors import ConfigError, InputError
from controller.observation import FailureReason, Observation, ObservationFailure, ObserveResult
from controller.sources.prometheus import PrometheusSource

COLUMNS = ("time_s", "arrival_rate_rps", "acceptance_rate", "mean_prompt_tokens", "mean_gen_tokens", "sd_enabled")
OPTIONAL_COLUMNS = ("arrival_rate_long_rps",)
CAVEAT = (
    "open-loop caveat: acceptance is unobserved while SD was off in the history (the replay uses the last "
    "measured value, then the prior), and the controller's own toggles would have changed the load's latency "
    "and queueing, which a replay cannot observe: gains are model predictions, not measurements"
)
MAX_STEPS = 200_000
POINTS_PER_QUERY = 10_000  # Prometheus refuses more than 11,000 points per series in one query_range
_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


class BacktestRuntimeError(RuntimeError):
    """A failure of the environment, not of the input (Prometheus unreachable): exit code 1."""


# ------------------------------------------------------------------------------------------
# Arguments: times and durations
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
# Input: steps to replay
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


# ------------------------------------------------------------------------------------------
# Replay
# ------------------------------------------------------------------------------------------


class _ListSource:
    """Returns the prepared observation of the current step."""

    def __init__(self) -> None:
        self.current: ObserveResult = ObservationFailure(FailureReason.EMPTY, "no step")

    def observe(self, now: float) -> ObserveResult:
        return self.current


class _ReplayHook:
    """A requested change is applied at once; ``status`` reports the replay's state."""

    def __init__(self, enabled: bool, draft_length: int) -> None:
        self.enabled = enabled
        self.draft_length = draft_length
        self.requests: list = []

    def request(self, change) -> None:
        self.requests.append(change)
        self.enabled = change.enabled
        if change.num_speculative_tokens:
            self.draft_length = change.num_speculative_tokens

    def status(self):
        from controller.hooks.base import HookPhase, HookStatus

        return HookStatus(phase=HookPhase.READY, applied_enabled=self.enabled, applied_draft_length=self.draft_length)


@dataclass(frozen=True)
class StepRecord:
    """What the replay saw and decided at one step."""

    time_s: float
    duration_s: float
    arrival_rate_rps: float | None
    acceptance_rate: float | None  # what the decision used
    acceptance_source: str | None  # measured | last | prior
    recorded_enabled: bool | None
    controller_enabled: bool  # after this step's decision (applied at once in the replay)
    predicted_speedup: float | None
    action: str
    reason: str
    detail: str
    failure: str | None  # why the observation was unusable
    switch_cost_request_s: float | None  # of this step's toggle
    projected_gain_request_s: float | None
    gain_request_s: float | None  # this step's latency term; None: no assessment or state unknown


@dataclass
class BacktestResult:
    records: list[StepRecord]
    latency_gain_request_s: float = 0.0  # Σ (L_recorded − L_controller) · λ · Δt over bounded steps
    switch_cost_request_s: float = 0.0  # Σ estimated cost of the controller's toggles
    unbounded_for: int = 0  # steps where only the recorded state is predicted overloaded
    unbounded_against: int = 0  # steps where only the controller's state is predicted overloaded
    requests: float = 0.0  # Σ λ · Δt over steps with an assessment
    beyond_headroom_recorded: int = 0  # steps the recorded state ran past capacity_headroom of its limit
    beyond_headroom_controller: int = 0  # the same for the controller's state
    failures: Counter = field(default_factory=Counter)

    @property
    def net_gain_request_s(self) -> float:
        return self.latency_gain_request_s - self.switch_cost_request_s

    @property
    def decisions(self) -> list[StepRecord]:
        return [r for r in self.records if r.action != "none"]

    @property
    def recorded_toggles(self) -> int:
        known = [r.recorded_enabled for r in self.records if r.recorded_enabled is not None]
        return sum(1 for a, b in itertools.pairwise(known) if a != b)


@contextlib.contextmanager
def _quiet_structlog() -> Iterator[None]:
    """Silence the controller's per-tick log lines, and restore the caller's configuration."""
    import structlog

    old = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    try:
        yield
    finally:
        structlog.configure(**old)


def replay(settings, model, steps: Sequence[Step]) -> BacktestResult:
    """Drive the unchanged Controller through ``steps`` on their clock; see the module doc."""
    from prometheus_client import CollectorRegistry

    from controller.loop import Controller
    from controller.settings import OverrideMode
    from controller.state_store import MemoryStateStore

    first = next((s.recorded_enabled for s in steps if s.recorded_enabled is not None), False)
    source, hook = _ListSource(), _ReplayHook(bool(first), settings.draft_length)
    clock = [steps[0].time_s if steps else 0.0]
    ctl = Controller(
        settings,
        model,
        source,
        hook,
        lambda: clock[0],
        CollectorRegistry(),
        MemoryStateStore(),
        override=lambda: OverrideMode.AUTO,  # an operator's override is not history to replay
    )
    result = BacktestResult([])
    recorded: bool | None = None
    with _quiet_structlog():
        for step in steps:
            clock[0] = step.time_s
            source.current = step.observation
            if step.recorded_enabled is not None:
                recorded = step.recorded_enabled  # carried over steps that lack it (restarts, gaps)
            res = ctl.tick()
            result.records.append(_record(result, settings, step, res, recorded, hook.enabled))
    return result


def _record(result: BacktestResult, settings, step: Step, res, recorded: bool | None, ctl_enabled: bool) -> StepRecord:
    from controller.policy import usable

    a = res.assessment
    obs = res.observation
    unusable = usable(obs, settings)  # the controller's own gate: why it held without an assessment
    failure = unusable.reason.value if unusable is not None else None
    if failure:
        result.failures[failure] += 1
    gain = None
    cost = None
    if a is not None:
        lam_dt = a.arrival_rate_rps * step.duration_s
        result.requests += lam_dt
        if recorded is not None and _beyond_headroom(a, recorded, settings):
            result.beyond_headroom_recorded += 1
        if _beyond_headroom(a, ctl_enabled, settings):
            result.beyond_headroom_controller += 1
        if recorded is not None:
            if recorded == ctl_enabled:
                gain = 0.0
            else:
                l_rec, l_ctl = a.latency_s(recorded), a.latency_s(ctl_enabled)
                if math.isinf(l_rec) and not math.isinf(l_ctl):
                    result.unbounded_for += 1
                elif math.isinf(l_ctl):
                    result.unbounded_against += 1
                else:
                    gain = (l_rec - l_ctl) * lam_dt
                    result.latency_gain_request_s += gain
        if res.acted:
            cost = a.switch_cost_request_s
            result.switch_cost_request_s += cost
    return StepRecord(
        time_s=step.time_s,
        duration_s=step.duration_s,
        arrival_rate_rps=getattr(obs, "arrival_rate_rps", None),
        acceptance_rate=a.acceptance.rate if a is not None else None,
        acceptance_source=a.acceptance.source.value if a is not None else None,
        recorded_enabled=recorded,
        controller_enabled=ctl_enabled,
        predicted_speedup=a.predicted_speedup if a is not None else None,
        action=res.decision.action.value if res.acted else "none",
        reason=res.decision.reason.value,
        detail=res.decision.detail,
        failure=failure,
        switch_cost_request_s=cost,
        projected_gain_request_s=a.projected_gain_request_s if a is not None else None,
        gain_request_s=gain,
    )


def _beyond_headroom(a, enabled: bool, settings) -> bool:
    limit = a.stability_limit_on_rps if enabled else a.stability_limit_off_rps
    return a.arrival_rate_rps > settings.capacity_headroom * limit


# ------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--csv", help=f"observations CSV with columns {', '.join(COLUMNS)}")
    src.add_argument("--prometheus-url", help="Prometheus base URL to read history from (query_range)")
    parser.add_argument("--start", help="Prometheus: start time (unix seconds, ISO 8601 (UTC if no offset), now-6h)")
    parser.add_argument("--end", help="Prometheus: end time (same forms; default now)")
    parser.add_argument(
        "--step", help="Prometheus: seconds between evaluations, e.g. 60s (default: evaluation_interval_s)"
    )
    parser.add_argument(
        "--selector", help='Prometheus: label matchers, e.g. model_name="x" (default: prometheus_selector)'
    )
    parser.add_argument(
        "--config", help="YAML or JSON settings file, as for `run` (environment SD_CONTROLLER_* applies)"
    )
    parser.add_argument(
        "--calibration", default=None, help="calibration JSON, or 'example' (default: calibration_file)"
    )
    parser.add_argument("--plot", default=None, help="write a PNG of rate, predicted speedup and SD state here")
    parser.add_argument("--all-steps", action="store_true", help="print every step, not only the decisions")


def load_backtest_settings(args: argparse.Namespace):
    from controller.settings import load_settings

    overrides: dict = {"hook_type": "none"}  # the replay never calls a hook; its settings do not matter
    if getattr(args, "selector", None) is not None:
        overrides["prometheus_selector"] = args.selector
    return load_settings(getattr(args, "config", None), **overrides)


def _steps_from_args(args: argparse.Namespace, settings) -> tuple[list[Step], str]:
    if args.csv:
        for opt in ("start", "end", "step", "selector"):
            if getattr(args, opt, None) is not None:
                raise InputError(f"--{opt} is for --prometheus-url; a CSV is replayed whole")
        rows = read_rows(Path(args.csv))
        return steps_from_rows(rows), f"CSV {args.csv}"
    parts = urlsplit(args.prometheus_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InputError(f"--prometheus-url {args.prometheus_url!r}: must be an http(s) URL with a host")
    if not args.start:
        raise InputError("--start is required with --prometheus-url")
    start = parse_time(args.start, "--start")
    end = parse_time(args.end, "--end") if args.end else datetime.now(UTC).timestamp()
    if end <= start:
        raise InputError(f"--end ({format_time(end)}) must be after --start ({format_time(start)})")
    step = parse_duration(args.step, "--step") if args.step else settings.evaluation_interval_s
    if step < 0.001:
        raise InputError(f"--step {args.step!r}: must be > 0")
    if (end - start) / step + 1 > MAX_STEPS:
        raise InputError(f"--step {step:g}s gives more than {MAX_STEPS} steps between --start and --end: raise it")
    steps = prometheus_steps(settings, args.prometheus_url, start, end, step)
    sel = settings.prometheus_selector or "(no selector)"
    return steps, f"Prometheus {args.prometheus_url} {sel}, {format_time(start)} .. {format_time(end)} every {step:g}s"


@exits_on_input_error
def run(args: argparse.Namespace) -> int:
    from controller import calibration

    settings = load_backtest_settings(args)
    cal_name = args.calibration or settings.calibration_file or EXAMPLE_CALIBRATION
    cal = calibration.load(calibration_path(cal_name))
    model = cal.latency_model(settings.max_num_seqs)
    try:
        steps, what = _steps_from_args(args, settings)
    except BacktestRuntimeError as exc:
        print(f"sd-controller {args.command}: error: {exc}", file=sys.stderr)
        return 1
    result = replay(settings, model, steps)
    print(f"backtest of {what}: {len(steps)} steps")
    if cal.example:
        print("calibration: the shipped EXAMPLE (a roofline estimate, not a measurement)")
    print(CAVEAT)
    print_result(result, all_steps=args.all_steps)
    from controller import residuals

    print("\n" + residuals.format_report(residuals.summarize(residuals.from_steps(settings, model, steps))))
    if args.plot:
        plot(result, Path(args.plot))
        print(f"wrote {args.plot}")
    return 0


def print_result(result: BacktestResult, all_steps: bool = False, out=None) -> None:
    out = out or sys.stdout
    shown = result.records if all_steps else result.decisions
    title = "steps" if all_steps else "decisions the controller would have taken"
    print(f"\n{title}:", file=out)
    if not shown:
        print("  (none: it would have kept the recorded state)", file=out)
    else:
        print(
            f"  {'time':>20} {'action':>8} {'rate':>7} {'accept':>12} {'speedup':>8} {'cost':>8} {'proj.gain':>9}"
            "  reason: detail",
            file=out,
        )
        for r in shown:
            acc = "-" if r.acceptance_rate is None else f"{r.acceptance_rate:.2f} {r.acceptance_source}"
            why = f"{r.failure}" if r.failure and r.action == "none" else f"{r.reason}: {r.detail}"
            print(
                f"  {format_time(r.time_s):>20} {r.action:>8} {_f(r.arrival_rate_rps):>7} {acc:>12}"
                f" {_f(r.predicted_speedup, 3):>8} {_f(r.switch_cost_request_s, 0):>8}"
                f" {_f(r.projected_gain_request_s, 0):>9}  {why}",
                file=out,
            )
    recs = result.records
    usable = sum(1 for r in recs if r.predicted_speedup is not None)
    rec_on = [r.recorded_enabled for r in recs if r.recorded_enabled is not None]
    ctl_on = [r.controller_enabled for r in recs]
    enables = sum(1 for r in result.decisions if r.action == "enable")
    disables = sum(1 for r in result.decisions if r.action == "disable")
    print("\nsummary:", file=out)
    failures = ", ".join(f"{k} {v}" for k, v in sorted(result.failures.items())) or "none"
    print(f"  steps: {len(recs)}, assessed {usable}; held on unusable data: {failures}", file=out)
    if rec_on:
        print(
            f"  recorded: SD on {100 * sum(rec_on) / len(rec_on):.0f}% of steps, {result.recorded_toggles} changes",
            file=out,
        )
    if ctl_on:
        print(
            f"  controller: SD on {100 * sum(ctl_on) / len(ctl_on):.0f}% of steps,"
            f" {enables} enable(s), {disables} disable(s)",
            file=out,
        )
    print(
        f"  predicted gain (model prediction, not a measurement): latency {result.latency_gain_request_s:.1f}"
        f" req·s - switch costs {result.switch_cost_request_s:.1f} req·s = {result.net_gain_request_s:.1f} req·s"
        + (
            f" ({result.net_gain_request_s / result.requests:+.3f} s per request over {result.requests:.0f} requests)"
            if result.requests > 0
            else ""
        ),
        file=out,
    )
    if result.unbounded_for or result.unbounded_against:
        print(
            f"  not in the sum: {result.unbounded_for} step(s) where the model predicts the recorded state overloaded"
            f" (unbounded gain), {result.unbounded_against} where it predicts the controller's state overloaded"
            " (unbounded loss)",
            file=out,
        )
    if result.beyond_headroom_recorded or result.beyond_headroom_controller:
        print(
            f"  beyond capacity_headroom of the stability limit (the fluid model understates latency there; real"
            f" queues grow without bound): recorded state {result.beyond_headroom_recorded} step(s),"
            f" controller's state {result.beyond_headroom_controller} step(s)",
            file=out,
        )
    print(f"  {CAVEAT}", file=out)


def _f(v: float | None, digits: int = 2) -> str:
    if v is None:
        return "-"
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:.{digits}f}"


def plot(result: BacktestResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = result.records
    if not recs:
        return
    t0 = recs[0].time_s
    t = [(r.time_s - t0) / 3600 for r in recs]
    nan = float("nan")
    fig, axes = plt.subplots(3, 1, figsize=(10, 7), sharex=True)
    axes[0].plot(t, [r.arrival_rate_rps if r.arrival_rate_rps is not None else nan for r in recs])
    axes[0].set_ylabel("arrival rate (req/s)")
    sp = [nan if r.predicted_speedup is None else min(r.predicted_speedup, 3.0) for r in recs]
    axes[1].plot(t, sp, color="C2", label="predicted speedup (capped at 3)")
    axes[1].axhline(1.0, color="grey", lw=0.8, ls=":")
    axes[1].set_ylabel("predicted speedup")
    axes[1].legend(loc="best", fontsize=8)
    rec = [nan if r.recorded_enabled is None else float(r.recorded_enabled) for r in recs]
    axes[2].step(t, rec, where="post", color="C0", alpha=0.6, label="recorded")
    axes[2].step(t, [float(r.controller_enabled) + 0.02 for r in recs], where="post", color="C1", label="controller")
    for r in result.decisions:
        for ax in axes:
            ax.axvline((r.time_s - t0) / 3600, color="C3", lw=0.6, alpha=0.5)
    axes[2].set_yticks([0, 1], ["off", "on"])
    axes[2].set_ylabel("SD")
    axes[2].legend(loc="best", fontsize=8)
    axes[2].set_xlabel(f"hours since {format_time(t0)}")
    fig.suptitle(
        f"backtest: predicted net gain {result.net_gain_request_s:.0f} req·s (model prediction; open-loop replay)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
