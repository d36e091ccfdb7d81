"""The model-free safety net (policy.safety_net), table-tested on virtual time like test_policy."""

import dataclasses
import math

import pytest

from controller.policy import Action, Reason, decide, safety_net
from controller.settings import Settings
from tests.support import LEGACY_CALIBRATION
from tests.test_policy import AUTO, T0, assessment, obs, off_state, on_state

S = Settings(calibration_file=LEGACY_CALIBRATION, price_switches=False, safety_net_ticks=3)
PRICED = Settings(calibration_file=LEGACY_CALIBRATION, price_switches=True, switch_margin=2.0, safety_net_ticks=3)
OFF_S = 2.0  # what assessment() predicts for SD off


def run(settings, state, observations, a=None, start=T0, step=60.0):
    """Decide tick after tick; returns [(action, reason)] and the final state."""
    out = []
    for i, o in enumerate(observations):
        d, state = decide(settings, state, o, a or assessment(1.5), AUTO, start + i * step)
        out.append((d.action, d.reason))
    return out, state


def harm(n, latency=2.5, **kw):
    return [obs(t=T0 + 60 * i, mean_e2e_latency_s=latency, **kw) for i in range(n)]


def queue(values):
    return [obs(t=T0 + 60 * i, mean_e2e_latency_s=1.5, waiting=w) for i, w in enumerate(values)]


STEADY = (Action.NONE, Reason.STEADY)


@pytest.mark.parametrize(
    ("name", "settings", "state", "observations", "expected_last"),
    [
        # observed 2.5 s > 1.1 × 2.0 s predicted for SD off, three ticks in a row
        ("harm trips", S, on_state(), harm(3), (Action.DISABLE, Reason.OBSERVED_SD_HARM)),
        ("harm needs N ticks", S, on_state(), harm(2), STEADY),
        ("at the margin is not harm", S, on_state(), harm(3, latency=1.1 * OFF_S), STEADY),
        ("net disabled", S.model_copy(update={"safety_net": False}), on_state(), harm(5), STEADY),
        # the backlog after a restart drains: the settle time does not count (then the dwell holds)
        ("settling", S, on_state(last_change_at=T0 - 60), harm(3), STEADY),
        ("dwell holds", S.model_copy(update={"evidence_settle_s": 0.0}), on_state(last_change_at=T0 - 60),
         harm(3), (Action.NONE, Reason.DWELL)),
        ("queue grows", S, on_state(), queue([1, 2, 4, 7]), (Action.DISABLE, Reason.QUEUE_GROWTH)),
        ("queue flat", S, on_state(), queue([3, 3, 3, 3, 3]), STEADY),
        ("queue empty", S, on_state(), queue([0, 0, 0, 0, 0]), STEADY),
        ("queue wobbles", S, on_state(), queue([1, 2, 1, 2, 3]), STEADY),
        ("no latency measured", S, on_state(), [obs(t=T0 + 60 * i) for i in range(5)], STEADY),
    ],
)  # fmt: skip
def test_safety_net_table(name, settings, state, observations, expected_last):
    decisions, _ = run(settings, state, observations)
    assert decisions[-1] == expected_last, name
    assert all(d[0] is Action.NONE for d in decisions[:-1]), name


def test_sd_off_never_trips_and_keeps_no_counts():
    decisions, state = run(S, off_state(sd_harm_ticks=2, queue_growth_ticks=2, last_waiting=3.0), harm(5, waiting=9))
    assert all(d == (Action.ENABLE, Reason.SPEEDUP_HIGH) for d in decisions)  # the thresholds decide
    assert (state.sd_harm_ticks, state.queue_growth_ticks, state.last_waiting) == (0, 0, None)


def test_a_good_tick_resets_the_harm_count():
    seq = [*harm(2), obs(t=T0 + 120, mean_e2e_latency_s=1.9), *harm(2)]
    decisions, state = run(S, on_state(), seq)
    assert all(d == STEADY for d in decisions)
    assert state.sd_harm_ticks == 2


def test_priced_restart_costing_more_than_staying_holds_and_says_so():
    a = assessment(1.5, gain=-100.0, cost=1e9)
    decisions, _ = run(PRICED, on_state(), harm(3), a=a)
    assert decisions[-1] == (Action.NONE, Reason.SAFETY_NET_HELD)


def test_priced_restart_cheaper_than_staying_acts():
    # staying: 5 req/s × 300 s horizon × 0.5 s excess = 750 req·s > 2 × 100
    a = assessment(1.5, gain=-100.0, cost=100.0)
    decisions, _ = run(PRICED, on_state(), harm(3), a=a)
    assert decisions[-1] == (Action.DISABLE, Reason.OBSERVED_SD_HARM)
    a = assessment(1.5, gain=-100.0, cost=400.0)  # 750 < 2 × 400
    decisions, _ = run(PRICED, on_state(), harm(3), a=a)
    assert decisions[-1] == (Action.NONE, Reason.SAFETY_NET_HELD)


def test_trip_is_remembered_as_congestion_so_the_model_cannot_re_enable_at_once():
    d, state = None, on_state()
    for i, o in enumerate(harm(3)):
        d, state = decide(S, state, o, assessment(1.5), AUTO, T0 + 60 * i)
    assert d.action is Action.DISABLE and d.desired_enabled is False
    assert state.sd_congested_rate_rps == 5.0 and state.sd_congested_at == T0 + 120
    assert "observed 2.50s > 1.1× predicted SD-off 2.00s" in d.detail


def test_queue_growth_prices_the_growing_queue():
    state = on_state()
    trips = []
    for i, w in enumerate([2, 4, 6, 8]):
        state, trip = safety_net(S, state, queue([w])[0], assessment(1.5), T0 + 60 * i)
        trips.append(trip)
    assert trips[:3] == [None, None, None]
    trip = trips[3]
    assert trip.reason is Reason.QUEUE_GROWTH
    # 8 waiting over a 300 s horizon + the growth (6 requests in 180 s) as a triangle
    assert trip.stay_cost_request_s == pytest.approx(8 * 300 + 0.5 * (6 / 180) * 300**2)


def test_overloaded_off_prediction_is_never_harm():
    a = assessment(1.5)
    a = a.__class__(**{**a.__dict__, "latency_off_s": math.inf})
    decisions, _ = run(S, on_state(), harm(5, latency=100.0), a=a)
    assert all(d == STEADY for d in decisions)


def test_acceptance_floor_still_wins_over_the_net():
    s = S.model_copy(update={"acceptance_floor_window_s": 60.0})
    a = assessment(1.5, acc=0.1)
    decisions, _ = run(s, on_state(), harm(3), a=a)
    assert decisions[-1] == (Action.DISABLE, Reason.ACCEPTANCE_FLOOR)


def test_safety_net_waits_out_an_excursion_shorter_than_a_restart():
    import dataclasses

    a = dataclasses.replace(assessment(1.5, gain=1e9, cost=1.0), excursion_filter_s=240.0)
    fast = PRICED.model_copy(update={"evaluation_interval_s": 60.0})
    decisions, _ = run(fast, on_state(), harm(3), a=a)  # 3 ticks = 180 s of harm < 240 s
    assert decisions[-1] == (Action.NONE, Reason.EXCURSION)
    decisions, _ = run(fast, on_state(), harm(4), a=a)  # 240 s: it has outlasted a restart
    assert decisions[-1] == (Action.DISABLE, Reason.OBSERVED_SD_HARM)


@pytest.mark.parametrize(
    ("forecast", "cost", "expected"),
    [
        # staying: 750 req·s over the 300 s horizon; the harm has held 180 s, which vouches for
        # 750 × 180/300 × ln(1 + 300/180) = 441 of it
        (True, 300.0, (Action.DISABLE, Reason.OBSERVED_SD_HARM)),  # forecast: 750 > 2 × 300
        (False, 300.0, (Action.NONE, Reason.NOT_LASTED)),  # unforecast: 441 < 2 × 300
        (False, 200.0, (Action.DISABLE, Reason.OBSERVED_SD_HARM)),  # 441 > 2 × 200
    ],
)
def test_unforecast_harm_must_have_cost_its_restart_before_it_acts(forecast, cost, expected):
    a = dataclasses.replace(assessment(1.5, gain=-100.0, cost=cost), horizon_forecast=forecast)
    decisions, _ = run(PRICED, on_state(), harm(3), a=a)
    assert decisions[-1] == expected


def test_a_growing_queue_needs_no_forecast():
    a = dataclasses.replace(assessment(1.5, gain=-100.0, cost=10.0), horizon_forecast=False)
    decisions, _ = run(PRICED, on_state(), queue([2, 4, 6, 8]), a=a)
    assert decisions[-1] == (Action.DISABLE, Reason.QUEUE_GROWTH)


@pytest.mark.parametrize("forecast", [True, False])
def test_a_net_that_does_not_insist_leaves_the_decision_to_the_model(forecast):
    """The net holds (staying 750 req·s < 2 × 1000, or a young unforecast harm), but the model
    itself predicts SD overloaded (its gain +inf): the model's rule disables. A hold never
    blocks a switch the model's own price makes."""
    a = dataclasses.replace(
        assessment(0.0, gain=math.inf, cost=1000.0), horizon_forecast=forecast, excursion_filter_s=60.0
    )
    state = on_state(switch_wanted_since=T0 - 3600, switch_wanted_enabled=False)
    decisions, _ = run(PRICED, state, harm(3), a=a)
    assert decisions[-1] == (Action.DISABLE, Reason.SPEEDUP_LOW)


def test_the_nets_hold_is_reported_with_the_models_reason():
    a = assessment(1.5, gain=-100.0, cost=1e9)
    d = None
    state = on_state()
    for i, o in enumerate(harm(3)):
        d, state = decide(PRICED, state, o, a, AUTO, T0 + 60 * i)
    assert d.reason is Reason.SAFETY_NET_HELD
    assert "staying costs" in d.detail and "model: within_thresholds" in d.detail
