"""bench/bench_preempted_hits.py: the truth with and without a preempted request's cached blocks."""

import re
import subprocess

from tests.support.bench_scripts import run_bench

CAPACITY = re.compile(r"^\s+(recomputed|blocks cached)\s+capacity served ([\d.]+), limit predicted", flags=re.M)


def run(*args: str) -> subprocess.CompletedProcess:
    return run_bench("bench_preempted_hits.py", "bench/results/fidelity-l40s", "--truth", "l40s", *args)


def test_cached_blocks_serve_at_least_what_recomputing_does():
    done = run("--rates", "1,4", "--duration", "300")
    assert done.returncode == 0, done.stderr
    served = dict(CAPACITY.findall(done.stdout))
    assert set(served) == {"recomputed", "blocks cached"}, done.stdout
    # 4 req/s of 4k prompts is far past this server: each truth serves its capacity there, and
    # a readmission that finds its blocks computes less.
    assert 1.0 < float(served["recomputed"]) <= float(served["blocks cached"]) < 4.0


def test_bad_rates_are_one_line():
    done = run("--rates", "1,x")
    assert done.returncode == 2
    assert "--rates: not a comma-separated list of numbers: '1,x'" in done.stderr.strip().splitlines()[-1]
