"""The load test against the virtual-time engine: warm-up, saturation both ways, acceptance from counter deltas."""

from __future__ import annotations

import random

import pytest

from controller.benchmark import loadtest
from controller.benchmark.csvio import LoadRow, load_csv
from controller.benchmark.probe import GaugeSample, ProbeError, ProbeRequest, ProbeResult, ServerInfo
from tests.support.fake_bench import Costs, FakeBenchServer

# Slow enough that ~5 requests/s of 64 + 32 tokens fill it.
SLOW = Costs(base_s=0.01, per_token_s=0.002, draft_pass_s=0.001, draft_per_prompt_token_s=0.0)
FIXED = loadtest.lognormal_workload(64, 32, 0.0, kind="chat")


def slow_server(**kw) -> FakeBenchServer:
    return FakeBenchServer(costs=SLOW, token_budget=256, max_num_seqs=64, **kw)


def plan(rates=(1.0,), duration_s=60.0, drain_s=30.0, **kw) -> loadtest.LoadPlan:
    return loadtest.LoadPlan(tuple(rates), duration_s, drain_s, "chat", **kw)


def test_light_load_is_not_saturated_and_excludes_the_warmup():
    def make(rate, duration_s, rng):
        # Long prompts during the warm-up only: the means must not see them.
        return [
            ProbeRequest(t, 500 if t < 0.1 * duration_s else 64, 32, "chat")
            for t in loadtest.poisson_arrivals(rate, duration_s, rng)
        ]

    (row,) = loadtest.run_load(slow_server(), make, plan())
    assert not row.saturated
    assert row.sent == row.completed > 30
    assert (row.mean_prompt_tokens, row.prompt_tokens_std, row.mean_gen_tokens) == (64, 0, 32)
    assert (row.sd, row.draft_length, row.acceptance_rate) == (False, 0, None)
    # One request alone: a prefill step and 31 decode steps; light load adds a little queueing.
    alone = SLOW.step_s(64, 0, 0) + 31 * SLOW.step_s(0, 1, 0)
    assert alone <= row.e2e_p50_s <= row.e2e_p90_s < 2 * alone
    assert row.mean_e2e_second_half_s < 1.5 * row.mean_e2e_first_half_s


def test_overload_is_saturated_and_stops_the_rates():
    warnings: list[str] = []
    rows = loadtest.run_load(
        slow_server(), FIXED, plan(rates=(40, 1, 20), duration_s=30, drain_s=1e6), warn=warnings.append
    )
    assert [(r.rate, r.saturated) for r in rows] == [(1, False), (20, True)]
    over = rows[1]
    assert over.completed == over.sent  # the huge drain limit: only the growing queue says saturated
    assert over.mean_e2e_second_half_s > 1.5 * over.mean_e2e_first_half_s  # the queue keeps growing
    # Served: what the server finishes with its queue full, not the 20 req/s sent; at 1 req/s, all of it.
    assert over.served_rps < 0.6 * 20
    assert rows[0].served_rps == pytest.approx(rows[0].sent / 30, rel=0.25)
    assert warnings == ["rate 20 saturated the server; skipping 40"]


def test_requests_past_the_drain_limit_mean_saturated():
    (row,) = loadtest.run_load(slow_server(), FIXED, plan(drain_s=0.0))
    # Light load, so the halves agree; but the last requests end after duration + 0 s.
    assert row.mean_e2e_second_half_s < 1.5 * row.mean_e2e_first_half_s
    assert row.completed < row.sent
    assert row.saturated


def test_acceptance_is_the_counter_delta():
    server = slow_server(draft_length=4, accepted_per_step=3)
    server.accepted, server.draft_tokens, server.drafts = 5000.0, 6000.0, 1500.0  # earlier traffic
    (row,) = loadtest.run_load(server, FIXED, plan())
    assert (row.sd, row.draft_length) == (True, 4)
    assert row.acceptance_rate == pytest.approx(3 / 4)


def test_bad_workloads_and_servers_are_one_line_errors():
    with pytest.raises(ProbeError, match="no requests"):
        loadtest.run_load(FakeBenchServer(), lambda rate, d, rng: [], plan())
    with pytest.raises(ProbeError, match="exceed the limit 10"):
        loadtest.run_load(FakeBenchServer(), FIXED, plan(rates=(5,), max_requests=10))
    with pytest.raises(ProbeError, match="HTTP 500"):
        loadtest.run_load(FakeBenchServer(fail_after_probes=0), FIXED, plan())


def test_workload_is_seeded_and_has_the_asked_spread():
    make = loadtest.lognormal_workload(200, 100, 0.5)
    a = make(10, 200, random.Random(1))
    assert a == make(10, 200, random.Random(1))
    assert 1800 < len(a) < 2200
    gens = [r.max_tokens for r in a]
    mean = sum(gens) / len(gens)
    cv = (sum((g - mean) ** 2 for g in gens) / len(gens)) ** 0.5 / mean
    assert mean == pytest.approx(100, rel=0.05) and cv == pytest.approx(0.5, rel=0.15)
    capped = loadtest.lognormal_workload(200, 100, 2.0, max_total_tokens=256)(10, 100, random.Random(2))
    assert all(r.prompt_tokens >= 1 and r.max_tokens >= 1 and r.prompt_tokens + r.max_tokens <= 256 for r in capped)


def test_summarize_percentiles_and_halves():
    p = plan(duration_s=100.0)
    sends = [5.0, 20.0, 40.0, 60.0, 80.0]  # 5.0 is in the warm-up (first 10 s)
    e2e = [50.0, 1.0, 2.0, 3.0, 4.0]
    reqs = [ProbeRequest(t, 10, 20) for t in sends]
    res = [ProbeResult(t, t + 0.1, t + d, 10, 20) for t, d in zip(sends, e2e, strict=True)]
    row = loadtest.summarize(4.0, reqs, res, p, 0, None)
    assert row.mean_e2e_s == pytest.approx(2.5)
    assert (row.e2e_p50_s, row.e2e_p90_s) == (pytest.approx(2.5), pytest.approx(3.7))
    # Halves of the measured window [10, 100): split at 55 s.
    assert (row.mean_e2e_first_half_s, row.mean_e2e_second_half_s) == (1.5, 3.5)
    assert row.saturated  # 3.5 > 1.5 × 1.5
    assert (row.sent, row.completed) == (5, 5)
    # Finished inside [10, 100): 21, 42, 63 and 84 s (5 + 50 = 55 s too, sent in the warm-up).
    assert row.served_rps == pytest.approx(5 / 90)


def test_load_csv_keeps_the_old_columns_first():
    row = LoadRow(2, True, 4, 0.61234, 1.5, 64, 32, 3.5, 10, 600, 1190, 1190, 1.4, 2.2, 1.45, 1.55, False, "chat")
    off = LoadRow(
        8, False, 0, None, 9.0, 64, 32, 0, 0, 600, 4800, 4700, 8, 15, 5, 12, True, "chat", 60, 1234.56, None, 7.51234
    )
    assert load_csv([row, off]).splitlines() == [
        "rate,sd,draft_length,acceptance_rate,mean_e2e_s,mean_prompt_tokens,mean_gen_tokens,"
        "gen_tokens_std,prompt_tokens_std,duration_s,sent,completed,e2e_p50_s,e2e_p90_s,"
        "mean_e2e_first_half_s,mean_e2e_second_half_s,saturated,workload,warmup_s,running_context_tokens,"
        "cached_prompt_tokens,served_rps",
        "2,on,4,0.6123,1.500000,64.00,32.00,3.50,10.00,600,1190,1190,1.400000,2.200000,1.450000,1.550000,0,chat,0,,,",
        "8,off,0,,9.000000,64.00,32.00,0.00,0.00,600,4800,4700,8.000000,15.000000,5.000000,12.000000,1,chat,60,1234.6,,"
        "7.5123",
    ]


def test_the_running_context_comes_from_the_gauges_of_the_measured_window():
    info = ServerInfo(0, kv_cache_tokens=100_000, block_size=16)
    gauges = [
        GaugeSample(5.0, 50.0, 0.9),  # the warm-up: left out
        GaugeSample(20.0, 10.0, 0.1),
        GaugeSample(40.0, 30.0, 0.5),
        GaugeSample(130.0, 1.0, 0.9),  # the drain: left out
    ]
    # Mean usage 0.3 of 100k tokens over a mean 20 running: 1,500 each, less half a block.
    assert loadtest.measured_context(gauges, info, 10.0, 100.0) == pytest.approx(1500.0 - 7.5)
    assert loadtest.measured_context(gauges, ServerInfo(0, kv_cache_tokens=None), 10.0, 100.0) is None
    assert loadtest.measured_context([], info, 10.0, 100.0) is None
    # No block size exported: vLLM's GPU default.
    assert loadtest.measured_context(gauges, ServerInfo(0, 100_000), 10.0, 100.0) == pytest.approx(1492.5)


def test_a_server_without_batch_gauges_leaves_the_context_empty():
    (row,) = loadtest.run_load(slow_server(), FIXED, plan())
    assert row.running_context_tokens is None
    assert load_csv([row]).splitlines()[1].endswith(f",chat,6,,,{row.served_rps:.4f}")


def _ramp(n: int, start_s: float, apart_s: float, slope: float, base_s: float, jitter_s: float) -> list[float]:
    """n latencies of requests sent over ``apart_s`` from ``start_s``: base + slope × t ± jitter."""
    rng = random.Random(n)
    return [base_s + slope * (start_s + apart_s * i / n) + rng.uniform(-jitter_s, jitter_s) for i in range(n)]


@pytest.mark.parametrize(
    ("per_half", "slope", "jitter_s", "climbs"),
    [
        (4000, 0.03, 20.0, True),  # 3 % past capacity: 81 → 105 s, only 1.3× but it climbs
        (4000, 0.01, 20.0, False),  # a steady queue near capacity drifts slower than 2 %
        (4000, 0.0, 20.0, False),
        (4000, -0.03, 20.0, False),  # draining
        (3, 0.03, 40.0, False),  # three requests a half: the rise is within their noise
        (1, 0.5, 0.0, False),  # no spread to judge by
    ],
)
def test_climbing_is_a_slope_beyond_the_noise(per_half, slope, jitter_s, climbs):
    apart_s = 800.0
    first = _ramp(per_half, 0.0, apart_s, slope, 60.0, jitter_s)
    second = _ramp(per_half, apart_s, apart_s, slope, 60.0, jitter_s)
    assert loadtest.climbing(first, second, apart_s) is climbs


def test_a_slow_climb_under_one_and_a_half_times_is_saturated():
    # As the A100 run this was found on (30 minutes at 1.06× capacity, halves 81 → 120 s): 80 → 117 s.
    p = plan(duration_s=1800.0, drain_s=900.0)
    sends = [180.0 + 1620.0 * i / 2000 for i in range(2000)]
    e2e = [62.0 + 0.045 * (t - 180.0) for t in sends]
    reqs = [ProbeRequest(t, 10, 20) for t in sends]
    res = [ProbeResult(t, t + 0.1, t + d, 10, 20) for t, d in zip(sends, e2e, strict=True)]
    row = loadtest.summarize(6.5, reqs, res, p, 4, 0.5)
    assert row.mean_e2e_second_half_s < loadtest.SATURATION_GROWTH * row.mean_e2e_first_half_s
    assert row.saturated
    flat = [ProbeResult(t, t + 0.1, t + 62.0 + 0.005 * (t - 180.0), 10, 20) for t in sends]
    assert not loadtest.summarize(6.5, reqs, flat, p, 4, 0.5).saturated
