"""Step times read off streamed chunk traces (controller/benchmark/micro.py).

Hand-built traces pin the arithmetic of ``traced_step_s``, ``decode_window`` and
``_traced_mixed_steps``; the simulated vLLM (controller/sim/simserver.py, noise off) checks
that what they read is the engine's true step time, ``controller.sim.stepsim.step_time_s``
for the same batch composition.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from controller.benchmark import micro
from controller.benchmark.probe import ProbeError, ProbeRequest, ProbeResult
from controller.sim.gpu import LLAMA_3_2_1B
from controller.sim.simserver import SimulatedServer
from controller.sim.stepsim import AcceptanceClass, ServerSpec, step_time_s

PROMPT, GEN = 512, 256
TOLERANCE = 0.03


def result(first_s: float, done_s: float, times: tuple[float, ...] = (), sent_s: float = 0.0) -> ProbeResult:
    return ProbeResult(sent_s, first_s, done_s, PROMPT, GEN, times)


# --------------------------------------------------------------------------------------------
# Hand-built traces
# --------------------------------------------------------------------------------------------


def test_traced_step_counts_only_intervals_inside_the_window():
    a = result(1.0, 1.5, (1.0, 1.1, 1.2, 1.3, 1.5))
    b = result(1.05, 1.4, (1.05, 1.15, 1.25, 1.35))
    # Inside [1.1, 1.3]: a has 1.1, 1.2, 1.3 (0.2 s over 2 steps); b has 1.15, 1.25 (0.1 s, 1 step).
    assert micro.traced_step_s([a, b], 1.1, 1.3) == pytest.approx(0.3 / 3)
    # A sequence with a single chunk inside adds nothing; none with two: no estimate.
    assert micro.traced_step_s([a], 1.45, 1.6) is None
    assert micro.traced_step_s([result(1.0, 2.0)], 0.0, 3.0) is None


def test_decode_window_prefers_the_trace():
    # Step 0.1 s while both decode; the first sequence's prefill-era chunks are 0.5 s apart.
    a = result(0.5, 2.0, (0.5, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 2.0))
    b = result(1.0, 1.5, (1.0, 1.1, 1.2, 1.3, 1.4, 1.5))
    run = micro.decode_window([a, b], steps=5.0)
    assert run.first_token_max_s == 1.0 and run.done_min_s == 1.5
    assert run.window_s == pytest.approx(1.0)  # last done − last first token
    assert run.mean_duration_s == pytest.approx((1.5 + 0.5) / 2)
    assert run.step_s == pytest.approx(0.1)
    assert run.steps_per_seq == 5.0


def test_decode_window_without_a_trace_falls_back_to_mean_duration():
    results = [result(1.0, 3.0), result(1.2, 3.4), result(0.9, 3.3)]
    run = micro.decode_window(results, steps=10.0)
    assert run.step_s == pytest.approx((2.0 + 2.2 + 2.4) / 3 / 10.0)
    assert run.first_token_max_s == 1.2 and run.done_min_s == 3.0
    assert run.window_s == pytest.approx(3.4 - 1.2)


def test_decode_window_needs_steps():
    with pytest.raises(ProbeError, match="no decode steps"):
        micro.decode_window([result(1.0, 2.0)], steps=0.0)


def test_traced_mixed_step_is_the_decoders_interval_ending_with_the_injection():
    # τ = 1 s; the steps ending at 3.5 and 7.5 carried an injected prompt.
    dec = [
        result(0.0, 9.0, (0.0, 1.0, 2.0, 3.5, 4.5, 5.5, 7.5, 8.5)),
        result(0.0, 9.0, (0.0, 1.0, 2.0, 3.5, 4.5, 5.5, 7.5, 8.5)),
        result(0.0, 9.0, (0.0, 1.0, 1.9, 3.5, 4.5, 5.4, 7.5, 8.5)),  # median ignores the odd one
        result(0.0, 9.0),  # untraced decoders are skipped
    ]
    inj = [result(3.5, 3.5, sent_s=2.2), result(7.5, 7.5, sent_s=6.0)]
    assert micro._traced_mixed_steps(dec, inj, tau_s=1.0) == pytest.approx((1.5 + 2.0) / 2)
    assert micro._traced_mixed_steps(dec, inj[:1], tau_s=1.0) == pytest.approx(1.5)


def test_traced_mixed_step_is_none_when_the_trace_does_not_show_every_injection():
    dec = [result(0.0, 9.0, (0.0, 1.0, 2.0, 3.5, 4.5))]
    # 0.5 s from the nearest chunk, more than 0.3·τ: this injection is not visible.
    assert micro._traced_mixed_steps(dec, [result(3.5, 3.5), result(3.0, 3.0)], tau_s=1.0) is None
    # Lined up with the very first chunk: no interval ends there.
    assert micro._traced_mixed_steps(dec, [result(0.0, 0.0)], tau_s=1.0) is None
    # No trace at all.
    assert micro._traced_mixed_steps([result(0.0, 9.0)], [result(3.5, 3.5)], tau_s=1.0) is None


# --------------------------------------------------------------------------------------------
# Against the simulated engine (noise off)
# --------------------------------------------------------------------------------------------


def spec(gamma: int) -> ServerSpec:
    return ServerSpec(draft=LLAMA_3_2_1B if gamma else None, draft_length=gamma, noise_sigma=0.0)


def true_step_s(s: ServerSpec, batch: int, ctx: float, chunk_tokens: int = 0) -> float:
    """One engine step: ``batch`` sequences with γ+1 query tokens at ``ctx``, plus a prompt chunk."""
    k = s.gamma + 1
    q = [k] * batch + ([chunk_tokens] if chunk_tokens else [])
    context = [ctx] * batch + ([0.0] if chunk_tokens else [])
    sampled = [k] * batch + ([1] if chunk_tokens else [])
    drafting = [True] * batch + ([False] if chunk_tokens else [])  # a max_tokens=1 prompt drafts nothing
    return step_time_s(
        s,
        np.array(q, dtype=np.int64),
        np.array(context, dtype=np.float64),
        np.array(sampled, dtype=np.int64),
        s.sd_on,
        np.array(drafting, dtype=bool),
    )


@pytest.mark.parametrize("batch", [1, 16, 64])
@pytest.mark.parametrize("gamma", [0, 4])
def test_decode_run_step_is_the_engine_step(gamma, batch):
    s = spec(gamma)
    run = micro.decode_run(SimulatedServer(s, seed=5), batch, PROMPT, GEN, gamma)
    truth = true_step_s(s, batch, PROMPT + GEN / 2)
    assert run.step_s == pytest.approx(truth, rel=TOLERANCE)
    if gamma:
        # Verify steps with a 1B draft (γ passes) cost clearly more than plain decode steps.
        assert run.step_s > 1.3 * true_step_s(spec(0), batch, PROMPT + GEN / 2)
        assert run.steps_per_seq < (GEN - 1) / 2  # several tokens per step from the counter


def test_trace_leaves_out_the_steps_that_carried_other_prompts():
    # 64 × 512 prompt tokens need four 8192-token steps, so early starters decode through long
    # mixed steps: their mean duration over the step count overstates the decode step.
    s = spec(0)
    server = SimulatedServer(s, seed=5)
    batch = 64
    results = micro.probe_checked(server, micro.decoders(batch, PROMPT, GEN))
    assert all(len(r.token_times_s) == GEN for r in results)
    steps = micro.steps_per_seq(GEN, batch, 0, 0.0)
    traced = micro.decode_window(results, steps)
    untraced = micro.decode_window([dataclasses.replace(r, token_times_s=()) for r in results], steps)
    truth = true_step_s(s, batch, PROMPT + GEN / 2)
    assert untraced.step_s == pytest.approx(untraced.mean_duration_s / steps, rel=1e-12)
    assert traced.step_s == pytest.approx(truth, rel=0.005)
    assert untraced.step_s > 1.05 * truth


@pytest.mark.parametrize(("batch", "chunk"), [(4, 256), (32, 2048)])
@pytest.mark.parametrize("gamma", [0, 4])
def test_mixed_step_is_read_off_the_trace(monkeypatch, gamma, batch, chunk):
    s = spec(gamma)
    server = SimulatedServer(s, seed=9)
    plan = micro.MicroPlan(phases=("mixed",), batch_sizes=(batch,), prompt_tokens=PROMPT, gen_tokens=GEN, iterations=1)
    pilot = micro.decode_run(server, batch, PROMPT, GEN, gamma)
    single = micro.probe_checked(server, [ProbeRequest(0.0, chunk, 1)])[0]
    layout = micro.mixed_layout(pilot, GEN, single.done_s - single.sent_s, plan)

    real = micro._traced_mixed_steps
    traced: list[float | None] = []

    def spy(dec, inj, tau_s):
        traced.append(real(dec, inj, tau_s))
        return traced[-1]

    monkeypatch.setattr(micro, "_traced_mixed_steps", spy)
    warnings: list[str] = []
    step = micro.mixed_step_s(server, batch, PROMPT, chunk, layout, gamma, warnings.append)
    assert traced and traced[0] is not None and step == traced[0]  # the trace, not the window difference
    truth = true_step_s(s, batch, PROMPT + layout.gen_tokens / 2, chunk)
    assert step == pytest.approx(truth, rel=TOLERANCE)
    assert step > true_step_s(s, batch, PROMPT + layout.gen_tokens / 2)  # the chunk costs something
    assert warnings == []


def test_a_mixed_run_whose_injection_outlasts_a_decoder_is_rerun_with_longer_decoders():
    """With SD each decoder accepts at its own rate: in a batch of 64 with widely spread
    acceptance the luckiest finishes well before the mean the layout was sized by, and the last
    injection lands after it. The run is repeated with longer decoders (and the row's context
    says so) instead of failing the whole bench."""
    s = dataclasses.replace(spec(4), acceptance={"": AcceptanceClass(0.6, concentration=4.0)})
    batch, chunk = 64, 128
    plan = micro.MicroPlan(
        phases=("mixed",),
        batch_sizes=(batch,),
        prompt_tokens=PROMPT,
        gen_tokens=GEN,
        iterations=1,
        chunk_tokens=(chunk,),
        chunk_phase_tokens=0,  # the very chunk sized above
    )
    server = SimulatedServer(s, seed=1)
    pilot = micro.decode_run(server, batch, PROMPT, GEN, 4)
    single = micro.probe_checked(server, [ProbeRequest(0.0, chunk, 1)])[0]
    sized = micro.mixed_layout(pilot, GEN, single.done_s - single.sent_s, plan)
    with pytest.raises(micro.InjectionOutsideWindow, match=r"mixed B=64: a 128-token injection .*N₂ = \d+ tokens"):
        micro.mixed_step_s(server, batch, PROMPT, chunk, sized, 4)

    rows = micro.run_micro(SimulatedServer(s, seed=1), plan)
    (row,) = [r for r in rows if r.phase == "mixed"]
    assert row.context_len > PROMPT + sized.gen_tokens // 2  # ran with the longer decoders
    truth = true_step_s(s, batch, row.context_len, chunk)
    assert row.latency_s == pytest.approx(truth, rel=TOLERANCE)
