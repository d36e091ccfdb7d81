"""Scraping vLLM's /metrics directly: rates across resets, acceptance, faults (real HTTP)."""

import time
from pathlib import Path

import pytest

from controller.observation import FailureReason, Observation, ObservationFailure
from controller.sources.vllm_metrics import VllmMetricsSource, parse_snapshot
from tests.support.fake_vllm import FakeVllmServer

FIXTURES = "tests/fixtures/vllm-0.32-cpu"


class Clock:
    def __init__(self, t=1_800_000_000.0):
        self.t = t

    def __call__(self):
        return self.t


def test_parses_real_capture():
    snap = parse_snapshot(Path(f"{FIXTURES}/metrics-sd-ngram-k4.txt").read_text(), 0.0)
    assert snap.sd_present
    assert snap.counters["vllm:spec_decode_num_accepted_tokens"] == 216
    assert snap.counters["vllm:spec_decode_num_accepted_tokens_per_pos:0"] == 104
    assert snap.counters["vllm:request_success"] == 8  # summed over finished_reason
    off = parse_snapshot(Path(f"{FIXTURES}/metrics-sd-off.txt").read_text(), 0.0)
    assert not off.sd_present and "vllm:spec_decode_num_drafts" not in off.counters


def test_model_name_filter_and_garbage():
    text = Path(f"{FIXTURES}/metrics-sd-off.txt").read_text()
    assert parse_snapshot(text, 0.0, model_name="other").counters == {}
    with pytest.raises(ValueError):
        parse_snapshot("hello world\n", 0.0)


def advance_sd(fake, n=30, gen=128):
    # 30 requests of 128 tokens; 4 positions accepted 0.8, 0.6, 0.4, 0.2 of 1000 drafts.
    fake.advance(
        requests=n, prompt_tokens=n * 500, gen_tokens=n * gen, drafts=1000, draft_tokens=4000,
        accepted_tokens=2000, accepted_per_pos=[800, 600, 400, 200], e2e_latency_s=2.0,
    )  # fmt: skip


def test_rates_acceptance_and_positions_over_http():
    clock = Clock()
    with FakeVllmServer(clock=clock) as fake:
        src = VllmMetricsSource(url=fake.metrics_url, rate_window_s=60, acceptance_window_s=300)
        first = src.observe(clock())
        assert isinstance(first, ObservationFailure) and first.reason is FailureReason.WARMING_UP
        clock.t += 60
        advance_sd(fake)
        fake.set_gauges(running=6, waiting=0)
        o = src.observe(clock())
        assert isinstance(o, Observation)
        # 30 completions + 6 more running over 60 s
        assert o.arrival_rate_rps == pytest.approx((30 + 6) / 60)
        assert o.acceptance_rate == pytest.approx(0.5)
        assert o.position_acceptance == pytest.approx((0.8, 0.6, 0.4, 0.2))
        assert o.accepted_length == pytest.approx(3.0)
        assert o.mean_draft_tokens == pytest.approx(4.0)
        assert o.mean_prompt_tokens == pytest.approx(500)
        assert o.mean_gen_tokens == pytest.approx(128)
        assert o.mean_e2e_latency_s == pytest.approx(2.0)
        assert o.sd_series_present is True and o.running == 6


def test_counter_reset_gives_no_negative_or_huge_rate():
    clock = Clock()
    with FakeVllmServer(clock=clock) as fake:
        src = VllmMetricsSource(url=fake.metrics_url, rate_window_s=60, acceptance_window_s=60)
        for _ in range(5):  # build up large counters
            advance_sd(fake, n=100)
            src.observe(clock())
            clock.t += 60
        # vLLM restarts without SD (a toggle): every counter back to zero, SD series gone.
        fake.restart(sd_enabled=False)
        clock.t += 30
        fake.advance(requests=12, prompt_tokens=12 * 500, gen_tokens=12 * 128)
        clock.t += 30
        o = src.observe(clock())
        assert isinstance(o, Observation)
        # Last scrape was 120 s ago: 12 requests since the reset, counted from zero, not negative.
        assert o.arrival_rate_rps == pytest.approx(12 / 120)
        assert o.acceptance_rate is None and o.position_acceptance is None
        assert o.sd_series_present is False
        clock.t += 60
        fake.advance(requests=30, prompt_tokens=30 * 500, gen_tokens=30 * 128)
        o = src.observe(clock())
        assert o.arrival_rate_rps == pytest.approx(30 / 60)


def test_reset_detected_by_created_timestamp_even_if_counters_grew():
    clock = Clock()
    with FakeVllmServer(clock=clock) as fake:
        src = VllmMetricsSource(url=fake.metrics_url)
        advance_sd(fake, n=5)
        src.observe(clock())
        started = clock()
        clock.t += 60
        fake.restart(sd_enabled=True)
        advance_sd(fake, n=50)  # more than before the restart: only _created tells
        o = src.observe(clock())
        assert o.arrival_rate_rps == pytest.approx(50 / 60)
        # When the server (re)started, a crash's as well as a switch's: _created says.
        assert started < o.server_started_at == pytest.approx(clock(), abs=1.0)


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("garbage", FailureReason.PARSE_ERROR),
        ("http500", FailureReason.HTTP_ERROR),
        ("hang", FailureReason.UNREACHABLE),
    ],
)
def test_faults_are_named(mode, reason):
    with FakeVllmServer() as fake:
        src = VllmMetricsSource(url=fake.metrics_url, timeout_s=0.5)
        fake.set_mode(mode)
        t0 = time.monotonic()
        o = src.observe(time.time())
        assert isinstance(o, ObservationFailure) and o.reason is reason
        assert time.monotonic() - t0 < 5  # bounded, even when the server hangs
        fake.set_mode("ok")


def test_unreachable_and_nan():
    with FakeVllmServer() as fake:
        url = fake.metrics_url
    o = VllmMetricsSource(url=url, timeout_s=0.5).observe(time.time())
    assert o.reason is FailureReason.UNREACHABLE
    nan_text = (
        Path(f"{FIXTURES}/metrics-sd-off.txt")
        .read_text()
        .replace(
            'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0',
            'vllm:num_requests_running{engine="0",model_name="tiny"} NaN',
        )
    )
    src = VllmMetricsSource(fetch=lambda: nan_text)
    assert src.observe(1.0).reason is FailureReason.NAN


def test_peak_rate_within_the_long_window():
    clock = Clock()
    with FakeVllmServer(clock=clock) as fake:
        src = VllmMetricsSource(url=fake.metrics_url, rate_window_s=60, long_window_s=300)
        src.observe(clock())
        for n in (60, 600, 120, 60):  # one busy minute among quiet ones
            clock.t += 60
            fake.advance(requests=n, prompt_tokens=n * 10, gen_tokens=n * 10)
            o = src.observe(clock())
        assert o.arrival_rate_rps == pytest.approx(1.0)
        assert o.arrival_rate_peak_rps == pytest.approx(10.0)


def exposition(success: float, created: float, running: float = 0.0, engines: int = 1) -> str:
    """Minimal vLLM-shaped text: the success counter (with its _created) and the queues."""
    lines = [
        "# TYPE vllm:request_success_total counter",
        f'vllm:request_success_total{{finished_reason="stop",model_name="tiny"}} {success}',
        "# TYPE vllm:request_success_created gauge",
        f'vllm:request_success_created{{finished_reason="stop",model_name="tiny"}} {created}',
        "# TYPE vllm:num_requests_running gauge",
        *(f'vllm:num_requests_running{{engine="{e}",model_name="tiny"}} {running / engines}' for e in range(engines)),
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{model_name="tiny"} 0',
    ]
    return "\n".join(lines) + "\n"


class Feed:
    """fetch() callable whose next payload a test sets."""

    def __init__(self) -> None:
        self.text = ""

    def __call__(self) -> str:
        return self.text


def implausible_source(**kw):
    feed = Feed()
    return feed, VllmMetricsSource(fetch=feed, rate_window_s=60, **kw)


def test_counter_stepping_back_without_new_created_is_a_glitch_not_a_restart():
    feed, src = implausible_source(max_num_seqs=256)
    feed.text = exposition(100_000, created=1000.0)
    src.observe(2000.0)
    feed.text = exposition(100_030, created=1000.0)
    assert isinstance(src.observe(2060.0), Observation)
    feed.text = exposition(99_950, created=1000.0)  # glitch: same _created, lower value
    o = src.observe(2120.0)
    assert isinstance(o, ObservationFailure) and o.reason is FailureReason.IMPLAUSIBLE
    assert "went down from 100030 to 99950" in o.detail
    feed.text = exposition(100_090, created=1000.0)  # the glitch left no trace in the rate
    o = src.observe(2180.0)
    assert isinstance(o, Observation) and o.arrival_rate_rps == pytest.approx(60 / 120)


def test_lasting_step_back_starts_over_after_a_few_scrapes():
    feed, src = implausible_source()
    feed.text = exposition(100_000, created=1000.0)
    src.observe(2000.0)
    feed.text = exposition(50_000, created=1000.0)
    reasons = [src.observe(2000.0 + 60 * i).reason for i in range(1, 4)]
    assert reasons == [FailureReason.IMPLAUSIBLE] * 3
    feed.text = exposition(50_060, created=1000.0)
    o = src.observe(2240.0)
    assert isinstance(o, Observation) and o.arrival_rate_rps == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("second", "kw", "needle"),
    [
        (exposition(-5, created=1000.0), {}, "negative"),
        (exposition(100, created=1000.0, running=200_000), {"max_num_seqs": 256}, "above max_num_seqs=256"),
        # _created changing every scrape: read as a restart, 100 000 "new" requests in 60 s
        (exposition(100_000, created=2059.0), {"max_rate_rps": 50.0}, "above the plausible 50"),
    ],
)
def test_implausible_data_is_held_with_a_reason(second, kw, needle):
    feed, src = implausible_source(**kw)
    feed.text = exposition(100, created=1000.0)
    src.observe(2000.0)
    feed.text = second
    o = src.observe(2060.0)
    assert isinstance(o, ObservationFailure) and o.reason is FailureReason.IMPLAUSIBLE, o
    assert needle in o.detail


def test_running_bound_is_per_engine():
    feed, src = implausible_source(max_num_seqs=256)
    feed.text = exposition(100, created=1000.0, running=400, engines=2)
    src.observe(2000.0)
    feed.text = exposition(160, created=1000.0, running=400, engines=2)
    assert isinstance(src.observe(2060.0), Observation)


def test_length_spread_from_the_histogram_buckets():
    # The simulator exports vLLM 0.32's length histograms; the source reads the spread of the
    # lengths finished in its window from the bucket increases (the model's residence-weighted
    # context needs it), close to the spread of the requests that actually finished.
    import numpy as np

    from controller.calibration import load
    from controller.shipped import example_calibration_path
    from controller.sim.engine import F_FIN, F_GEN, F_PROMPT, Engine
    from controller.sim.scenarios import Scenario

    sc = Scenario.model_validate(
        {
            "duration_s": 900, "seed": 3, "arrival_rate": {"kind": "constant", "value": 4},
            "engine": {"initial_sd": False},
            # lengths within the buckets of the captured vLLM (1-2-5 up to 1000, then +Inf)
            "classes": [{"name": "chat", "prompt_tokens": {"kind": "lognormal", "mean": 300, "sigma": 0.5, "max": 1000},
                         "gen_tokens": {"kind": "lognormal", "mean": 150, "sigma": 0.6, "max": 1000}}],
        }
    )  # fmt: skip
    engine = Engine(sc, load(example_calibration_path()).latency_model())
    clock = Clock(engine.now)
    src = VllmMetricsSource(fetch=engine.render_metrics, acceptance_window_s=600, rate_window_s=60)
    engine.advance_to(120)
    clock.t = engine.now
    assert isinstance(src.observe(clock()), ObservationFailure)  # warming up
    start = engine.t
    engine.advance_to(720)
    o = src.observe(engine.now)
    assert isinstance(o, Observation)
    log = engine.finished_log()
    done = log[(log[:, F_FIN] > start) & (log[:, F_FIN] <= engine.t)]
    assert o.gen_tokens_std == pytest.approx(float(np.std(done[:, F_GEN])), rel=0.15)
    assert o.prompt_tokens_std == pytest.approx(float(np.std(done[:, F_PROMPT])), rel=0.15)
    assert o.mean_gen_tokens == pytest.approx(float(np.mean(done[:, F_GEN])), rel=0.02)


def test_a_body_cut_off_mid_transfer_is_an_unreachable_observation_not_a_crash():
    """A server that promises 15 kB and closes after 10 bytes (a vLLM killed mid-scrape)."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    port = srv.getsockname()[1]

    def serve() -> None:
        for _ in range(2):  # the first try and the retry
            conn, _ = srv.accept()
            conn.recv(4096)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 14884\r\n\r\nvllm:num_r")
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        got = VllmMetricsSource(url=f"http://127.0.0.1:{port}/metrics", timeout_s=2.0).observe(time.time())
    finally:
        t.join(timeout=5)
        srv.close()
    assert isinstance(got, ObservationFailure) and got.reason is FailureReason.UNREACHABLE


def kv_exposition(
    success: float,
    running: dict[str, float],
    usage: dict[str, float | str],
    config: dict[str, tuple[int | str, int]],
    cached: float | None = None,
) -> str:
    """vLLM 0.32-shaped text with the KV context's series, per engine: running, KV usage,
    ``vllm:cache_config_info`` (no model_name label, as vLLM writes it) and the prefix-cache counter."""
    lines = [
        "# TYPE vllm:request_success_total counter",
        f'vllm:request_success_total{{engine="0",finished_reason="stop",model_name="tiny"}} {success}',
        "# TYPE vllm:request_success_created gauge",
        'vllm:request_success_created{engine="0",finished_reason="stop",model_name="tiny"} 1000.0',
        "# TYPE vllm:num_requests_running gauge",
        *(f'vllm:num_requests_running{{engine="{e}",model_name="tiny"}} {r}' for e, r in running.items()),
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{engine="0",model_name="tiny"} 0',
        "# TYPE vllm:kv_cache_usage_perc gauge",
        *(f'vllm:kv_cache_usage_perc{{engine="{e}",model_name="tiny"}} {u}' for e, u in usage.items()),
        "# TYPE vllm:cache_config_info gauge",
        *(
            f'vllm:cache_config_info{{block_size="{bs}",cache_dtype="auto",engine="{e}",num_gpu_blocks="{n}"}} 1.0'
            for e, (n, bs) in config.items()
        ),
    ]
    if cached is not None:
        lines += [
            "# TYPE vllm:prompt_tokens_cached_total counter",
            f'vllm:prompt_tokens_cached_total{{engine="0",model_name="tiny"}} {cached}',
            "# TYPE vllm:prompt_tokens_cached_created gauge",
            'vllm:prompt_tokens_cached_created{engine="0",model_name="tiny"} 1000.0',
            # per tier: the same tokens again, never to be added to the total
            "# TYPE vllm:prompt_tokens_cached_by_source_total counter",
            f'vllm:prompt_tokens_cached_by_source_total{{engine="0",model_name="tiny",source="device"}} {cached}',
        ]
    return "\n".join(lines) + "\n"


CACHE = {"0": (8192, 128)}  # the captured server's: 1 048 576 tokens in blocks of 128
HALF_BLOCK = 0.5 * (128 - 1)


def context_after(first: str, second: str, **kw) -> Observation:
    feed = Feed()
    src = VllmMetricsSource(fetch=feed, rate_window_s=60, model_name="tiny", **kw)
    feed.text = first
    src.observe(2000.0)
    feed.text = second
    o = src.observe(2060.0)
    assert isinstance(o, Observation), o
    return o


def test_the_captured_server_exports_its_cache_capacity():
    snap = parse_snapshot(Path(f"{FIXTURES}/metrics-sd-off.txt").read_text(), 0.0, model_name="tiny")
    assert snap.kv_capacity["0"].tokens == 8192 * 128 and snap.kv_capacity["0"].block_size == 128
    assert snap.kv_usage == {"0": 0.0} and snap.prompt_cached == 0.0
    assert snap.prefix_caching == [True]  # vLLM 0.32's default


def test_prefix_caching_is_observed_from_the_cache_config_labels():
    text = Path(f"{FIXTURES}/metrics-sd-off.txt").read_text()
    assert context_after(text, text).prefix_caching is True
    # A server started without it says so; no label at all is unknown.
    off = text.replace('enable_prefix_caching="True"', 'enable_prefix_caching="False"')
    assert context_after(off, off).prefix_caching is False
    plain = kv_exposition(100, {"0": 4}, {"0": 0.3}, CACHE)
    assert context_after(plain, plain).prefix_caching is None


def test_running_context_one_engine_is_the_ratio_of_the_window_means():
    # Usage 0.3 -> 0.1 while the batch grows 4 -> 12: the window holds 0.2 of the cache for 8
    # sequences on average (the mean of the per-scrape ratios would say 43 690, not 26 214).
    o = context_after(
        kv_exposition(100, {"0": 4}, {"0": 0.3}, CACHE),
        kv_exposition(160, {"0": 12}, {"0": 0.1}, CACHE),
    )
    assert o.running_context_tokens == pytest.approx(0.2 * 8192 * 128 / 8 - HALF_BLOCK)
    assert o.arrival_rate_rps == pytest.approx((60 + 8) / 60)


def test_running_context_sums_the_engines_tokens_over_their_sequences():
    # Data parallel, unequal caches: 0.5 of 1 048 576 and 0.25 of 524 288 tokens for 10 + 2 sequences.
    engines = {"0": (8192, 128), "1": (4096, 128)}
    text = [kv_exposition(s, {"0": 10, "1": 2}, {"0": 0.5, "1": 0.25}, engines) for s in (100, 160)]
    o = context_after(*text)
    assert o.running_context_tokens == pytest.approx((0.5 * 1_048_576 + 0.25 * 524_288) / 12 - HALF_BLOCK)
    # An engine whose KV usage is not exported: its sequences' tokens are unknown.
    text = [kv_exposition(s, {"0": 10, "1": 2}, {"0": 0.5}, engines) for s in (100, 160)]
    assert context_after(*text).running_context_tokens is None
    # An engine without a cache config: its capacity is unknown.
    text = [kv_exposition(s, {"0": 10, "1": 2}, {"0": 0.5, "1": 0.25}, CACHE) for s in (100, 160)]
    assert context_after(*text).running_context_tokens is None


def test_prefix_cache_hits_are_added_back_per_completed_request():
    # 60 requests completed in the window, 9000 of their prompt tokens served from the cache.
    o = context_after(
        kv_exposition(100, {"0": 8}, {"0": 0.2}, CACHE, cached=50_000),
        kv_exposition(160, {"0": 8}, {"0": 0.2}, CACHE, cached=59_000),
    )
    assert o.running_context_tokens == pytest.approx(0.2 * 1_048_576 / 8 - HALF_BLOCK + 150)
    assert o.cached_prompt_tokens == pytest.approx(150)  # what the model's prefill leaves out
    # The counter restarted with vLLM (it went down): its increase is its new value.
    o = context_after(
        kv_exposition(100, {"0": 8}, {"0": 0.2}, CACHE, cached=50_000),
        kv_exposition(160, {"0": 8}, {"0": 0.2}, CACHE, cached=3_000),
    )
    assert o.running_context_tokens == pytest.approx(0.2 * 1_048_576 / 8 - HALF_BLOCK + 50)
    assert o.cached_prompt_tokens == pytest.approx(50)


def test_missing_kv_series_leave_the_context_unmeasured_and_the_observation_whole():
    plain = [exposition(s, created=1000.0, running=8) for s in (100, 160)]  # the simulator's shape
    o = context_after(*plain)
    assert o.running_context_tokens is None and o.arrival_rate_rps == pytest.approx(1.0)
    assert o.cached_prompt_tokens == 0.0  # no counter: nothing served from a cache
    no_config = [kv_exposition(s, {"0": 8}, {"0": 0.2}, {}) for s in (100, 160)]
    assert context_after(*no_config).running_context_tokens is None
    undecided = [kv_exposition(s, {"0": 8}, {"0": 0.2}, {"0": ("None", 128)}) for s in (100, 160)]
    assert context_after(*undecided).running_context_tokens is None
    idle = [kv_exposition(s, {"0": 0}, {"0": 0.0}, CACHE) for s in (100, 160)]
    assert context_after(*idle).running_context_tokens is None


@pytest.mark.parametrize("usage", [1.7, -0.1, "NaN", "+Inf"])
def test_garbage_kv_usage_is_unmeasured_never_a_failed_observation(usage):
    o = context_after(
        kv_exposition(100, {"0": 8}, {"0": 0.2}, CACHE),
        kv_exposition(160, {"0": 8}, {"0": usage}, CACHE),
        max_num_seqs=256,
    )
    assert o.running_context_tokens is None and o.arrival_rate_rps == pytest.approx(1.0)


def test_garbage_prefix_cache_counter_is_unmeasured_never_a_failed_observation():
    o = context_after(
        kv_exposition(100, {"0": 8}, {"0": 0.2}, CACHE, cached=50_000),
        kv_exposition(160, {"0": 8}, {"0": 0.2}, CACHE, cached=float("nan")),
    )
    assert o.running_context_tokens is None and o.arrival_rate_rps == pytest.approx(1.0)
