"""``sd-controller demo``: a simulated day with the real controller, against always-on and
always-off.

The controller (``controller.loop.Controller``, unchanged) scrapes the simulator's /metrics
text and toggles SD through an in-simulation hook, on a simulated clock. The two baselines run
in worker processes meanwhile (:mod:`controller.sim.comparison`). Prints a live view, then a
comparison table and a one-line verdict, and writes a timeline plot (PNG) and the numbers
(JSON) to ``--out``.

By default the simulated server is the independent truth (GPU roofline,
:mod:`controller.sim.demo_truth`) and the controller believes a calibration measured from it by
bench → calibrate; with ``--calibration FILE`` (or ``example``) the server runs on that
calibration's own model.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

from controller.commands._common import exits_on_input_error
from controller.errors import EXIT_OK, InputError
from controller.shipped import EXAMPLE_CALIBRATION, calibration_path
from controller.sim.demo_truth import TRUTH


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
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="N > 1: a fleet of N replicas behind a router, each with its own controller, every replica seeing "
        "the scenario's load (the fleet N times it), against always-on and always-off fleets (default 1)",
    )
    parser.add_argument(
        "--router", default="lor", choices=("rr", "lor"), help="fleet: round-robin or least outstanding requests"
    )
    parser.add_argument(
        "--max-unavailable", type=int, default=1, help="fleet: replicas allowed to restart at once (default 1)"
    )


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
    from controller.sim import comparison, demo_truth

    started = time.perf_counter()
    if args.replicas < 1 or args.replicas > 64:
        raise InputError(f"--replicas {args.replicas}: expected 1 to 64")
    if not 1 <= args.max_unavailable <= args.replicas:
        raise InputError(f"--max-unavailable {args.max_unavailable}: expected 1 to --replicas ({args.replicas})")
    scenario, model, cal_file, example, server = _load(args)
    if args.replicas > 1:
        return _run_fleet(args, scenario, model, cal_file, example, server, started)
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

    with LiveView(scenario) as view:
        got = comparison.compare(
            scenario, model, cal_file, baselines=not args.no_baselines, on_tick=view.update, server=server
        )
    comparison.print_table(got.rows)
    cost_s, aborted = (
        demo_truth.restart_cost(got.result.engine.restart_log, demo_truth.requests_of(got.result), got.requests)
        if len(got.requests) == 2
        else (math.nan, got.result.engine.lost)
    )
    line = demo_truth.verdict(got.rows, cost_s, aborted)
    print(line)
    plot = out / "timeline.png"
    comparison.plot(got.result, got.t_windows, got.windows, plot, model)
    (out / "summary.json").write_text(
        json.dumps(
            {
                "scenario": scenario.name,
                "calibration": str(cal_file),
                "server": server,
                "runs": got.rows,
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
    return EXIT_OK


class FleetProgress:
    """One line per simulated hour and per restart requested (the fleet's state in brief)."""

    def __init__(self, scenario, stream=None) -> None:
        self.scenario = scenario
        self.stream = stream or sys.stdout
        self.last_t = -math.inf

    def __call__(self, records, fleet) -> None:
        t = records[0].t
        acted = [f"replica-{i} {r.action}" for i, r in enumerate(records) if r.action != "none"]
        if not acted and t - self.last_t < 3600 and t < self.scenario.duration_s:
            return
        self.last_t = t if not acted else self.last_t
        rates = [r.observed_rate_rps for r in records if r.observed_rate_rps is not None]
        sd = sum(e.applied.enabled for e in fleet.engines)
        down = sum(not e.serving for e in fleet.engines)
        print(
            f"t={_hms(t)} rate/replica={_fmt(sum(rates) / len(rates) if rates else None, '{:.2f}')} req/s "
            f"SD on {sd}/{len(fleet.engines)} restarting {down} restarts={sum(e.restart_count for e in fleet.engines)}"
            + (f" ({', '.join(acted)})" if acted else ""),
            file=self.stream,
            flush=True,
        )


def _run_fleet(args, scenario, model, cal_file, example, server, started) -> int:
    """``demo --replicas N``: the fleet of controllers against always-on and always-off fleets."""
    from controller.sim import fleet_comparison

    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"--out {out}: cannot create directory: {exc.strerror or exc}") from None
    quiet_logs()
    n = args.replicas
    if example:
        print("EXAMPLE calibration (not measured): the numbers show the mechanism, not your GPU")
    print(
        f"scenario {scenario.name}: {scenario.description} ({scenario.duration_s / 3600:g} h simulated), "
        f"per replica; the fleet of {n} behind a {args.router} router receives {n}× that"
    )
    if server == TRUTH:
        print(
            f"servers: {n} simulated H100s, Llama-3.1-8B + Llama-3.2-1B draft (GPU roofline); each controller "
            f"calibrated from it by bench -> calibrate ({cal_file.name}); at most {args.max_unavailable} restarting"
        )
    got = fleet_comparison.compare(
        scenario,
        model,
        cal_file,
        n,
        args.router,
        server=server,
        baselines=not args.no_baselines,
        on_tick=FleetProgress(scenario),
        max_unavailable=args.max_unavailable,
    )
    fleet_comparison.print_table(got.rows, n, args.router)
    line = fleet_comparison.verdict(got.rows, n, args.max_unavailable)
    print(line)
    plot = out / "timeline.png"
    fleet_comparison.plot(got.result, got.t_windows, got.windows, plot)
    (out / "summary.json").write_text(
        json.dumps(
            {
                "scenario": scenario.name,
                "calibration": str(cal_file),
                "server": server,
                "replicas": n,
                "router": args.router,
                "max_unavailable": args.max_unavailable,
                "runs": got.rows,
                "verdict": line,
                "wall_s": time.perf_counter() - started,
            },
            indent=2,
            default=lambda x: None,
        )
        + "\n",
        encoding="utf-8",
    )
    print(f"wrote {plot} and {out / 'summary.json'} ({time.perf_counter() - started:.0f} s)")
    return EXIT_OK
