"""The controller image, built for real (buildah, base from Debian packages) and run.

In CI scripts/test.sh installs buildah and mmdebstrap (Debian packages); a skip there fails
the run. About 1.5 minutes: the base (40 s, cached in local storage afterwards), the build
(30 s, dependencies from PyPI) and two commands.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from tests.support import container
from tests.support.prometheus import free_port

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.container, pytest.mark.slow]


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    missing = container.tools_missing()
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (apt-get install -y buildah mmdebstrap)")
    if os.geteuid() != 0:
        pytest.skip("building the base with mmdebstrap --mode=root needs root")
    container.build_base(tmp_path_factory.mktemp("base"))
    container.build_image(ROOT)
    return container.IMAGE


@pytest.fixture
def simulator():
    port, admin_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "controller.cli", "simulate", "--port", str(port), "--admin-port", str(admin_port),
         "--insecure-no-token", "--scenario", "always-low"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if requests.get(url, timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.2)
        else:
            raise AssertionError("the simulator did not serve /metrics within 30 s")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_image_runs_help(image):
    with container.Container() as ctr:
        proc = ctr.run(["sd-controller", "--help"])
        assert proc.returncode == 0, proc.stderr
        assert "Switch speculative decoding" in proc.stdout
        who = ctr.run(["id", "-u"])
        assert who.stdout.strip() == "10001", "the image runs as its non-root user"


def test_image_decides_once_against_the_simulator(image, simulator):
    env = {
        "SD_CONTROLLER_VLLM_METRICS_URL": simulator,
        "SD_CONTROLLER_CALIBRATION_FILE": "example",
        "SD_CONTROLLER_HOOK_TYPE": "none",
        "SD_CONTROLLER_STATE_FILE": "/var/lib/sd-controller/state.json",
        "SD_CONTROLLER_RATE_WINDOW_S": "3",
        "SD_CONTROLLER_LOG_FORMAT": "json",
    }
    with container.Container() as ctr:
        proc = ctr.run(["sd-controller", "run", "--once", "--dry-run"], env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("decision: "), proc.stdout
    assert "warming_up" not in proc.stdout and "unreachable" not in proc.stdout, proc.stdout
    assert "predicted speedup" in proc.stdout, proc.stdout
