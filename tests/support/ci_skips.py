"""pytest plugin: in CI (``CI`` set to a true value) a skipped test fails the run.

A skip there means a missing tool or dependency, i.e. a setup bug that would otherwise hide
the test for good. The one exception: real-vLLM tests when ``SD_SKIP_VLLM=1`` says the run
chose to go without the vLLM venv.
"""

from __future__ import annotations

import os

import pytest

_skipped: list[str] = []


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _allowed(report: pytest.TestReport) -> bool:
    return os.environ.get("SD_SKIP_VLLM") == "1" and "vllm" in report.keywords


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail") and not _allowed(report):
        _skipped.append(report.nodeid)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if in_ci() and _skipped:
        terminalreporter.write_line(
            f"CI: {len(_skipped)} skipped test(s) fail the run (a skip in CI is a setup bug): "
            + ", ".join(_skipped[:10]),
            red=True,
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if in_ci() and _skipped and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
