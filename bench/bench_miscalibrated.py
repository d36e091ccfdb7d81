"""Decisions with a wrong calibration: does the online correction bring them back?

Issue "close the loop": with calibrations off by ×0.7 and ×1.4 on the load-dependent costs,
and with the shipped example calibration (made for another GPU), the controller's decisions
over the scenario set should be within 5 % of those it makes with the true calibration, as
mean latency ÷ the start-aware oracle.

The server is the GPU-roofline truth (never the controller's model), as in
bench/bench_decisions.py, whose decisions.json gives the oracle and the true-calibration
controller for each scenario and start state; this bench runs only the controller again, once
per wrong calibration, on the same arrivals. Prints a markdown table and writes
miscalibrated.json next to ``--out``.

    python bench/bench_miscalibrated.py --decisions bench-out/decisions [--max-hours 3] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import structlog

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

TARGET = 0.05  # within 5 % of the true calibration's ratio to the oracle
LOAD_SCALED = {"load costs ×0.7": (1.0, 0.7, 1.0, 0.7), "load costs ×1.4": (1.0, 1.4, 1.0, 1.4)}
EXAMPLE = "example calibration"


def believed_models(true_cal: Path) -> dict:
    from controller import calibration
    from controller.correction import scaled_model
    from controller.shipped import example_calibration_path

    true = calibration.load(true_cal).latency_model()
    models = {label: scaled_model(true, f) for label, f in LOAD_SCALED.items()}
    models[EXAMPLE] = calibration.load(example_calibration_path()).latency_model()
    return models


def run_one(name: str, start_on: bool, label: str, true_cal: str) -> tuple[str, bool, str, float, int]:
    """Worker: the real controller on the truth, believing the ``label`` calibration."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    from controller.sim import decisions, runner

    sc = decisions.load_scenario(name).with_changes(engine={"initial_sd": start_on})
    model = believed_models(Path(true_cal))[label]
    r = runner.run_controller(
        sc, decisions.truth_costs(), runner.default_settings(), controller_model=model, warmup_s=decisions.WARMUP_S
    )
    return name, start_on, label, float(r.summary()["mean_latency_s"]), int(r.toggles)


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decisions", required=True, help="bench_decisions output directory (decisions.json, calibration.json)")
    ap.add_argument("--max-hours", type=float, default=3.0, help="skip scenarios longer than this (default 3)")
    ap.add_argument("--scenarios", default=None, help="comma-separated names (default: all in decisions.json)")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    src = Path(args.decisions)
    try:
        done = json.loads((src / "decisions.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        print(f"--decisions {src}: cannot read decisions.json: {exc}", file=sys.stderr)
        return 2
    true_cal = src / "calibration.json"
    picked = set(args.scenarios.split(",")) if args.scenarios else None
    rows = [
        r
        for r in done["scenarios"]
        if r["duration_s"] <= args.max_hours * 3600 and (picked is None or r["name"] in picked)
    ]
    labels = [*LOAD_SCALED, EXAMPLE]
    started = time.perf_counter()
    jobs = [(r["name"], s["start"] == "on", label) for r in rows for s in r["starts"] for label in labels]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        got = list(pool.map(run_one, *zip(*jobs, strict=True), [str(true_cal)] * len(jobs)))
    result = {(n, on, label): (lat, toggles) for n, on, label, lat, toggles in got}

    print("| scenario | start | true calibration | " + " | ".join(labels) + " |")
    print("|---|---|---:|" + "---:|" * len(labels))
    ratios: dict[str, list[float]] = {"true calibration": [], **{label: [] for label in labels}}
    out_rows = []
    for r in rows:
        for s in r["starts"]:
            on = s["start"] == "on"
            oracle = s["oracle"]["mean_latency_s"]
            true_ratio = s["controller"]["mean_latency_s"] / oracle
            ratios["true calibration"].append(true_ratio)
            cells = [f"{true_ratio:.2f} ({s['controller']['toggles']})"]
            row = {"scenario": r["name"], "start": s["start"], "true calibration": true_ratio}
            for label in labels:
                lat, toggles = result[(r["name"], on, label)]
                ratios[label].append(lat / oracle)
                cells.append(f"{lat / oracle:.2f} ({toggles})")
                row[label] = lat / oracle
                row[f"{label} toggles"] = toggles
            out_rows.append(row)
            print(f"| {r['name']} | {s['start']} | " + " | ".join(cells) + " |")
    g_true = geomean(ratios["true calibration"])
    print(f"\ngeometric mean of ctl ÷ oracle over {len(out_rows)} rows: true calibration {g_true:.3f}")
    summary = {"true calibration": g_true}
    for label in labels:
        g = geomean(ratios[label])
        summary[label] = g
        verdict = "within" if abs(g / g_true - 1) <= TARGET else "NOT within"
        print(f"  {label}: {g:.3f} ({(g / g_true - 1) * 100:+.1f} %, {verdict} {TARGET * 100:.0f} %)")
    (src / "miscalibrated.json").write_text(
        json.dumps({"rows": out_rows, "geomean": summary, "wall_s": time.perf_counter() - started}, indent=2) + "\n",
        encoding="utf-8",
    )
    print(f"wrote {src / 'miscalibrated.json'} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
