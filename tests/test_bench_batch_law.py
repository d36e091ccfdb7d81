"""bench/bench_batch_law.py: the truth's law of requests running against the model's, from a stored run."""

import importlib.util
import re
import subprocess

import numpy as np

from tests.support.bench_scripts import ROOT, run_bench

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


def _module(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # it imports bench_fidelity beside it
    spec = importlib.util.spec_from_file_location("bench_batch_law", ROOT / "bench" / "bench_batch_law.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _mean_var(law: np.ndarray) -> tuple[float, float]:
    n = np.arange(law.size)
    mean = float(law @ n)
    return mean, float(law @ (n - mean) ** 2)


def test_departures_by_state_counts_the_time_held_and_the_completions_out_of_each_n(monkeypatch):
    mod = _module(monkeypatch)
    # Arrivals at 0, 1, 2, finishes at 3, 4, 2.5: n is 1 on [0, 1), 2 on [1, 2), 3 on [2, 2.5),
    # 2 on [2.5, 3), 1 on [3, 4), 0 on [4, 5).
    arrival, finish = np.array([0.0, 1.0, 2.0]), np.array([3.0, 4.0, 2.5])
    seconds, done = mod.departures_by_state(arrival, finish, 0.0, 5.0)
    np.testing.assert_allclose(seconds, [1.0, 2.0, 1.5, 0.5])
    np.testing.assert_array_equal(done, [0, 1, 1, 1])  # one completion out of each of 3, 2 and 1
    # A window that starts late counts only what it sees: [2.2, 3.5).
    seconds, done = mod.departures_by_state(arrival, finish, 2.2, 3.5)
    np.testing.assert_allclose(seconds, [0.0, 0.5, 0.5, 0.3])
    np.testing.assert_array_equal(done, [0, 0, 1, 1])


def test_completions_by_requests_in_the_server_are_listed_beside_the_steps_and_the_chains():
    done = run("--rate", "10", "--duration", "600")
    assert done.returncode == 0, done.stderr
    head = re.search(r"arrived, not finished\): truth mean ([\d.]+) \(sd ([\d.]+)\), chain ([\d.]+)", done.stdout)
    assert head, done.stdout
    bands = re.findall(r"^\s+(\d+)-(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", done.stdout, flags=re.M)
    assert len(bands) >= 4, done.stdout
    assert sum(float(b[2]) for b in bands) <= 1.0 + 1e-3
    for _lo, _hi, _share, truth, steps, chain in bands:
        # Each band's completions are near what its own steps give, and the chain's near both.
        assert 0.7 < float(truth) / float(steps) < 1.3 and 0.7 < float(chain) / float(steps) < 1.3
    # The bursts' law beside the chain's: prompts that stall the batch widen it.
    bursts = re.search(
        r"bursts \(prefill share λ·Δ ([\d.]+), length overlap κ ([\d.]+), ratio r ([\d.]+)\): "
        r"([\d.]+) \(sd ([\d.]+)\); the chain ([\d.]+) \(sd ([\d.]+)\)",
        done.stdout,
    )
    assert bursts, done.stdout
    share, overlap, ratio, _mean, sd, _chain_mean, chain_sd = map(float, bursts.groups())
    assert 0.1 < share < 0.9 and 0.3 < overlap < 1.0 and 0.0 < ratio < 1.0
    assert float(sd) > float(chain_sd)


def test_length_overlap_is_how_long_two_requests_stay_together(monkeypatch):
    mod = _module(monkeypatch)
    assert mod.length_overlap(280.0, 0.0) == 1.0  # equal lengths leave together
    assert abs(mod.length_overlap(280.0, 280.0) - 0.5) < 1e-6  # exponential: E[min] = E/2
    # Gamma of shape 2 (mean 1, rate 2): ∫ ((1 + 2x)·e^(−2x))² dx = 1/4 + 1/4 + 1/8.
    assert abs(mod.length_overlap(1.0, 1.0 / np.sqrt(2.0)) - 0.625) < 1e-5
    # The closed form against E[min(S₁, S₂)]/E[S] drawn, for a shape above 1 and one below.
    rng = np.random.default_rng(3)
    for cv in (0.5, 1.5):
        shape = 1.0 / cv**2
        s1, s2 = (rng.gamma(shape, 280.0 / shape, 400_000) for _ in range(2))
        drawn = float(np.minimum(s1, s2).mean()) / 280.0
        assert abs(mod.length_overlap(280.0, 280.0 * cv) - drawn) < 0.006, (cv, drawn)


def test_burst_ratio_matches_the_borel_familys_index(monkeypatch):
    mod = _module(monkeypatch)
    assert mod.burst_ratio(0.0, 0.7) == 0.0  # no prefill, no bursts
    # Memoryless departures (κ = 1/2): the geometric index (1 + r)/(1 − r) is the Borel's 1/(1 − p)².
    r = mod.burst_ratio(0.4, 0.5)
    assert abs((1.0 + r) / (1.0 - r) - 1.0 / 0.6**2) < 1e-12
    assert mod.burst_ratio(0.4, 1.0) > r > mod.burst_ratio(0.4, 0.3)  # lengths that stay together widen it


def test_burst_law_without_bursts_is_the_chains_and_with_them_widens_an_infinite_server(monkeypatch):
    from controller.queueing import cumulative_log_rates, stationary_law

    mod = _module(monkeypatch)
    # A chain that flattens, its queue served at 2.0 req/s: without bursts or prompts the law is
    # queueing.stationary_law's (its geometric queue, here written out state by state).
    h = np.minimum(np.arange(1.0, 41.0) * 0.1, 2.0)
    law, past = stationary_law(1.2, cumulative_log_rates(h), 2.0)
    bursts = mod.burst_law(1.2, h, np.zeros(h.size), 0.0, 2.0, 400)
    np.testing.assert_allclose(bursts[: h.size + 1], law, rtol=1e-9)
    assert abs(bursts[h.size + 1 :].sum() - past) < 1e-9
    # An infinite server whose T(B) = a + (B + 1)·Δ (its decode, its own prompt and B others'):
    # with the others' prompts as stalls at λ it is an infinite server of rate (1 − λΔ)/(a + Δ),
    # its mean the fixed point λ·(a + Δ)/(1 − λΔ) whatever the bursts, and geometric bursts
    # of ratio r make Var/E = 1/(1 − r) (M^X/M/∞: (1 + E[X²]/E[X])/2).
    a, delta, rate = 2.0, 0.05, 6.0
    n = np.arange(1.0, 801.0)
    h = n / (a + n * delta)
    fixed_point = rate * (a + delta) / (1.0 - rate * delta)
    for r in (0.0, 0.5):
        mean, var = _mean_var(mod.burst_law(rate, h, np.full(h.size, delta), r, float(h[-1]), 0))
        assert abs(mean / fixed_point - 1.0) < 1e-9, (r, mean, fixed_point)
        assert abs(var / mean - 1.0 / (1.0 - r)) < 1e-9, (r, var / mean)
