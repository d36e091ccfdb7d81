"""How fast the simulator runs: a simulated day at 1 s ticks, with SD off, on, and with the
metrics rendered every 15 simulated seconds (what a scraper would cost).

    python bench/bench_sim_speed.py [--hours 24] [--peak 14]

Prints simulated seconds per wall second and the wall time per simulated day.
"""

from __future__ import annotations

import argparse
import time

from controller.calibration import load
from controller.shipped import example_calibration_path
from controller.sim.engine import Engine
from controller.sim.scenarios import Scenario


def day(hours: float, peak: float, sd: bool) -> Scenario:
    return Scenario.model_validate(
        {
            "name": "bench-day",
            "duration_s": hours * 3600,
            "arrival_rate": {"kind": "diurnal", "min": 1.0, "max": peak, "period_s": 86400, "peak_at_s": 14 * 3600},
            "acceptance": {"kind": "constant", "value": 0.8},
            "classes": [
                {
                    "prompt_tokens": {"kind": "lognormal", "mean": 512, "sigma": 0.8, "max": 8192},
                    "gen_tokens": {"kind": "lognormal", "mean": 256, "sigma": 0.6, "max": 2048},
                }
            ],
            "engine": {"initial_sd": sd},
        }
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--peak", type=float, default=13.0, help="peak arrival rate, req/s")
    args = ap.parse_args()
    model = load(example_calibration_path()).latency_model()
    sim_s = args.hours * 3600
    print(f"simulated {args.hours:g} h at 1 s ticks, diurnal 1..{args.peak:g} req/s, example calibration")
    print(f"{'run':<28}{'wall s':>9}{'sim s / wall s':>16}{'requests':>11}{'wall s per 24 h':>17}")
    for label, sd, scrape in (
        ("SD off", False, False),
        ("SD on", True, False),
        ("SD on, /metrics every 15 s", True, True),
    ):
        engine = Engine(day(args.hours, args.peak, sd), model)
        start = time.perf_counter()
        if scrape:
            t = 0.0
            while t < sim_s:
                t += 15.0
                engine.advance_to(t)
                engine.render_metrics()
        else:
            engine.advance_to(sim_s)
        wall = time.perf_counter() - start
        print(f"{label:<28}{wall:>9.1f}{sim_s / wall:>16.0f}{engine.arrived:>11}{wall * 86400 / sim_s:>17.1f}")


if __name__ == "__main__":
    main()
