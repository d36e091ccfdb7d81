"""Presenting a backtest: the decision table with its summary, and the timeline plot."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from controller.sim.backtest.history import format_time
from controller.sim.backtest.scoring import BacktestResult

CAVEAT = (
    "open-loop caveat: acceptance is unobserved while SD was off in the history (the replay uses the last "
    "measured value, then the prior), and the controller's own toggles would have changed the load's latency "
    "and queueing, which a replay cannot observe: gains are model predictions, not measurements"
)


def print_result(result: BacktestResult, all_steps: bool = False, out=None) -> None:
    out = out or sys.stdout
    shown = result.records if all_steps else result.decisions
    title = "steps" if all_steps else "decisions the controller would have taken"
    print(f"\n{title}:", file=out)
    if not shown:
        print("  (none: it would have kept the recorded state)", file=out)
    else:
        print(
            f"  {'time':>20} {'action':>8} {'rate':>7} {'accept':>12} {'speedup':>8} {'cost':>8} {'proj.gain':>9}"
            "  reason: detail",
            file=out,
        )
        for r in shown:
            acc = "-" if r.acceptance_rate is None else f"{r.acceptance_rate:.2f} {r.acceptance_source}"
            why = f"{r.failure}" if r.failure and r.action == "none" else f"{r.reason}: {r.detail}"
            print(
                f"  {format_time(r.time_s):>20} {r.action:>8} {_f(r.arrival_rate_rps):>7} {acc:>12}"
                f" {_f(r.predicted_speedup, 3):>8} {_f(r.switch_cost_request_s, 0):>8}"
                f" {_f(r.projected_gain_request_s, 0):>9}  {why}",
                file=out,
            )
    recs = result.records
    usable = sum(1 for r in recs if r.predicted_speedup is not None)
    rec_on = [r.recorded_enabled for r in recs if r.recorded_enabled is not None]
    ctl_on = [r.controller_enabled for r in recs]
    enables = sum(1 for r in result.decisions if r.action == "enable")
    disables = sum(1 for r in result.decisions if r.action == "disable")
    print("\nsummary:", file=out)
    failures = ", ".join(f"{k} {v}" for k, v in sorted(result.failures.items())) or "none"
    print(f"  steps: {len(recs)}, assessed {usable}; held on unusable data: {failures}", file=out)
    if rec_on:
        print(
            f"  recorded: SD on {100 * sum(rec_on) / len(rec_on):.0f}% of steps, {result.recorded_toggles} changes",
            file=out,
        )
    if ctl_on:
        print(
            f"  controller: SD on {100 * sum(ctl_on) / len(ctl_on):.0f}% of steps,"
            f" {enables} enable(s), {disables} disable(s)",
            file=out,
        )
    print(
        f"  predicted gain (model prediction, not a measurement): latency {result.latency_gain_request_s:.1f}"
        f" req·s - switch costs {result.switch_cost_request_s:.1f} req·s = {result.net_gain_request_s:.1f} req·s"
        + (
            f" ({result.net_gain_request_s / result.requests:+.3f} s per request over {result.requests:.0f} requests)"
            if result.requests > 0
            else ""
        ),
        file=out,
    )
    if result.unbounded_for or result.unbounded_against:
        print(
            f"  not in the sum: {result.unbounded_for} step(s) where the model predicts the recorded state overloaded"
            f" (unbounded gain), {result.unbounded_against} where it predicts the controller's state overloaded"
            " (unbounded loss)",
            file=out,
        )
    if result.beyond_headroom_recorded or result.beyond_headroom_controller:
        print(
            f"  beyond capacity_headroom of the stability limit (the fluid model understates latency there; real"
            f" queues grow without bound): recorded state {result.beyond_headroom_recorded} step(s),"
            f" controller's state {result.beyond_headroom_controller} step(s)",
            file=out,
        )
    print(f"  {CAVEAT}", file=out)


def _f(v: float | None, digits: int = 2) -> str:
    if v is None:
        return "-"
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:.{digits}f}"


def plot(result: BacktestResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = result.records
    if not recs:
        return
    t0 = recs[0].time_s
    t = [(r.time_s - t0) / 3600 for r in recs]
    nan = float("nan")
    fig, axes = plt.subplots(3, 1, figsize=(10, 7), sharex=True)
    axes[0].plot(t, [r.arrival_rate_rps if r.arrival_rate_rps is not None else nan for r in recs])
    axes[0].set_ylabel("arrival rate (req/s)")
    sp = [nan if r.predicted_speedup is None else min(r.predicted_speedup, 3.0) for r in recs]
    axes[1].plot(t, sp, color="C2", label="predicted speedup (capped at 3)")
    axes[1].axhline(1.0, color="grey", lw=0.8, ls=":")
    axes[1].set_ylabel("predicted speedup")
    axes[1].legend(loc="best", fontsize=8)
    rec = [nan if r.recorded_enabled is None else float(r.recorded_enabled) for r in recs]
    axes[2].step(t, rec, where="post", color="C0", alpha=0.6, label="recorded")
    axes[2].step(t, [float(r.controller_enabled) + 0.02 for r in recs], where="post", color="C1", label="controller")
    for r in result.decisions:
        for ax in axes:
            ax.axvline((r.time_s - t0) / 3600, color="C3", lw=0.6, alpha=0.5)
    axes[2].set_yticks([0, 1], ["off", "on"])
    axes[2].set_ylabel("SD")
    axes[2].legend(loc="best", fontsize=8)
    axes[2].set_xlabel(f"hours since {format_time(t0)}")
    fig.suptitle(
        f"backtest: predicted net gain {result.net_gain_request_s:.0f} req·s (model prediction; open-loop replay)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
