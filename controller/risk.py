"""The risk terms of a decision: excursion filter, load history and its forecast, startup hold.

Pure functions over plain values and timestamps (no clock is read here), small enough to be
table-tested one by one, the way the Kubernetes HPA tests its stabilization windows:

* **Excursion filter.** A restart takes ``downtime + drain`` seconds before the new state
  serves anything; a load excursion shorter than that is over before a switch could help, and
  the switch's outage lands on top of it. So a switch signal must persist that long first
  (:func:`persisted_since`, :func:`excursion_filter_s`).
* **Load history.** The controller keeps its own bucketed history of the arrival rate (the
  state file carries it across restarts), so that "what the next hours plausibly bring" can be
  read off the same hours of yesterday and of a week ago (:func:`record_rate`,
  :func:`forecast_peak`, :func:`forecast_time_to`): a diurnal day repeats, a trend from two
  windows does not see tomorrow morning.
* **Cycles.** A load that crossed SD's break-even band back and forth within two hours (an
  oscillation, a run of spikes) is judged by those hours' rates, not the phase it is in now
  (:func:`cycle_rates`): each crest and trough is shorter than the excursion filter.
* **Startup hold.** A controller that just started has no trend and no history of its own: it
  keeps the state vLLM was launched with unless that state is clearly wrong now. An overload
  the server shows (a full batch with a queue) that every bucket of the history has held
  (:func:`overload_predates_history`) is no excursion: only the restart's own outage is
  filtered, not the backlog's drain.
* **A load lasts about as long as it has lasted.** When nothing forecasts how long the load
  that wants a switch will last (no earlier days in the history, no material trend), the
  scale-free prior is Gott's (Lindy's): a load seen for ``a`` seconds is still there ``T``
  seconds later with probability a/(a + T). A switch's gain over a horizon H is then worth
  its rate times a·ln(1 + H/a) (:func:`rented_gain`): a few minutes of a new load vouch for
  little, an hour of it for most of an hour's gain. It keeps a step that reverses within the
  hour, or a launch into a load about to change, from a restart that never pays back, and
  asks a quiet hour to last before a restart is spent on it.
* **Acceptance trend.** The draft's acceptance drifts when the traffic's mix does (a new
  language, a new task). While SD runs, the controller keeps the last hour of the per-token
  acceptance α in buckets (:func:`record_acceptance`); a line that explains that hour and moves
  α materially (:func:`acceptance_trend`) is followed for as long as it was seen and then held
  (:func:`projected_alpha`): a drift that has run for an hour plausibly runs one more, and says
  nothing of where it goes after.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

DAY_S = 86_400.0
# Days whose same hours forecast the next ones: yesterday and the same weekday last week.
FORECAST_LAGS_S = (DAY_S, 7 * DAY_S)

RateHistory = tuple[tuple[float, float], ...]  # (bucket start, highest rate seen in it), ascending
# The history's resolution: one bucket per 5 minutes (eight days: at most 2305 pairs).
HISTORY_BUCKET_S = 300.0
# The load trend a switch's gain follows: a least-squares line through the last hour's buckets.
TREND_FIT_S = 3600.0
TREND_MIN_BUCKETS = 6
# A load seen within the last hour plausibly comes back: an oscillation, repeated spikes.
RECENT_PEAK_S = 3600.0
# A load that crossed SD's break-even band this often within this window is a cycle (see
# cycle_rates): two hours hold three crossings of a 40-minute oscillation, or of spikes 30 minutes apart.
CYCLE_WINDOW_S = 7200.0
CYCLE_MIN_CROSSINGS = 3
# A fitted trend forecasts the load only if it moves it by this fraction (and at least
# TREND_MIN_RPS) within TREND_FIT_S; a flatter line is the rate's noise.
TREND_MIN_CHANGE = 0.10
TREND_MIN_RPS = 0.5
TREND_MIN_R2 = 0.8
# A rise that disabling SD may anticipate: a steady line through the last two hours. A step is a
# poor line over any window (r² ≤ 0.75 for one in mid-window), a steady rise a better one the
# longer the window, so the longer fit tells a morning's climb from a step that has stopped.
RISE_FIT_S = 7200.0
RISE_MIN_BUCKETS = 18
# The acceptance history: the last hour's buckets (and the one filling) are all a trend needs.
ACCEPTANCE_KEEP_S = TREND_FIT_S + HISTORY_BUCKET_S
# A fitted α line forecasts the acceptance only if it moves α by this much within TREND_FIT_S
# (a measured α wanders by ~0.01 between windows at a steady mix).
ACCEPTANCE_TREND_MIN = 0.05


def backlog_drain_s(rate_rps: float, downtime_s: float, capacity_rps: float) -> float:
    """Seconds the new state needs to work off the backlog a restart's outage builds:
    λ·D / (μ − λ); +inf when it cannot (μ ≤ λ)."""
    if rate_rps <= 0.0 or downtime_s <= 0.0:
        return 0.0
    if capacity_rps <= rate_rps:
        return math.inf
    return rate_rps * downtime_s / (capacity_rps - rate_rps)


def excursion_filter_s(
    downtime_s: float, drain_s: float, configured_s: float | None, backlog_s: float = 0.0, max_s: float = math.inf
) -> float:
    """How long a switch signal must persist before it may restart vLLM.

    A restart helps only once it is over: the outage (downtime plus vLLM's graceful drain) and
    then the time the new state takes to work off the backlog the outage built. An excursion
    shorter than that has passed before the switch pays anything back, and near capacity that
    recovery takes many minutes. Capped at ``max_s`` (a lasting load is acted on eventually);
    ``configured_s`` overrides it.
    """
    if configured_s is not None:
        return max(configured_s, 0.0)
    return min(max(downtime_s, 0.0) + max(drain_s, 0.0) + max(backlog_s, 0.0), max_s)


def persisted_since(
    since: float | None,
    since_enabled: bool | None,
    want_enabled: bool | None,
    now: float,
    holding: bool = False,
) -> tuple[float | None, bool | None]:
    """When the current switch signal started: ``(since, direction)``.

    ``want_enabled`` is the state the signal asks for (None: no signal this tick). A signal that
    changes direction starts over, and so does one that disappears, unless ``holding``: the
    speedup fell back inside the hysteresis band but not past its middle. Like a Schmitt
    trigger, that keeps a minute of rate noise on a lasting load from restarting the clock
    forever, while a load that really comes back (a spike that ends) still resets it.
    """
    if want_enabled is None:
        if holding and since is not None and since_enabled is not None and since <= now:
            return since, since_enabled
        return None, None
    if since is not None and since_enabled == want_enabled and since <= now:
        return since, want_enabled
    return now, want_enabled


def overload_predates_history(history: RateHistory, overload_rps: float) -> bool:
    """Whether every bucket the controller has seen held a load of at least ``overload_rps``
    (the rate at which the applied state counts as overloaded): the overload was there before
    the controller was, so it is no excursion from anything it knows. A load seen arriving from
    below (a surge) is one, and must outlast its recovery like any other."""
    return bool(history) and all(r >= overload_rps for _, r in history)


def record_rate(history: RateHistory, now: float, rate_rps: float, bucket_s: float, keep_s: float) -> RateHistory:
    """Add one rate sample: each bucket keeps the highest rate seen in it; old buckets drop off.

    Bounded: at most ``keep_s / bucket_s + 1`` buckets. A sample older than the newest bucket
    (a clock stepped back) is ignored rather than rewriting history.
    """
    return _record(history, now, rate_rps, bucket_s, keep_s, max)


def record_acceptance(
    history: RateHistory,
    now: float,
    alpha: float,
    bucket_s: float = HISTORY_BUCKET_S,
    keep_s: float = ACCEPTANCE_KEEP_S,
) -> RateHistory:
    """Add one measured per-token acceptance α: each bucket keeps its latest (the source's
    window already averages it); bounded and ordered as :func:`record_rate`."""
    if not 0.0 <= alpha <= 1.0:
        return history
    return _record(history, now, alpha, bucket_s, keep_s, lambda _old, new: new)


def _record(history: RateHistory, now: float, value: float, bucket_s: float, keep_s: float, combine) -> RateHistory:
    if not (math.isfinite(value) and value >= 0.0 and bucket_s > 0):
        return history
    start = math.floor(now / bucket_s) * bucket_s
    items = list(history)
    if items and start < items[-1][0]:
        return history
    if items and items[-1][0] == start:
        items[-1] = (start, combine(items[-1][1], value))
    else:
        items.append((start, value))
    cutoff = now - keep_s
    first = next((i for i, (t, _) in enumerate(items) if t >= cutoff), len(items))
    return tuple(items[first:])


def history_fit(
    history: RateHistory,
    now: float,
    bucket_s: float = HISTORY_BUCKET_S,
    window_s: float = TREND_FIT_S,
    min_buckets: int = TREND_MIN_BUCKETS,
) -> tuple[float, float] | None:
    """``(slope, r²)``: the least-squares line through the complete buckets of the last
    ``window_s`` (req/s per second) and the share of their variance it explains; None with
    fewer than ``min_buckets`` of them.

    Two rate windows (a minute against a quarter hour) give a slope whose noise, carried over
    the hours a switch is priced for, is larger than any real trend; a line through an hour of
    buckets is ten times steadier. The bucket still filling is left out (its maximum so far is
    biased low), and so are buckets older than the window.
    """
    pts = [(t, r) for t, r in history if t >= now - window_s and t + bucket_s <= now]
    if len(pts) < max(min_buckets, 2):
        return None
    n = len(pts)
    mt = sum(t for t, _ in pts) / n
    mr = sum(r for _, r in pts) / n
    var = sum((t - mt) ** 2 for t, _ in pts)
    if var <= 0.0:
        return None
    slope = sum((t - mt) * (r - mr) for t, r in pts) / var
    total = sum((r - mr) ** 2 for _, r in pts)
    r2 = 1.0 if total <= 0.0 else min(slope * slope * var / total, 1.0)
    return slope, r2


def trend_is_material(fit: tuple[float, float] | None, rate_rps: float) -> bool:
    """Whether a fitted trend ``(slope, r²)`` forecasts the load: a line that explains most of
    the last hour (r² ≥ TREND_MIN_R2: a spike or a step in it is not a line) and moves the load
    by at least TREND_MIN_CHANGE of it (and TREND_MIN_RPS) within TREND_FIT_S, either way. Then
    the line, not the load's age, says where the load goes (and
    :func:`~controller.switch_cost.gain_horizon` when it undoes the switch)."""
    return _steady_line(fit, max(TREND_MIN_CHANGE * rate_rps, TREND_MIN_RPS))


def _steady_line(fit: tuple[float, float] | None, min_change: float) -> bool:
    """A fitted ``(slope, r²)`` that explains the hour (r² ≥ TREND_MIN_R2) and moves the value
    by at least ``min_change`` within TREND_FIT_S, either way."""
    if fit is None or not math.isfinite(fit[0]):
        return False
    slope, r2 = fit
    return r2 >= TREND_MIN_R2 and abs(slope) * TREND_FIT_S >= min_change


def steady_rise(history: RateHistory, now: float, rate_rps: float) -> float | None:
    """The slope (req/s per second) of a load that has risen along a steady line for the last
    RISE_FIT_S (:func:`trend_is_material` over that window, rising); None otherwise."""
    fit = history_fit(history, now, window_s=RISE_FIT_S, min_buckets=RISE_MIN_BUCKETS)
    if fit is None or fit[0] <= 0.0 or not trend_is_material(fit, rate_rps):
        return None
    return fit[0]


def acceptance_trend(history: RateHistory, now: float) -> float | None:
    """The slope (α per second) of a line through the last hour of measured acceptance that
    explains it (r² ≥ TREND_MIN_R2: a step to a new mix is not a drift) and moves α by at least
    ACCEPTANCE_TREND_MIN within the hour; None otherwise (too few buckets, noise, a step)."""
    fit = history_fit(history, now)
    return fit[0] if _steady_line(fit, ACCEPTANCE_TREND_MIN) else None


def projected_alpha(alpha: float, slope: float, after_s: float) -> float:
    """α ``after_s`` from now along the fitted line, followed for at most TREND_FIT_S (the hour
    that vouches for it) and then held; always a probability."""
    return min(max(alpha + slope * min(max(after_s, 0.0), TREND_FIT_S), 0.0), 1.0)


def rented_gain(gain: float, lasted_s: float, horizon_s: float) -> float:
    """A switch's projected gain over ``horizon_s``, weighted by the chance that the load that
    wants it is still there (it has lasted ``lasted_s``): the gain's rate times
    a·ln(1 + H/a), at most the whole gain (the load's age vouches for nothing beyond it).

    Infinite gains (leaving or entering an overload) are what they are: they need no rent.
    """
    if not math.isfinite(gain) or horizon_s <= 0.0:
        return gain
    if lasted_s <= 0.0:
        return 0.0
    return gain * min(lasted_s / horizon_s * math.log1p(horizon_s / lasted_s), 1.0)


def recent_peak(history: RateHistory, now: float, window_s: float = RECENT_PEAK_S) -> tuple[float, float] | None:
    """``(rate, when)``: the highest rate of the last ``window_s`` (its bucket's start), or None.

    Yesterday says what the same hours bring; the last hour says what an oscillating load or a
    run of spikes brings back. A trough between two peaks looks like a quiet hour to the rate
    windows and to the trend, and SD enabled there is caught by the next peak.
    """
    seen = [(r, t) for t, r in history if now - window_s <= t <= now]
    if not seen:
        return None
    rate, at = max(seen)
    return rate, at


def cycle_rates(
    history: RateHistory, now: float, rate_rps: float, low_rps: float, high_rps: float, window_s: float = CYCLE_WINDOW_S
) -> tuple[float, ...] | None:
    """The last ``window_s``'s bucket rates and the rate now, when the load crossed the band
    ``[low_rps, high_rps]`` three times within them: it came back to a side it had left and
    left it again (an oscillation, a run of spikes). None otherwise: a step crosses once, one
    spike twice, a steady load not at all.

    Such a load is a cycle, not a level: judged at whatever phase it is in now, it restarts vLLM
    at every crest or never, since each crest and each trough is shorter than the excursion
    filter. Rates inside the band (a load at break-even) count for neither side.
    """
    seen = [r for t, r in history if now - window_s <= t <= now] + [rate_rps]
    sides = [r > high_rps for r in seen if r > high_rps or r < low_rps]
    flips = sum(a != b for a, b in itertools.pairwise(sides))
    return tuple(seen) if flips >= CYCLE_MIN_CROSSINGS else None


def _window(history: RateHistory, lo: float, hi: float) -> list[tuple[float, float]]:
    return [(t, r) for t, r in history if lo <= t < hi]


def forecast_peak(
    history: RateHistory, now: float, horizon_s: float, lags_s: Sequence[float] = FORECAST_LAGS_S
) -> float | None:
    """Highest rate seen in the same ``horizon_s`` after this time of day on earlier days.

    None when the history covers none of those windows (a controller younger than a day).
    """
    peaks = [r for lag in lags_s for _, r in _window(history, now - lag, now - lag + horizon_s)]
    return max(peaks) if peaks else None


def forecast_time_to(
    history: RateHistory,
    now: float,
    horizon_s: float,
    rate_rps: float,
    lags_s: Sequence[float] = FORECAST_LAGS_S,
) -> float | None:
    """Seconds until the load is expected to reach ``rate_rps``, by the earliest earlier day
    on which it did within ``horizon_s`` of this time of day; None if none did (or no history)."""
    times = []
    for lag in lags_s:
        hit = next((t for t, r in _window(history, now - lag, now - lag + horizon_s) if r >= rate_rps), None)
        if hit is not None:
            times.append(max(hit - (now - lag), 0.0))
    return min(times) if times else None


def expected_peak(forecast_rps: float | None, configured_rps: float | None) -> float | None:
    """The peak to leave headroom for: the larger of the history's forecast and the operator's."""
    values = [v for v in (forecast_rps, configured_rps) if v is not None]
    return max(values) if values else None


def in_startup_hold(now: float, started_at: float | None, hold_s: float) -> bool:
    """Whether the controller is still in its first ``hold_s`` after start."""
    return started_at is not None and 0.0 <= now - started_at < hold_s
