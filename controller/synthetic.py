"""Synthetic micro-benchmark rows from known step costs: for tests, examples and the simulator.

Lets a test check that calibration recovers parameters it did not choose itself, with noise.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from controller.calibration import BENCH_COLUMNS, BenchRow
from controller.model import LatencyModel, StepCost


def bench_rows(
    model: LatencyModel,
    *,
    batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128),
    context_lens: Sequence[float] = (256.0, 1024.0, 2048.0),
    prompt_tokens: Sequence[int] = (128, 512),
    verify_tokens_per_seq: int = 5,
    iterations: int = 14,
    noise: float = 0.01,
    warmup_penalty: float = 0.5,
    seed: int = 0,
) -> list[BenchRow]:
    """Rows for every phase; latencies carry relative Gaussian noise of ``noise``.

    The first few iterations of each group are slowed by ``warmup_penalty`` (cold caches, graph
    capture), so a calibration that forgot to drop warm-up would be visibly off.
    """
    rng = np.random.default_rng(seed)
    rows: list[BenchRow] = []

    def emit(phase: str, cost: StepCost, batch: int, tps: int, ctx: float) -> None:
        true = float(cost.scalar(batch * tps, batch * ctx))
        for it in range(iterations):
            slow = 1.0 + (warmup_penalty if it < 3 else 0.0)
            lat = max(true * slow * (1.0 + noise * rng.standard_normal()), 0.0)
            rows.append(BenchRow(phase, batch, tps, ctx, it, lat, len(rows) + 2))

    for b in batch_sizes:
        for ctx in context_lens:
            emit("target", model.target, b, 1, ctx)
            emit("draft", model.draft, b, 1, ctx)
            emit("verify", model.verify, b, verify_tokens_per_seq, ctx)
        for p in prompt_tokens:
            emit("prefill", model.prefill, b, p, float(p))
    return rows


def write_bench_csv(rows: Sequence[BenchRow], path: str | Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(BENCH_COLUMNS)
        for r in rows:
            w.writerow([r.phase, r.batch_size, r.tokens_per_seq, r.context_len, r.iteration, repr(r.latency_s)])
