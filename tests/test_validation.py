"""validate(): per-run errors, per-mode summaries, stability-limit brackets, measured break-even,
and the ``sd-controller validate`` command around it.

Load rows are built by hand around a small model whose predictions the test computes itself
with :func:`predict_point`, so every expected error is exact.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from controller import calibration as cal_mod
from controller.acceptance import alpha_from_vllm_rate
from controller.calibration import LOAD_COLUMNS, LOAD_OPTIONAL_COLUMNS, LoadRow
from controller.cli import main
from controller.errors import InputError
from controller.model import (
    LIMIT_REASONS,
    LatencyModel,
    StepCost,
    Workload,
    break_even_rates,
    curves,
    predict_point,
)
from controller.synthetic import bench_rows
from controller.validation import INTERVAL_COVERAGE, RowCheck, refine_rates, validate

MODEL = LatencyModel(target=StepCost(0.010, 0.001), draft=StepCost(0.002, 0.0001), max_num_seqs=64)
GAMMA = 4
ACCEPTANCE_RATE = 0.6  # vLLM's accepted / drafted
ALPHA = float(alpha_from_vllm_rate(ACCEPTANCE_RATE, GAMMA))
PROMPT, GEN, GEN_STD = 100.0, 50.0, 50.0
WORKLOAD = Workload(PROMPT, GEN, GEN_STD, None)


def predicted(rate: float, sd: bool, model: LatencyModel = MODEL) -> float:
    p = predict_point(model, rate, ALPHA, GAMMA, WORKLOAD)
    return p.latency_on_s if sd else p.latency_off_s


def row(rate: float, sd: bool, measured_s: float, saturated: bool | None = None, line: int = 0) -> LoadRow:
    return LoadRow(
        rate=rate,
        sd=sd,
        draft_length=GAMMA if sd else 0,
        acceptance_rate=ACCEPTANCE_RATE if sd else 0.0,
        mean_e2e_s=measured_s,
        mean_prompt_tokens=PROMPT,
        mean_gen_tokens=GEN,
        line=line,
        gen_tokens_std=GEN_STD,
        saturated=saturated,
    )


def off_limit() -> float:
    off, _ = curves(MODEL, ALPHA, GAMMA, WORKLOAD)
    return off.stability_limit_rps


def test_the_model_has_the_shape_these_tests_assume():
    # Off limit ≈ 6.2 req/s, SD's ≈ 4.7, SD faster at low load, slower from ≈ 2.8 req/s.
    off, on = curves(MODEL, ALPHA, GAMMA, WORKLOAD)
    assert 6.0 < off.stability_limit_rps < 6.5
    assert 4.5 < on.stability_limit_rps < 5.1
    assert predicted(1.0, True) < predicted(1.0, False)
    assert predicted(4.0, True) > predicted(4.0, False)
    assert math.isinf(predicted(7.0, False))


# --------------------------------------------------------------------------------------------
# Per run
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sd", [False, True])
@pytest.mark.parametrize("rate", [0.5, 2.0, 3.5])
def test_error_is_predicted_minus_measured_over_measured(rate, sd):
    pred = predicted(rate, sd)
    over = validate(MODEL, [row(rate, sd, pred / 1.05)]).rows[0]
    assert over.predicted_s == pytest.approx(pred, rel=1e-12)
    assert over.error == pytest.approx(0.05, rel=1e-9)  # predicts 5 % too high
    under = validate(MODEL, [row(rate, sd, pred * 1.05)]).rows[0]
    assert under.error == pytest.approx(1 / 1.05 - 1, rel=1e-9)  # −4.76 %: measured 5 % above
    assert over.mode == ("on(γ=4)" if sd else "off")
    assert not over.predicted_overloaded and not over.measured_saturated


@pytest.mark.parametrize("sd", [False, True])
def test_a_run_is_predicted_at_the_rate_its_arrivals_came_at(sd):
    # 4 req/s asked for over 600 s; Poisson arrivals sent 2,322 (3.87 req/s, −1.6 sd). Near a
    # limit that is worth several per cent of latency: the run is judged at what it was offered.
    sent = replace(row(4.0, sd, 1.0), duration_s=600.0, sent=2322)
    offered = 2322 / 600.0
    check = validate(MODEL, [sent]).rows[0]
    assert sent.offered_rps == offered
    assert check.stationary_s == pytest.approx(predicted(offered, sd), rel=1e-12)
    assert abs(check.stationary_s / predicted(4.0, sd) - 1.0) > 0.01
    # Not recorded (or nothing sent): the rate asked for.
    for unknown in (replace(sent, sent=None), replace(sent, sent=0), replace(sent, duration_s=None)):
        assert unknown.offered_rps == 4.0
        assert validate(MODEL, [unknown]).rows[0].stationary_s == pytest.approx(predicted(4.0, sd), rel=1e-12)
    # The runs at one rate still pool under the rate asked for.
    (point,) = validate(MODEL, [sent, replace(sent, sent=2478)]).points
    assert point.rate == 4.0 and len(point.runs) == 2


def test_off_rows_use_the_off_curve_whatever_their_acceptance_columns():
    # An SD-off row carries no γ; its prediction is the plain target's latency.
    r = LoadRow(2.0, False, 0, 0.0, 1.0, PROMPT, GEN, 0, GEN_STD)
    assert validate(MODEL, [r]).rows[0].predicted_s == pytest.approx(predicted(2.0, False), rel=1e-12)


def test_interval_brackets_the_prediction_when_calibration_has_residuals():
    noisy = LatencyModel(
        target=MODEL.target, draft=MODEL.draft, max_num_seqs=64, relative_sd_off=0.05, relative_sd_on=0.05
    )
    c = validate(noisy, [row(2.0, True, 1.0)]).rows[0]
    assert c.predicted_lo_s < c.predicted_s < c.predicted_hi_s
    exact = validate(MODEL, [row(2.0, True, 1.0)]).rows[0]
    assert exact.predicted_lo_s == pytest.approx(exact.predicted_s, rel=1e-12)
    assert exact.predicted_hi_s == pytest.approx(exact.predicted_s, rel=1e-12)


def test_a_run_counts_inside_the_interval_between_its_ends_and_the_report_counts_them():
    noisy = LatencyModel(
        target=MODEL.target, draft=MODEL.draft, max_num_seqs=64, relative_sd_off=0.05, relative_sd_on=0.05
    )
    (probe,) = validate(noisy, [row(2.0, True, 1.0)]).rows
    lo, hi = probe.predicted_lo_s, probe.predicted_hi_s
    rows = [
        row(2.0, True, probe.predicted_s),  # the prediction itself
        row(2.0, True, lo),  # the interval's ends belong to it
        row(2.0, True, hi),
        row(2.0, True, lo * 0.99),  # just outside, either side
        row(2.0, True, hi * 1.01),
        row(9.0, True, 120.0, saturated=True),  # measured saturated: not checked
        row(2.0 * off_limit(), False, 1.0),  # called overloaded: not checked
    ]
    rep = validate(noisy, rows)
    assert [c.inside_interval for c in rep.rows] == [True, True, True, False, False, None, None]
    assert rep.interval_coverage == (3, 5)
    off, on = rep.modes
    assert (on.interval_inside, on.interval_runs) == (3, 5)
    assert (off.interval_inside, off.interval_runs) == (0, 0)
    assert abs(INTERVAL_COVERAGE - 0.90) < 5e-4  # two-sided at INTERVAL_Z = 1.645


def test_saturated_run_has_no_error_and_is_flagged_only_if_predicted_overloaded():
    rep = validate(
        MODEL,
        [
            row(1.0, False, predicted(1.0, False) / 1.05),
            row(7.0, False, 50.0, saturated=True),  # model: overloaded → flagged
            row(2.0, False, 50.0, saturated=True),  # model: fine → not flagged
        ],
    )
    ok, flagged, missed = rep.rows
    assert ok.error == pytest.approx(0.05, rel=1e-9)
    assert flagged.error is None and flagged.predicted_overloaded and flagged.measured_saturated
    assert missed.error is None and not missed.predicted_overloaded and missed.measured_saturated
    assert not rep.saturated_all_flagged
    (mode,) = rep.modes
    assert (mode.runs, mode.saturated_runs, mode.saturated_flagged, mode.false_overloads) == (3, 2, 1, 0)
    # The 50 s the saturated runs "measured" never reaches an error figure.
    assert mode.mean_abs_error == pytest.approx(0.05, rel=1e-9)
    assert mode.worst_error == pytest.approx(0.05, rel=1e-9)
    assert rep.mean_abs_error == pytest.approx(0.05, rel=1e-9)
    assert rep.worst_abs_error == pytest.approx(0.05, rel=1e-9)
    assert validate(MODEL, [row(7.0, False, 50.0, saturated=True)]).saturated_all_flagged


def test_steady_run_the_model_calls_overloaded_is_a_false_overload_without_error():
    rep = validate(MODEL, [row(7.0, False, 3.0, saturated=False), row(8.0, False, 4.0)])
    assert [c.error for c in rep.rows] == [None, None]
    assert all(c.predicted_overloaded for c in rep.rows)
    (mode,) = rep.modes
    assert mode.false_overloads == 2
    assert mode.mean_abs_error is None and mode.worst_error is None
    assert rep.mean_abs_error is None and rep.worst_abs_error is None
    assert rep.saturated_all_flagged  # vacuously: nothing saturated


def test_a_steady_run_between_the_recompute_limit_and_the_full_cache_is_metastable_not_false():
    # 1,000-token prompts fill a 100k-token cache at ~80 sequences, far below max_num_seqs.
    model = LatencyModel(
        target=StepCost(0.010, 2e-5, context_s_per_token=2e-8), draft=StepCost(0.001, 2e-6), max_num_seqs=256,
        kv_cache_tokens_off=100_000, kv_cache_tokens_on=100_000,
    )  # fmt: skip
    off, _ = curves(model, 0.5, 1, Workload(1000.0, 250.0, 250.0))
    lo, hi = off.metastable_band_rps
    assert off.limit_reason == "kv_recompute" and lo < hi == off.cache_fill_limit_rps

    def run(rate: float, saturated: bool) -> LoadRow:
        return LoadRow(rate, False, 0, 0.0, 60.0, 1000.0, 250.0, 2, 250.0, saturated)

    band = (lo + hi) / 2
    rep = validate(model, [run(0.5 * lo, False), run(band, False), run(1.1 * hi, True)])
    low, mid, top = rep.rows
    assert not low.metastable and mid.metastable and mid.predicted_overloaded and mid.error is None
    assert top.predicted_overloaded and not top.metastable
    (mode,) = rep.modes
    assert (mode.false_overloads, mode.metastable_runs) == (0, 1)
    assert mode.limit_cache_fill_rps == pytest.approx(hi)
    assert mode.limit_error == 0.0  # the band [lo, hi) overlaps the measured (band, 1.1·hi)
    # Past the band a steady run is a false overload, and the band's top is what misses.
    rep = validate(model, [run(0.5 * lo, False), run(1.05 * hi, False), run(1.1 * hi, True)])
    (mode,) = rep.modes
    assert (mode.false_overloads, mode.metastable_runs) == (1, 0)
    assert mode.limit_error == pytest.approx((hi - 1.05 * hi) / (1.05 * hi))


# --------------------------------------------------------------------------------------------
# Per mode
# --------------------------------------------------------------------------------------------


def test_mode_summary_mean_and_signed_worst():
    errors = {1.0: 0.05, 2.0: -0.10, 3.0: 0.02}
    rows = [row(r, False, predicted(r, False) / (1 + e)) for r, e in errors.items()]
    rows += [row(r, True, predicted(r, True) / (1 + e)) for r, e in ((1.0, 0.01), (2.0, 0.03))]
    rep = validate(MODEL, rows)
    assert [m.mode for m in rep.modes] == ["off", "on(γ=4)"]
    off, on = rep.modes
    assert off.runs == 3 and on.runs == 2
    assert off.mean_abs_error == pytest.approx((0.05 + 0.10 + 0.02) / 3, rel=1e-9)
    assert off.worst_error == pytest.approx(-0.10, rel=1e-9)  # signed: the model was 10 % low
    assert on.mean_abs_error == pytest.approx(0.02, rel=1e-9)
    assert on.worst_error == pytest.approx(0.03, rel=1e-9)
    assert rep.mean_abs_error == pytest.approx((0.05 + 0.10 + 0.02 + 0.01 + 0.03) / 5, rel=1e-9)
    assert rep.worst_abs_error == pytest.approx(0.10, rel=1e-9)
    assert [c.row.rate for c in rep.rows] == [1.0, 2.0, 3.0, 1.0, 2.0]  # input order kept


def test_draft_lengths_are_separate_modes():
    r2 = LoadRow(1.0, True, 2, ACCEPTANCE_RATE, 1.0, PROMPT, GEN, 0, GEN_STD)
    r4 = row(1.0, True, 1.0)
    rep = validate(MODEL, [r4, r2])
    assert [m.mode for m in rep.modes] == ["on(γ=2)", "on(γ=4)"]
    alpha2 = float(alpha_from_vllm_rate(ACCEPTANCE_RATE, 2))
    assert rep.rows[1].predicted_s == pytest.approx(predict_point(MODEL, 1.0, alpha2, 2, WORKLOAD).latency_on_s)


@pytest.mark.parametrize(
    ("steady", "saturated", "bracket"),
    [
        ((1.0, 2.0, 4.0), (7.0, 8.0), (4.0, 7.0)),  # limit 6.2 inside
        ((1.0, 2.0, 4.0), (), (4.0, None)),  # never saturated, limit above the highest rate
        ((), (7.0,), (None, 7.0)),  # only a saturated run, limit below it
    ],
)
def test_limit_inside_the_measured_bracket_has_zero_error(steady, saturated, bracket):
    rows = [row(r, False, 1.0) for r in steady] + [row(r, False, 50.0, saturated=True) for r in saturated]
    (mode,) = validate(MODEL, rows).modes
    assert mode.limit_measured_rps == bracket
    assert mode.limit_predicted_rps == pytest.approx(off_limit(), rel=1e-12)
    assert mode.limit_error == 0.0


def test_limit_outside_the_bracket_is_the_relative_distance_to_its_edge():
    limit = off_limit()
    # Saturated already at 3 req/s: the model's limit is too high, by its distance from 3.
    (high,) = validate(MODEL, [row(1.0, False, 1.0), row(3.0, False, 50.0, saturated=True)]).modes
    assert high.limit_measured_rps == (1.0, 3.0)
    assert high.limit_error == pytest.approx((limit - 3.0) / 3.0, rel=1e-12)
    # Still steady at 8 req/s: the model's limit is too low.
    (low,) = validate(MODEL, [row(2.0, False, 1.0), row(8.0, False, 5.0, saturated=False)]).modes
    assert low.limit_measured_rps == (8.0, None)
    assert low.limit_error == pytest.approx((limit - 8.0) / 8.0, rel=1e-12)
    assert low.limit_error < 0 < high.limit_error


def test_bracket_uses_highest_steady_and_lowest_saturated_rate_in_any_order():
    rows = [
        row(8.0, False, 50.0, saturated=True),
        row(2.0, False, 1.0),
        row(6.5, False, 50.0, saturated=True),
        row(5.0, False, 1.0),
        row(1.0, False, 1.0),
    ]
    (mode,) = validate(MODEL, rows).modes
    assert mode.limit_measured_rps == (5.0, 6.5)
    assert mode.limit_error == 0.0  # 6.2 is inside


def test_capacity_is_what_the_lowest_saturated_rate_served():
    limit = off_limit()  # 6.2
    served = replace(row(6.5, False, 50.0, saturated=True), served_rps=5.9)
    later = replace(row(8.0, False, 90.0, saturated=True), served_rps=5.0)
    (mode,) = validate(MODEL, [row(2.0, False, 1.0), later, served]).modes
    assert mode.limit_error == 0.0  # inside the bracket (2, 6.5) ...
    assert mode.limit_served_rps == 5.9  # ... but 5 % past what the server managed
    assert mode.capacity_error == pytest.approx((limit - 5.9) / 5.9, rel=1e-12)
    # Not recorded (an older CSV), or nothing saturated: no capacity to compare with.
    (old,) = validate(MODEL, [row(2.0, False, 1.0), row(6.5, False, 50.0, saturated=True)]).modes
    (steady,) = validate(MODEL, [replace(row(2.0, False, 1.0), served_rps=2.0)]).modes
    assert old.limit_served_rps is old.capacity_error is steady.limit_served_rps is steady.capacity_error is None


def test_unrecorded_saturation_counts_as_steady():
    (mode,) = validate(MODEL, [row(1.0, False, 1.0), row(2.0, False, 1.0, saturated=None)]).modes
    assert mode.saturated_runs == 0
    assert mode.limit_measured_rps == (2.0, None)


# --------------------------------------------------------------------------------------------
# The runs at one rate, pooled (replicates on other arrival seeds)
# --------------------------------------------------------------------------------------------


def test_runs_at_one_rate_are_judged_by_their_mean():
    # Two draws 8 % above and 4 % below the prediction: each run alone misses by 7.4 % and
    # 4.2 %, their mean by 2 % (1/(1.02) of the prediction).
    pred = predicted(3.0, False)
    rows = [row(3.0, False, pred * 1.08), row(3.0, False, pred * 0.96), row(1.0, False, predicted(1.0, False))]
    rep = validate(MODEL, rows)
    assert len(rep.rows) == 3 and rep.replicated
    three, one = rep.points
    assert (three.rate, len(three.runs), one.rate, len(one.runs)) == (3.0, 2, 1.0, 1)
    assert three.measured_s == pytest.approx(pred * 1.02, rel=1e-12)
    assert three.predicted_s == pytest.approx(pred, rel=1e-12)
    assert three.error == pytest.approx(1 / 1.02 - 1, rel=1e-9)
    # The standard error of a two-run mean: half their difference.
    assert three.measured_se_s == pytest.approx(pred * 0.06, rel=1e-9)
    assert three.error_in_se == pytest.approx(-0.02 / 0.06, rel=1e-9)  # a third of one: the runs' own spread
    assert one.error_in_se is None
    assert three.beyond_noise is False and one.beyond_noise is None
    assert one.measured_se_s is None and one.error == pytest.approx(0.0, abs=1e-12)
    (off,) = rep.modes
    assert (off.runs, off.points) == (3, 2)
    assert off.mean_abs_error == pytest.approx(abs(1 / 1.02 - 1) / 2, rel=1e-9)
    assert rep.worst_abs_error == pytest.approx(abs(1 / 1.02 - 1), rel=1e-9)
    # Each run keeps its own error too.
    assert [c.error for c in rep.rows[:2]] == [pytest.approx(1 / 1.08 - 1), pytest.approx(1 / 0.96 - 1)]


@pytest.mark.parametrize(("spread", "beyond"), [(0.02, True), (0.05, False)])
def test_a_miss_is_beyond_noise_only_past_students_t_of_the_runs(spread, beyond):
    # Three runs 1.10·(1 − s), 1.10, 1.10·(1 + s) of the prediction: se = 1.10·s/√3, the miss
    # 1/1.1 − 1 of the mean, 0.1·√3/(1.1·s) = 7.9 and 3.1 standard errors; t(2 dof) = 4.303 decides.
    pred = predicted(2.0, False)
    rows = [row(2.0, False, pred * 1.10 * (1 + k * spread)) for k in (-1, 0, 1)]
    (pt,) = validate(MODEL, rows).points
    assert pt.measured_se_s == pytest.approx(pred * 1.10 * spread / math.sqrt(3), rel=1e-9)
    assert pt.error_in_se == pytest.approx(-0.10 / (1.10 * spread / math.sqrt(3)), rel=1e-9)
    assert pt.beyond_noise is beyond


def test_one_run_per_rate_is_exactly_the_per_run_report():
    rows = [row(r, sd, predicted(r, sd) * (1 + 0.01 * r)) for sd in (False, True) for r in (1.0, 2.0, 3.0)]
    rep = validate(MODEL, rows)
    assert not rep.replicated
    assert [p.error for p in rep.points] == [c.error for c in rep.rows]
    assert [m.runs for m in rep.modes] == [m.points for m in rep.modes] == [3, 3]


@pytest.mark.parametrize(
    ("saturated", "point_saturated"),
    [((False, False, True), False), ((True, False), True), ((True, True, False), True)],
)
def test_a_rate_is_saturated_when_at_least_half_its_runs_are(saturated, point_saturated):
    pred = predicted(4.0, False)
    rows = [row(4.0, False, pred * (100.0 if s else 1.1), saturated=s) for s in saturated]
    (pt,) = validate(MODEL, rows).points
    assert pt.saturated_runs == sum(saturated)
    assert pt.measured_saturated is point_saturated
    if point_saturated:
        assert pt.measured_s is None and pt.error is None
    else:  # the steady runs' mean; the saturated one does not enter it
        assert pt.measured_s == pytest.approx(pred * 1.1, rel=1e-12)
        assert pt.error == pytest.approx(1 / 1.1 - 1, rel=1e-9)


def test_the_limit_bracket_and_the_flag_read_the_rates_not_the_runs():
    over = 1.1 * off_limit()  # the model calls it overloaded
    rows = [row(3.0, False, predicted(3.0, False)), row(over, False, 50.0, saturated=True)]
    rows += [row(over, False, 40.0, saturated=False)]  # one lucky draw of two: the rate still saturated
    rep = validate(MODEL, rows)
    (off,) = rep.modes
    assert off.limit_measured_rps == (3.0, over)
    assert (off.saturated_runs, off.saturated_flagged, off.false_overloads) == (1, 1, 0)
    assert rep.saturated_all_flagged


def test_replicated_rates_pair_by_their_means_for_the_break_even():
    # Off at 2 req/s run twice (1.0 and 1.2 s): speedup 1.1 / 1.0 there, not whichever came last.
    rows = speedup_rows({1.0: 1.25, 3.0: 0.9})
    rows += [row(2.0, False, 1.0), row(2.0, False, 1.2), row(2.0, True, 1.0)]
    (be,) = validate(MODEL, rows).break_even
    assert be.measured_rps == pytest.approx(2.0 + 0.1 / 0.2, rel=1e-12)


# --------------------------------------------------------------------------------------------
# Break-even
# --------------------------------------------------------------------------------------------


def speedup_rows(speedups: dict[float, float | str]) -> list[LoadRow]:
    """Off runs at 1 s; SD runs at 1/speedup, or saturated ('on-sat', 'off-sat', 'both-sat')."""
    rows = []
    for rate, s in speedups.items():
        rows.append(row(rate, False, 1.0, saturated=s in ("off-sat", "both-sat")))
        if isinstance(s, str):
            rows.append(row(rate, True, 1.0, saturated=s in ("on-sat", "both-sat")))
        else:
            rows.append(row(rate, True, 1.0 / s))
    return rows


def predicted_break_even() -> float:
    be = break_even_rates(MODEL, ALPHA, GAMMA, WORKLOAD, thresholds=(1.0,))[1.0].rate_rps
    assert be is not None
    return be


def test_measured_break_even_interpolates_the_first_crossing():
    rep = validate(MODEL, speedup_rows({1.0: 1.25, 2.0: 1.1, 3.0: 0.9, 4.0: 1.2, 5.0: 0.5}))
    (be,) = rep.break_even
    assert be.draft_length == GAMMA
    # Speedup 1.1 at 2, 0.9 at 3: crosses 1 halfway. The later recovery above 1 is ignored.
    assert be.measured_rps == pytest.approx(2.5, rel=1e-12)
    assert be.measured_between_rps == (2.0, 3.0)
    assert be.refine_rps == (2.2, 2.4, 2.6, 2.8)  # 2 and 3 are 40 % apart: four rates between, at most
    assert be.predicted_rps == pytest.approx(predicted_break_even(), rel=1e-9)
    assert 2.7 < be.predicted_rps < 2.95  # pinned: the draft's first pass covers the γ+1 verified tokens
    assert be.error == pytest.approx((be.predicted_rps - 2.5) / 2.5, rel=1e-9)


@pytest.mark.parametrize(
    ("low", "high", "rates"),
    [
        (4.0, 5.0, (4.2, 4.4, 4.6, 4.8)),  # a fifth of the rate: steps of 0.2, 4.3–4.8 % of it
        (5.0, 5.5, (5.25,)),
        (10.0, 12.0, (10.5, 11.0, 11.5)),
        (1.0, 2.0, (1.2, 1.4, 1.6, 1.8)),  # two thirds of the rate: no more than four rates
        (4.5, 4.7, ()),  # already within 5 %
    ],
)
def test_refine_rates_cut_a_bracket_into_steps_of_at_most_five_percent(low, high, rates):
    assert refine_rates(low, high) == rates


def test_measured_break_even_ignores_row_order():
    rows = speedup_rows({1.0: 1.5, 3.0: 0.5, 2.0: 1.2})
    (be,) = validate(MODEL, list(reversed(rows))).break_even
    assert be.measured_rps == pytest.approx(2.0 + 0.2 / 0.7, rel=1e-12)


def test_the_speedup_at_a_rate_is_read_over_runs_that_served_the_same_requests():
    # At 2 req/s SD ran on two arrival seeds, the server without SD on one (heavy: 1.2 s). On that
    # seed SD took 1.25 s (speedup 0.96); its other seed, lighter, took 0.9 s. Over the modes'
    # means the speedup is 1.2 / 1.075 = 1.12 and the crossing moves past 2 req/s on the seeds alone.
    heavy, light = 60.0, 40.0
    rows = speedup_rows({1.0: 1.25, 3.0: 0.5})
    rows += [
        replace(row(2.0, False, 1.2), mean_gen_tokens=heavy),
        replace(row(2.0, True, 1.25), mean_gen_tokens=heavy),
        replace(row(2.0, True, 0.9), mean_gen_tokens=light),
    ]
    (be,) = validate(MODEL, rows).break_even
    s2 = 1.2 / 1.25
    assert be.measured_rps == pytest.approx(1.0 + 0.25 / (1.25 - s2), rel=1e-12)
    assert be.measured_between_rps == (1.0, 2.0)
    # No run of one mode served the other's requests: the points' means, as before.
    rows[-3] = replace(rows[-3], mean_gen_tokens=50.5)
    (be,) = validate(MODEL, rows).break_even
    s2 = 1.2 / 1.075
    assert be.measured_rps == pytest.approx(2.0 + (s2 - 1.0) / (s2 - 0.5), rel=1e-12)
    assert be.measured_between_rps == (2.0, 3.0)


def test_runs_read_from_one_load_test_are_paired_whatever_their_means():
    # Near a limit a run leaves requests unfinished, and the two modes' means over one seed's
    # requests differ: the load test a run was read from says which runs share arrivals.
    rows = [replace(r, source="seed0.csv") for r in speedup_rows({1.0: 1.25, 3.0: 0.5})]
    rows += [
        replace(row(2.0, False, 1.2), source="seed0.csv", mean_gen_tokens=60.0),
        replace(row(2.0, True, 1.25), source="seed0.csv", mean_gen_tokens=59.0),
        replace(row(2.0, True, 0.9), source="seed1.csv"),
    ]
    (be,) = validate(MODEL, rows).break_even
    assert be.measured_rps == pytest.approx(1.0 + 0.25 / (1.25 - 1.2 / 1.25), rel=1e-12)


def test_read_load_csv_names_each_run_s_file(tmp_path):
    path = write_load_csv(tmp_path / "load.csv", [csv_row(1.0, False, 1.0), csv_row(1.0, True, 0.8)])
    rows, _ = cal_mod.read_load_csv(path)
    assert [r.source for r in rows] == [str(path)] * 2


def test_speedup_below_one_at_the_lowest_rate_is_break_even_there():
    (be,) = validate(MODEL, speedup_rows({1.0: 0.8, 2.0: 0.7})).break_even
    assert be.measured_rps == 1.0
    assert be.measured_between_rps is None  # below the lowest rate measured: no bracket


def test_never_crossed_within_the_measured_rates():
    (be,) = validate(MODEL, speedup_rows({1.0: 1.3, 2.0: 1.2, 3.0: 1.01})).break_even
    assert be.measured_rps is None and be.error is None
    assert be.predicted_rps == pytest.approx(predicted_break_even(), rel=1e-9)


def test_sd_saturating_first_is_a_crossing_toward_zero_speedup():
    # SD saturated at 3 while off is steady: speedup 0 there, linear from 1.1 at 2.
    (be,) = validate(MODEL, speedup_rows({1.0: 1.2, 2.0: 1.1, 3.0: "on-sat"})).break_even
    assert be.measured_rps == pytest.approx(2.0 + 0.1 / 1.1, rel=1e-12)


def test_only_sd_keeping_up_is_not_a_crossing_and_both_saturated_is_dropped():
    (be,) = validate(MODEL, speedup_rows({1.0: 1.2, 2.0: "off-sat", 3.0: "both-sat"})).break_even
    assert be.measured_rps is None
    # Off saturated (speedup +inf) then SD below 1: the crossing is the later rate itself.
    (be,) = validate(MODEL, speedup_rows({1.0: 1.2, 2.0: "off-sat", 3.0: 0.5})).break_even
    assert be.measured_rps == 3.0


def test_break_even_needs_two_paired_rates():
    rows = [row(1.0, False, 1.0), row(1.0, True, 0.8), row(2.0, True, 0.9)]  # SD at 2 has no off run
    assert validate(MODEL, rows).break_even == ()
    assert validate(MODEL, [row(1.0, False, 1.0), row(2.0, False, 1.0)]).break_even == ()


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


@pytest.fixture
def calibration_file(tmp_path: Path) -> Path:
    cal = cal_mod.calibrate(bench_rows(MODEL, batch_sizes=(1, 2, 4, 8, 16, 32, 64), iterations=12, seed=3))
    path = tmp_path / "cal.json"
    cal_mod.save(cal, path)
    return path


def write_load_csv(path: Path, rows: list[dict[str, object]]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=[*LOAD_COLUMNS, *LOAD_OPTIONAL_COLUMNS])
        w.writeheader()
        for r in rows:
            w.writerow(r)
    return path


def csv_row(rate: float, sd: bool, measured_s: float, saturated: bool = False) -> dict[str, object]:
    return {
        "rate": rate,
        "sd": "on" if sd else "off",
        "draft_length": GAMMA if sd else 0,
        "acceptance_rate": ACCEPTANCE_RATE if sd else "",
        "mean_e2e_s": repr(measured_s),
        "mean_prompt_tokens": PROMPT,
        "mean_gen_tokens": GEN,
        "gen_tokens_std": GEN_STD,
        "prompt_tokens_std": "",
        "saturated": 1 if saturated else 0,
    }


def run_cli(monkeypatch: pytest.MonkeyPatch, *argv: str) -> int:
    monkeypatch.setattr(sys, "argv", ["sd-controller"])  # main() rewrites it; restored after the test
    return main(["validate", *argv])


@pytest.fixture
def load_csv(tmp_path: Path, calibration_file: Path) -> Path:
    """Runs measured 5 % below the calibration's predictions (error +5 % each), one saturated."""
    model = cal_mod.load(calibration_file).latency_model()
    rows = [csv_row(r, sd, predicted(r, sd, model) / 1.05) for sd in (False, True) for r in (1.0, 2.0, 3.0, 4.0)]
    rows.append(csv_row(9.0, False, 120.0, saturated=True))
    return write_load_csv(tmp_path / "load.csv", rows)


def test_cli_json_report(monkeypatch, capsys, calibration_file, load_csv):
    assert run_cli(monkeypatch, str(calibration_file), str(load_csv), "--json") == 0
    out = capsys.readouterr().out
    report = json.loads(out)
    model = cal_mod.load(calibration_file).latency_model()
    assert report["mean_abs_error"] == pytest.approx(0.05, rel=1e-9)
    assert report["worst_abs_error"] == pytest.approx(0.05, rel=1e-9)
    assert report["saturated_all_flagged"] is True
    rows = report["rows"]
    assert [r["line"] for r in rows] == list(range(2, 11))
    assert [r["mode"] for r in rows] == ["off"] * 4 + ["on(γ=4)"] * 4 + ["off"]
    for r in rows[:8]:
        assert r["error"] == pytest.approx(0.05, rel=1e-9)
        assert r["predicted_s"] == pytest.approx(predicted(r["rate_rps"], r["mode"] != "off", model), rel=1e-12)
        assert r["predicted_overloaded"] is False and r["measured_saturated"] is False
        assert r["offered_rps"] == r["rate_rps"]  # the file records no sent/duration
    sat = rows[8]
    assert sat["rate_rps"] == 9.0 and sat["measured_s"] == 120.0
    assert sat["measured_saturated"] is True and sat["predicted_overloaded"] is True
    assert sat["predicted_s"] is None and sat["error"] is None  # +inf is not JSON
    assert sat["predicted_interval_s"] == [None, None]
    assert sat["inside_interval"] is None
    inside = [lo <= r["measured_s"] <= hi for r in rows[:8] for lo, hi in [r["predicted_interval_s"]]]
    assert [r["inside_interval"] for r in rows[:8]] == inside
    assert report["interval_coverage"] == {"inside": sum(inside), "runs": 8, "nominal": INTERVAL_COVERAGE}
    off, on = report["modes"]
    assert (off["mode"], off["runs"], off["saturated_runs"], off["saturated_flagged"]) == ("off", 5, 1, 1)
    assert off["limit_measured_rps"] == [4.0, 9.0]
    assert off["limit_error"] == 0.0
    limit_off, _ = curves(model, ALPHA, GAMMA, WORKLOAD)
    assert off["limit_predicted_rps"] == pytest.approx(limit_off.stability_limit_rps, rel=1e-12)
    assert off["limit_reason"] == limit_off.limit_reason in LIMIT_REASONS
    assert (on["mode"], on["runs"], on["mean_abs_error"]) == ("on(γ=4)", 4, pytest.approx(0.05, rel=1e-9))
    assert (off["interval_inside"], off["interval_runs"]) == (sum(inside[:4]), 4)
    assert (on["interval_inside"], on["interval_runs"]) == (sum(inside[4:]), 4)
    assert on["limit_measured_rps"] == [4.0, None]
    (be,) = report["break_even"]
    assert be["draft_length"] == GAMMA
    expected_be = break_even_rates(model, ALPHA, GAMMA, WORKLOAD, thresholds=(1.0,))[1.0].rate_rps
    assert be["predicted_rps"] == pytest.approx(expected_be, rel=1e-9)
    # Measured latencies are the predictions scaled alike, so the measured speedup is the
    # predicted one at each rate: SD ahead at 2 req/s and behind at 3 on this calibration.
    assert 2.0 < be["measured_rps"] < 3.0
    assert be["measured_between_rps"] == [2.0, 3.0]
    assert be["refine_rps"] == [2.2, 2.4, 2.6, 2.8]  # what to run to pin the crossing


def test_cli_plot_writes_a_png(monkeypatch, capsys, tmp_path, calibration_file, load_csv):
    png = tmp_path / "out.png"
    assert run_cli(monkeypatch, str(calibration_file), str(load_csv), "--json", "--plot", str(png)) == 0
    json.loads(capsys.readouterr().out)  # --plot does not spoil the JSON on stdout
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 5000


def test_cli_table_output(monkeypatch, capsys, calibration_file, load_csv):
    assert run_cli(monkeypatch, str(calibration_file), str(load_csv)) == 0
    out = capsys.readouterr().out
    assert "+5.0 %" in out
    assert "saturated (flagged)" in out
    assert "every saturated run flagged: yes" in out
    report = validate(cal_mod.load(calibration_file).latency_model(), cal_mod.read_load_csv(load_csv)[0])
    inside, checked = report.interval_coverage
    assert checked == 8
    assert f"measured inside the predicted interval: {inside} of 8 runs" in out
    assert "drawn for 90 %" in out
    assert "2–3" in out  # the measured rates the break-even lies between
    assert "2.2,2.4,2.6,2.8" in out  # and the rates that would pin it, as a --rates list


def test_cli_table_says_the_rate_a_run_was_predicted_at_where_it_sent_another(
    monkeypatch, capsys, tmp_path, calibration_file
):
    # 2 req/s for 600 s: 1,170 sent is 1.95 req/s (2.5 % short, said); 1,203 is 2.005 (0.25 %, not).
    model = cal_mod.load(calibration_file).latency_model()
    rows = [
        {**csv_row(2.0, False, predicted(2.0, False, model)), "duration_s": 600.0, "sent": sent}
        for sent in (1170, 1203)
    ]
    assert run_cli(monkeypatch, str(calibration_file), str(write_load_csv(tmp_path / "sent.csv", rows))) == 0
    out = capsys.readouterr().out
    assert out.count("predicted at the 1.95 req/s it sent") == 1
    assert "2.005" not in out


def test_cli_pools_the_runs_of_several_files(monkeypatch, capsys, tmp_path, calibration_file, load_csv):
    # The same test again on other arrivals, 15 % slower at 4 req/s off: that rate's point is
    # the mean of the two runs, each row names its file, the table shows the pooled rates.
    model = cal_mod.load(calibration_file).latency_model()
    again = write_load_csv(tmp_path / "again.csv", [csv_row(4.0, False, predicted(4.0, False, model) / 1.05 * 1.15)])
    assert run_cli(monkeypatch, str(calibration_file), str(load_csv), str(again), "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["file"] for r in report["rows"]] == ["load.csv"] * 9 + ["again.csv"]
    four = [p for p in report["points"] if p["mode"] == "off" and p["rate_rps"] == 4.0]
    assert len(four) == 1 and four[0]["runs"] == 2
    assert four[0]["error"] == pytest.approx(1.05 / 1.075 - 1, rel=1e-9)  # the mean: 1.075 / 1.05 of the prediction
    assert four[0]["error_in_se"] == pytest.approx((1.05 - 1.075) / 0.075, rel=1e-9)  # se: half the two runs' gap
    assert report["modes"][0]["runs"] == 6 and report["modes"][0]["points"] == 5
    assert run_cli(monkeypatch, str(calibration_file), str(load_csv), str(again)) == 0
    out = capsys.readouterr().out
    assert "again.csv:2" in out and "rates run more than once" in out and "every saturated rate flagged: yes" in out


def test_cli_a_bad_second_file_is_named(monkeypatch, capsys, tmp_path, calibration_file, load_csv):
    bad = write_load_csv(tmp_path / "bad.csv", [{**csv_row(1.0, False, 1.0), "sd": "maybe"}])
    assert run_cli(monkeypatch, str(calibration_file), str(load_csv), str(bad)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.csv:2" in err[0] and "column sd" in err[0]


def test_cli_plot_draws_pooled_rates(monkeypatch, capsys, tmp_path, calibration_file, load_csv):
    again = write_load_csv(tmp_path / "again.csv", [csv_row(r, False, 1.5) for r in (1.0, 2.0)])
    png = tmp_path / "pooled.png"
    assert run_cli(monkeypatch, str(calibration_file), str(load_csv), str(again), "--plot", str(png)) == 0
    assert f"wrote {png}" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_cli_refuses_load_tests_of_several_workloads(monkeypatch, capsys, tmp_path, calibration_file):
    # Their rates would pool into one point and their limits into one bracket.
    chat = write_load_csv(tmp_path / "chat.csv", [{**csv_row(1.0, False, 1.0), "workload": "chat"}])
    code = write_load_csv(tmp_path / "code.csv", [{**csv_row(1.0, False, 1.2), "workload": "code"}])
    assert run_cli(monkeypatch, str(calibration_file), str(chat), str(code)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "several workloads (chat, code): validate one workload at a time" in err[0]
    again = write_load_csv(tmp_path / "again.csv", [{**csv_row(1.0, False, 1.4), "workload": "chat"}])
    assert run_cli(monkeypatch, str(calibration_file), str(chat), str(again), "--json") == 0
    (point,) = json.loads(capsys.readouterr().out)["points"]
    assert point["runs"] == 2 and point["measured_s"] == pytest.approx(1.2)


@pytest.mark.parametrize(
    ("line", "mutate", "needle"),
    [
        (3, {"rate": "fast"}, "column rate"),
        (2, {"sd": "maybe"}, "column sd"),
        (4, {"saturated": "perhaps"}, "column saturated"),
        (3, {"acceptance_rate": "1.5", "sd": "on", "draft_length": 4}, "acceptance_rate"),
        (2, {"duration_s": "0"}, "column duration_s"),
        (3, {"duration_s": "600", "warmup_s": "600"}, "column warmup_s"),
        (4, {"duration_s": "600", "warmup_s": "soon"}, "column warmup_s"),
        (2, {"running_context_tokens": "0"}, "column running_context_tokens"),
        (3, {"running_context_tokens": "lots"}, "column running_context_tokens"),
        (4, {"running_context_tokens": "nan"}, "column running_context_tokens"),
        (2, {"sent": "-3"}, "column sent"),
        (3, {"sent": "12.5"}, "column sent"),
    ],
)
def test_cli_bad_csv_exits_2_with_one_line_naming_file_and_line(
    monkeypatch, capsys, tmp_path, calibration_file, line, mutate, needle
):
    rows = [csv_row(r, False, 1.0) for r in (1.0, 2.0, 3.0)]
    rows[line - 2] = {**rows[line - 2], **mutate}
    bad = write_load_csv(tmp_path / "bad.csv", rows)
    assert run_cli(monkeypatch, str(calibration_file), str(bad), "--json") == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert "\n" not in err
    assert f"{bad}:{line}:" in err
    assert needle in err


def test_cli_missing_column_names_the_file(monkeypatch, capsys, tmp_path, calibration_file):
    bad = tmp_path / "short.csv"
    bad.write_text("rate,sd\n1,off\n", encoding="utf-8")
    assert run_cli(monkeypatch, str(calibration_file), str(bad)) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(bad) in err and "mean_e2e_s" in err


def test_rowcheck_is_a_value():
    c = validate(MODEL, [row(1.0, False, 1.0)]).rows[0]
    assert isinstance(c, RowCheck)
    with pytest.raises(AttributeError):
        c.error = 0.0  # type: ignore[misc]


# --------------------------------------------------------------------------------------------
# A test of finite length
# --------------------------------------------------------------------------------------------


def test_a_run_that_records_its_length_is_compared_with_what_such_a_test_sees():
    # Near the limit the stationary mean is hours of queueing away; a 600 s test started empty
    # sees less, and validate predicts that. Far from it the two agree.
    from dataclasses import replace

    off, _ = curves(MODEL, ALPHA, GAMMA, WORKLOAD)
    near = 0.995 * off.stability_limit_rps
    quiet = replace(row(1.0, False, 1.0), duration_s=600.0, warmup_s=60.0)
    busy = replace(row(near, False, 1.0), duration_s=600.0, warmup_s=60.0)
    report = validate(MODEL, [quiet, busy, row(near, False, 1.0)])
    q, b, plain = report.rows
    assert q.predicted_s == pytest.approx(q.stationary_s, rel=1e-3)
    assert plain.predicted_s == plain.stationary_s == pytest.approx(off.latency_s(near))
    assert b.stationary_s == plain.predicted_s
    assert b.predicted_s < 0.9 * b.stationary_s
    assert b.predicted_s == pytest.approx(off.latency_in_window_s(near, 600.0, 60.0))
    assert b.predicted_lo_s <= b.predicted_s <= b.predicted_hi_s
    from controller.commands.validate import to_dict

    row_json = to_dict(report)["rows"][1]
    assert (row_json["predicted_s"], row_json["stationary_s"], row_json["duration_s"]) == (
        b.predicted_s,
        b.stationary_s,
        600.0,
    )


def test_a_measured_running_context_is_read_and_predicted_with(tmp_path):
    from controller.commands.validate import to_dict

    rows = [{**csv_row(4.0, False, 1.0), "running_context_tokens": 4000}, csv_row(4.0, False, 1.0)]
    parsed, _ = cal_mod.read_load_csv(write_load_csv(tmp_path / "load.csv", rows))
    assert (parsed[0].running_context_tokens, parsed[1].running_context_tokens) == (4000.0, None)
    reads_kv = replace(MODEL, target=StepCost(0.010, 0.001, context_s_per_token=1e-6))
    measured, derived = validate(reads_kv, parsed).rows
    # The same run with a longer batch context reads more KV per step: a slower prediction.
    assert parsed[1].workload().mean_context_tokens < 4000.0
    assert measured.predicted_s > 1.05 * derived.predicted_s
    assert validate(MODEL, parsed).rows[0].predicted_s == validate(MODEL, parsed).rows[1].predicted_s
    out = to_dict(validate(reads_kv, parsed))["rows"]
    assert (out[0]["running_context_tokens"], out[0]["running_context_measured"]) == (4000.0, True)
    assert out[1]["running_context_measured"] is False
    assert out[1]["running_context_tokens"] == pytest.approx(parsed[1].workload().mean_context_tokens)


def test_prefix_cache_hits_are_read_and_priced(tmp_path):
    from controller.commands.validate import to_dict

    rows = [
        {**csv_row(4.0, False, 1.0), "cached_prompt_tokens": 0.6 * PROMPT},
        csv_row(4.0, False, 1.0),
        {**csv_row(4.0, False, 1.0), "cached_prompt_tokens": ""},
    ]
    parsed, _ = cal_mod.read_load_csv(write_load_csv(tmp_path / "load.csv", rows))
    assert [r.cached_prompt_tokens for r in parsed] == [pytest.approx(0.6 * PROMPT), None, None]
    hit, cold, _ = validate(MODEL, parsed).rows
    assert hit.predicted_s < cold.predicted_s  # 60 % of the prompt is not computed
    out = to_dict(validate(MODEL, parsed))["rows"]
    assert [r["cached_prompt_tokens"] for r in out] == [pytest.approx(0.6 * PROMPT), 0.0, 0.0]
    bad = write_load_csv(tmp_path / "bad.csv", [{**csv_row(4.0, False, 1.0), "cached_prompt_tokens": -5}])
    with pytest.raises(InputError, match=r"bad.csv:2: column cached_prompt_tokens: -5 is negative"):
        cal_mod.read_load_csv(bad)


def test_the_window_columns_are_read_from_the_csv(tmp_path):
    rows = [{**csv_row(1.0, False, 1.0), "duration_s": 600, "warmup_s": 60}, csv_row(2.0, False, 1.0)]
    parsed, _ = cal_mod.read_load_csv(write_load_csv(tmp_path / "load.csv", rows))
    assert (parsed[0].duration_s, parsed[0].warmup_s) == (600.0, 60.0)
    assert (parsed[1].duration_s, parsed[1].warmup_s) == (None, 0.0)
