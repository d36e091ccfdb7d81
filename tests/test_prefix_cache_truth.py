"""The truth side of vLLM's prefix cache: the step simulator's cache, shared-prefix workloads,
vllm:prompt_tokens_cached_total and the load-test column that records it."""

from __future__ import annotations

import random
from dataclasses import fields, replace

import numpy as np
import pytest

from controller import calibration as cal
from controller.benchmark import loadtest
from controller.benchmark.csvio import load_csv
from controller.benchmark.http import HttpServer
from controller.benchmark.probe import ProbeError, ProbeRequest, ServerCounters
from controller.errors import InputError
from controller.sim import gpu as g
from controller.sim.simserver import SimulatedServer
from controller.sim.stepsim import ServerSpec, simulate
from controller.sim.truth_workloads import MIXES, poisson_load
from controller.sim.vllm_exposition import render
from tests.support.fake_vllm import FakeVllmServer

BS = 16
OFF = ServerSpec(noise_sigma=0.0)
SD = ServerSpec(draft=g.LLAMA_3_2_1B, draft_length=4)


def run(spec, arrival, prompt, gen, group=None, prefix=None, seed=0):
    n = len(arrival)
    kw = {} if group is None else {"prefix_group": np.array(group), "prefix_tokens": np.array(prefix)}
    return simulate(
        spec,
        np.array(arrival, float),
        np.array(prompt),
        np.array(gen),
        np.full(n, 0.7),
        np.random.default_rng(seed),
        **kw,
    )


def same(a, b) -> bool:
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            if not np.array_equal(x, y, equal_nan=x.dtype.kind == "f"):
                return False
        elif x != y:
            return False
    return True


# --------------------------------------------------------------------------- the simulator


@pytest.mark.parametrize(
    "spec", [SD, replace(SD, kv_cache_tokens=6000, max_num_batched_tokens=2048)], ids=["sd", "tiny"]
)
def test_no_group_is_the_cacheless_run_exactly(spec):
    rng = np.random.default_rng(3)
    n = 200
    arrival = np.sort(rng.uniform(0, 20, n))
    prompt, gen = rng.integers(20, 2500, n), rng.integers(1, 400, n)
    plain = run(spec, arrival, prompt, gen, seed=9)
    none = run(spec, arrival, prompt, gen, [-1] * n, [0] * n, seed=9)
    sub_block = run(spec, arrival, prompt, gen, [7] * n, [BS - 1] * n, seed=9)  # no whole block to share
    assert same(plain, none) and same(plain, sub_block)
    assert plain.num_cached_tokens == 0 and not plain.cached_tokens.any()
    if spec.kv_cache_tokens:
        assert plain.preemptions.sum() > 0  # the slow path is covered too


def test_a_later_request_of_the_group_hits_the_prefix():
    arrival, prompt, gen, prefix = [0.0, 1.0], [2000, 2000], [200, 200], [1500, 1500]
    shared = run(OFF, arrival, prompt, gen, [5, 5], prefix)
    alone = run(OFF, arrival, prompt, gen, [5, 6], prefix)  # different groups: nothing to share
    assert shared.cached_tokens.tolist() == [0, 1500 // BS * BS] and shared.num_cached_tokens == 1488
    assert alone.num_cached_tokens == 0
    ttft = shared.first_token_s - shared.arrival_s
    ttft_alone = alone.first_token_s - alone.arrival_s
    assert ttft[0] == ttft_alone[0] and ttft[1] < 0.6 * ttft_alone[1]
    # Noise-free, one token per step each: the steps line up; B holds 93 blocks fewer.
    assert shared.steps == alone.steps
    both = shared.step_running == 2
    assert both.sum() > 20
    assert ((alone.step_kv_tokens - shared.step_kv_tokens)[both] == 1488).all()
    assert shared.step_kv_tokens[-1] == 0  # the cached prefix nobody runs counts as free, as in vLLM


def test_what_a_request_admitted_behind_its_group_s_first_finds():
    # Both arrive at once: B is admitted in A's first step and hits what A scheduled in it
    # (vLLM caches blocks when it allocates them, before the step runs).
    same_step = run(OFF, [0.0, 0.0], [2000, 2000], [10, 10], [1, 1], [1500, 1500])
    assert same_step.cached_tokens.tolist() == [0, 1488]
    assert same_step.admitted_s[0] == same_step.admitted_s[1]
    # A's prefill is cut by the budget: B waits for budget (A runs first) and then finds the
    # whole prefix A scheduled meanwhile, 2400 tokens, although A computed only 2048 of them
    # before that step.
    chunked = run(replace(OFF, max_num_batched_tokens=1024), [0.0, 0.0], [3000, 3000], [10, 10], [1, 1], [2400, 2400])
    assert chunked.cached_tokens.tolist() == [0, 2400]
    assert chunked.step_tokens[:3].tolist() == [1024, 1024, 952 + 72]  # B takes the budget A left
    # Nothing is cached before the group's first request is scheduled.
    first = run(OFF, [0.0, 0.5], [2000, 2000], [10, 10], [-1, 1], [0, 1500])
    assert first.num_cached_tokens == 0


def test_a_fully_cached_prompt_still_computes_its_last_block():
    res = run(OFF, [0.0, 1.0], [1600, 1600], [5, 5], [0, 0], [1600, 1600])
    assert res.cached_tokens.tolist() == [0, 1584]  # 100 blocks cached, the last one recomputed
    admitted = int(np.searchsorted(res.step_end_s, res.admitted_s[1], side="right"))
    assert res.step_tokens[admitted] == 16
    odd = run(OFF, [0.0, 1.0], [1590, 1590], [5, 5], [0, 0], [1590, 1590])
    assert odd.cached_tokens.tolist() == [0, 1584]  # whole blocks only: 6 tokens computed


def test_an_idle_prefix_is_evicted_from_its_tail_when_blocks_run_out():
    spec = replace(OFF, kv_cache_tokens=4096)  # 256 blocks
    res = run(spec, [0.0, 1.0, 2.0], [1700, 3000, 1700], [10, 10, 10], [0, -1, 0], [1600, 0, 1600])
    # B needs 189 blocks, 156 are free: 33 of the idle prefix's 100 go, 67 stay for C.
    assert res.cached_tokens.tolist() == [0, 0, 67 * BS]


@pytest.mark.parametrize(
    "spec", [replace(OFF, kv_cache_tokens=8000), replace(SD, kv_cache_tokens=8000)], ids=["off", "sd"]
)
def test_preemption_with_shared_prefixes_frees_every_block(spec):
    rng = np.random.default_rng(4)
    n = 120
    group = rng.integers(0, 2, n)
    prefix = np.where(group == 0, 1024, 2000)
    prompt = prefix + rng.integers(1, 800, n)
    gen = rng.integers(50, 600, n)
    res = run(spec, np.sort(rng.uniform(0, 5, n)), prompt, gen, group, prefix)
    assert res.preemptions.sum() > 10
    assert np.isfinite(res.finish_s).all() and (res.generated_tokens == gen).all()
    capacity = spec.kv_tokens() // BS * BS
    # Referenced KV stays within [0, cache]: free blocks never exceed the total (no double
    # free; simulate also checks every step and the final balance itself).
    assert res.step_kv_tokens.min() >= 0 and res.step_kv_tokens.max() <= capacity
    assert res.step_kv_tokens[-1] == 0
    assert res.num_cached_tokens == res.cached_tokens.sum() > 0
    if not spec.sd_on:
        # Without drafts a request schedules (prompt − hit) + (gen − 1) tokens, plus what it
        # recomputes after each preemption: its whole prompt and more if nothing were cached.
        extra = res.step_tokens.sum() - (prompt - res.cached_tokens + gen - 1).sum()
        assert 0 < extra < 0.6 * (res.preemptions * prompt).sum()  # re-admissions hit the prefix again


def test_bad_prefix_arguments_are_refused():
    with pytest.raises(ValueError, match="same prefix_tokens"):
        run(OFF, [0, 0], [100, 100], [5, 5], [0, 0], [32, 48])
    with pytest.raises(ValueError, match=r"\[0, prompt_tokens\]"):
        run(OFF, [0], [100], [5], [0], [101])
    with pytest.raises(ValueError, match="go together"):
        simulate(
            OFF,
            np.zeros(1),
            np.ones(1, int),
            np.ones(1, int),
            np.ones(1),
            np.random.default_rng(),
            prefix_group=np.zeros(1, int),
        )


# --------------------------------------------------------------------------- the simulated server


@pytest.mark.parametrize("spec", [ServerSpec(), SD], ids=["sd-off", "sd-on"])
def test_the_server_counts_cached_prompt_tokens(spec):
    s = SimulatedServer(spec, seed=1)
    assert s.counters().prompt_cached_tokens == 0.0
    reqs = [
        ProbeRequest(0.0, 2000, 20, "chat", prefix_group="sys", prefix_tokens=1500),
        ProbeRequest(1.0, 1800, 20, "chat", prefix_group="sys", prefix_tokens=1500),
        ProbeRequest(2.0, 900, 20, "chat"),
    ]
    s.probe(reqs)
    assert s.counters().prompt_cached_tokens == 1488
    s.probe(reqs)  # each probe starts cold; the counter keeps counting
    c = s.counters()
    assert c.prompt_cached_tokens == 2 * 1488
    assert (c.drafts is None) == (not spec.sd_on)


def test_the_server_checks_prefix_fields_in_one_line():
    s = SimulatedServer(ServerSpec(), seed=1)
    with pytest.raises(ProbeError, match="request 1: prefix_group 'a' has prefix_tokens 64, earlier 32") as err:
        s.probe(
            [
                ProbeRequest(0, 100, 5, prefix_group="a", prefix_tokens=32),
                ProbeRequest(0, 100, 5, prefix_group="a", prefix_tokens=64),
            ]
        )
    assert "\n" not in str(err.value)
    with pytest.raises(ProbeError, match="request 0: prefix_tokens 200"):
        s.probe([ProbeRequest(0, 100, 5, prefix_group="a", prefix_tokens=200)])


# --------------------------------------------------------------------------- workloads


def test_system_prompt_mix_shares_four_prefixes():
    reqs = poisson_load(5, 200, "system_prompt", np.random.default_rng(1))
    assert len(reqs) > 800
    assert {r.prefix_tokens for r in reqs} == {1536} and {r.kind for r in reqs} == {"chat"}
    assert {r.prefix_group for r in reqs} == {"chat:0", "chat:1", "chat:2", "chat:3"}
    assert min(r.prompt_tokens for r in reqs) > 1536
    body = np.mean([r.prompt_tokens - 1536 for r in reqs])
    assert body == pytest.approx(600, rel=0.08)
    agent = poisson_load(5, 100, "agent", np.random.default_rng(1))
    assert {r.prefix_group for r in agent} == {"code:0", "code:1"} and {r.prefix_tokens for r in agent} == {3072}


def old_poisson_load(rate, duration, mix, rng):
    """The draw before shared prefixes existed, inline: (send, prompt, gen, kind) per request."""
    n = int(rng.poisson(rate * duration))
    send = np.sort(rng.uniform(0.0, duration, n))
    w = np.array([w for _, w in mix.classes], dtype=float)
    which = rng.choice(len(mix.classes), size=n, p=w / w.sum())
    prompt, gen = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    for i, (c, _) in enumerate(mix.classes):
        idx = np.flatnonzero(which == i)
        mu = np.log(c.prompt_mean_tokens) - 0.5 * c.prompt_sigma**2
        prompt[idx] = np.clip(np.rint(rng.lognormal(mu, c.prompt_sigma, idx.size)), 1, c.max_prompt_tokens)
        gen[idx] = np.clip(
            np.rint(rng.gamma(c.gen_shape, c.gen_mean_tokens / c.gen_shape, idx.size)), 1, c.max_gen_tokens
        )
    return [
        (float(s), int(p), int(m), mix.classes[k][0].kind) for s, p, m, k in zip(send, prompt, gen, which, strict=True)
    ]


@pytest.mark.parametrize("name", ["chat", "code", "mixed", "long_prompt", "long_tail", "reasoning", "rag_mix"])
def test_existing_mixes_draw_exactly_as_before(name):
    new = poisson_load(4, 100, name, np.random.default_rng(11))
    assert [(r.send_at_s, r.prompt_tokens, r.max_tokens, r.kind) for r in new] == old_poisson_load(
        4, 100, MIXES[name], np.random.default_rng(11)
    )
    assert all(r.prefix_group == "" and r.prefix_tokens == 0 for r in new)


# --------------------------------------------------------------------------- load test and CSV


def system_prompt_load(rate, duration, rng: random.Random):
    return poisson_load(rate, duration, "system_prompt", np.random.default_rng(rng.randrange(2**32)))


def test_run_load_records_cached_prompt_tokens_and_the_csv_keeps_them(tmp_path):
    plan = loadtest.LoadPlan(rates=(2.0,), duration_s=120.0, drain_s=60.0, workload="system_prompt")
    (row,) = loadtest.run_load(SimulatedServer(SD, seed=2), system_prompt_load, plan)
    # All but each group's first request (4 of ~240) find the 1536-token system prompt.
    assert row.cached_prompt_tokens == pytest.approx(1536 * (1 - 4 / row.sent), rel=0.01)
    assert 1400 < row.cached_prompt_tokens <= 1536
    path = tmp_path / "load.csv"
    path.write_text(load_csv([row, replace(row, cached_prompt_tokens=None)]))
    rows, _ = cal.read_load_csv(path)
    assert [r.cached_prompt_tokens for r in rows] == [pytest.approx(row.cached_prompt_tokens, abs=0.005), None]
    assert [r.mean_prompt_tokens for r in rows] == [pytest.approx(row.mean_prompt_tokens, abs=0.005)] * 2
    # validate prices what the run measured: the hits reach the model's workload.
    assert rows[0].workload().cached_prompt_tokens == pytest.approx(row.cached_prompt_tokens, abs=0.005)
    assert rows[1].workload().cached_prompt_tokens == 0.0


def test_an_old_csv_without_the_column_reads_none_and_a_bad_cell_is_one_line(tmp_path):
    header = ",".join(cal.LOAD_COLUMNS)
    old = tmp_path / "old.csv"
    old.write_text(f"{header},running_context_tokens\n1,off,0,,1.5,512,256,\n")
    assert [r.cached_prompt_tokens for r in cal.read_load_csv(old)[0]] == [None]
    bad = tmp_path / "bad.csv"
    bad.write_text(f"{header},cached_prompt_tokens\n1,off,0,,1.5,512,256,lots\n")
    with pytest.raises(InputError) as err:
        cal.read_load_csv(bad)
    assert str(err.value) == f"{bad}:2: column cached_prompt_tokens: 'lots' is not a number"
    bad.write_text(f"{header},cached_prompt_tokens\n1,off,0,,1.5,512,256,-3\n")
    with pytest.raises(InputError, match=r"bad.csv:2: column cached_prompt_tokens: -3 is negative"):
        cal.read_load_csv(bad)


def test_cached_per_request_and_a_restarted_counter():
    before, after = ServerCounters(prompt_cached_tokens=100.0), ServerCounters(prompt_cached_tokens=700.0)
    assert loadtest.cached_per_request(2.0, before, after, 4) == 150.0
    assert loadtest.cached_per_request(2.0, ServerCounters(), after, 4) is None
    with pytest.raises(ProbeError, match=r"rate 2: vllm:prompt_tokens_cached_total went down \(700 -> 100\)") as err:
        loadtest.cached_per_request(2.0, after, before, 4)
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------- real vLLM over HTTP


class TwoEngineVllm(FakeVllmServer):
    """The fake vLLM's /metrics with a second engine, and a chosen cached-prompt counter."""

    cached: tuple[float, float] | None = (0.0, 0.0)

    def render(self) -> str:
        if self.cached is None:
            return (
                "\n".join(line for line in super().render().splitlines() if "prompt_tokens_cached" not in line) + "\n"
            )
        c = self.snapshot()
        return render(replace(c, prompt_tokens_cached_total=self.cached[0])) + render(
            replace(c, engine="1", prompt_tokens_cached_total=self.cached[1])
        )


@pytest.fixture
def vllm():
    server = TwoEngineVllm(sd_enabled=False).start()
    yield server
    server.stop()


def test_http_counters_sum_the_cached_prompt_tokens_over_engines(vllm):
    vllm.cached = (1000.0, 536.0)
    assert HttpServer(vllm.url, "tiny", 10).counters().prompt_cached_tokens == 1536.0
    vllm.cached = None  # an older vLLM without the counter
    assert HttpServer(vllm.url, "tiny", 10).counters().prompt_cached_tokens is None


def test_http_requests_of_a_group_share_their_first_tokens(vllm):
    vllm.prefill_s = vllm.step_s = 0.0
    reqs = [
        ProbeRequest(0.0, 40, 2, prefix_group="a", prefix_tokens=24),
        ProbeRequest(0.0, 30, 2, prefix_group="a", prefix_tokens=24),
        ProbeRequest(0.0, 40, 2, prefix_group="b", prefix_tokens=24),
        ProbeRequest(0.0, 40, 2),
    ]
    HttpServer(vllm.url, "tiny", 10, seed=1).probe(reqs)
    prompts = [b["prompt"] for b in vllm.completions]  # in arrival order, which threads decide
    (a2,) = [p for p in prompts if len(p) == 30]
    (a1,) = [p for p in prompts if len(p) == 40 and p[:24] == a2[:24]]
    others = [p for p in prompts if len(p) == 40 and p is not a1]  # group b's and the plain one
    assert len(others) == 2 and all(p[:24] != a1[:24] for p in others)
    assert a1[24:30] != a2[24:30]  # past the prefix each request is its own
    # The same group's prefix again in a later probe (a real server's cache outlives a probe).
    HttpServer(vllm.url, "tiny", 10, seed=2).probe(reqs[:1])
    assert vllm.completions[-1]["prompt"][:24] == a1[:24]
    with pytest.raises(ProbeError, match="request 1: prefix_group 'a' has prefix_tokens 16, earlier 24"):
        HttpServer(vllm.url, "tiny", 10).probe([reqs[0], replace(reqs[1], prefix_tokens=16)])


def test_the_load_test_workload_puts_a_shared_prefix_in_front():
    plain = loadtest.lognormal_workload(300, 100, 0.5, kind="chat")
    shared = loadtest.lognormal_workload(300, 100, 0.5, kind="chat", prefix_tokens=1024, prefix_groups=3)
    a, b = plain(4.0, 60.0, random.Random(5)), shared(4.0, 60.0, random.Random(5))
    assert {r.prefix_group for r in a} == {""} and {r.prefix_tokens for r in a} == {0}
    assert {r.prefix_group for r in b} == {"prefix0", "prefix1", "prefix2"} and {r.prefix_tokens for r in b} == {1024}
    # The same bodies behind the prefix (one more draw per request, after the lengths: the
    # arrivals and the first request's lengths match).
    assert b[0].prompt_tokens == a[0].prompt_tokens + 1024 and b[0].send_at_s == a[0].send_at_s
    with pytest.raises(ValueError, match="both be > 0, or both 0"):
        loadtest.lognormal_workload(300, 100, 0.5, prefix_tokens=1024)
    plan = loadtest.LoadPlan(rates=(2.0,), duration_s=120.0, drain_s=60.0, workload="chat")
    (row,) = loadtest.run_load(SimulatedServer(SD, seed=2), shared, plan)
    assert 0.9 * 1024 < row.cached_prompt_tokens <= 1024
