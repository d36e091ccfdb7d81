"""``sd-controller backtest``: replay history through the real decision logic.

Two inputs: ``--csv FILE`` (one row per evaluation), or ``--prometheus-url URL --start T
--end T [--step 60s] [--selector ...]`` (the daemon's own PromQL over a time range); see
:mod:`controller.sim.backtest` for how the replay and its predicted gain work.

Exit codes: 0 done; 2 bad input (arguments, times, CSV, settings, calibration, a query
Prometheus rejects, no data in the range); 1 runtime failure (Prometheus unreachable, HTTP 5xx,
not JSON). Each error is one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

from controller.commands._common import exits_on_input_error
from controller.errors import EXIT_OK, EXIT_RUNTIME, InputError
from controller.shipped import EXAMPLE_CALIBRATION, calibration_path
from controller.sim.backtest.history import (
    COLUMNS,
    MAX_STEPS,
    BacktestRuntimeError,
    Step,
    format_time,
    parse_duration,
    parse_time,
    prometheus_steps,
    read_rows,
    steps_from_rows,
)
from controller.sim.backtest.replay import replay
from controller.sim.backtest.report import CAVEAT, plot, print_result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--csv", help=f"observations CSV with columns {', '.join(COLUMNS)}")
    src.add_argument("--prometheus-url", help="Prometheus base URL to read history from (query_range)")
    parser.add_argument("--start", help="Prometheus: start time (unix seconds, ISO 8601 (UTC if no offset), now-6h)")
    parser.add_argument("--end", help="Prometheus: end time (same forms; default now)")
    parser.add_argument(
        "--step", help="Prometheus: seconds between evaluations, e.g. 60s (default: evaluation_interval_s)"
    )
    parser.add_argument(
        "--selector", help='Prometheus: label matchers, e.g. model_name="x" (default: prometheus_selector)'
    )
    parser.add_argument(
        "--config", help="YAML or JSON settings file, as for `run` (environment SD_CONTROLLER_* applies)"
    )
    parser.add_argument(
        "--calibration", default=None, help="calibration JSON, or 'example' (default: calibration_file)"
    )
    parser.add_argument("--plot", default=None, help="write a PNG of rate, predicted speedup and SD state here")
    parser.add_argument("--all-steps", action="store_true", help="print every step, not only the decisions")


def load_backtest_settings(args: argparse.Namespace):
    from controller.settings import load_settings

    overrides: dict = {"hook_type": "none"}  # the replay never calls a hook; its settings do not matter
    if getattr(args, "selector", None) is not None:
        overrides["prometheus_selector"] = args.selector
    return load_settings(getattr(args, "config", None), **overrides)


def _steps_from_args(args: argparse.Namespace, settings) -> tuple[list[Step], str]:
    if args.csv:
        for opt in ("start", "end", "step", "selector"):
            if getattr(args, opt, None) is not None:
                raise InputError(f"--{opt} is for --prometheus-url; a CSV is replayed whole")
        rows = read_rows(Path(args.csv))
        return steps_from_rows(rows), f"CSV {args.csv}"
    parts = urlsplit(args.prometheus_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InputError(f"--prometheus-url {args.prometheus_url!r}: must be an http(s) URL with a host")
    if not args.start:
        raise InputError("--start is required with --prometheus-url")
    start = parse_time(args.start, "--start")
    end = parse_time(args.end, "--end") if args.end else datetime.now(UTC).timestamp()
    if end <= start:
        raise InputError(f"--end ({format_time(end)}) must be after --start ({format_time(start)})")
    step = parse_duration(args.step, "--step") if args.step else settings.evaluation_interval_s
    if step < 0.001:
        raise InputError(f"--step {args.step!r}: must be > 0")
    if (end - start) / step + 1 > MAX_STEPS:
        raise InputError(f"--step {step:g}s gives more than {MAX_STEPS} steps between --start and --end: raise it")
    steps = prometheus_steps(settings, args.prometheus_url, start, end, step)
    sel = settings.prometheus_selector or "(no selector)"
    return steps, f"Prometheus {args.prometheus_url} {sel}, {format_time(start)} .. {format_time(end)} every {step:g}s"


@exits_on_input_error
def run(args: argparse.Namespace) -> int:
    from controller import calibration

    settings = load_backtest_settings(args)
    cal_name = args.calibration or settings.calibration_file or EXAMPLE_CALIBRATION
    cal = calibration.load(calibration_path(cal_name))
    model = cal.latency_model(settings.max_num_seqs)
    try:
        steps, what = _steps_from_args(args, settings)
    except BacktestRuntimeError as exc:
        print(f"sd-controller {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    result = replay(settings, model, steps)
    print(f"backtest of {what}: {len(steps)} steps")
    if cal.example:
        print("calibration: the shipped EXAMPLE (a roofline estimate, not a measurement)")
    print(CAVEAT)
    print_result(result, all_steps=args.all_steps)
    if args.plot:
        plot(result, Path(args.plot))
        print(f"wrote {args.plot}")
    return EXIT_OK
