"""`sd-controller demo --replicas N` end to end on a short scenario; its usage errors."""

from __future__ import annotations

import json

import pytest

from controller.cli import main

# Launched with SD on, the load rises past break-even (8.7 req/s on the truth) within ten
# minutes and stays there: the fleet must go off, one replica at a time.
SHORT = """
kind: sd-controller/scenario
name: short-fleet
description: "rising through break-even"
duration_s: 3000
seed: 3
arrival_rate: {kind: piecewise, points: [[0, 3], [300, 3], [600, 10], [3000, 10]]}
acceptance: {kind: constant, value: 0.65}
classes:
  - name: chat
    prompt_tokens: {kind: lognormal, mean: 1000, sigma: 0.6, max: 8000}
    gen_tokens: {kind: lognormal, mean: 280, sigma: 0.6, max: 2048}
engine: {initial_sd: true, restart_downtime_s: 30, restart_jitter_s: 0, drain_limit_s: 10}
"""


@pytest.mark.slow
def test_fleet_demo_end_to_end(tmp_path, capsys):
    sc = tmp_path / "short.yaml"
    sc.write_text(SHORT)
    out = tmp_path / "out"
    assert main(["demo", "--scenario", str(sc), "--replicas", "4", "--router", "rr", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fleet of 4 behind a rr router" in text and "always-off" in text
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["replicas"], summary["router"], summary["max_unavailable"]) == (4, "rr", 1)
    runs = summary["runs"]
    assert runs["controller"]["toggles"] >= 1 and runs["controller"]["max_restarting"] == 1
    assert runs["always-on"]["toggles"] == 0 and runs["always-on"]["sd_on_fraction"] == 1.0
    assert runs["controller"]["requests"] == runs["always-on"]["requests"] == runs["always-off"]["requests"]
    assert runs["controller"]["mean_latency_s"] < runs["always-on"]["mean_latency_s"]
    assert summary["verdict"].startswith("fleet of 4: controllers") and summary["verdict"] in text
    assert (out / "timeline.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--replicas", "0"], "--replicas 0: expected 1 to 64"),
        (["--replicas", "3", "--max-unavailable", "4"], "--max-unavailable 4: expected 1 to --replicas (3)"),
    ],
)
def test_fleet_demo_bad_numbers_are_one_line_usage_errors(tmp_path, capsys, args, message):
    assert main(["demo", *args, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
