"""The real exporter exposes what deploy/ (dashboard, rules, alerts) and the fake exporter the
PromQL tests scrape assume: same names, types and label names; labelled counters born at 0."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

import controller.exporter as exporter_mod
from tests.support.controller_metrics import METRICS

KIND_TO_TYPE = {"gauge": "gauge", "counter": "counter", "enum": "stateset", "info": "info"}


@pytest.fixture
def registry() -> CollectorRegistry:
    from controller.coordination.gate import RestartGate
    from controller.coordination.none import NoCoordinator

    registry = CollectorRegistry()
    exporter_mod.Exporter(registry)
    RestartGate(NoCoordinator(), "r").register(registry)  # every daemon has one (run.build)
    return registry


def test_every_metric_the_deploy_kit_uses_exists_with_its_type(registry) -> None:
    families = {f.name: f.type for f in registry.collect()}
    for name, (kind, _, _) in METRICS.items():
        assert name in families, f"{name}: not exported"
        assert families[name] == KIND_TO_TYPE[kind], f"{name}: {families[name]}, deploy/ assumes {kind}"


def test_label_names_match() -> None:
    registry = CollectorRegistry()
    exporter = exporter_mod.Exporter(registry)
    wrappers = {m._name: m for m in vars(exporter).values() if isinstance(m, MetricWrapperBase)}
    for name, (kind, labels, _) in METRICS.items():
        if kind in ("gauge", "counter") and name in wrappers:
            assert tuple(wrappers[name]._labelnames) == labels, name


def test_toggle_counters_start_at_zero(registry) -> None:
    """increase() ignores a series' first sample: a counter born at 1 on the first toggle
    would hide that toggle from SDFlapping, SDPredictionDrift and the annotations."""
    for direction in ("on", "off"):
        assert registry.get_sample_value("sd_toggles_total", {"direction": direction}) == 0
