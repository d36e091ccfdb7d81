"""``sd-controller validate CAL.json LOAD.csv [LOAD.csv ...]``: the calibration against load tests it
never saw (the runs at one rate, from one file or several, pooled into a point)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from controller import calibration as cal_mod
from controller.commands._common import check_plot_path, exits_on_input_error, finite_or_none, save_plot
from controller.errors import EXIT_OK
from controller.shipped import calibration_path
from controller.validation import INTERVAL_COVERAGE, ValidationReport, validate


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("calibration", help="calibration JSON, or 'example' for the shipped example")
    p.add_argument(
        "load_csv",
        type=Path,
        nargs="+",
        help="load-test CSV(s) (sd-controller bench --load-test): "
        + ",".join((*cal_mod.LOAD_COLUMNS, *cal_mod.LOAD_OPTIONAL_COLUMNS))
        + "; the runs of one mode at one rate (e.g. the same test on other --seed) are pooled",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of tables")
    p.add_argument(
        "--plot", type=Path, help="write predicted vs measured latency per mode (an image: .png, .svg, .pdf, …)"
    )


def to_dict(report: ValidationReport, sources: Sequence[str] | None = None) -> dict[str, Any]:
    """JSON-safe report (+inf predictions become null with overloaded = true); ``sources``: each
    run's file, in the order of ``report.rows`` (when several were read)."""
    inside, checked = report.interval_coverage
    return {
        "mean_abs_error": report.mean_abs_error,
        "worst_abs_error": report.worst_abs_error,
        "saturated_all_flagged": report.saturated_all_flagged,
        # Runs whose measured mean lay inside the predicted interval, of those checked (neither
        # side overloaded), and the share the interval is drawn for.
        "interval_coverage": {
            "inside": inside,
            "runs": checked,
            "nominal": INTERVAL_COVERAGE,
        },
        "rows": [
            {
                **({} if sources is None else {"file": sources[i]}),
                "line": c.row.line,
                "mode": c.mode,
                "rate_rps": c.row.rate,
                # The rate predicted at: what the run sent over its duration, where recorded.
                "offered_rps": c.row.offered_rps,
                "measured_s": c.row.mean_e2e_s,
                "measured_saturated": c.measured_saturated,
                "predicted_s": finite_or_none(c.predicted_s),
                "stationary_s": finite_or_none(c.stationary_s),
                "duration_s": c.row.duration_s,
                "predicted_interval_s": [finite_or_none(c.predicted_lo_s), finite_or_none(c.predicted_hi_s)],
                "inside_interval": c.inside_interval,
                "predicted_overloaded": c.predicted_overloaded,
                "metastable": c.metastable,
                "error": c.error,
                # The batch's KV context the prediction read: measured by the load test's gauges,
                # or derived from the lengths (taken as independent).
                "running_context_tokens": c.row.workload().mean_context_tokens,
                "running_context_measured": c.row.running_context_tokens is not None,
                # Prompt tokens per request the prefix cache served (not computed): measured, or 0.
                "cached_prompt_tokens": c.row.workload().cached_tokens,
            }
            for i, c in enumerate(report.rows)
        ],
        # The runs of one mode at one rate pooled; the summaries below read these.
        "points": [
            {
                "mode": pt.mode,
                "rate_rps": pt.rate,
                "runs": len(pt.runs),
                "saturated_runs": pt.saturated_runs,
                "measured_saturated": pt.measured_saturated,
                "measured_s": pt.measured_s,
                "measured_se_s": pt.measured_se_s,
                "predicted_s": finite_or_none(pt.predicted_s),
                "predicted_overloaded": pt.predicted_overloaded,
                "error": pt.error,
                "error_in_se": pt.error_in_se,
                "beyond_noise": pt.beyond_noise,
            }
            for pt in report.points
        ],
        "modes": [
            {
                "mode": m.mode,
                "runs": m.runs,
                "points": m.points,
                "mean_abs_error": m.mean_abs_error,
                "worst_error": m.worst_error,
                "saturated_runs": m.saturated_runs,
                "saturated_flagged": m.saturated_flagged,
                "false_overloads": m.false_overloads,
                "limit_predicted_rps": finite_or_none(m.limit_predicted_rps),
                "limit_measured_rps": list(m.limit_measured_rps),
                "limit_error": m.limit_error,
                "limit_reason": m.limit_reason,
                "limit_cache_fill_rps": m.limit_cache_fill_rps,
                "limit_served_rps": m.limit_served_rps,
                "capacity_error": m.capacity_error,
                "metastable_runs": m.metastable_runs,
                "interval_runs": m.interval_runs,
                "interval_inside": m.interval_inside,
            }
            for m in report.modes
        ],
        "break_even": [
            {
                "draft_length": b.draft_length,
                "predicted_rps": b.predicted_rps,
                "measured_rps": b.measured_rps,
                "measured_between_rps": None if b.measured_between_rps is None else list(b.measured_between_rps),
                "error": b.error,
                "refine_rps": list(b.refine_rps),
            }
            for b in report.break_even
        ],
    }


# A run's Poisson arrivals stray from the rate asked for by ±1/√(rate·duration): past this the
# table says which rate it was predicted at (near a limit 1 % of rate is 5–10 % of latency).
OFFERED_NOTE = 0.005


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.1f} %"


def print_report(report: ValidationReport, console: Console, sources: Sequence[str] | None = None) -> None:
    t = Table(title="predicted vs measured mean end-to-end latency")
    for col in ("line", "mode", "rate req/s", "measured s", "predicted s", "interval s", "error", "note"):
        t.add_column(col, justify="right")
    for i, c in enumerate(report.rows):
        note = []
        if c.measured_saturated:
            note.append("saturated" + (" (flagged)" if c.predicted_overloaded else " (NOT flagged)"))
        elif c.metastable:
            note.append("metastable: overloaded once its KV cache fills")
        elif c.predicted_overloaded:
            note.append("predicted overloaded")
        offered = c.row.offered_rps
        if abs(offered - c.row.rate) > OFFERED_NOTE * c.row.rate:
            note.append(f"predicted at the {offered:.4g} req/s it sent")
        pred = "overloaded" if c.predicted_overloaded else f"{c.predicted_s:.3f}"
        interval = (
            "-"
            if math.isinf(c.predicted_hi_s) and math.isinf(c.predicted_lo_s)
            else f"{c.predicted_lo_s:.2f}-{c.predicted_hi_s:.2f}"
        )
        t.add_row(
            str(c.row.line) if sources is None else f"{sources[i]}:{c.row.line}",
            c.mode,
            f"{c.row.rate:g}",
            f"{c.row.mean_e2e_s:.3f}",
            pred,
            interval,
            _pct(c.error),
            ", ".join(note),
        )
    console.print(t)
    if report.replicated:
        print_points(report, console)
    m = Table(title="per mode (errors over the rates neither saturated nor called overloaded; runs at one rate pooled)")
    for col in (
        "mode",
        "runs",
        "mean |error|",
        "worst",
        "saturated flagged",
        "false overloads",
        "limit predicted",
        "limit measured",
        "limit error",
        "served when saturated",
        "capacity error",
        "inside interval",
        "limit set by",
    ):
        m.add_column(col, justify="right", no_wrap=col == "limit set by")
    for s in report.modes:
        lo, hi = s.limit_measured_rps
        measured = f"{'-' if lo is None else f'>{lo:g}'} / {'-' if hi is None else f'<{hi:g}'}"
        m.add_row(
            s.mode, str(s.runs) if s.runs == s.points else f"{s.runs} at {s.points} rates", "-" if s.mean_abs_error is None else f"{s.mean_abs_error * 100:.1f} %", _pct(s.worst_error),
            f"{s.saturated_flagged}/{s.saturated_runs}", str(s.false_overloads),
            f"{s.limit_predicted_rps:.2f}" + ("" if s.limit_cache_fill_rps is None else f"-{s.limit_cache_fill_rps:.2f}"),
            measured,
            _pct(s.limit_error),
            "-" if s.limit_served_rps is None else f"{s.limit_served_rps:.2f}", _pct(s.capacity_error),
            f"{s.interval_inside}/{s.interval_runs}" if s.interval_runs else "-",
            s.limit_reason,
        )  # fmt: skip
    console.print(m)
    if report.break_even:
        b = Table(title="break-even rate (speedup = 1)")
        for col in ("γ", "predicted req/s", "measured req/s", "measured between", "error", "to pin it, also run"):
            b.add_column(col, justify="right", no_wrap=col.startswith("to pin"))  # one --rates list
        for be in report.break_even:
            b.add_row(
                str(be.draft_length),
                "never" if be.predicted_rps is None else f"{be.predicted_rps:.2f}",
                "not crossed" if be.measured_rps is None else f"{be.measured_rps:.2f}",
                "-" if be.measured_between_rps is None else "{:g}–{:g}".format(*be.measured_between_rps),
                _pct(be.error),
                ",".join(f"{r:g}" for r in be.refine_rps) or "-",  # a --rates list for bench --load-test
            )
        console.print(b)
    overall = report.mean_abs_error
    console.print(
        f"overall: mean |error| {'-' if overall is None else f'{overall * 100:.1f} %'}, worst "
        f"{'-' if report.worst_abs_error is None else f'{report.worst_abs_error * 100:.1f} %'}; "
        f"every saturated {'rate' if report.replicated else 'run'} flagged: {'yes' if report.saturated_all_flagged else 'NO'}"
    )
    inside, checked = report.interval_coverage
    if checked:
        console.print(
            f"measured inside the predicted interval: {inside} of {checked} runs ({inside / checked * 100:.0f} %; "
            f"drawn for {INTERVAL_COVERAGE * 100:.0f} %)"
        )


def print_points(report: ValidationReport, console: Console) -> None:
    """The rates run more than once: their runs' mean, its standard error, and the pooled error."""
    t = Table(title="rates run more than once, pooled (mean of the steady runs)")
    for col in ("mode", "rate req/s", "runs", "saturated", "measured s", "± se", "predicted s", "error", "in se"):
        t.add_column(col, justify="right")
    for pt in report.points:
        if len(pt.runs) < 2:
            continue
        t.add_row(
            pt.mode,
            f"{pt.rate:g}",
            str(len(pt.runs)),
            str(pt.saturated_runs),
            "saturated" if pt.measured_s is None else f"{pt.measured_s:.3f}",
            "-" if pt.measured_se_s is None else f"{pt.measured_se_s:.3f}",
            "overloaded" if pt.predicted_overloaded else f"{pt.predicted_s:.3f}",
            _pct(pt.error),
            "-"
            if pt.error_in_se is None
            else f"{pt.error_in_se:+.1f}" + (" (beyond the runs' spread)" if pt.beyond_noise else ""),
        )
    console.print(t)


def plot(report: ValidationReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    modes = sorted({c.mode for c in report.rows})
    for i, mode in enumerate(modes):
        rows = sorted((c for c in report.rows if c.mode == mode), key=lambda c: c.row.rate)
        color = f"C{i}"
        pooled = [p for p in report.points if p.mode == mode and len(p.runs) > 1 and p.measured_s is not None]
        ax.plot(
            [c.row.rate for c in rows],
            [c.row.mean_e2e_s for c in rows],
            "o",
            color=color,
            alpha=0.35 if pooled else 1.0,
            label=f"{mode} measured" + (" (each run)" if pooled else ""),
        )
        if pooled:  # the runs at one rate: their mean ± its standard error
            ax.errorbar(
                [p.rate for p in pooled],
                [p.measured_s for p in pooled],
                yerr=[p.measured_se_s or 0.0 for p in pooled],
                fmt="s",
                color=color,
                capsize=3,
                label=f"{mode} mean of the runs ± se",
            )
        pred = [(c.row.rate, c.predicted_s) for c in rows if math.isfinite(c.predicted_s)]
        if pred:
            ax.plot(*zip(*pred, strict=True), "-", color=color, label=f"{mode} predicted")
    ax.set_xlabel("arrival rate (req/s)")
    ax.set_ylabel("mean end-to-end latency (s)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_plot(fig, path, 110)
    plt.close(fig)


@exits_on_input_error
def run(args: argparse.Namespace) -> int:
    check_plot_path("--plot", args.plot)
    cal = cal_mod.load(calibration_path(args.calibration))
    rows, sources = [], []
    for path in args.load_csv:
        read = cal_mod.read_load_csv(path)[0]
        rows += read
        sources += [path.name] * len(read)
    named = sources if len(args.load_csv) > 1 else None
    report = validate(cal.latency_model(), rows)
    if args.plot:
        plot(report, args.plot)
    if args.json:
        json.dump(to_dict(report, named), sys.stdout, indent=2, allow_nan=False)
        print()
    else:
        print_report(report, Console(width=max(Console().width, 130)), named)
        if args.plot:
            print(f"wrote {args.plot}")
    return EXIT_OK
