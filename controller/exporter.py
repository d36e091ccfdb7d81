"""What the controller predicts and does, as Prometheus metrics (one registry, passed in).

Tests make their own ``CollectorRegistry`` and read values back with
``registry.get_sample_value``; the daemon serves the registry on its own port with /healthz.
A value the controller does not know is left out rather than exported as 0 or NaN.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Enum, Gauge, Info, generate_latest

from controller import __version__
from controller.assessment import AcceptanceSource, Assessment
from controller.observation import FailureReason
from controller.policy import ControllerPhase, Decision
from controller.state import ControllerState


class Exporter:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        r = registry
        self.predicted_speedup = Gauge("sd_predicted_speedup", "Predicted T_off / T_on at the observed rate", registry=r)
        self.decision_speedup = Gauge(
            "sd_decision_speedup", "Predicted speedup at the projected rate (compared with the thresholds)", registry=r
        )
        self.acceptance_rate = Gauge("sd_acceptance_rate", "Acceptance rate used (accepted/drafted tokens)", registry=r)
        self.acceptance_source = Gauge(
            "sd_acceptance_source", "Which acceptance was used (1 = this one)", ["source"], registry=r
        )
        self.acceptance_age = Gauge("sd_acceptance_age_seconds", "Age of the acceptance used", registry=r)
        self.alpha = Gauge("sd_acceptance_alpha", "Per-token acceptance α derived from it", registry=r)
        self.draft_length = Gauge("sd_draft_length", "Draft length SD runs (or would run) with", registry=r)
        self.best_draft_length = Gauge("sd_best_draft_length", "Model's best draft length at the projected rate", registry=r)
        self.enabled = Gauge("sd_enabled", "SD applied on the server (1) or not (0)", registry=r)
        self.desired = Gauge("sd_desired_enabled", "SD state the controller wants", registry=r)
        self.batch = Gauge("sd_effective_batch_size", "Predicted running batch (Little's law) in the applied state", registry=r)
        self.arrival = Gauge("sd_arrival_rate_rps", "Observed arrival rate", registry=r)
        self.projected = Gauge("sd_projected_arrival_rate_rps", "Rate the decision is evaluated at (trend)", registry=r)
        self.break_even = Gauge("sd_break_even_rate_rps", "Arrival rate where the predicted speedup is 1", registry=r)
        self.limit = Gauge("sd_stability_limit_rps", "Highest sustainable arrival rate", ["mode"], registry=r)
        self.latency = Gauge("sd_predicted_latency_seconds", "Predicted mean request latency", ["mode"], registry=r)
        self.applied_latency = Gauge(
            "sd_predicted_applied_latency_seconds", "Predicted mean latency in the applied state", registry=r
        )
        self.observed_latency = Gauge("sd_observed_latency_seconds", "Observed mean e2e latency (vLLM)", registry=r)
        self.state = Enum(
            "sd_controller_state", "Controller state", states=[p.value for p in ControllerPhase], registry=r
        )
        self.toggles = Counter("sd_toggles", "Applied SD changes", ["direction"], registry=r)
        self.failures = Counter(
            "sd_controller_observation_failures", "Ticks held for unusable observations", ["reason"], registry=r
        )
        self.change_failures = Counter("sd_controller_change_failures", "Changes that failed or timed out", registry=r)
        self.floor_trips = Counter("sd_controller_acceptance_floor_trips", "Acceptance-floor disables", registry=r)
        self.floor_active = Gauge("sd_controller_acceptance_floor_active", "Acceptance below the floor long enough", registry=r)
        self.last_decision = Gauge("sd_controller_last_decision_timestamp_seconds", "Time of the last decision", registry=r)
        self.decisions = Counter("sd_controller_decisions", "Decisions by action and reason", ["action", "reason"], registry=r)
        self.pending_age = Gauge("sd_controller_pending_age_seconds", "Age of the pending change (0: none)", registry=r)
        self.pending_timeout = Gauge("sd_controller_pending_timeout_seconds", "Pending-change timeout", registry=r)
        self.interval = Gauge("sd_controller_evaluation_interval_seconds", "Evaluation interval", registry=r)
        self.switch_cost = Gauge("sd_switch_cost_request_seconds", "Estimated cost of switching now", registry=r)
        self.gain = Gauge("sd_projected_gain_request_seconds", "Projected gain of switching over the horizon", registry=r)
        self.downtime = Gauge("sd_restart_downtime_seconds", "Restart downtime estimate", registry=r)
        self.horizon = Gauge("sd_gain_horizon_seconds", "How long the other state is expected to stay right", registry=r)
        Info("sd_controller_build", "Build information", registry=r).info({"version": __version__})
        for reason in FailureReason:
            self.failures.labels(reason.value)  # every reason visible at 0 from the start
        for direction in ("on", "off"):
            self.toggles.labels(direction)

    def configure(self, interval_s: float, pending_timeout_s: float) -> None:
        self.interval.set(interval_s)
        self.pending_timeout.set(pending_timeout_s)

    def record(
        self,
        now: float,
        state: ControllerState,
        decision: Decision,
        assessment: Assessment | None,
        failure: FailureReason | None,
        observed_latency_s: float | None,
        events: tuple[str, ...],
    ) -> None:
        self.last_decision.set(now)
        self.state.state(decision.phase.value)
        self.decisions.labels(decision.action.value, decision.reason.value).inc()
        if failure is not None:
            self.failures.labels(failure.value).inc()
        if state.applied_enabled is not None:
            self.enabled.set(1 if state.applied_enabled else 0)
        if decision.desired_enabled is not None:
            self.desired.set(1 if decision.desired_enabled else 0)
        self.pending_age.set(now - state.pending.issued_at if state.pending else 0.0)
        self.floor_active.set(1 if state.floor_tripped_at is not None else 0)
        for ev in events:
            if ev.startswith(("change_confirmed:", "external_change:")):
                self.toggles.labels(ev.split(":", 1)[1]).inc()
            elif ev.startswith("change_failed:"):
                self.change_failures.inc()
            elif ev == "acceptance_floor_tripped":
                self.floor_trips.inc()
        if observed_latency_s is not None:
            self.observed_latency.set(observed_latency_s)
        if assessment is None:
            return
        a = assessment
        _set(self.predicted_speedup, a.predicted_speedup)
        _set(self.decision_speedup, a.decision_speedup)
        self.acceptance_rate.set(a.acceptance.rate)
        for src in AcceptanceSource:
            self.acceptance_source.labels(src.value).set(1 if src is a.acceptance.source else 0)
        _set(self.acceptance_age, a.acceptance.age_s)
        self.alpha.set(a.acceptance.alpha)
        self.draft_length.set(a.draft_length)
        self.best_draft_length.set(a.best_draft_length)
        on = bool(state.applied_enabled)
        self.batch.set(a.batch(on))
        self.arrival.set(a.arrival_rate_rps)
        self.projected.set(a.projected_rate_rps)
        if a.break_even_rate_rps is not None:
            self.break_even.set(a.break_even_rate_rps)
        self.limit.labels("on").set(a.stability_limit_on_rps)
        self.limit.labels("off").set(a.stability_limit_off_rps)
        _set(self.latency.labels("on"), a.latency_on_s)
        _set(self.latency.labels("off"), a.latency_off_s)
        _set(self.applied_latency, a.latency_s(on))
        _set(self.switch_cost, a.switch_cost_request_s)
        _set(self.gain, a.projected_gain_request_s)
        self.downtime.set(a.restart_downtime_s)
        self.horizon.set(a.gain_horizon_s)


def _set(gauge: Gauge, value: float) -> None:
    # +Inf is valid exposition (an overloaded state); NaN never is exported.
    if not math.isnan(value):
        gauge.set(value)


class MetricsServer:
    """``/metrics`` and ``/healthz`` on a port of its own, in a daemon thread."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int, healthy: Callable[[], tuple[bool, str]]):
        reg = registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server API
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, ctype, code = generate_latest(reg), CONTENT_TYPE_LATEST, 200
                elif path == "/healthz":
                    ok, why = healthy()
                    body, ctype, code = (why + "\n").encode(), "text/plain; charset=utf-8", 200 if ok else 503
                else:
                    body, ctype, code = b"not found\n", "text/plain; charset=utf-8", 404
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # quiet: structlog does logging
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="sd-exporter", daemon=True)

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
