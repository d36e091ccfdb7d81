"""Where a staircase rises: the tile period off the residuals, the riser placed at its multiple."""

from __future__ import annotations

import numpy as np
import pytest

from controller.model import stair_nodes, stair_residual
from controller.treads import Treads, describe, riser_nodes, tile_period

TREAD_SLOPE = -4e-5  # s a token: the fitted line rises along a flat tread
RISE = 3e-3  # s: what a riser adds past the line


def sawtooth(tokens: np.ndarray, period: int) -> np.ndarray:
    """A tiled step's residual against its line: highest just past a multiple of the period
    (R + 1 tokens), falling along the tread to the next multiple, then back up."""
    x = np.asarray(tokens, dtype=float)
    into = (x - 1.0) % period  # tokens past the tread's first
    return RISE + TREAD_SLOPE * into - 0.5 * (RISE + TREAD_SLOPE * (period - 1))


SD_GRID = np.array(
    sorted({*(3 * b for b in (1, 2, 4, *range(8, 257, 8))), *(5 * b for b in (1, 2, 4, *range(8, 257, 8)))})
)
DECODE_GRID = np.array([1, 2, 4, *range(8, 257, 8)])


@pytest.mark.parametrize(("grid", "period"), [(SD_GRID, 64), (SD_GRID, 128), (DECODE_GRID, 64), (DECODE_GRID, 128)])
def test_the_period_and_the_treads_slope_are_read_off_a_tiled_staircase(grid, period):
    got = tile_period(grid, sawtooth(grid, period))
    assert got is not None
    assert got.period == period  # not twice it (half the risers would sit in its "treads"), not half
    assert got.slope_s_per_token == pytest.approx(TREAD_SLOPE, rel=1e-9)


def test_a_smooth_servers_noise_has_no_period():
    rng = np.random.default_rng(3)
    for _ in range(50):
        assert tile_period(SD_GRID, rng.normal(0.0, 1e-4, SD_GRID.size)) is None
    assert tile_period(SD_GRID, np.zeros(SD_GRID.size)) is None


def test_risers_that_no_candidate_places_leave_no_period():
    # Risers every 96 tokens: no power of two marks exactly the gaps that jump.
    assert tile_period(SD_GRID, sawtooth(SD_GRID, 96)) is None
    assert tile_period(np.array([8.0, 16.0, 24.0]), np.array([0.0, 1e-3, 0.0])) is None  # too few gaps to tell


def test_the_riser_sits_at_the_multiple_each_side_on_its_own_tread():
    t = Treads(64, -1e-4)
    # 48 … 72 holds 64: the tread before it runs from 48 up to 64, the one after back from 72 to 65.
    assert riser_nodes(48.0, 0.0, 72.0, 2e-3, t) == [(64.0, pytest.approx(-1.6e-3)), (65.0, pytest.approx(2.7e-3))]
    assert riser_nodes(64.0, 0.0, 72.0, 2e-3, t) == [(65.0, pytest.approx(2.7e-3))]  # 64 itself is on the low tread
    assert riser_nodes(40.0, 0.0, 64.0, 2e-3, t) == []  # the gap ends on the low tread: one tread
    assert riser_nodes(72.0, 0.0, 96.0, 2e-3, t) == []
    assert riser_nodes(8.0, 0.0, 200.0, 2e-3, t) == []  # three multiples: nothing to place them by


def test_the_chain_reads_the_tread_it_is_on_not_a_line_across_the_riser():
    period = 64
    table = tuple(zip(SD_GRID.tolist(), sawtooth(SD_GRID, period).tolist(), strict=True))
    tokens, residual = stair_nodes(table)
    every = np.arange(SD_GRID[0], SD_GRID[-1] + 1, dtype=float)
    np.testing.assert_allclose(np.interp(every, tokens, residual), sawtooth(every, period), atol=1e-12)
    # Straight across (what a table without a period reads) misses by up to most of a riser.
    straight = np.interp(every, SD_GRID, sawtooth(SD_GRID, period))
    assert np.abs(straight - sawtooth(every, period)).max() > 0.5 * RISE


@pytest.mark.parametrize("period", [64, 128])
def test_past_the_largest_step_benchmarked_the_tiles_go_on(period):
    # γ = 6 beside 256 sequences is a 1,792-token step, past a bench of γ = 2 and 4 (≤ 1,280):
    # it lands on the same treads, a whole number of tiles at the cheapest point of one.
    table = tuple(zip(SD_GRID.tolist(), sawtooth(SD_GRID, period).tolist(), strict=True))
    past = np.arange(SD_GRID[-1] + 1, 7 * 256 + 1, dtype=float)
    np.testing.assert_allclose(stair_residual(table, past), sawtooth(past, period), atol=1e-12)
    assert float(stair_residual(table, 7.0 * 256)) == pytest.approx(float(sawtooth(np.array([1792.0]), period)[0]))
    inside = np.arange(SD_GRID[0], SD_GRID[-1] + 1, dtype=float)
    np.testing.assert_array_equal(stair_residual(table, inside), np.interp(inside, *stair_nodes(table)))


def test_without_a_period_nothing_is_added_past_the_bench():
    rng = np.random.default_rng(5)
    table = tuple(zip(SD_GRID.tolist(), rng.normal(0.0, 1e-4, SD_GRID.size).tolist(), strict=True))
    assert stair_residual(table, np.array([1281.0, 1792.0, 4000.0])).tolist() == [0.0, 0.0, 0.0]
    # A table shorter than one period has no whole period to repeat.
    few = np.array([40.0, 48.0, 56.0, 63.0, 66.0, 70.0])
    assert tile_period(few, sawtooth(few, 64)) == Treads(64, pytest.approx(TREAD_SLOPE))
    short = tuple(zip(few.tolist(), sawtooth(few, 64).tolist(), strict=True))
    assert float(stair_residual(short, 100.0)) == 0.0


def test_describe_says_what_calibrate_found():
    assert describe(Treads(64, -4e-5)) == "risers every 64 tokens (tread slope -40.00 µs a token)"
    assert describe(None).startswith("no tile period")
