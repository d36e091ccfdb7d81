"""Benchmark: cost of one speedup evaluation and of one full decision, on this machine.

Targets (issue: math core): <= 20 µs per single speedup evaluation, <= 1 ms per full decision
(best draft length over 1..16 plus the three break-even rates). Prints figures; asserts nothing.

    python bench/bench_model.py
"""

from __future__ import annotations

import platform
import time

import numpy as np

from controller import calibration
from controller.commands._common import example_calibration_path
from controller.model import Workload, best_draft_length, break_even_rates, predict, speedup_point


def per_call(fn, number: int, repeat: int = 7) -> float:
    """Best-of-``repeat`` mean seconds per call (the least disturbed run)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t0) / number)
    return best


def main() -> None:
    cal = calibration.load(example_calibration_path())
    model = cal.latency_model()
    w = Workload(512, 256)
    print(f"python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}")

    t = per_call(lambda: speedup_point(model, 6.0, 0.7, 4, w), 5000)
    print(f"single speedup evaluation (scalar, knees in the calibration): {t * 1e6:8.2f} µs   target <= 20 µs")

    rates = np.linspace(0.0, 20.0, 100_000)
    t = per_call(lambda: predict(model, rates, 0.7, 4, w), 3, repeat=3)
    print(f"vectorized, 100k rates in one call:                  {t / rates.size * 1e6:8.3f} µs per point")

    t = per_call(lambda: predict(model, 6.0, 0.7, 4, w), 500)
    print(f"vectorized API called on one point:                  {t * 1e6:8.2f} µs")

    def decision() -> None:
        choice = best_draft_length(model, 6.0, 0.7, w)
        break_even_rates(model, 0.7, choice.draft_length, w)

    t = per_call(decision, 300)
    print(f"full decision (best γ over 1..16 + 3 break-evens):   {t * 1e6:8.2f} µs   target <= 1000 µs")


if __name__ == "__main__":
    main()
