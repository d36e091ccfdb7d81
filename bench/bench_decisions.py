"""Decision quality: the controller against static choices and a hindsight oracle.

For each built-in benchmark scenario it runs, on the same arrivals (same seed):
always-on, always-off, a static threshold on running requests, the real controller (with the
switch-cost gate on and off: Settings.price_switches) and the hindsight oracle (best state per
minute with switching costs, replayed through the simulator). Prints a markdown table of mean
and p99 latency relative to the oracle, and toggles.

    python bench/bench_decisions.py [--scenarios diurnal,spike] [--calibration example]
"""

from __future__ import annotations

import argparse
import logging
import time

import structlog

from controller import calibration
from controller.model import Workload, predict_point
from controller.shipped import calibration_path
from controller.sim import runner, scenarios
from controller.sim.oracle import run_oracle
from controller.sim.workload import mean_lengths

SCENARIOS = (
    "diurnal", "step-up", "step-down", "spike", "acceptance-drift",
    "oscillating", "long-context", "always-low", "always-overloaded",
)  # fmt: skip
WARMUP_S = 300.0


def threshold_for(model, sc) -> float:
    """Running requests (SD off) at the model's break-even rate: the rule an operator would
    derive by hand."""
    from controller.model import break_even_rates

    p, g = mean_lengths(list(sc.classes))
    be = break_even_rates(model, 0.8, sc.engine.draft_length, Workload(p, g))[1.0].rate_rps
    if be is None:
        return float(model.max_num_seqs)
    return predict_point(model, be, 0.8, sc.engine.draft_length, Workload(p, g)).batch_off


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--calibration", default="example")
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    model = calibration.load(calibration_path(args.calibration)).latency_model()
    settings_fields = type(runner.default_settings()).model_fields
    variants = [("controller", {})]
    if "price_switches" in settings_fields:
        variants.append(("controller, no switch pricing", {"price_switches": False}))
    rows = []
    started = time.perf_counter()
    for name in args.scenarios.split(","):
        sc = scenarios.load(name)
        t0 = time.perf_counter()
        on = runner.run_static(sc, model, True, warmup_s=WARMUP_S)
        off = runner.run_static(sc, model, False, warmup_s=WARMUP_S)
        oracle = run_oracle(sc, model, on, off)
        oracle.warmup_s = WARMUP_S
        thr = threshold_for(model, sc)
        results = {
            "oracle": oracle,
            "always-on": on,
            "always-off": off,
            f"threshold (running<{thr:.0f})": runner.run_threshold(sc, model, thr, warmup_s=WARMUP_S),
        }
        for label, overrides in variants:
            results[label] = runner.run_controller(sc, model, runner.default_settings(**overrides), warmup_s=WARMUP_S)
        ref = oracle.summary()
        for label, r in results.items():
            s = r.summary()
            rows.append((name, label, s["mean_latency_s"], s["mean_latency_s"] / ref["mean_latency_s"],
                         s["p99_latency_s"], s["p99_latency_s"] / ref["p99_latency_s"], int(s["toggles"]), int(s["lost"])))  # fmt: skip
        print(f"# {name}: {time.perf_counter() - t0:.0f} s", flush=True)
    print()
    print("| scenario | policy | mean latency s | ÷ oracle | p99 s | ÷ oracle | toggles | lost |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, label, mean, rm, p99, rp, toggles, lost in rows:
        print(f"| {name} | {label} | {mean:.2f} | {rm:.2f} | {p99:.1f} | {rp:.2f} | {toggles} | {lost} |")
    print(
        f"\n(total {time.perf_counter() - started:.0f} s; latency of every request after {WARMUP_S:.0f} s "
        "warm-up, unfinished ones counted up to the end)"
    )


if __name__ == "__main__":
    main()
