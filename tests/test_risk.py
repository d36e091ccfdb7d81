"""The risk terms, table-tested over timestamps (controller/risk.py; no clock, no I/O)."""

import math

import pytest

from controller.risk import (
    DAY_S,
    backlog_drain_s,
    excursion_filter_s,
    expected_peak,
    forecast_peak,
    forecast_time_to,
    history_slope,
    in_startup_hold,
    persisted_since,
    record_rate,
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
    got = history_slope(tuple(points), now)
    assert got == (None if expected is None else pytest.approx(expected))
