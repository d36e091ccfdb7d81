"""The two CSV formats the benchmark writes, rendered as text and written atomically.

Kept apart from the measurement so the column order (what ``calibrate`` reads) lives in one
place, and a failed run never leaves half a file: the CLI renders every row first, then
replaces the output in one rename (:func:`controller.atomic.write_bytes_atomic`).
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass

from controller import calibration as cal
from controller.atomic import write_bytes_atomic

# What calibrate reads is defined once, in controller.calibration; this adds what a load test
# also records for people (percentiles, the halves behind the saturation flag).
BENCH_COLUMNS = (*cal.BENCH_COLUMNS, *cal.BENCH_OPTIONAL_COLUMNS)
LOAD_COLUMNS = (
    *cal.LOAD_COLUMNS,
    "gen_tokens_std",
    "prompt_tokens_std",
    "duration_s",
    "sent",
    "completed",
    "e2e_p50_s",
    "e2e_p90_s",
    "mean_e2e_first_half_s",
    "mean_e2e_second_half_s",
    "saturated",
    "workload",
    "warmup_s",
    "running_context_tokens",
    "cached_prompt_tokens",
    "served_rps",
)


@dataclass(frozen=True)
class BenchRow:
    """One micro-benchmark measurement (see :mod:`controller.benchmark.micro` for the phases)."""

    phase: str
    batch_size: int
    tokens_per_seq: int
    context_len: int
    iteration: int
    latency_s: float
    draft_length: int = 0  # γ of the measured server; 0 = SD off
    chunk_tokens: int = 0  # prompt tokens of the prefill chunk in a ``mixed`` step; else 0


@dataclass(frozen=True)
class LoadRow:
    """One rate of a load test (see :mod:`controller.benchmark.loadtest`)."""

    rate: float
    sd: bool
    draft_length: int
    acceptance_rate: float | None  # None with SD off (written empty)
    mean_e2e_s: float
    mean_prompt_tokens: float
    mean_gen_tokens: float
    gen_tokens_std: float
    prompt_tokens_std: float
    duration_s: float
    sent: int
    completed: int
    e2e_p50_s: float
    e2e_p90_s: float
    mean_e2e_first_half_s: float
    mean_e2e_second_half_s: float
    saturated: bool
    workload: str
    warmup_s: float = 0.0  # arrivals before this are left out of the means (validate replays it)
    # KV tokens per running sequence from the batch gauges (controller.occupancy); None: not exported.
    running_context_tokens: float | None = None
    # Prompt tokens per request served from the prefix cache (Δvllm:prompt_tokens_cached_total /
    # requests sent); None: the server does not export the counter.
    cached_prompt_tokens: float | None = None
    # Requests finished per second inside the measured window: the rate while steady, the
    # server's capacity where the queue never emptied (a saturated rate). None: not recorded.
    served_rps: float | None = None


def _render(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return buf.getvalue()


def bench_csv(rows: Sequence[BenchRow]) -> str:
    """Header + rows; latency with 6 decimals."""
    return _render(
        BENCH_COLUMNS,
        [
            (
                r.phase,
                r.batch_size,
                r.tokens_per_seq,
                r.context_len,
                r.iteration,
                f"{r.latency_s:.6f}",
                r.draft_length,
                r.chunk_tokens,
            )
            for r in rows
        ],
    )


def load_csv(rows: Sequence[LoadRow]) -> str:
    """Header + rows; seconds with 6 decimals, token counts with 2, acceptance with 4 (empty when SD is off)."""
    return _render(
        LOAD_COLUMNS,
        [
            (
                f"{r.rate:g}",
                "on" if r.sd else "off",
                r.draft_length,
                "" if r.acceptance_rate is None else f"{r.acceptance_rate:.4f}",
                f"{r.mean_e2e_s:.6f}",
                f"{r.mean_prompt_tokens:.2f}",
                f"{r.mean_gen_tokens:.2f}",
                f"{r.gen_tokens_std:.2f}",
                f"{r.prompt_tokens_std:.2f}",
                f"{r.duration_s:g}",
                r.sent,
                r.completed,
                f"{r.e2e_p50_s:.6f}",
                f"{r.e2e_p90_s:.6f}",
                f"{r.mean_e2e_first_half_s:.6f}",
                f"{r.mean_e2e_second_half_s:.6f}",
                1 if r.saturated else 0,
                r.workload,
                f"{r.warmup_s:g}",
                "" if r.running_context_tokens is None else f"{r.running_context_tokens:.1f}",
                "" if r.cached_prompt_tokens is None else f"{r.cached_prompt_tokens:.2f}",
                "" if r.served_rps is None else f"{r.served_rps:.4f}",
            )
            for r in rows
        ],
    )


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Replace ``path`` with ``text`` in one rename (readers see the old file or the new one)."""
    write_bytes_atomic(path, text.encode("utf-8"))
