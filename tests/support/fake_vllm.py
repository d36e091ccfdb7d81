"""A fake vLLM server: real HTTP on 127.0.0.1, ``/metrics`` and ``/health``, driven by tests.

The counters live in a :class:`~controller.sim.vllm_exposition.VllmCounters` snapshot that
``advance()`` replaces atomically, so a scrape never sees half an update.

For the benchmark it also answers ``POST /tokenize`` and ``POST /v1/completions`` (plain or
streamed as server-sent events, vLLM 0.32 shapes): a completion sleeps ``prefill_s``, then
``step_s`` per decode step; with SD a step yields 1 + ``accept_per_step`` tokens and moves the
spec-decode counters. ``cache_config`` = (num_gpu_blocks, block_size) adds
``vllm:cache_config_info``; ``api_key`` makes the POST endpoints demand a bearer token.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal

from controller.sim.vllm_exposition import SpecDecodeCounters, VllmCounters, render

Mode = Literal["ok", "garbage", "http500", "hang"]
MODES: tuple[str, ...] = ("ok", "garbage", "http500", "hang")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
GARBAGE = b"<html><body>502 Bad Gateway</body></html>\nvllm:request_success_total{{{ nope\n"


class FakeVllmServer:
    """Serves vLLM-shaped ``/metrics`` from counters a test drives.

    ``sd_enabled`` decides whether the ``vllm:spec_decode_*`` series exist, as with a real
    vLLM started with or without ``--speculative-config``; ``num_speculative_tokens`` is the
    number of ``position`` series. Fault injection with :meth:`set_mode`: ``"garbage"``
    (200 with unparsable text), ``"http500"``, ``"hang"`` (the request blocks until the mode
    changes or the server stops; clients must use timeouts). ``/health`` follows the mode too.
    """

    def __init__(
        self,
        *,
        model_name: str = "tiny",
        sd_enabled: bool = True,
        num_speculative_tokens: int = 4,
        engine: str = "0",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.model_name = model_name
        self.engine = engine
        self.num_speculative_tokens = num_speculative_tokens
        self._clock = clock
        self._lock = threading.Lock()
        self._mode: Mode = "ok"
        self._unhang = threading.Event()
        self._counters = self._fresh(sd_enabled)
        self.scrapes = 0
        self.restarts = 0
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0
        # The completion endpoints (tests set these directly).
        self.cache_config: tuple[int, int] | None = None
        self.prefix_caching: bool | None = None  # enable_prefix_caching on cache_config_info (None: no label)
        self.sleep_level: int | None = None  # vllm:engine_sleep_state: None not exported, 0 awake, 1 or 2 asleep
        self.api_key: str | None = None
        self.prefill_s = 0.01
        self.step_s = 0.002
        self.accept_per_step = 0
        self.short_by = 0  # generate this many tokens fewer than asked (a broken server)
        self.max_model_len = 1024
        self.completions: list[dict] = []  # request bodies, in arrival order

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> FakeVllmServer:
        """Bind a free port on 127.0.0.1 and serve in a daemon thread."""
        if self._httpd is not None:
            return self
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        httpd.daemon_threads = True
        self._httpd = httpd
        self.port = httpd.server_address[1]
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
            name=f"fake-vllm-{self.port}",
        )  # fmt: skip
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and release hung requests. Idempotent."""
        httpd, self._httpd = self._httpd, None
        self._unhang.set()
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> FakeVllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` (no path)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"{self.url}/metrics"

    @property
    def target(self) -> str:
        """``127.0.0.1:PORT``, as a Prometheus scrape target."""
        return f"127.0.0.1:{self.port}"

    # -- driving the counters --------------------------------------------------------------

    @property
    def sd_enabled(self) -> bool:
        return self._counters.spec_decode is not None

    def snapshot(self) -> VllmCounters:
        """The counters as the next scrape will render them."""
        return self._counters

    def render(self) -> str:
        text = render(self._counters)
        if self.cache_config is not None:
            blocks, block_size = self.cache_config
            apc = "" if self.prefix_caching is None else f'enable_prefix_caching="{self.prefix_caching}",'
            text += (
                "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
                "# TYPE vllm:cache_config_info gauge\n"
                f'vllm:cache_config_info{{block_size="{block_size}",cache_dtype="auto",{apc}engine="{self.engine}",'
                f'num_cpu_blocks="None",num_gpu_blocks="{blocks}"}} 1.0\n'
            )
        if self.sleep_level is not None:  # vLLM 0.32's three series per engine
            level = self.sleep_level
            text += (
                "# HELP vllm:engine_sleep_state Engine sleep state; awake = 0 means engine is sleeping.\n"
                "# TYPE vllm:engine_sleep_state gauge\n"
            )
            for state, on in (("awake", level == 0), ("weights_offloaded", level == 1), ("discard_all", level == 2)):
                labels = f'engine="{self.engine}",model_name="{self.model_name}",sleep_state="{state}"'
                text += f"vllm:engine_sleep_state{{{labels}}} {float(on)}\n"
        return text

    def generate(self, body: dict) -> tuple[list[int], int, int]:
        """Time one completion (sleeping); returns the tokens per step, prompt and generated counts."""
        n = int(body["max_tokens"])
        prompt = body["prompt"]
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        with self._lock:
            self.completions.append(body)
        sd = self.sd_enabled
        per_step = 1 + (self.accept_per_step if sd else 0)
        steps = [1]
        while sum(steps) < n:
            steps.append(min(per_step, n - sum(steps)))
        steps[-1] -= min(self.short_by, steps[-1])
        decode_steps = len(steps) - 1
        if sd and decode_steps:
            k = self.num_speculative_tokens
            self.advance(
                draft_tokens=k * decode_steps,
                drafts=decode_steps,
                accepted_tokens=sum(t - 1 for t in steps[1:]),
            )
        self.advance(requests=1, prompt_tokens=prompt_tokens, gen_tokens=sum(steps))
        return steps, prompt_tokens, sum(steps)

    def advance(
        self,
        requests: int = 0,
        prompt_tokens: float = 0,
        gen_tokens: float = 0,
        draft_tokens: float = 0,
        accepted_tokens: float = 0,
        drafts: float = 0,
        accepted_per_pos: Sequence[float] | None = None,
        e2e_latency_s: float | None = None,
        ttft_s: float | None = None,
        finished_reason: str = "length",
    ) -> VllmCounters:
        """Add finished requests and tokens; returns the new snapshot.

        ``prompt_tokens`` and ``gen_tokens`` are totals over the ``requests`` requests; the
        per-request histograms observe their mean once per request. ``e2e_latency_s`` is each
        request's latency (observed ``requests`` times; also drives the per-token latency
        histograms). SD counters may only move while SD is enabled (ValueError otherwise);
        ``accepted_per_pos`` adds per position; None leaves those counters unchanged.
        """
        with self._lock:
            c = self._counters
            sd = c.spec_decode
            if sd is None and (draft_tokens or accepted_tokens or drafts or accepted_per_pos):
                raise ValueError("advance: SD counters given but SD is not enabled")
            changes: dict = {
                "prompt_tokens_total": c.prompt_tokens_total + prompt_tokens,
                "generation_tokens_total": c.generation_tokens_total + gen_tokens,
            }
            if requests:
                success = dict(c.request_success)
                success[finished_reason] = success.get(finished_reason, 0.0) + requests
                changes["request_success"] = success
                changes["request_prompt_tokens"] = c.request_prompt_tokens.observe(prompt_tokens / requests, requests)
                gen_per_request = gen_tokens / requests
                changes["request_generation_tokens"] = c.request_generation_tokens.observe(gen_per_request, requests)
                if e2e_latency_s is not None:
                    changes["e2e_request_latency_seconds"] = c.e2e_request_latency_seconds.observe(
                        e2e_latency_s, requests
                    )
                    ttft = e2e_latency_s * 0.1 if ttft_s is None else ttft_s
                    changes["time_to_first_token_seconds"] = c.time_to_first_token_seconds.observe(ttft, requests)
                    if gen_per_request > 1:
                        tpot = max(e2e_latency_s - ttft, 0.0) / (gen_per_request - 1)
                        changes["request_time_per_output_token_seconds"] = (
                            c.request_time_per_output_token_seconds.observe(tpot, requests)
                        )
                        # One observation per engine step, as vLLM does (so with SD it
                        # counts fewer, longer intervals than tokens).
                        steps = drafts if sd is not None and drafts else gen_tokens - requests
                        if steps > 0:
                            itl = max(e2e_latency_s - ttft, 0.0) * requests / steps
                            changes["inter_token_latency_seconds"] = c.inter_token_latency_seconds.observe(itl, steps)
            if sd is not None:
                per_pos = list(sd.accepted_per_pos)
                if accepted_per_pos is not None:
                    if len(accepted_per_pos) > len(per_pos):
                        raise ValueError(f"advance: {len(accepted_per_pos)} positions given, SD has {len(per_pos)}")
                    for i, v in enumerate(accepted_per_pos):
                        per_pos[i] += v
                changes["spec_decode"] = replace(
                    sd,
                    num_drafts=sd.num_drafts + drafts,
                    num_draft_tokens=sd.num_draft_tokens + draft_tokens,
                    num_accepted_tokens=sd.num_accepted_tokens + accepted_tokens,
                    accepted_per_pos=tuple(per_pos),
                )
            self._counters = replace(c, **changes)
            return self._counters

    def set_gauges(self, running: float | None = None, waiting: float | None = None) -> None:
        """Set ``vllm:num_requests_running`` / ``_waiting``; None leaves one unchanged."""
        with self._lock:
            c = self._counters
            self._counters = replace(
                c,
                num_requests_running=c.num_requests_running if running is None else running,
                num_requests_waiting=c.num_requests_waiting if waiting is None else waiting,
            )

    def restart(self, sd_enabled: bool, num_speculative_tokens: int | None = None) -> None:
        """Simulate a vLLM restart: every counter back to 0, a new created timestamp, and the
        SD series present iff ``sd_enabled``. The port stays the same."""
        with self._lock:
            if num_speculative_tokens is not None:
                self.num_speculative_tokens = num_speculative_tokens
            self._counters = self._fresh(sd_enabled)
            self.restarts += 1

    def set_mode(self, mode: Mode) -> None:
        """Fault injection for both endpoints: "ok", "garbage", "http500" or "hang"."""
        if mode not in MODES:
            raise ValueError(f"set_mode: {mode!r} is not one of {MODES}")
        with self._lock:
            self._mode = mode
            if mode == "hang":
                self._unhang = threading.Event()
            else:
                self._unhang.set()

    @property
    def mode(self) -> Mode:
        return self._mode

    def _fresh(self, sd_enabled: bool) -> VllmCounters:
        sd = SpecDecodeCounters(accepted_per_pos=(0.0,) * self.num_speculative_tokens) if sd_enabled else None
        return VllmCounters(
            model_name=self.model_name,
            engine=self.engine,
            created_ts=self._clock(),
            spec_decode=sd,
        )


def _handler_for(server: FakeVllmServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass  # keep test output clean

        def _send(self, status: int, body: bytes, content_type: str = CONTENT_TYPE) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, status: int, obj: dict) -> None:
            self._send(status, json.dumps(obj).encode(), "application/json")

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
            if server.api_key is not None and self.headers.get("Authorization") != f"Bearer {server.api_key}":
                self._json(401, {"error": "Unauthorized"})
                return
            if self.path == "/tokenize":
                words = str(body.get("prompt", "")).split()
                ids = [100 + (sum(map(ord, w)) % 900) for w in words]
                self._json(
                    200, {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids, "token_strs": None}
                )
                return
            if self.path != "/v1/completions":
                self._send(404, b"not found\n")
                return
            n = int(body.get("max_tokens", 16))
            base = {
                "id": "cmpl-fake",
                "object": "text_completion",
                "created": int(time.time()),
                "model": server.model_name,
            }
            if not body.get("stream"):
                steps, p, g = server.generate(body)
                time.sleep(server.prefill_s + server.step_s * (len(steps) - 1))
                choice = {
                    "index": 0,
                    "text": " x" * g,
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                }
                usage = {
                    "prompt_tokens": p,
                    "total_tokens": p + g,
                    "completion_tokens": g,
                    "prompt_tokens_details": None,
                }
                self._json(200, {**base, "choices": [choice], "usage": usage})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            steps, p, g = server.generate(body)
            time.sleep(server.prefill_s)
            for i, tokens in enumerate(steps):
                if i:
                    time.sleep(server.step_s)
                last = i == len(steps) - 1
                choice = {
                    "index": 0, "text": " x" * tokens, "logprobs": None,
                    "finish_reason": "length" if last and g >= n else None, "stop_reason": None,
                }  # fmt: skip
                self._chunk(b"data: " + json.dumps({**base, "choices": [choice], "usage": None}).encode() + b"\n\n")
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": p, "total_tokens": p + g, "completion_tokens": g}
                self._chunk(b"data: " + json.dumps({**base, "choices": [], "usage": usage}).encode() + b"\n\n")
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path not in ("/metrics", "/health"):
                self._send(404, b"not found\n")
                return
            mode = server.mode
            if mode == "hang":
                server._unhang.wait(timeout=300)
                mode = server.mode
                if server._httpd is None:
                    return
            if mode == "http500":
                self._send(500, b"Internal Server Error\n")
            elif mode == "garbage":
                self._send(200, GARBAGE)
            elif path == "/health":
                self._send(200, b"")
            else:
                server.scrapes += 1
                self._send(200, server.render().encode())

    return Handler
