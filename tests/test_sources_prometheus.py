"""The Prometheus source against a REAL Prometheus scraping a vLLM-format server."""

import contextlib
import threading
import time

import pytest

from controller.observation import FailureReason, Observation, ObservationFailure
from controller.sources.prometheus import DEFAULT_QUERIES, PrometheusSource, render_queries

pytestmark = pytest.mark.prometheus


class Traffic:
    """Drives the fake vLLM at ~8 requests/s in a background thread (bounded in time)."""

    def __init__(self, fake, per_tick=2, tick_s=0.25, max_s=120):
        self.fake, self.per_tick, self.tick_s, self.max_s = fake, per_tick, tick_s, max_s
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        t_end = time.monotonic() + self.max_s
        while not self.stop.is_set() and time.monotonic() < t_end:
            n = self.per_tick
            kw = dict(requests=n, prompt_tokens=n * 400, gen_tokens=n * 100, e2e_latency_s=1.5)
            if self.fake.sd_enabled:
                kw.update(
                    drafts=n * 30,
                    draft_tokens=n * 120,
                    accepted_tokens=n * 72,
                    accepted_per_pos=[n * 24, n * 21, n * 15, n * 12],
                )
            self.fake.advance(**kw)
            self.stop.wait(self.tick_s)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(5)


def source(prom, **kw):
    return PrometheusSource(
        prom.url, 'model_name="tiny"', rate_window_s=5, acceptance_window_s=10, long_window_s=20, **kw
    )


def test_observes_rates_acceptance_and_reset(fake_vllm, prometheus_server):
    prom = prometheus_server({"vllm": [fake_vllm.target]})
    with Traffic(fake_vllm):
        prom.wait_for("sum(rate(vllm:request_success_total[5s])) > 0", timeout_s=30)
        time.sleep(11)  # fill the acceptance window
        o = source(prom).observe(time.time())
        assert isinstance(o, Observation), o
        assert 4 <= o.arrival_rate_rps <= 12  # 8 req/s nominal
        assert o.acceptance_rate == pytest.approx(0.6, abs=0.02)
        # Every request of this traffic has 400 prompt and 100 generated tokens: the bucket
        # increases (by `le`, through PromQL) say the spread is small, not missing.
        assert o.prompt_tokens_std is not None and o.prompt_tokens_std < 60
        assert o.gen_tokens_std is not None and o.gen_tokens_std < 40  # within its (50, 100] bucket
        assert o.position_acceptance == pytest.approx((0.8, 0.7, 0.5, 0.4), abs=0.03)
        assert o.mean_prompt_tokens == pytest.approx(400, rel=0.02)
        assert o.mean_gen_tokens == pytest.approx(100, rel=0.02)
        assert o.sd_series_present is True
        assert o.sample_age_s < 5
        assert o.running_context_tokens is None  # no KV usage exported (old vLLM, the simulator)
        started = o.server_started_at
        assert started is not None and started < time.time() - 10
        # A restart without SD: counters reset, SD series vanish; rates stay sane.
        restarted = time.time()
        fake_vllm.restart(sd_enabled=False)
        time.sleep(3)
        o = source(prom).observe(time.time())
        assert isinstance(o, Observation)
        assert 0 <= o.arrival_rate_rps <= 20
        assert o.sd_series_present is False and o.acceptance_rate is None
        assert o.server_started_at == pytest.approx(restarted, abs=1.0)  # vLLM's counters say when


def test_failures_are_named(fake_vllm, prometheus_server):
    prom = prometheus_server({"vllm": [fake_vllm.target]})
    with Traffic(fake_vllm, max_s=30):
        prom.wait_for("vllm:num_requests_running", timeout_s=30)
        time.sleep(2)
        none_match = PrometheusSource(prom.url, 'model_name="absent"', rate_window_s=5).observe(time.time())
        assert none_match.reason is FailureReason.EMPTY
        bad = source(prom, queries={"arrival_rate": "sum(rate(vllm:request_success_total[5s]"}).observe(time.time())
        assert bad.reason is FailureReason.QUERY_ERROR
        nan = source(prom, queries={"arrival_rate": "0/0"}).observe(time.time())
        assert nan.reason is FailureReason.NAN
    prom.stop()
    down = source(prom, timeout_s=1).observe(time.time())
    assert isinstance(down, ObservationFailure) and down.reason is FailureReason.UNREACHABLE


def test_queries_are_rendered_and_overridable():
    q = render_queries('instance="a:1"', 60, 300, 900, {"running": "max(vllm:num_requests_running{$SEL})"})
    assert q["arrival_rate"].startswith('sum(rate(vllm:request_success_total{instance="a:1"}[60s]))')
    assert "[300s]" in q["acceptance_rate"] and "[900s]" in q["arrival_rate_long"]
    assert q["running"] == 'max(vllm:num_requests_running{instance="a:1"})'
    with pytest.raises(ValueError, match="unknown query name"):
        render_queries("", 60, 300, 900, {"arival_rate": "1"})
    assert set(q) == set(DEFAULT_QUERIES)


class KvServer:
    """A vLLM-shaped /metrics with the KV context's series (which the fake vLLM lacks): 8
    requests/s complete, each with 120 prompt tokens from the prefix cache when ``cached``;
    per engine a constant running batch and KV usage, and ``vllm:cache_config_info`` with no
    model_name label, as vLLM 0.32 writes it."""

    def __init__(
        self,
        engines: dict[str, tuple[float, object, tuple[int, int] | None]],
        cached: bool = False,
        caching: dict[str, bool] | None = None,  # enable_prefix_caching per engine (none: no label)
    ):
        from tests.support.stub_http import StubHttp

        self.engines, self.cached, self.t0 = engines, cached, time.monotonic()
        self.caching = caching or {}
        self.stub = StubHttp(self.respond)

    def respond(self, method, path, body):
        done = 8.0 * (time.monotonic() - self.t0)
        lines = [
            "# TYPE vllm:request_success_total counter",
            f'vllm:request_success_total{{engine="0",finished_reason="stop",model_name="tiny"}} {done}',
            "# TYPE vllm:num_requests_waiting gauge",
            'vllm:num_requests_waiting{engine="0",model_name="tiny"} 0',
            "# TYPE vllm:num_requests_running gauge",
            *(
                f'vllm:num_requests_running{{engine="{e}",model_name="tiny"}} {r}'
                for e, (r, _, _) in self.engines.items()
            ),
            "# TYPE vllm:kv_cache_usage_perc gauge",
            *(
                f'vllm:kv_cache_usage_perc{{engine="{e}",model_name="tiny"}} {u}'
                for e, (_, u, _) in self.engines.items()
            ),
            "# TYPE vllm:cache_config_info gauge",
            *(
                f'vllm:cache_config_info{{block_size="{c[1]}",{self._caching(e)}engine="{e}",num_gpu_blocks="{c[0]}"}} 1.0'
                for e, (_, _, c) in self.engines.items()
                if c is not None
            ),
        ]
        if self.cached:
            lines += [
                "# TYPE vllm:prompt_tokens_cached_total counter",
                f'vllm:prompt_tokens_cached_total{{engine="0",model_name="tiny"}} {120 * done}',
            ]
        return 200, "text/plain; version=0.0.4", ("\n".join(lines) + "\n").encode()

    def _caching(self, engine: str) -> str:
        return f'enable_prefix_caching="{self.caching[engine]}",' if engine in self.caching else ""

    @property
    def target(self):
        return self.stub.url.removeprefix("http://")

    def __enter__(self):
        self.stub.__enter__()
        return self

    def __exit__(self, *exc):
        self.stub.__exit__(*exc)


def test_running_context_per_engine_with_prefix_cache_hits(prometheus_server):
    half_block = 0.5 * (128 - 1)
    servers = {
        "one": KvServer({"0": (8, 0.2, (8192, 128))}, cached=True, caching={"0": True}),
        # data parallel, unequal caches: Σ usage × capacity / Σ running, not a mean of usages
        "two": KvServer({"0": (10, 0.5, (8192, 128)), "1": (2, 0.25, (4096, 128))}, caching={"0": True, "1": False}),
        "garbage": KvServer({"0": (8, 1.7, (8192, 128))}),
        "noconfig": KvServer({"0": (8, 0.2, None)}),
        "missing_engine": KvServer({"0": (8, 0.2, (8192, 128)), "1": (8, 0.2, None)}),
    }
    with contextlib.ExitStack() as stack:
        for s in servers.values():
            stack.enter_context(s)
        prom = prometheus_server({job: [s.target] for job, s in servers.items()})
        prom.wait_for("count(rate(vllm:request_success_total[5s]) > 0) == 5", timeout_s=30)
        time.sleep(6)  # a whole rate window of scrapes

        def observe(job):
            src = PrometheusSource(prom.url, f'job="{job}",model_name="tiny"', rate_window_s=5, long_window_s=20)
            o = src.observe(time.time())
            assert isinstance(o, Observation), (job, o)
            assert 4 <= o.arrival_rate_rps <= 12, (job, o)
            caching[job] = o.prefix_caching
            return o.running_context_tokens, o.cached_prompt_tokens

        caching: dict[str, bool | None] = {}
        # 120 cached prompt tokens per completed request: added back to the context, and
        # left out of the prefill the model prices.
        assert observe("one") == pytest.approx((0.2 * 1_048_576 / 8 - half_block + 120, 120), rel=1e-6)
        assert observe("two") == pytest.approx(((0.5 * 1_048_576 + 0.25 * 524_288) / 12 - half_block, 0), rel=1e-6)
        assert observe("garbage")[0] is None
        assert observe("noconfig") == (None, 0.0)
        assert observe("missing_engine")[0] is None
        # enable_prefix_caching from the same series: on only where every engine says on.
        assert caching == {"one": True, "two": False, "garbage": None, "noconfig": None, "missing_engine": None}


def test_an_engine_that_stalls_with_requests_in_it_is_held_as_stalled(fake_vllm, prometheus_server):
    """The real PromQL: requests in the server through the rate window and no token produced is
    held; the same quiet with nothing in the server is a load of zero, not a stall."""
    prom = prometheus_server({"vllm": [fake_vllm.target]})
    fake_vllm.set_gauges(running=12, waiting=0)
    with Traffic(fake_vllm, max_s=30):
        prom.wait_for("sum(rate(vllm:generation_tokens_total[5s])) > 0", timeout_s=30)
        time.sleep(6)
        moving = source(prom).observe(time.time())
        assert isinstance(moving, Observation) and moving.arrival_rate_rps > 0, moving
    # The engine hangs: the gauges stay up, the queue grows, no counter moves.
    fake_vllm.set_gauges(running=12, waiting=30)
    time.sleep(7)  # past the 5 s rate window, scraped every second
    held = source(prom).observe(time.time())
    assert isinstance(held, ObservationFailure) and held.reason is FailureReason.STALLED, held
    assert "no token produced" in held.detail
    fake_vllm.set_gauges(running=0, waiting=0)  # an idle server: nothing waits on it
    time.sleep(7)
    idle = source(prom).observe(time.time())
    assert isinstance(idle, Observation) and idle.arrival_rate_rps == 0.0, idle


def test_an_engine_put_to_sleep_is_held_as_asleep(fake_vllm, prometheus_server):
    prom = prometheus_server({"vllm": [fake_vllm.target]})
    fake_vllm.sleep_level = 0
    with Traffic(fake_vllm, max_s=20):
        prom.wait_for('vllm:engine_sleep_state{sleep_state="awake"} == 1', timeout_s=30)
        time.sleep(2)
        assert isinstance(source(prom).observe(time.time()), Observation)
    fake_vllm.sleep_level = 1
    prom.wait_for('vllm:engine_sleep_state{sleep_state="awake"} == 0', timeout_s=30)
    for selector in ('model_name="tiny"', ""):  # the query's own matcher, with and without one of ours
        held = PrometheusSource(prom.url, selector, rate_window_s=5).observe(time.time())
        assert isinstance(held, ObservationFailure) and held.reason is FailureReason.ASLEEP, (selector, held)
