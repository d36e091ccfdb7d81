"""The Prometheus source against a REAL Prometheus scraping a vLLM-format server."""

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
        # A restart without SD: counters reset, SD series vanish; rates stay sane.
        fake_vllm.restart(sd_enabled=False)
        time.sleep(3)
        o = source(prom).observe(time.time())
        assert isinstance(o, Observation)
        assert 0 <= o.arrival_rate_rps <= 20
        assert o.sd_series_present is False and o.acceptance_rate is None


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
