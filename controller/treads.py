"""Where a step's staircase rises: the tile period read off the calibration's residuals.

GEMMs run in whole tiles (and vLLM pads a step to a captured CUDA-graph size), so a step's cost
is flat along a tread and jumps just past each multiple of the tile, ``m·P`` → ``m·P + 1``
tokens. Against the fitted line the residual therefore falls at one slope along every tread
(the line rises, the tread does not) and jumps up at each riser. A bench every 8 sequences
samples an SD step every 24–40 tokens, so most gaps between the sizes measured straddle a riser
of 64-token tiles; drawn straight across, the interpolation prices the states before the riser
too dear and those after it too cheap (+12 % and −5 % on the simulated H100, γ = 2 at 17–22
sequences, where the batch spends about a quarter of its time at 8 req/s).

:func:`tile_period` finds the period where the residuals show one: the largest candidate whose
multiples fall in every gap that jumps and in none that does not. :func:`riser_nodes` then
places the riser inside a gap at its multiple, each side extended from its own node along the
tread's slope. Where no candidate explains the jumps (a smooth server, a grid too coarse, noise),
there is no period and the staircase is read straight between the sizes measured, as before.
Pure functions of the table: no I/O, cached by the caller.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

# Tile sizes in tokens, largest first: GEMM tiles and vLLM's CUDA-graph paddings are powers of two.
CANDIDATE_PERIODS = (512, 256, 128, 64, 32)
# Gaps inside one tread needed to read its slope; gaps across a riser needed to call it a period
# (one: 128-token tiles rise once in a decode step of at most 256 sequences).
MIN_TREAD_GAPS = 3
MIN_RISERS = 1
# The risers' median jump beyond the tread's slope must exceed this many times the largest
# departure of any gap inside a tread: a period twice the true one leaves half the risers in its
# "tread" gaps, as large as the ones it explains. (The simulated truths: 2.05–10.1 at their tiles,
# 0.60–0.98 at twice them; a noisier bench that falls under is read straight, as before.)
RISER_CONTRAST = 2.0


class Treads(NamedTuple):
    """A staircase's period (tokens) and the residual's slope along a tread (seconds per token)."""

    period: int
    slope_s_per_token: float


def _multiples(lo: np.ndarray, hi: np.ndarray, period: int) -> tuple[np.ndarray, np.ndarray]:
    """How many multiples R of ``period`` lie in each gap with lo ≤ R < hi (the riser R → R + 1
    falls between the sizes measured), and the first of them."""
    first = np.ceil(lo / period) * period
    count = np.floor((hi - 1.0) / period) - np.ceil(lo / period) + 1.0
    return np.maximum(count, 0.0), first


def tile_period(tokens: np.ndarray, residual: np.ndarray) -> Treads | None:
    """The largest candidate period whose multiples mark exactly the gaps that jump, or None.

    ``tokens`` (ascending, whole tokens) and ``residual`` (seconds) are a staircase table's
    nodes. The tread's slope is the median slope over the gaps that hold no multiple; each gap's
    excess is its jump beyond that slope. A period holds when every gap holding one multiple
    jumps up, their median by more than ``RISER_CONTRAST`` times the largest excess of a gap
    holding none.
    """
    x, r = np.asarray(tokens, dtype=float), np.asarray(residual, dtype=float)
    if x.size < MIN_TREAD_GAPS + MIN_RISERS + 1:
        return None
    lo, hi, jump = x[:-1], x[1:], np.diff(r)
    width = hi - lo
    for period in CANDIDATE_PERIODS:
        count, _ = _multiples(lo, hi, period)
        tread, riser = count == 0, count == 1
        if tread.sum() < MIN_TREAD_GAPS or riser.sum() < MIN_RISERS:
            continue
        slope = float(np.median(jump[tread] / width[tread]))
        excess = jump - slope * width
        every_one_rises = float(excess[riser].min()) > 0.0
        if every_one_rises and np.median(excess[riser]) > RISER_CONTRAST * float(np.abs(excess[tread]).max()):
            return Treads(period, slope)
    return None


def table_period(table: Sequence[tuple[float, float]]) -> Treads | None:
    """:func:`tile_period` of a staircase table's (tokens, residual) pairs, as the calibration
    file keeps them."""
    tokens, residual = np.asarray(table, dtype=float).reshape(-1, 2).T
    return tile_period(tokens, residual)


def riser_nodes(lo: float, r_lo: float, hi: float, r_hi: float, treads: Treads) -> list[tuple[float, float]]:
    """Interpolation nodes strictly inside the gap (lo, hi): the riser at its one multiple R of
    the period, the tread before it from (lo, r_lo) up to R, the one after it back from
    (hi, r_hi) to R + 1. Nothing (a straight line, as between sizes on one tread) where the gap
    holds no multiple or more than one."""
    period, slope = treads
    count, first = _multiples(np.array([lo]), np.array([hi]), period)
    if count[0] != 1:
        return []
    at = float(first[0])
    nodes = [] if at <= lo else [(at, r_lo + slope * (at - lo))]
    if at + 1.0 < hi:
        nodes.append((at + 1.0, r_hi - slope * (hi - at - 1.0)))
    return nodes


def describe(treads: Treads | None) -> str:
    """One line for calibrate's notes."""
    if treads is None:
        return "no tile period: read straight between the sizes measured"
    return f"risers every {treads.period} tokens (tread slope {treads.slope_s_per_token * 1e6:+.2f} µs a token)"


__all__ = ["CANDIDATE_PERIODS", "Treads", "describe", "riser_nodes", "table_period", "tile_period"]
