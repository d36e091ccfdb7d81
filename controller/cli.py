"""Command-line entry point: argument parsing and dispatch only.

Each subcommand lives in its own module of :mod:`controller.commands`, exposing
``add_arguments(parser)`` and ``run(args) -> int``; modules are imported lazily so
``sd-controller predict`` does not pay for the launcher, the simulator or matplotlib.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from controller import __version__
from controller.errors import EXIT_RUNTIME, EXIT_USAGE

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "predict": (
        "controller.commands.predict",
        "what-if table: speedup vs arrival rate and draft length",
    ),
    "calibrate": (
        "controller.commands.calibrate",
        "fit a calibration file from a micro-benchmark CSV",
    ),
    "validate": (
        "controller.commands.validate",
        "compare a calibration's predictions with a load test (per run, per mode, break-even)",
    ),
    "run": ("controller.commands.run", "run the controller daemon next to one vLLM server"),
    "launch": (
        "controller.commands.launch",
        "run vLLM as a child process with an admin API to toggle SD",
    ),
    "bench": (
        "controller.commands.bench",
        "micro-benchmark or load-test a running vLLM server into the CSVs calibrate reads",
    ),
    "demo": ("controller.commands.demo", "simulated day: the controller vs always-on and always-off"),
    "simulate": ("controller.commands.simulate", "serve a simulated vLLM (/metrics + admin API) over HTTP"),
    "backtest": ("controller.commands.backtest", "replay history through the decision logic"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sd-controller",
        description="Switch speculative decoding on a vLLM server on and off as its load changes.",
    )
    parser.add_argument("--version", action="version", version=f"sd-controller {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = sys.argv[1] if len(sys.argv) > 1 else None
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        # Only import the module whose arguments we need (or all of them for --help).
        if wanted in (name, None, "-h", "--help"):
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as exc:
                if exc.name and module_name.startswith(exc.name):
                    p.set_defaults(_missing=module_name)
                    continue
                raise
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:])
    if not getattr(args, "command", None):
        parser.print_help()
        return EXIT_USAGE
    if getattr(args, "_missing", None):
        print(
            f"sd-controller: command {args.command!r} is not available in this build",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        return int(args._run(args) or 0)
    except BrokenPipeError:
        # The reader left (`predict --json | head`): the rest of the output has nowhere to go.
        # Point stdout at /dev/null so the interpreter's last flush does not fail again, and
        # exit 1 without a traceback, as rich's console does for the tables.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_RUNTIME


if __name__ == "__main__":
    sys.exit(main())
