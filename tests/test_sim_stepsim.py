"""The step-level vLLM v1 scheduler simulation (the ground truth's engine)."""

from __future__ import annotations

import numpy as np
import pytest

from controller.sim import gpu as g
from controller.sim.stepsim import ServerSpec, simulate, step_time_s
from controller.sim.truth_workloads import poisson_load

T, D, GPU = g.LLAMA_3_1_8B, g.LLAMA_3_2_1B, g.H100_SXM


def run(spec, arrival, prompt, gen, alpha=0.7, seed=0):
    n = len(arrival)
    alpha = np.broadcast_to(np.asarray(alpha, dtype=float), (n,))
    return simulate(
        spec, np.asarray(arrival, float), np.asarray(prompt), np.asarray(gen), alpha, np.random.default_rng(seed)
    )


def load(rate_rps, duration_s, seed=0):
    reqs = poisson_load(rate_rps, duration_s, "chat", np.random.default_rng(seed))
    return (
        np.array([r.send_at_s for r in reqs]),
        np.array([r.prompt_tokens for r in reqs]),
        np.array([r.max_tokens for r in reqs]),
    )


def assert_conserved(res, prompt, gen):
    assert np.all(np.isfinite(res.finish_s)) and np.all(np.isfinite(res.first_token_s))
    np.testing.assert_array_equal(res.generated_tokens, gen)
    np.testing.assert_array_equal(res.prompt_tokens, prompt)
    assert np.all(res.admitted_s >= res.arrival_s)
    assert np.all(res.first_token_s > res.admitted_s)
    assert np.all(res.finish_s >= res.first_token_s)
    assert np.all((gen > 1) <= (res.finish_s > res.first_token_s))


@pytest.mark.parametrize("sd", [False, True])
def test_conservation(sd):
    spec = ServerSpec(draft=D if sd else None, draft_length=3 if sd else 0)
    arr, prompt, gen = load(6, 40)
    res = run(spec, arr, prompt, gen)
    assert_conserved(res, prompt, gen)


def test_lone_request_is_one_prefill_step_plus_decode_steps():
    spec = ServerSpec(noise_sigma=0.0)
    prompt, gen = 1200, 50
    res = run(spec, [3.0], [prompt], [gen])
    prefill = g.forward_time_s(T, GPU, g.Seqs(np.array([prompt]), np.array([0])))
    decodes = [g.forward_time_s(T, GPU, g.Seqs(np.array([1]), np.array([prompt + k]))) for k in range(gen - 1)]
    assert res.steps == gen
    assert res.first_token_s[0] - 3.0 == pytest.approx(prefill, rel=1e-12)
    assert res.latency_s[0] == pytest.approx(prefill + sum(decodes), rel=1e-12)


def test_lone_sd_request_verifies_once_per_step_after_prefill():
    spec = ServerSpec(draft=D, draft_length=4, noise_sigma=0.0)
    res = run(spec, [0.0], [300], [200], alpha=0.0)  # nothing accepted: one token per verify
    # The draft model prefills the prompt too.
    prompt_s = [g.forward_time_s(m, GPU, g.Seqs(np.array([300]), np.array([0]))) for m in (T, D)]
    assert res.first_token_s[0] > sum(prompt_s)
    assert res.steps == 200 and res.num_drafts == 199 and res.num_accepted_tokens == 0
    assert res.num_draft_tokens == 4 * 199
    # A verify step costs more than a plain decode step: target over γ+1 tokens plus the draft passes.
    plain = g.forward_time_s(T, GPU, g.Seqs(np.array([1]), np.array([400])))
    assert res.step_s[100] > plain + 4 * g.forward_time_s(
        D, GPU, g.Seqs(np.array([1]), np.array([400])), engine_step=False
    )
    expected = step_time_s(spec, np.array([5]), np.array([300]), np.array([5]), True, np.array([True]))
    assert res.step_s[1] == pytest.approx(expected, rel=1e-12)


def test_chunked_prefill_respects_the_budget():
    spec = ServerSpec(max_num_batched_tokens=512)
    res = run(spec, [0.0], [2000], [5])
    assert res.step_tokens.max() <= 512
    assert list(res.step_tokens[:4]) == [512, 512, 512, 464]  # the 4th chunk ends the prompt
    assert res.step_tokens[4] == 1
    arr, prompt, gen = load(10, 20)
    res = run(spec, arr, prompt, gen)
    assert res.step_tokens.max() <= 512 and np.sum(res.step_tokens == 512) > 10
    assert_conserved(res, prompt, gen)


def test_max_num_seqs_respected():
    spec = ServerSpec(max_num_seqs=4)
    n = 30
    res = run(spec, np.zeros(n), np.full(n, 100), np.full(n, 20))
    assert res.step_seqs.max() == 4
    assert_conserved(res, np.full(n, 100), np.full(n, 20))
    # FCFS: with equal work, admission follows arrival order.
    assert np.all(np.diff(res.admitted_s) >= 0)


@pytest.mark.parametrize("sd", [False, True])
def test_preemption_when_kv_is_tiny(sd):
    spec = ServerSpec(kv_cache_tokens=4096, draft=D if sd else None, draft_length=4 if sd else 0)
    n = 24
    prompt, gen = np.full(n, 600), np.full(n, 300)
    res = run(spec, np.zeros(n), prompt, gen)
    assert res.preemptions.sum() > 0
    assert_conserved(res, prompt, gen)
    roomy = run(ServerSpec(draft=spec.draft, draft_length=spec.draft_length), np.zeros(n), prompt, gen)
    assert roomy.preemptions.sum() == 0


@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_sd_tokens_per_verify_match_the_closed_form(alpha):
    gamma = 4
    spec = ServerSpec(draft=D, draft_length=gamma)
    n = 64
    res = run(spec, np.linspace(0, 5, n), np.full(n, 50), np.full(n, 600), alpha=alpha)
    mean_n = (res.num_accepted_tokens + res.num_drafts) / res.num_drafts
    assert mean_n == pytest.approx((1 - alpha ** (gamma + 1)) / (1 - alpha), rel=0.02)
    per_pos = res.accepted_per_pos / res.num_drafts
    np.testing.assert_allclose(per_pos, alpha ** np.arange(1, gamma + 1), rtol=0.03)


def test_counters_consistent():
    spec = ServerSpec(draft=D, draft_length=3)
    arr, prompt, gen = load(5, 20)
    res = run(spec, arr, prompt, gen)
    assert 0 < res.num_accepted_tokens <= res.num_draft_tokens
    assert res.num_draft_tokens == 3 * res.num_drafts
    assert res.accepted_per_pos.sum() == res.num_accepted_tokens
    assert np.all(np.diff(res.accepted_per_pos) <= 0)  # a later position is accepted only after the earlier
    # Every generated token beyond the prefills' first tokens comes from a verify.
    assert res.num_drafts + res.num_accepted_tokens >= gen.sum() - len(gen)
    assert res.num_drafts <= gen.sum() - len(gen)


def test_latency_rises_with_rate_and_diverges_above_capacity():
    means = []
    for rate in (2, 6, 10):
        arr, prompt, gen = load(rate, 40, seed=rate)
        means.append(run(ServerSpec(), arr, prompt, gen).latency_s.mean())
    assert means[0] < means[1] < means[2]
    over = []
    for duration in (20, 60):
        arr, prompt, gen = load(25, duration, seed=1)
        over.append(run(ServerSpec(), arr, prompt, gen).latency_s.mean())
    assert over[1] > 1.6 * over[0]  # a backlog that grows with time: mean latency ∝ duration
    below = [run(ServerSpec(), *load(6, duration, seed=1)).latency_s.mean() for duration in (20, 60)]
    assert below[1] < 1.2 * below[0]  # below capacity the latency does not grow with duration


def test_guards():
    with pytest.raises(RuntimeError, match="max_steps"):
        run(ServerSpec(max_steps=10), [0.0], [100], [50])
    with pytest.raises(ValueError):
        run(ServerSpec(kv_cache_tokens=512), [0.0], [600], [10])
    res = run(ServerSpec(), [], [], [])
    assert res.steps == 0


def test_a_step_observer_sees_each_step_as_it_ran_and_changes_nothing():
    spec = ServerSpec(draft=D, draft_length=3, noise_sigma=0.0, max_num_batched_tokens=512)
    arr, prompt, gen = load(6, 20)
    alpha = np.full(arr.size, 0.7)
    plain = simulate(spec, arr, prompt, gen, alpha, np.random.default_rng(3))
    views = []
    seen = simulate(spec, arr, prompt, gen, alpha, np.random.default_rng(3), on_step=views.append)
    np.testing.assert_array_equal(seen.finish_s, plain.finish_s)  # the same draws, the same run
    assert len(views) == seen.steps
    np.testing.assert_array_equal([v.seconds for v in views], seen.step_s)  # noise off: the step's own time
    np.testing.assert_array_equal([int(v.query_tokens.sum()) for v in views], seen.step_tokens)
    np.testing.assert_array_equal([v.query_tokens.size for v in views], seen.step_seqs)
    # Every prompt token is computed in a step that flags it: the 512-token budget chunks the
    # long ones, and what the flagged sequences ran is every request's prompt (no preemption).
    assert seen.preemptions.sum() == 0
    assert sum(int(v.query_tokens[v.prefill].sum()) for v in views) == int(prompt.sum())
    decoding = [v for v in views if (~v.prefill).any()]
    assert all(np.all(v.query_tokens[~v.prefill] <= 4) for v in decoding)  # 1 + γ at most


def test_the_smooth_truth_has_no_tile_staircase():
    """H200_SMOOTH (bench_fidelity.py --truth h200-smooth) pads no GEMM to tiles: one more
    decoder never costs more than about one decoder's share, where the H100's 64-token tiles
    make a riser of many."""
    ctx = 1000

    def increments(gpu):
        steps = [g.forward_time_s(T, gpu, g.Seqs(np.ones(b, np.int64), np.full(b, ctx))) for b in range(1, 400)]
        d = np.diff(steps)
        return d.max() / d.mean(), d.min()

    smooth_jump, smooth_min = increments(g.H200_SMOOTH)
    tiled_jump, _ = increments(GPU)
    assert smooth_min > 0.0 and smooth_jump < 1.5, smooth_jump
    assert tiled_jump > 10.0, tiled_jump
