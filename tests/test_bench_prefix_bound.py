"""bench/bench_prefix_bound.py: the KV bound with many prefixes, set beside what the truth served."""

import re
import subprocess

from tests.support.bench_scripts import run_bench

LINE = re.compile(
    r"^\s+([\d.]+) req/s: served\s+([\d.]+)\s.*limit ([\d.]+)-([\d.]+), as measured ([\d.]+)-([\d.]+)$", flags=re.M
)


def run(*args: str) -> subprocess.CompletedProcess:
    return run_bench("bench_prefix_bound.py", "--truth", "l40s", *args)


def test_the_measured_context_bounds_no_higher_than_the_capped_one():
    done = run("--case", "8x1024:1,8", "--duration", "240")
    assert done.returncode == 0, done.stderr
    rows = [tuple(map(float, m)) for m in LINE.findall(done.stdout)]
    assert len(rows) == 2, done.stdout
    (rate, served, *_), (_, overloaded, *_) = rows
    assert abs(served / rate - 1.0) < 0.15  # a light load is served as offered
    assert overloaded < 8.0  # past capacity: the server finishes what it can
    for *_, lo, hi, measured_lo, measured_hi in rows:
        # A light load spreads each prefix over few sequences: that context bounds the batch lower.
        assert lo <= hi and measured_lo <= lo + 1e-9 and measured_hi <= hi + 1e-9


def test_a_bad_case_is_one_line():
    done = run("--case", "8x:1")
    assert done.returncode == 2
    assert "--case '8x:1': want GROUPSxTOKENS:RATE,RATE,..." in done.stderr.strip().splitlines()[-1]
