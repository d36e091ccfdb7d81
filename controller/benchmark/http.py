"""A real vLLM behind the :class:`BenchServer` protocol, over its OpenAI API and /metrics.

Why streaming: the first-token time is what separates the prefill step from the decode steps,
and only a streamed response shows it. Prompts are token ids sampled afresh per request from
the server's own tokenization of a generated text (so vLLM's prefix cache never makes a
prefill free), except a request's ``prefix_group`` prefix: its first ``prefix_tokens`` ids are
drawn from a generator seeded by the group's name, the same for every request of the group (and
every probe), as a shared system prompt would be; ``ignore_eos`` and temperature 0 make the lengths exact, and every stream's
``usage`` is checked against what was asked. Requests go out open-loop: each at its
``send_at_s`` from a thread pool, whether or not earlier ones have finished.

/metrics is parsed with prometheus-client's parser; during a probe a thread scrapes the batch
gauges (running sequences, KV cache usage) once a second. The draft length is the user's word
(vLLM does not export it), cross-checked: SD series present ⇔ draft_length > 0. The API key
is only ever put in a header; errors name the URL and the failure, never the key.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import requests
from prometheus_client.parser import text_string_to_metric_families

from controller.benchmark.probe import GaugeSample, ProbeError, ProbeRequest, ProbeResult, ServerCounters, ServerInfo
from controller.sources.kv_context import prefix_caching as caching_label

ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
DRAFTS = "vllm:spec_decode_num_drafts_total"
CACHED = "vllm:prompt_tokens_cached_total"
CACHE_INFO = "vllm:cache_config_info"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
GAUGE_INTERVAL_S = 1.0  # how often a probe scrapes the batch gauges
MAX_WORKERS = 512  # concurrent requests in flight; beyond that sends are late (open loop bends)
MIN_POOL_TOKENS = 16

# Text per workload kind: the ids are shuffled anyway, but their vocabulary follows the kind.
VOCABULARY: dict[str, tuple[str, ...]] = {
    "": (
        "the", "model", "draft", "token", "verify", "batch", "queue", "server",
        "latency", "step", "cache", "rate", "one", "two", "red", "blue",
    ),
    "code": (
        "def", "return", "for", "in", "if", "else", "self", "import", "(", ")", ":",
        "=", "+", "[", "]", "x", "i", "range", "len", "None",
    ),
}  # fmt: skip


def _one_line(text: str, limit: int = 200) -> str:
    return " ".join(text.split())[:limit]


class HttpServer:
    """vLLM's /tokenize, /v1/completions (streamed) and /metrics as a BenchServer."""

    def __init__(
        self,
        url: str,
        model: str,
        timeout_s: float,
        api_key: str | None = None,
        *,
        draft_length: int = 0,
        seed: int = 0,
        max_workers: int = MAX_WORKERS,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        # vLLM's /metrics does not show the scheduler's budget: the user says what it was started with.
        self.max_num_batched_tokens = max_num_batched_tokens
        self.model = model
        self.timeout_s = timeout_s
        self.draft_length = draft_length
        self.max_workers = max_workers
        self._api_key = api_key
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._local = threading.local()
        self._rng = random.Random(seed)
        self._pools: dict[str, list[int]] = {}
        self._max_model_len: int | None = None
        self._lock = threading.Lock()
        self._gauges: list[GaugeSample] = []

    # ---- plumbing --------------------------------------------------------------------------

    def _error(self, message: str) -> ProbeError:
        if self._api_key:
            message = message.replace(self._api_key, "***")
        return ProbeError(_one_line(message, 400))

    def _session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
            s.trust_env = False
        return s

    def _post_json(self, path: str, body: dict) -> dict:
        url = self.url + path
        try:
            r = self._session().post(url, json=body, headers=self._headers, timeout=self.timeout_s)
        except requests.RequestException as exc:
            raise self._error(f"POST {url}: {type(exc).__name__}") from None
        if r.status_code != 200:
            raise self._error(f"POST {url}: HTTP {r.status_code}: {_one_line(r.text)}")
        try:
            return r.json()
        except ValueError:
            raise self._error(f"POST {url}: not JSON") from None

    def _metric_samples(self) -> list:
        url = self.url + "/metrics"
        try:
            r = self._session().get(url, headers=self._headers, timeout=self.timeout_s)
        except requests.RequestException as exc:
            raise self._error(f"GET {url}: {type(exc).__name__}") from None
        if r.status_code != 200:
            raise self._error(f"GET {url}: HTTP {r.status_code}")
        try:
            return [s for family in text_string_to_metric_families(r.text) for s in family.samples]
        except Exception as exc:  # the parser raises ValueError, TypeError, IndexError... on garbage
            raise self._error(f"GET {url}: not Prometheus text ({type(exc).__name__})") from None

    # ---- BenchServer -----------------------------------------------------------------------

    def counters(self) -> ServerCounters:
        sums: dict[str, float] = {}
        for s in self._metric_samples():
            if s.name in (ACCEPTED, DRAFT_TOKENS, DRAFTS, CACHED):
                sums[s.name] = sums.get(s.name, 0.0) + float(s.value)
        return ServerCounters(sums.get(ACCEPTED), sums.get(DRAFT_TOKENS), sums.get(DRAFTS), sums.get(CACHED))

    def info(self) -> ServerInfo:
        samples = self._metric_samples()
        has_sd = any(s.name in (ACCEPTED, DRAFTS) for s in samples)
        if has_sd and self.draft_length <= 0:
            raise self._error(f"{self.url} runs with SD (spec-decode series in /metrics): pass its --draft-length")
        if not has_sd and self.draft_length > 0:
            raise self._error(
                f"{self.url}/metrics has no vllm:spec_decode_* series but --draft-length is {self.draft_length}: "
                "is SD on?"
            )
        kv_tokens = block_size = prefix_caching = None
        for s in samples:
            if s.name == CACHE_INFO:
                try:
                    block_size = int(s.labels["block_size"])
                    kv_tokens = int(s.labels["num_gpu_blocks"]) * block_size
                except (KeyError, ValueError):
                    kv_tokens = block_size = None
                prefix_caching = caching_label(s.labels)
                break
        return ServerInfo(
            self.draft_length,
            kv_tokens,
            block_size=block_size,
            max_num_batched_tokens=self.max_num_batched_tokens,
            prefix_caching=prefix_caching,
        )

    def gauges(self) -> list[GaugeSample]:
        return list(self._gauges)

    def _scrape_gauges(self, start: float, stop: threading.Event, out: list[GaugeSample]) -> None:
        """Until ``stop``: the batch gauges once per GAUGE_INTERVAL_S. A failed scrape is a gap,
        not a failed probe (the requests are what is measured)."""
        while not stop.is_set():
            at = time.perf_counter() - start
            try:
                samples = self._metric_samples()
            except ProbeError:
                samples = []
            running = [float(s.value) for s in samples if s.name == RUNNING]
            usage = [float(s.value) for s in samples if s.name == KV_USAGE]
            if running and usage and all(math.isfinite(v) for v in (*running, *usage)):
                # Engines share the load alike; their usage fractions average to the whole cache's.
                out.append(GaugeSample(at, sum(running), sum(usage) / len(usage)))
            stop.wait(GAUGE_INTERVAL_S)

    def token_pool(self, kind: str = "") -> list[int]:
        """Token ids of a generated text of this kind, tokenized by the server itself (cached)."""
        with self._lock:
            pool = self._pools.get(kind)
        if pool is not None:
            return pool
        words = VOCABULARY.get(kind, VOCABULARY[""])
        text_rng = random.Random(f"pool:{kind}")
        text = " ".join(text_rng.choice(words) for _ in range(400))
        reply = self._post_json("/tokenize", {"model": self.model, "prompt": text})
        ids = reply.get("tokens")
        if not isinstance(ids, list) or len(ids) < MIN_POOL_TOKENS:
            raise self._error(f"POST {self.url}/tokenize: no usable token list")
        pool = [int(i) for i in ids]
        with self._lock:
            self._pools[kind] = pool
            if isinstance(reply.get("max_model_len"), int):
                self._max_model_len = reply["max_model_len"]
        return pool

    def _prefix(self, index: int, req: ProbeRequest, prefixes: dict[str, list[int]]) -> list[int]:
        """The shared first tokens of the request's prefix group (none without one)."""
        if not req.prefix_group:
            return []
        if not 0 <= req.prefix_tokens <= req.prompt_tokens:
            raise self._error(
                f"request {index}: prefix_tokens {req.prefix_tokens} must be in [0, prompt_tokens {req.prompt_tokens}]"
            )
        ids = prefixes.get(req.prefix_group)
        if ids is None:
            rng = random.Random(f"prefix:{req.prefix_group}")  # the same text in every probe
            pool = self.token_pool(req.kind)
            ids = prefixes[req.prefix_group] = [rng.choice(pool) for _ in range(req.prefix_tokens)]
        if len(ids) != req.prefix_tokens:
            raise self._error(
                f"request {index}: prefix_group {req.prefix_group!r} has prefix_tokens {req.prefix_tokens}, "
                f"earlier {len(ids)}"
            )
        return ids

    def probe(self, requests_: Sequence[ProbeRequest]) -> list[ProbeResult]:
        prompts = []
        prefixes: dict[str, list[int]] = {}
        for index, req in enumerate(requests_):
            pool = self.token_pool(req.kind)
            if self._max_model_len is not None and req.prompt_tokens + req.max_tokens > self._max_model_len:
                raise self._error(
                    f"a request of {req.prompt_tokens} prompt + {req.max_tokens} generated tokens exceeds "
                    f"the server's max_model_len {self._max_model_len}"
                )
            prefix = self._prefix(index, req, prefixes)
            prompts.append(prefix + [self._rng.choice(pool) for _ in range(req.prompt_tokens - len(prefix))])
        order = sorted(range(len(requests_)), key=lambda i: requests_[i].send_at_s)
        stop = threading.Event()
        futures: dict[int, Future[ProbeResult]] = {}
        pool_size = max(1, min(len(requests_), self.max_workers))
        executor = ThreadPoolExecutor(max_workers=pool_size, thread_name_prefix="bench")
        gauges: list[GaugeSample] = []
        scraped = threading.Event()
        start = time.perf_counter()
        scraper = threading.Thread(
            target=self._scrape_gauges, args=(start, scraped, gauges), name="bench-gauges", daemon=True
        )
        scraper.start()
        try:
            for i in order:
                delay = start + requests_[i].send_at_s - time.perf_counter()
                if delay > 0 and stop.wait(delay):
                    break
                if stop.is_set():
                    break
                futures[i] = executor.submit(
                    self._complete, prompts[i], requests_[i].max_tokens, start, stop, requests_[i].trace
                )
            done = {i: f.result() for i, f in futures.items()}  # raises the first failure, in send order
        finally:
            stop.set()  # after an error: send nothing more
            executor.shutdown(wait=True, cancel_futures=True)
            scraped.set()
            scraper.join()
            self._gauges = gauges
        if len(done) != len(requests_):
            raise self._error(f"only {len(done)} of {len(requests_)} requests were sent")
        return [done[i] for i in range(len(requests_))]

    def _complete(
        self, prompt: list[int], max_tokens: int, start: float, stop: threading.Event, trace: bool = False
    ) -> ProbeResult:
        try:
            return self._stream(prompt, max_tokens, start, trace)
        except BaseException:
            stop.set()
            raise

    def _stream(self, prompt: list[int], max_tokens: int, start: float, trace: bool = False) -> ProbeResult:
        url = self.url + "/v1/completions"
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        sent_s = time.perf_counter() - start
        first_s: float | None = None
        usage: dict | None = None
        times: list[float] = []
        try:
            with self._session().post(url, json=body, headers=self._headers, timeout=self.timeout_s, stream=True) as r:
                if r.status_code != 200:
                    raise self._error(f"POST {url}: HTTP {r.status_code}: {_one_line(r.text)}")
                for raw in r.iter_lines():
                    if not raw.startswith(b"data:"):
                        continue
                    data = raw[5:].strip()
                    if data == b"[DONE]":
                        break
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        raise self._error(f"POST {url}: a stream chunk is not JSON") from None
                    if "error" in chunk:
                        raise self._error(f"POST {url}: error in stream: {chunk['error']}")
                    if chunk.get("choices"):
                        now_s = time.perf_counter() - start
                        if first_s is None:
                            first_s = now_s
                        if trace:
                            times.append(now_s)
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                done_s = time.perf_counter() - start
        except requests.RequestException as exc:
            raise self._error(f"POST {url}: {type(exc).__name__}") from None
        if first_s is None or usage is None:
            raise self._error(f"POST {url}: the stream ended without {'tokens' if first_s is None else 'usage'}")
        generated, prompt_count = usage.get("completion_tokens"), usage.get("prompt_tokens")
        if generated != max_tokens or prompt_count != len(prompt):
            raise self._error(
                f"asked for {len(prompt)} prompt + {max_tokens} generated tokens, "
                f"server reported {prompt_count} + {generated}"
            )
        return ProbeResult(sent_s, first_s, done_s, prompt_count, generated, tuple(times))
