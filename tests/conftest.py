"""Shared fixtures: a real Prometheus (``prometheus_bin``, ``prometheus_server``) and a fake
vLLM /metrics server (``fake_vllm``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest
import structlog
from hypothesis import settings

# `tests` has no __init__.py, so pytest puts tests/ (not the repo root) on sys.path; the root
# is needed for `tests.support` and, before `pip install -e .`, for `controller`.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.support.etcd import EtcdServer, etcd_binary  # noqa: E402
from tests.support.fake_vllm import FakeVllmServer  # noqa: E402
from tests.support.prometheus import ENV_BIN, PrometheusServer, prometheus_binary  # noqa: E402

PrometheusFactory = Callable[..., PrometheusServer]

# In CI a skipped test fails the run (see tests/support/ci_skips.py).
pytest_plugins = ["tests.support.ci_skips"]

# In CI the property tests draw the same examples every run (seeded by each test): what passed on
# a clean clone before landing passes in CI. Elsewhere they draw new ones, which is how a case
# such as the NaN a hair below the limit (tests/test_model.py) was found.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(scope="session")
def prometheus_bin() -> str:
    """Path of the Prometheus binary; skips the test when there is none.

    CI installs it (``apt-get install prometheus``), so a skip there is a setup bug.
    """
    binary = prometheus_binary()
    if binary is None:
        pytest.skip(f"prometheus binary not found on PATH or in ${ENV_BIN} (install: apt-get install -y prometheus)")
    return binary


@pytest.fixture
def fake_vllm() -> Iterator[FakeVllmServer]:
    """A started FakeVllmServer (model "tiny", SD enabled with 4 positions)."""
    with FakeVllmServer() as server:
        yield server


@pytest.fixture
def prometheus_server(prometheus_bin: str, tmp_path: Path) -> Iterator[PrometheusFactory]:
    """Factory: ``prometheus_server(targets, rule_files=(), scrape_interval_s=1.0)`` starts a
    PrometheusServer under tmp_path; every server it started is stopped at teardown."""
    started: list[PrometheusServer] = []

    def start(
        targets: Mapping[str, Sequence[str]],
        rule_files: Sequence[Path] = (),
        scrape_interval_s: float = 1.0,
    ) -> PrometheusServer:
        server = PrometheusServer(
            tmp_path / f"prometheus-{len(started)}",
            targets,
            scrape_interval_s=scrape_interval_s,
            rule_files=rule_files,
        )
        started.append(server)
        server.start()
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def etcd_server(tmp_path: Path) -> Iterator[EtcdServer]:
    """A started etcd on 127.0.0.1 (random ports, data under tmp_path), stopped at teardown.

    Skips when there is no etcd binary; CI installs it (``apt-get install etcd-server``).
    """
    if etcd_binary() is None:
        pytest.skip("etcd binary not found on PATH or in $SD_ETCD_BIN (install: apt-get install -y etcd-server)")
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _structlog_reset():
    """Each test starts from structlog's defaults: a test that configures logging (a command
    run in-process) must not leak its configuration into the next one."""
    yield
    structlog.reset_defaults()
