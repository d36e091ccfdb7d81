"""Decision quality against an independent truth: the controller vs a start-aware oracle.

The simulated vLLM runs on the GPU roofline (controller/sim/truth_costs.py: H100, Llama-3.1-8B
with a Llama-3.2-1B draft), never on the controller's model. The controller's calibration comes
from bench → calibrate against that simulated server (cached in the output directory;
``--recalibrate`` measures again). Each scenario (controller/data/scenarios/decisions/) runs
always-on, always-off, and from both launch states the real controller and the hindsight
oracle given that start state. Prints markdown tables and writes decisions.json and
decisions.md to ``--out``.

    python bench/bench_decisions.py [--quick] [--scenarios a,b] [--out bench-out/decisions] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import structlog

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from controller.sim import decisions  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"smoke subset: {', '.join(decisions.QUICK)}")
    ap.add_argument("--scenarios", default=None, help="comma-separated names or YAML paths (default: all)")
    ap.add_argument("--out", default="bench-out/decisions", help="output directory (default bench-out/decisions)")
    ap.add_argument("--recalibrate", action="store_true", help="measure bench → calibrate again (ignore the cache)")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="controller setting to override (repeatable; default: the daemon's defaults)",
    )
    args = ap.parse_args(argv)
    overrides = dict(kv.split("=", 1) for kv in args.set)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    category = dict(decisions.SCENARIOS)
    if args.scenarios:
        picked = args.scenarios.split(",")
    elif args.quick:
        picked = list(decisions.QUICK)
    else:
        picked = [n for n, _ in decisions.SCENARIOS]
    names = [(n, category.get(Path(n).stem, decisions.FUTURE)) for n in picked]

    cal, cal_path = decisions.calibrate(out, force=args.recalibrate, log=lambda m: print(m, flush=True))
    print(
        f"calibration: {cal_path} (bench → calibrate against the simulated truth; sha {cal.metadata.source_sha256[:12]})"
    )
    results = decisions.run_all(
        names, cal_path, out, jobs=args.jobs, settings_overrides=overrides, log=lambda m: print(m, flush=True)
    )
    wall = time.perf_counter() - started

    table = decisions.markdown(results)
    limits = decisions.limits_markdown(results)
    settings = ", ".join(f"{k}={v}" for k, v in overrides.items()) or "the daemon's defaults"
    footer = (
        f"\nController settings: {settings}. {len(results)} scenarios × 2 start states in {wall:.0f} s "
        f"({args.jobs} processes). Mean latency of every "
        f"request after a {decisions.WARMUP_S:.0f} s warm-up, unfinished ones counted up to the end. Oracle: the best "
        "of the replayed DP schedules and stay/switch-at-t=0, given the same start state. 'not acting': the static "
        "policy equal to the start state. Target: ≤ 1.10× the oracle (future follows from past) or ≤ not acting "
        "(surprises), toggles ≤ oracle + 2.\n"
    )
    doc = "## Decision quality on the truth\n\n" + table + "\n### Truth limits (measured)\n\n" + limits + footer
    print()
    print(doc)
    (out / "decisions.md").write_text(doc, encoding="utf-8")
    payload = decisions.to_json(results) | {
        "wall_s": wall,
        "calibration": str(cal_path),
        "jobs": args.jobs,
        "settings_overrides": overrides,
    }
    (out / "decisions.json").write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    print(f"wrote {out / 'decisions.md'} and {out / 'decisions.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
