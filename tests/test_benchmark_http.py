"""HttpServer and ``sd-controller bench`` against the fake vLLM over real HTTP on 127.0.0.1.

The fake streams completions (prefill_s, then step_s per decode step; with SD 1 + accepted
tokens per step) and exports vLLM 0.32 /metrics, so the wall-clock timings are checked with
a tolerance for a loaded machine, and the arithmetic exactly elsewhere (test_benchmark_micro).
"""

from __future__ import annotations

import argparse
import csv
import io
import statistics
from pathlib import Path

import pytest

from controller.benchmark.http import HttpServer
from controller.benchmark.loadtest import LoadPlan, lognormal_workload, run_load
from controller.benchmark.micro import MicroPlan, run_micro
from controller.benchmark.probe import ProbeError, ProbeRequest
from controller.commands import bench as cli
from tests.support.fake_vllm import FakeVllmServer

SECRET = "sk-very-secret-token"
FIXTURES = Path(__file__).parent / "fixtures" / "vllm-0.32-cpu"


@pytest.fixture
def fake():
    servers: list[FakeVllmServer] = []

    def make(sd: bool = False, **attrs) -> FakeVllmServer:
        server = FakeVllmServer(sd_enabled=sd, num_speculative_tokens=4).start()
        for k, v in attrs.items():
            setattr(server, k, v)
        servers.append(server)
        return server

    yield make
    for s in servers:
        s.stop()


def test_probe_streams_first_token_and_done_times(fake):
    server = fake(prefill_s=0.05, step_s=0.01)
    http = HttpServer(server.url, "tiny", 10)
    reqs = [ProbeRequest(0.0, 16, 6), ProbeRequest(0.2, 8, 1)]
    results = http.probe(reqs)
    a, b = results
    assert (a.prompt_tokens, a.generated_tokens, b.prompt_tokens, b.generated_tokens) == (16, 6, 8, 1)
    assert a.sent_s < 0.05 and a.first_token_s - a.sent_s >= 0.05
    assert a.done_s - a.first_token_s >= 5 * 0.01  # five decode steps after the first token
    assert b.sent_s >= 0.2  # open loop: sent at its offset, while a may still run
    bodies = server.completions
    assert all(b["stream"] and b["ignore_eos"] and b["temperature"] == 0 for b in bodies)
    assert all(b["stream_options"] == {"include_usage": True} for b in bodies)
    # Token-id prompts of the asked length, fresh per request (no shared prefix to cache).
    assert [len(b["prompt"]) for b in bodies] == [16, 8]
    assert bodies[0]["prompt"][:8] != bodies[1]["prompt"]


def test_counters_and_info_from_metrics(fake):
    server = fake(sd=True, cache_config=(8192, 16))
    server.advance(draft_tokens=400, accepted_tokens=250, drafts=100)
    http = HttpServer(server.url, "tiny", 10, draft_length=4)
    c = http.counters()
    assert (c.accepted_tokens, c.draft_tokens, c.drafts) == (250, 400, 100)
    assert http.info().kv_cache_tokens == 8192 * 16
    assert http.info().draft_length == 4
    off = fake()
    assert HttpServer(off.url, "tiny", 10).counters().accepted_tokens is None
    assert HttpServer(off.url, "tiny", 10).info().kv_cache_tokens is None


@pytest.mark.parametrize("caching", [True, False, None])
def test_prefix_caching_is_read_from_the_cache_config_label(fake, caching):
    server = fake(cache_config=(100, 16), prefix_caching=caching)
    assert HttpServer(server.url, "tiny", 10).info().prefix_caching is caching


def test_prefix_caching_on_a_real_vllm_capture(fake):
    # vLLM 0.32 (CPU build) as captured: prefix caching on by default, 8192 blocks of 128.
    text = (FIXTURES / "metrics-sd-off.txt").read_text()
    server = fake()
    server.render = lambda: text
    info = HttpServer(server.url, "tiny", 10).info()
    assert (info.prefix_caching, info.kv_cache_tokens, info.block_size) == (True, 8192 * 128, 128)


def test_draft_length_is_cross_checked_with_the_sd_series(fake):
    with pytest.raises(ProbeError, match="pass its --draft-length"):
        HttpServer(fake(sd=True).url, "tiny", 10).info()
    with pytest.raises(ProbeError, match="is SD on"):
        HttpServer(fake().url, "tiny", 10, draft_length=4).info()


def test_wrong_token_counts_and_garbage_are_one_line_errors(fake):
    with pytest.raises(ProbeError, match="server reported 16 \\+ 5") as err:
        HttpServer(fake(short_by=1).url, "tiny", 10).probe([ProbeRequest(0, 16, 6)])
    assert "\n" not in str(err.value)
    bad = fake()
    bad.set_mode("garbage")
    with pytest.raises(ProbeError, match="not Prometheus text"):
        HttpServer(bad.url, "tiny", 10).counters()
    with pytest.raises(ProbeError, match="exceeds the server's max_model_len 1024"):
        HttpServer(fake().url, "tiny", 10).probe([ProbeRequest(0, 1000, 100)])


def test_api_key_is_sent_and_never_shown(fake):
    server = fake(api_key=SECRET, prefill_s=0.0, step_s=0.0)
    assert HttpServer(server.url, "tiny", 10, SECRET).probe([ProbeRequest(0, 4, 2)])[0].generated_tokens == 2
    with pytest.raises(ProbeError) as err:
        HttpServer(server.url, "tiny", 10, "sk-wrong-" + SECRET).probe([ProbeRequest(0, 4, 2)])
    assert "HTTP 401" in str(err.value) and SECRET not in str(err.value)


def test_micro_over_http_recovers_the_step_time(fake):
    server = fake(prefill_s=0.03, step_s=0.01)
    rows = run_micro(
        HttpServer(server.url, "tiny", 10),
        MicroPlan(("prefill", "target"), (1, 3), prompt_tokens=16, gen_tokens=11, iterations=3),
    )
    assert [r.phase for r in rows[:2]] == ["prefill", "target"]
    target = [r.latency_s for r in rows if r.phase == "target"]
    assert statistics.median(target) == pytest.approx(0.01, abs=0.004)  # wall clock on a shared box
    prefill = [r.latency_s for r in rows if r.phase == "prefill"]
    assert all(0.03 <= t < 0.2 for t in prefill)


def test_verify_over_http_divides_by_steps_from_the_accepted_counter(fake):
    server = fake(sd=True, prefill_s=0.02, step_s=0.02, accept_per_step=1)  # 10 tokens: 5 steps of 2
    rows = run_micro(
        HttpServer(server.url, "tiny", 10, draft_length=4),
        MicroPlan(("verify",), (2,), prompt_tokens=16, gen_tokens=11, iterations=3),
    )
    verify = [r for r in rows if r.phase == "verify"]
    assert {(r.tokens_per_seq, r.draft_length) for r in verify} == {(5, 4)}
    assert statistics.median(r.latency_s for r in verify) == pytest.approx(0.02, abs=0.006)


# ---- the CLI ---------------------------------------------------------------------------------


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_micro_writes_the_csv(fake, tmp_path, capsys):
    server = fake(prefill_s=0.0, step_s=0.001, cache_config=(100, 16), prefix_caching=True)
    out = tmp_path / "bench.csv"
    args = parse("--url", server.url, "--model", "tiny", "--batch-sizes", "2", "--iterations", "3",
                 "--gen-tokens", "4", "--prompt-tokens", "8", "-o", str(out))  # fmt: skip
    assert cli.run(args) == 0
    assert "8 rows" in capsys.readouterr().err
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert list(rows[0]) == ["phase", "batch_size", "tokens_per_seq", "context_len", "iteration", "latency_s",
                             "draft_length", "chunk_tokens"]  # fmt: skip
    assert [(r["phase"], r["iteration"]) for r in rows] == [
        ("prefill", "0"), ("target", "0"), ("prefill", "1"), ("target", "1"), ("prefill", "2"), ("target", "2"),
        ("kv_cache", "0"), ("prefix_caching", "0"),
    ]  # fmt: skip
    assert (rows[-2]["context_len"], rows[-1]["context_len"]) == ("1600", "1")


def test_cli_load_test_writes_one_row_per_rate(fake, tmp_path, monkeypatch):
    server = fake(sd=True, prefill_s=0.0, step_s=0.001, accept_per_step=2, api_key=SECRET)
    monkeypatch.setenv("BENCH_KEY", SECRET)
    out = tmp_path / "load.csv"
    args = parse("--url", server.url, "--model", "tiny", "--load-test", "--rates", "20,10", "--duration-s", "1",
                 "--drain-s", "5", "--draft-length", "4", "--api-key-env", "BENCH_KEY", "--workload", "code",
                 "-o", str(out))  # fmt: skip
    assert cli.run(args) == 0
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert [(r["rate"], r["sd"], r["draft_length"], r["saturated"], r["workload"]) for r in rows] == [
        ("10", "on", "4", "0", "code"), ("20", "on", "4", "0", "code"),
    ]  # fmt: skip
    assert float(rows[0]["acceptance_rate"]) == pytest.approx(0.5, abs=0.05)
    assert all(int(r["sent"]) == int(r["completed"]) > 0 for r in rows)


@pytest.mark.parametrize(
    "bad",
    [
        ["--batch-sizes", "1,x"],
        ["--phase", "decode"],
        ["--gen-tokens", "1"],
        ["--phase", "target,verify", "--draft-length", "4"],
        ["--phase", "verify"],
        ["--phase", "target", "--draft-length", "4"],
        ["--chunk-tokens", "0"],
        ["--chunk-phase-tokens", "-1"],
        ["--max-num-batched-tokens", "8"],
        ["--load-test", "--rates", "0"],
        ["--load-test", "--duration-s", "1e9"],
        ["--load-test", "--rates", "100", "--max-requests", "10"],
        ["--load-test", "--workload", "Bad Name"],
        ["--load-test", "--prefix-tokens", "-1"],
        ["--load-test", "--prefix-tokens", "512", "--prefix-groups", "0"],
        ["--api-key-env", "SD_BENCH_UNSET_VAR"],
    ],
)
def test_cli_usage_errors_are_one_line_exit_2(bad, tmp_path, capsys):
    assert cli.run(parse("--model", "tiny", "-o", str(tmp_path / "x.csv"), *bad)) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert not (tmp_path / "x.csv").exists()


def test_cli_runtime_errors_are_one_line_exit_1(fake, tmp_path, capsys):
    out = tmp_path / "y.csv"
    assert cli.run(parse("--url", "http://127.0.0.1:9", "--model", "tiny", "-o", str(out), "--timeout-s", "2")) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "GET http://127.0.0.1:9/metrics" in err
    # A server that fails mid-run: nothing is written.
    server = fake(short_by=1, prefill_s=0.0, step_s=0.0)
    assert cli.run(parse("--url", server.url, "--model", "tiny", "--iterations", "1", "-o", str(out))) == 1
    assert "server reported" in capsys.readouterr().err
    assert not out.exists()


def test_the_bench_subcommand_points_here():
    from controller.cli import SUBCOMMANDS

    assert SUBCOMMANDS["bench"][0] == "controller.commands.bench"


class GaugedVllm(FakeVllmServer):
    """The fake with vLLM 0.32's KV cache gauge (the fake's engine does not model a cache)."""

    kv_usage: float | None = 0.25

    def render(self) -> str:
        if self.kv_usage is None:  # /metrics breaks: the connection drops without an answer
            raise RuntimeError("scrape failed")
        return super().render() + (
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{engine="{self.engine}",model_name="{self.model_name}"}} {self.kv_usage}\n'
        )


def test_a_load_test_reads_the_running_context_from_the_gauges_it_scrapes():
    with GaugedVllm(sd_enabled=False) as server:
        server.cache_config = (1000, 16)
        server.prefill_s, server.step_s = 0.0, 0.001
        server.set_gauges(running=5.0)
        http = HttpServer(server.url, "tiny", 10)
        assert http.info().block_size == 16
        assert http.info().max_num_batched_tokens is None  # /metrics does not show the budget: the user says it
        assert HttpServer(server.url, "tiny", 10, max_num_batched_tokens=2048).info().max_num_batched_tokens == 2048
        rate_plan = LoadPlan(rates=(4.0,), duration_s=3.5, drain_s=5.0, workload="chat", seed=1)
        (row,) = run_load(http, lognormal_workload(8, 4, 0.0, kind="chat"), rate_plan)
        # Scraped about once a second through the probe; the warm-up's scrape left out.
        inside = [g for g in http.gauges() if 0.35 <= g.at_s <= 3.5]
        assert len(inside) >= 2 and all((g.running, g.kv_usage) == (5.0, 0.25) for g in inside)
        # A quarter of 16,000 tokens over 5 running sequences, less half a block.
        assert row.running_context_tokens == pytest.approx(0.25 * 16_000 / 5 - 7.5)


def test_a_failed_gauge_scrape_is_a_gap_not_a_failed_probe():
    with GaugedVllm(sd_enabled=False) as server:
        server.kv_usage = None
        http = HttpServer(server.url, "tiny", 10)
        results = http.probe([ProbeRequest(0.0, 8, 3), ProbeRequest(1.2, 8, 3)])
        assert [r.generated_tokens for r in results] == [3, 3]
        assert http.gauges() == []
