"""The micro-benchmark recovers known step costs from a virtual-time engine (tests/support/fake_bench.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from controller.benchmark import micro
from controller.benchmark.csvio import BenchRow, bench_csv
from controller.benchmark.probe import ProbeError
from controller.sim import fidelity, stepsim
from controller.sim.simserver import SimulatedServer
from tests.support.fake_bench import Costs, FakeBenchServer

COSTS = Costs()


def plan(**kw) -> micro.MicroPlan:
    # The planned chunks as they are (no tile-phase walk) unless a test asks for it.
    defaults = dict(
        phases=("prefill", "target"),
        batch_sizes=(1, 4),
        prompt_tokens=64,
        gen_tokens=31,
        iterations=2,
        chunk_phase_tokens=0,
    )
    return micro.MicroPlan(**{**defaults, **kw})


def by_phase(rows, phase):
    return [r for r in rows if r.phase == phase]


def test_target_and_prefill_rows_are_the_step_costs():
    rows = micro.run_micro(FakeBenchServer(), plan(warmup=1))
    assert [(r.phase, r.batch_size, r.iteration) for r in rows] == [
        ("prefill", 1, 0), ("target", 1, 0), ("prefill", 1, 1), ("target", 1, 1),
        ("prefill", 4, 0), ("target", 4, 0), ("prefill", 4, 1), ("target", 4, 1),
        ("kv_cache", 1, 0),
    ]  # fmt: skip
    for r in by_phase(rows, "target"):
        assert (r.tokens_per_seq, r.context_len, r.draft_length, r.chunk_tokens) == (1, 64 + 15, 0, 0)
        assert r.latency_s == pytest.approx(COSTS.step_s(0, r.batch_size, 0))
    for r in by_phase(rows, "prefill"):
        assert (r.tokens_per_seq, r.context_len) == (64, 64)
        assert r.latency_s == pytest.approx(COSTS.step_s(64 * r.batch_size, 0, 0))


def test_verify_divides_by_steps_from_the_accepted_counter():
    # γ = 4, 2 accepted per step: 30 tokens after the prefill take 10 steps, not 30.
    server = FakeBenchServer(draft_length=4, accepted_per_step=2)
    rows = micro.run_micro(server, plan(phases=("prefill", "verify")))
    verify = by_phase(rows, "verify")
    assert len(verify) == 4
    for r in verify:
        assert (r.tokens_per_seq, r.draft_length) == (5, 4)
        assert r.latency_s == pytest.approx(COSTS.step_s(0, r.batch_size, 4))
    # Prefill on the SD server carries the draft model's prefill: more than on the SD-off server.
    for r in by_phase(rows, "prefill"):
        assert r.draft_length == 4
        assert r.latency_s == pytest.approx(COSTS.step_s(64 * r.batch_size, 0, 4))
        assert r.latency_s > COSTS.step_s(64 * r.batch_size, 0, 0)


@pytest.mark.parametrize(("gamma", "accepted"), [(0, 0), (4, 2)])
def test_mixed_recovers_the_chunk_step_cost(gamma, accepted):
    server = FakeBenchServer(draft_length=gamma, accepted_per_step=accepted)
    warnings: list[str] = []
    rows = micro.run_micro(
        server, plan(phases=("mixed",), batch_sizes=(1, 8), chunk_tokens=(128, 1024, 2048)), warn=warnings.append
    )
    mixed = by_phase(rows, "mixed")
    assert sorted({(r.batch_size, r.chunk_tokens) for r in mixed}) == [
        (1, 128), (1, 1024), (1, 2048), (8, 128), (8, 1024), (8, 2048),
    ]  # fmt: skip
    for r in mixed:
        assert (r.tokens_per_seq, r.draft_length) == (gamma + 1, gamma)
        assert r.context_len > 64
        truth = COSTS.step_s(r.chunk_tokens, r.batch_size, gamma)
        # SD: the counter-derived step count is short by the last step's overshoot past max_tokens
        # (accepted but discarded tokens, counted as vLLM counts them): τ reads a few % high.
        assert r.latency_s == pytest.approx(truth, rel=0.05 if gamma else 0.01), (r, truth)
        # The chunk's marginal cost is what matters: it must not be mistaken for a plain decode step.
        assert r.latency_s - COSTS.step_s(0, r.batch_size, gamma) == pytest.approx(
            truth - COSTS.step_s(0, r.batch_size, gamma), rel=0.1
        )
    assert warnings == []


def test_a_chunk_past_the_budget_is_measured_at_what_the_budget_leaves():
    # vLLM gives a waiting prompt only the budget the decoders leave: 512 − 2 = 510 tokens. A
    # 1024-token chunk would span two steps and time neither; the bench times a 510-token one.
    server = FakeBenchServer(token_budget=512)
    warnings: list[str] = []
    rows = micro.run_micro(
        server, plan(phases=("mixed",), batch_sizes=(2,), chunk_tokens=(128, 1024, 2048)), warn=warnings.append
    )
    assert sorted({r.chunk_tokens for r in by_phase(rows, "mixed")}) == [128, 510]
    assert len(by_phase(rows, "mixed")) == 2 * 2  # 2048 clamps to the same 510: measured once
    assert [w for w in warnings if "budget 512" in w] == [
        "mixed B=2 C=1024: the step budget 512 leaves 510 tokens beside 2 decode tokens; measured at C=510",
        "mixed B=2 C=2048: the step budget 512 leaves 510 tokens beside 2 decode tokens; measured at C=510",
    ]
    for r in by_phase(rows, "mixed"):
        assert r.latency_s == pytest.approx(COSTS.step_s(r.chunk_tokens, 2, 0))


def test_mixed_steps_walk_the_tile_phases():
    # A mixed row's step, B·(γ + 1) + C tokens, must not sit at one phase of every tile: over
    # batches every 8 (the recipes' grid), each chunk's rows put the step's tokens all over
    # [0, 128). An offset walked by the batch alone (8·φ is 0.94 past a whole number) left each
    # chunk's steps within ~20 tokens of one phase: the line through them read the tiles'
    # cheapest or dearest corner.
    walked = plan(
        phases=("mixed",),
        batch_sizes=tuple(range(8, 129, 8)),
        chunk_tokens=(128, 512),
        iterations=1,
        chunk_phase_tokens=micro.TILE_PHASE_TOKENS,
    )
    for gamma in (0, 2):
        rows = micro.run_micro(FakeBenchServer(draft_length=gamma, accepted_per_step=1), walked)
        again = micro.run_micro(FakeBenchServer(draft_length=gamma, accepted_per_step=1), walked)
        chunks = [(r.batch_size, r.chunk_tokens) for r in by_phase(rows, "mixed")]
        assert chunks == [
            (r.batch_size, r.chunk_tokens) for r in by_phase(again, "mixed")
        ]  # the same plan, the same chunks
        for planned in (128, 512):
            mixed = [r for r in by_phase(rows, "mixed") if planned <= r.chunk_tokens < planned + 128]
            assert len(mixed) == 16
            phases = np.array([(r.batch_size * (gamma + 1) + r.chunk_tokens) % 128 for r in mixed])
            assert np.bincount(phases // 16, minlength=8).min() >= 1, (gamma, planned, sorted(phases))
    # no walk, no offset
    assert {micro.tile_phase_offset(b + 512, j, 0) for j, b in enumerate(fidelity.EVERY_8)} == {0}


def test_mixed_rows_carry_the_walked_chunks():
    rows = micro.run_micro(
        FakeBenchServer(),
        plan(
            phases=("mixed",), batch_sizes=(1, 8), chunk_tokens=(128, 1024), chunk_phase_tokens=micro.TILE_PHASE_TOKENS
        ),
    )
    want = {
        (b, c + micro.tile_phase_offset(b + c, j * 2 + i, 128))
        for j, b in enumerate((1, 8))
        for i, c in enumerate((128, 1024))
    }
    assert {(r.batch_size, r.chunk_tokens) for r in by_phase(rows, "mixed")} == want
    assert any(c % 128 for _, c in want)
    for r in by_phase(rows, "mixed"):
        assert r.latency_s == pytest.approx(COSTS.step_s(r.chunk_tokens, r.batch_size, 0), rel=0.01)


@pytest.mark.parametrize(
    ("chunks", "batch", "per_seq", "budget", "expected"),
    [
        ((128, 2048), 8, 1, None, [128, 2048]),  # budget unknown (vLLM's /metrics does not show it)
        ((128, 2048), 8, 1, 8192, [128, 2048]),
        ((128, 1024, 2048), 168, 5, 2048, [128, 1024, 1208]),
        ((2048, 128), 200, 5, 2048, [1048, 128]),  # plan order kept
        ((128, 512), 410, 5, 2048, []),  # the decodes alone fill the budget
        ((128, 512), 409, 5, 2048, [3]),
    ],
)
def test_chunks_beside(chunks, batch, per_seq, budget, expected):
    assert micro.chunks_beside(chunks, batch, per_seq, budget) == expected


def test_kv_cache_row_only_when_known():
    rows = micro.run_micro(
        FakeBenchServer(draft_length=2, accepted_per_step=1, kv_cache_tokens=4096),
        plan(phases=("prefill",), batch_sizes=(1,), iterations=1),
    )
    assert rows[-1] == BenchRow("kv_cache", 1, 1, 4096, 0, 0.0, 2, 0)
    rows = micro.run_micro(
        FakeBenchServer(kv_cache_tokens=None), plan(phases=("prefill",), batch_sizes=(1,), iterations=1)
    )
    assert [r.phase for r in rows] == ["prefill"]


def test_phase_and_draft_length_must_match_the_server():
    with pytest.raises(ProbeError, match="use verify"):
        micro.run_micro(FakeBenchServer(draft_length=4, accepted_per_step=1), plan())
    with pytest.raises(ProbeError, match="needs a server with SD"):
        micro.run_micro(FakeBenchServer(), plan(phases=("verify",)))

    class Lying(FakeBenchServer):
        def counters(self):  # SD counters present, but the user said draft_length 0
            return FakeBenchServer(draft_length=4).counters()

    with pytest.raises(ProbeError, match="pass --draft-length"):
        micro.run_micro(Lying(), plan(phases=("prefill",)))


def test_short_generation_is_an_error():
    with pytest.raises(ProbeError, match="server reported 64\\+0"):
        micro.run_micro(FakeBenchServer(generate_short_by=1), plan())


def test_a_failing_server_stops_the_run():
    with pytest.raises(ProbeError, match="HTTP 500"):
        micro.run_micro(FakeBenchServer(fail_after_probes=3), plan())


def test_steps_per_seq_arithmetic():
    assert micro.steps_per_seq(32, 4, 0, 0) == 31
    # 4 sequences, 31 tokens each after prefill, 60 accepted in all: 31 - 15 = 16 steps each.
    assert micro.steps_per_seq(32, 4, 4, 60) == 16


def test_bench_csv_has_exact_columns():
    rows = [
        BenchRow("prefill", 2, 64, 64, 0, 0.1234567),
        BenchRow("verify", 8, 5, 80, 13, 0.002, 4),
        BenchRow("mixed", 8, 5, 96, 1, 0.05, 4, 512),
        BenchRow("kv_cache", 1, 1, 100000, 0, 0.0, 4),
    ]
    assert bench_csv(rows).splitlines() == [
        "phase,batch_size,tokens_per_seq,context_len,iteration,latency_s,draft_length,chunk_tokens",
        "prefill,2,64,64,0,0.123457,0,0",
        "verify,8,5,80,13,0.002000,4,0",
        "mixed,8,5,96,1,0.050000,4,512",
        "kv_cache,1,1,100000,0,0.000000,4,0",
    ]


def test_a_mixed_run_that_would_outgrow_the_kv_cache_is_skipped_not_fatal():
    # 8 decoders of 64 + N₂ tokens fit a 4,096-token cache; 64 do not: vLLM would preempt them
    # and the injection wait for blocks, so those runs are skipped with a warning, and the
    # decode rows (which calibrate judges against the cache itself) are kept.
    server = FakeBenchServer(kv_cache_tokens=4096)
    warnings: list[str] = []
    rows = micro.run_micro(
        server, plan(phases=("target", "mixed"), batch_sizes=(8, 64), chunk_tokens=(128,)), warn=warnings.append
    )
    assert {r.batch_size for r in by_phase(rows, "mixed")} == {8}
    assert {r.batch_size for r in by_phase(rows, "target")} == {8, 64}
    (why,) = [w for w in warnings if "KV" in w]
    assert why.startswith("mixed B=64 C=128: 64 decoders of 64 + ") and "the cache holds 4096" in why


@pytest.mark.parametrize(
    ("cap", "block", "gamma", "fits"),
    [
        (None, 16, 0, True),  # the cache size unknown: nothing to judge
        (8 * 128 + 128, 16, 0, True),  # 8 × (64 + 64) rounds to 8 whole blocks each, plus the chunk
        (8 * 128 + 127, 16, 0, False),
        (8 * 144 + 128, 16, 4, True),  # γ = 4 of lookahead spills each decoder into a ninth block
        (8 * 144 + 127, 16, 4, False),
        (8 * 192 + 128, 64, 4, True),  # 64-token blocks: 132 tokens take three
        (8 * 192 + 127, 64, 4, False),
    ],
)
def test_kv_shortfall(cap, block, gamma, fits):
    info = micro.ServerInfo(gamma, cap, block_size=block)
    layout = micro.MixedLayout(gen_tokens=64, injections_at_s=(1.0,))
    assert (micro.kv_shortfall(info, 8, 64, 128, layout) is None) == fits


# The simulated H100 on a 2048-token budget, γ = 4, without timing noise.
BUDGET_2048_SD4 = dataclasses.replace(fidelity.TruthServer(max_num_batched_tokens=2048).spec(4), noise_sigma=0.0)
STAGGERED = dict(phases=("verify",), batch_sizes=(64,), prompt_tokens=2048, gen_tokens=64)


def assert_times_the_verify_step(row: BenchRow) -> None:
    """The row is the truth's verify step of its batch at the row's mean context, within 3 %."""
    b = row.batch_size
    truth = stepsim.step_time_s(
        BUDGET_2048_SD4, np.full(b, 5), np.full(b, int(row.context_len)), np.full(b, 5), True, np.ones(b, bool)
    )
    assert row.latency_s == pytest.approx(truth, rel=0.03)


def test_decoders_on_a_small_budget_outlast_their_staggered_prefill():
    # 64 decoders of 2048-token prompts start one step apart, and at γ = 4 the first would finish
    # 64 tokens before the last began: no step would be all-decode. The trace shows it; the bench
    # runs them again longer and times the verify step of 64 sequences at their mean context.
    rows = micro.run_micro(SimulatedServer(BUDGET_2048_SD4, seed=1), plan(**STAGGERED, iterations=1))
    (row,) = by_phase(rows, "verify")
    assert row.context_len > 2048 + 64  # the decoders generated more than twice the 64 asked
    assert_times_the_verify_step(row)


def test_without_the_budget_the_bench_reads_the_stagger_off_the_trace_and_runs_again():
    # vLLM's /metrics does not show the budget: the same 64 decoders on the same 2048-token
    # budget, the bench told nothing. The first run's trace shows the first decoders streaming
    # most of their tokens before the last one starts; the run is repeated that much longer.
    class BudgetUnknown(SimulatedServer):
        runs = 0

        def info(self):
            return dataclasses.replace(super().info(), max_num_batched_tokens=None)

        def probe(self, requests):
            self.runs += 1
            return super().probe(requests)

    server = BudgetUnknown(BUDGET_2048_SD4, seed=1)
    rows = micro.run_micro(server, plan(**STAGGERED, iterations=2))
    assert 3 <= server.runs <= 5  # the first iteration ran again (at most 3 times), the second did not
    for row in by_phase(rows, "verify"):
        assert row.context_len > 2048 + 64  # the decoders generated more than twice the 64 asked
        assert_times_the_verify_step(row)


def test_a_staggered_decode_run_the_cache_cannot_lengthen_is_left_out_not_recorded():
    # The same 64 staggered decoders, on a KV cache that holds them as asked (64 × 2116 tokens)
    # but not run as long as the stagger needs: no step had every decoder decoding, and the
    # only step time the run has is the mean over prefill-laden steps (vs the truth's verify step
    # at its context).
    small = dataclasses.replace(BUDGET_2048_SD4, kv_cache_tokens=64 * 2200)
    warnings: list[str] = []
    rows = micro.run_micro(SimulatedServer(small, seed=1), plan(**STAGGERED, iterations=2), warn=warnings.append)
    assert by_phase(rows, "verify") == []
    assert len(warnings) == 1 and "verify B=64 at 2048-token prompts" in warnings[0] and "skipped" in warnings[0]
    # What was left out would have been far off: the same run's mean step against the truth's.
    run, gen = micro.decode_together(SimulatedServer(small, seed=1), 64, 2048, 64, 4, kv_cache_tokens=64 * 2200)
    assert not run.decoded_together and run.outgrew_cache
    truth = stepsim.step_time_s(
        small, np.full(64, 5), np.full(64, 2048 + gen // 2), np.full(64, 5), True, np.ones(64, bool)
    )
    assert run.step_s > 1.1 * truth


def test_a_staggered_run_lengthened_until_it_decodes_together_is_recorded():
    run, _gen = micro.decode_together(SimulatedServer(BUDGET_2048_SD4, seed=1), 64, 2048, 64, 4)
    assert run.lead_steps > 0 and run.decoded_together and not run.outgrew_cache
