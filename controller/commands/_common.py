"""Small helpers shared by subcommands: list parsing, JSON numbers, error exits."""

from __future__ import annotations

import argparse
import functools
import math
import sys
from collections.abc import Callable

from controller.errors import EXIT_USAGE, InputError


def finite_or_none(x: float | None) -> float | None:
    """JSON has no infinity: an overloaded or unknown number becomes null."""
    return None if x is None or not math.isfinite(x) else x


def float_list(option: str) -> Callable[[str], list[float]]:
    def parse(text: str) -> list[float]:
        try:
            values = [float(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{option}: {text!r} is not a comma-separated list of numbers") from None
        if not values or any(v != v or v < 0 for v in values):
            raise argparse.ArgumentTypeError(f"{option}: values must be numbers >= 0")
        return values

    return parse


def int_list(option: str, minimum: int = 1) -> Callable[[str], list[int]]:
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{option}: {text!r} is not a comma-separated list of integers") from None
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(f"{option}: values must be integers >= {minimum}")
        return values

    return parse


def exits_on_input_error(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn an InputError into its one line on stderr and exit code 2."""

    @functools.wraps(run)
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except InputError as exc:
            print(f"sd-controller {args.command}: error: {exc}", file=sys.stderr)
            return EXIT_USAGE

    return wrapper
