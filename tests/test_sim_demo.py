"""`sd-controller demo` end to end on a short scenario, and the in-process controller run."""

from __future__ import annotations

import json

import pytest

from controller.cli import main

SHORT = """
kind: sd-controller/scenario
name: short
duration_s: 2400
seed: 2
arrival_rate: {kind: piecewise, points: [[0, 4], [900, 17.5], [2400, 17.5]]}
acceptance: {kind: constant, value: 0.6}
engine: {restart_downtime_s: 30, restart_jitter_s: 0}
"""


@pytest.fixture
def short_scenario(tmp_path):
    f = tmp_path / "short.yaml"
    f.write_text(SHORT)
    return f


@pytest.mark.slow
def test_demo_end_to_end(tmp_path, short_scenario, capsys):
    out = tmp_path / "out"
    rc = main(["demo", "--scenario", str(short_scenario), "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "always-on" in text and "always-off" in text and "controller" in text
    assert (out / "timeline.png").stat().st_size > 10_000
    summary = json.loads((out / "summary.json").read_text())
    runs = summary["runs"]
    # Rising through break-even: the controller must switch SD off and beat always-on.
    assert runs["controller"]["toggles"] >= 1
    assert runs["controller"]["mean_latency_s"] < runs["always-on"]["mean_latency_s"]


def test_demo_bad_scenario_is_usage_error(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("duration_s: 5\n")
    assert main(["demo", "--scenario", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml" in err and "arrival_rate" in err and len(err.strip().splitlines()) == 1
