"""The bench driver: CSV shape and timing arithmetic, against a tiny local HTTP server that
mimics vLLM's /tokenize, /v1/completions (delay = a + c·max_tokens) and /metrics."""

from __future__ import annotations

import csv
import io
import json
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from controller.errors import InputError
from controller.launcher import bench

BASE_S, PER_TOKEN_S = 0.02, 0.01


class MimicVllm:
    """/v1/completions sleeps BASE_S + PER_TOKEN_S·max_tokens; with SD it counts accepted
    tokens as if every step accepted ``accept_per_step`` drafts."""

    def __init__(self, sd: bool = False, accept_per_step: int = 0, short_by: int = 0) -> None:
        self.sd, self.accept_per_step, self.short_by = sd, accept_per_step, short_by
        self.accepted = 0
        self.prompts: list[list[int]] = []
        self.lock = threading.Lock()
        mimic = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize":
                    self._json({"tokens": list(range(100, 400)), "count": 300})
                    return
                n = body["max_tokens"]
                assert body["ignore_eos"] is True and body["temperature"] == 0
                time.sleep(BASE_S + PER_TOKEN_S * n)
                with mimic.lock:
                    mimic.prompts.append(body["prompt"])
                    if mimic.sd and n > 1:
                        mimic.accepted += mimic.accept_per_step * ((n - 1) // (1 + mimic.accept_per_step))
                self._json({"usage": {"completion_tokens": n - mimic.short_by}})

            def do_GET(self) -> None:
                text = "vllm:num_requests_running 0\n"
                if mimic.sd:
                    text += 'vllm:spec_decode_num_drafts_total{engine="0"} 1\n'
                    accepted = mimic.accepted
                    text += f'vllm:spec_decode_num_accepted_tokens_total{{engine="0"}} {accepted}\n'
                data = text.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _json(self, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def mimic():
    servers = []

    def make(**kw):
        servers.append(MimicVllm(**kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def plan(**kw) -> bench.BenchPlan:
    defaults = dict(
        phases=("prefill", "target"),
        batch_sizes=(1, 3),
        prompt_tokens=16,
        gen_tokens=11,
        draft_length=4,
        iterations=2,
        warmup=1,
    )
    return bench.BenchPlan(**{**defaults, **kw})


def test_arithmetic():
    assert bench.decode_step_s(1.0, 0.2, 8) == pytest.approx(0.1)
    assert bench.decode_step_s(0.1, 0.2, 8) == 0.0  # noise never gives a negative step
    assert bench.target_steps(32) == 31
    # 4 sequences, 31 tokens each after prefill, 60 accepted in all: 31 - 15 = 16 steps each.
    assert bench.verify_steps(32, 4, 60) == 16
    with pytest.raises(bench.BenchError):
        bench.decode_step_s(1.0, 0.5, 0)


def test_csv_has_exact_columns():
    rows = [bench.Row("prefill", 2, 64, 64, 0, 0.1234567), bench.Row("verify", 8, 5, 80, 13, 0.002)]
    text = bench.to_csv(rows)
    assert text.splitlines() == [
        "phase,batch_size,tokens_per_seq,context_len,iteration,latency_s",
        "prefill,2,64,64,0,0.123457",
        "verify,8,5,80,13,0.002000",
    ]


def test_target_rows_recover_the_per_token_delay(mimic):
    server = mimic()
    client = bench.Client(server.url, "tiny", 10, None)
    rows = bench.run_bench(client, plan())
    assert [(r.phase, r.batch_size, r.iteration) for r in rows] == [
        ("prefill", 1, 0),
        ("target", 1, 0),
        ("prefill", 1, 1),
        ("target", 1, 1),
        ("prefill", 3, 0),
        ("target", 3, 0),
        ("prefill", 3, 1),
        ("target", 3, 1),
    ]
    for r in rows:
        if r.phase == "prefill":
            assert (r.tokens_per_seq, r.context_len) == (16, 16)
            # Concurrent requests overlap: the batch takes about one request's time.
            assert BASE_S + PER_TOKEN_S <= r.latency_s < 3 * (BASE_S + PER_TOKEN_S)
        else:
            assert (r.tokens_per_seq, r.context_len) == (1, 16 + 11 // 2)
    # Wall-clock jitter on a loaded machine: judge the median, with a tolerance.
    target = sorted(r.latency_s for r in rows if r.phase == "target")
    assert statistics.median(target) == pytest.approx(PER_TOKEN_S, abs=0.004)
    # 1 warm-up + 2 recorded iterations, each 1 prefill + 1 generate batch.
    assert len(server.prompts) == (1 + 3) * 3 * 2
    # Every request has its own prompt: nothing for a prefix cache to reuse.
    assert len({tuple(p) for p in server.prompts}) == len(server.prompts)
    assert all(len(p) == 16 for p in server.prompts)


def test_verify_rows_divide_by_steps_from_the_accepted_counter(mimic):
    server = mimic(sd=True, accept_per_step=1)  # 10 tokens after prefill -> 5 steps of 2
    client = bench.Client(server.url, "tiny", 10, None)
    rows = bench.run_bench(client, plan(phases=("verify",), batch_sizes=(2,), iterations=3, warmup=0))
    assert [r.phase for r in rows] == ["verify"] * 3
    for r in rows:
        assert (r.batch_size, r.tokens_per_seq, r.context_len) == (2, 5, 21)
    # (t_11 - t_1) = 10·PER_TOKEN_S spread over 5 verify steps, not over 10 tokens.
    median = statistics.median(r.latency_s for r in rows)
    assert median == pytest.approx(10 * PER_TOKEN_S / 5, abs=0.006)


def test_phase_must_match_the_server(mimic):
    with pytest.raises(bench.BenchError, match="use --phase verify"):
        bench.run_bench(bench.Client(mimic(sd=True).url, "tiny", 10, None), plan())
    with pytest.raises(bench.BenchError, match="is SD on"):
        bench.run_bench(bench.Client(mimic().url, "tiny", 10, None), plan(phases=("verify",)))


def test_short_generation_is_an_error(mimic):
    with pytest.raises(bench.BenchError, match="server generated"):
        bench.run_bench(bench.Client(mimic(short_by=1).url, "tiny", 10, None), plan())


def test_cli_writes_csv_and_rejects_bad_usage(mimic, tmp_path, capsys):
    import argparse

    server = mimic()
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "bench.csv"
    args = parser.parse_args(
        [
            "--url",
            server.url,
            "--model",
            "tiny",
            "--batch-sizes",
            "2",
            "--iterations",
            "3",
            "--gen-tokens",
            "4",
            "--prompt-tokens",
            "8",
            "-o",
            str(out),
        ]
    )
    assert bench.run(args) == 0
    assert "6 rows" in capsys.readouterr().err
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert [(r["phase"], r["iteration"]) for r in rows] == [
        ("prefill", "0"),
        ("target", "0"),
        ("prefill", "1"),
        ("target", "1"),
        ("prefill", "2"),
        ("target", "2"),
    ]
    for bad in (
        ["--batch-sizes", "1,x"],
        ["--phase", "decode"],
        ["--gen-tokens", "1"],
        ["--phase", "target,verify"],
    ):
        args = parser.parse_args(["--model", "tiny", "-o", str(tmp_path / "x.csv"), *bad])
        assert bench.run(args) == 2
        assert capsys.readouterr().err.count("\n") == 1
    assert not (tmp_path / "x.csv").exists()
    # A server that is not there: runtime failure, exit 1, one line.
    args = parser.parse_args(
        [
            "--url",
            "http://127.0.0.1:9",
            "--model",
            "tiny",
            "-o",
            str(tmp_path / "y.csv"),
            "--timeout-s",
            "2",
        ]
    )
    assert bench.run(args) == 1
    assert "POST http://127.0.0.1:9/tokenize" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["", "0", "1,-2", "a"])
def test_parse_int_list_rejects(text):
    with pytest.raises(InputError):
        bench.parse_int_list(text, "--batch-sizes")
