"""Run one of bench/'s scripts as a user would: a subprocess in the repository root."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_bench(script: str, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """``python bench/SCRIPT ARGS`` from the repository root, output captured."""
    return subprocess.run(
        [sys.executable, f"bench/{script}", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s
    )
