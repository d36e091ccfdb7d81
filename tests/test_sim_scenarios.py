"""Scenario files: built-ins load; bad files fail with one line naming the file and field."""

from __future__ import annotations

import numpy as np
import pytest

from controller.errors import InputError
from controller.sim import scenarios
from controller.sim.workload import generate_arrivals


def test_builtins_load():
    names = scenarios.builtin_names()
    assert {"demo-day", "quick", "oscillating", "always-overloaded"} <= set(names)
    for n in names:
        assert scenarios.load(n).duration_s > 0


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("duration_s: 10\narrival_rate: {kind: constant, value: -1}\n", "arrival_rate.constant.value"),
        ("duration_s: 10\narrival_rate: {kind: wobbly}\n", "arrival_rate"),
        ("arrival_rate: {kind: constant, value: 1}\n", "duration_s"),
        ("duration_s: 10\narrival_rate: {kind: constant, value: 1}\nengine: {drain_limit: 3}\n", "engine.drain_limit"),
        ("duration_s: [1\n", "not valid YAML"),
        ("- 1\n- 2\n", "top level"),
    ],
)
def test_bad_file_is_one_line_naming_file_and_field(tmp_path, text, needle):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(InputError) as err:
        scenarios.load(str(f))
    msg = str(err.value)
    assert "\n" not in msg and str(f) in msg and needle in msg


def test_unknown_name_lists_builtins():
    with pytest.raises(InputError, match=r"built-ins: .*demo-day"):
        scenarios.load("no-such-scenario")


def test_traces_and_mixes():
    sc = scenarios.load("long-context")
    rng = np.random.default_rng(1)
    arr, counts = generate_arrivals(rng, sc.arrival_rate, sc.acceptance, list(sc.classes), 0.0, 1.0, 3600)
    assert len(arr) == counts.sum() and np.all(np.diff(arr.time_s) >= 0)
    assert abs(len(arr) / 3600 - sc.arrival_rate.evaluate(np.arange(3600)).mean()) < 0.3
    rag = arr.klass == 0
    assert 0.7 < rag.mean() < 0.8
    assert arr.prompt[rag].mean() > 3 * arr.prompt[~rag].mean()
    assert arr.alpha[rag].mean() == pytest.approx(0.85)
