"""The risk terms, table-tested over timestamps (controller/risk.py; no clock, no I/O)."""

import itertools
import math

import pytest

from controller.risk import (
    ACCEPTANCE_KEEP_S,
    DAY_S,
    acceptance_trend,
    backlog_drain_s,
    cycle_rates,
    excursion_filter_s,
    expected_peak,
    forecast_peak,
    forecast_time_to,
    history_fit,
    in_startup_hold,
    overload_predates_history,
    persisted_since,
    projected_alpha,
    record_acceptance,
    record_rate,
    rented_gain,
    steady_rise,
    trend_is_material,
)

T0 = 1_800_000_000.0


@pytest.mark.parametrize(
    ("downtime", "drain", "configured", "expected"),
    [(75.0, 30.0, None, 105.0), (75.0, 30.0, 0.0, 0.0), (75.0, 30.0, 240.0, 240.0), (-1.0, 30.0, None, 30.0)],
)
def test_excursion_filter(downtime, drain, configured, expected):
    assert excursion_filter_s(downtime, drain, configured) == expected


@pytest.mark.parametrize(
    ("since", "since_dir", "want", "now", "expected"),
    [
        (None, None, True, T0, (T0, True)),  # a new signal starts now
        (T0 - 50, True, True, T0, (T0 - 50, True)),  # the same signal keeps its start
        (T0 - 50, True, False, T0, (T0, False)),  # a reversed signal starts over
        (T0 - 50, True, None, T0, (None, None)),  # no signal: forgotten
        (T0 + 50, True, True, T0, (T0, True)),  # a start in the future (clock stepped back): now
    ],
)
def test_persisted_since(since, since_dir, want, now, expected):
    assert persisted_since(since, since_dir, want, now) == expected


@pytest.mark.parametrize(
    ("since", "since_dir", "want", "holding", "expected"),
    [
        (T0 - 50, False, None, True, (T0 - 50, False)),  # lapsed inside the band: the clock runs on
        (T0 - 50, False, None, False, (None, None)),  # lapsed past the band's middle: forgotten
        (None, None, None, True, (None, None)),  # nothing to hold
        (T0 - 50, False, True, True, (T0, True)),  # reversed: starts over, holding or not
        (T0 + 50, False, None, True, (None, None)),  # a start in the future is not held
    ],
)
def test_persisted_since_holds_a_signal_that_lapses_inside_the_band(since, since_dir, want, holding, expected):
    assert persisted_since(since, since_dir, want, T0, holding=holding) == expected


def test_record_rate_keeps_the_bucket_maximum_and_drops_old_buckets():
    h = ()
    for t, r in [(0, 1.0), (100, 3.0), (299, 2.0), (300, 5.0), (900, 4.0)]:
        h = record_rate(h, T0 + t, r, 300.0, 10_000.0)
    start = math.floor(T0 / 300) * 300
    assert h == ((start, 3.0), (start + 300, 5.0), (start + 900, 4.0))
    h = record_rate(h, T0 + 20_000, 1.0, 300.0, 10_000.0)
    assert [t for t, _ in h] == [math.floor((T0 + 20_000) / 300) * 300]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_record_rate_ignores_unusable_rates(bad):
    assert record_rate(((T0, 1.0),), T0 + 300, bad, 300.0, 1e6) == ((T0, 1.0),)


def test_record_rate_ignores_a_clock_stepping_back():
    h = ((T0, 1.0),)
    assert record_rate(h, T0 - 600, 9.0, 300.0, 1e6) == h


def test_record_rate_is_bounded():
    h = ()
    for i in range(5000):
        h = record_rate(h, T0 + 300 * i, 1.0, 300.0, 8 * DAY_S)
    assert len(h) <= 8 * DAY_S / 300 + 1


def day_history(peak_at_s: float, peak_rps: float, base_rps: float = 1.0):
    """Yesterday: base load, with one bucket at the peak ``peak_at_s`` after this time of day."""
    return tuple((T0 - DAY_S + t, peak_rps if t == peak_at_s else base_rps) for t in range(0, 6 * 3600, 300))


@pytest.mark.parametrize(
    ("peak_at", "horizon", "expected"),
    [(3600, 4 * 3600, 12.0), (3600, 1800, 1.0), (5 * 3600, 4 * 3600, 1.0)],
)
def test_forecast_peak_reads_the_same_hours_yesterday(peak_at, horizon, expected):
    assert forecast_peak(day_history(peak_at, 12.0), T0, horizon) == expected


def test_forecast_without_history_says_none():
    assert forecast_peak((), T0, 3600) is None
    assert forecast_time_to((), T0, 3600, 5.0) is None
    recent = ((T0 - 600, 50.0),)  # only the last minutes: not the same hours of an earlier day
    assert forecast_peak(recent, T0, 3600) is None


def test_forecast_reads_the_same_weekday_last_week_too():
    last_week = ((T0 - 7 * DAY_S + 1200, 20.0),)
    assert forecast_peak(last_week, T0, 3600) == 20.0
    assert forecast_time_to(last_week, T0, 3600, 15.0) == 1200.0


def test_forecast_time_to_takes_the_earliest_day():
    h = ((T0 - 7 * DAY_S + 600, 20.0), (T0 - DAY_S + 2400, 20.0))
    assert forecast_time_to(h, T0, 4 * 3600, 10.0) == 600.0
    assert forecast_time_to(h, T0, 4 * 3600, 30.0) is None


@pytest.mark.parametrize(
    ("forecast", "configured", "expected"), [(None, None, None), (5.0, None, 5.0), (None, 7.0, 7.0), (5.0, 7.0, 7.0)]
)
def test_expected_peak(forecast, configured, expected):
    assert expected_peak(forecast, configured) == expected


@pytest.mark.parametrize(
    ("now", "started", "expected"), [(T0, None, False), (T0, T0, True), (T0 + 599, T0, True), (T0 + 600, T0, False)]
)
def test_startup_hold(now, started, expected):
    assert in_startup_hold(now, started, 600.0) is expected


@pytest.mark.parametrize(
    ("rate", "downtime", "capacity", "expected"),
    [(10.0, 75.0, 15.0, 150.0), (14.8, 75.0, 15.2, 2775.0), (15.0, 75.0, 15.0, math.inf), (0.0, 75.0, 5.0, 0.0)],
)
def test_backlog_drain(rate, downtime, capacity, expected):
    assert backlog_drain_s(rate, downtime, capacity) == pytest.approx(expected)


def test_the_filter_waits_for_the_backlog_near_capacity_and_is_capped():
    # Near capacity the recovery (75 s down + 30 s drain + 2775 s of backlog) outlasts a 30-minute spike.
    assert excursion_filter_s(75.0, 30.0, None, backlog_drain_s(14.8, 75.0, 15.2), 3600.0) == pytest.approx(2880.0)
    assert excursion_filter_s(75.0, 30.0, None, math.inf, 3600.0) == 3600.0
    assert excursion_filter_s(75.0, 30.0, 10.0, math.inf, 3600.0) == 10.0  # the operator's value wins


@pytest.mark.parametrize(
    ("points", "now", "expected"),
    [
        ([(k * 300.0, 2.0 + k) for k in range(12)], 3600.0, 1.0 / 300.0),  # +1 req/s per bucket
        ([(k * 300.0, 5.0) for k in range(12)], 3600.0, 0.0),  # flat
        ([(k * 300.0, 2.0 + k) for k in range(5)], 1500.0, None),  # too few complete buckets
        # the bucket still filling (its max so far biased low) is left out: the line stays exact
        ([(k * 300.0, 2.0 + k) for k in range(12)] + [(3600.0, 0.0)], 3700.0, 1.0 / 300.0),
        ([(k * 300.0, 2.0 + k) for k in range(24)], 7200.0, 1.0 / 300.0),  # only the last hour
        ([], 3600.0, None),
    ],
)
def test_history_slope_fits_the_last_hour_of_complete_buckets(points, now, expected):
    fit = history_fit(tuple(points), now)
    got = None if fit is None else fit[0]
    assert got == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize(
    ("points", "rate", "material"),
    [
        ([(k * 300.0, 2.0 + 0.2 * k) for k in range(12)], 4.0, True),  # +2.4 req/s an hour, a clean line
        ([(k * 300.0, 8.0 + 0.05 * k) for k in range(12)], 8.5, False),  # +0.6 an hour: under 10 % of 8.5
        ([(k * 300.0, 1.0 + 0.05 * k) for k in range(12)], 1.5, True),  # +0.6: over the 0.5 req/s floor
        # a 10-minute spike in an otherwise flat hour tilts the line, but no line explains it
        ([(k * 300.0, 14.8 if k in (4, 5) else 3.0) for k in range(12)], 3.0, False),
        ([(k * 300.0, 12.0 - 0.3 * k) for k in range(12)], 9.0, True),  # falling counts as well
        ([(k * 300.0, 5.0) for k in range(12)], 5.0, False),  # flat
        ([(k * 300.0, 2.0 + k) for k in range(4)], 5.0, False),  # no fit yet
    ],
)
def test_a_trend_forecasts_the_load_only_if_it_is_a_steady_line_that_moves_it(points, rate, material):
    assert trend_is_material(history_fit(tuple(points), 3600.0), rate) is material


def test_history_fit_says_how_much_of_the_hour_the_line_explains():
    line = history_fit(tuple((k * 300.0, 2.0 + k) for k in range(12)), 3600.0)
    assert line == (pytest.approx(1.0 / 300.0), pytest.approx(1.0))
    step = history_fit(tuple((k * 300.0, 2.0 if k < 6 else 12.0) for k in range(12)), 3600.0)
    assert step[0] > 0 and 0.5 < step[1] < 0.8  # a step in mid-hour: a slope, a poor line


@pytest.mark.parametrize(
    ("gain", "lasted", "horizon", "expected"),
    [
        (1000.0, 3600.0, 3600.0, 1000.0 * math.log(2.0)),  # an hour old: P(still there) = 1/(1 + T/1h)
        (1000.0, 360.0, 14400.0, 1000.0 * 360.0 / 14400.0 * math.log(41.0)),  # six minutes vouch for 9 %
        (1000.0, 1e9, 3600.0, pytest.approx(1000.0, rel=1e-5)),  # an age far beyond the horizon: nearly all
        (1000.0, 0.0, 3600.0, 0.0),  # a load that just appeared vouches for nothing
        (-500.0, 3600.0, 3600.0, -500.0 * math.log(2.0)),  # a loss is weighed the same way
        (math.inf, 10.0, 3600.0, math.inf),  # leaving an overload needs no rent
        (-math.inf, 10.0, 3600.0, -math.inf),
    ],
)
def test_rented_gain_weighs_the_gain_by_the_chance_the_load_is_still_there(gain, lasted, horizon, expected):
    assert rented_gain(gain, lasted, horizon) == pytest.approx(expected)


def test_rented_gain_grows_with_the_load_age_and_never_passes_the_whole_gain():
    ages = [60.0 * k for k in range(1, 600)]
    got = [rented_gain(1000.0, a, 7200.0) for a in ages]
    assert all(b >= a for a, b in itertools.pairwise(got))
    assert max(got) <= 1000.0


@pytest.mark.parametrize(
    ("points", "rate", "expected"),
    [
        ([(k * 300.0, 2.0 + 0.1 * k) for k in range(24)], 4.4, 0.1 / 300.0),  # +1.2 req/s an hour for 2 h
        ([(k * 300.0, 2.0 + 0.1 * k) for k in range(12)], 3.2, None),  # only an hour of it: too young
        ([(k * 300.0, 2.0 if k < 12 else 6.0) for k in range(24)], 6.0, None),  # a step: a poor line
        ([(k * 300.0, 8.0 - 0.2 * k) for k in range(24)], 3.2, None),  # falling
        ([(k * 300.0, 5.0 + (0.3 if k % 2 else -0.3)) for k in range(24)], 5.0, None),  # flat noise
        # a steady line with noise on it still counts
        ([(k * 300.0, 2.0 + 0.1 * k + (0.15 if k % 2 else -0.15)) for k in range(24)], 4.4, 0.1 / 300.0),
    ],
)
def test_a_rise_to_anticipate_is_a_steady_line_through_two_hours(points, rate, expected):
    got = steady_rise(tuple(points), 7200.0, rate)
    assert got == (None if expected is None else pytest.approx(expected, rel=0.05))


def _buckets(rates: list[float]) -> tuple[tuple[float, float], ...]:
    """5-minute buckets ending now, oldest first."""
    return tuple((T0 - 300.0 * (len(rates) - k), r) for k, r in enumerate(rates))


@pytest.mark.parametrize(
    ("rates", "now_rps", "cycle"),
    [
        ([3, 3, 3, 13, 13, 13, 13, 13], 13.0, False),  # a step up: one crossing
        ([13, 13, 13, 3, 3, 3, 3, 3], 3.0, False),  # a step down: one crossing
        ([3, 3, 13, 13, 3, 3, 3, 3], 3.0, False),  # one spike: two crossings
        ([3, 13, 13, 3, 3, 13, 3, 3], 3.0, True),  # a run of spikes: it came back
        ([13, 8, 3, 8, 13, 8, 3, 5], 5.0, True),  # an oscillation through the band
        ([3, 8, 3, 8, 3, 8, 3, 8], 8.0, False),  # rates inside the band count for neither side
        ([8, 8, 8, 8, 8, 8, 8, 8], 8.0, False),  # a steady load at break-even
    ],
)
def test_a_load_is_a_cycle_once_it_crossed_the_break_even_band_three_times(rates, now_rps, cycle):
    got = cycle_rates(_buckets(rates), T0, now_rps, low_rps=6.0, high_rps=9.0)
    assert (got is not None) is cycle
    if cycle:
        assert got == (*map(float, rates), now_rps)  # the window's rates and the rate now


def test_a_cycle_is_read_within_its_window_only():
    """The same spikes, the first of them older than the window: two crossings left."""
    history = _buckets([3, 13, 13, 3, 3, 13, 3, 3])
    assert cycle_rates(history, T0, 3.0, 6.0, 9.0, window_s=8 * 300.0) is not None
    assert cycle_rates(history, T0, 3.0, 6.0, 9.0, window_s=5 * 300.0) is None


def test_record_acceptance_keeps_the_bucket_latest_and_only_the_last_hour():
    h = ()
    for t, a in [(0, 0.70), (100, 0.72), (299, 0.69), (300, 0.65)]:
        h = record_acceptance(h, T0 + t, a)
    start = math.floor(T0 / 300) * 300
    assert h == ((start, 0.69), (start + 300, 0.65))  # the source's window already averages
    for i in range(100):
        h = record_acceptance(h, T0 + 600 + 300 * i, 0.6)
    assert len(h) <= ACCEPTANCE_KEEP_S / 300 + 1


@pytest.mark.parametrize("bad", [math.nan, -0.1, 1.5, math.inf])
def test_record_acceptance_ignores_what_is_not_a_probability(bad):
    assert record_acceptance(((T0, 0.6),), T0 + 300, bad) == ((T0, 0.6),)


@pytest.mark.parametrize(
    ("alphas", "expected"),
    [
        ([0.80 - 0.02 * k for k in range(12)], -0.02 / 300.0),  # −0.24 an hour along a clean line
        ([0.60 + 0.01 * k for k in range(12)], 0.01 / 300.0),  # rising counts as well
        ([0.70 - 0.003 * k for k in range(12)], None),  # −0.036 an hour: a steady mix's wander
        ([0.70 + (0.01 if k % 2 else -0.01) for k in range(12)], None),  # noise, no line
        ([0.80 if k < 6 else 0.50 for k in range(12)], None),  # a step to a new mix is not a drift
        ([0.80 - 0.02 * k for k in range(5)], None),  # too few buckets
        # a clean line with a measured wander on it still counts
        ([0.80 - 0.02 * k + (0.005 if k % 2 else -0.005) for k in range(12)], -0.02 / 300.0),
    ],
)
def test_an_acceptance_trend_is_a_steady_line_that_moves_alpha(alphas, expected):
    got = acceptance_trend(_buckets(alphas), T0)
    assert got == (None if expected is None else pytest.approx(expected, rel=0.05))


@pytest.mark.parametrize(
    ("alpha", "slope", "after", "expected"),
    [
        (0.6, -0.2 / 3600, 1800.0, 0.5),  # along the line
        (0.6, -0.2 / 3600, 3600.0, 0.4),
        (0.6, -0.2 / 3600, 4 * 3600.0, 0.4),  # the hour that vouches for it, then held
        (0.1, -0.2 / 3600, 3600.0, 0.0),  # never below 0
        (0.9, 0.2 / 3600, 3600.0, 1.0),  # nor above 1
        (0.6, -0.2 / 3600, -60.0, 0.6),  # nothing before now
    ],
)
def test_projected_alpha_follows_the_line_for_an_hour_and_stays_a_probability(alpha, slope, after, expected):
    assert projected_alpha(alpha, slope, after) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("rates", "predates"),
    [
        ([14.8, 15.1, 14.9], True),  # overloaded in every bucket the controller has seen: a launch into it
        ([3.0, 3.0, 14.8, 15.1], False),  # seen arriving from below: a surge, an excursion
        ([14.8, 13.0, 14.9], False),  # it dipped below once: it came and went
        ([], False),  # nothing seen yet says nothing
    ],
)
def test_an_overload_predates_the_history_only_if_every_bucket_held_it(rates, predates):
    assert overload_predates_history(_buckets(rates), 14.0) is predates
