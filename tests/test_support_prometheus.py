"""The shared test support works end to end: a real Prometheus scrapes FakeVllmServer."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
import requests

from tests.support.fake_vllm import FakeVllmServer
from tests.support.prometheus import PrometheusError, PrometheusServer, sample_values

pytestmark = pytest.mark.prometheus


def feed(fake: FakeVllmServer, rps: int = 5) -> None:
    """One 0.25 s step of steady traffic (SD counters too when SD is on)."""
    sd = fake.sd_enabled
    fake.advance(
        requests=rps,
        prompt_tokens=30 * rps,
        gen_tokens=48 * rps,
        e2e_latency_s=1.2,
        drafts=12 * rps if sd else 0,
        draft_tokens=48 * rps if sd else 0,
        accepted_tokens=30 * rps if sd else 0,
        accepted_per_pos=[12 * rps, 9 * rps, 6 * rps, 3 * rps] if sd else None,
    )


def drive(fake: FakeVllmServer, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        feed(fake)
        time.sleep(0.25)


@contextlib.contextmanager
def driving(fake: FakeVllmServer) -> Iterator[None]:
    """Feed the fake steady traffic in the background while the block runs."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(0.25):
            feed(fake)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)


def test_rate_of_a_driven_counter_becomes_positive(prometheus_server, fake_vllm) -> None:
    prom = prometheus_server({"vllm": [fake_vllm.target]})
    with driving(fake_vllm):
        result = prom.wait_for(
            "sum(rate(vllm:request_success_total[5s]))",
            timeout_s=20,
            predicate=lambda r: bool(r) and sample_values(r)[0] > 0,
        )
    assert sample_values(result)[0] > 0
    # The labels the controller selects on survive the scrape.
    series = prom.query('vllm:request_success_total{model_name="tiny",finished_reason="length"}')
    assert series and series[0]["metric"]["engine"] == "0"
    accepted = prom.query("vllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert sorted(s["metric"]["position"] for s in accepted) == ["0", "1", "2", "3"]


def test_a_restart_of_vllm_never_gives_a_negative_rate(prometheus_server, fake_vllm) -> None:
    prom = prometheus_server({"vllm": [fake_vllm.target]})
    prom.wait_for("up == 1", timeout_s=15)
    start = time.time()
    with driving(fake_vllm):
        prom.wait_for("rate(vllm:request_success_total[5s]) > 0", timeout_s=20)
    fake_vllm.restart(sd_enabled=False)  # counters back to 0, SD series gone
    scrapes = fake_vllm.scrapes
    drive(fake_vllm, 1)
    with driving(fake_vllm):
        # Two scrapes after the reset: the reset is in the TSDB, and then some growth.
        prom.wait_for("vllm:request_success_total", predicate=lambda r: fake_vllm.scrapes > scrapes + 2)
    values = [
        float(v)
        for series in prom.query_range("rate(vllm:request_success_total[5s])", start, time.time(), 0.5)
        for _, v in series["values"]
    ]
    assert values, "no rate samples at all"
    assert min(values) >= 0
    assert max(values) > 0
    # SD series went away with the restart: the latest scrape has none.
    assert prom.query("vllm:spec_decode_num_drafts_total") == []


def test_bad_promql_raises_with_the_query_in_the_message(prometheus_server, fake_vllm) -> None:
    prom = prometheus_server({"vllm": [fake_vllm.target]})
    with pytest.raises(PrometheusError, match="sum\\(rate"):
        prom.query("sum(rate(vllm:request_success_total[5s])")


def test_restart_keeps_port_and_data(prometheus_bin, tmp_path, fake_vllm) -> None:
    with PrometheusServer(tmp_path, {"vllm": [fake_vllm.target]}) as prom:
        url = prom.url
        prom.wait_for("up == 1", timeout_s=15)
        prom.restart()
        assert prom.url == url
        assert requests.get(f"{url}/-/ready", timeout=5).status_code == 200
        # Samples from before the restart are still there (same TSDB).
        assert prom.query("count_over_time(up[1m])")
    assert not prom.running
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{url}/-/ready", timeout=2)


def test_wait_for_is_bounded(prometheus_server, fake_vllm) -> None:
    prom = prometheus_server({"vllm": [fake_vllm.target]})
    t0 = time.monotonic()
    with pytest.raises(PrometheusError, match="not met"):
        prom.wait_for("vector(0) > 1", timeout_s=1)
    assert time.monotonic() - t0 < 5


def test_recording_rules_are_evaluated(prometheus_server, fake_vllm, tmp_path) -> None:
    rules = tmp_path / "rules.yml"
    rules.write_text(
        "groups:\n- name: t\n  rules:\n"
        "  - record: test:success:rate5s\n"
        "    expr: sum(rate(vllm:request_success_total[5s]))\n"
    )
    prom = prometheus_server({"vllm": [fake_vllm.target]}, rule_files=[rules])
    assert prom.rules()[0]["rules"][0]["name"] == "test:success:rate5s"
    with driving(fake_vllm):
        prom.wait_for("test:success:rate5s > 0", timeout_s=20)
