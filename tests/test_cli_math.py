"""`sd-controller predict` and `calibrate` as a user runs them."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from controller.cli import main
from controller.model import LatencyModel, StepCost
from controller.synthetic import bench_rows, write_bench_csv

TRUE = LatencyModel(
    target=StepCost(0.0065, 9.0e-5, (), (), 4.0e-8),
    draft=StepCost(0.0008, 4.0e-6),
)


def test_predict_json_fields(capsys):
    rc = main(["predict", "--json", "--rates", "1,4,40", "--draft-lengths", "2,4", "--acceptance-rate", "0.6"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["calibration"]["example"] is True
    assert len(out["points"]) == 6
    p = out["points"][0]
    assert set(p) >= {"rate_rps", "draft_length", "speedup", "latency_off_s", "latency_on_s", "batch_off", "batch_on"}
    assert p["speedup"] > 1.2  # low load: SD pays on the example
    # At 40 req/s the example server is overloaded: stated, and JSON stays valid (null, not NaN).
    last = out["points"][-1]
    assert last["overloaded_off"] and last["latency_off_s"] is None
    assert {b["threshold"] for b in out["break_even"]} == {1.0, 1.05, 1.2}
    assert out["stability_limit_rps"]["off"] > 0
    assert out["stability_limit_reason"] == {"off": "max_num_seqs", "on": {"2": "max_num_seqs", "4": "max_num_seqs"}}
    assert len(out["best_draft_length"]) == 3
    assert out["inputs"]["alpha"] > 0.6  # vLLM's rate at γ = 4 understates per-token α


def test_predict_prices_prefix_cache_hits(capsys):
    def limits(*extra):
        args = ["predict", "--json", "--rates", "1", "--draft-lengths", "4", "--prompt-tokens", "2000", *extra]
        assert main(args) == 0
        out = json.loads(capsys.readouterr().out)
        return out["stability_limit_rps"]["off"], out["inputs"]["cached_prompt_tokens"]

    full, none = limits()
    cached, hits = limits("--cached-prompt-tokens", "1500")
    assert (none, hits) == (0.0, 1500.0)
    assert cached > full  # 500 tokens a prefill instead of 2000: more capacity


def test_predict_table_and_plot(tmp_path, capsys):
    png = tmp_path / "speedup.png"
    assert main(["predict", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "break-even" in out and "EXAMPLE" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--acceptance-rate", "1.5"], "--acceptance-rate: 1.5 must be within [0, 1]"),
        (["--calibration", "/nonexistent/cal.json"], "cannot read calibration file"),
        (["--cached-prompt-tokens", "600"], "--cached-prompt-tokens: 600 must be within [0, --prompt-tokens]"),
    ],
)
def test_predict_bad_input_exit_2(args, message, capsys):
    assert main(["predict", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_calibrate_writes_and_reports(tmp_path, capsys):
    src = tmp_path / "bench.csv"
    write_bench_csv(bench_rows(TRUE, batch_sizes=(1, 2, 4, 8, 16, 32, 64), seed=3), src)
    out = tmp_path / "cal.json"
    assert main(["calibrate", str(src), "-o", str(out), "--gpu", "test-gpu"]) == 0
    text = capsys.readouterr().out
    assert "fit quality" in text and "draft" in text and "prediction intervals" in text
    cal = json.loads(out.read_text())
    assert cal["metadata"]["gpu"] == "test-gpu"
    assert cal["phases"]["draft"]["fit"]["r2"] > 0.95
    # The fitted file drives predict.
    assert main(["predict", "--calibration", str(out), "--json"]) == 0


def test_calibrate_prefix_caching_from_the_bench_or_the_flag(tmp_path, capsys):
    # The bench of a server that caches prefixes says so; --prefix-caching overrides it (a server
    # relaunched since, or a bench from before it said anything), and the report prints it.
    src = tmp_path / "bench.csv"
    caching = replace(TRUE, prefix_caching=True, kv_cache_tokens_off=100_000)
    write_bench_csv(bench_rows(caching, batch_sizes=(1, 2, 4, 8, 16, 32, 64), seed=3), src)
    out = tmp_path / "cal.json"
    for flag, expected, shown in (([], True, "prefix caching on"), (["--prefix-caching", "off"], False, "caching off")):
        assert main(["calibrate", str(src), "-o", str(out), *flag]) == 0
        assert shown in capsys.readouterr().out
        assert json.loads(out.read_text())["serving"]["prefix_caching"] is expected


def test_calibrate_bad_csv_writes_nothing(tmp_path):
    src = tmp_path / "bench.csv"
    src.write_text("phase,batch_size,tokens_per_seq,context_len,iteration,latency_s\ntarget,1,1,10,0,abc\n")
    out = tmp_path / "cal.json"
    # A real process: the console entry point's exit code and stderr.
    proc = subprocess.run(
        [sys.executable, "-m", "controller.cli", "calibrate", str(src), "-o", str(out)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "bench.csv:2: column latency_s: 'abc' is not a number" in proc.stderr
    assert proc.stderr.count("\n") == 1
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [src]  # no temp file left behind either
