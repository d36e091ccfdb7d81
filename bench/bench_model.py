"""Benchmark: cost of one speedup evaluation and of one full decision, on this machine.

Targets (issue: math core): <= 20 µs per single speedup evaluation, <= 1 ms per full decision
(best draft length over 1..16 plus the three break-even rates). Prints figures; asserts nothing.
A load past every capacity (the draft-length search ranks capacities there) is timed apart.
The draft-length search stops ``DRAFT_SEARCH_PATIENCE`` candidates past the best
(``best_draft_length``'s ``patience``); the exhaustive search over all 16 is timed next to it,
with how often the two choose differently over a grid of loads, acceptances and workloads and
what that costs.

The rate curves of a (model, workload, acceptance, γ) are built once and cached: "repeated" is a
further evaluation at another rate (what a tick does after its first), "fresh" pays the build
(a new workload, what the first evaluation of a tick pays).

    python bench/bench_model.py

Instruction counts (deterministic, unlike times on a shared machine): ``--loop WHAT N`` only runs
N calls of one figure; the difference between N and 0 under callgrind, divided by N, is one call:

    PYTHONHASHSEED=0 OPENBLAS_NUM_THREADS=1 valgrind --tool=callgrind --callgrind-out-file=/dev/null \
        python bench/bench_model.py --loop fresh 100
"""

from __future__ import annotations

import argparse
import math
import platform
import time

import numpy as np

from controller import calibration
from controller.model import (
    CAPACITY_SEARCH_PATIENCE,
    DRAFT_SEARCH_PATIENCE,
    Workload,
    best_draft_length,
    break_even_rates,
    predict,
    speedup_point,
    stability_limits,
)
from controller.shipped import example_calibration_path


def per_call(fn, number: int, repeat: int = 7) -> float:
    """Best-of-``repeat`` mean seconds per call (the least disturbed run)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t0) / number)
    return best


def loop(what: str, n: int) -> None:
    """``n`` calls of one figure, untimed (for an instruction counter)."""
    model = calibration.load(example_calibration_path()).latency_model()
    w = Workload(1000, 280, 200.0, 500.0)
    fresh = [Workload(1000 + i * 1e-6, 280, 200.0, 500.0) for i in range(n)]
    speedup_point(model, 6.0, 0.7, 4, w)
    for fw in fresh:
        if what in ("fresh", "repeated"):
            speedup_point(model, 6.0, 0.7, 4, fw if what == "fresh" else w)
        else:
            dw = fw if what.startswith("fresh-decision") else w
            patience = None if what.endswith("exhaustive") else DRAFT_SEARCH_PATIENCE
            rate = 30.0 if what.endswith("overloaded") else 6.0
            choice = best_draft_length(model, rate, 0.7, dw, patience=patience)
            break_even_rates(model, 0.7, choice.draft_length, dw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--loop",
        nargs=2,
        metavar=("WHAT", "N"),
        help="fresh|repeated|decision|fresh-decision[-exhaustive|-overloaded], calls",
    )
    args = parser.parse_args()
    if args.loop:
        loop(args.loop[0], int(args.loop[1]))
        return
    cal = calibration.load(example_calibration_path())
    model = cal.latency_model()
    w = Workload(1000, 280, 200.0, 500.0)
    print(f"python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}")

    t = per_call(lambda: speedup_point(model, 6.0, 0.7, 4, w), 5000)
    print(f"speedup evaluation, repeated (curves cached):     {t * 1e6:8.2f} µs   target <= 20 µs")

    counter = iter(range(10**9))

    def fresh_workload() -> Workload:
        return Workload(1000 + next(counter) * 1e-6, 280, 200.0, 500.0)

    t = per_call(lambda: speedup_point(model, 6.0, 0.7, 4, fresh_workload()), 2000)
    print(f"speedup evaluation, fresh workload (curves built): {t * 1e6:8.2f} µs")

    rates = np.linspace(0.0, 20.0, 20_000)
    t = per_call(lambda: predict(model, rates, 0.7, 4, w), 1, repeat=3)
    print(f"vectorized API, 20k rates in one call:            {t / rates.size * 1e6:8.3f} µs per point")

    def decision() -> None:
        choice = best_draft_length(model, 6.0, 0.7, w)
        break_even_rates(model, 0.7, choice.draft_length, w)

    t = per_call(decision, 300)
    print(f"full decision, repeated (best γ + 3 break-evens):  {t * 1e6:8.2f} µs   target <= 1000 µs")

    def fresh_decision() -> None:
        fw = fresh_workload()
        choice = best_draft_length(model, 6.0, 0.7, fw)
        break_even_rates(model, 0.7, choice.draft_length, fw)

    t = per_call(fresh_decision, 100)
    print(f"full decision, fresh workload:                    {t * 1e6:8.2f} µs   target <= 1000 µs")

    def fresh_exhaustive() -> None:
        fw = fresh_workload()
        choice = best_draft_length(model, 6.0, 0.7, fw, patience=None)
        break_even_rates(model, 0.7, choice.draft_length, fw)

    t = per_call(fresh_exhaustive, 100)
    print(f"full decision, fresh workload, all 16 γ tried:    {t * 1e6:8.2f} µs")

    def fresh_overloaded() -> None:  # 30 req/s: past SD's capacity at every γ and past plain decoding's
        fw = fresh_workload()
        choice = best_draft_length(model, 30.0, 0.7, fw)
        break_even_rates(model, 0.7, choice.draft_length, fw)

    t = per_call(fresh_overloaded, 100)
    print(f"full decision, fresh workload, past every limit:  {t * 1e6:8.2f} µs")
    search_agreement(model)


def search_agreement(model) -> None:
    """How often stopping past the best chooses another γ than trying all, and the SD latency
    that costs, over loads (fractions of the plain limit, past it too), acceptances and workloads."""
    differ = total = overloaded = 0
    worst = 1.0
    for alpha in (0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95):
        for w in (Workload(200, 100, 80.0, 140.0), Workload(1000, 280, 280.0, 600.0), Workload(4000, 500)):
            limit = stability_limits(model, alpha, 1, w)[0]
            for f in (0.0, 0.1, 0.3, 0.5, 0.7, 0.85, 0.95, 1.3, 2.0):
                quick = best_draft_length(model, f * limit, alpha, w)
                full = best_draft_length(model, f * limit, alpha, w, patience=None)
                total += 1
                overloaded += math.isinf(full.latency_on_s)
                if quick.draft_length != full.draft_length:
                    differ += 1
                    worst = max(worst, quick.latency_on_s / full.latency_on_s)
    print(
        f"draft-length search stopping {DRAFT_SEARCH_PATIENCE} past the best ({CAPACITY_SEARCH_PATIENCE} past the best"
        f" capacity where capacity decides): {differ} of {total} choices differ from trying all"
        f" ({overloaded} overloaded at every γ); SD latency at most {(worst - 1) * 100:.2f} % above the exhaustive"
        " choice's"
    )


if __name__ == "__main__":
    main()
