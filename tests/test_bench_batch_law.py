"""bench/bench_batch_law.py: the truth's law of requests running against the model's, from a stored run."""

import re
import subprocess

from tests.support.bench_scripts import run_bench

STORED = "bench/results/fidelity-h100"


def run(*args: str) -> subprocess.CompletedProcess:
    return run_bench("bench_batch_law.py", STORED, "--truth", "h100", "--workload", "chat", *args)


def test_both_laws_are_probabilities_and_the_truths_mean_is_littles():
    done = run("--rate", "4", "--duration", "300")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    truth_s = float(re.search(r"truth: mean ([\d.]+) s", out).group(1))
    truth_n = float(re.search(r"truth mean ([\d.]+) \(sd [\d.]+\), model ([\d.]+)", out).group(1))
    bins = re.findall(r"^\s+\d+-\d+\s+truth\s+([\d.]+)\s+model\s+([\d.]+)", out, flags=re.M)
    truth_law, model_law = (sum(float(b[i]) for b in bins) for i in (0, 1))
    assert abs(truth_law - 1.0) < 0.01 and abs(model_law - 1.0) < 0.01, bins
    # Little: the running gauge weighted by step time holds λ·T (no queue at a quarter of the limit).
    assert abs(truth_n / (4.0 * truth_s) - 1.0) < 0.1, (truth_n, truth_s)
    steps = re.findall(r"^\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+[+-][\d.]+ %$", out, flags=re.M)
    assert steps, out  # decode steps were listed, each with the truth's and the model's cost
    assert all(0.5 < float(m) / float(t) < 2.0 for _b, _n, t, m in steps)
    # Mixed steps by their prompt tokens: four quartile bins, each the truth's and the fit's cost
    # a token, and the fit's error that pair gives.
    chunks = re.findall(r"^\s+(\d+)-(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([+-][\d.]+) %$", out, flags=re.M)
    assert len(chunks) == 4, out
    for lo, hi, _n, mean, truth_us, fit_us, err in chunks:
        assert int(lo) <= int(mean) <= int(hi)
        truth, fit = float(truth_us), float(fit_us)
        # Each figure printed to 0.05 of its last digit: the error they give may differ by that.
        rounding = 100 * 0.05 * (1 / truth + fit / truth**2) + 0.05
        assert abs(100 * (fit / truth - 1) - float(err)) < rounding + 1e-9


def test_a_rate_the_load_csv_never_ran_is_one_line():
    done = run("--rate", "4.5", "--duration", "60")
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == ("bench_batch_law: load-chat.csv has no row at γ=0, 4.5 req/s")
