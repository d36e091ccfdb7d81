"""``sd-controller bench``: time a running vLLM's phases through /v1/completions into the
micro-benchmark CSV the calibrator reads.

Columns: ``phase,batch_size,tokens_per_seq,context_len,iteration,latency_s``. For each
batch size B and iteration, B concurrent requests (one thread each, started together):

* ``prefill``: B requests with ``max_tokens=1`` and a P-token prompt: the wall time;
  tokens_per_seq = context_len = P.
* ``target`` (server without SD): B requests generating N tokens; the step time is
  (t_N − t_1) / (N − 1): the first token comes out of the prefill pass that t_1 already
  timed, so N − 1 decode steps remain. tokens_per_seq = 1, context_len = P + N/2.
* ``verify`` (server with SD, draft length γ): the same two timings, but a step now yields
  1 + accepted tokens, so the number of steps is read from the server's own counter:
  steps = (B·(N − 1) − Δaccepted) / B. tokens_per_seq = γ + 1.

Prompts are token-id lists sampled per request (so no two share a cached prefix) from the
server's own tokenization of a generated text; ``ignore_eos`` and temperature 0 make the
lengths exact, and every response's ``usage`` is checked.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import random
import re
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import requests

from controller.atomic import write_bytes_atomic
from controller.errors import InputError

COLUMNS = ("phase", "batch_size", "tokens_per_seq", "context_len", "iteration", "latency_s")
PHASES = ("prefill", "target", "verify")
EXIT_OK, EXIT_RUNTIME, EXIT_USAGE = 0, 1, 2
ACCEPTED_RE = re.compile(r"^vllm:spec_decode_num_accepted_tokens_total(?:\{[^}]*\})?\s+(\S+)", re.M)
DRAFTS_RE = re.compile(r"^vllm:spec_decode_num_drafts_total(?:\{[^}]*\})?\s+(\S+)", re.M)
WORDS = [
    "the",
    "model",
    "draft",
    "token",
    "verify",
    "batch",
    "queue",
    "server",
    "latency",
    "step",
    "cache",
    "rate",
    "one",
    "two",
    "red",
    "blue",
]


class BenchError(RuntimeError):
    """A runtime failure talking to the server; ``str()`` is one line."""


@dataclass(frozen=True)
class Row:
    phase: str
    batch_size: int
    tokens_per_seq: int
    context_len: int
    iteration: int
    latency_s: float


# ---- pure arithmetic -------------------------------------------------------------------------


def decode_step_s(t_generate_s: float, t_prefill_s: float, steps: float) -> float:
    """Seconds per decode step: the generation time beyond the prefill pass, per step."""
    if steps <= 0:
        raise BenchError(f"no decode steps to divide by ({steps})")
    return max(0.0, t_generate_s - t_prefill_s) / steps


def target_steps(gen_tokens: int) -> int:
    """Decode steps after the prefill pass (which already yields the first token)."""
    return gen_tokens - 1


def verify_steps(gen_tokens: int, batch_size: int, accepted_delta: float) -> float:
    """Verify steps per sequence when each step yields 1 + accepted tokens."""
    return (batch_size * (gen_tokens - 1) - accepted_delta) / batch_size


def to_csv(rows: Sequence[Row]) -> str:
    """The CSV text (header + rows, latency with 6 decimals)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(COLUMNS)
    for r in rows:
        writer.writerow(
            [
                r.phase,
                r.batch_size,
                r.tokens_per_seq,
                r.context_len,
                r.iteration,
                f"{r.latency_s:.6f}",
            ]
        )
    return buf.getvalue()


def parse_int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InputError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise InputError(f"{what}: expected positive integers, got {text!r}")
    return values


def parse_phases(text: str) -> list[str]:
    phases = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in phases if p not in PHASES]
    if not phases or bad:
        raise InputError(f"--phase: expected a comma list of {', '.join(PHASES)}, got {text!r}")
    if "target" in phases and "verify" in phases:
        raise InputError("--phase: target and verify need different servers (SD off / SD on)")
    return phases


# ---- I/O -------------------------------------------------------------------------------------


class Client:
    """Per-thread keep-alive sessions against one server."""

    def __init__(self, url: str, model: str, timeout_s: float, api_key: str | None) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.timeout_s = timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._local = threading.local()

    def session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
            s.trust_env = False
        return s

    def _post(self, path: str, body: dict) -> dict:
        url = self.url + path
        try:
            r = self.session().post(url, json=body, headers=self.headers, timeout=self.timeout_s)
        except requests.RequestException as exc:
            raise BenchError(f"POST {url}: {type(exc).__name__}") from None
        if r.status_code != 200:
            raise BenchError(f"POST {url}: HTTP {r.status_code}: {' '.join(r.text.split())[:200]}")
        return r.json()

    def token_pool(self, min_tokens: int) -> list[int]:
        """Token ids of a generated text, tokenized by the server itself."""
        rng = random.Random(0)
        text = " ".join(rng.choice(WORDS) for _ in range(max(200, min_tokens)))
        ids = self._post("/tokenize", {"model": self.model, "prompt": text}).get("tokens")
        if not isinstance(ids, list) or len(ids) < 16:
            raise BenchError(f"POST {self.url}/tokenize: no usable token list")
        return [int(i) for i in ids]

    def complete(self, prompt: list[int], max_tokens: int) -> None:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        usage = self._post("/v1/completions", body).get("usage") or {}
        if usage.get("completion_tokens") != max_tokens:
            raise BenchError(f"asked for {max_tokens} tokens, server generated {usage.get('completion_tokens')}")

    def metric(self, pattern: re.Pattern[str]) -> float | None:
        try:
            r = self.session().get(self.url + "/metrics", headers=self.headers, timeout=self.timeout_s)
        except requests.RequestException:
            return None
        if r.status_code != 200:
            return None
        values = [float(v) for v in pattern.findall(r.text)]
        return sum(values) if values else None


def timed_batch(pool: ThreadPoolExecutor, client: Client, prompts: list[list[int]], max_tokens: int) -> float:
    """Wall seconds for len(prompts) concurrent requests, released together by a barrier."""
    barrier = threading.Barrier(len(prompts) + 1)

    def one(prompt: list[int]) -> None:
        barrier.wait(timeout=client.timeout_s)
        client.complete(prompt, max_tokens)

    futures = [pool.submit(one, p) for p in prompts]
    barrier.wait(timeout=client.timeout_s)
    start = time.perf_counter()
    for f in futures:
        f.result(timeout=client.timeout_s + 5)
    return time.perf_counter() - start


@dataclass(frozen=True)
class BenchPlan:
    phases: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    prompt_tokens: int
    gen_tokens: int
    draft_length: int
    iterations: int
    warmup: int
    seed: int = 0


def run_bench(client: Client, plan: BenchPlan, progress=None, warn=None) -> list[Row]:
    """Run the plan against the server; return the rows (warm-up iterations not included)."""
    pool_ids = client.token_pool(plan.prompt_tokens)
    rng = random.Random(plan.seed)
    decode_phase = next((p for p in plan.phases if p in ("target", "verify")), None)
    if decode_phase == "verify" and client.metric(ACCEPTED_RE) is None:
        raise BenchError(f"{client.url}/metrics has no vllm:spec_decode_* series: is SD on?")
    if decode_phase == "target" and client.metric(DRAFTS_RE) is not None:
        raise BenchError(f"{client.url} runs with SD: use --phase verify (or restart without SD)")
    rows: list[Row] = []
    context_len = plan.prompt_tokens + plan.gen_tokens // 2
    with ThreadPoolExecutor(max_workers=max(plan.batch_sizes)) as pool:
        for batch in plan.batch_sizes:
            for it in range(plan.warmup + plan.iterations):
                recorded = it - plan.warmup
                prompts = [[rng.choice(pool_ids) for _ in range(plan.prompt_tokens)] for _ in range(batch)]
                t_prefill = timed_batch(pool, client, prompts, 1)
                if recorded >= 0 and "prefill" in plan.phases:
                    rows.append(
                        Row(
                            "prefill",
                            batch,
                            plan.prompt_tokens,
                            plan.prompt_tokens,
                            recorded,
                            t_prefill,
                        )
                    )
                if decode_phase is None:
                    continue
                # Fresh prompts: a prefix cached by the prefill run would make this one cheaper.
                prompts = [[rng.choice(pool_ids) for _ in range(plan.prompt_tokens)] for _ in range(batch)]
                accepted_before = client.metric(ACCEPTED_RE) if decode_phase == "verify" else None
                t_generate = timed_batch(pool, client, prompts, plan.gen_tokens)
                if decode_phase == "verify":
                    accepted_after = client.metric(ACCEPTED_RE)
                    if accepted_before is None or accepted_after is None:
                        raise BenchError(f"{client.url}/metrics: lost the accepted-tokens counter")
                    steps = verify_steps(plan.gen_tokens, batch, accepted_after - accepted_before)
                    tokens_per_seq = plan.draft_length + 1
                else:
                    steps = target_steps(plan.gen_tokens)
                    tokens_per_seq = 1
                if recorded >= 0:
                    if t_generate < t_prefill and warn is not None:
                        warn(
                            f"batch {batch} iteration {recorded}: generating took less than the "
                            "prefill; step time clamped to 0 (warm-up noise?)"
                        )
                    latency = decode_step_s(t_generate, t_prefill, steps)
                    rows.append(Row(decode_phase, batch, tokens_per_seq, context_len, recorded, latency))
            if progress is not None:
                progress(batch)
    return rows


# ---- CLI -------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="vLLM base URL")
    parser.add_argument("--model", required=True, help="served model name")
    parser.add_argument(
        "--phase",
        default="prefill,target",
        help="comma list of prefill, target (server without SD), verify (server with SD)",
    )
    parser.add_argument("--batch-sizes", default="1,2,4,8", help="comma list (default 1,2,4,8)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length P (default 64)")
    parser.add_argument("--gen-tokens", type=int, default=32, help="generated tokens N (default 32)")
    parser.add_argument("--draft-length", type=int, default=4, help="γ of the SD server, for verify rows")
    parser.add_argument(
        "--iterations",
        type=int,
        default=14,
        help="recorded iterations per batch size (default 14: the calibrator drops the first 10)",
    )
    parser.add_argument("--warmup", type=int, default=0, help="extra unrecorded iterations first (default 0)")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="per-request timeout (default 120)")
    parser.add_argument("--api-key-env", help="env var holding vLLM's --api-key, if it has one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-o", "--output", required=True, help="CSV file to write")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; write the CSV only when every request succeeded."""
    try:
        plan = BenchPlan(
            phases=tuple(parse_phases(args.phase)),
            batch_sizes=tuple(parse_int_list(args.batch_sizes, "--batch-sizes")),
            prompt_tokens=args.prompt_tokens,
            gen_tokens=args.gen_tokens,
            draft_length=args.draft_length,
            iterations=args.iterations,
            warmup=args.warmup,
            seed=args.seed,
        )
        for name in ("prompt_tokens", "iterations", "draft_length"):
            if getattr(plan, name) < 1:
                raise InputError(f"--{name.replace('_', '-')} must be >= 1")
        if plan.gen_tokens < 2:
            raise InputError("--gen-tokens must be >= 2 (one token comes from the prefill pass)")
        if plan.warmup < 0 or args.timeout_s <= 0:
            raise InputError("--warmup must be >= 0 and --timeout-s > 0")
    except InputError as exc:
        print(f"sd-controller bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    api_key = os.environ.get(args.api_key_env) if args.api_key_env else None
    client = Client(args.url, args.model, args.timeout_s, api_key)
    started = time.monotonic()

    def progress(batch: int) -> None:
        print(f"bench: batch {batch} done at {time.monotonic() - started:.1f} s", file=sys.stderr)

    try:
        rows = run_bench(client, plan, progress, warn=lambda m: print(f"bench: {m}", file=sys.stderr))
    except BenchError as exc:
        print(f"sd-controller bench: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    write_bytes_atomic(args.output, to_csv(rows).encode("utf-8"))
    print(
        f"bench: {len(rows)} rows in {time.monotonic() - started:.1f} s -> {args.output}",
        file=sys.stderr,
    )
    return EXIT_OK
