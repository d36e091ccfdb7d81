"""From observation to assessment: acceptance source, workload memory, projection, pricing."""

import dataclasses
import math

import pytest

from controller.acceptance import alpha_from_vllm_rate, vllm_rate_from_alpha
from controller.assessment import AcceptanceSource, assess, estimate_acceptance
from controller.calibration import load
from controller.model import Workload, predict_point
from controller.observation import Observation
from controller.risk import history_fit, trend_is_material
from controller.settings import Settings
from controller.sim.demo_truth import truth_calibration_path
from controller.state import ControllerState
from tests.support import LEGACY_CALIBRATION

MODEL = load(LEGACY_CALIBRATION).latency_model()
S = Settings(calibration_file=LEGACY_CALIBRATION)
S0 = S.model_copy(update={"acceptance_prior_sd": 0.0})  # an unmeasured acceptance taken as the prior
T = 1_000_000.0


def test_acceptance_measured_last_prior():
    measured = estimate_acceptance(
        Observation(T, 1.0, acceptance_rate=0.6, mean_draft_tokens=4.0), ControllerState(), S, 4, T
    )
    assert measured.source is AcceptanceSource.MEASURED
    assert measured.alpha == pytest.approx(float(alpha_from_vllm_rate(0.6, 4)))
    state = ControllerState(last_acceptance_rate=0.5, last_alpha=0.7, last_acceptance_at=T - 100)
    last = estimate_acceptance(Observation(T, 1.0), state, S, 4, T)
    assert (last.source, last.alpha, last.age_s) == (AcceptanceSource.LAST, 0.7, 100)
    old = estimate_acceptance(Observation(T, 1.0), state, S, 4, T + S.acceptance_max_age_s + 1)
    # Nothing measured: the prior at the end of its spread that argues against enabling.
    assert old.source is AcceptanceSource.PRIOR
    assert old.rate == pytest.approx(S.acceptance_prior - S.enable_posterior_z * S.acceptance_prior_sd)
    assert old.alpha == pytest.approx(float(alpha_from_vllm_rate(old.rate, 4)))
    exact = S.model_copy(update={"acceptance_prior_sd": 0.0})
    assert estimate_acceptance(Observation(T, 1.0), ControllerState(), exact, 4, T).rate == exact.acceptance_prior
    guess = S.model_copy(update={"acceptance_prior": 0.1, "acceptance_prior_sd": 0.5})
    assert estimate_acceptance(Observation(T, 1.0), ControllerState(), guess, 4, T).rate == 0.0  # never below 0


def test_an_unmeasured_acceptance_does_not_talk_the_controller_into_enabling():
    # Launched with SD off, nothing has measured the drafts: the prior's pessimistic end prices
    # the enable. With the prior taken as is (sd 0), the same quiet load looks like a clear win.
    from controller.assessment import assess

    obs = Observation(T, 2.0, mean_prompt_tokens=900.0, mean_gen_tokens=280.0)
    as_is = assess(
        MODEL, S.model_copy(update={"acceptance_prior_sd": 0.0}).policy, ControllerState(), obs, False, None, T
    )
    careful = assess(MODEL, S.policy, ControllerState(), obs, False, None, T)
    assert careful.acceptance.rate < as_is.acceptance.rate
    assert careful.predicted_speedup < as_is.predicted_speedup
    assert careful.projected_gain_request_s < as_is.projected_gain_request_s


def test_ngram_short_drafts_use_the_mean_drafted():
    # n-gram proposed 2.8 tokens per draft on average (the real capture: 360/128).
    e = estimate_acceptance(Observation(T, 1.0, acceptance_rate=0.6, mean_draft_tokens=2.8), ControllerState(), S, 4, T)
    assert e.alpha == pytest.approx(float(alpha_from_vllm_rate(0.6, 2.8)))


def test_positions_win_when_consistent_and_are_ignored_when_not():
    consistent = Observation(
        T, 1.0, acceptance_rate=0.5, mean_draft_tokens=4.0, position_acceptance=(0.8, 0.6, 0.4, 0.2)
    )
    assert estimate_acceptance(consistent, ControllerState(), S, 4, T).accepted_length == pytest.approx(3.0)
    broken = Observation(T, 1.0, acceptance_rate=0.5, mean_draft_tokens=4.0, position_acceptance=(0.0, 0.0, 0.0, 0.0))
    assert estimate_acceptance(broken, ControllerState(), S, 4, T).accepted_length is None


def test_assessment_matches_the_model_and_remembers_workload():
    obs = Observation(T, 4.0, acceptance_rate=0.6, mean_draft_tokens=4.0)  # no token means measured
    state = ControllerState(
        applied_enabled=True, applied_draft_length=4, last_prompt_tokens=300.0, last_gen_tokens=120.0
    )
    a = assess(MODEL, S, state, obs, True, 4, T)
    assert a.workload == Workload(300.0, 120.0)
    p = predict_point(MODEL, 4.0, a.acceptance.alpha, 4, Workload(300.0, 120.0))
    assert a.predicted_speedup == pytest.approx(p.speedup)
    assert a.batch_on == pytest.approx(p.batch_on)
    assert a.switch_cost_request_s > 0 and a.gain_horizon_s == S.gain_horizon_max_s  # no trend: it lasts


def test_rising_trend_projects_higher_and_shortens_sd_gain():
    flat = Observation(T, 10.0, arrival_rate_long_rps=10.0, acceptance_rate=0.6, mean_draft_tokens=4.0)
    rising = Observation(T, 10.0, arrival_rate_long_rps=6.0, acceptance_rate=0.6, mean_draft_tokens=4.0)
    off = ControllerState(applied_enabled=False)
    a_flat = assess(MODEL, S, off, flat, False, None, T)
    a_rise = assess(MODEL, S, off, rising, False, None, T)
    assert a_rise.projected_rate_rps > a_flat.projected_rate_rps == 10.0
    assert a_rise.decision_speedup < a_flat.decision_speedup
    assert a_rise.gain_horizon_s < a_flat.gain_horizon_s
    # A falling trend is not believed for the decision rate (conservative toward SD overload).
    falling = Observation(T, 10.0, arrival_rate_long_rps=14.0, acceptance_rate=0.6, mean_draft_tokens=4.0)
    assert assess(MODEL, S, off, falling, False, None, T).projected_rate_rps == 10.0


def _history(start_rps: float, slope_rps_per_h: float, hours: float = 1.0) -> tuple[tuple[float, float], ...]:
    """Complete 5-minute buckets of the last ``hours`` on a straight line ending now."""
    n = int(hours * 12)
    return tuple((T - (n - k) * 300.0, start_rps + slope_rps_per_h * (k - n) / 12.0) for k in range(n))


@pytest.mark.parametrize(("slope", "more"), [(2.0, True), (-2.0, False)])
def test_a_fitted_trend_carries_the_gain_of_disabling_along_the_load_line(slope, more):
    """SD on at 9 req/s: if the last hour rose 2 req/s per hour, staying gets worse by the hour,
    so switching off now gains more than the flat load says; a falling hour gains less."""
    model = load(truth_calibration_path()).latency_model()  # SD breaks even near 8 req/s here
    obs = Observation(
        T, 9.0, arrival_rate_long_rps=9.0, acceptance_rate=0.38, mean_draft_tokens=4.0,
        mean_prompt_tokens=1000.0, mean_gen_tokens=280.0,
    )  # fmt: skip
    flat = ControllerState(applied_enabled=True, applied_draft_length=4, rate_history=_history(9.0, 0.0))
    trend = ControllerState(applied_enabled=True, applied_draft_length=4, rate_history=_history(9.0, slope))
    g_flat = assess(model, S, flat, obs, True, 4, T).projected_gain_request_s
    g_trend = assess(model, S, trend, obs, True, 4, T).projected_gain_request_s
    assert g_flat > 0  # SD loses at 9 req/s: switching off gains
    assert (g_trend > g_flat) is more
    assert g_trend != g_flat


def test_a_line_that_explains_little_of_the_hour_does_not_carry_the_gain():
    """A rise of 2 req/s an hour under its buckets' noise (±0.5 req/s, r² well under 0.8)
    forecasts nothing: the gain is the flat load's, not the line's over four hours. (The noise
    stays above where SD gains 20 %, 6.4 req/s here: a load that crosses SD's break-even band
    back and forth is a cycle, judged by the cycle.)"""
    model = load(truth_calibration_path()).latency_model()
    obs = Observation(
        T, 9.0, arrival_rate_long_rps=9.0, acceptance_rate=0.38, mean_draft_tokens=4.0,
        mean_prompt_tokens=1000.0, mean_gen_tokens=280.0,
    )  # fmt: skip
    line = _history(9.0, 2.0)
    noisy = tuple((t, r + (0.5 if k % 2 else -0.5)) for k, (t, r) in enumerate(line))
    fit = history_fit(noisy, T)
    assert fit is not None and fit[0] > 0 and not trend_is_material(fit, 9.0)
    flat = ControllerState(applied_enabled=True, applied_draft_length=4, rate_history=_history(9.0, 0.0))
    shaky = ControllerState(applied_enabled=True, applied_draft_length=4, rate_history=noisy)
    g_flat = assess(model, S, flat, obs, True, 4, T).projected_gain_request_s
    a = assess(model, S, shaky, obs, True, 4, T)
    assert not a.cycling
    assert a.projected_gain_request_s == pytest.approx(g_flat)
    # The clean line with the same slope does move it (the previous test's rule).
    g_line = assess(
        model, S, ControllerState(applied_enabled=True, applied_draft_length=4, rate_history=line), obs, True, 4, T
    )
    assert g_line.projected_gain_request_s != pytest.approx(g_flat)


def test_single_replica_restart_near_saturation_costs_more_than_it_gains():
    obs = Observation(T, 14.0, acceptance_rate=0.6, mean_draft_tokens=4.0)
    on = ControllerState(applied_enabled=True, applied_draft_length=4)
    single = assess(MODEL, S, on, obs, True, 4, T)
    fleet = assess(MODEL, Settings(calibration_file=LEGACY_CALIBRATION, replicas=4), on, obs, True, 4, T)
    assert fleet.switch_cost_request_s < single.switch_cost_request_s


def test_near_the_limit_a_state_counts_as_overloaded_when_pricing():
    # A rate just below SD's limit and above the headroom's fraction of plain decoding's (SD's
    # limit within 2 % of it: long answers): both count as overloaded, so the larger capacity
    # (SD off) wins, whatever the cost.
    from controller.acceptance import alpha_from_vllm_rate
    from controller.model import Workload, stability_limits

    lim_off, lim_on = stability_limits(MODEL, float(alpha_from_vllm_rate(0.7, 4)), 4, Workload(512, 512))
    headroom = S.capacity_headroom
    rate = 0.5 * (max(headroom * lim_off, headroom * lim_on) + lim_on)
    assert headroom * lim_off < rate < lim_on < lim_off
    obs = Observation(T, rate, acceptance_rate=0.7, mean_draft_tokens=4.0, mean_prompt_tokens=512, mean_gen_tokens=512)
    on = ControllerState(applied_enabled=True, applied_draft_length=4)
    a = assess(MODEL, S, on, obs, True, 4, T)
    assert a.projected_gain_request_s == float("inf")
    relaxed = assess(MODEL, Settings(calibration_file=LEGACY_CALIBRATION, capacity_headroom=1.0), on, obs, True, 4, T)
    # Without the headroom the states are priced by the model (finite; its queueing term already
    # makes SD this close to its limit expensive).
    assert relaxed.projected_gain_request_s < float("inf")


def test_full_batch_with_a_queue_is_congested_whatever_the_fluid_model_says():
    # 8 req/s is comfortable for SD by the model, but the server reports a full batch and a
    # queue (the backlog after a restart pushed it onto the congested branch).
    obs = Observation(T, 8.0, acceptance_rate=0.6, mean_draft_tokens=4.0, running=256.0, waiting=40.0)
    on = ControllerState(applied_enabled=True, applied_draft_length=4)
    a = assess(MODEL, S, on, obs, True, 4, T)
    assert a.congested and a.decision_speedup == 0.0 and a.projected_gain_request_s == float("inf")
    calm = assess(
        MODEL,
        S,
        on,
        Observation(T, 8.0, acceptance_rate=0.6, mean_draft_tokens=4.0, running=20.0, waiting=0.0),
        True,
        4,
        T,
    )
    assert not calm.congested and calm.decision_speedup > 1.2


@pytest.mark.parametrize(("last_waiting", "congested"), [(None, True), (0.0, False), (3.0, True)])
def test_a_full_batch_counts_as_congested_once_its_queue_held_two_ticks(last_waiting, congested):
    """Near its limit a stable load fills the batch for a minute now and then; that minute must
    not make leaving SD worth any restart. The last tick's queue (kept with SD on) must agree."""
    obs = Observation(T, 8.0, acceptance_rate=0.6, mean_draft_tokens=4.0, running=256.0, waiting=18.0)
    on = ControllerState(applied_enabled=True, applied_draft_length=4, last_waiting=last_waiting)
    a = assess(MODEL, S, on, obs, True, 4, T)
    assert a.congested is congested
    assert (a.projected_gain_request_s == float("inf")) is congested


def _near_sd_limit(long_share: float) -> tuple[Observation, float]:
    from controller.model import stability_limits

    _, lim_on = stability_limits(MODEL, float(alpha_from_vllm_rate(0.6, 4)), 4, Workload(512, 256))
    obs = Observation(
        T,
        0.93 * lim_on,
        arrival_rate_long_rps=long_share * lim_on,
        arrival_rate_peak_rps=1.02 * lim_on,  # the quarter hour's busiest minute, past the limit
        acceptance_rate=0.6,
        mean_draft_tokens=4.0,
        mean_prompt_tokens=512,
        mean_gen_tokens=256,
    )
    return obs, lim_on


@pytest.mark.parametrize(("long_share", "overloaded"), [(0.93, False), (0.995, True)])
def test_leaving_sd_is_an_overload_only_when_the_lasting_load_is_past_the_headroom(long_share, overloaded):
    """The busiest minute of a steady load near SD's limit passes it now and then: leaving SD is
    then priced (finite), and held to the load's age, until the quarter hour's rate says so."""
    obs, lim_on = _near_sd_limit(long_share)
    on = ControllerState(applied_enabled=True, applied_draft_length=4)
    a = assess(MODEL, S, on, obs, True, 4, T)
    assert a.projected_rate_rps == pytest.approx(1.02 * lim_on)  # the speedup still reads the peak
    assert a.decision_speedup < S.disable_threshold
    assert (a.projected_gain_request_s == float("inf")) is overloaded
    assert overloaded or math.isfinite(a.projected_gain_request_s)


def test_a_minute_that_overloads_both_states_leaves_the_lasting_load_to_price_the_switch():
    """The busiest minute past both limits says nothing of which state to run: without the
    lasting load "the larger capacity wins" made leaving a stable SD worth any restart."""
    from controller.model import stability_limits

    lim_off, lim_on = stability_limits(MODEL, float(alpha_from_vllm_rate(0.6, 4)), 4, Workload(512, 256))
    obs, _ = _near_sd_limit(0.93)
    obs = dataclasses.replace(obs, arrival_rate_peak_rps=1.02 * max(lim_on, lim_off))
    a = assess(MODEL, S, ControllerState(applied_enabled=True, applied_draft_length=4), obs, True, 4, T)
    assert a.projected_rate_rps == pytest.approx(1.02 * max(lim_on, lim_off))
    assert math.isfinite(a.projected_gain_request_s)


@pytest.mark.parametrize(("last_rise", "overloaded"), [(None, False), (0.5, False), (1.1, True)])
def test_a_rise_overloads_the_applied_state_only_when_two_ticks_saw_it(last_rise, overloaded):
    """A minute 3 σ above a steady load near SD's limit projects a rise past it; one such minute
    is noise (a few an afternoon), not a lasting overload: leaving SD stays priced (finite)
    unless the last tick saw the rise too (``last_rise`` as a share of SD's limit)."""
    from controller.model import stability_limits

    _, lim_on = stability_limits(MODEL, float(alpha_from_vllm_rate(0.6, 4)), 4, Workload(512, 256))
    obs = Observation(
        T,
        0.98 * lim_on,  # this minute, far above the quarter hour's 0.86: beyond the windows' noise
        arrival_rate_long_rps=0.86 * lim_on,
        acceptance_rate=0.6,
        mean_draft_tokens=4.0,
        mean_prompt_tokens=512,
        mean_gen_tokens=256,
    )
    last = None if last_rise is None else last_rise * lim_on
    on = ControllerState(applied_enabled=True, applied_draft_length=4, last_rise_rps=last)
    a = assess(MODEL, S, on, obs, True, 4, T)
    assert a.rise_rps is not None and a.rise_rps > lim_on  # the rise this tick projects
    assert a.projected_rate_rps == pytest.approx(a.rise_rps)  # the speedup still reads it
    assert (a.projected_gain_request_s == float("inf")) is overloaded
    # What the next tick compares with (policy._remember keeps it in the state).
    calm = assess(MODEL, S, on, dataclasses.replace(obs, arrival_rate_rps=0.86 * lim_on), True, 4, T)
    assert calm.rise_rps is None


def test_entering_sd_stays_judged_at_the_busiest_minute():
    # SD off, the quarter hour at 93 % of SD's limit, its busiest minute past it: enabling SD
    # enters an overload (its catastrophic side), whatever the lasting load.
    obs, _ = _near_sd_limit(0.93)
    off = ControllerState(applied_enabled=False)
    a = assess(MODEL, S0, off, obs, False, None, T)
    assert a.projected_gain_request_s == float("-inf")


def test_drain_is_priced_at_the_full_batch_throughput():
    from controller.acceptance import alpha_from_vllm_rate
    from controller.model import stability_limits, throughput_at_batch

    alpha = float(alpha_from_vllm_rate(0.6, 4))
    w = Workload(512, 256)
    _, mu_on = stability_limits(MODEL, alpha, 4, w)
    # Past the verify knee a full batch completes fewer requests per second than the limit.
    assert throughput_at_batch(MODEL, 256, True, alpha, 4, w) < mu_on
    # Enabling SD at 14 req/s (below its 15.1 limit) after a 90 s restart: the backlog fills the
    # batch, which then completes only 13.7 req/s: priced as never recovering.
    off = ControllerState(applied_enabled=False)
    obs = Observation(T, 14.0, acceptance_rate=None, mean_prompt_tokens=512, mean_gen_tokens=256)
    a = assess(MODEL, S, off, obs, False, None, T)
    assert a.switch_cost_request_s == float("inf")


def test_remembered_congestion_keeps_sd_off_until_the_load_is_well_below():
    S = S0  # the prior as is: what is under test is the memory, not the prior's pessimism
    off = ControllerState(applied_enabled=False, sd_congested_rate_rps=10.0, sd_congested_at=T - 60)
    near = assess(MODEL, S, off, Observation(T, 8.5, mean_prompt_tokens=512, mean_gen_tokens=256), False, None, T)
    assert near.projected_gain_request_s == float("-inf")  # 8.5 >= 0.8 × 10: SD counts as overloaded
    low = assess(MODEL, S, off, Observation(T, 7.0, mean_prompt_tokens=512, mean_gen_tokens=256), False, None, T)
    assert low.projected_gain_request_s > 0
    forgotten = assess(
        MODEL,
        S,
        off,
        Observation(T + S.congestion_memory_s + 120, 8.5, mean_prompt_tokens=512, mean_gen_tokens=256),
        False,
        None,
        T + S.congestion_memory_s + 120,
    )
    assert forgotten.projected_gain_request_s > 0
    # With SD on the memory does not make leaving it an overload: its congestion is seen, or not, now.
    on = ControllerState(
        applied_enabled=True, applied_draft_length=4, sd_congested_rate_rps=10.0, sd_congested_at=T - 60
    )
    running = Observation(
        T, 8.5, acceptance_rate=0.6, mean_draft_tokens=4.0, mean_prompt_tokens=512, mean_gen_tokens=256
    )
    assert math.isfinite(assess(MODEL, S, on, running, True, 4, T).projected_gain_request_s)


def test_oscillating_load_is_judged_by_its_recent_peak():
    off = ControllerState(applied_enabled=False)
    trough = Observation(
        T, 10.0, arrival_rate_long_rps=10.0, arrival_rate_peak_rps=15.0, mean_prompt_tokens=512, mean_gen_tokens=256
    )
    a = assess(MODEL, S, off, trough, False, None, T)
    assert a.projected_rate_rps == 15.0 and a.decision_speedup < S.disable_threshold
    plain = assess(
        MODEL, Settings(calibration_file=LEGACY_CALIBRATION, price_switches=False), off, trough, False, None, T
    )
    assert plain.projected_rate_rps == 10.0  # without pricing: the thresholds on the current rate only


@pytest.mark.parametrize(("changed_ago", "counts"), [(60.0, False), (899.0, False), (900.0, True), (None, True)])
def test_the_completion_peak_of_a_restarts_own_drain_is_not_load(changed_ago, counts):
    """For a long window after a restart the highest completion rate between scrapes is the
    backlog the outage built, draining: it must not make the decision's rate a peak."""
    at = None if changed_ago is None else T - changed_ago
    state = ControllerState(applied_enabled=False, last_change_at=at)
    obs = Observation(
        T, 10.0, arrival_rate_long_rps=10.0, arrival_rate_peak_rps=15.0, mean_prompt_tokens=512, mean_gen_tokens=256
    )
    a = assess(MODEL, S, state, obs, False, None, T)
    assert a.projected_rate_rps == (15.0 if counts else 10.0)


@pytest.mark.parametrize(("started_ago", "counts"), [(60.0, False), (899.0, False), (900.0, True), (None, True)])
def test_the_completion_peak_of_a_crashs_drain_is_not_load_either(started_ago, counts):
    """A crash (or an operator's restart) sets no change of ours: vLLM's counters say when
    the server started, and its backlog's drain is no more load than after our own switch."""
    state = ControllerState(applied_enabled=False, last_change_at=T - 86_400.0)
    obs = Observation(
        T, 10.0, arrival_rate_long_rps=10.0, arrival_rate_peak_rps=15.0, mean_prompt_tokens=512, mean_gen_tokens=256,
        server_started_at=None if started_ago is None else T - started_ago,
    )  # fmt: skip
    a = assess(MODEL, S, state, obs, False, None, T)
    assert a.projected_rate_rps == (15.0 if counts else 10.0)


@pytest.mark.parametrize(
    ("rate", "slope", "hours", "on", "early"),
    [
        (6.0, 1.2, 2.0, True, True),  # 2 h of +1.2 req/s an hour toward the ~8.3 break-even
        (6.5, 2.5, 2.0, True, True),  # steeper and closer
        (5.5, 0.0, 2.0, True, False),  # flat: the rule's own disable never comes
        (4.5, 1.2, 2.0, True, False),  # the crossing is more than 2 h away: too far to anticipate
        (5.5, 1.2, 1.0, True, False),  # only an hour of the line: too young
        (5.5, 1.2, 2.0, False, False),  # SD off: nothing to disable
    ],
)
def test_a_steady_rise_toward_the_break_even_prices_disabling_now_against_later(rate, slope, hours, on, early):
    """SD on, the load rising along a line toward SD's break-even (truth calibration, ~8.3 req/s
    at this acceptance): the rule would disable SD at the crossing, at a dearer restart; the
    assessment says what disabling now saves against that, only when now is the cheapest time."""
    model = load(truth_calibration_path()).latency_model()
    obs = Observation(
        T, rate, arrival_rate_long_rps=rate, acceptance_rate=0.38, mean_draft_tokens=4.0,
        mean_prompt_tokens=1000.0, mean_gen_tokens=280.0,
    )  # fmt: skip
    state = ControllerState(
        applied_enabled=on, applied_draft_length=4 if on else None, rate_history=_history(rate, slope, hours)
    )
    a = assess(model, S, state, obs, on, 4 if on else None, T)
    assert a.decision_speedup > S.disable_threshold  # SD still wins now: only the rise argues
    assert (a.early_disable_saving_request_s > S.rise_saving_margin * a.switch_cost_request_s) is early
    if early:
        assert 0 < a.rule_disable_in_s <= 7200.0
    off = assess(model, S.model_copy(update={"disable_ahead_of_rise": False}), state, obs, on, 4 if on else None, T)
    assert off.early_disable_saving_request_s == 0.0


def test_the_excursion_signal_times_the_load_that_is_here_not_the_two_windows_projection():
    """A step from 3 to 7 req/s looks like a steep trend to the two rate windows for a quarter
    of an hour: the decision's rate believes it (conservative toward SD overload), but the
    speedup the excursion filter times is the observed load's, or what the same hours of an
    earlier day bring. Otherwise a step to a load where SD still wins restarts vLLM."""
    model = load(truth_calibration_path()).latency_model()
    obs = Observation(
        T, 7.0, arrival_rate_long_rps=3.0, acceptance_rate=0.38, mean_draft_tokens=4.0,
        mean_prompt_tokens=1000.0, mean_gen_tokens=280.0,
    )  # fmt: skip
    on = ControllerState(applied_enabled=True, applied_draft_length=4)
    a = assess(model, S, on, obs, True, 4, T)
    assert a.projected_rate_rps > 7.0 and a.decision_speedup < a.predicted_speedup
    assert a.trend_speedup == pytest.approx(a.predicted_speedup)
    # Yesterday's same quarter hour at 12 req/s: that is a forecast, and the signal times it.
    yesterday = tuple((T - 86400.0 + k * 300.0, 12.0) for k in range(4))
    a_day = assess(
        model, S, ControllerState(applied_enabled=True, applied_draft_length=4, rate_history=yesterday), obs, True, 4, T
    )
    assert a_day.trend_speedup < a.trend_speedup


@pytest.mark.parametrize(("expected_peak", "infinite"), [(None, False), (16.0, True)])
def test_a_line_nothing_confirms_is_believed_up_to_the_current_states_overload(expected_peak, infinite):
    """SD on at 10 req/s on a line rising 6 req/s an hour, with no earlier days: the line would
    overload SD within the horizon, but only an operator's (or earlier days') peak says the load
    gets there; unconfirmed, the gain counts the line up to that point (finite, so the restart's
    price still applies), confirmed it is leaving an overload (worth any restart)."""
    model = load(truth_calibration_path()).latency_model()
    obs = Observation(
        T, 10.0, arrival_rate_long_rps=10.0, acceptance_rate=0.38, mean_draft_tokens=4.0,
        mean_prompt_tokens=1000.0, mean_gen_tokens=280.0,
    )  # fmt: skip
    state = ControllerState(applied_enabled=True, applied_draft_length=4, rate_history=_history(10.0, 6.0))
    settings = S.model_copy(update={"expected_peak_rps": expected_peak})
    a = assess(model, settings, state, obs, True, 4, T)
    p = predict_point(model, 10.0, a.acceptance.alpha, 4, a.workload)
    assert math.isfinite(p.latency_on_s)  # SD is not overloaded now...
    assert a.gain_horizon_s * 6.0 / 3600.0 + 10.0 > p.stability_limit_on_rps  # ...but on the line
    assert math.isinf(a.projected_gain_request_s) is infinite
    assert a.projected_gain_request_s > 0


@pytest.mark.parametrize("crests", [1, 3])
def test_a_load_that_cycles_through_the_break_even_is_judged_by_the_cycle(crests):
    """SD on in the trough (3 req/s) of a load with 13 req/s crests every 40 minutes: SD wins at
    3 req/s, but the cycle's requests fare better without it, so the decision reads the cycle's
    speedup and gain, the crest priced up to the headroom (finite: the trough drains it). One
    crest is a spike, not a cycle: the trough alone is judged."""
    model = load(truth_calibration_path()).latency_model()
    period = [13.0, 13.0, 8.0, 3.0, 3.0, 3.0, 3.0, 8.0]  # 40 minutes of 5-minute buckets
    rates = (period * 3)[: 8 * crests] if crests > 1 else [3.0] * 16 + period
    history = tuple((T - 300.0 * (len(rates) - k), r) for k, r in enumerate(rates))
    obs = Observation(
        T, 3.0, arrival_rate_long_rps=3.0, acceptance_rate=0.38, mean_draft_tokens=4.0,
        mean_prompt_tokens=1000.0, mean_gen_tokens=280.0,
    )  # fmt: skip
    state = ControllerState(applied_enabled=True, applied_draft_length=4, rate_history=history)
    a = assess(model, S, state, obs, True, 4, T)
    assert a.predicted_speedup > S.enable_threshold  # SD wins at the trough's rate
    assert a.cycling is (crests > 1)
    if crests > 1:
        assert a.decision_speedup < S.disable_threshold and a.trend_speedup == a.decision_speedup
        assert math.isfinite(a.projected_gain_request_s) and a.projected_gain_request_s > a.switch_cost_request_s
        assert a.horizon_forecast  # a cycle that came back is its own forecast
    else:
        assert a.decision_speedup > S.disable_threshold
        assert a.projected_gain_request_s < 0


@pytest.mark.parametrize(
    ("drift_per_h", "enabled", "followed"), [(-0.2, True, True), (0.0, True, False), (-0.2, False, False)]
)
def test_the_gain_of_leaving_a_drifting_draft_follows_the_acceptance_line(drift_per_h, enabled, followed):
    """A steady 5 req/s while α has fallen along a line for an hour (the traffic's mix changing):
    with SD on, the gain of disabling follows α down for another hour (then holds it), so it is
    larger than at today's α, and the line counts as the forecast (no rent on the load's age).
    A flat α, or SD off (α not measured now), leaves the gain at today's α."""
    model = load(truth_calibration_path()).latency_model()
    alpha_now = 0.55
    alphas = [alpha_now - drift_per_h * (12 - k) / 12 for k in range(12)]
    history = tuple((T - 300.0 * (12 - k), a) for k, a in enumerate(alphas))
    rate = float(vllm_rate_from_alpha(alpha_now, 4))
    obs = Observation(
        T, 5.0, arrival_rate_long_rps=5.0, acceptance_rate=rate if enabled else None, mean_draft_tokens=4.0,
        mean_prompt_tokens=900.0, mean_gen_tokens=280.0,
    )  # fmt: skip
    flat = ControllerState(applied_enabled=enabled, applied_draft_length=4, last_alpha=alpha_now,
                           last_acceptance_rate=rate, last_acceptance_at=T - 60)  # fmt: skip
    drifting = ControllerState(**{**flat.__dict__, "alpha_history": history})
    base = assess(model, S, flat, obs, enabled, 4, T)
    a = assess(model, S, drifting, obs, enabled, 4, T)
    assert base.acceptance_trend_per_s is None and not base.horizon_forecast
    assert (a.acceptance_trend_per_s is not None) is followed
    assert a.horizon_forecast is followed
    if followed:
        assert a.acceptance_trend_per_s * 3600 == pytest.approx(drift_per_h, rel=0.01)
        assert a.projected_gain_request_s > base.projected_gain_request_s + 0.5 * abs(base.projected_gain_request_s)
        # ...but no further than α held an hour on: at most the whole horizon at that α
        p_end = predict_point(model, 5.0, alpha_now + drift_per_h, 4, a.workload)
        assert a.projected_gain_request_s <= 5.0 * a.gain_horizon_s * (p_end.latency_on_s - p_end.latency_off_s) + 1e-6
    else:
        assert a.projected_gain_request_s == pytest.approx(base.projected_gain_request_s)


@pytest.mark.parametrize("seen", ["launched into it", "predicted only", "seen arriving"])
def test_an_overload_the_controller_never_saw_arrive_is_no_excursion(seen):
    """SD on at 14.8 req/s, past its limit, SD off just able to carry it. Launched into it
    (every bucket overloaded, and the server shows it: a full batch with a queue), the filter is
    the restart's outage only. An overload the model predicts and the server does not show (a
    foreign calibration's) is filtered in full. Seen arriving from 3 req/s (a surge) it is the
    outage plus working off its backlog, at the end of the SD-off capacity's interval that
    argues against the switch: longer than at the model's own capacity."""
    import dataclasses

    model = load(truth_calibration_path()).latency_model()
    assert model.relative_sd_off > 0
    rates = [3.0] * 12 + [14.8] * 3 if seen == "seen arriving" else [14.8] * 6
    history = tuple((T - 300.0 * (len(rates) - k), r) for k, r in enumerate(rates))
    shown = {} if seen == "predicted only" else {"running": float(model.max_num_seqs), "waiting": 40.0}
    obs = Observation(
        T, 14.8, arrival_rate_long_rps=14.8, acceptance_rate=0.38, mean_draft_tokens=4.0,
        mean_prompt_tokens=900.0, mean_gen_tokens=280.0, **shown,
    )  # fmt: skip
    state = ControllerState(applied_enabled=True, applied_draft_length=4, rate_history=history)
    a = assess(model, S, state, obs, True, 4, T)
    assert a.applied_overloaded
    outage = a.restart_downtime_s + S.restart_drain_s
    assert a.overload_predates_history is (seen == "launched into it")
    if seen == "launched into it":
        assert a.excursion_filter_s == pytest.approx(outage)
    else:
        exact = dataclasses.replace(model, relative_sd_off=0.0)  # the same model, no interval
        central = assess(exact, S, state, obs, True, 4, T).excursion_filter_s
        assert a.excursion_filter_s > central > outage


def test_a_measured_running_context_sets_the_decode_steps_context():
    # vLLM's KV usage per running sequence replaces the lengths' formula: longer measured
    # context, slower decode steps, higher predicted latency in both modes; the formula's own
    # value gives the unmeasured prediction back.
    def at(context):
        obs = Observation(
            T, 4.0, acceptance_rate=0.6, mean_draft_tokens=4.0, mean_prompt_tokens=900.0, mean_gen_tokens=280.0,
            running_context_tokens=context,
        )  # fmt: skip
        return assess(MODEL, S.policy, ControllerState(), obs, True, 4, T)

    unmeasured, short, long = at(None), at(300.0), at(4000.0)
    assert long.workload.running_context_tokens == 4000.0 and unmeasured.workload.running_context_tokens is None
    assert short.latency_off_s < unmeasured.latency_off_s < long.latency_off_s
    assert short.latency_on_s < unmeasured.latency_on_s < long.latency_on_s
    same = at(Workload(900.0, 280.0).mean_context_tokens)
    assert same.latency_off_s == pytest.approx(unmeasured.latency_off_s)
    assert same.latency_on_s == pytest.approx(unmeasured.latency_on_s)


def test_prefix_cache_hits_leave_the_prefill_out_of_the_price():
    # The observed hits per request reach the model: less prefill, lower latency in both
    # modes and a higher limit; an unreadable counter (None) prices every prompt in full.
    def at(cached):
        obs = Observation(
            T, 4.0, acceptance_rate=0.6, mean_draft_tokens=4.0, mean_prompt_tokens=900.0, mean_gen_tokens=280.0,
            cached_prompt_tokens=cached,
        )  # fmt: skip
        return assess(MODEL, S.policy, ControllerState(), obs, True, 4, T)

    unread, none, half = at(None), at(0.0), at(450.0)
    assert half.workload.cached_prompt_tokens == 450.0 and unread.workload.cached_prompt_tokens == 0.0
    assert unread.latency_off_s == none.latency_off_s and unread.latency_on_s == none.latency_on_s
    assert half.latency_off_s < none.latency_off_s and half.latency_on_s < none.latency_on_s
    assert half.stability_limit_off_rps > none.stability_limit_off_rps
