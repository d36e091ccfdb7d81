"""Re-run only the controller of a finished decisions bench, against its stored oracle.

The oracle and the static runs of ``bench/bench_decisions.py`` depend on the truth, the
scenario and the start state only, never on the controller: after a policy change the
controller runs alone are enough to compare (a fifth of the full bench's time). Reads the
full run's decisions.json and calibration.json, prints one line per scenario × start and the
aggregates, and writes ``--out`` (markdown table plus the raw lines).

    python bench/bench_decisions_rerun.py bench-out/decisions [--scenarios a,b] [--jobs 2]
        [--set KEY=VALUE ...] [--out bench-out/decisions/rerun.md]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

TARGET_FUTURE = 1.10


def _run(job: tuple[str, str, str, dict]) -> tuple[str, str, float, int]:
    name, start, cal_path, overrides = job
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    from controller import calibration
    from controller.sim import decisions, runner

    sc = decisions.load_scenario(name).with_changes(engine={"initial_sd": start == "on"})
    model = calibration.load(cal_path).latency_model()
    r = runner.run_controller(
        sc, decisions.truth_costs(), runner.default_settings(**overrides), controller_model=model,
        warmup_s=decisions.WARMUP_S,
    )  # fmt: skip
    return name, start, float(r.summary()["mean_latency_s"]), int(r.toggles)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("full", help="output directory of a full bench_decisions run (decisions.json, calibration.json)")
    ap.add_argument("--scenarios", default=None, help="comma-separated names (default: all of the full run)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="controller setting override")
    ap.add_argument("--out", default=None, help="markdown file to write (default: FULL/rerun.md)")
    args = ap.parse_args(argv)
    full = Path(args.full)
    ref = {s["name"]: s for s in json.loads((full / "decisions.json").read_text())["scenarios"]}
    names = args.scenarios.split(",") if args.scenarios else list(ref)
    unknown = [n for n in names if n not in ref]
    if unknown:
        print(f"bench_decisions_rerun: not in {full / 'decisions.json'}: {', '.join(unknown)}", file=sys.stderr)
        return 2
    overrides = dict(kv.split("=", 1) for kv in args.set)
    jobs = [(n, s, str(full / "calibration.json"), overrides) for n in names for s in ("on", "off")]
    jobs.sort(key=lambda j: -ref[j[0]]["duration_s"])  # the long ones first
    got: dict[tuple[str, str], tuple[float, int]] = {}
    lines = []
    with ProcessPoolExecutor(args.jobs) as ex:
        for name, start, mean, toggles in ex.map(_run, jobs):
            got[(name, start)] = (mean, toggles)
            st = next(x for x in ref[name]["starts"] if x["start"] == start)
            o, na, old = (st[k]["mean_latency_s"] for k in ("oracle", "not_acting", "controller"))
            line = (
                f"{name:24s} {start:3s} ctl {mean:7.3f} (was {old:7.3f})  ÷ oracle {mean / o:5.2f} "
                f"(was {old / o:5.2f})  ÷ not acting {mean / na:5.2f}  toggles {toggles}/{st['oracle']['toggles']}"
            )
            lines.append(line)
            print(line, flush=True)
    table = ["| scenario | kind | launched on | launched off |", "|---|---|---|---|"]
    agg: dict[str, list[tuple[float, float, bool]]] = {}
    for name in names:
        kind = "future" if ref[name]["category"].startswith("future") else "surprise"
        cells = []
        for start in ("on", "off"):
            mean, toggles = got[(name, start)]
            st = next(x for x in ref[name]["starts"] if x["start"] == start)
            o, na = st["oracle"]["mean_latency_s"], st["not_acting"]["mean_latency_s"]
            ok = (mean / o <= TARGET_FUTURE) if kind == "future" else (mean / na <= 1.0 + 1e-9)
            ok = ok and toggles <= st["oracle"]["toggles"] + 2
            agg.setdefault(kind, []).append((mean / o, mean / na, ok))
            cells.append(f"{mean / o:.2f} ({toggles} / {st['oracle']['toggles']})")
        table.append(f"| {name} | {kind} | {cells[0]} | {cells[1]} |")

    def geo(xs: list[float]) -> float:
        return math.exp(sum(map(math.log, xs)) / len(xs))

    table += [
        "",
        "| scenarios | rows | worst ÷ oracle | geomean ÷ oracle | geomean ÷ not acting | rows meeting the target |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for kind, rows in agg.items():
        table.append(
            f"| {kind} | {len(rows)} | {max(r[0] for r in rows):.2f} | {geo([r[0] for r in rows]):.2f} | "
            f"{geo([r[1] for r in rows]):.2f} | {sum(r[2] for r in rows)} |"
        )
    text = "\n".join(table)
    print("\n" + text)
    out = Path(args.out) if args.out else full / "rerun.md"
    out.write_text(text + "\n\n```\n" + "\n".join(lines) + "\n```\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
