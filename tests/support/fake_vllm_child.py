"""A stand-in for vLLM in fast launcher tests: a real process serving /health and /metrics.

It takes a vLLM-like command line (``--host``, ``--port``, ``--speculative-config``;
anything else is ignored) plus knobs, read from the command line or the environment
(``FAKE_VLLM_<KNOB>``) so a test can set them for every start the launcher makes:

    --startup-delay-s S     sleep before serving (default 0)
    --hang-if-tokens K      with num_speculative_tokens == K: never serve (ready timeout)
    --exit-if-tokens K      with num_speculative_tokens == K: exit 3 while starting
    --ignore-sigterm        keep running on SIGTERM (forces the launcher to SIGKILL)
    --sigterm-exit-code N   exit status after a SIGTERM (default 0)
    --record FILE           append one JSON line {pid, argv, spec} per start

    POST /fake/crash        exit at once with status 3 (a crash)
    GET  /fake/info         {pid, argv, spec}

Tests import ``command()`` (a vLLM-like command line running this file) and ``free_port()``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SD_METRICS = (
    "# TYPE vllm:spec_decode_num_drafts_total counter\n"
    'vllm:spec_decode_num_drafts_total{{engine="0",model_name="tiny"}} {n}\n'
)
BASE_METRICS = '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0",model_name="tiny"} 0.0\n'


SCRIPT = os.path.abspath(__file__)
NGRAM_K4 = '{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":3}'


def free_port() -> int:
    """A loopback port that was free a moment ago (tests: bind, read, close)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def command(port: int, spec: str | None = NGRAM_K4) -> list[str]:
    """A vLLM-like command line that runs this stand-in (SD on when ``spec`` is given)."""
    argv = [sys.executable, SCRIPT, "--host", "127.0.0.1", "--port", str(port)]
    return [*argv, "--speculative-config", spec] if spec is not None else argv


def parse(argv: list[str]) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--speculative-config", default=None)
    p.add_argument("--startup-delay-s", type=float, default=float(env("FAKE_VLLM_STARTUP_DELAY_S", "0")))
    p.add_argument("--hang-if-tokens", type=int, default=int(env("FAKE_VLLM_HANG_IF_TOKENS", "-1")))
    p.add_argument("--exit-if-tokens", type=int, default=int(env("FAKE_VLLM_EXIT_IF_TOKENS", "-1")))
    p.add_argument("--ignore-sigterm", action="store_true", default=env("FAKE_VLLM_IGNORE_SIGTERM") == "1")
    p.add_argument("--sigterm-exit-code", type=int, default=int(env("FAKE_VLLM_SIGTERM_EXIT_CODE", "0")))
    p.add_argument("--record", default=env("FAKE_VLLM_RECORD"))
    args, _unknown = p.parse_known_args(argv)
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    spec = json.loads(args.speculative_config) if args.speculative_config else None
    tokens = (spec or {}).get("num_speculative_tokens")
    info = {"pid": os.getpid(), "argv": argv, "spec": spec}
    if args.record:
        with open(args.record, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(info) + "\n")

    stop = threading.Event()

    def on_term(_signum: int, _frame: object) -> None:
        if not args.ignore_sigterm:
            stop.set()

    signal.signal(signal.SIGTERM, on_term)
    if args.exit_if_tokens >= 0 and tokens == args.exit_if_tokens:
        print(f"fake vllm: refusing to start with k={tokens}", file=sys.stderr)
        return 3
    if stop.wait(args.startup_delay_s):
        return args.sigterm_exit_code
    if args.hang_if_tokens >= 0 and tokens == args.hang_if_tokens:
        while not stop.wait(0.1):
            pass
        return args.sigterm_exit_code

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/health":
                self._reply(200, b"", "text/plain")
            elif self.path == "/metrics":
                text = BASE_METRICS + (SD_METRICS.format(n=0) if spec is not None else "")
                self._reply(200, text.encode(), "text/plain; version=0.0.4")
            elif self.path == "/fake/info":
                self._reply(200, json.dumps(info).encode(), "application/json")
            else:
                self._reply(404, b"", "text/plain")

        def do_POST(self) -> None:
            if self.path == "/fake/crash":
                self._reply(200, b"", "text/plain")
                os._exit(3)
            self._reply(404, b"", "text/plain")

        def _reply(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args: object) -> None:
            pass

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    while not stop.wait(0.1):
        pass
    server.shutdown()
    server.server_close()
    time.sleep(0.05)
    return args.sigterm_exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
