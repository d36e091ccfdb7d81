"""Benchmark: how long an arrival waits to be scheduled, on the truth and in the model.

The truth is the step-level vLLM simulation (controller/sim/stepsim.py, H100 roofline costs);
the model reaches it only through a calibration (default: the shipped
controller/data/truth-calibration.json, bench → calibrate against the same truth). For each case
it serves Poisson arrivals of a workload mix and prints, from the truth's own step log, the mean
wait from arrival to the first step that schedules the request, the length-weighted residual of
the step in flight (E[S²]/(2·E[S])) and half a mean step; beside them the model's wait at its
fixed point, τ/2 + λ·R(B) (docs/model.md, "A request's time in the system"), and τ/2 alone (the
model before the length-weighted term). Asserts nothing.

    python bench/bench_wait.py [--calibration FILE] [--duration 900]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from controller import calibration  # noqa: E402
from controller.acceptance import alpha_from_vllm_rate  # noqa: E402
from controller.model import Workload, curves  # noqa: E402
from controller.sim import stepsim  # noqa: E402
from controller.sim.demo_truth import truth_calibration_path  # noqa: E402
from controller.sim.fidelity import TruthServer  # noqa: E402
from controller.sim.truth_workloads import poisson_load  # noqa: E402

CASES = (("long_prompt", 4, 4.0), ("long_prompt", 4, 1.0), ("chat", 2, 10.0), ("chat", 0, 12.0))


def truth_wait(mix: str, gamma: int, rate: float, duration_s: float, seed: int = 5):
    """(mean wait, E[S²]/2E[S], mean step / 2, vLLM acceptance rate, workload) on the truth."""
    spec = TruthServer().spec(gamma)
    rng = np.random.default_rng(seed)
    reqs = poisson_load(rate, duration_s, mix, rng)
    arrival = np.array([r.send_at_s for r in reqs])
    prompt = np.array([r.prompt_tokens for r in reqs])
    gen = np.array([r.max_tokens for r in reqs])
    alpha = np.array([spec.alpha_class(r.kind).draw(rng, 1)[0] for r in reqs])
    res = stepsim.simulate(spec, arrival, prompt, gen, alpha, rng)
    warm = arrival > 0.1 * duration_s  # the first tenth fills the server
    wait = float((res.admitted_s - res.arrival_s)[warm].mean())
    steps = res.step_s
    acc = res.num_accepted_tokens / res.num_draft_tokens if res.num_draft_tokens else 0.0
    workload = Workload(float(prompt.mean()), float(gen.mean()), float(gen.std()), float(prompt.std()))
    return wait, float((steps**2).sum() / (2.0 * steps.sum())), float(steps.mean() / 2.0), acc, workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", type=Path, default=truth_calibration_path())
    ap.add_argument("--duration", type=float, default=900.0, help="seconds of arrivals per case")
    args = ap.parse_args()
    model = calibration.load(args.calibration).latency_model()
    print(f"{'case':28s} {'truth wait':>10s} {'in flight':>10s} {'½ step':>8s} | {'model':>8s} {'τ/2 only':>8s}  (ms)")
    for mix, gamma, rate in CASES:
        wait, residual, half, acc, w = truth_wait(mix, gamma, rate, args.duration)
        alpha = float(alpha_from_vllm_rate(acc, gamma)) if gamma else 0.5
        off, on = curves(model, alpha, max(gamma, 1), w)
        c = on if gamma else off
        b = c.batch(rate)
        tau, delta = c.step(b), c.prompt(b)
        model_wait = c.wait_s(rate)
        name = f"{mix} {'off' if not gamma else f'γ={gamma}'} {rate:g} req/s"
        print(
            f"{name:28s} {wait * 1e3:10.1f} {residual * 1e3:10.1f} {half * 1e3:8.1f} | "
            f"{model_wait * 1e3:8.1f} {tau / 2.0 * 1e3:8.1f}   (B {b:.1f}, τ {tau * 1e3:.1f}, Δ {delta * 1e3:.1f})"
        )


if __name__ == "__main__":
    main()
