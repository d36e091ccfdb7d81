"""FakeVllmServer serves what tests drive, and fails the way it is told to."""

from __future__ import annotations

import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.support.fake_vllm import FakeVllmServer


def scrape(fake: FakeVllmServer) -> dict[tuple[str, tuple], float]:
    r = requests.get(fake.metrics_url, timeout=5)
    r.raise_for_status()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(r.text)
        for s in f.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    labels = {"engine": "0", "model_name": "tiny", **labels}
    return samples[(name, tuple(sorted(labels.items())))]


def test_advance_moves_counters_and_histograms(fake_vllm: FakeVllmServer) -> None:
    fake_vllm.advance(
        requests=4, prompt_tokens=120, gen_tokens=200, e2e_latency_s=2.0,
        drafts=50, draft_tokens=200, accepted_tokens=120, accepted_per_pos=[50, 40, 20, 10],
    )  # fmt: skip
    fake_vllm.set_gauges(running=3, waiting=1)
    s = scrape(fake_vllm)
    assert value(s, "vllm:request_success_total", finished_reason="length") == 4
    assert value(s, "vllm:request_success_total", finished_reason="stop") == 0
    assert value(s, "vllm:request_prompt_tokens_sum") == 120
    assert value(s, "vllm:request_prompt_tokens_count") == 4
    assert value(s, "vllm:request_generation_tokens_bucket", le="50.0") == 4
    assert value(s, "vllm:e2e_request_latency_seconds_sum") == 8.0
    assert value(s, "vllm:e2e_request_latency_seconds_bucket", le="2.0") == 4
    assert value(s, "vllm:e2e_request_latency_seconds_bucket", le="1.5") == 0
    assert value(s, "vllm:spec_decode_num_draft_tokens_total") == 200
    assert value(s, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 40
    assert value(s, "vllm:num_requests_running") == 3
    assert value(s, "vllm:num_requests_waiting") == 1
    assert value(s, "vllm:inter_token_latency_seconds_count") == 50  # one per step
    assert value(s, "vllm:prompt_tokens_total") == 120


def test_restart_resets_counters_and_toggles_sd_series(fake_vllm: FakeVllmServer) -> None:
    fake_vllm.advance(requests=2, prompt_tokens=10, gen_tokens=10, drafts=1, draft_tokens=4)
    before = fake_vllm.snapshot().created_ts
    time.sleep(0.01)
    fake_vllm.restart(sd_enabled=False)
    s = scrape(fake_vllm)
    assert value(s, "vllm:request_success_total", finished_reason="length") == 0
    assert not any("spec_decode" in k[0] for k in s)
    assert value(s, "vllm:request_success_created", finished_reason="length") > before
    with pytest.raises(ValueError, match="SD"):
        fake_vllm.advance(requests=1, draft_tokens=4)
    fake_vllm.restart(sd_enabled=True, num_speculative_tokens=2)
    s = scrape(fake_vllm)
    positions = {dict(k[1])["position"] for k in s if "per_pos_total" in k[0]}
    assert positions == {"0", "1"}
    assert fake_vllm.restarts == 2


def test_health_endpoint(fake_vllm: FakeVllmServer) -> None:
    assert requests.get(f"{fake_vllm.url}/health", timeout=5).status_code == 200
    assert requests.get(f"{fake_vllm.url}/nope", timeout=5).status_code == 404


def test_fault_modes(fake_vllm: FakeVllmServer) -> None:
    fake_vllm.set_mode("http500")
    assert requests.get(fake_vllm.metrics_url, timeout=5).status_code == 500
    fake_vllm.set_mode("garbage")
    r = requests.get(fake_vllm.metrics_url, timeout=5)
    assert r.status_code == 200
    with pytest.raises(ValueError):
        list(text_string_to_metric_families(r.text))
    fake_vllm.set_mode("hang")
    t0 = time.monotonic()
    with pytest.raises(requests.Timeout):
        requests.get(fake_vllm.metrics_url, timeout=0.5)
    assert time.monotonic() - t0 < 3
    fake_vllm.set_mode("ok")
    assert requests.get(fake_vllm.metrics_url, timeout=5).status_code == 200
    with pytest.raises(ValueError):
        fake_vllm.set_mode("sideways")  # type: ignore[arg-type]


def test_stop_releases_a_hung_request() -> None:
    fake = FakeVllmServer(sd_enabled=False).start()
    fake.set_mode("hang")
    with pytest.raises(requests.Timeout):
        requests.get(fake.metrics_url, timeout=0.3)
    t0 = time.monotonic()
    fake.stop()
    assert time.monotonic() - t0 < 3
    with pytest.raises(requests.ConnectionError):
        requests.get(fake.metrics_url, timeout=1)
