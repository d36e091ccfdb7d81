"""``sd-controller demo``: a simulated day with the real controller, against always-on and
always-off.

By default the simulated server is the independent truth (GPU roofline, controller/sim/
demo_truth.py) and the controller believes a calibration measured from it by bench → calibrate;
with ``--calibration FILE`` (or ``example``) the server runs on that calibration's own model.

The controller (``controller.loop.Controller``, unchanged) scrapes the simulator's /metrics
text and toggles SD through an in-simulation hook, on a simulated clock. The two baselines run
in worker processes meanwhile. Prints a live view, then a comparison table, and writes a
timeline plot (PNG) and the numbers (JSON) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path

import numpy as np

from controller.commands._common import EXAMPLE_CALIBRATION, calibration_path, exits_on_input_error
from controller.errors import InputError
from controller.sim.demo_truth import TRUTH

WINDOW_S = 600.0  # latency plot resolution


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", default="demo-day", help="built-in scenario name or YAML file (default demo-day)")
    parser.add_argument(
        "--calibration",
        default=TRUTH,
        help=f"'{TRUTH}' (default: server on the simulated H100 truth, controller calibrated from it by bench → "
        f"calibrate), a calibration JSON or '{EXAMPLE_CALIBRATION}' (server on that calibration's own model)",
    )
    parser.add_argument(
        "--out", default="sd-demo-out", help="directory for the plot and numbers (default ./sd-demo-out)"
    )
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: the scenario's)")
    parser.add_argument("--no-baselines", action="store_true", help="run the controller only")


def quiet_logs() -> None:
    """The controller logs every decision; the demo shows them in its own view instead."""
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))


def _load(args: argparse.Namespace):
    from controller import calibration
    from controller.sim import demo_truth, scenarios

    scenario = scenarios.load(args.scenario)
    if args.seed is not None:
        scenario = scenario.with_changes(seed=args.seed)
    if args.calibration == TRUTH:
        scenario = demo_truth.truth_scenario(scenario)
        cal_file, server = demo_truth.truth_calibration_path(), TRUTH
    else:
        cal_file, server = calibration_path(args.calibration), "calibration"
    cal = calibration.load(cal_file)
    return scenario, cal.latency_model(), cal_file, bool(cal.example), server


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


def _baseline(scenario_dump: dict, cal_file: str, enabled: bool, server: str = "calibration") -> dict:
    """Worker process: one always-on/off run, reduced to what the table, plot and restart
    pricing need."""
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


class LiveView:
    """A rich live panel on a terminal; plain progress lines otherwise."""

    def __init__(self, scenario, stream=None) -> None:
        from rich.console import Console

        self.console = Console(file=stream or sys.stdout)
        self.tty = self.console.is_terminal
        self.scenario = scenario
        self.toggles = 0
        self.last_line_t = -math.inf
        self._live = None
        self.started = time.perf_counter()

    def __enter__(self) -> LiveView:
        if self.tty:
            from rich.live import Live

            self._live = Live(self._render(None, None), console=self.console, refresh_per_second=8)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)

    def _render(self, rec, engine):
        from rich.table import Table

        table = Table(title=f"sd-controller demo: {self.scenario.name}", show_header=False, min_width=60)
        if rec is None:
            table.add_row("starting", "")
            return table
        frac = rec.t / self.scenario.duration_s
        bar = "█" * int(30 * frac) + "·" * (30 - int(30 * frac))
        table.add_row("simulated time", f"{_hms(rec.t)}  {bar} {100 * frac:4.0f}%")
        table.add_row("arrival rate (observed)", _fmt(rec.observed_rate_rps, "{:.2f} req/s"))
        table.add_row("acceptance (vLLM rate)", _fmt(rec.acceptance_rate, "{:.3f}"))
        table.add_row("predicted speedup", _fmt(rec.predicted_speedup, "{:.2f}x"))
        state = "ON" if rec.applied_enabled else "off"
        table.add_row("SD", state + ("" if rec.serving else "  (restarting)"))
        table.add_row("last decision", f"{rec.action} ({rec.reason})")
        table.add_row("toggles / requests lost", f"{engine.restart_count} / {engine.lost}")
        table.add_row("running / waiting", f"{engine.running} / {engine.waiting}")
        return table

    def update(self, rec, engine) -> None:
        if self._live is not None:
            self._live.update(self._render(rec, engine))
            return
        if rec.action != "none" or rec.t - self.last_line_t >= 3600 or rec.t >= self.scenario.duration_s:
            self.last_line_t = rec.t
            print(
                f"t={_hms(rec.t)} rate={_fmt(rec.observed_rate_rps, '{:.2f}')} req/s "
                f"acceptance={_fmt(rec.acceptance_rate, '{:.3f}')} speedup={_fmt(rec.predicted_speedup, '{:.2f}')} "
                f"sd={'on' if rec.applied_enabled else 'off'} action={rec.action} reason={rec.reason} "
                f"toggles={engine.restart_count}",
                file=self.console.file,
                flush=True,
            )


def _fmt(v, spec: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    return spec.format(v)


def _hms(t: float) -> str:
    t = int(t)
    return f"{t // 3600:02d}:{t % 3600 // 60:02d}:{t % 60:02d}"


@exits_on_input_error
def run(args: argparse.Namespace) -> int:
    from controller.sim import demo_truth, runner

    started = time.perf_counter()
    scenario, model, cal_file, example, server = _load(args)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"--out {out}: cannot create directory: {exc.strerror or exc}") from None
    quiet_logs()
    if example:
        print("EXAMPLE calibration (not measured): the numbers show the mechanism, not your GPU")
    print(f"scenario {scenario.name}: {scenario.description} ({scenario.duration_s / 3600:g} h simulated)")
    if server == TRUTH:
        print(
            "server: simulated H100, Llama-3.1-8B + Llama-3.2-1B draft (GPU roofline); controller calibrated "
            f"from it by bench -> calibrate ({cal_file.name})"
        )
    else:
        print(f"server: simulated on {cal_file.name}'s own model (the controller is graded on its own assumptions)")

    futures: dict[str, Future] = {}
    pool = None
    if not args.no_baselines:
        pool = ProcessPoolExecutor(max_workers=2)
        dump = scenario.model_dump(mode="json")
        futures["always-on"] = pool.submit(_baseline, dump, str(cal_file), True, server)
        futures["always-off"] = pool.submit(_baseline, dump, str(cal_file), False, server)
    requests = {}
    try:
        with LiveView(scenario) as view:
            result = runner.run_controller(
                scenario, demo_truth.server_costs(server, model), controller_model=model, on_tick=view.update
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

    _print_table(rows)
    cost_s, aborted = (
        demo_truth.restart_cost(result.engine.restart_log, demo_truth.requests_of(result), requests)
        if len(requests) == 2
        else (math.nan, result.engine.lost)
    )
    line = demo_truth.verdict(rows, cost_s, aborted)
    print(line)
    plot = out / "timeline.png"
    _plot(result, t_ctl, windows, plot, model)
    (out / "summary.json").write_text(
        json.dumps(
            {
                "scenario": scenario.name,
                "calibration": str(cal_file),
                "server": server,
                "runs": rows,
                "verdict": line,
                "restart_cost_request_s": cost_s,
                "wall_s": time.perf_counter() - started,
            },
            indent=2,
            default=lambda x: None,
        )
        + "\n",
        encoding="utf-8",
    )
    print(f"wrote {plot} and {out / 'summary.json'} ({time.perf_counter() - started:.0f} s)")
    return 0


def _print_table(rows: dict[str, dict]) -> None:
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


def _plot(result, t_windows, windows: dict[str, list], path: Path, model) -> None:
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
