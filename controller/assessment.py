"""Turn an observation into what the decision needs: acceptance, prediction, switch price.

Pure: model, settings (a :class:`~controller.config.PolicyConfig`), state, observation and
time in; an :class:`Assessment` out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from controller.acceptance import alpha_from_vllm_rate, vllm_rate_from_alpha
from controller.config import PolicyConfig
from controller.model import (
    INTERVAL_Z,
    LatencyModel,
    Workload,
    best_draft_length,
    break_even_rates,
    curves,
    cycle_speedup,
    predict_point,
    predict_points,
    throughput_at_batch,
)
from controller.observation import Observation, last_restart
from controller.risk import (
    CYCLE_WINDOW_S,
    RISE_FIT_S,
    acceptance_trend,
    backlog_drain_s,
    cycle_rates,
    excursion_filter_s,
    expected_peak,
    forecast_peak,
    forecast_time_to,
    history_fit,
    overload_predates_history,
    projected_alpha,
    recent_peak,
    steady_rise,
    trend_is_material,
)
from controller.state import ControllerState
from controller.switch_cost import (
    downtime_estimate,
    gain_horizon,
    path_gain,
    projected_rate,
    switch_cost,
    switch_gain,
    switch_now_saving,
    trend_slope,
)

GAIN_PATH_POINTS = 4  # midpoints along the fitted load line at which a switch's gain is summed
RISE_GRID_POINTS = 4  # restart times between now and the rule's own disable, weighed against now


class AcceptanceSource(StrEnum):
    MEASURED = "measured"  # rolling window from the SD counters
    LAST = "last"  # SD is off: the last measured value, within its max age
    PRIOR = "prior"  # never measured, or too old


@dataclass(frozen=True)
class AcceptanceEstimate:
    rate: float  # vLLM-style accepted / drafted tokens at ``measured_at_draft_length``
    alpha: float  # per-token acceptance
    source: AcceptanceSource
    age_s: float  # 0 when measured now
    accepted_length: float | None = None  # measured E[N] from per-position counters


def estimate_acceptance(
    obs: Observation, state: ControllerState, settings: PolicyConfig, draft_length: int, now: float
) -> AcceptanceEstimate:
    """Measured if SD counters moved this window; else the last one if young enough; else prior."""
    if obs.acceptance_rate is not None:
        en = obs.accepted_length
        if en is not None and obs.mean_draft_tokens:
            # Per-position counters must agree with the totals (Σ per position = accepted);
            # if they do not (a partial scrape, an exporter bug), trust the totals.
            en_total = 1.0 + obs.acceptance_rate * obs.mean_draft_tokens
            if abs(en - en_total) > 0.05 * en_total:
                en = None
        if en is not None and obs.position_acceptance:
            # Per-position counters give E[N] exactly; α is what reproduces it at that γ.
            gamma = len(obs.position_acceptance)
            alpha = float(alpha_from_vllm_rate((en - 1.0) / gamma, gamma))
        else:
            # N-gram drafting may propose fewer than γ tokens: use the mean drafted per draft.
            gamma_eff = obs.mean_draft_tokens if obs.mean_draft_tokens else float(draft_length)
            alpha = float(alpha_from_vllm_rate(obs.acceptance_rate, max(gamma_eff, 1.0)))
        return AcceptanceEstimate(obs.acceptance_rate, alpha, AcceptanceSource.MEASURED, 0.0, en)
    if state.last_alpha is not None and state.last_acceptance_at is not None:
        age = max(now - state.last_acceptance_at, 0.0)
        if age <= settings.acceptance_max_age_s:
            rate = state.last_acceptance_rate if state.last_acceptance_rate is not None else 0.0
            return AcceptanceEstimate(rate, state.last_alpha, AcceptanceSource.LAST, age)
    # Nothing measured: the prior at the end of its spread that argues against enabling.
    rate = max(settings.acceptance_prior - settings.enable_posterior_z * settings.acceptance_prior_sd, 0.0)
    alpha = float(alpha_from_vllm_rate(rate, settings.draft_length))
    return AcceptanceEstimate(rate, alpha, AcceptanceSource.PRIOR, math.inf)


@dataclass(frozen=True)
class Assessment:
    """Everything the policy weighs, and everything the exporter shows."""

    arrival_rate_rps: float
    projected_rate_rps: float  # the rate the decision is evaluated at (trend, conservative)
    acceptance: AcceptanceEstimate
    workload: Workload
    draft_length: int  # γ the SD-on state would run with
    best_draft_length: int
    predicted_speedup: float  # at the current rate
    decision_speedup: float  # at the projected rate: compared with the thresholds
    latency_off_s: float
    latency_on_s: float
    batch_off: float
    batch_on: float
    stability_limit_off_rps: float
    stability_limit_on_rps: float
    break_even_rate_rps: float | None  # S = 1 at this acceptance; None: SD never falls below 1
    restart_downtime_s: float
    switch_cost_request_s: float  # of switching away from the applied state
    projected_gain_request_s: float  # of the other state over the horizon (negative: a loss)
    gain_horizon_s: float = 0.0  # how long the other state is expected to stay right
    congested: bool = False  # the running batch is full with a queue behind it
    # Prediction interval of the speedup at the projected rate (calibration residuals).
    speedup_lo: float = math.nan
    speedup_hi: float = math.nan
    projected_speedup: float = math.nan  # the interval's middle: the speedup at the projected rate
    # Risk terms (controller/risk.py): the peak the next hours may bring (history or operator),
    # the restart back that enabling SD commits to when that peak passes SD's break-even, how
    # long a switch signal must persist, and whether the applied state is wrong right now.
    expected_peak_rps: float | None = None
    trend_speedup: float = math.nan  # at the current rate or the history's forecast (no peak, no window trend)
    undo_cost_request_s: float = 0.0
    excursion_filter_s: float = 0.0
    applied_overloaded: bool = False
    rise_rps: float | None = None  # the rate projected by a rise beyond the windows' noise (None: no rise)
    # The running mode's smoothed observed / predicted latency (the shell fills it in from the
    # learner; None: no evidence yet). A model that misses the state it watches by more than
    # model_error_threshold is not trusted with a restart.
    model_error_ratio: float | None = None
    # Whether something forecasts how long the load lasts: the same hours on earlier days in
    # the history, or a material fitted trend. Without it the policy rents (risk.rented_gain):
    # the gain counts only as long as the switch signal has already held.
    horizon_forecast: bool = True
    # Posterior sd of the log speedup at the projected rate (the shell fills it in from the
    # learner while SD is off; None: no online correction, or not computed).
    speedup_log_sd: float | None = None
    # SD on under a steadily rising load: what disabling now saves against the restart the rule
    # would make once the load reaches SD's break-even (request-s; 0 when nothing is rising
    # toward it, or when some time before the rule's is cheaper still), and when the rule would.
    early_disable_saving_request_s: float = 0.0
    rule_disable_in_s: float | None = None
    # The load crossed SD's break-even band back and forth within two hours (risk.cycle_rates):
    # the speedup and the gain are the cycle's, and its latency evidence is its transients.
    cycling: bool = False
    # SD on with its acceptance drifting along a line through the last hour
    # (risk.acceptance_trend, α per second): the gain of disabling follows it. None: no drift.
    acceptance_trend_per_s: float | None = None
    # The applied state is congested and its overload has held in every bucket of the rate history
    # (a launch into it): no excursion, so the filter is the restart's outage only
    # (risk.overload_predates_history).
    overload_predates_history: bool = False
    # What sets each mode's stability limit (model.LIMIT_REASONS): what to change to raise it.
    limit_reason_off: str = "throughput_peak"
    limit_reason_on: str = "throughput_peak"

    def latency_s(self, enabled: bool) -> float:
        return self.latency_on_s if enabled else self.latency_off_s

    def batch(self, enabled: bool) -> float:
        return self.batch_on if enabled else self.batch_off


def assess(
    model: LatencyModel,
    settings: PolicyConfig,
    state: ControllerState,
    obs: Observation,
    applied_enabled: bool | None,
    applied_draft_length: int | None,
    now: float,
) -> Assessment:
    """Predict both states at the observed (and projected) load and price a switch."""
    assert obs.arrival_rate_rps is not None, "assess() needs an arrival rate"
    gamma_now = applied_draft_length or settings.draft_length
    acc = estimate_acceptance(obs, state, settings, gamma_now, now)
    workload = Workload(
        _first(obs.mean_prompt_tokens, state.last_prompt_tokens, settings.default_prompt_tokens),
        _first(obs.mean_gen_tokens, state.last_gen_tokens, settings.default_gen_tokens),
        obs.gen_tokens_std,
        obs.prompt_tokens_std,
        running_context_tokens=obs.running_context_tokens,
        # Unreadable this tick: priced without the cache (every prompt computed), the dearer side.
        cached_prompt_tokens=obs.cached_prompt_tokens or 0.0,
    )
    rate = obs.arrival_rate_rps
    if settings.price_switches:
        lookahead = max(settings.dwell_s, settings.trend_lookahead_s)
        ahead = projected_rate(
            rate, obs.arrival_rate_long_rps, settings.rate_window_s, settings.long_window_s, lookahead
        )
        # Conservative toward the catastrophic side: SD at a load beyond its limit. A rising
        # trend is believed; a falling one is not (the load may come back before the dwell ends),
        # and an oscillating load is judged by its recent peak, not by the trough it is in.
        # The same hours on earlier days say what the next minutes bring better than a trend.
        soon = forecast_peak(state.rate_history, now, lookahead) or 0.0
        trend_rate = max(rate, soon)
        # The peak is the highest completion rate between scrapes: for a long window after a
        # restart it is the restart's own backlog draining, not load. Any restart: a crash or
        # an operator's restarts vLLM without a change of ours (vLLM's counters say when).
        since_restart = now - last_restart(obs, state.last_change_at)
        peak = (obs.arrival_rate_peak_rps or 0.0) if since_restart >= settings.long_window_s else 0.0
        eval_rate = max(trend_rate, ahead, peak)
        # Whether a state is overloaded (an infinite gain for leaving it, which neither the
        # load's age nor the restart's price can hold back) is judged on the load that lasts:
        # the quarter hour's rate, the forecast or a rise beyond the windows' noise. The
        # noisiest minute of a steady 13.5 req/s passes 98 % of a 14.6 req/s limit every
        # quarter hour, and a restart on it is a loss whenever the load ends within the hour.
        # A rise counts there only when the last tick saw one too: Poisson noise passes the
        # windows' 3 σ once in ~700 minutes, so a steady 13.5 req/s throws a 15 req/s "rise"
        # every few hours, and on one of them a restart out of a stable SD cost 1.3× riding it.
        rise = ahead if ahead > rate else None
        seen_twice = min(rise, state.last_rise_rps) if rise is not None and state.last_rise_rps is not None else 0.0
        sustained = max(obs.arrival_rate_long_rps or rate, soon, seen_twice)
    else:
        eval_rate = trend_rate = sustained = rate
        rise = None
    best = best_draft_length(model, eval_rate, acc.alpha, workload, settings.draft_length_candidates)
    gamma_on = (
        applied_draft_length
        if applied_enabled and applied_draft_length
        else (best.draft_length if settings.adapt_draft_length else settings.draft_length)
    )
    # A measured E[N] is only valid for the γ it was measured at.
    en = acc.accepted_length if acc.accepted_length is not None and gamma_on == gamma_now else None
    now_p = predict_point(model, rate, acc.alpha, gamma_on, workload, en)
    curve_off, curve_on = curves(model, acc.alpha, gamma_on, workload, en)  # cached by predict_point
    eval_p = now_p if eval_rate == rate else predict_point(model, eval_rate, acc.alpha, gamma_on, workload, en)
    # The excursion filter times the load that is here (or coming, by the same hours of earlier
    # days), not the recent peak or the two windows' trend the decision also weighs: a spike
    # that is over must not keep a switch signal alive for the long window, and a step looks
    # like a steep trend to the two windows for as long (a step to a load where SD still wins
    # restarted vLLM on it).
    trend_p = eval_p if trend_rate == eval_rate else predict_point(model, trend_rate, acc.alpha, gamma_on, workload, en)
    thresholds = (1.0, settings.disable_threshold, settings.enable_threshold)
    bes = break_even_rates(model, acc.alpha, gamma_on, workload, thresholds=thresholds, accepted_length=en)
    be = bes[1.0]

    downtime = downtime_estimate(state.restart_durations_s, settings.restart_downtime_s)
    currently_on = bool(applied_enabled)
    lat_new = eval_p.latency_off_s if currently_on else eval_p.latency_on_s
    cap_cur = eval_p.stability_limit_on_rps if currently_on else eval_p.stability_limit_off_rps
    cap_new = eval_p.stability_limit_off_rps if currently_on else eval_p.stability_limit_on_rps

    def latency_current(r: float) -> float:
        p = predict_point(model, r, acc.alpha, gamma_on, workload, en)
        return p.latency_on_s if currently_on else p.latency_off_s

    # After a restart the backlog (λ·D arrivals) fills the batch; past a compute knee a fuller
    # batch completes *fewer* requests per second, so price the drain at the batch it will run.
    cap_m = float(model.max_num_seqs)
    lat_new_steady = lat_new if math.isfinite(lat_new) else 0.0
    drain_batch = min(cap_m, eval_rate * downtime + eval_rate * lat_new_steady)
    drain_capacity = min(
        cap_new,
        throughput_at_batch(model, drain_batch, not currently_on, acc.alpha, gamma_on, workload, en),
    )
    cost = switch_cost(eval_rate, downtime, drain_capacity, settings.replicas, cap_cur, latency_current)
    # A full batch with a queue behind it is the congested branch, whatever the fluid model's
    # smallest fixed point says: the current state is overloaded in fact.
    # With SD on the safety net keeps the last tick's queue: a full batch counts once its queue
    # has held for two ticks (near the limit a stable load fills the batch for a minute now and
    # then, and one such minute must not make leaving SD worth any restart).
    congested = (
        obs.running is not None
        and obs.running >= 0.95 * cap_m
        and (obs.waiting or 0.0) > 0.0
        and (state.last_waiting is None or state.last_waiting > 0.0)
    )
    decision_speedup = eval_p.speedup
    if not currently_on and settings.enable_on_pessimistic_speedup and not math.isnan(eval_p.speedup_lo):
        # Enabling is a restart on the model's word: take the end of its interval that argues
        # against it, so calibration error cannot talk the controller into a loss.
        decision_speedup = eval_p.speedup_lo
    trend_speedup = trend_p.speedup
    low_be, high_be = bes[settings.enable_threshold], be
    cycle = (
        cycle_rates(state.rate_history, now, rate, low_be.rate_rps, high_be.rate_rps)
        if settings.price_switches and low_be.rate_rps is not None and high_be.rate_rps is not None
        else None
    )
    cycle_points = []
    if cycle:
        # A crest past a limit builds a queue that the trough drains, not a lasting overload (and
        # a bucket's busiest minute overstates it): the cycle's rates are priced up to the headroom.
        crest = settings.capacity_headroom * min(now_p.stability_limit_off_rps, now_p.stability_limit_on_rps)
        cycle_points = predict_points(model, [min(r, crest) for r in cycle], acc.alpha, gamma_on, workload, en)
    if cycle_points:
        # A load that went through SD's break-even and back within two hours is judged by
        # them, not by the phase it is in now: that is what the next hours plausibly bring.
        # Enabling still needs the busiest minute's word as well (SD's catastrophic side).
        cyc = cycle_speedup(cycle_points)
        decision_speedup = cyc if currently_on else min(cyc, decision_speedup)
        trend_speedup = cyc
    if congested and currently_on:
        decision_speedup = 0.0  # SD is the state that fell behind
    remembered = sd_congestion_remembered(state, settings, now)

    def priced(r: float, p) -> tuple[float, float, float, float, float]:
        """(rate, latency now-state, latency new-state, their capacities) as the gain counts them."""
        lc, ln = (p.latency_on_s, p.latency_off_s) if currently_on else (p.latency_off_s, p.latency_on_s)
        cc, cn = (
            (p.stability_limit_on_rps, p.stability_limit_off_rps)
            if currently_on
            else (p.stability_limit_off_rps, p.stability_limit_on_rps)
        )
        # The fluid model's latency is optimistic next to a stability limit (arrival bursts
        # queue); past the headroom a state counts as overloaded, so leaving it is always worth
        # a restart.
        if r > settings.capacity_headroom * cc:
            lc = math.inf
        if r > settings.capacity_headroom * cn:
            ln = math.inf
        # What the model cannot know, experience does: SD seen congested at some rate is treated
        # as overloaded above a margin of it for a while (a model that overrates SD at a full
        # batch would otherwise re-enable it into the same collapse). Only for re-enabling: with
        # SD on, its congestion is seen (or not) now, and one full-batch minute of a stable
        # load must not make leaving SD worth any restart for six hours.
        if remembered and not currently_on and r >= settings.congestion_margin * (state.sd_congested_rate_rps or 0.0):
            ln = math.inf
        return r, lc, ln, cc, cn

    here = priced(eval_rate, eval_p)
    if sustained < eval_rate and math.isinf(here[1]):
        # The current state overloaded at the peak minute only: leaving it is priced at the
        # lasting load. (Entering an overload stays judged at the peak, SD's catastrophic side,
        # where the current state is not overloaded too: a minute that overloads both says
        # nothing of which to run, and "the larger capacity wins" on it had restarted a stable
        # SD at a steady 13.5 req/s into 1.26× the latency of riding it out.)
        here = priced(sustained, predict_point(model, sustained, acc.alpha, gamma_on, workload, en))
    if congested:
        here = (here[0], math.inf, *here[2:])
    # The trend the gain follows: a line through the last hour of the rate history when there
    # is one, else the two rate windows (noisy: used for the horizon only).
    fit = history_fit(state.rate_history, now)
    fitted = fit[0] if fit is not None else None
    slope = (
        fitted
        if fitted is not None
        else trend_slope(rate, obs.arrival_rate_long_rps, settings.rate_window_s, settings.long_window_s)
    )
    # The new state pays off until the load trend would switch it back: SD just enabled lasts
    # until load rises to the disable break-even; SD just disabled until load falls to enable's.
    undo = bes[settings.enable_threshold if currently_on else settings.disable_threshold]
    undo_rate = undo.rate_rps if not undo.always_above else None
    horizon = gain_horizon(
        eval_rate,
        slope,
        undo_rate,
        rising_undoes=not currently_on,
        min_s=settings.dwell_s,
        max_s=max(settings.gain_horizon_max_s, settings.dwell_s),
    )
    recent = recent_peak(state.rate_history, now)
    # What the next hours bring: the same hours on earlier days, or the operator's word...
    history_peak = forecast_peak(state.rate_history, now, settings.gain_horizon_max_s)
    ahead_peak = expected_peak(history_peak, settings.expected_peak_rps)
    # ...and, for the way back after enabling, what the last hour saw (it may come back), or
    # where a steady rise is carrying the load.
    peak = expected_peak(ahead_peak, recent[0] if recent else None)
    material = trend_is_material(fit, eval_rate)
    line_top = max(eval_rate, ahead_peak) if ahead_peak is not None else 2.0 * eval_rate + 1.0
    rising = material and fitted is not None and fitted > 0.0
    if rising:
        peak = expected_peak(peak, min(eval_rate + fitted * settings.gain_horizon_max_s, line_top))
    off_be = bes[settings.disable_threshold]
    undo_cost = 0.0
    if not currently_on and settings.price_switches and not off_be.always_above and off_be.rate_rps is not None:
        # Enabling SD commits to a restart back once the load climbs past SD's break-even. If
        # the next hours bring such a load, that restart is part of the price, and the gain
        # lasts only until then.
        r_back = off_be.rate_rps
        if peak is not None and peak > r_back:
            undo_cost = _cost_back_off(model, settings, r_back, downtime, acc.alpha, gamma_on, workload, en)
            until = forecast_time_to(state.rate_history, now, settings.gain_horizon_max_s, r_back)
            if until is None and recent is not None and recent[0] > r_back:
                # It was there a while ago: expect it back within about as long (an oscillation).
                until = max(now - recent[1], 0.0)
            if until is None and rising and r_back > eval_rate:
                until = (r_back - eval_rate) / fitted
            if until is not None:
                horizon = min(horizon, max(until, settings.dwell_s))
    # SD running a drifting draft (the traffic's mix changing): leaving it gains more hour by
    # hour, and the gain follows the acceptance's line as it follows the load's.
    drift = (
        acceptance_trend(state.alpha_history, now)
        if currently_on
        and settings.price_switches
        and acc.source is AcceptanceSource.MEASURED
        and not congested
        and not cycle_points
        else None
    )
    if cycle_points and not congested:
        # The cycle's gain: an equal share of the horizon at each of its rates. A line through a
        # cycle says nothing of when it ends; the cycle vouches for about as long as it was seen.
        horizon = max(settings.dwell_s, min(settings.gain_horizon_max_s, CYCLE_WINDOW_S))
        gain = path_gain([priced(p.rate_rps, p) for p in cycle_points], horizon / len(cycle_points))
    elif (not material and drift is None) or congested or not settings.price_switches:
        # A line that explains little of the last hour (its buckets' noise) forecasts nothing.
        gain = switch_gain(here[0], horizon, *here[1:])
    else:
        # A load that keeps rising makes staying with SD worse hour by hour (and a falling one
        # better): the gain follows the fitted line over the horizon, never above the expected
        # peak (or twice the load plus one request per second without one) and never below half
        # the load (a line fitted to an evening does not run on to zero). A drifting acceptance
        # moves along its own line for the hour that vouches for it (a measured E[N] is the
        # acceptance of now only).
        step = horizon / GAIN_PATH_POINTS
        path = []
        for k in range(GAIN_PATH_POINTS):
            after = (k + 0.5) * step
            r = min(max(eval_rate + fitted * after, 0.5 * eval_rate), line_top) if material and fitted else here[0]
            alpha_k, en_k = (acc.alpha, en) if drift is None else (projected_alpha(acc.alpha, drift, after), None)
            point = priced(r, predict_point(model, r, alpha_k, gamma_on, workload, en_k)) if r > 0 else here
            if ahead_peak is None and math.isinf(point[1]) and not math.isinf(here[1]):
                # A line that nothing confirms (no earlier days, no operator's peak) is believed
                # up to where it would overload the current state, not past it: whether the load
                # gets there is the rise's own question, priced by disabling ahead of the rise
                # (a restart now against the rule's own later one), and a day's rise flattens
                # at a peak the line cannot see.
                break
            path.append(point)
        gain = path_gain(path, step) if path else switch_gain(here[0], step, *here[1:])
    now_cur = now_p.latency_on_s if currently_on else now_p.latency_off_s
    applied_overloaded = congested or math.isinf(now_cur)
    # An overload the controller never saw arrive (it was there before the history began: a
    # launch into it) is no excursion: the launched state is clearly wrong and only the
    # restart's own outage is filtered. A surge seen arriving must outlast its recovery. The
    # server must show it (a full batch with a queue): a foreign calibration that prices this
    # server 2.6× slower predicts an overload at every load, and its first hour is the online
    # correction's.
    predates = (
        congested
        and settings.price_switches
        and overload_predates_history(state.rate_history, settings.capacity_headroom * cap_cur)
    )
    # Near the new state's limit the drain λ·D/(μ − λ) swings with every percent of μ: the
    # filter takes the end of the capacity's prediction interval that argues against the
    # switch (the calibration's residuals), so a noisy minute cannot shorten it below what the
    # model cannot rule out. (The switch's price stays at the model's own capacity.)
    sd_new = model.relative_sd_off if currently_on else model.relative_sd_on
    backlog_s = backlog_drain_s(eval_rate, downtime, drain_capacity / (1.0 + INTERVAL_Z * sd_new))
    filter_s = excursion_filter_s(
        downtime,
        settings.restart_drain_s,
        settings.excursion_filter_s,
        # Behind a router the other replicas carry the outage's arrivals: no backlog of ours.
        backlog_s if settings.replicas <= 1 and not predates else 0.0,
        settings.excursion_filter_max_s,
    )
    early, fire_in = 0.0, None
    r_x = off_be.rate_rps
    climb = steady_rise(state.rate_history, now, eval_rate) if currently_on else None
    if (
        climb is not None
        and settings.price_switches
        and settings.disable_ahead_of_rise
        and not congested
        and not off_be.always_above
        and r_x is not None
        and eval_rate < r_x
    ):
        # The rule disables SD once the decision's rate passes the break-even and the signal has
        # outlasted the filter; by then the restart's backlog is λ·D at a higher λ.
        fire_in = (r_x - eval_rate) / climb + filter_s
        # Two hours of a steady line vouch for about two more: no further.
        if fire_in <= min(settings.gain_horizon_max_s, RISE_FIT_S):

            def cost_at(r: float) -> float:
                return _cost_back_off(model, settings, r, downtime, acc.alpha, gamma_on, workload, en)

            def priced_at(r: float):
                return priced(r, predict_point(model, r, acc.alpha, gamma_on, workload, en))

            early = _saving_ahead_of_rise(rate, climb, line_top, fire_in, cost_at, priced_at)
        else:
            fire_in = None
    return Assessment(
        arrival_rate_rps=rate,
        projected_rate_rps=eval_rate,
        acceptance=acc,
        workload=workload,
        draft_length=gamma_on,
        best_draft_length=best.draft_length,
        predicted_speedup=now_p.speedup,
        decision_speedup=decision_speedup,
        latency_off_s=now_p.latency_off_s,
        latency_on_s=now_p.latency_on_s,
        batch_off=now_p.batch_off,
        batch_on=now_p.batch_on,
        stability_limit_off_rps=now_p.stability_limit_off_rps,
        stability_limit_on_rps=now_p.stability_limit_on_rps,
        limit_reason_off=curve_off.limit_reason,
        limit_reason_on=curve_on.limit_reason,
        break_even_rate_rps=be.rate_rps,
        restart_downtime_s=downtime,
        switch_cost_request_s=cost,
        projected_gain_request_s=gain,
        gain_horizon_s=horizon,
        congested=congested,
        speedup_lo=eval_p.speedup_lo,
        speedup_hi=eval_p.speedup_hi,
        projected_speedup=eval_p.speedup,
        expected_peak_rps=peak,
        trend_speedup=trend_speedup,
        undo_cost_request_s=undo_cost,
        # A cycle that came back is its own forecast (three crossings: it repeated).
        # So is an acceptance drifting along a line: the load is not what changed.
        horizon_forecast=history_peak is not None or material or bool(cycle_points) or drift is not None,
        excursion_filter_s=filter_s,
        applied_overloaded=applied_overloaded,
        rise_rps=rise,
        overload_predates_history=predates,
        early_disable_saving_request_s=early,
        rule_disable_in_s=fire_in,
        cycling=bool(cycle_points),
        acceptance_trend_per_s=drift,
    )


def _saving_ahead_of_rise(rate: float, slope: float, top: float, fire_in: float, cost_at, priced_at) -> float:
    """What disabling SD now saves against the rule's own disable ``fire_in`` s from now, the
    load rising along its fitted line (``slope``, at most ``top``); 0 unless now is the cheapest
    time on the grid. Restart prices at a grid of times against the SD gain collected until each
    (:func:`~controller.switch_cost.switch_now_saving`)."""
    step = fire_in / RISE_GRID_POINTS
    costs, gains, kept = [], [], 0.0
    for k in range(RISE_GRID_POINTS + 1):
        costs.append(cost_at(min(rate + slope * k * step, top)))
        gains.append(kept)
        if k < RISE_GRID_POINTS and math.isfinite(kept):
            # Staying on gains what switching off would lose over this stretch of the line.
            r, lc, ln, cc, cn = priced_at(min(rate + slope * (k + 0.5) * step, top))
            kept -= switch_gain(r, step, lc, ln, cc, cn)
    vs_best, vs_rule = switch_now_saving(costs, gains)
    return vs_rule if vs_best >= 0.0 else 0.0


def pessimistic_speedup(a: Assessment, z: float) -> float:
    """The decision's speedup with the posterior's uncertainty taken off too: the calibration's
    interval (its log half-width) and ``z`` posterior sds of the log speedup, combined in
    quadrature around the projected speedup. Unchanged without a posterior width."""
    sd = a.speedup_log_sd
    s = a.decision_speedup
    mean = a.projected_speedup
    if sd is None or sd <= 0.0 or z <= 0.0 or not (math.isfinite(mean) and mean > 0 and math.isfinite(s) and s > 0):
        return s
    cal = max(math.log(mean / s), 0.0)  # the calibration interval already taken (0: none)
    return mean * math.exp(-math.hypot(cal, z * sd))


def _cost_back_off(
    model: LatencyModel,
    settings: PolicyConfig,
    rate: float,
    downtime: float,
    alpha: float,
    gamma: int,
    workload: Workload,
    en: float | None,
) -> float:
    """Request-seconds of the restart from SD on back to off at ``rate`` (the backlog drained
    at the batch it fills, as for the switch now)."""
    p = predict_point(model, rate, alpha, gamma, workload, en)
    lat_off = p.latency_off_s if math.isfinite(p.latency_off_s) else 0.0
    batch = min(float(model.max_num_seqs), rate * downtime + rate * lat_off)
    capacity = min(p.stability_limit_off_rps, throughput_at_batch(model, batch, False, alpha, gamma, workload, en))

    def latency_on(r: float) -> float:
        return predict_point(model, r, alpha, gamma, workload, en).latency_on_s

    return switch_cost(rate, downtime, capacity, settings.replicas, p.stability_limit_on_rps, latency_on)


def sd_congestion_remembered(state: ControllerState, settings: PolicyConfig, now: float) -> bool:
    return (
        state.sd_congested_rate_rps is not None
        and state.sd_congested_at is not None
        and now - state.sd_congested_at <= settings.congestion_memory_s
    )


def _first(*values: float | None) -> float:
    for v in values:
        if v is not None and v > 0:
            return float(v)
    raise ValueError("no positive value")  # pragma: no cover - the settings default is > 0


def acceptance_rate_for(alpha: float, draft_length: int) -> float:
    """vLLM-style rate an α would show at this draft length (for display)."""
    return float(vllm_rate_from_alpha(alpha, draft_length))
