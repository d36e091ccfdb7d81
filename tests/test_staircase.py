"""The decode step's staircase: calibrate reads it off the bench, the chain runs on it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from controller.calibration import calibrate
from controller.model import (
    STAIR_MAX_GAP_TOKENS,
    LatencyModel,
    StepCost,
    Workload,
    curves,
    prompt_step_share,
    prompt_step_tread,
)
from controller.queueing import cumulative_log_rates, mean_time_in_system, mean_time_in_window
from controller.synthetic import bench_rows

LINE = LatencyModel(
    target=StepCost(0.006, 4e-5, context_s_per_token=2e-8, seq_s=1e-6),
    draft=StepCost(0.0008, 4e-6),
    sd_overhead_s=0.0003,
    max_num_batched_tokens=8192,
)
BATCHES = (1, 2, 4, *range(8, 257, 8))
TILE = 64


def tread(size: int, tile: int = TILE) -> float:
    """+4 % of a step just past a tile boundary (64 sequences unless told), falling to −4 % at the next."""
    return 0.04 - 0.08 * (((size - 1) % tile) / (tile - 1))


def with_staircase(rows):
    """The decode steps of the SD-off server on GEMM tiles: the step's cost moves with the tread."""
    return [replace(r, latency_s=r.latency_s * (1.0 + tread(r.batch_size))) if r.phase == "target" else r for r in rows]


def test_calibrate_reads_each_batch_sizes_residual_off_the_decode_rows():
    rows = bench_rows(LINE, batch_sizes=BATCHES, noise=0.005, iterations=8, seed=2)
    flat = calibrate(rows, max_num_batched_tokens=8192, warmup=3)
    stepped = calibrate(with_staircase(rows), max_num_batched_tokens=8192, warmup=3)
    assert [s.batch_size for s in stepped.phases.decode_staircase] == list(BATCHES)
    cost = {b: LINE.target.scalar(b, b * 640.0, b) for b in BATCHES}  # the rows' mean context
    # A line on a line: nothing left but noise.
    assert max(abs(s.residual_s) / cost[s.batch_size] for s in flat.phases.decode_staircase) < 0.01
    # On tiles each size's residual is its tread, less what the fitted line took of it (its
    # knees bend through the first tile).
    got = np.array([s.residual_s / cost[s.batch_size] for s in stepped.phases.decode_staircase if s.batch_size >= 8])
    want = np.array([tread(b) for b in BATCHES if b >= 8])
    assert np.corrcoef(got, want)[0, 1] > 0.9
    past_first = np.array([b >= TILE for b in BATCHES if b >= 8])
    assert np.abs(got - want)[past_first].max() < 0.015
    model = stepped.latency_model()
    assert model.decode_staircase_off == tuple(
        (float(s.batch_size), s.residual_s) for s in stepped.phases.decode_staircase
    )


def test_a_zero_staircase_changes_nothing():
    w = Workload(900.0, 280.0, 200.0, 500.0)
    plain, _ = curves(LINE, 0.7, 2, w)
    zero, _ = curves(replace(LINE, decode_staircase_off=((1.0, 0.0), (256.0, 0.0))), 0.7, 2, w)
    np.testing.assert_allclose(zero.cum_log_rates, plain.cum_log_rates, rtol=0, atol=1e-12)
    assert zero.stability_limit_rps == pytest.approx(plain.stability_limit_rps, rel=1e-12)
    for rate in (2.0, 0.8 * plain.stability_limit_rps):
        assert zero.latency_s(rate) == pytest.approx(plain.latency_s(rate), rel=1e-12)


def test_a_dear_tread_slows_the_states_on_it_and_is_not_smoothed_away():
    w = Workload(900.0, 280.0, 200.0, 500.0)
    plain, _ = curves(LINE, 0.7, 2, w)
    # Benched every 8: the step costs 1 ms more from 136 to 184 sequences, as much less at 256
    # (a tile boundary).
    table = sampled(lambda b: 0.001 if 136 <= b <= 184 else -0.001 if b == 256 else 0.0, (1, *range(8, 257, 8)))
    stepped, _ = curves(replace(LINE, decode_staircase_off=table), 0.7, 2, w)
    h, h0 = np.exp(np.diff(stepped.cum_log_rates)), np.exp(np.diff(plain.cum_log_rates))
    n = np.arange(1, h.size + 1)
    assert np.allclose(h[:128], h0[:128])
    on_tread = (n >= 136) & (n <= 184)
    assert (h[on_tread] < h0[on_tread]).all()
    assert h[135] < h[127]  # a busier state finishes fewer per second: the server runs them all
    # The limit is set at the bound, where the step is 1 ms cheaper: the limit rises with it.
    assert stepped.stability_limit_rps / plain.stability_limit_rps == pytest.approx(h[-1] / h0[-1], rel=1e-9)
    assert stepped.stability_limit_rps > plain.stability_limit_rps
    # A load whose batch sits on the tread waits longer than on the smooth line.
    busy = next(r for r in np.linspace(1.0, plain.stability_limit_rps, 200) if plain.batch(r) > 150)
    assert stepped.latency_s(busy) > 1.01 * plain.latency_s(busy)


def sampled(residual, sizes) -> tuple[tuple[float, float], ...]:
    """A staircase table as calibrate writes it: the residual at each size benchmarked."""
    return tuple((float(x), residual(x)) for x in sizes)


def test_sizes_too_far_apart_to_place_a_riser_add_nothing_between_them():
    # Two dear sizes 64 tokens apart (a tile at most): whatever lies between was never seen, and
    # a slope drawn through it aliases the risers. The residuals hold at the sizes measured.
    w = Workload(900.0, 280.0, 200.0, 500.0)
    far = sampled(lambda b: 0.001 if b in (128, 192) else 0.0, (1, 8, 16, 32, 64, 128, 192, 256))
    near = sampled(lambda b: 0.001 if 128 <= b <= 192 else 0.0, (1, *range(8, 257, 8)))
    plain, _ = curves(LINE, 0.7, 2, w)
    h0 = np.exp(np.diff(plain.cum_log_rates))
    n = np.arange(1, h0.size + 1)
    for table, between_dear in ((far, False), (near, True)):
        curve, _ = curves(replace(LINE, decode_staircase_off=table), 0.7, 2, w)
        h = np.exp(np.diff(curve.cum_log_rates))
        inside = (n > 128) & (n < 192)
        assert (h[n == 128] < h0[n == 128]).all() and (h[n == 192] < h0[n == 192]).all()
        if between_dear:
            assert (h[inside] < h0[inside]).all()
        else:
            np.testing.assert_allclose(h[inside], h0[inside], rtol=1e-12)
    assert STAIR_MAX_GAP_TOKENS < 64  # half a tile of the smallest GEMM tiles vLLM runs


def test_a_window_over_a_chain_that_dips_stays_a_probability():
    # The fastest state is not the last: the uniformized grid must be set by the fastest.
    rates = np.concatenate((np.linspace(1.0, 50.0, 100), np.full(100, 30.0)))
    cum = cumulative_log_rates(rates, monotone=False)
    got = mean_time_in_window(20.0, cum, 30.0, duration_s=2000.0, warmup_s=200.0)
    assert np.isfinite(got)
    assert got == pytest.approx(mean_time_in_system(20.0, cum, 30.0), rel=0.02)
    assert (np.diff(cumulative_log_rates(rates)) >= np.diff(cum) - 1e-12).all()  # monotone keeps the best


TOKEN_TILE = 128


def token_tread(tokens: int) -> float:
    """The SD step's tread: 128-token tiles."""
    return tread(tokens, TOKEN_TILE)


def with_token_staircase(rows):
    """The SD server's verify steps on token tiles: a step of B sequences at γ runs B·(γ + 1)."""
    return [
        replace(r, latency_s=r.latency_s * (1.0 + token_tread(r.batch_size * (r.draft_length + 1))))
        if r.phase == "verify"
        else r
        for r in rows
    ]


def test_calibrate_reads_the_sd_steps_residual_per_step_tokens_every_draft_length_together():
    rows = bench_rows(LINE, batch_sizes=BATCHES, noise=0.005, iterations=8, seed=3)
    stepped_rows = with_token_staircase(rows)  # the target's tiles count tokens
    flat = calibrate(rows, max_num_batched_tokens=8192, warmup=3)
    stepped = calibrate(stepped_rows, max_num_batched_tokens=8192, warmup=3)
    tokens = sorted({b * (g + 1) for b in BATCHES for g in (2, 4)})
    assert [s.step_tokens for s in stepped.phases.verify_staircase] == tokens
    assert [s.step_tokens for s in flat.phases.verify_staircase] == tokens

    def cost(t: int) -> float:  # the mean verify step of that size over the draft lengths run it
        steps = [
            (r.latency_s / (1.0 + token_tread(t)), r)
            for r in stepped_rows
            if r.phase == "verify" and r.iteration >= 3 and r.batch_size * (r.draft_length + 1) == t
        ]
        return float(np.mean([s for s, _ in steps]))

    assert max(abs(s.residual_s) / cost(s.step_tokens) for s in flat.phases.verify_staircase) < 0.01
    got = np.array([s.residual_s / cost(s.step_tokens) for s in stepped.phases.verify_staircase])
    want = np.array([token_tread(t) for t in tokens])
    assert np.corrcoef(got, want)[0, 1] > 0.9
    big = np.array(tokens) >= 2 * TOKEN_TILE
    assert np.abs(got - want)[big].max() < 0.02
    # ... and where its risers are: every tile (treads.tile_period), which the chain places them by.
    notes = " ".join(stepped.phases.draft.fit.notes)
    assert "SD step staircase: risers every 128 tokens" in notes, notes
    assert not any("risers" in n for n in flat.phases.draft.fit.notes + flat.phases.target.fit.notes)
    # The SD-off decode rows are untouched: their staircase stays flat.
    assert max(abs(s.residual_s) for s in stepped.phases.decode_staircase) < 0.01 * LINE.target.scalar(256, 256 * 640)
    model = stepped.latency_model()
    assert model.verify_staircase_on == tuple(
        (float(s.step_tokens), s.residual_s) for s in stepped.phases.verify_staircase
    )


def test_the_sd_chain_reads_the_staircase_at_its_step_tokens_and_adds_nothing_past_it():
    w = Workload(900.0, 280.0, 200.0, 500.0)
    # Benched every 24 tokens: the SD step costs 1 ms more from 312 to 432 target tokens; the
    # table ends at 600, dear.
    table = sampled(lambda t: 0.001 if 312 <= t <= 432 else 0.0005 if t == 600 else 0.0, (3, *range(24, 601, 24)))
    stepped = replace(LINE, verify_staircase_on=table)
    for gamma in (2, 4):
        off0, on0 = curves(LINE, 0.7, gamma, w)
        off, on = curves(stepped, 0.7, gamma, w)
        np.testing.assert_array_equal(off.cum_log_rates, off0.cum_log_rates)  # SD off reads its own
        h, h0 = np.exp(np.diff(on.cum_log_rates)), np.exp(np.diff(on0.cum_log_rates))
        tokens = np.arange(1, h.size + 1) * (gamma + 1)
        on_tread = (tokens >= 312) & (tokens <= 432)
        assert on_tread.any() and (h[on_tread] < h0[on_tread]).all()
        assert np.allclose(h[tokens <= 288], h0[tokens <= 288])
        assert (h[tokens == 600] < h0[tokens == 600]).all()
        assert np.allclose(h[tokens > 600], h0[tokens > 600])  # past the table: nothing known


def _step_s(curve) -> np.ndarray:
    """T(n) = n / h(n): each state's time a request spends, off the chain's departure rates."""
    h = np.exp(np.diff(curve.cum_log_rates))
    return np.arange(1, h.size + 1) / h


def _tread_share(model: LatencyModel, workload: Workload, tread_s: float) -> np.ndarray:
    """Each state's added time over the line's chain, in whole treads of the request's steps."""
    plain, _ = curves(replace(model, decode_staircase_off=(), prompt_step_treads=()), 0.7, 2, workload)
    on, _ = curves(model, 0.7, 2, workload)
    return (_step_s(on) - _step_s(plain)) / tread_s


R_TREAD = 0.002
FLAT = replace(LINE, decode_staircase_off=sampled(lambda b: R_TREAD, BATCHES))
DECODE_ONLY = Workload(0.0, 280.0, 200.0, 500.0)
PROMPTED = Workload(900.0, 280.0, 200.0, 500.0)


def test_a_step_carrying_a_prompt_keeps_the_measured_share_of_the_tread():
    # A prompt chunk moves the step's tokens to B + C, anywhere on the tiles: its passes cost the
    # line, except what the chunk does not touch (prompt_step_share of the steps carry one).
    steps = curves(LINE, 0.7, 2, DECODE_ONLY)[0].steps
    tread_s = (steps + 0.5) * R_TREAD  # the request's steps and the half step it waits for
    for share in (0.0, 0.5):
        model = replace(FLAT, prompt_step_treads=((0.0, share),))
        # No prompts: every step on the tread, whatever the share.
        np.testing.assert_allclose(_tread_share(model, DECODE_ONLY, tread_s), 1.0, rtol=1e-9)
        kept = _tread_share(model, PROMPTED, tread_s)
        assert kept[0] == pytest.approx(1.0)  # alone: no prompt shares its steps
        assert (kept[1:] < 1.0).all() and (kept > share).all()
        assert (np.diff(kept) <= 1e-12).all()  # more running, more prompts a step: less of the tread
        assert kept[-1] < 0.8
    half = _tread_share(replace(FLAT, prompt_step_treads=((0.0, 0.5),)), PROMPTED, tread_s)
    none = _tread_share(replace(FLAT, prompt_step_treads=((0.0, 0.0),)), PROMPTED, tread_s)
    np.testing.assert_allclose(half, 0.5 + 0.5 * none, rtol=1e-6)  # pure steps + share·the others
    # A calibration from before the mixed rows were read (no entry): the whole tread, as then.
    np.testing.assert_allclose(_tread_share(FLAT, PROMPTED, tread_s), 1.0, rtol=1e-9)


@pytest.mark.parametrize(
    ("treads", "gamma", "want"),
    [
        ((), 0, 1.0),
        ((), 4, 1.0),
        (((0, 0.1),), 4, 1.0),  # SD never benched: SD off's does not carry over
        (((0, 0.1), (2, 0.2), (4, 0.6)), 0, 0.1),
        (((0, 0.1), (2, 0.2), (4, 0.6)), 3, 0.4),  # between: linear in γ
        (((0, 0.1), (2, 0.2), (4, 0.6)), 1, 0.2),  # below: the nearest
        (((0, 0.1), (2, 0.2), (4, 0.6)), 6, 0.6),  # beyond: the nearest
    ],
)
def test_prompt_step_tread_per_draft_length(treads, gamma, want):
    model = replace(LINE, prompt_step_treads=tuple((float(g), s) for g, s in treads))
    assert prompt_step_tread(model, gamma) == pytest.approx(want)


def test_calibrate_reads_the_share_off_the_mixed_rows():
    # Mixed rows off the tread (a chunk anywhere on the tiles) read a share near 0; mixed rows
    # on their batch's tread (chunks of whole tiles) near 1.
    rows = bench_rows(LINE, batch_sizes=BATCHES, noise=0.003, iterations=4, seed=5)

    decode = {r.batch_size: r.latency_s for r in rows if r.phase == "target"}

    def treaded(r):  # the decode step's tread in seconds, on its rows and (on tiles) the mixed ones
        if r.phase == "target" or (r.phase == "mixed" and r.draft_length == 0 and on_tiles):
            return replace(r, latency_s=r.latency_s + tread(r.batch_size) * decode[r.batch_size])
        return r

    on_tiles = False
    off_tiles = calibrate([treaded(r) for r in rows], max_num_batched_tokens=8192, warmup=1)
    on_tiles = True
    whole = calibrate([treaded(r) for r in rows], max_num_batched_tokens=8192, warmup=1)
    got = {t.draft_length: t for t in off_tiles.phases.prompt_step_treads}
    assert sorted(got) == [0]  # the synthetic bench's mixed rows are SD off's
    assert got[0].tread_share < 0.15
    (on0, *_) = whole.phases.prompt_step_treads
    assert on0.draft_length == 0 and on0.tread_share > 0.85
    assert whole.latency_model().prompt_step_treads[0] == (0.0, on0.tread_share)


def test_calibrate_says_where_its_grid_is_too_coarse_to_read_a_staircase():
    # Every 8 sequences leaves no gap wider than 40 tokens; powers of two leave them past 32.
    dense = calibrate(bench_rows(LINE, batch_sizes=(1, 2, 4, *range(8, 257, 8)), seed=3), max_num_batched_tokens=8192)
    assert not any("staircase" in n for n in dense.phases.target.fit.notes + dense.phases.draft.fit.notes)
    sparse = calibrate(
        bench_rows(LINE, batch_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256), seed=3), max_num_batched_tokens=8192
    )
    # γ = 2 and 4 at powers of two: 18 step sizes, wider than 40 tokens at 96 → 160, 192 → 320,
    # 320 → 384, 384 → 640, 640 → 768 and 768 → 1280.
    assert len(sparse.phases.verify_staircase) == 18
    (verify_note,) = [n for n in sparse.phases.draft.fit.notes if n.startswith("SD step staircase")]
    assert "6 of 17 gaps" in verify_note and "every 8 sequences" in verify_note
    (decode_note,) = [n for n in sparse.phases.target.fit.notes if n.startswith("decode staircase")]
    assert "2 of 8 gaps" in decode_note  # 64 → 128 → 256


def test_a_smooth_servers_jitter_is_not_kept_as_a_staircase_and_a_tiled_ones_treads_are():
    # Straight passes measured with 4 % jitter, 4 iterations after warm-up: each size's mean
    # residual is noise with a standard error of ~2 % of the step.
    smooth = calibrate(bench_rows(LINE, batch_sizes=BATCHES, noise=0.04, iterations=7, seed=11), warmup=3)
    kept = [s.residual_s for s in smooth.phases.verify_staircase]
    assert sum(1 for r in kept if r == 0.0) > 0.4 * len(kept)  # |mean| under its standard error
    # Treads of ±4 % under 1 % jitter stand well above it: kept where they are, barely shrunk.
    rows = bench_rows(LINE, batch_sizes=BATCHES, noise=0.01, iterations=7, seed=11)
    tiled = with_token_staircase(rows)
    stepped = calibrate(tiled, max_num_batched_tokens=8192, warmup=3).phases.verify_staircase
    big = [s for s in stepped if s.step_tokens >= 2 * TOKEN_TILE]
    step = {s.step_tokens: LINE.target.scalar(s.step_tokens) for s in big}  # the step, near enough
    got = np.array([s.residual_s / step[s.step_tokens] for s in big])
    want = np.array([token_tread(s.step_tokens) for s in big])
    assert np.corrcoef(got, want)[0, 1] > 0.9
    assert np.sqrt(np.mean(got**2)) > 0.7 * np.sqrt(np.mean(want**2))


@pytest.mark.parametrize(("arrivals", "bunching"), [(0.05, 0.0), (0.3, 0.2), (0.29, 0.44), (0.5, 0.8)])
def test_prompt_step_share_is_the_branching_process_measured(arrivals, bunching):
    # A step's prompts are those that arrived during the one before, J' ~ Poisson(a + b·J):
    # the closed form against that chain run for 200,000 steps.
    rng = np.random.default_rng(7)
    j, carried, n = 0, 0, 200_000
    for _ in range(n):
        j = rng.poisson(arrivals + bunching * j)
        carried += j > 0
    assert prompt_step_share(arrivals, bunching) == pytest.approx(carried / n, abs=0.006)
    # Averaging the prompts a step carries first (e^(−a/(1 − b)) without one) over-counts them.
    assert prompt_step_share(arrivals, bunching) <= -np.expm1(-arrivals / (1.0 - bunching)) + 1e-12
