"""Starting from a wrong calibration, the real loop's online correction converges in a simulated day.

The simulator serves the truth (its own step costs, noise, queueing, restarts); the controller
believes another calibration and learns only from the latency it observes (bench/bench_correction.py
prints the figures for every case).
"""

import logging

import pytest
import structlog

from controller.calibration import load
from controller.correction import scaled_model
from controller.shipped import example_calibration_path
from controller.sim import scenarios
from controller.sim.convergence import measure, run_day

EXAMPLE = load(example_calibration_path()).latency_model()


@pytest.fixture(autouse=True)
def quiet():
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    yield
    structlog.reset_defaults()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("label", "engine", "believed"),
    [
        ("load costs ×1.4", {}, scaled_model(EXAMPLE, (1.0, 1.4, 1.0, 1.4))),
        (
            "example on another server",
            {"cost_scale_off": 0.8, "cost_scale_on": 0.85, "cost_quadratic_s_per_token2": 5e-10},
            EXAMPLE,
        ),
    ],
)
def test_corrected_model_error_on_the_running_mode_after_a_day_is_within_5_percent(label, engine, believed):
    sc = scenarios.load("demo-day")
    sc = sc.with_changes(engine=engine) if engine else sc
    c = measure(run_day(sc, EXAMPLE, believed), label, last_s=6 * 3600.0)
    assert c.ticks_used > 200, c
    assert abs(c.bias_calibrated) > 0.15 or c.mape_15min_calibrated > 0.15, c  # the start was wrong
    assert abs(c.bias_corrected) <= 0.05, c
    assert c.mape_15min <= 0.05, c
    assert not c.alarm, c
