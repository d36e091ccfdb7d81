"""In CI a skip fails the run; outside CI it is only reported."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = """
import pytest

def test_ok():
    pass

def test_skipped():
    pytest.skip("no such tool")

@pytest.mark.vllm
def test_vllm():
    pytest.skip("no vLLM venv")
"""


def run_sample(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    clean = {k: v for k, v in os.environ.items() if k not in ("CI", "SD_SKIP_VLLM")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.support.ci_skips", "-p", "no:cacheprovider",
         "-o", "markers=vllm", str(tmp_path / "test_sample.py"), *(["-k", "not test_skipped"] if env.pop("only_vllm", "") else [])],
        cwd=tmp_path, env={**clean, "PYTHONPATH": str(ROOT), **env}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("env", "code"),
    [
        ({}, 0),  # a developer's machine: skips are reported, not fatal
        ({"CI": "true"}, 1),
        ({"CI": "true", "SD_SKIP_VLLM": "1"}, 1),  # the other skip still fails
        ({"CI": "true", "SD_SKIP_VLLM": "1", "only_vllm": "1"}, 0),  # vLLM skipped on purpose
    ],
)
def test_skip_fails_only_in_ci(tmp_path, env, code):
    proc = run_sample(tmp_path, **env)
    assert proc.returncode == code, proc.stdout + proc.stderr
