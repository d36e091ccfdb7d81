"""Validate a calibration against a load test it was not fitted on (pure).

A load test is a set of constant-rate runs of the real (or simulated) server, each with its
measured mean end-to-end latency and whether its queue kept growing (saturated). For every run
the model predicts the same quantity at the same acceptance and request shape, and at the rate
the run was offered: what it sent over its duration where the file records both (Poisson
arrivals at a rate send ±√n requests, and near a limit 1 % of rate is 5–10 % of latency),
else the rate it asked for. The report says per run how far off it is, per mode the mean and
worst error over the runs that were not saturated, whether every saturated run was predicted
overloaded, and where the measured and predicted stability limits and break-even rates are.

Near a limit one run's mean varies by several per cent from arrival seed to arrival seed (a
queue at 0.9 of capacity remembers its bursts for minutes), so a load test may repeat a rate on
other seeds, in one file or several: the runs at one rate of one mode are pooled into a point
(the mean of its steady runs' means and of their predictions; saturated when at least half its
runs were), and the summaries, the limit bracket and the break-even read the points. With one
run per rate a point is its run.
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from controller.acceptance import alpha_from_vllm_rate
from controller.calibration import LoadRow
from controller.errors import InputError
from controller.model import (
    INTERVAL_Z,
    LatencyModel,
    break_even_rates,
    curves,
    interval_scales,
    predict_point,
)

# The share of runs a prediction interval should hold if the calibration's residuals are the
# model's error: two-sided at INTERVAL_Z (≈ 90 %). validate reports the share that did.
INTERVAL_COVERAGE = 2.0 * statistics.NormalDist().cdf(INTERVAL_Z) - 1.0


@dataclass(frozen=True)
class RowCheck:
    """One load-test run next to its prediction."""

    row: LoadRow
    predicted_s: float  # +inf: the model calls it overloaded
    predicted_lo_s: float
    predicted_hi_s: float
    error: float | None  # (predicted − measured) / measured; None when either side saturated
    # The model's stationary mean; predicted_s is what a test of the row's duration sees, when
    # the row records it (LoadRow.duration_s), else the same.
    stationary_s: float
    # Called overloaded only because a KV-full batch recomputes prompts: the rate is below what
    # the server keeps until a burst fills its cache (ModeCurve.metastable_band_rps), so a test
    # of finite length may stay steady there as well as fall behind.
    metastable: bool = False

    @property
    def mode(self) -> str:
        return f"on(γ={self.row.draft_length})" if self.row.sd else "off"

    @property
    def predicted_overloaded(self) -> bool:
        return math.isinf(self.predicted_s)

    @property
    def measured_saturated(self) -> bool:
        return bool(self.row.saturated)

    @property
    def inside_interval(self) -> bool | None:
        """The measured mean lies in the predicted interval (the cost scales of the calibration's
        residuals, :data:`INTERVAL_COVERAGE` nominal); None where either side is overloaded."""
        if self.measured_saturated or self.predicted_overloaded:
            return None
        return self.predicted_lo_s <= self.row.mean_e2e_s <= self.predicted_hi_s  # hi is +inf past the limit


# Student's t, two-sided 95 %, by degrees of freedom 1..30 (then 1.96): the standard error of a
# mean of a few runs is itself a rough estimate, and three runs need a miss of 4.3 of them.
_T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.16, 2.145, 2.131,
          2.12, 2.11, 2.101, 2.093, 2.086, 2.08, 2.074, 2.069, 2.064, 2.06, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip


def t_975(dof: int) -> float:
    """The two-sided 95 % quantile of Student's t with ``dof`` degrees of freedom (≥ 1)."""
    return _T_975[dof - 1] if dof <= len(_T_975) else 1.96


@dataclass(frozen=True)
class PointCheck:
    """The runs of one mode at one rate, pooled."""

    runs: tuple[RowCheck, ...]
    saturated_runs: int
    measured_s: float | None  # mean of the steady runs' means; None when the point is saturated
    predicted_s: float  # mean of the same runs' predictions; +inf: called overloaded
    # Standard error of measured_s from the spread of its runs (None below two steady runs).
    measured_se_s: float | None
    error: float | None  # (predicted − measured) / measured; None when either side is overloaded

    @property
    def mode(self) -> str:
        return self.runs[0].mode

    @property
    def rate(self) -> float:
        return self.runs[0].row.rate

    @property
    def measured_saturated(self) -> bool:
        return 2 * self.saturated_runs >= len(self.runs)

    @property
    def predicted_overloaded(self) -> bool:
        return math.isinf(self.predicted_s)

    @property
    def metastable(self) -> bool:
        return all(c.metastable for c in self.runs)

    @property
    def error_in_se(self) -> float | None:
        """The miss in standard errors of the measured mean, signed (None below two steady runs or
        with no error); :attr:`beyond_noise` sets it against Student's t."""
        if self.error is None or not self.measured_se_s:
            return None
        return (self.predicted_s - self.measured_s) / self.measured_se_s  # type: ignore[operator]

    @property
    def beyond_noise(self) -> bool | None:
        """The miss lies outside the 95 % band the runs' own spread allows (Student's t with one
        degree of freedom fewer than the steady runs); None without two steady runs."""
        if self.error_in_se is None:
            return None
        steady = len(self.runs) - self.saturated_runs
        return abs(self.error_in_se) > t_975(steady - 1)

    @property
    def served_rps(self) -> float | None:
        """What the saturated runs finished per second, on average (None: not recorded)."""
        served = [c.row.served_rps for c in self.runs if c.measured_saturated and c.row.served_rps is not None]
        return sum(served) / len(served) if served else None


def pool(checks: Sequence[RowCheck]) -> list[PointCheck]:
    """The runs of each mode at each rate as one point, in the order of their first run (of one
    workload: :func:`validate` refuses several)."""
    groups: dict[tuple[bool, int, float], list[RowCheck]] = defaultdict(list)
    for c in checks:
        groups[(*_curve_key(c.row), round(c.row.rate, 9))].append(c)
    points = []
    for group in groups.values():
        saturated = sum(c.measured_saturated for c in group)
        overloaded = sum(c.predicted_overloaded for c in group)
        steady = [c for c in group if not c.measured_saturated]
        measured = se = None
        error = None
        if 2 * saturated < len(group):
            means = [c.row.mean_e2e_s for c in steady]
            measured = sum(means) / len(means)
            if len(means) > 1:
                var = sum((m - measured) ** 2 for m in means) / (len(means) - 1)
                se = math.sqrt(var / len(means))
        # Called overloaded when at least half its runs are (their workloads differ a little);
        # otherwise the mean over the steady runs the model gives a finite latency.
        if 2 * overloaded >= len(group):
            predicted = math.inf
        else:
            finite = [c.predicted_s for c in (steady or group) if math.isfinite(c.predicted_s)]
            predicted = sum(finite) / len(finite) if finite else math.inf
        if measured is not None and math.isfinite(predicted) and measured > 0:
            error = (predicted - measured) / measured
        points.append(PointCheck(tuple(group), saturated, measured, predicted, se, error))
    return points


@dataclass(frozen=True)
class ModeSummary:
    """One mode over its points (the runs at one rate pooled: with one run per rate, its runs)."""

    mode: str
    runs: int
    mean_abs_error: float | None  # over points neither measured saturated nor predicted overloaded
    worst_error: float | None  # signed, the largest in magnitude
    saturated_runs: int  # saturated points
    saturated_flagged: int  # saturated points the model called overloaded
    false_overloads: int  # points the model called overloaded that were not saturated (metastable ones aside)
    limit_predicted_rps: float
    limit_measured_rps: tuple[float | None, float | None]  # (highest steady rate, lowest saturated rate)
    limit_error: float | None  # relative distance of the prediction outside that bracket (0 inside)
    limit_reason: str = "throughput_peak"  # what sets the predicted limit (model.LIMIT_REASONS)
    # kv_recompute: the rate kept until the cache fills; the limit's error is to the band
    # [limit_predicted_rps, this]. None without such a band.
    limit_cache_fill_rps: float | None = None
    metastable_runs: int = 0  # steady runs inside that band (called overloaded, not counted false)
    # What the server finished per second at the lowest saturated rate (its queue never emptied:
    # its capacity), None where not recorded; and the predicted limit's (or band's) relative
    # distance from it.
    limit_served_rps: float | None = None
    capacity_error: float | None = None
    points: int = 0  # rates measured (runs at one rate pooled)
    # Runs (not pooled) neither saturated nor called overloaded, and those whose measured mean lay
    # inside the predicted interval (RowCheck.inside_interval).
    interval_runs: int = 0
    interval_inside: int = 0


@dataclass(frozen=True)
class BreakEvenCheck:
    draft_length: int
    predicted_rps: float | None  # None: SD predicted never below 1
    measured_rps: float | None  # None: not crossed within the measured rates
    error: float | None
    # The measured rates around the crossing (speedup ≥ 1 at the first, < 1 at the second): the
    # measured rate is interpolated between them, and rates far apart leave it soft. None: not
    # crossed, or crossed below the lowest rate measured.
    measured_between_rps: tuple[float, float] | None = None

    @property
    def refine_rps(self) -> tuple[float, ...]:
        """Rates to load-test (both modes) to pin the measured crossing: :func:`refine_rates`
        inside its bracket; none when the bracket is already that narrow or there is none."""
        return () if self.measured_between_rps is None else refine_rates(*self.measured_between_rps)


# A measured crossing interpolated over a step wider than this share of the rate is soft: the
# speedup bends between the rates (it falls steeply into SD's limit), and a straight line
# between runs a fifth of the rate apart can miss the crossing by several per cent (the
# simulated A100's `mixed` at γ = 4: 4.91 req/s across runs at 4 and 5, 4.58 with runs 0.2 apart).
BREAK_EVEN_STEP = 0.05
MAX_REFINE_RATES = 4


def refine_rates(low: float, high: float) -> tuple[float, ...]:
    """Rates strictly between ``low`` and ``high`` that cut it into steps of at most
    BREAK_EVEN_STEP of the rate (at most MAX_REFINE_RATES of them), rounded to 1e-3 req/s."""
    parts = min(MAX_REFINE_RATES + 1, math.ceil((high - low) / (BREAK_EVEN_STEP * 0.5 * (low + high)) - 1e-9))
    return tuple(round(low + (high - low) * j / parts, 3) for j in range(1, parts))


@dataclass(frozen=True)
class ValidationReport:
    rows: tuple[RowCheck, ...]  # every run
    modes: tuple[ModeSummary, ...]
    break_even: tuple[BreakEvenCheck, ...]
    points: tuple[PointCheck, ...] = ()  # the runs at one rate of one mode, pooled

    @property
    def replicated(self) -> bool:
        """Some rate was run more than once."""
        return any(len(p.runs) > 1 for p in self.points)

    @property
    def mean_abs_error(self) -> float | None:
        errs = [abs(p.error) for p in self.points if p.error is not None]
        return sum(errs) / len(errs) if errs else None

    @property
    def worst_abs_error(self) -> float | None:
        errs = [abs(p.error) for p in self.points if p.error is not None]
        return max(errs) if errs else None

    @property
    def saturated_all_flagged(self) -> bool:
        return all(p.predicted_overloaded for p in self.points if p.measured_saturated)

    @property
    def interval_coverage(self) -> tuple[int, int]:
        """(runs inside the predicted interval, runs checked): against INTERVAL_COVERAGE, whether
        the calibration's residuals say how far off the model is (many more inside: the
        intervals are wider than its errors; fewer: they promise more than it keeps)."""
        return _coverage(self.rows)


def _coverage(checks: Sequence[RowCheck]) -> tuple[int, int]:
    """(runs inside their predicted interval, runs checked) of some runs (RowCheck.inside_interval)."""
    checked = [c.inside_interval for c in checks if c.inside_interval is not None]
    return sum(checked), len(checked)


def _alpha(row: LoadRow) -> float:
    return float(alpha_from_vllm_rate(row.acceptance_rate, max(row.draft_length, 1))) if row.sd else 0.0


def check_row(model: LatencyModel, row: LoadRow) -> RowCheck:
    gamma = row.draft_length if row.sd else 1
    alpha = _alpha(row) if row.sd else 0.5
    rate = row.offered_rps  # near a limit ±1 % of arrivals moves the latency by ±5–10 %
    p = predict_point(model, rate, alpha, gamma, row.workload())
    if row.sd:
        pred, lo, hi = p.latency_on_s, p.latency_on_lo_s, p.latency_on_hi_s
    else:
        pred, lo, hi = p.latency_off_s, p.latency_off_lo_s, p.latency_off_hi_s
    stationary = pred
    curve = curves(model, alpha, gamma, row.workload())[1 if row.sd else 0]
    band_lo, band_hi = curve.metastable_band_rps
    metastable = band_lo <= rate < band_hi
    if row.duration_s is not None and math.isfinite(pred) and rate > 0:
        # The test ran for a while from an empty server: compare it with what such a test
        # sees (near the limit the stationary mean is hours away), at the same interval.
        window = functools.partial(curve.latency_in_window_s, rate, row.duration_s, row.warmup_s)
        spread = INTERVAL_Z * (model.relative_sd_on if row.sd else model.relative_sd_off)
        pred = window()
        lo, hi = (window(cost_scale=c) for c in interval_scales(spread))
    error = None
    if not row.saturated and math.isfinite(pred) and row.mean_e2e_s > 0:
        error = (pred - row.mean_e2e_s) / row.mean_e2e_s
    return RowCheck(row, pred, lo, hi, error, stationary, metastable)


def _curve_key(row: LoadRow) -> tuple[bool, int]:
    return (row.sd, row.draft_length if row.sd else 0)


def _limit_bracket(points: Sequence[PointCheck]) -> tuple[float | None, float | None]:
    steady = [p.rate for p in points if not p.measured_saturated]
    saturated = [p.rate for p in points if p.measured_saturated]
    return (max(steady) if steady else None, min(saturated) if saturated else None)


def _limit_error(
    predicted: float, bracket: tuple[float | None, float | None], predicted_hi: float | None = None
) -> float | None:
    """Relative distance of the predicted limit (or band [predicted, predicted_hi]) outside the
    measured bracket; 0 where they overlap."""
    lo, hi = bracket
    top = predicted if predicted_hi is None else predicted_hi
    if lo is not None and top < lo:
        return (top - lo) / lo
    if hi is not None and predicted > hi:
        return (predicted - hi) / hi
    if lo is None and hi is None:
        return None
    return 0.0


def _summaries(model: LatencyModel, points: Sequence[PointCheck]) -> list[ModeSummary]:
    groups: dict[tuple[bool, int], list[PointCheck]] = defaultdict(list)
    for p in points:
        groups[_curve_key(p.runs[0].row)].append(p)
    out = []
    for (sd, gamma), group in sorted(groups.items()):
        errs = [p.error for p in group if p.error is not None]
        runs = [c for p in group for c in p.runs]
        ref = runs[0].row
        off, on = curves(model, _alpha(ref) if sd else 0.5, gamma if sd else 1, _mean_row(runs).workload())
        curve = on if sd else off
        limit = curve.stability_limit_rps
        bracket = _limit_bracket(group)
        saturated = [p for p in group if p.measured_saturated]
        band_lo, band_hi = curve.metastable_band_rps
        fill = band_hi if band_hi > band_lo else None
        inside, checked = _coverage(runs)
        first = min(saturated, key=lambda p: p.rate, default=None)
        served = None if first is None else first.served_rps
        out.append(
            ModeSummary(
                mode=group[0].mode,
                runs=len(runs),
                mean_abs_error=sum(abs(e) for e in errs) / len(errs) if errs else None,
                worst_error=max(errs, key=abs) if errs else None,
                saturated_runs=len(saturated),
                saturated_flagged=sum(p.predicted_overloaded for p in saturated),
                false_overloads=sum(
                    p.predicted_overloaded and not p.measured_saturated and not p.metastable for p in group
                ),
                limit_predicted_rps=limit,
                limit_measured_rps=bracket,
                limit_error=_limit_error(limit, bracket, fill),
                limit_reason=curve.limit_reason,
                limit_cache_fill_rps=fill,
                metastable_runs=sum(p.metastable and not p.measured_saturated for p in group),
                limit_served_rps=served,
                capacity_error=None if not served else _limit_error(limit, (served, served), fill),
                points=len(group),
                interval_runs=checked,
                interval_inside=inside,
            )
        )
    return out


def _mean_row(group: Sequence[RowCheck]) -> LoadRow:
    """A representative run of a curve: mean request shape and acceptance over its runs."""
    rows = [c.row for c in group]
    n = len(rows)
    stds = [r.gen_tokens_std for r in rows if r.gen_tokens_std is not None]
    pstds = [r.prompt_tokens_std for r in rows if r.prompt_tokens_std is not None]
    # A saturated run's batch is whatever its backlog left in the cache: the steady runs say
    # what the mix holds.
    ctxs = [r.running_context_tokens for r in rows if r.running_context_tokens is not None and not r.saturated]
    hits = [r.cached_prompt_tokens for r in rows if r.cached_prompt_tokens is not None]
    return LoadRow(
        rate=0.0,
        sd=rows[0].sd,
        draft_length=rows[0].draft_length,
        acceptance_rate=sum(r.acceptance_rate for r in rows) / n,
        mean_e2e_s=1.0,
        mean_prompt_tokens=sum(r.mean_prompt_tokens for r in rows) / n,
        mean_gen_tokens=sum(r.mean_gen_tokens for r in rows) / n,
        line=0,
        gen_tokens_std=sum(stds) / len(stds) if stds else None,
        prompt_tokens_std=sum(pstds) / len(pstds) if pstds else None,
        running_context_tokens=sum(ctxs) / len(ctxs) if ctxs else None,
        cached_prompt_tokens=sum(hits) / len(hits) if hits else None,
    )


def _arrivals(row: LoadRow) -> tuple[str, float, float]:
    """What identifies a run's arrivals: the load test it came from (every mode of one is sent
    the same requests), or, for runs built otherwise, the requests' mean shape."""
    return (row.source, 0.0, 0.0) if row.source else ("", row.mean_prompt_tokens, row.mean_gen_tokens)


def _measured_speedup(off: PointCheck, on: PointCheck) -> float:
    """The speedup the runs measured at one rate: over the runs of both modes that were sent the
    same arrivals (one load test, one seed) where there are any, since a seed's long requests
    move both modes' latencies alike and a speedup of one mode's seeds over the other's can cross
    1 on them alone (H100 reasoning at 4 req/s: 1.01 over unpaired seeds, 0.97 on the seed both
    ran); else the points' means."""
    if on.measured_saturated and off.measured_saturated:
        return math.nan
    if on.measured_saturated:
        return 0.0
    if off.measured_saturated:
        return math.inf

    def by_arrivals(point: PointCheck) -> dict[tuple[str, float, float], list[float]]:
        runs: dict[tuple[str, float, float], list[float]] = defaultdict(list)
        for c in point.runs:
            if not c.row.saturated:
                runs[_arrivals(c.row)].append(c.row.mean_e2e_s)
        return runs

    offs, ons = by_arrivals(off), by_arrivals(on)
    paired = [(statistics.fmean(offs[k]), statistics.fmean(ons[k])) for k in offs.keys() & ons.keys()]
    if paired:
        return sum(o for o, _ in paired) / sum(n for _, n in paired)
    return off.measured_s / on.measured_s  # type: ignore[operator]


def _measured_break_even(pairs: Sequence[tuple[float, float]]) -> tuple[float | None, tuple[float, float] | None]:
    """First rate where the measured speedup falls below 1 (linear between measured rates), and
    the two rates it lies between."""
    pairs = [(r, s) for r, s in sorted(pairs) if not math.isnan(s)]
    if not pairs:
        return None, None
    if pairs[0][1] < 1.0:
        return pairs[0][0], None
    for (r0, s0), (r1, s1) in itertools.pairwise(pairs):
        if s1 < 1.0 <= s0:
            if math.isinf(s0):
                return r1, (r0, r1)
            return r0 + (s0 - 1.0) / (s0 - s1) * (r1 - r0), (r0, r1)
    return None, None


def _break_evens(model: LatencyModel, points: Sequence[PointCheck]) -> list[BreakEvenCheck]:
    off_by_rate = {round(p.rate, 9): p for p in points if not p.runs[0].row.sd}
    on_groups: dict[int, list[PointCheck]] = defaultdict(list)
    for p in points:
        if p.runs[0].row.sd:
            on_groups[p.runs[0].row.draft_length].append(p)
    out = []
    for gamma, group in sorted(on_groups.items()):
        pairs = [
            (p.rate, _measured_speedup(off_by_rate[round(p.rate, 9)], p))
            for p in group
            if round(p.rate, 9) in off_by_rate
        ]
        if len(pairs) < 2:
            continue
        ref = _mean_row([c for p in group for c in p.runs])
        be = break_even_rates(model, _alpha(ref), gamma, ref.workload(), thresholds=(1.0,))[1.0]
        measured, between = _measured_break_even(pairs)
        error = None
        if be.rate_rps is not None and measured is not None and measured > 0:
            error = (be.rate_rps - measured) / measured
        out.append(BreakEvenCheck(gamma, be.rate_rps, measured, error, between))
    return out


def validate(model: LatencyModel, rows: Sequence[LoadRow]) -> ValidationReport:
    """Check every load-test run, pool the runs at one rate, then summarize per mode and per draft length."""
    workloads = sorted({r.workload_name for r in rows if r.workload_name})
    if len(workloads) > 1:  # a mode's limit and break-even belong to one request mix
        raise InputError(
            f"load-test rows of several workloads ({', '.join(workloads)}): validate one workload at a time"
        )
    checks = [check_row(model, r) for r in rows]
    points = pool(checks)
    return ValidationReport(
        tuple(checks), tuple(_summaries(model, points)), tuple(_break_evens(model, points)), tuple(points)
    )
