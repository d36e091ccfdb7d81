"""bench/bench_fidelity.py refuses a bad draft-length list with one line naming the option."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("value", "why"), [("3,x", "not a comma-separated list of integers"), ("3,-1", "0 (SD off) or more")]
)
def test_a_bad_draft_length_list_is_refused_before_anything_runs(tmp_path, value, why):
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "bench/bench_fidelity.py", "--draft-lengths", value, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    last = run.stderr.strip().splitlines()[-1]
    assert "--draft-lengths" in last and why in last and repr(value) in last
    assert not out.exists()  # nothing benched, nothing written
