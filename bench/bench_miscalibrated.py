"""Decisions with a wrong calibration: does the online correction bring them back?

Issue "close the loop": with calibrations off by ×0.7 and ×1.4 on the load-dependent costs,
with the shipped example calibration, and with one from another GPU, the controller's decisions
over the scenario set should be within 5 % of those it makes with the true calibration, as
mean latency ÷ the start-aware oracle. The shipped example calibration is the recipe run on
this very simulated H100, so here it is the true one; the A100 calibration is the same recipe on
the same deployment simulated on an A100 (1.6× the memory-bound costs, 3.2× the compute-bound):
the calibration a user brings from another GPU.

The server is the GPU-roofline truth (never the controller's model), as in
bench/bench_decisions.py, with its calibration (bench → calibrate, from its ``--out``). The
controller runs with the true calibration and with each wrong one on the same arrivals; the
oracle is common to all, so the controller's mean latency ÷ the true calibration's is the ratio
of their ratios to the oracle (decisions.json in ``--out``, when there, adds the oracle).
Prints a markdown table and writes miscalibrated.json to ``--out``.

    python bench/bench_miscalibrated.py [--out bench-out/decisions] [--max-hours 3] [--jobs 2]
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
OTHER_GPU = "A100 calibration"  # bench → calibrate against the same server on an A100: another GPU
OTHER_GPU_FILE = "calibration-a100.json"
TRUE = "true calibration"


def believed_models(true_cal: Path) -> dict:
    from controller import calibration
    from controller.correction import scaled_model
    from controller.shipped import example_calibration_path

    true = calibration.load(true_cal).latency_model()
    models = {TRUE: true, **{label: scaled_model(true, f) for label, f in LOAD_SCALED.items()}}
    models[EXAMPLE] = calibration.load(example_calibration_path()).latency_model()
    other = true_cal.parent / OTHER_GPU_FILE
    if other.is_file():
        models[OTHER_GPU] = calibration.load(other).latency_model()
    return models


def other_gpu_calibration(out: Path) -> Path:
    """The calibration a user would bring from another GPU: the recipe (bench → calibrate) run
    against the same simulated deployment on an A100 (cached in ``out``)."""
    from controller.sim import decisions, fidelity, gpu

    work = out / "a100"
    decisions.calibrate(work, truth=fidelity.TruthServer(gpu=gpu.A100_SXM))
    target = out / OTHER_GPU_FILE
    if not target.is_file():
        target.write_bytes((work / decisions.CALIBRATION_FILE).read_bytes())
    return target


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
    ap.add_argument(
        "--out", default="bench-out/decisions", help="bench_decisions output directory (default bench-out/decisions)"
    )
    ap.add_argument("--max-hours", type=float, default=3.0, help="skip scenarios longer than this (default 3)")
    ap.add_argument("--scenarios", default=None, help="comma-separated names (default: all of bench_decisions')")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    from controller.sim import decisions

    out = Path(args.out)
    true_cal = out / decisions.CALIBRATION_FILE
    if not true_cal.is_file():
        print(f"--out {out}: no {decisions.CALIBRATION_FILE} (run bench/bench_decisions.py first)", file=sys.stderr)
        return 2
    names = args.scenarios.split(",") if args.scenarios else [n for n, _ in decisions.SCENARIOS]
    names = [n for n in names if decisions.load_scenario(n).duration_s <= args.max_hours * 3600]
    other_gpu_calibration(out)
    labels = [TRUE, *LOAD_SCALED, EXAMPLE, OTHER_GPU]
    started = time.perf_counter()
    jobs = [(n, on, label) for n in names for on in (True, False) for label in labels]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        got = list(pool.map(run_one, *zip(*jobs, strict=True), [str(true_cal)] * len(jobs)))
    result = {(n, on, label): (lat, toggles) for n, on, label, lat, toggles in got}
    # The oracle is the same for every calibration: ÷ the true calibration's controller is the
    # ratio of the two ratios to the oracle. decisions.json, when there, adds the oracle.
    oracle = _oracles(out / "decisions.json")

    print("ctl mean latency ÷ the true calibration's controller (toggles); ÷ oracle where decisions.json has it")
    print("| scenario | start | true calibration ÷ oracle (toggles) | " + " | ".join(labels[1:]) + " |")
    print("|---|---|---:|" + "---:|" * (len(labels) - 1))
    rel: dict[str, list[float]] = {label: [] for label in labels[1:]}
    vs_oracle: dict[str, list[float]] = {label: [] for label in labels}
    rows = []
    for n in names:
        for on in (True, False):
            true_lat, true_tog = result[(n, on, TRUE)]
            orc = oracle.get((n, on))
            cells = [f"{true_lat / orc:.2f} ({true_tog})" if orc else f"- ({true_tog})"]
            row = {"scenario": n, "start": "on" if on else "off", "oracle_s": orc, TRUE: true_lat}
            for label in labels:
                lat, toggles = result[(n, on, label)]
                row[label] = lat
                row[f"{label} toggles"] = toggles
                if orc:
                    vs_oracle[label].append(lat / orc)
                if label != TRUE:
                    rel[label].append(lat / true_lat)
                    cells.append(f"{lat / true_lat:.3f} ({toggles})")
            rows.append(row)
            print(f"| {n} | {'on' if on else 'off'} | " + " | ".join(cells) + " |")
    print(f"\nover {len(rows)} rows (scenarios of at most {args.max_hours:g} h, both launch states):")
    summary = {}
    for label in labels[1:]:
        g = geomean(rel[label])
        worst = max(rel[label])
        summary[label] = {"geomean_vs_true": g, "worst_vs_true": worst}
        line = f"  {label}: geomean {g:.3f}× the true calibration's, worst {worst:.2f}×"
        if vs_oracle[label] and vs_oracle[TRUE]:
            go, gt = geomean(vs_oracle[label]), geomean(vs_oracle[TRUE])
            summary[label].update(geomean_vs_oracle=go, true_geomean_vs_oracle=gt)
            line += f"; ÷ oracle {go:.3f} vs {gt:.3f}"
        verdict = "within" if abs(g - 1) <= TARGET else "NOT within"
        print(f"{line} ({verdict} {TARGET * 100:.0f} %)")
    (out / "miscalibrated.json").write_text(
        json.dumps({"rows": rows, "summary": summary, "wall_s": time.perf_counter() - started}, indent=2) + "\n",
        encoding="utf-8",
    )
    print(f"wrote {out / 'miscalibrated.json'} ({time.perf_counter() - started:.0f} s)")
    return 0


def _oracles(path: Path) -> dict[tuple[str, bool], float]:
    try:
        done = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {
        (r["name"], s["start"] == "on"): s["oracle"]["mean_latency_s"]
        for r in done.get("scenarios", [])
        for s in r.get("starts", [])
    }


if __name__ == "__main__":
    raise SystemExit(main())
