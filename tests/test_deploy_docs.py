"""docs/deployment.md documents every controller metric and has a runbook for every alert."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from tests.support.controller_metrics import EXPOSED_NAMES

ROOT = Path(__file__).resolve().parents[1]
GUIDE = (ROOT / "docs" / "deployment.md").read_text()


def anchors(markdown: str) -> set[str]:
    """GitHub-style heading anchors."""
    out = set()
    for line in markdown.splitlines():
        m = re.match(r"^#+\s+(.*)$", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m[1].strip().lower()).replace(" ", "-"))
    return out


def test_every_controller_metric_is_in_the_reference() -> None:
    missing = [name for name in sorted(EXPOSED_NAMES) if f"`{name}" not in GUIDE]
    assert not missing, f"metrics missing from docs/deployment.md: {missing}"


def test_every_alert_links_to_its_runbook_section() -> None:
    groups = yaml.safe_load((ROOT / "deploy/prometheus/alert-rules.yml").read_text())["groups"]
    heads = anchors(GUIDE)
    for rule in (r for g in groups for r in g["rules"] if "alert" in r):
        url = rule["annotations"]["runbook_url"]
        path, _, anchor = url.partition("#")
        assert path == "docs/deployment.md", rule["alert"]
        assert anchor == rule["alert"].lower() and anchor in heads, rule["alert"]


def test_the_guide_covers_what_operators_must_know() -> None:
    for phrase in (
        "One controller per replica",
        "What a toggle costs",
        "at least two replicas",
        "sd-controller bench",
        "sd-controller calibrate",
        "Metrics reference",
        "Runbook",
    ):
        assert phrase.lower() in GUIDE.lower(), phrase
