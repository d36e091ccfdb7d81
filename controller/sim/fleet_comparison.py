"""A fleet of real controllers against static fleets on one scenario: the runs, the table, the
verdict and a timeline plot. Used by ``sd-controller demo --replicas N``.

The always-on and always-off fleets run in worker processes while the controllers' fleet runs
in this one; all three receive the same arrivals (same seed, same router policy).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

WINDOW_S = 600.0


def windowed(fleet, duration_s: float, window_s: float = WINDOW_S) -> tuple[np.ndarray, np.ndarray]:
    """Mean latency of the fleet's requests arriving in each window."""
    arr, lat = fleet.latencies()
    n = max(1, math.ceil(duration_s / window_s))
    idx = np.minimum((arr // window_s).astype(int), n - 1)
    sums = np.bincount(idx, weights=lat, minlength=n)
    counts = np.bincount(idx, minlength=n)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
    return (np.arange(n) + 0.5) * window_s, mean


def baseline(scenario_dump: dict, cal_file: str, server: str, replicas: int, router: str, enabled: bool) -> dict:
    """Worker process: one static fleet, reduced to its summary and windowed latency."""
    from controller import calibration
    from controller.sim import demo_truth
    from controller.sim.fleet_runner import run_fleet_static
    from controller.sim.scenarios import Scenario

    scenario = Scenario.model_validate(scenario_dump)
    model = calibration.load(cal_file).latency_model()
    r = run_fleet_static(scenario, demo_truth.server_costs(server, model), replicas, router, enabled)
    _, lat = windowed(r.fleet, scenario.duration_s)
    return {"summary": r.summary(), "window_latency": lat.tolist()}


@dataclass
class FleetComparison:
    result: object  # controller.sim.fleet_runner.FleetRunResult
    rows: dict[str, dict]
    t_windows: np.ndarray
    windows: dict[str, list]


def compare(
    scenario,
    model,
    cal_file: Path,
    replicas: int,
    router: str,
    *,
    server: str = "truth",
    baselines: bool = True,
    on_tick: Callable | None = None,
    max_unavailable: int = 1,
) -> FleetComparison:
    """The controllers' fleet (believing ``model``) and, with ``baselines``, the static fleets."""
    from controller.sim import demo_truth
    from controller.sim.fleet_runner import run_fleet_controllers

    futures: dict[str, Future] = {}
    pool = None
    if baselines:
        pool = ProcessPoolExecutor(max_workers=2)
        dump = scenario.model_dump(mode="json")
        for name, on in (("always-on", True), ("always-off", False)):
            futures[name] = pool.submit(baseline, dump, str(cal_file), server, replicas, router, on)
    try:
        result = run_fleet_controllers(
            scenario,
            demo_truth.server_costs(server, model),
            model,
            replicas,
            router,
            max_unavailable=max_unavailable,
            on_tick=on_tick,
        )
        rows = {"controller": result.summary()}
        t, lat = windowed(result.fleet, scenario.duration_s)
        windows = {"controller": lat.tolist()}
        for name, fut in futures.items():
            got = fut.result()
            rows[name] = got["summary"]
            windows[name] = got["window_latency"]
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return FleetComparison(result, rows, t, windows)


def print_table(rows: dict[str, dict], replicas: int, router: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"fleet of {replicas} behind a {router} router: controllers vs static fleets")
    cols = ("policy", "mean latency s", "p99 latency s", "restarts", "max restarting", "lost", "SD on")
    for col in cols:
        t.add_column(col, justify="right" if col != "policy" else "left")
    for name, s in rows.items():
        t.add_row(
            name,
            f"{s['mean_latency_s']:.2f}",
            f"{s['p99_latency_s']:.2f}",
            f"{s['toggles']:.0f}",
            f"{s['max_restarting']:.0f}",
            f"{s['lost']:.0f}",
            f"{100 * s['sd_on_fraction']:.0f}%",
        )
    console = Console()
    if not console.is_terminal:
        console = Console(width=120)
    console.print(t)


def verdict(rows: dict[str, dict], replicas: int, max_unavailable: int) -> str:
    """One line: the controllers' fleet against each static fleet, and its restarts."""
    c = rows["controller"]["mean_latency_s"]
    parts = []
    for name in ("always-on", "always-off"):
        if name in rows:
            b = rows[name]["mean_latency_s"]
            change = (b - c) / b if b > 0 and math.isfinite(b) else math.nan
            parts.append(f"{'beat' if change > 0 else 'lost to'} {name} by {abs(change) * 100:.1f} % ({b:.2f} s)")
    n = int(rows["controller"]["toggles"])
    most = int(rows["controller"]["max_restarting"])
    vs = "; ".join(parts) if parts else "no baselines"
    return (
        f"fleet of {replicas}: controllers {c:.2f} s mean latency, {vs}; {n} restart{'s' if n != 1 else ''}, "
        f"at most {most} at once (max_unavailable {max_unavailable})"
    )


def plot(result, t_windows, windows: dict[str, list], path: Path) -> None:
    """Rate, replicas on SD and restarting, and the windowed mean latency of each fleet."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fleet = result.fleet
    tl = [e.timeline_arrays() for e in fleet.engines]
    t = tl[0]["t"] / 3600
    sd = np.sum([x["sd_on"] for x in tl], axis=0)
    down = np.sum([1 - x["serving"] for x in tl], axis=0)
    rate = len(fleet.engines) * result.scenario.arrival_rate.evaluate(tl[0]["t"])
    fig, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    axes[0].plot(t, rate, color="0.5", lw=1, label="fleet arrival rate")
    axes[0].set_ylabel("req/s")
    axes[0].legend(loc="upper left")
    axes[1].step(t, sd, where="post", color="C1", label="replicas on SD")
    axes[1].fill_between(t, down, step="post", color="C3", alpha=0.6, label="restarting")
    axes[1].set_ylabel("replicas")
    axes[1].legend(loc="upper left")
    for name, lat in windows.items():
        axes[2].plot(t_windows / 3600, lat, lw=1.2, label=name)
    axes[2].set_yscale("log")
    axes[2].set_ylabel("mean latency s (10 min)")
    axes[2].set_xlabel("simulated hours")
    axes[2].legend(loc="upper left")
    fig.suptitle(f"sd-controller fleet demo: {result.scenario.name}, {len(fleet.engines)} replicas")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
