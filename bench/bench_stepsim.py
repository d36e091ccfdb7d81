"""How fast the step-level ground truth runs: a 10-minute constant-rate load test.

    python bench/bench_stepsim.py [--rate 16] [--duration 600] [--mix chat]

Prints, for SD off and on (Llama 3.1 8B + 3.2 1B draft, γ=4, H100), the wall seconds per
simulated load test, the engine steps, and the mean latency it produced.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from controller.sim import gpu as g
from controller.sim.simserver import SimulatedServer
from controller.sim.stepsim import ServerSpec
from controller.sim.truth_workloads import poisson_load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=16.0, help="requests per second")
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    ap.add_argument("--mix", default="chat")
    args = ap.parse_args()
    reqs = poisson_load(args.rate, args.duration, args.mix, np.random.default_rng(0))
    for label, spec in (("sd off", ServerSpec()), ("sd on γ=4", ServerSpec(draft=g.LLAMA_3_2_1B, draft_length=4))):
        server = SimulatedServer(spec, seed=0)
        t0 = time.perf_counter()
        res = server.probe(reqs)
        wall_s = time.perf_counter() - t0
        lat = np.array([r.done_s - r.sent_s for r in res])
        print(
            f"{label:10s} {len(reqs)} requests at {args.rate:g} req/s for {args.duration:g} s: "
            f"{wall_s:.2f} s wall, mean latency {lat.mean():.2f} s, p99 {np.percentile(lat, 99):.2f} s"
        )


if __name__ == "__main__":
    main()
