"""The controller against the static choices on one scenario: the runs, the latency of
each window, and presenting the comparison (table, timeline plot).

Used by ``sd-controller demo``; the two baselines run in worker processes while the
controller runs in this one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

WINDOW_S = 600.0  # latency plot resolution


def windowed_latency(result, window_s: float = WINDOW_S) -> tuple[np.ndarray, np.ndarray]:
    """Mean latency of the requests arriving in each window (censored for unfinished ones)."""
    from controller.sim.engine import F_ARR, F_FIN

    e = result.engine
    log = e.finished_log()
    arr = np.concatenate([log[:, F_ARR], e.pending_arrivals()])
    lat = np.concatenate([log[:, F_FIN] - log[:, F_ARR], e.t - e.pending_arrivals()])
    n = max(1, math.ceil(result.scenario.duration_s / window_s))
    idx = np.minimum((arr // window_s).astype(int), n - 1)
    sums = np.bincount(idx, weights=lat, minlength=n)
    counts = np.bincount(idx, minlength=n)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
    return (np.arange(n) + 0.5) * window_s, mean


def baseline(scenario_dump: dict, cal_file: str, enabled: bool, server: str = "calibration") -> dict:
    """Worker process: one always-on/off run, reduced to what the table, plot and restart
    pricing need (``server``: see :func:`controller.sim.demo_truth.server_costs`)."""
    from controller import calibration
    from controller.sim import demo_truth, runner
    from controller.sim.scenarios import Scenario

    scenario = Scenario.model_validate(scenario_dump)
    model = calibration.load(cal_file).latency_model()
    r = runner.run_static(scenario, demo_truth.server_costs(server, model), enabled)
    t, lat = windowed_latency(r)
    return {
        "summary": r.summary(),
        "window_t": t.tolist(),
        "window_latency": lat.tolist(),
        "requests": demo_truth.requests_of(r),
    }


@dataclass
class Comparison:
    """The controller's run, each policy's summary row and its windowed mean latency."""

    result: object  # controller.sim.runner.RunResult
    rows: dict[str, dict]
    t_windows: np.ndarray
    windows: dict[str, list]
    requests: dict[bool, tuple] = field(default_factory=dict)  # static runs' (arrival, latency), by SD on


def compare(
    scenario,
    model,
    cal_file: Path,
    baselines: bool = True,
    on_tick: Callable | None = None,
    server: str = "calibration",
) -> Comparison:
    """Run the controller on ``scenario`` (``on_tick(record, engine)`` after each tick) and,
    with ``baselines``, always-on and always-off in two worker processes meanwhile. The
    controller believes ``model``; the server runs on :func:`demo_truth.server_costs`."""
    from controller.sim import demo_truth, runner

    futures: dict[str, Future] = {}
    pool = None
    if baselines:
        pool = ProcessPoolExecutor(max_workers=2)
        dump = scenario.model_dump(mode="json")
        futures["always-on"] = pool.submit(baseline, dump, str(cal_file), True, server)
        futures["always-off"] = pool.submit(baseline, dump, str(cal_file), False, server)
    requests: dict[bool, tuple] = {}
    try:
        result = runner.run_controller(
            scenario, demo_truth.server_costs(server, model), controller_model=model, on_tick=on_tick
        )
        rows = {"controller": result.summary()}
        t_ctl, lat_ctl = windowed_latency(result)
        windows = {"controller": lat_ctl.tolist()}
        for name, fut in futures.items():
            got = fut.result()
            rows[name] = got["summary"]
            windows[name] = got["window_latency"]
            requests[name == "always-on"] = got["requests"]
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return Comparison(result, rows, t_ctl, windows, requests)


def print_table(rows: dict[str, dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="controller vs static choices (latency of every request, censored if unfinished)")
    for col in ("policy", "mean latency s", "p99 latency s", "toggles", "lost to restarts", "unfinished", "SD on"):
        t.add_column(col, justify="right" if col != "policy" else "left")
    for name, s in rows.items():
        t.add_row(
            name,
            f"{s['mean_latency_s']:.2f}",
            f"{s['p99_latency_s']:.2f}",
            f"{s['toggles']:.0f}",
            f"{s['lost']:.0f}",
            f"{s['unfinished']:.0f}",
            f"{100 * s['sd_on_fraction']:.0f}%",
        )
    console = Console()
    if not console.is_terminal:
        console = Console(width=120)
    console.print(t)


def plot(result, t_windows, windows: dict[str, list], path: Path, model) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ticks = result.ticks
    th = np.array([r.t for r in ticks]) / 3600
    rate = np.array([np.nan if r.observed_rate_rps is None else r.observed_rate_rps for r in ticks])
    speed = np.array([np.nan if r.predicted_speedup is None else min(r.predicted_speedup, 3.0) for r in ticks])
    tl = result.engine.timeline_arrays()
    true_rate = result.scenario.arrival_rate.evaluate(tl["t"])
    fig, axes = plt.subplots(4, 1, figsize=(11, 10), sharex=True)
    ax = axes[0]
    ax.plot(tl["t"] / 3600, true_rate, color="0.6", lw=1, label="scenario rate")
    ax.plot(th, rate, color="C0", lw=1.2, label="observed by the controller")
    ax.set_ylabel("req/s")
    ax.legend(loc="upper left")
    ax = axes[1]
    ax.plot(th, speed, color="C2", lw=1.2, label="predicted speedup")
    ax.axhline(result.controller.settings.enable_threshold, color="C2", ls=":", lw=1, label="enable")  # type: ignore[attr-defined]
    ax.axhline(result.controller.settings.disable_threshold, color="C3", ls=":", lw=1, label="disable")  # type: ignore[attr-defined]
    ax.set_ylabel("T_off / T_on")
    ax.legend(loc="upper left")
    ax = axes[2]
    ax.fill_between(tl["t"] / 3600, tl["sd_on"], step="post", alpha=0.4, color="C1", label="SD on")
    ax.fill_between(tl["t"] / 3600, 1 - tl["serving"], step="post", alpha=0.6, color="C3", label="restarting")
    ax.set_ylabel("state")
    ax.set_yticks([0, 1])
    ax.legend(loc="upper left")
    ax = axes[3]
    for name, lat in windows.items():
        ax.plot(t_windows / 3600, lat, lw=1.2, label=name)
    ax.set_yscale("log")
    ax.set_ylabel("mean latency s (10 min)")
    ax.set_xlabel("simulated hours")
    ax.legend(loc="upper left")
    fig.suptitle(f"sd-controller demo: {result.scenario.name}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
