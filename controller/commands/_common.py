"""Small helpers shared by subcommands: list parsing, JSON numbers, error exits."""

from __future__ import annotations

import argparse
import functools
import io
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from controller.atomic import write_bytes_atomic
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
        if not values or any(not math.isfinite(v) or v < 0 for v in values):
            raise argparse.ArgumentTypeError(f"{option}: values must be finite numbers >= 0")
        return values

    return parse


def finite_float(text: str) -> float:
    """An option's number; NaN and infinity are no setting (argparse names the option)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def check_plot_path(option: str, path: Path | None) -> None:
    """InputError unless ``path``'s suffix names an image format matplotlib writes: checked
    before the work, not after it."""
    if path is None:
        return
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = FigureCanvasBase.get_supported_filetypes()
    kind = path.suffix.lstrip(".").lower()
    if kind not in kinds:
        raise InputError(f"{option} {path}: unknown image format {kind!r} (one of {', '.join(sorted(kinds))})")


def save_plot(fig: Any, path: Path, dpi: int, option: str = "--plot") -> None:
    """Write a figure atomically (a failed write leaves no half an image); one line on failure."""
    buf = io.BytesIO()
    fig.savefig(buf, format=path.suffix.lstrip(".").lower() or "png", dpi=dpi)
    try:
        write_bytes_atomic(path, buf.getvalue())
    except OSError as exc:
        raise InputError(f"{option} {path}: cannot write: {exc.strerror or exc}") from None


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
