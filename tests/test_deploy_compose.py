"""The compose example is wired consistently: services, ports, mounts and scrape targets."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

COMPOSE_DIR = Path(__file__).resolve().parents[1] / "deploy" / "compose"
COMPOSE = yaml.safe_load((COMPOSE_DIR / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def test_services() -> None:
    assert set(SERVICES) == {"simulator", "controller", "prometheus", "grafana"}
    # The simulator's own argument parser accepts the compose command, and it listens beyond loopback.
    import argparse

    from controller.commands import simulate as serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(SERVICES["simulator"]["command"][1:])
    assert SERVICES["simulator"]["command"][0] == "simulate"
    assert (args.host, args.port, args.admin_port) == ("0.0.0.0", 8000, 8091)
    assert SERVICES["controller"]["command"] == ["run"]
    assert SERVICES["simulator"]["image"] == SERVICES["controller"]["image"]


def test_controller_points_at_the_simulator() -> None:
    env = SERVICES["controller"]["environment"]
    assert env["SD_CONTROLLER_VLLM_METRICS_URL"] == "http://simulator:8000/metrics"
    assert env["SD_CONTROLLER_HOOK_URL"] == "http://simulator:8091"  # the simulator's --admin-port
    assert all(k.startswith("SD_CONTROLLER_") for k in env)
    # The token the controller reads is the one the simulator's admin API expects.
    secret_file = COMPOSE_DIR / COMPOSE["secrets"]["sd_admin_token"]["file"]
    assert env["SD_CONTROLLER_HOOK_TOKEN_FILE"] == "/run/secrets/sd_admin_token"
    token = secret_file.read_text().strip()
    assert SERVICES["simulator"]["environment"]["SD_LAUNCHER_ADMIN_TOKEN"] == token


def test_bind_mounts_exist() -> None:
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE_DIR / source).exists(), f"{name}: {source} does not exist"


def test_prometheus_scrapes_the_compose_services() -> None:
    command = SERVICES["prometheus"]["command"]
    config_arg = next(c for c in command if c.startswith("--config.file="))
    mount = next(v for v in SERVICES["prometheus"]["volumes"] if v.startswith("../prometheus"))
    host_dir, container_dir = mount.split(":")[:2]
    config_path = COMPOSE_DIR / host_dir / Path(config_arg.split("=", 1)[1]).relative_to(container_dir)
    config = yaml.safe_load(config_path.read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {"simulator:8000", "controller:9464"}
    for rule_file in config["rule_files"]:
        assert (config_path.parent / rule_file).exists()
    # Both targets carry the pod label the dashboard and rules group by.
    for job in config["scrape_configs"]:
        assert job["static_configs"][0]["labels"]["pod"] == "replica-0"


def test_grafana_is_provisioned_with_the_dashboard() -> None:
    volumes = SERVICES["grafana"]["volumes"]
    assert any(v.startswith("../grafana/dashboards:") for v in volumes)
    assert any(v.startswith("../grafana/provisioning:") for v in volumes)
    provider = yaml.safe_load((COMPOSE_DIR / "../grafana/provisioning/dashboards/sd-controller.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert any(v.split(":")[1] == path for v in volumes)


def test_controller_environment_loads_as_settings(monkeypatch) -> None:
    import controller.settings as settings_mod

    for name in [k for k in os.environ if k.startswith(settings_mod.ENV_PREFIX)]:
        monkeypatch.delenv(name)
    env = SERVICES["controller"]["environment"]
    for key, value in env.items():
        # compose interpolation: ${VAR:-default} -> default
        if isinstance(value, str) and value.startswith("${") and ":-" in value:
            value = value.split(":-", 1)[1].rstrip("}")
        monkeypatch.setenv(key, str(value))
    settings = settings_mod.load_settings()
    assert settings.vllm_metrics_url == "http://simulator:8000/metrics"
