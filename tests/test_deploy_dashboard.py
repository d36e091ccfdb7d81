"""The Grafana dashboard has the panels the deployment guide promises, laid out sanely."""

from __future__ import annotations

import json
from pathlib import Path

DASHBOARD = json.loads(
    (Path(__file__).resolve().parents[1] / "deploy/grafana/dashboards/sd-controller.json").read_text()
)
PANELS = [p for p in DASHBOARD["panels"] if p["type"] != "row"]


def exprs(panel: dict) -> str:
    return " ".join(t["expr"] for t in panel.get("targets", []))


def find(title: str) -> dict:
    return next(p for p in PANELS if p["title"] == title)


def test_ids_unique_and_grid_does_not_overlap() -> None:
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in DASHBOARD["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps at {(x, y)}"
                cells.add((x, y))


def test_required_views() -> None:
    scatter = find("Predicted speedup vs arrival rate")
    assert scatter["type"] == "xychart"
    assert "sd_arrival_rate_rps" in exprs(scatter) and "sd_predicted_speedup" in exprs(scatter)
    assert "vllm:spec_decode_num_accepted_tokens_total" in exprs(find("Acceptance over time"))
    assert find("Acceptance distribution")["type"] == "histogram"
    assert find("SD state")["type"] == "state-timeline"
    assert "sd_effective_batch_size" in exprs(find("Effective batch"))
    breakeven = exprs(find("Arrival rate vs break-even"))
    assert "sd_break_even_rate_rps" in breakeven and "sd_arrival_rate_rps" in breakeven
    latency = exprs(find("End-to-end latency (vLLM histograms)"))
    assert "histogram_quantile(0.5," in latency and "histogram_quantile(0.99," in latency
    assert "vllm:e2e_request_latency_seconds_bucket" in latency


def test_toggles_are_annotations() -> None:
    names = {a["name"]: a for a in DASHBOARD["annotations"]["list"]}
    assert "sd_toggles_total" in names["SD toggles"]["expr"]


def test_every_query_uses_the_datasource_variable_and_filters_by_replica() -> None:
    for p in PANELS:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        for t in p["targets"]:
            assert 'pod=~"$pod"' in t["expr"], f"{p['title']} {t['refId']}"
            assert t["datasource"]["uid"] == "${datasource}"
