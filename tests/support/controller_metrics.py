"""A stand-in for the controller's /metrics: every metric name the deployment kit relies on,
built with prometheus_client on a fresh CollectorRegistry and served over real HTTP.

The names, types and labels are the contract between the controller's exporter and the
dashboards/alerts in deploy/; tests of deploy/ run against this server, and a test of the
real exporter can compare itself with :data:`METRICS`.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Info, start_http_server

from tests.support.prometheus import free_port

# name as exposed (without _total for counters) -> (kind, label names, help)
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "sd_predicted_speedup": ("gauge", (), "predicted latency(off) / latency(on)"),
    "sd_acceptance_rate": ("gauge", (), "accepted draft tokens / draft tokens (vLLM-style)"),
    "sd_acceptance_source": ("gauge", ("source",), "1 for the acceptance in use"),
    "sd_acceptance_age_seconds": ("gauge", (), "age of the acceptance in use"),
    "sd_draft_length": ("gauge", (), "draft length (num_speculative_tokens)"),
    "sd_enabled": ("gauge", (), "SD applied (0/1)"),
    "sd_desired_enabled": ("gauge", (), "SD desired by the policy (0/1)"),
    "sd_effective_batch_size": ("gauge", (), "B = lambda * T"),
    "sd_running_context_tokens": ("gauge", (), "KV tokens the average running sequence reads"),
    "sd_arrival_rate_rps": ("gauge", (), "arrival rate"),
    "sd_break_even_rate_rps": ("gauge", (), "rate where SD on and off tie"),
    "sd_stability_limit_rps": ("gauge", ("mode",), "rate where the queue diverges"),
    "sd_predicted_latency_seconds": ("gauge", ("mode",), "predicted mean latency per mode"),
    "sd_predicted_applied_latency_seconds": ("gauge", (), "predicted latency, applied mode"),
    "sd_observed_latency_seconds": ("gauge", (), "observed mean e2e latency"),
    "sd_controller_state": ("enum", (), "controller state"),
    "sd_toggles": ("counter", ("direction",), "SD switches applied"),
    "sd_controller_observation_failures": ("counter", ("reason",), "failed observations"),
    "sd_controller_last_decision_timestamp_seconds": ("gauge", (), "time of the last decision"),
    "sd_controller_pending_age_seconds": ("gauge", (), "age of the pending switch, 0 if none"),
    "sd_controller_pending_timeout_seconds": ("gauge", (), "pending switch timeout"),
    "sd_controller_change_failures": ("counter", (), "failed switches"),
    "sd_controller_acceptance_floor_active": ("gauge", (), "acceptance at its floor (0/1)"),
    "sd_controller_evaluation_interval_seconds": ("gauge", (), "tick interval"),
    "sd_switch_cost_request_seconds": ("gauge", (), "cost of a switch now"),
    "sd_projected_gain_request_seconds": ("gauge", (), "projected gain of a switch now"),
    "sd_projected_arrival_rate_rps": ("gauge", (), "projected arrival rate"),
    "sd_restart_downtime_seconds": ("gauge", (), "expected restart downtime"),
    "sd_controller_build": ("info", (), "build information"),
    "sd_model_error_ratio": ("gauge", ("mode",), "smoothed observed / predicted latency per mode"),
    "sd_model_correction": ("gauge", ("mode", "term"), "online correction factor"),
    "sd_model_correction_width": ("gauge", ("term",), "posterior sd of each log factor"),
    "sd_calibrated_latency_seconds": ("gauge", ("mode",), "predicted latency, calibration alone"),
    "sd_model_recalibration_alarm": ("gauge", (), "correction at its clamp (0/1)"),
    "sd_model_evidence_ticks": ("gauge", (), "ticks the correction learned from"),
    # registered by the restart gate (controller/coordination/gate.py) on the same registry
    "sd_controller_max_unavailable": ("gauge", (), "replicas allowed to restart at once"),
    "sd_controller_restart_slot_waits": ("counter", ("reason",), "ticks a restart waited for a slot"),
    "sd_controller_fleet_sd_replicas": ("gauge", (), "replicas of the fleet running SD"),
    "sd_controller_fleet_sd_target": ("gauge", (), "replicas the fleet's plan wants on SD"),
    "sd_controller_duplicate_replica_id": ("gauge", (), "another process publishes under this replica id"),
}
STATES = ("enabled", "disabled", "pending", "failed", "override")

# Series names as Prometheus sees them (what PromQL refers to).
EXPOSED_NAMES: frozenset[str] = frozenset(
    f"{name}_total" if kind == "counter" else f"{name}_info" if kind == "info" else name
    for name, (kind, _, _) in METRICS.items()
)


class FakeControllerExporter:
    """Serves :data:`METRICS` on 127.0.0.1 from a fresh registry, with plausible defaults.

    ``set(name, value, **labels)`` sets a gauge, ``inc(name, n, **labels)`` a counter,
    ``state(s)`` the enum. Labelled counters start at 0 for every known label value, as the
    real exporter should do (an increase() over a series born at 1 counts nothing).
    """

    def __init__(self, version: str = "0.1.0") -> None:
        self.registry = CollectorRegistry()
        self.metrics: dict[str, Any] = {}
        for name, (kind, labels, help_text) in METRICS.items():
            if kind == "gauge":
                metric = Gauge(name, help_text, labels, registry=self.registry)
            elif kind == "counter":
                metric = Counter(name, help_text, labels, registry=self.registry)
            elif kind == "enum":
                metric = Enum(name, help_text, states=list(STATES), registry=self.registry)
            else:
                metric = Info(name, help_text, registry=self.registry)
            self.metrics[name] = metric
        self.metrics["sd_controller_build"].info({"version": version})
        self.metrics["sd_controller_state"].state("disabled")
        for direction in ("on", "off"):
            self.metrics["sd_toggles"].labels(direction=direction)
        for reason in ("timeout", "http_error", "parse_error", "missing"):
            self.metrics["sd_controller_observation_failures"].labels(reason=reason)
        for reason in ("restart_slot_busy", "coordination_unavailable"):
            self.metrics["sd_controller_restart_slot_waits"].labels(reason=reason)
        for source, v in (("measured", 1), ("last", 0), ("prior", 0)):
            self.set("sd_acceptance_source", v, source=source)
        defaults = {
            "sd_predicted_speedup": 1.4,
            "sd_acceptance_rate": 0.65,
            "sd_acceptance_age_seconds": 30,
            "sd_draft_length": 4,
            "sd_enabled": 1,
            "sd_desired_enabled": 1,
            "sd_effective_batch_size": 3.2,
            "sd_arrival_rate_rps": 1.5,
            "sd_break_even_rate_rps": 6.0,
            "sd_predicted_applied_latency_seconds": 1.0,
            "sd_observed_latency_seconds": 1.05,
            "sd_controller_pending_age_seconds": 0,
            "sd_controller_pending_timeout_seconds": 600,
            "sd_controller_acceptance_floor_active": 0,
            "sd_controller_evaluation_interval_seconds": 60,
            "sd_switch_cost_request_seconds": 40,
            "sd_projected_gain_request_seconds": 300,
            "sd_projected_arrival_rate_rps": 1.6,
            "sd_restart_downtime_seconds": 75,
            "sd_controller_max_unavailable": 1,
            "sd_controller_fleet_sd_replicas": 0,
            "sd_controller_fleet_sd_target": 0,
            "sd_controller_duplicate_replica_id": 0,
        }
        for name, v in defaults.items():
            self.set(name, v)
        for mode, limit, latency in (("on", 9.0, 1.0), ("off", 14.0, 1.4)):
            self.set("sd_stability_limit_rps", limit, mode=mode)
            self.set("sd_predicted_latency_seconds", latency, mode=mode)
            self.set("sd_calibrated_latency_seconds", latency * 1.1, mode=mode)
            self.set("sd_model_error_ratio", 1.02, mode=mode)
            for term in ("fixed", "load"):
                self.set("sd_model_correction", 1.05, mode=mode, term=term)
        for term in ("target_fixed", "target_load", "sd_fixed", "sd_load"):
            self.set("sd_model_correction_width", 0.05, term=term)
        self.set("sd_model_recalibration_alarm", 0)
        self.set("sd_model_evidence_ticks", 500)
        self._server: Any = None
        self._thread: Any = None
        self.port = 0

    def set(self, name: str, value: float, **labels: str) -> None:
        metric = self.metrics[name]
        (metric.labels(**labels) if labels else metric).set(value)

    def inc(self, name: str, amount: float = 1, **labels: str) -> None:
        metric = self.metrics[name]
        (metric.labels(**labels) if labels else metric).inc(amount)

    def state(self, state: str) -> None:
        self.metrics["sd_controller_state"].state(state)

    def start(self) -> FakeControllerExporter:
        self.port = free_port()
        self._server, self._thread = start_http_server(self.port, addr="127.0.0.1", registry=self.registry)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> FakeControllerExporter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
