"""Files that ship inside the package (``controller/data/``) and how a setting names one.

Shared by the commands, the simulator and the benchmarks: ``example`` wherever a calibration
file is asked for means the shipped example (a simulated H100, not a measurement).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

EXAMPLE_CALIBRATION = "example"


def example_calibration_path() -> Path:
    """The shipped example calibration file."""
    return Path(str(resources.files("controller") / "data" / "example-calibration.json"))


def calibration_path(value: str) -> Path:
    """``example`` names the shipped example calibration; anything else is a path."""
    return example_calibration_path() if value == EXAMPLE_CALIBRATION else Path(value)
