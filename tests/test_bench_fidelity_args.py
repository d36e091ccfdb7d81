"""bench/bench_fidelity.py refuses a bad option with one line naming it, before anything runs."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def bench_fidelity(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "bench/bench_fidelity.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("option", "value", "why"),
    [
        ("--draft-lengths", "3,x", "not a comma-separated list of integers"),
        ("--draft-lengths", "3,-1", "0 (SD off) or more"),
        ("--max-num-batched-tokens", "64", "at least 256 tokens"),
    ],
)
def test_a_bad_option_is_refused_before_anything_runs(tmp_path, option, value, why):
    out = tmp_path / "out"
    run = bench_fidelity(option, value, "--out", str(out))
    assert run.returncode == 2
    last = run.stderr.strip().splitlines()[-1]
    assert option in last and why in last and value in last
    assert not out.exists()  # nothing benched, nothing written


def test_recalibrate_needs_revalidate(tmp_path):
    run = bench_fidelity("--recalibrate", str(tmp_path))
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].endswith("--recalibrate: only with --revalidate DIR")


def test_recalibrate_refuses_bench_csvs_the_calibration_was_not_made_from(tmp_path):
    # A directory of one truth's runs and another truth's bench: one line, nothing rewritten.
    work = tmp_path / "runs"
    work.mkdir()
    stored = ROOT / "bench/results/fidelity-a100-coarse-prefix"
    for name in ("calibration.json", "load-agent.csv"):
        (work / name).write_bytes((stored / name).read_bytes())
    before = (work / "calibration.json").read_bytes()
    run = bench_fidelity("--revalidate", str(work), "--recalibrate", "bench/results/fidelity-h100")
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("bench_fidelity: bench/results/fidelity-h100: its bench CSVs") and "not the ones" in last
    assert (work / "calibration.json").read_bytes() == before
