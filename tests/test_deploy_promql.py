"""Every PromQL expression shipped in deploy/ (dashboard, recording and alert rules) runs
on a real Prometheus that scrapes a fake vLLM and a fake controller exporter: no parse or
evaluation error, and no empty result where the data for it exists. The data is arranged so
that every alert's condition holds, and the alerts are checked to go pending/firing."""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.support.controller_metrics import EXPOSED_NAMES, FakeControllerExporter
from tests.support.fake_vllm import FakeVllmServer
from tests.support.prometheus import PrometheusServer, sample_values

pytestmark = [pytest.mark.prometheus, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "sd-controller.json"
RULE_FILES = [
    ROOT / "deploy" / "prometheus" / "recording-rules.yml",
    ROOT / "deploy" / "prometheus" / "alert-rules.yml",
]
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "1h",
    "${pod}": ".*",
    "$pod": ".*",
    "${model_name}": ".*",
    "$model_name": ".*",
}
LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")


def substitute(expr: str) -> str:
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    return expr


def dashboard_exprs() -> list[tuple[str, str]]:
    """(where, PromQL) for every query in the dashboard: panels, annotations, variables."""
    dash = json.loads(DASHBOARD.read_text())
    out = []

    def walk(panels: list[dict]) -> None:
        for panel in panels:
            for target in panel.get("targets", []):
                out.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
            walk(panel.get("panels", []))

    walk(dash["panels"])
    for ann in dash["annotations"]["list"]:
        if "expr" in ann:
            out.append((f"annotation {ann['name']!r}", ann["expr"]))
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = LABEL_VALUES.match(query)
            assert m, f"variable {var['name']}: unsupported query {query!r}"
            out.append((f"variable {var['name']!r}", m["selector"]))
    return [(where, substitute(expr)) for where, expr in out]


def rule_exprs() -> list[tuple[str, str]]:
    out = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                name = rule.get("record") or rule.get("alert")
                out.append((f"{path.name}: {name}", rule["expr"]))
    return out


ALL_EXPRS = dashboard_exprs() + rule_exprs()


def test_the_dashboard_and_rules_have_queries() -> None:
    assert len(dashboard_exprs()) >= 30
    assert len(rule_exprs()) >= 15


def test_every_sd_metric_referenced_is_exported() -> None:
    """A typo in a metric name would show as an empty panel; catch it by name too."""
    recorded = {r[0].split(": ")[1] for r in rule_exprs()}
    for where, expr in ALL_EXPRS:
        for name in re.findall(r"\b(sd_[a-z_]+)\b", expr):
            if name in ("sd_controller_state",) or name in recorded:
                continue
            assert name in EXPOSED_NAMES, f"{where}: {name} is not a controller metric"


class Stack:
    def __init__(self, prom: PrometheusServer, vllm: FakeVllmServer, ctl: dict) -> None:
        self.prom, self.vllm, self.ctl = prom, vllm, ctl


def _feed(fake: FakeVllmServer, stop: threading.Event) -> None:
    i = 0
    while not stop.wait(0.25):
        i += 1
        fake.advance(
            requests=4, prompt_tokens=160, gen_tokens=192, e2e_latency_s=1.0 + (i % 5) * 0.4,
            drafts=60, draft_tokens=240, accepted_tokens=150, accepted_per_pos=[55, 45, 30, 20],
        )  # fmt: skip
        fake.set_gauges(running=3 + i % 4, waiting=i % 2)


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    from tests.support.prometheus import prometheus_binary

    if prometheus_binary() is None:
        pytest.skip("prometheus binary not found (apt-get install -y prometheus)")
    workdir = tmp_path_factory.mktemp("promql")
    stop = threading.Event()
    vllm = FakeVllmServer(sd_enabled=True).start()
    # a: SD on, drifting, flapping, low acceptance, stale; b: a switch stuck pending;
    # c: scraped once, then gone (controller down); d: restarting too, beside b (one slot), with a twin.
    ctl = {k: FakeControllerExporter().start() for k in "abcd"}
    a, b = ctl["a"], ctl["b"]
    a.set("sd_acceptance_rate", 0.3)
    a.set("sd_observed_latency_seconds", 1.5)
    a.set("sd_predicted_applied_latency_seconds", 1.0)
    a.set("sd_controller_last_decision_timestamp_seconds", time.time() - 1000)
    a.set("sd_model_error_ratio", 1.3, mode="on")  # SD runs on a: its mode drifts
    a.set("sd_model_error_ratio", 0.6, mode="off")
    b.set("sd_model_error_ratio", 0.6, mode="off")  # SD on at b too: a stale off-mode error is no drift
    a.set("sd_model_recalibration_alarm", 1)
    a.state("enabled")
    b.set("sd_controller_pending_age_seconds", 900)
    b.set("sd_controller_pending_timeout_seconds", 600)
    b.set("sd_controller_last_decision_timestamp_seconds", time.time())
    b.state("pending")
    ctl["d"].set("sd_controller_pending_age_seconds", 30)
    ctl["d"].set("sd_controller_last_decision_timestamp_seconds", time.time())
    ctl["d"].state("pending")
    ctl["d"].set("sd_controller_duplicate_replica_id", 1)
    feeder = threading.Thread(target=_feed, args=(vllm, stop), daemon=True)
    feeder.start()
    prom = PrometheusServer(
        workdir,
        {"vllm": [vllm.target], "sd-controller": [c.target for c in ctl.values()]},
        rule_files=RULE_FILES,
    )
    try:
        prom.start()
        prom.wait_for('count(up{job="sd-controller"} == 1) == 4', timeout_s=30)
        ctl["c"].stop()
        # Six toggles, a switch failure and observation failures, each after a scrape so
        # that the counters' first samples are 0.
        scrapes = vllm.scrapes
        for i in range(6):
            while vllm.scrapes < scrapes + 2:
                time.sleep(0.1)
            scrapes = vllm.scrapes
            a.inc("sd_toggles", direction="on" if i % 2 == 0 else "off")
            b.inc("sd_controller_change_failures")
            a.inc("sd_controller_observation_failures", reason="stalled")
            b.inc("sd_controller_observation_failures", amount=4, reason="unreachable")  # b is blind
        a.set("sd_controller_pending_age_seconds", 0)
        prom.wait_for('up{job="sd-controller"} == 0', timeout_s=30)
        yield Stack(prom, vllm, ctl)
    finally:
        stop.set()
        prom.stop()
        for c in ctl.values():
            c.stop()
        vllm.stop()


@pytest.mark.parametrize("where,expr", ALL_EXPRS, ids=[w for w, _ in ALL_EXPRS])
def test_expression_parses_and_has_data(stack: Stack, where: str, expr: str) -> None:
    result = stack.prom.wait_for(expr, timeout_s=30)
    values = sample_values(result)
    assert values, f"{where}: empty result for {expr}"
    assert any(not math.isnan(v) for v in values), f"{where}: only NaN for {expr}"


def test_rules_evaluate_without_errors_and_every_alert_triggers(stack: Stack) -> None:
    def all_active(groups: list[dict]) -> bool:
        alerts = [r for g in groups for r in g["rules"] if r["type"] == "alerting"]
        return bool(alerts) and all(r["state"] in ("pending", "firing") for r in alerts)

    deadline = time.monotonic() + 30
    while True:
        groups = stack.prom.rules()
        if all_active(groups) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for group in groups:
        for rule in group["rules"]:
            assert rule["health"] == "ok", f"{rule['name']}: {rule.get('lastError')}"
    states = {r["name"]: r["state"] for g in groups for r in g["rules"] if r["type"] == "alerting"}
    assert set(states) == {
        "SDAcceptanceLow", "SDControllerStale", "SDControllerDown", "SDRestartStuck",
        "SDPredictionDrift", "SDFlapping", "SDModelDrift", "SDRecalibrationNeeded", "SDFleetRestartsOverLimit",
        "SDVllmStalled", "SDObservationsFailing", "SDDuplicateReplicaId",
    }  # fmt: skip
    inactive = {name: s for name, s in states.items() if s not in ("pending", "firing")}
    assert not inactive, f"alerts whose condition should hold but does not: {inactive}"


def test_alerts_point_at_the_right_replica(stack: Stack) -> None:
    a, b, c, d = (stack.ctl[k].target for k in "abcd")
    alerts = stack.prom.wait_for("ALERTS", predicate=lambda r: len(r) >= 11)
    where = {}
    for s in alerts:
        where.setdefault(s["metric"]["alertname"], set()).add(s["metric"]["instance"])
    assert where["SDAcceptanceLow"] == {a}
    assert where["SDPredictionDrift"] == {a}
    assert where["SDFlapping"] == {a}
    assert where["SDModelDrift"] == {a}
    assert where["SDRecalibrationNeeded"] == {a}
    assert where["SDVllmStalled"] == {a}
    assert where["SDObservationsFailing"] == {b}
    assert where["SDRestartStuck"] == {b}
    assert where["SDControllerDown"] == {c}
    assert where["SDFleetRestartsOverLimit"] == {b, d}
    assert where["SDDuplicateReplicaId"] == {d}
    assert a in where["SDControllerStale"] and b not in where["SDControllerStale"]


def test_recorded_acceptance_matches_what_vllm_counts(stack: Stack) -> None:
    result = stack.prom.wait_for("replica:vllm_spec_decode_acceptance:ratio_rate5m")
    assert sample_values(result)[0] == pytest.approx(150 / 240, rel=1e-6)
    per_pos = stack.prom.wait_for(
        "replica_position:vllm_spec_decode_accepted_per_draft:ratio_rate5m",
        predicate=lambda r: len(r) == 4,
    )
    got = {s["metric"]["position"]: float(s["value"][1]) for s in per_pos}
    assert got == pytest.approx({"0": 55 / 60, "1": 45 / 60, "2": 30 / 60, "3": 20 / 60})
