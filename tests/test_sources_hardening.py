"""The sources against data that parses but cannot be true: held with a reason, never used, never raised.

vLLM payloads come from the fake vLLM (vLLM 0.32's exposition) or the captured server; Prometheus
answers from a stub API on 127.0.0.1.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from controller.errors import ConfigError, redact_url
from controller.histograms import std_from_buckets
from controller.observation import FailureReason, Observation, ObservationFailure
from controller.settings import Settings
from controller.sources.base import MAX_BODY_BYTES
from controller.sources.kv_context import cache_capacity
from controller.sources.prometheus import PrometheusSource, render_queries
from controller.sources.setup import build_source
from controller.sources.vllm_metrics import Snapshot, VllmMetricsSource, increase
from tests.support.fake_vllm import FakeVllmServer
from tests.support.stub_http import StubHttp

FIXTURES = "tests/fixtures/vllm-0.32-cpu"
T0 = 1_800_000_000.0


# ----------------------------------------------------------------------------- vLLM /metrics


def add_to(prefix: str, delta: float, label: str | None = None) -> Callable[[str], str]:
    """Add ``delta`` to the first sample line starting with ``prefix`` (and holding ``label``)."""

    def mutate(text: str) -> str:
        out, done = [], False
        for line in text.splitlines():
            if not done and line.startswith(prefix) and (label is None or label in line):
                name, value = line.rsplit(" ", 1)
                line, done = f"{name} {float(value) + delta!r}", True
            out.append(line)
        return "\n".join(out) + "\n"

    return mutate


def set_value(prefix: str, value: str) -> Callable[[str], str]:
    def mutate(text: str) -> str:
        return re.sub(rf"^({re.escape(prefix)}(?:\{{[^}}]*\}})?) \S+$", rf"\g<1> {value}", text, flags=re.M)

    return mutate


def drop(prefix: str) -> Callable[[str], str]:
    """Remove every line (samples, # HELP, # TYPE) of the families whose name starts with ``prefix``."""

    def mutate(text: str) -> str:
        keep = []
        for line in text.splitlines():
            name = line.split(" ", 3)[2] if line.startswith("#") else line.split("{", 1)[0].split(" ", 1)[0]
            if not name.startswith(prefix):
                keep.append(line)
        return "\n".join(keep) + "\n"

    return mutate


def per_series_created(text: str) -> str:
    """Each request_success series its own _created, microseconds apart, as real vLLM 0.32 has them."""
    k = iter(range(1, 100))
    return re.sub(
        r"^(vllm:request_success_created\{[^}]*\}) (\S+)$",
        lambda m: f"{m.group(1)} {float(m.group(2)) + 2e-5 * next(k)!r}",
        text,
        flags=re.M,
    )


def sd_traffic(fake: FakeVllmServer, requests: int) -> None:
    """``requests`` SD requests of 512 prompt and 256 generated tokens finished: 3 tokens a
    step (acceptance 0.6 of 4 drafted), 2 s each."""
    steps = requests * 256 // 3
    fake.advance(
        requests=requests, prompt_tokens=requests * 512, gen_tokens=requests * 256, drafts=steps,
        draft_tokens=4 * steps, accepted_tokens=int(2.4 * steps),
        accepted_per_pos=[steps * 0.8, steps * 0.65, steps * 0.5, steps * 0.45], e2e_latency_s=2.0,
    )  # fmt: skip


def scrapes(mutate: Callable[[str], str] | None, at: set[int], n: int = 6, lifetime: int = 0, every=None):
    """A steady vLLM with SD (5 req/s, acceptance 0.6, 2 s latency), scraped each minute;
    ``mutate`` applied to the scrapes in ``at`` (and ``every`` to all). ``lifetime`` requests
    were served before the first scrape. The observations, from the second scrape on."""
    clock = [T0]
    fake = FakeVllmServer(clock=lambda: clock[0])
    if lifetime:
        sd_traffic(fake, lifetime)
    i = [0]

    def fetch() -> str:
        text = fake.render()
        text = every(text) if every else text
        return mutate(text) if mutate is not None and i[0] in at else text

    src = VllmMetricsSource(fetch=fetch, max_num_seqs=256, max_rate_rps=12575.0)
    out = []
    for i[0] in range(n):
        clock[0] += 60
        sd_traffic(fake, 300)
        fake.set_gauges(running=20, waiting=0)
        out.append(src.observe(clock[0]))
    return out[1:]


def held(o, reason: FailureReason = FailureReason.IMPLAUSIBLE, needle: str = "") -> bool:
    return isinstance(o, ObservationFailure) and o.reason is reason and needle in o.detail


def steady(o) -> bool:
    """The observation a steady 5 req/s, acceptance 0.6, 2 s latency gives."""
    return (
        isinstance(o, Observation)
        and o.arrival_rate_rps == pytest.approx(5.0)
        and o.arrival_rate_peak_rps == pytest.approx(5.0)
        and o.acceptance_rate == pytest.approx(0.6)
        and o.position_acceptance == pytest.approx((0.8, 0.65, 0.5, 0.45))
        and o.mean_draft_tokens == pytest.approx(4.0)
        and o.mean_e2e_latency_s == pytest.approx(2.0)
        and o.mean_prompt_tokens == pytest.approx(512)
    )


def exposition(success: float, e2e_count: float, e2e_sum: float, prompt_sum: float = 0.0, created=1000.0) -> str:
    """vLLM-shaped text without buckets (a server that does not export them): the success
    counter, the e2e and prompt-length histograms' _sum/_count/_created, and the queues."""
    lines = [
        "# TYPE vllm:request_success_total counter",
        f'vllm:request_success_total{{finished_reason="stop",model_name="tiny"}} {success}',
        "# TYPE vllm:request_success_created gauge",
        f'vllm:request_success_created{{finished_reason="stop",model_name="tiny"}} {created}',
        "# TYPE vllm:e2e_request_latency_seconds histogram",
        f'vllm:e2e_request_latency_seconds_count{{model_name="tiny"}} {e2e_count}',
        f'vllm:e2e_request_latency_seconds_sum{{model_name="tiny"}} {e2e_sum}',
        "# TYPE vllm:e2e_request_latency_seconds_created gauge",
        f'vllm:e2e_request_latency_seconds_created{{model_name="tiny"}} {created}',
        "# TYPE vllm:request_prompt_tokens histogram",
        f'vllm:request_prompt_tokens_count{{model_name="tiny"}} {e2e_count}',
        f'vllm:request_prompt_tokens_sum{{model_name="tiny"}} {prompt_sum}',
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{model_name="tiny"} 4',
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{model_name="tiny"} 0',
    ]
    return "\n".join(lines) + "\n"


def second_of(first: str, second: str):
    texts = iter([first, second])
    src = VllmMetricsSource(fetch=lambda: next(texts), max_num_seqs=256)
    src.observe(2000.0)
    return src.observe(2060.0)


# 1. Mean end-to-end latency


def test_mean_latency_longer_than_the_servers_uptime_is_held():
    # Up since 1000 (1060 s at the second scrape): 30 requests cannot average 2000 s.
    o = second_of(exposition(100, 100, 200.0), exposition(130, 130, 200.0 + 30 * 2000.0))
    assert held(o, needle="mean_e2e_latency_s is 2000"), o
    assert "uptime" in o.detail
    # 30 requests of 20 s each, well within the uptime: measured.
    o = second_of(exposition(100, 100, 200.0), exposition(130, 130, 200.0 + 30 * 20.0))
    assert isinstance(o, Observation) and o.mean_e2e_latency_s == pytest.approx(20.0)


def test_a_latency_sum_jump_its_buckets_deny_is_held_then_absorbed():
    # vllm:e2e_request_latency_seconds_sum jumps by 1e5 s once (count unchanged): every request
    # sat in the (1.5, 2] bucket, so the window's mean cannot be 68 s. Held as a glitch; a
    # lasting level is believed after MAX_IMPLAUSIBLE_STREAK scrapes, from scratch.
    obs = scrapes(add_to("vllm:e2e_request_latency_seconds_sum", 1e5), at=set(range(3, 9)), n=9)
    assert steady(obs[0]) and steady(obs[1])
    assert all(held(o, needle="its buckets allow") for o in obs[2:5]), obs[2:5]
    assert all(steady(o) for o in obs[5:]), obs[5:]


@pytest.mark.parametrize("value", ["-3", "1e9", "+Inf"])
def test_prometheus_mean_latency_negative_infinite_or_absurd_is_held(value):
    o = prom_observe({"mean_e2e_latency": [({}, value)]})
    assert held(o, needle="mean_e2e_latency_s"), o


# 2. Phantom restarts


def test_a_scrape_missing_a_family_is_held_and_the_next_is_not_a_restart():
    # A day of counters, then one scrape without the drafts family: it would have counted the
    # lifetime's drafts as one minute's (acceptance per position 0.46 instead of 0.8).
    obs = scrapes(drop("vllm:spec_decode_num_drafts"), at={3}, lifetime=432_000)
    assert steady(obs[1])
    assert held(obs[2], FailureReason.INCOMPLETE, "vllm:spec_decode_num_drafts_total missing"), obs[2]
    assert steady(obs[3]) and steady(obs[4])


@pytest.mark.parametrize("family", ["vllm:request_success", "vllm:num_requests_running", "vllm:request_prompt_tokens"])
def test_any_counter_or_queue_missing_for_one_scrape_leaves_no_trace(family):
    obs = scrapes(drop(family), at={3}, lifetime=432_000)
    assert held(obs[2], FailureReason.INCOMPLETE, "missing from this scrape"), obs[2]
    assert steady(obs[3]) and steady(obs[4])


def test_one_series_missing_is_not_a_restart_of_the_others():
    # Each series has its own _created; the finished_reason="stop" one (0 requests) missing
    # from one scrape moved the counter's "oldest _created" and read as a restart: 7220 req/s.
    def drop_stop(text: str) -> str:
        lines = text.splitlines()
        return "\n".join(x for x in lines if not (x.startswith("vllm:request_success_") and '"stop"' in x)) + "\n"

    obs = scrapes(drop_stop, at={3}, lifetime=432_000, every=per_series_created)
    assert all(steady(o) for o in obs), obs


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf"])
def test_a_non_finite_created_is_held_as_nan(value):
    obs = scrapes(set_value("vllm:spec_decode_num_drafts_created", value), at={3}, lifetime=432_000)
    assert held(obs[2], FailureReason.NAN), obs[2]
    assert steady(obs[3]) and steady(obs[4])


def snap(t: float, value: float | None, created: float | None = 100.0, other: float = 0.0) -> Snapshot:
    s = Snapshot(t, {"vllm:request_success": other})
    if value is not None:
        s.counters["vllm:spec_decode_num_drafts"] = value
    if created is not None:
        s.created["vllm:spec_decode_num_drafts"] = {(("model_name", "tiny"),): created}
    return s


def test_increase_pairs_a_gap_with_the_last_snapshot_that_had_the_key():
    key = "vllm:spec_decode_num_drafts"
    assert increase([snap(1000, 5000), snap(1060, None), snap(1120, 5100)], key) == 100
    # New in the window, created before the scrape before it: a baseline, not 5000 new drafts.
    assert increase([snap(1000, None), snap(1060, 5000), snap(1120, 5100)], key) == 100
    # Born after the scrape before it (SD switched on by a restart): from zero.
    assert increase([snap(1000, None, created=None), snap(1060, 40, created=1030)], key) == 40
    # A real restart: _created moved and the value dropped.
    assert increase([snap(1000, 5000), snap(1060, 30, created=1030)], key) == 30


@pytest.mark.parametrize("created", [True, False], ids=["created", "no-created"])
def test_sd_switched_on_by_a_restart_counts_from_zero(created):
    # Real restarts still reset: SD's counters appear after a restart (its _created, or without
    # _created series the other counters' drop, says so) and count from zero.
    clock = [T0]
    fake = FakeVllmServer(clock=lambda: clock[0], sd_enabled=False)

    def strip(text: str) -> str:  # a server run with PROMETHEUS_DISABLE_CREATED_SERIES
        return text if created else "\n".join(x for x in text.splitlines() if "_created" not in x) + "\n"

    src = VllmMetricsSource(fetch=lambda: strip(fake.render()), rate_window_s=60, acceptance_window_s=300)
    fake.advance(requests=1000, prompt_tokens=1000 * 500, gen_tokens=1000 * 128, e2e_latency_s=2.0)
    src.observe(clock[0])
    clock[0] += 30
    fake.restart(sd_enabled=True)
    clock[0] += 30
    fake.advance(
        requests=60, prompt_tokens=60 * 500, gen_tokens=60 * 128, drafts=1000, draft_tokens=4000,
        accepted_tokens=2000, accepted_per_pos=[800, 600, 400, 200], e2e_latency_s=2.0,
    )  # fmt: skip
    o = src.observe(clock[0])
    assert isinstance(o, Observation), o
    assert o.arrival_rate_rps == pytest.approx(1.0) and o.acceptance_rate == pytest.approx(0.5)
    assert o.position_acceptance == pytest.approx((0.8, 0.6, 0.4, 0.2)) and o.mean_draft_tokens == pytest.approx(4.0)


# 3. Absurd but finite lengths


@pytest.mark.parametrize("jump", [1e150, 1e300])
def test_an_absurd_prompt_length_is_held_not_raised(jump):
    obs = scrapes(add_to("vllm:request_prompt_tokens_sum", jump), at=set(range(3, 6)), n=6)
    assert steady(obs[1])
    assert all(held(o, needle="vllm:request_prompt_tokens_sum") for o in obs[2:]), obs[2:]


def test_a_length_jump_its_buckets_deny_is_held():
    obs = scrapes(add_to("vllm:request_generation_tokens_sum", 1e10), at={3})
    assert held(obs[2], needle="vllm:request_generation_tokens_sum grew"), obs[2]
    assert steady(obs[3])


def test_a_mean_length_past_any_request_is_held_without_buckets():
    o = second_of(exposition(100, 100, 200.0, 5e4), exposition(130, 130, 260.0, 5e4 + 30 * 2e7))
    assert held(o, needle="mean_prompt_tokens is 2e+07"), o


def test_spread_past_float_range_is_unmeasured_not_an_overflow():
    bounds = [100.0, 1000.0, math.inf]
    assert std_from_buckets(bounds, [0.0, 100.0, 100.0], mean=1e300) is None
    assert std_from_buckets([1e300, math.inf], [1.0, 2.0]) is None
    assert std_from_buckets(bounds, [0.0, 100.0, 100.0], mean=500.0) is not None


@pytest.mark.parametrize(
    "blocks", ["1" + "0" * 300, "1" + "0" * 400, "999999999999999"], ids=["1e300", "1e400", "1e15"]
)
def test_kv_capacity_past_a_trillion_tokens_is_unmeasured(blocks):
    assert cache_capacity({"num_gpu_blocks": blocks, "block_size": "16"}) is None
    assert cache_capacity({"num_gpu_blocks": "8192", "block_size": "16"}).tokens == 8192 * 16


@pytest.mark.parametrize("name", ["mean_prompt_tokens", "mean_gen_tokens"])
@pytest.mark.parametrize("value", ["1e300", "-5", "+Inf"])
def test_prometheus_absurd_lengths_are_held(name, value):
    assert held(prom_observe({name: [({}, value)]}), needle=name)


# 4. Malformed Prometheus answers


def vector(*items) -> bytes:
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": list(items)}}).encode()


@pytest.mark.parametrize(
    "body",
    [
        vector([{}, [1, "2"]]),  # an element that is a list
        vector(None),
        vector({"metric": None, "value": [1, "2"]}),
        vector({"metric": {"position": 0}, "value": [1, "2"]}),  # a label that is not a string
        vector({"metric": {}, "value": [1, True]}),
        b"[" * 200_000 + b"]" * 200_000,  # nested past any parser
    ],
    ids=["list", "null", "metric-null", "label-number", "value-bool", "deep"],
)
def test_malformed_prometheus_answers_are_parse_errors(body):
    with StubHttp(lambda method, path, req: (200, "application/json", body)) as stub:
        o = PrometheusSource(stub.url, SEL, timeout_s=2).observe(T0)
    assert held(o, FailureReason.PARSE_ERROR), o


# 5. Impossible SD values and rates


def test_more_tokens_accepted_than_drafted_is_held_not_clamped():
    lie = add_to("vllm:spec_decode_num_accepted_tokens_total", 2e6)
    obs = scrapes(lie, at=set(range(3, 8)), n=8)
    assert all(held(o, needle="more than the") for o in obs[2:5]), obs[2:5]
    assert steady(obs[6])  # the new level, believed after the streak


def test_a_position_accepted_more_often_than_drafted_is_held():
    obs = scrapes(add_to("vllm:spec_decode_num_accepted_tokens_per_pos_total", 2e6, 'position="0"'), at={3})
    assert held(obs[2], needle='position="0"} grew'), obs[2]
    assert steady(obs[3])


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"acceptance_rate": [({}, "1.7")]}, "acceptance_rate is 1.7"),
        ({"acceptance_rate": [({}, "+Inf")]}, "acceptance_rate is inf"),
        ({"position_acceptance": [({"position": "0"}, "3.0"), ({"position": "1"}, "0.5")]}, "position_acceptance"),
        ({"arrival_rate_long": [({}, "1e6")]}, "arrival_rate_long 1000000.0 req/s is above"),
        ({"arrival_rate_peak": [({}, "1e6")]}, "arrival_rate_peak 1000000.0 req/s is above"),
        ({"arrival_rate_peak": [({}, "-1")]}, "arrival_rate_peak is negative"),
        ({"waiting": [({}, "-4")]}, "waiting is -4"),
        ({"mean_draft_tokens": [({}, "-2")]}, "mean_draft_tokens is -2"),
    ],
)
def test_prometheus_impossible_values_are_held_not_clamped(changes, needle):
    o = prom_observe(changes, max_rate_rps=100.0)
    assert held(o, needle=needle), o


def test_a_long_rate_below_zero_is_not_measured_not_clamped():
    # The long window's deriv() over a history shorter than the window undershoots (a Prometheus
    # backtest of a server seconds old read -0.12 req/s): not a number to clamp, nor a held tick.
    o = prom_observe({"arrival_rate_long": [({}, "-50")]}, max_rate_rps=100.0)
    assert isinstance(o, Observation) and o.arrival_rate_long_rps is None and o.arrival_rate_rps == 2.0


def test_prometheus_rounding_past_one_and_nan_are_not_held():
    o = prom_observe({"acceptance_rate": [({}, "1.0000001")], "mean_e2e_latency": [({}, "NaN")]})
    assert isinstance(o, Observation) and o.acceptance_rate == 1.0 and o.mean_e2e_latency_s is None
    assert o.arrival_rate_long_rps == 2.0 and o.mean_prompt_tokens == 512.0


# ----------------------------------------------------------------------------- Prometheus stub

SEL = 'model_name="tiny"'
HEALTHY = {
    "arrival_rate": [({}, "2")],
    "arrival_rate_long": [({}, "2")],
    "arrival_rate_peak": [({}, "2.5")],
    "sample_age": [({}, "1")],
    "sd_present": [({}, "1")],
    "acceptance_rate": [({}, "0.6")],
    "position_acceptance": [({"position": "0"}, "0.8"), ({"position": "1"}, "0.5")],
    "mean_draft_tokens": [({}, "2")],
    "mean_prompt_tokens": [({}, "512")],
    "mean_gen_tokens": [({}, "256")],
    "mean_e2e_latency": [({}, "2")],
    "running": [({"engine": "0"}, "10")],
    "waiting": [({}, "0")],
}


def prom_observe(changes: dict, **kw):
    by_text = {text: name for name, text in render_queries(SEL, 60, 300, 900).items()}
    answers = HEALTHY | changes

    def respond(method, path, body):
        query = parse_qs(urlsplit(path).query)["query"][0]
        rows = answers.get(by_text.get(query, ""), [])
        return 200, "application/json", vector(*({"metric": m, "value": [T0, v]} for m, v in rows))

    with StubHttp(respond) as stub:
        return PrometheusSource(stub.url, SEL, timeout_s=2, max_num_seqs=256, **kw).observe(T0)


# 6. Settings


def test_an_empty_vllm_metrics_url_is_a_config_error_naming_the_setting(tmp_path):
    s = Settings(calibration_file="example", hook_type="none", state_file=tmp_path / "state.json", vllm_metrics_url="")
    with pytest.raises(ConfigError, match="setting vllm_metrics_url"):
        build_source(s)


# 7. Credentials in errors


def test_redact_url_drops_credentials_and_query():
    assert redact_url("http://user:pa%40ss@host:9090/prom?token=abc") == "http://host:9090/prom?…"
    assert redact_url("http://[::1]:8000/metrics") == "http://[::1]:8000/metrics"


def test_credentials_never_appear_in_a_sources_errors():
    answer = lambda method, path, body: (503, "text/html", b"<html>down</html>")  # noqa: E731
    with StubHttp(answer) as stub:
        port = stub.url.rsplit(":", 1)[1]
        url = f"http://scraper:s3cret@127.0.0.1:{port}"
        failures = [
            VllmMetricsSource(url=f"{url}/metrics?token=t0ken", timeout_s=2).observe(T0),
            PrometheusSource(url, SEL, timeout_s=2).observe(T0),
        ]
    for o in failures:
        assert held(o, FailureReason.HTTP_ERROR, f"127.0.0.1:{port}"), o
        assert "s3cret" not in o.detail and "scraper" not in o.detail and "t0ken" not in o.detail


def test_credentials_never_appear_in_an_implausible_scrapes_detail():
    texts = iter([exposition(100, 100, 200.0), exposition(50, 100, 200.0)])  # a counter went down
    with StubHttp(lambda method, path, body: (200, "text/plain", next(texts).encode())) as stub:
        src = VllmMetricsSource(url=stub.url.replace("//", "//scraper:s3cret@") + "/metrics", max_num_seqs=256)
        src.observe(2000.0)
        o = src.observe(2060.0)
    assert held(o, needle="went down") and "s3cret" not in o.detail, o


# 8. Huge bodies


class BigBody:
    """Serves a valid payload (``head``, padding, ``tail``) past MAX_BODY_BYTES, with a
    Content-Length or chunked."""

    def __init__(self, head: bytes, pad: bytes, tail: bytes, chunked: bool) -> None:
        size = MAX_BODY_BYTES + 2**20
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                outer.requests += 1
                try:
                    self.send_response(200)
                    if chunked:
                        self.send_header("Transfer-Encoding", "chunked")
                        self.end_headers()
                        piece = pad * (2**20 // len(pad))
                        for data in [head, *[piece] * (size // len(piece)), tail]:
                            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                        self.wfile.write(b"0\r\n\r\n")
                    else:
                        body = head + pad * ((size - len(head)) // len(pad)) + tail
                        self.send_header("Content-Length", str(len(body)))
                        self.end_headers()
                        self.wfile.write(body)
                except OSError:
                    pass  # the client stopped reading: what it should do

            def log_message(self, *args: object) -> None:
                pass

        self.requests = 0
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("chunked", [False, True])
def test_a_metrics_body_past_the_cap_is_a_failure_not_a_memory_spike(chunked):
    capture = Path(f"{FIXTURES}/metrics-sd-off.txt").read_bytes()
    server = BigBody(capture, b"# padding\n", b"", chunked)
    try:
        o = VllmMetricsSource(url=f"{server.url}/metrics", timeout_s=5).observe(T0)
    finally:
        server.close()
    assert held(o, FailureReason.PARSE_ERROR, f"over {MAX_BODY_BYTES} bytes"), o
    assert server.requests == 1  # not retried


@pytest.mark.parametrize("chunked", [False, True])
def test_a_prometheus_body_past_the_cap_is_a_failure(chunked):
    answer = vector({"metric": {}, "value": [T0, "2"]})
    server = BigBody(answer[:-1], b" " * 64, answer[-1:], chunked)
    try:
        o = PrometheusSource(server.url, SEL, timeout_s=5).observe(T0)
    finally:
        server.close()
    assert held(o, FailureReason.PARSE_ERROR, f"over {MAX_BODY_BYTES} bytes"), o


# ----------------------------------------------------------------------------- a stalled engine


def stalled_run(hang: Callable[[FakeVllmServer, int], None], mutate: Callable[[str], str] | None = None):
    """Ten minutes of steady SD traffic scraped every 15 s, then ``hang(fake, k)`` before the
    k-th of 12 more scrapes, the counters left alone. The observations of those 12."""
    clock = [T0]
    fake = FakeVllmServer(clock=lambda: clock[0])
    src = VllmMetricsSource(fetch=lambda: (mutate or str)(fake.render()), max_num_seqs=256, max_rate_rps=12575.0)
    for i in range(40):
        clock[0] += 15
        sd_traffic(fake, 75)  # 5 req/s
        fake.set_gauges(running=10, waiting=0)
        o = src.observe(clock[0])
        assert isinstance(o, Observation) or (i == 0 and o.reason is FailureReason.WARMING_UP), o
    out = []
    for k in range(12):
        clock[0] += 15
        hang(fake, k)
        out.append(src.observe(clock[0]))
    return out


def test_a_hung_engine_is_held_as_stalled_not_read_as_a_queue_of_arrivals():
    # vLLM's API server keeps queueing requests (5 req/s) while its engine produces nothing.
    out = stalled_run(lambda fake, k: fake.set_gauges(running=10, waiting=75 * (k + 1)))
    # The rate window (60 s) still holds progress for the first 3 scrapes; from the 4th none.
    assert all(isinstance(o, Observation) for o in out[:3]), out[:3]
    assert all(isinstance(o, ObservationFailure) and o.reason is FailureReason.STALLED for o in out[3:]), out[3:]
    assert "10 running and 300 waiting, no token produced and no request completed in 60s" in out[3].detail


def test_a_frozen_payload_with_requests_running_is_stalled_and_an_idle_one_is_a_load_of_zero():
    frozen = stalled_run(lambda fake, k: None)  # byte-identical: 10 running, nothing moves
    assert [o.reason for o in frozen[3:]] == [FailureReason.STALLED] * 9, frozen
    idle = stalled_run(lambda fake, k: fake.set_gauges(running=0, waiting=0) if k == 0 else None)
    assert all(isinstance(o, Observation) for o in idle), idle
    assert idle[-1].arrival_rate_rps == 0.0


def test_a_server_without_the_token_counter_is_not_judged():
    out = stalled_run(lambda fake, k: None, mutate=drop("vllm:generation_tokens"))
    assert all(isinstance(o, Observation) for o in out), out


def test_long_requests_that_complete_nothing_in_a_window_but_produce_tokens_are_not_stalled():
    def decode_only(fake, k):  # long generations: tokens every step, no completion for minutes
        fake.advance(gen_tokens=2000)
        fake.set_gauges(running=10, waiting=0)

    assert all(isinstance(o, Observation) for o in stalled_run(decode_only))


# ----------------------------------------------------------------------------- an engine asleep


@pytest.mark.parametrize("level", [1, 2])
def test_an_engine_in_sleep_mode_is_held_as_asleep(level):
    clock = [T0]
    fake = FakeVllmServer(clock=lambda: clock[0])
    fake.sleep_level = 0
    src = VllmMetricsSource(fetch=fake.render, model_name="tiny", max_num_seqs=256)
    for _ in range(3):
        clock[0] += 60
        fake.advance(requests=60, prompt_tokens=60 * 512, gen_tokens=60 * 256, e2e_latency_s=2.0)
        awake = src.observe(clock[0])
    assert isinstance(awake, Observation), awake
    fake.sleep_level = level  # an operator freed the GPU: nothing runs, nothing arrives
    clock[0] += 60
    held = src.observe(clock[0])
    assert isinstance(held, ObservationFailure) and held.reason is FailureReason.ASLEEP, held
    assert "1 engine(s) in sleep mode" in held.detail
    fake.sleep_level = 0
    clock[0] += 60
    fake.advance(requests=60, prompt_tokens=60 * 512, gen_tokens=60 * 256, e2e_latency_s=2.0)
    assert isinstance(src.observe(clock[0]), Observation)


def test_prometheus_an_engine_in_sleep_mode_is_held_as_asleep():
    o = prom_observe({"asleep": [({}, "1")]})
    assert isinstance(o, ObservationFailure) and o.reason is FailureReason.ASLEEP, o
    assert isinstance(prom_observe({}), Observation)  # no engine asleep: the query is empty
