"""The ground truth's cost function (gpu.py), its BenchServer and its workload mixes."""

from __future__ import annotations

import numpy as np
import pytest

from controller.benchmark.probe import BenchServer, ProbeError, ProbeRequest
from controller.sim import gpu as g
from controller.sim.simserver import SimulatedServer
from controller.sim.stepsim import ServerSpec
from controller.sim.truth_workloads import MIXES, poisson_load

T, D, GPU = g.LLAMA_3_1_8B, g.LLAMA_3_2_1B, g.H100_SXM


def decode_s(model, batch, ctx=1000, **kw):
    return g.forward_time_s(model, GPU, g.Seqs(np.ones(batch, dtype=int), np.full(batch, ctx)), **kw)


def prefill_s(model, tokens, ctx=0):
    return g.forward_time_s(model, GPU, g.Seqs(np.array([tokens]), np.array([ctx])))


def test_preset_shapes():
    assert 7.9e9 < T.params < 8.1e9  # Llama 3.1 8B
    assert 1.2e9 < D.params < 1.3e9  # Llama 3.2 1B, tied embeddings
    assert T.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2


@pytest.mark.parametrize(
    ("what", "lo_ms", "hi_ms"),
    [
        (lambda: decode_s(T, 1), 6, 8),
        (lambda: decode_s(T, 64), 9, 12),
        (lambda: prefill_s(T, 1000), 40, 60),
        (lambda: decode_s(D, 1, engine_step=False), 1, 2),
        (lambda: decode_s(D, 1), 1, 2),
    ],
)
def test_sanity_ranges(what, lo_ms, hi_ms):
    assert lo_ms <= what() * 1e3 <= hi_ms


def test_monotone_in_tokens_context_and_batch():
    pre = [prefill_s(T, n) for n in range(1, 9000, 37)]
    assert np.all(np.diff(pre) >= 0)
    ctx = [decode_s(T, 8, c) for c in range(0, 32000, 500)]
    assert np.all(np.diff(ctx) > 0)
    bat = [decode_s(T, b) for b in range(1, 300, 3)]
    assert np.all(np.diff(bat) > 0)


def test_memory_bound_plateau_then_compute_slope():
    # Decode: 32× the sequences cost far less than 32× (weights are read once per step).
    assert decode_s(T, 32, ctx=0) / decode_s(T, 1, ctx=0) < 1.3
    # Per-token slope: nearly flat at small token counts, steep past a few hundred tokens.
    small = (prefill_s(T, 64) - prefill_s(T, 16)) / 48
    large = (prefill_s(T, 4096) - prefill_s(T, 2048)) / 2048
    assert large > 5 * small
    # ... and not piecewise linear: the large-batch slope keeps changing (efficiency ramp).
    mid = (prefill_s(T, 2048) - prefill_s(T, 1024)) / 1024
    assert abs(large / mid - 1) > 0.02


def test_attention_grows_with_context_and_uses_each_sequence():
    assert decode_s(T, 64, ctx=8000) > 1.5 * decode_s(T, 64, ctx=1000)
    # A prefill chunk's attention depends on its own context, not the batch mean.
    q = np.array([512, 1])
    uneven = g.forward_time_s(T, GPU, g.Seqs(q, np.array([4000, 0])))
    even = g.forward_time_s(T, GPU, g.Seqs(q, np.array([2000, 2000])))
    assert uneven > even * 1.01


def test_lm_head_only_for_sampled_positions():
    s = g.Seqs(np.array([500]), np.array([0]), np.array([0]))
    s1 = g.Seqs(np.array([500]), np.array([0]), np.array([1]))
    assert g.forward_time_s(T, GPU, s) < g.forward_time_s(T, GPU, s1)


def test_noise_is_mean_one_with_sigma():
    rng = np.random.default_rng(0)
    x = np.array([g.lognormal_noise(rng, 0.02) for _ in range(20000)])
    assert abs(x.mean() - 1) < 1e-3 and 0.018 < x.std() < 0.022
    assert g.lognormal_noise(rng, 0.0) == 1.0


def test_kv_capacity():
    alone = g.kv_capacity_tokens(GPU, T)
    with_draft = g.kv_capacity_tokens(GPU, T, D)
    assert 300_000 < alone < 500_000
    assert 0 < with_draft < alone
    assert g.kv_capacity_tokens(GPU, T, gpu_memory_utilization=0.5) < alone


# ---------------------------------------------------------------------------- SimulatedServer
SD = ServerSpec(draft=D, draft_length=4)


def test_protocol_and_info():
    s: BenchServer = SimulatedServer(SD, seed=1)
    info = s.info()
    assert info.draft_length == 4 and info.max_num_seqs == 256 and info.max_num_batched_tokens == 8192
    assert info.kv_cache_tokens == g.kv_capacity_tokens(GPU, T, D)
    off = SimulatedServer(ServerSpec(), seed=1)
    assert off.info().draft_length == 0 and off.info().kv_cache_tokens == g.kv_capacity_tokens(GPU, T)
    off.probe([ProbeRequest(0.0, 100, 10)])
    c = off.counters()
    assert c.drafts is None and c.draft_tokens is None and c.accepted_tokens is None


def test_probe_results_and_counters_accumulate():
    s = SimulatedServer(SD, seed=2)
    reqs = [ProbeRequest(0.5 * i, 200 + 10 * i, 20 + i, "chat") for i in range(10)]
    res = s.probe(reqs)
    assert [r.sent_s for r in res] == [q.send_at_s for q in reqs]
    assert [r.generated_tokens for r in res] == [q.max_tokens for q in reqs]
    assert all(r.sent_s < r.first_token_s < r.done_s for r in res)
    c1 = s.counters()
    assert c1.drafts > 0 and c1.draft_tokens == 4 * c1.drafts and 0 <= c1.accepted_tokens <= c1.draft_tokens
    s.probe(reqs)
    assert s.counters().drafts > c1.drafts  # a server that stays up keeps counting


def test_deterministic_for_a_seed():
    reqs = poisson_load(3, 20, "mixed", np.random.default_rng(5))
    a = SimulatedServer(SD, seed=7).probe(reqs)
    b = SimulatedServer(SD, seed=7).probe(reqs)
    c = SimulatedServer(SD, seed=8).probe(reqs)
    assert a == b and a != c


def test_kind_selects_acceptance():
    def acceptance(kind):
        s = SimulatedServer(SD, seed=3)
        s.probe([ProbeRequest(0.1 * i, 100, 200, kind) for i in range(40)])
        c = s.counters()
        return c.accepted_tokens / c.draft_tokens

    assert acceptance("code") > acceptance("chat") + 0.03


def test_bad_request_is_a_probe_error():
    with pytest.raises(ProbeError):
        SimulatedServer(SD).probe([ProbeRequest(0.0, 0, 10)])
    with pytest.raises(ProbeError):
        SimulatedServer(ServerSpec(kv_cache_tokens=1000)).probe([ProbeRequest(0.0, 2000, 10)])


# ---------------------------------------------------------------------------- workloads
def test_poisson_load():
    rng = np.random.default_rng(0)
    reqs = poisson_load(10, 300, "mixed", rng)
    assert 2800 < len(reqs) < 3200
    send = np.array([r.send_at_s for r in reqs])
    assert np.all(np.diff(send) >= 0) and send.min() >= 0 and send.max() <= 300
    assert {r.kind for r in reqs} == {"chat", "code"}
    prompt = np.array([r.prompt_tokens for r in reqs])
    gen = np.array([r.max_tokens for r in reqs])
    assert prompt.min() >= 1 and gen.min() >= 1
    assert 850 < prompt.mean() < 1050 and 260 < gen.mean() < 320
    assert gen.std() > 100  # real spread
    longp = poisson_load(5, 200, MIXES["long_prompt"], rng)
    assert 3700 < np.mean([r.prompt_tokens for r in longp]) < 4300
    assert poisson_load(0, 100, "chat", rng) == []
