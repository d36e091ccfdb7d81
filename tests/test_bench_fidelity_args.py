"""bench/bench_fidelity.py refuses a bad option with one line naming it, before anything runs."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
    run = subprocess.run(
        [sys.executable, "bench/bench_fidelity.py", option, value, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    last = run.stderr.strip().splitlines()[-1]
    assert option in last and why in last and value in last
    assert not out.exists()  # nothing benched, nothing written
