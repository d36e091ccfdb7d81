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
    # Every step of the window priced by the calibration: the stored calibration reproduces the
    # truth's steps to a few per cent, in all and in each band of decoders printed.
    priced = re.search(r"priced by the calibration's passes: (\d+) steps, [\d.]+ s, error\s+([+-][\d.]+) %", out)
    assert priced is not None, out
    assert int(priced.group(1)) > 1000 and abs(float(priced.group(2))) < 3.0, priced.group(0)
    bands = re.findall(r"^\s+\d+-\d+\s+\d+\s+([+-][\d.]+) %\s+([+-][\d.]+ %|-)$", out, flags=re.M)
    assert bands, out
    assert all(abs(float(d)) < 5.0 for d, _p in bands)
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


def test_a_step_is_priced_by_the_calibrations_passes(monkeypatch):
    """calibrated_step_s against the truth's own step: a decode batch, then the same batch with
    a prompt beside it, on the stored H100 calibration (SD off and γ = 2)."""
    mod = _module(monkeypatch)
    from controller import calibration
    from controller.sim import fidelity
    from controller.sim.stepsim import StepView, step_time_s

    lm = calibration.load(ROOT / STORED / "calibration.json").latency_model()
    for gamma in (0, 2):
        spec = fidelity.TruthServer().spec(gamma)
        per_seq = gamma + 1
        q, ctx = np.full(64, per_seq), np.full(64, 1000)
        with_prompt = (np.append(q, 900), np.append(ctx, 0))
        truth, model = [], []
        for qq, cc in ((q, ctx), with_prompt):
            prefill = cc == 0
            drafting = np.ones(qq.size, dtype=bool)
            truth.append(step_time_s(spec, qq, cc, np.where(prefill, 1, qq), bool(gamma), drafting))
            model.append(mod.calibrated_step_s(lm, gamma, StepView(qq, cc, prefill, drafting, truth[-1])))
        assert abs(model[0] / truth[0] - 1) < 0.03, (gamma, model, truth)
        assert abs((model[1] - model[0]) / (truth[1] - truth[0]) - 1) < 0.1, (gamma, model, truth)
