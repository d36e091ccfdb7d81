"""promtool accepts the shipped rules and configs, and the alert unit tests pass."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.prometheus import promtool_binary

pytestmark = pytest.mark.prometheus

PROM_DIR = Path(__file__).resolve().parents[1] / "deploy" / "prometheus"
RULES = [PROM_DIR / "recording-rules.yml", PROM_DIR / "alert-rules.yml"]


@pytest.fixture(scope="module")
def promtool() -> str:
    binary = promtool_binary()
    if binary is None:
        pytest.skip("promtool not found (apt-get install -y prometheus)")
    return binary


def run(promtool: str, *args: str | Path, cwd: Path = PROM_DIR) -> subprocess.CompletedProcess:
    return subprocess.run([promtool, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_check_rules(promtool: str) -> None:
    result = run(promtool, "check", "rules", *RULES)
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_unit_tests_pass(promtool: str) -> None:
    result = run(promtool, "test", "rules", "tests/alert-rules.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_every_alert_has_a_firing_and_a_silent_unit_test() -> None:
    alerts = {
        r["alert"]
        for g in yaml.safe_load((PROM_DIR / "alert-rules.yml").read_text())["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    tests = yaml.safe_load((PROM_DIR / "tests" / "alert-rules.test.yml").read_text())["tests"]
    fires, silent = set(), set()
    for case in tests:
        for check in case.get("alert_rule_test", []):
            (fires if check["exp_alerts"] else silent).add(check["alertname"])
    assert alerts - fires == set(), "alerts without a firing test"
    assert alerts - silent == set(), "alerts without a not-firing test"


def test_a_broken_unit_test_fails(promtool: str, tmp_path: Path) -> None:
    """The unit tests can fail: flip one expectation and promtool must say so."""
    tests = yaml.safe_load((PROM_DIR / "tests" / "alert-rules.test.yml").read_text())
    case = next(c for c in tests["tests"] if c["name"].startswith("five toggles"))
    case["alert_rule_test"][0]["exp_alerts"] = []
    tests["tests"] = [case]
    tests["rule_files"] = [str(p) for p in RULES]
    broken = tmp_path / "broken.test.yml"
    broken.write_text(yaml.safe_dump(tests))
    result = run(promtool, "test", "rules", broken, cwd=tmp_path)
    assert result.returncode != 0


def test_check_compose_config(promtool: str) -> None:
    result = run(promtool, "check", "config", "prometheus-compose.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_check_kubernetes_config(promtool: str, tmp_path: Path) -> None:
    result = run(promtool, "check", "config", "prometheus.yml")
    if result.returncode != 0 and "kubernetes_sd_configs" in result.stdout + result.stderr:
        # Debian's build has no Kubernetes service discovery: check everything else by
        # swapping the discovery for a static target list.
        config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
        for job in config["scrape_configs"]:
            assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}]
            job["static_configs"] = [{"targets": ["127.0.0.1:8000"]}]
        config["rule_files"] = [str(p) for p in RULES]
        swapped = tmp_path / "prometheus.yml"
        swapped.write_text(yaml.safe_dump(config))
        result = run(promtool, "check", "config", swapped, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
