"""What the controller predicts and does, as Prometheus metrics (one registry, passed in).

Tests make their own ``CollectorRegistry`` and read values back with
``registry.get_sample_value``; the daemon serves the registry on its own port with /healthz.
A value the controller does not know is left out rather than exported as 0 or NaN.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Enum, Info, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from controller import __version__
from controller.assessment import AcceptanceSource, Assessment
from controller.correction import TERMS
from controller.events import Event, EventKind
from controller.httpserver import BackgroundHTTPServer
from controller.model import LIMIT_REASONS
from controller.observation import FailureReason
from controller.policy import ControllerPhase, Decision
from controller.state import ControllerState

if TYPE_CHECKING:
    from controller.learning import Learned, Learner


class OptionalGauges(Collector):
    """Gauges that are absent until set: an unknown value is left out, never exported as 0.

    (prometheus-client's Gauge reads 0 before its first ``set``; a dashboard would take a 0
    speedup before the first prediction for "SD is useless".)
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._docs: dict[str, tuple[str, tuple[str, ...]]] = {}
        self._values: dict[str, dict[tuple[str, ...], float]] = {}
        self._lock = threading.Lock()
        self._registry = registry

    def define(self, name: str, doc: str, labelnames: tuple[str, ...] = ()) -> str:
        self._docs[name] = (doc, labelnames)
        self._values[name] = {}
        return name

    def register(self) -> None:
        self._registry.register(self)

    def set(self, name: str, value: float, *labelvalues: str) -> None:
        if math.isnan(value):  # NaN is never exported; +Inf is (an overloaded state)
            return
        with self._lock:
            self._values[name][tuple(labelvalues)] = float(value)

    def clear(self, *names: str) -> None:
        """Make these gauges absent again (the value is no longer known)."""
        with self._lock:
            for name in names:
                self._values[name] = {}

    def describe(self):
        return [GaugeMetricFamily(n, d, labels=list(lbl)) for n, (d, lbl) in self._docs.items()]

    def collect(self):
        with self._lock:
            snapshot = {n: dict(v) for n, v in self._values.items()}
        for name, (doc, labels) in self._docs.items():
            fam = GaugeMetricFamily(name, doc, labels=list(labels))
            for labelvalues, value in snapshot[name].items():
                fam.add_metric(list(labelvalues), value)
            yield fam


# Derived from this tick's assessment: absent when there is none (bad data, a restart), so a
# dashboard never shows a stale prediction as if it were current.
PREDICTION_GAUGES = (
    "sd_predicted_speedup",
    "sd_decision_speedup",
    "sd_acceptance_rate",
    "sd_acceptance_source",
    "sd_acceptance_age_seconds",
    "sd_acceptance_alpha",
    "sd_draft_length",
    "sd_best_draft_length",
    "sd_effective_batch_size",
    "sd_arrival_rate_rps",
    "sd_projected_arrival_rate_rps",
    "sd_break_even_rate_rps",
    "sd_stability_limit_rps",
    "sd_stability_limit_reason",
    "sd_predicted_latency_seconds",
    "sd_predicted_applied_latency_seconds",
    "sd_switch_cost_request_seconds",
    "sd_projected_gain_request_seconds",
    "sd_gain_horizon_seconds",
    "sd_restart_downtime_seconds",
    "sd_disable_ahead_saving_request_seconds",
    "sd_load_cycling",
    "sd_acceptance_trend_per_hour",
    "sd_running_context_tokens",
    "sd_cached_prompt_tokens",
)


class Exporter:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        r = registry
        g = self.gauges = OptionalGauges(r)
        g.define("sd_predicted_speedup", "Predicted T_off / T_on at the observed rate")
        g.define("sd_decision_speedup", "Predicted speedup at the projected rate (compared with the thresholds)")
        g.define(
            "sd_predicted_speedup_bound",
            "Prediction interval of the speedup at the projected rate (calibration residuals)",
            ("bound",),
        )
        g.define("sd_acceptance_rate", "Acceptance rate used (accepted/drafted tokens)")
        g.define("sd_acceptance_source", "Which acceptance was used (1 = this one)", ("source",))
        g.define("sd_acceptance_age_seconds", "Age of the acceptance used")
        g.define("sd_acceptance_alpha", "Per-token acceptance α derived from it")
        g.define("sd_draft_length", "Draft length SD runs (or would run) with")
        g.define("sd_best_draft_length", "Model's best draft length at the projected rate")
        g.define(
            "sd_disable_ahead_saving_request_seconds",
            "SD on under a steady rise: what disabling now saves against the rule's later restart (0: nothing)",
        )
        g.define("sd_enabled", "SD applied on the server (1) or not (0)")
        g.define("sd_desired_enabled", "SD state the controller wants")
        g.define("sd_effective_batch_size", "Predicted running batch (Little's law) in the applied state")
        g.define(
            "sd_running_context_tokens",
            "KV tokens per running sequence measured from vLLM's KV usage (absent: from the lengths)",
        )
        g.define(
            "sd_cached_prompt_tokens",
            "Prompt tokens per request served from vLLM's prefix cache, as the model priced them",
        )
        g.define("sd_arrival_rate_rps", "Observed arrival rate")
        g.define("sd_projected_arrival_rate_rps", "Rate the decision is evaluated at (trend)")
        g.define("sd_break_even_rate_rps", "Arrival rate where the predicted speedup is 1")
        g.define("sd_stability_limit_rps", "Highest sustainable arrival rate", ("mode",))
        g.define(
            "sd_stability_limit_reason",
            "What sets the stability limit (1 = this reason): throughput_peak, max_num_seqs, kv_cache, kv_recompute or token_budget",
            ("mode", "reason"),
        )
        g.define("sd_predicted_latency_seconds", "Predicted mean request latency", ("mode",))
        g.define("sd_predicted_applied_latency_seconds", "Predicted mean latency in the applied state")
        g.define("sd_observed_latency_seconds", "Observed mean e2e latency (vLLM)")
        g.define("sd_controller_acceptance_floor_active", "Acceptance below the floor long enough")
        g.define("sd_controller_last_decision_timestamp_seconds", "Time of the last decision")
        g.define("sd_controller_pending_age_seconds", "Age of the pending change (0: none)")
        g.define("sd_controller_pending_timeout_seconds", "Pending-change timeout")
        g.define("sd_controller_evaluation_interval_seconds", "Evaluation interval")
        g.define("sd_switch_cost_request_seconds", "Estimated cost of switching now")
        g.define("sd_projected_gain_request_seconds", "Projected gain of switching over the horizon")
        g.define("sd_gain_horizon_seconds", "How long the other state is expected to stay right")
        g.define("sd_restart_downtime_seconds", "Restart downtime estimate")
        g.define("sd_load_cycling", "1 while the load cycles through SD's break-even: the decision reads the cycle")
        g.define(
            "sd_acceptance_trend_per_hour",
            "Change of the per-token acceptance per hour that the gain of disabling follows (0: no drift)",
        )
        # Closing the loop (controller/learning.py): drift, the correction, calibrated predictions.
        g.define("sd_model_error_ratio", "Smoothed observed / predicted (corrected) latency", ("mode",))
        g.define("sd_model_correction", "Correction factor on the step costs (1 = calibration)", ("mode", "term"))
        g.define("sd_model_correction_width", "Posterior sd of each log correction factor", ("term",))
        g.define("sd_calibrated_latency_seconds", "Predicted mean latency, calibration alone", ("mode",))
        g.define("sd_model_recalibration_alarm", "The correction wants more than its clamp (1): recalibrate")
        g.define("sd_model_evidence_ticks", "Ticks of evidence the correction has learned from")
        g.register()
        self.state = Enum(
            "sd_controller_state", "Controller state", states=[p.value for p in ControllerPhase], registry=r
        )
        self.toggles = Counter("sd_toggles", "Applied SD changes", ["direction"], registry=r)
        self.failures = Counter(
            "sd_controller_observation_failures", "Ticks held for unusable observations", ["reason"], registry=r
        )
        self.change_failures = Counter("sd_controller_change_failures", "Changes that failed or timed out", registry=r)
        self.floor_trips = Counter("sd_controller_acceptance_floor_trips", "Acceptance-floor disables", registry=r)
        self.decisions = Counter(
            "sd_controller_decisions", "Decisions by action and reason", ["action", "reason"], registry=r
        )
        Info("sd_controller_build", "Build information", registry=r).info({"version": __version__})
        for reason in FailureReason:
            self.failures.labels(reason.value)  # every reason visible at 0 from the start
        for direction in ("on", "off"):
            self.toggles.labels(direction)

    def configure(self, interval_s: float, pending_timeout_s: float) -> None:
        self.gauges.set("sd_controller_evaluation_interval_seconds", interval_s)
        self.gauges.set("sd_controller_pending_timeout_seconds", pending_timeout_s)

    def record(
        self,
        now: float,
        state: ControllerState,
        decision: Decision,
        assessment: Assessment | None,
        failure: FailureReason | None,
        observed_latency_s: float | None,
        events: tuple[Event, ...],
    ) -> None:
        g = self.gauges.set
        g("sd_controller_last_decision_timestamp_seconds", now)
        self.state.state(decision.phase.value)
        self.decisions.labels(decision.action.value, decision.reason.value).inc()
        if failure is not None:
            self.failures.labels(failure.value).inc()
        if state.applied_enabled is not None:
            g("sd_enabled", 1 if state.applied_enabled else 0)
        if decision.desired_enabled is not None:
            g("sd_desired_enabled", 1 if decision.desired_enabled else 0)
        g("sd_controller_pending_age_seconds", now - state.pending.issued_at if state.pending else 0.0)
        g("sd_controller_acceptance_floor_active", 1 if state.floor_tripped_at is not None else 0)
        for ev in events:
            if ev.toggled is not None:
                self.toggles.labels(ev.toggled).inc()
            elif ev.kind is EventKind.CHANGE_FAILED:
                self.change_failures.inc()
            elif ev.kind is EventKind.ACCEPTANCE_FLOOR_TRIPPED:
                self.floor_trips.inc()
        if observed_latency_s is not None:
            g("sd_observed_latency_seconds", observed_latency_s)
        else:
            self.gauges.clear("sd_observed_latency_seconds")
        if assessment is None:
            self.gauges.clear(*PREDICTION_GAUGES)
            return
        a = assessment
        on = bool(state.applied_enabled)
        g("sd_predicted_speedup", a.predicted_speedup)
        g("sd_decision_speedup", a.decision_speedup)
        for bound, value in (("lo", a.speedup_lo), ("hi", a.speedup_hi)):
            if math.isfinite(value):
                g("sd_predicted_speedup_bound", value, bound)
        g("sd_acceptance_rate", a.acceptance.rate)
        for src in AcceptanceSource:
            g("sd_acceptance_source", 1 if src is a.acceptance.source else 0, src.value)
        g("sd_acceptance_age_seconds", a.acceptance.age_s)
        g("sd_acceptance_alpha", a.acceptance.alpha)
        g("sd_draft_length", a.draft_length)
        g("sd_best_draft_length", a.best_draft_length)
        g("sd_effective_batch_size", a.batch(on))
        if a.workload.running_context_tokens is not None:
            g("sd_running_context_tokens", a.workload.running_context_tokens)
        else:
            self.gauges.clear("sd_running_context_tokens")
        g("sd_cached_prompt_tokens", a.workload.cached_tokens)
        g("sd_arrival_rate_rps", a.arrival_rate_rps)
        g("sd_projected_arrival_rate_rps", a.projected_rate_rps)
        if a.break_even_rate_rps is not None:
            g("sd_break_even_rate_rps", a.break_even_rate_rps)
        else:
            self.gauges.clear("sd_break_even_rate_rps")
        g("sd_stability_limit_rps", a.stability_limit_on_rps, "on")
        g("sd_stability_limit_rps", a.stability_limit_off_rps, "off")
        for reason in LIMIT_REASONS:
            g("sd_stability_limit_reason", 1 if reason == a.limit_reason_on else 0, "on", reason)
            g("sd_stability_limit_reason", 1 if reason == a.limit_reason_off else 0, "off", reason)
        g("sd_predicted_latency_seconds", a.latency_on_s, "on")
        g("sd_predicted_latency_seconds", a.latency_off_s, "off")
        g("sd_predicted_applied_latency_seconds", a.latency_s(on))
        g("sd_switch_cost_request_seconds", a.switch_cost_request_s)
        g("sd_projected_gain_request_seconds", a.projected_gain_request_s)
        g("sd_gain_horizon_seconds", a.gain_horizon_s)
        g("sd_restart_downtime_seconds", a.restart_downtime_s)
        g("sd_disable_ahead_saving_request_seconds", a.early_disable_saving_request_s)
        g("sd_load_cycling", 1 if a.cycling else 0)
        g("sd_acceptance_trend_per_hour", (a.acceptance_trend_per_s or 0.0) * 3600.0)

    def record_learning(self, learner: Learner, learned: Learned | None, assessment: Assessment | None) -> None:
        """Drift and the correction (see controller/learning.py)."""
        g, p = self.gauges.set, learner.posterior
        for mode in ("off", "on"):
            ratio = p.error_ratio(mode)
            if ratio is not None:
                g("sd_model_error_ratio", ratio, mode)
            gamma = assessment.draft_length if assessment is not None else learner.settings.draft_length
            for term, value in p.mode_factors(mode, learner.base, gamma).items():
                g("sd_model_correction", value, mode, term)
        for term, width in zip(TERMS, p.width(learner.config), strict=True):
            g("sd_model_correction_width", width, term)
        g("sd_model_recalibration_alarm", 1 if p.alarm else 0)
        g("sd_model_evidence_ticks", p.evidence)
        if assessment is None:
            self.gauges.clear("sd_calibrated_latency_seconds")
            return
        off, on = learner.calibrated(assessment)
        g("sd_calibrated_latency_seconds", off, "off")
        g("sd_calibrated_latency_seconds", on, "on")


class MetricsServer(BackgroundHTTPServer):
    """``/metrics`` and ``/healthz`` on a port of its own, in a daemon thread."""

    thread_name = "sd-exporter"

    def __init__(self, registry: CollectorRegistry, host: str, port: int, healthy: Callable[[], tuple[bool, str]]):
        reg = registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._answer(with_body=True)

            def do_HEAD(self) -> None:  # load balancers' and uptime checkers' probes: GET's status and headers
                self._answer(with_body=False)

            def _refuse(self) -> None:
                self._send(405, "text/plain; charset=utf-8", b"method not allowed: GET or HEAD\n", True, "GET, HEAD")

            do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse

            def _answer(self, with_body: bool) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, ctype, code = generate_latest(reg), CONTENT_TYPE_LATEST, 200
                elif path == "/healthz":
                    ok, why = healthy()
                    body, ctype, code = (why + "\n").encode(), "text/plain; charset=utf-8", 200 if ok else 503
                else:
                    body, ctype, code = b"not found\n", "text/plain; charset=utf-8", 404
                self._send(code, ctype, body, with_body)

            def _send(self, code: int, ctype: str, body: bytes, with_body: bool, allow: str | None = None) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                if allow:
                    self.send_header("Allow", allow)
                self.end_headers()
                if with_body:
                    self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # quiet: structlog does logging
                pass

        super().__init__((host, port), Handler)
