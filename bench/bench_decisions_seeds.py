"""The decisions bench on other draws of the same scenarios: how much of a row is its seed.

Each row of ``bench/bench_decisions.py`` is one draw: one arrival sequence, one restart's
downtime (±10 s of jitter), one cost noise. Where a row hangs on a single restart, a second
draw can move it by more than the controller's decisions do. This re-runs chosen scenarios
with other seeds — the static runs, the controller and the start-aware oracle all on the new
draw (nothing reused but the truth's limits and the calibration of the full run) — and prints
per row the controller ÷ oracle of every seed (the scenario's own first, re-run: the controller
may have changed since the full run), their geometric mean and worst, and how many draws meet
the row's target (≤ 1.10× the oracle where the future follows the past; no worse
than not acting on a surprise). Asserts nothing.

    python bench/bench_decisions_seeds.py bench-out/decisions --scenarios acceptance-drift \
        [--starts on,off] [--seeds 201,202,203] [--jobs 2] [--out seeds.md]

``--scenarios future`` takes every scenario whose future follows from its past.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from controller.sim.decisions import RATIO_TARGET  # noqa: E402

DEFAULT_SEEDS = "201,202,203,204"


def _run(job: tuple[str, bool, int | None, str, dict]) -> tuple[str, bool, int, float, float, float, int, int]:
    """One scenario, one launch state, one seed (None: the scenario's own): (…, the seed,
    controller, oracle, not acting, toggles)."""
    name, start_on, seed, cal_path, limits = job
    from controller import calibration
    from controller.sim import decisions

    sc = decisions.load_scenario(name)
    sc = sc.with_changes(seed=seed) if seed is not None else sc
    model = calibration.load(cal_path).latency_model()
    res = decisions.run_scenario(
        sc, "", model, decisions.truth_costs(), decisions.Limits(**limits), starts=(start_on,)
    )  # fmt: skip
    st = res.starts[0]
    return (
        name,
        start_on,
        sc.seed,
        st.controller.mean_latency_s,
        st.oracle.mean_latency_s,
        st.not_acting.mean_latency_s,
        st.controller.toggles,
        st.oracle.toggles,
    )


def decisions_seed(name: str) -> int:
    """The seed the full bench ran the scenario with."""
    from controller.sim import decisions

    return decisions.load_scenario(name).seed


def _geo(xs: list[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("full", help="output directory of a full bench_decisions run (decisions.json, calibration.json)")
    ap.add_argument("--scenarios", required=True, help="comma-separated names, or 'future' / 'surprise'")
    ap.add_argument("--starts", default="on,off", help="launch states: on, off or on,off (both)")
    ap.add_argument(
        "--seeds", default=DEFAULT_SEEDS, help="seeds besides the scenario's own, which always runs (comma-separated)"
    )
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (1: in this process)")
    ap.add_argument("--out", default=None, help="markdown file to write")
    args = ap.parse_args(argv)
    full = Path(args.full)
    ref = {s["name"]: s for s in json.loads((full / "decisions.json").read_text())["scenarios"]}
    if args.scenarios in ("future", "surprise"):
        names = [n for n, s in ref.items() if s["category"].startswith(args.scenarios)]
    else:
        names = args.scenarios.split(",")
    unknown = [n for n in names if n not in ref]
    if unknown:
        print(f"bench_decisions_seeds: not in {full / 'decisions.json'}: {', '.join(unknown)}", file=sys.stderr)
        return 2
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        starts = [{"on": True, "off": False}[s.strip()] for s in args.starts.replace("both", "on,off").split(",")]
    except (ValueError, KeyError) as e:
        print(f"bench_decisions_seeds: --seeds must be integers, --starts on, off or both: {e}", file=sys.stderr)
        return 2
    cal = str(full / "calibration.json")
    jobs = [(n, st, seed, cal, ref[n]["limits"]) for n in names for st in starts for seed in (None, *seeds)]
    jobs.sort(key=lambda j: -ref[j[0]]["duration_s"])  # the long ones first
    lines: list[str] = []
    rows: dict[tuple[str, bool], list[tuple[int, float, float, bool]]] = {}
    with ProcessPoolExecutor(args.jobs) if args.jobs > 1 else contextlib.nullcontext() as ex:
        for name, start_on, seed, ctl, orc, na, tog, otog in (ex.map if ex else map)(_run, jobs):
            future = ref[name]["category"].startswith("future")
            ok = (ctl / orc <= RATIO_TARGET) if future else (ctl / na <= 1.0 + 1e-9)
            ok = ok and tog <= otog + 2
            rows.setdefault((name, start_on), []).append((seed, ctl / orc, ctl / na, ok))
            line = (
                f"{name:24s} {'on' if start_on else 'off':3s} seed {seed:6d}  ctl {ctl:7.3f}  oracle {orc:7.3f}  "
                f"÷ oracle {ctl / orc:5.3f}  ÷ not acting {ctl / na:5.3f}  toggles {tog}/{otog}"
            )
            lines.append(line)
            print(line, flush=True)
    table = [
        "| scenario | launched | ÷ oracle: own seed, then the others | geomean | worst | worst ÷ not acting |"
        " draws meeting the target |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for (name, start_on), got in sorted(rows.items()):
        own = decisions_seed(name)
        got.sort(key=lambda r: (r[0] != own, r[0]))
        ratios = [r[1] for r in got]
        table.append(
            f"| {name} | {'on' if start_on else 'off'} | {', '.join(f'{x:.3f}' for x in ratios)} | "
            f"{_geo(ratios):.3f} | {max(ratios):.3f} | {max(r[2] for r in got):.3f} | "
            f"{sum(r[3] for r in got)} of {len(got)} |"
        )
    text = "\n".join(table)
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text + "\n\n```\n" + "\n".join(sorted(lines)) + "\n```\n")
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    import structlog

    # The controller's tick logs would drown the table (workers fork with this configuration).
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    raise SystemExit(main())
