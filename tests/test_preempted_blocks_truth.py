"""The truth's option to keep a preempted request's blocks cached (vLLM's prefix caching hits
them at its readmission): the cache's own bookkeeping, what a run with preemptions recomputes
with and without it, and that a run without preemptions is unchanged."""

from __future__ import annotations

from dataclasses import fields, replace

import numpy as np
import pytest

from controller.benchmark.csvio import bench_csv
from controller.benchmark.micro import MicroPlan, run_micro
from controller.calibration import read_bench_csv
from controller.sim import gpu as g
from controller.sim.fidelity import TruthServer
from controller.sim.simserver import SimulatedServer
from controller.sim.stepsim import ServerSpec, _PreemptedBlocks, simulate

BS = 16
OFF = ServerSpec(noise_sigma=0.0, kv_cache_tokens=8000)
SD = ServerSpec(draft=g.LLAMA_3_2_1B, draft_length=4, kv_cache_tokens=8000)


def crowd(spec: ServerSpec, seed: int = 4, n: int = 120):
    """Long prompts and generations into a small cache: decoders grow until some are preempted."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(600, 2400, n)
    gen = rng.integers(50, 600, n)
    arrival = np.sort(rng.uniform(0, 5, n))
    res = simulate(spec, arrival, prompt, gen, np.full(n, 0.7), np.random.default_rng(seed))
    return res, prompt, gen


def test_blocks_are_kept_hit_and_evicted_oldest_first():
    cache = _PreemptedBlocks(4, BS)
    assert cache.keep(0, blocks=12, computed=10 * BS + 5) == 10  # only full computed blocks
    assert cache.keep(1, blocks=6, computed=6 * BS) == 6
    assert cache.evictable() == 16
    cache.evict(12)  # request 0's ten go first, then two of request 1's
    assert cache.own.tolist() == [0, 4, 0, 0] and cache.evictable() == 4
    # Request 1 readmitted with 3 blocks' worth of tokens + 1: it uses 3, the fourth stays cached.
    assert cache.hit(1, num_tokens=3 * BS + 1, step=0) == 3
    assert cache.shared[1] == 3 and cache.own[1] == 0 and cache.evictable() == 1
    cache.release(1, step=1)  # finished: what it referenced is cached again, under its name
    assert cache.own[1] == 3 and cache.evictable() == 4 and cache.shared[1] == 0
    with pytest.raises(RuntimeError, match="evicted more"):
        cache.evict(5)


@pytest.mark.parametrize("spec", [OFF, SD], ids=["off", "sd"])
def test_a_readmitted_request_recomputes_less_when_its_blocks_stay_cached(spec):
    plain, prompt, gen = crowd(spec)
    kept, _, _ = crowd(replace(spec, cache_preempted_blocks=True))
    assert plain.preemptions.sum() > 10 and kept.preemptions.sum() > 10
    for res in (plain, kept):  # every request done, every block back (simulate checks the balance too)
        assert np.isfinite(res.finish_s).all() and (res.generated_tokens == gen).all()
        assert res.step_kv_tokens[-1] == 0 and res.step_kv_tokens.max() <= spec.kv_tokens() // BS * BS
    # The blocks a hit finds are not computed again: beyond each request's own tokens the runs
    # schedule 47k and 6.9k tokens without SD (28 preemptions each), 71k and 36k with it (rejected
    # drafts are scheduled too).
    base = (prompt + gen - 1).sum()
    recomputed = plain.step_tokens.sum() - base
    assert recomputed > 0
    assert kept.step_tokens.sum() - base < (0.7 if spec.sd_on else 0.3) * recomputed
    assert kept.cached_tokens.sum() == 0  # vLLM's counter: the first admission's hits only


def test_without_preemptions_the_option_changes_nothing():
    spec = replace(SD, kv_cache_tokens=None)
    plain, _, _ = crowd(spec, n=40)
    kept, _, _ = crowd(replace(spec, cache_preempted_blocks=True), n=40)
    assert plain.preemptions.sum() == 0
    for f in fields(plain):
        x, y = getattr(plain, f.name), getattr(kept, f.name)
        if isinstance(x, np.ndarray):
            assert np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), f.name
        else:
            assert x == y, f.name


def test_not_modelled_together_with_prefix_groups():
    spec = replace(OFF, cache_preempted_blocks=True)
    with pytest.raises(ValueError, match="not modelled together with prefix groups"):
        simulate(
            spec,
            np.array([0.0, 1.0]),
            np.array([100, 100]),
            np.array([5, 5]),
            np.full(2, 0.7),
            np.random.default_rng(0),
            prefix_group=np.array([0, 0]),
            prefix_tokens=np.array([64, 64]),
        )


def test_the_truth_server_passes_the_option_on():
    assert TruthServer(cache_preempted_blocks=True).spec(4).cache_preempted_blocks
    assert not TruthServer().spec(0).cache_preempted_blocks


def test_a_bench_of_the_caching_server_records_it_for_the_model(tmp_path):
    # As a real vLLM's cache_config_info says enable_prefix_caching: the simulated server says so
    # where it keeps a preempted request's blocks, and the micro-benchmark's CSV writes it down
    # for calibrate (tests/test_calibration.py: what the model makes of it). The recomputing
    # truth says nothing.
    plan = MicroPlan(phases=("prefill", "target"), batch_sizes=(1, 2), prompt_tokens=64, gen_tokens=8, iterations=2)
    for caching, said in ((True, [1.0]), (False, [])):
        server = SimulatedServer(TruthServer(cache_preempted_blocks=caching).spec(0), seed=1)
        assert server.info().prefix_caching is (True if caching else None)
        path = tmp_path / f"bench-{caching}.csv"
        path.write_text(bench_csv(run_micro(server, plan)), encoding="utf-8")
        rows, _ = read_bench_csv(path)
        assert [r.context_len for r in rows if r.phase == "prefix_caching"] == said
        assert [r.phase for r in rows].count("kv_cache") == 1
