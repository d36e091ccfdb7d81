"""``sd-controller bench``: measure a running vLLM into the CSVs ``calibrate`` reads.

Two modes over one :class:`~controller.benchmark.http.HttpServer`: the micro-benchmark
(:mod:`controller.benchmark.micro`, default) and ``--load-test``
(:mod:`controller.benchmark.loadtest`). Nothing is written unless every request succeeded;
errors are one line, exit 2 for usage and 1 at run time.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

from controller.benchmark.csvio import bench_csv, load_csv, write_text_atomic
from controller.benchmark.loadtest import MAX_DURATION_S, MAX_REQUESTS, LoadPlan, lognormal_workload, run_load
from controller.benchmark.micro import DEFAULT_CHUNK_TOKENS, PHASES, TILE_PHASE_TOKENS, MicroPlan, run_micro
from controller.benchmark.probe import ProbeError
from controller.commands._common import finite_float
from controller.errors import EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, InputError

WORKLOAD_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")


def parse_int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InputError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise InputError(f"{what}: expected positive integers, got {text!r}")
    return values


def parse_rates(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InputError(f"--rates: expected comma-separated numbers, got {text!r}") from None
    if not values or any(not v > 0 or v == float("inf") for v in values):
        raise InputError(f"--rates: expected positive request rates, got {text!r}")
    return values


def parse_phases(text: str, draft_length: int) -> list[str]:
    phases = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in phases if p not in PHASES]
    if not phases or bad:
        raise InputError(f"--phase: expected a comma list of {', '.join(PHASES)}, got {text!r}")
    if "target" in phases and "verify" in phases:
        raise InputError("--phase: target and verify need different servers (SD off / SD on)")
    if "verify" in phases and draft_length < 1:
        raise InputError("--phase verify measures an SD server: pass its --draft-length (>= 1)")
    if "target" in phases and draft_length > 0:
        raise InputError("--phase target measures a server without SD: --draft-length must be 0")
    return phases


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="vLLM base URL")
    parser.add_argument("--model", required=True, help="served model name")
    parser.add_argument(
        "--draft-length",
        type=int,
        default=0,
        help="γ (num_speculative_tokens) of the server's SD config; 0 = SD off (default). Cross-checked with /metrics",
    )
    parser.add_argument(
        "--phase",
        default="prefill,target",
        help="micro-benchmark: comma list of prefill, target (SD off), verify (SD on), mixed (default prefill,target)",
    )
    parser.add_argument("--batch-sizes", default="1,2,4,8", help="comma list (default 1,2,4,8)")
    parser.add_argument(
        "--chunk-tokens",
        default=",".join(map(str, DEFAULT_CHUNK_TOKENS)),
        help="mixed: prompt tokens of the injected prefill chunk, comma list (default 128,512,1024,2048)",
    )
    parser.add_argument(
        "--chunk-phase-tokens",
        type=int,
        default=TILE_PHASE_TOKENS,
        help="mixed: each chunk grows by an offset below this, walking the GEMM tiles' phases so a step's"
        f" batch-plus-chunk tokens land anywhere on them, as served prompts do (default {TILE_PHASE_TOKENS};"
        " 0: the sizes as given)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="mixed: the server's step token budget (vLLM --max-num-batched-tokens; /metrics does not show it):"
        " a chunk larger than the budget leaves beside the batch is measured at that remainder",
    )
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length P (load test: mean; default 64)")
    parser.add_argument("--gen-tokens", type=int, default=32, help="generated tokens N (load test: mean; default 32)")
    parser.add_argument(
        "--iterations",
        type=int,
        default=14,
        help="recorded iterations per batch size (default 14: the calibrator drops the first 10)",
    )
    parser.add_argument("--warmup", type=int, default=0, help="extra unrecorded iterations first (default 0)")
    parser.add_argument("--load-test", action="store_true", help="run the load test instead of the micro-benchmark")
    parser.add_argument("--rates", default="1,2,4,8", help="load test: arrival rates in requests/s (default 1,2,4,8)")
    parser.add_argument(
        "--duration-s", type=finite_float, default=600.0, help="load test: seconds per rate (default 600)"
    )
    parser.add_argument(
        "--drain-s",
        type=finite_float,
        default=None,
        help="load test: seconds after the duration for the last requests (default: 10 %% of the duration, >= 30)",
    )
    parser.add_argument(
        "--workload", default="chat", help="load test: workload name, also the prompt vocabulary (default chat)"
    )
    parser.add_argument(
        "--length-cv",
        type=finite_float,
        default=0.5,
        help="load test: coefficient of variation of the lognormal prompt/generated lengths (default 0.5)",
    )
    parser.add_argument(
        "--prefix-tokens",
        type=int,
        default=0,
        help="load test: every prompt starts with a shared prefix of this many tokens (a system prompt, which"
        " vLLM's prefix cache serves once computed); --prompt-tokens is then the mean of the rest (default 0)",
    )
    parser.add_argument(
        "--prefix-groups",
        type=int,
        default=1,
        help="load test: how many different shared prefixes the requests draw from, uniformly (default 1)",
    )
    parser.add_argument(
        "--max-requests", type=int, default=20_000, help="load test: most requests per rate (default 20000)"
    )
    parser.add_argument(
        "--context-prompt-tokens",
        help="comma list of further prompt lengths at which target/verify are repeated, so the KV-read cost"
        " separates from the per-sequence cost (e.g. 2048)",
    )
    parser.add_argument("--timeout-s", type=finite_float, default=120.0, help="per-request timeout (default 120)")
    parser.add_argument("--api-key-env", help="env var holding vLLM's --api-key, if it has one")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="random draws (a load test's arrivals and lengths): another seed repeats a load test on other"
        " arrivals, and validate pools the runs at one rate (default 0)",
    )
    parser.add_argument("-o", "--output", required=True, help="CSV file to write")


def _micro_plan(args: argparse.Namespace) -> MicroPlan:
    if args.draft_length < 0:
        raise InputError("--draft-length must be >= 0")
    plan = MicroPlan(
        phases=tuple(parse_phases(args.phase, args.draft_length)),
        batch_sizes=tuple(parse_int_list(args.batch_sizes, "--batch-sizes")),
        prompt_tokens=args.prompt_tokens,
        gen_tokens=args.gen_tokens,
        iterations=args.iterations,
        warmup=args.warmup,
        chunk_tokens=tuple(parse_int_list(args.chunk_tokens, "--chunk-tokens")),
        chunk_phase_tokens=args.chunk_phase_tokens,
        context_prompt_tokens=tuple(parse_int_list(args.context_prompt_tokens, "--context-prompt-tokens"))
        if args.context_prompt_tokens
        else (),
    )
    for name in ("prompt_tokens", "iterations"):
        if getattr(plan, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1")
    if plan.gen_tokens < 2:
        raise InputError("--gen-tokens must be >= 2 (one token comes from the prefill pass)")
    if plan.warmup < 0:
        raise InputError("--warmup must be >= 0")
    if plan.chunk_phase_tokens < 0:
        raise InputError("--chunk-phase-tokens must be >= 0")
    return plan


def _load_plan(args: argparse.Namespace) -> LoadPlan:
    if args.draft_length < 0:
        raise InputError("--draft-length must be >= 0")
    rates = parse_rates(args.rates)
    if not 0 < args.duration_s <= MAX_DURATION_S:
        raise InputError(f"--duration-s must be in (0, {MAX_DURATION_S:g}]")
    drain_s = max(30.0, 0.1 * args.duration_s) if args.drain_s is None else args.drain_s
    if drain_s < 0:
        raise InputError("--drain-s must be >= 0")
    if not 1 <= args.max_requests <= MAX_REQUESTS:
        raise InputError(f"--max-requests must be in [1, {MAX_REQUESTS}]")
    expected = max(rates) * args.duration_s
    if expected > args.max_requests:
        raise InputError(
            f"rate {max(rates):g}/s for {args.duration_s:g} s is ~{expected:.0f} requests > --max-requests "
            f"{args.max_requests}"
        )
    if args.prompt_tokens < 1 or args.gen_tokens < 1:
        raise InputError("--prompt-tokens and --gen-tokens must be >= 1")
    if not 0 <= args.length_cv <= 5:
        raise InputError("--length-cv must be in [0, 5]")
    if args.prefix_tokens < 0 or args.prefix_groups < 1:
        raise InputError(
            f"--prefix-tokens {args.prefix_tokens} must be >= 0 and --prefix-groups {args.prefix_groups} >= 1"
        )
    if not WORKLOAD_NAME.match(args.workload):
        raise InputError(f"--workload: expected a short lowercase name, got {args.workload!r}")
    return LoadPlan(tuple(rates), args.duration_s, drain_s, args.workload, args.seed, args.max_requests)


def run(args: argparse.Namespace) -> int:
    """Run the micro-benchmark or the load test; write the CSV only when every request succeeded."""
    # Deferred: keeps `sd-controller --help` from importing requests.
    from controller.benchmark.http import HttpServer

    try:
        if args.timeout_s <= 0:
            raise InputError("--timeout-s must be > 0")
        if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < 16:
            raise InputError(f"--max-num-batched-tokens: {args.max_num_batched_tokens} must be >= 16")
        micro = None if args.load_test else _micro_plan(args)
        load = _load_plan(args) if args.load_test else None
    except InputError as exc:
        print(f"sd-controller bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    api_key = os.environ.get(args.api_key_env) if args.api_key_env else None
    if args.api_key_env and not api_key:
        print(f"sd-controller bench: --api-key-env {args.api_key_env}: the variable is not set", file=sys.stderr)
        return EXIT_USAGE
    server = HttpServer(
        args.url,
        args.model,
        args.timeout_s,
        api_key,
        draft_length=args.draft_length,
        seed=args.seed,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    started = time.monotonic()

    def note(message: str) -> None:
        print(f"bench: {message}", file=sys.stderr)

    try:
        if micro is not None:
            rows = run_micro(
                server, micro, lambda b: note(f"batch {b} done at {time.monotonic() - started:.1f} s"), warn=note
            )
            text = bench_csv(rows)
        else:
            assert load is not None
            workload = lognormal_workload(
                args.prompt_tokens,
                args.gen_tokens,
                args.length_cv,
                kind=args.workload,
                prefix_tokens=args.prefix_tokens,
                prefix_groups=args.prefix_groups if args.prefix_tokens else 0,
            )
            rows = run_load(
                server,
                workload,
                load,
                lambda r: note(
                    f"rate {r.rate:g}: mean e2e {r.mean_e2e_s:.3f} s, saturated {int(r.saturated)}"
                    + (f" (served {r.served_rps:.3g} req/s: the server's capacity)" if r.saturated else "")
                ),
                warn=note,
            )
            text = load_csv(rows)
    except ProbeError as exc:
        print(f"sd-controller bench: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_RUNTIME
    write_text_atomic(args.output, text)
    note(f"{len(rows)} rows in {time.monotonic() - started:.1f} s -> {args.output}")
    return EXIT_OK
