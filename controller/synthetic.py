"""Synthetic micro-benchmark rows from known pass costs: for tests of the calibrator.

Lets a test check that calibration recovers parameters it did not choose itself, with noise.
The rows are built from the calibrator's own pass decomposition, so they test the fit, never
the model's fidelity (that is what the simulated server in controller/sim/ is for).
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from controller.calibration import BENCH_COLUMNS, BENCH_OPTIONAL_COLUMNS, BenchRow, draft_passes, target_passes
from controller.model import LatencyModel


def _true_latency(model: LatencyModel, row: BenchRow, budget: int | None) -> float:
    # A MoE target's pass costs what its experts see (the calibrator fits it in those tokens).
    moe = model.moe
    t = sum(
        c * model.target.scalar(float(moe.effective_tokens(x)) if moe else x, z, q, a)
        for c, x, z, q, a in target_passes(row, budget)
    )
    if row.draft_length > 0:
        t += sum(c * model.draft.scalar(x, z, q, a) for c, x, z, q, a in draft_passes(row, budget))
        if row.phase in ("verify", "mixed"):
            t += model.sd_overhead_s
    return float(t)


def bench_rows(
    model: LatencyModel,
    *,
    batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128),
    context_lens: Sequence[float] = (256.0, 1024.0),
    prompt_tokens: Sequence[int] = (128, 512),
    chunk_tokens: Sequence[int] = (256, 1024, 2048),
    draft_lengths: Sequence[int] = (2, 4),
    iterations: int = 14,
    noise: float = 0.01,
    warmup_penalty: float = 0.5,
    seed: int = 0,
) -> list[BenchRow]:
    """Rows of every phase on an SD-off server and SD servers at ``draft_lengths``.

    Latencies carry relative Gaussian noise of ``noise``; the first few iterations of each
    group are slowed by ``warmup_penalty`` (cold caches, graph capture), so a calibration that
    forgot to drop warm-up would be visibly off.
    """
    rng = np.random.default_rng(seed)
    budget = model.max_num_batched_tokens
    rows: list[BenchRow] = []

    def emit(phase: str, batch: int, tps: int, ctx: float, gamma: int = 0, chunk: int = 0) -> None:
        template = BenchRow(phase, batch, tps, ctx, 0, 0.0, 0, gamma, chunk)
        true = _true_latency(model, template, budget)
        for it in range(iterations):
            slow = 1.0 + (warmup_penalty if it < 3 else 0.0)
            lat = max(true * slow * (1.0 + noise * rng.standard_normal()), 0.0)
            rows.append(BenchRow(phase, batch, tps, ctx, it, lat, len(rows) + 2, gamma, chunk))

    for gamma in (0, *draft_lengths):
        for b in batch_sizes:
            for ctx in context_lens:
                if gamma == 0:
                    emit("target", b, 1, ctx)
                else:
                    emit("verify", b, gamma + 1, ctx, gamma)
            for p in prompt_tokens:
                emit("prefill", b, p, float(p), gamma)
            if gamma == 0:
                for c in chunk_tokens:
                    emit("mixed", b, 1, context_lens[0], 0, c)
    if model.kv_cache_tokens_off:
        rows.append(BenchRow("kv_cache", 1, 1, float(model.kv_cache_tokens_off), 0, 0.0, len(rows) + 2, 0, 0))
    if model.kv_cache_tokens_on:
        gamma = draft_lengths[0] if draft_lengths else 1
        rows.append(BenchRow("kv_cache", 1, 1, float(model.kv_cache_tokens_on), 0, 0.0, len(rows) + 2, gamma, 0))
    if model.prefix_caching:  # a server says so only where it caches (vllm:cache_config_info)
        rows.append(BenchRow("prefix_caching", 1, 1, 1.0, 0, 0.0, len(rows) + 2, 0, 0))
    return rows


def write_bench_csv(rows: Sequence[BenchRow], path: str | Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow((*BENCH_COLUMNS, *BENCH_OPTIONAL_COLUMNS))
        for r in rows:
            w.writerow(
                [
                    r.phase,
                    r.batch_size,
                    r.tokens_per_seq,
                    r.context_len,
                    r.iteration,
                    repr(r.latency_s),
                    r.draft_length,
                    r.chunk_tokens,
                ]
            )
