"""Prompts the prefix cache serves: the model computes P − C tokens that still read all P."""

import math

import pytest

from controller.model import LatencyModel, StepCost, Workload, curves, predict_point, stability_limits

BIG = 10**7


def linear(**target_kw) -> LatencyModel:
    """Target 10 ms + 0.1 ms/token (plus what the test adds); free drafting; no bounds."""
    target = StepCost(0.010, 1e-4, **target_kw)
    return LatencyModel(target=target, verify=target, draft=StepCost(0.0, 0.0), max_num_seqs=BIG)


def test_cached_tokens_are_clamped_to_the_prompt():
    assert Workload(1000, 200, cached_prompt_tokens=400).computed_prompt_tokens == 600
    # vLLM computes the last prompt token however much is cached; a bad reading cancels nothing.
    assert Workload(1000, 200, cached_prompt_tokens=5000).computed_prompt_tokens == 1
    assert Workload(1000, 200, cached_prompt_tokens=-3).computed_prompt_tokens == 1000
    assert Workload(0, 200, cached_prompt_tokens=10).computed_prompt_tokens == 0


def test_attention_pairs_of_the_computed_part_over_the_whole_prefix():
    w = Workload(1000, 200, prompt_tokens_std=300, cached_prompt_tokens=400)
    # Σ over positions 400…1000 ≈ (E[P²] − C²)/2, E[P²] = P² + σ².
    assert w.prompt_pairs == pytest.approx(0.5 * (1000**2 + 300**2 - 400**2))
    assert Workload(1000, 200, prompt_tokens_std=300).prompt_pairs == pytest.approx(0.5 * (1000**2 + 300**2))
    # Never below the computed tokens' own triangle (a measured spread that does not add up).
    odd = Workload(100, 10, prompt_tokens_std=0, cached_prompt_tokens=99.5)
    assert odd.prompt_pairs >= 0.5 * odd.computed_prompt_tokens**2


def test_without_a_context_term_a_cached_prefix_is_a_shorter_prompt():
    # Prefill is priced on the computed tokens only; with nothing read per KV token and no
    # attention-pair term the model cannot tell a cache hit from a shorter prompt.
    m = linear()
    cached = Workload(1500, 250, 0.0, 0.0, cached_prompt_tokens=1000)
    short = Workload(500, 250, 0.0, 0.0)
    for lam in (0.5, 4.0, 12.0):
        a, b = predict_point(m, lam, 0.7, 3, cached), predict_point(m, lam, 0.7, 3, short)
        assert a.latency_off_s == pytest.approx(b.latency_off_s, rel=1e-12)
        assert a.latency_on_s == pytest.approx(b.latency_on_s, rel=1e-12)
    assert stability_limits(m, 0.7, 3, cached) == pytest.approx(stability_limits(m, 0.7, 3, short), rel=1e-12)


def test_decodes_still_read_the_cached_prefix():
    # With a KV-read term the hit is not a shorter prompt: every decode step reads all P.
    m = linear(context_s_per_token=1e-8)
    cached = Workload(1500, 250, 0.0, 0.0, cached_prompt_tokens=1000)
    short = Workload(500, 250, 0.0, 0.0)
    full = Workload(1500, 250, 0.0, 0.0)
    assert cached.mean_context_tokens == full.mean_context_tokens
    for lam in (1.0, 8.0):
        t_cached = predict_point(m, lam, 0.7, 3, cached).latency_off_s
        assert predict_point(m, lam, 0.7, 3, short).latency_off_s < t_cached
        assert t_cached < predict_point(m, lam, 0.7, 3, full).latency_off_s


def test_a_shared_prefix_is_held_once_in_the_kv_cache():
    # A KV cache of 400 k tokens bounds the batch at 400k / held context: the prefix's blocks
    # are shared, so each sequence adds its context less the prefix.
    kv = 400_000.0
    m = LatencyModel(
        target=StepCost(0.010, 1e-4),
        verify=StepCost(0.010, 1e-4),
        draft=StepCost(0.0, 0.0),
        max_num_seqs=BIG,
        kv_cache_tokens_off=kv,
        kv_cache_tokens_on=kv,
    )
    full = Workload(3000, 200, 0.0, 0.0)
    cached = Workload(3000, 200, 0.0, 0.0, cached_prompt_tokens=2000)
    off_full, _ = curves(m, 0.7, 3, full)
    off_cached, _ = curves(m, 0.7, 3, cached)
    assert off_full.batch_bound == pytest.approx(kv / full.mean_context_tokens)
    assert off_cached.batch_bound == pytest.approx(kv / (cached.mean_context_tokens - 2000))
    assert off_cached.stability_limit_rps > off_full.stability_limit_rps


def test_measured_context_counts_the_hits_back_once():
    # occupancy adds the hits back to held/running: held = that less the hits again.
    w = Workload(3000, 200, cached_prompt_tokens=2000, running_context_tokens=3100.0)
    assert w.held_context_tokens == pytest.approx(1100.0)
    assert Workload(3000, 200, running_context_tokens=3100.0).held_context_tokens == pytest.approx(3100.0)


def test_hits_move_the_break_even_up():
    # The draft prefills every prompt too (its KV shares the target's blocks): a cache hit
    # saves SD more than it saves the plain server, and capacity grows for both.
    target, draft = StepCost(0.008, 6e-5), StepCost(0.002, 1.5e-5)
    m = LatencyModel(target=target, verify=target, draft=draft, max_num_seqs=BIG)
    full = Workload(2500, 250, 0.0, 0.0)
    cached = Workload(2500, 250, 0.0, 0.0, cached_prompt_tokens=2000)
    lim_full, lim_cached = stability_limits(m, 0.75, 4, full), stability_limits(m, 0.75, 4, cached)
    assert lim_cached[0] > lim_full[0] and lim_cached[1] > lim_full[1]
    lam = 0.6 * lim_full[1]
    s_full = predict_point(m, lam, 0.75, 4, full)
    s_cached = predict_point(m, lam, 0.75, 4, cached)
    assert s_cached.latency_off_s / s_cached.latency_on_s > s_full.latency_off_s / s_full.latency_on_s
    assert math.isfinite(s_cached.latency_on_s)


def test_a_measured_context_with_hits_is_capped_by_the_lengths():
    # held/running + hits counts each prefix in use once more for the batch: an upper bound.
    lengths = Workload(2100, 280, 280, cached_prompt_tokens=1500).mean_context_tokens
    inflated = Workload(2100, 280, 280, cached_prompt_tokens=1500, running_context_tokens=lengths + 800)
    assert inflated.mean_context_tokens == pytest.approx(lengths)
    # ...and so is the KV bound's: a full cache spreads the prefixes over its many sequences.
    assert inflated.held_context_tokens == pytest.approx(lengths - 1500)
    # Below the lengths' value (short answers to long prompts) the measurement stands.
    short = Workload(2100, 280, 280, cached_prompt_tokens=1500, running_context_tokens=lengths - 300)
    assert short.mean_context_tokens == pytest.approx(lengths - 300)
    # Without hits a measured context is taken as it is, above the lengths' value or not.
    assert Workload(2100, 280, 280, running_context_tokens=lengths + 800).mean_context_tokens == lengths + 800
