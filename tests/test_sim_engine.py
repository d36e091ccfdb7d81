"""The simulated engine: conservation, restarts, counters, agreement with the model."""

from __future__ import annotations

import numpy as np
import pytest

from controller.calibration import load
from controller.hooks.base import ChangeRequest, HookError, HookPhase
from controller.model import Workload, predict_point
from controller.sim.engine import F_ARR, F_FIN, Engine, SimHook, SimulatorDown, tokens_per_step_moments
from controller.sim.scenarios import Scenario
from tests.support import LEGACY_CALIBRATION


@pytest.fixture(scope="module")
def model():
    return load(LEGACY_CALIBRATION).latency_model()


def scenario(rate, duration=600.0, **engine) -> Scenario:
    return Scenario.model_validate(
        {
            "duration_s": duration,
            "seed": 5,
            "arrival_rate": rate if isinstance(rate, dict) else {"kind": "constant", "value": rate},
            "acceptance": {"kind": "constant", "value": 0.8},
            "classes": [
                {
                    "prompt_tokens": {"kind": "lognormal", "mean": 512, "sigma": 0.5},
                    "gen_tokens": {"kind": "uniform", "low": 1, "high": 400},
                }
            ],
            "engine": {"restart_downtime_s": 20, "restart_jitter_s": 0, "drain_limit_s": 5, **engine},
        }
    )


def conserved(e: Engine) -> bool:
    t = e.totals()
    return t.arrived == t.finished + t.running + t.waiting + t.lost


def test_conservation_through_restarts_and_overload(model):
    e = Engine(scenario({"kind": "steps", "initial": 6, "steps": [{"at_s": 200, "value": 25}]}), model)
    for t in range(30, 600, 30):
        e.advance_to(t)
        assert conserved(e), e.totals()
        if t in (120, 300, 450):
            assert e.request_restart(not e.applied.enabled, None) is True
            with pytest.raises(HookError):
                e.request_restart(e.applied.enabled, None)
    assert e.restart_count == 3
    assert e.waiting > 0  # 25 req/s overloads both modes
    assert e.lost > 0  # a 5 s drain cannot finish everything
    assert len(e.lost_arrivals()) == e.lost
    assert len(e.finished_log()) == e.finished


def test_restart_resets_counters_and_hides_metrics(model):
    e = Engine(scenario(5.0), model, epoch_s=1_000_000.0)
    e.advance_to(100)
    before = e.counters_snapshot()
    assert before.spec_decode is not None and before.request_success["stop"] > 0
    assert e.request_restart(False, None) is True
    e.advance_to(110)
    with pytest.raises(SimulatorDown):
        e.render_metrics()
    e.advance_to(140)
    after = e.counters_snapshot()
    assert after.spec_decode is None  # SD series exist only while SD is configured
    assert after.created_ts > before.created_ts
    assert after.request_success["stop"] < before.request_success["stop"]
    assert e.restart_durations_s and 20 <= e.restart_durations_s[0] <= 30


def test_same_config_is_a_noop(model):
    e = Engine(scenario(2.0), model)
    assert e.request_restart(True, 4) is False
    assert e.restart_count == 0


def test_hook_protocol(model):
    e = Engine(scenario(2.0), model)
    hook = SimHook(e)
    hook.request(ChangeRequest(enabled=False, num_speculative_tokens=None, reason="test"))
    assert hook.status().phase is HookPhase.RESTARTING
    with pytest.raises(HookError):
        hook.request(ChangeRequest(enabled=True, num_speculative_tokens=4, reason="again"))
    e.advance_to(60)
    st = hook.status()
    assert st.phase is HookPhase.READY and st.applied_enabled is False and st.restart_durations_s


def test_a_change_asked_for_in_the_warm_up_starts_when_it_ends(model):
    """A benchmark's warm-up is unmeasured: the launch state holds through it for every plan,
    the controller's too. The change waits (the hook says it is in flight) and starts then."""
    e = Engine(scenario(2.0), model)
    hook = SimHook(e, hold_until_s=300.0)
    e.advance_to(240)
    hook.request(ChangeRequest(enabled=False, num_speculative_tokens=None, reason="test"))
    assert e.restart_count == 0 and hook.status().phase is HookPhase.RESTARTING
    e.advance_to(280)
    hook.release()
    assert e.restart_count == 0 and e.applied.enabled  # still held
    e.advance_to(300)
    hook.release()
    assert e.restart_count == 1 and e.phase.value != "ready"
    e.advance_to(400)
    st = hook.status()
    assert st.phase is HookPhase.READY and st.applied_enabled is False


def test_tokens_per_step_moments_match_sampling():
    rng = np.random.default_rng(0)
    alpha, gamma = 0.7, 4
    accepted = rng.random((200_000, gamma)) < alpha
    n = 1 + np.cumprod(accepted, axis=1).sum(axis=1)
    mean, sd = tokens_per_step_moments(np.array([alpha]), gamma)
    assert mean[0] == pytest.approx(n.mean(), rel=5e-3)
    assert sd[0] == pytest.approx(n.std(), rel=1e-2)


@pytest.mark.parametrize(("sd", "rate"), [(False, 4.0), (False, 12.0), (True, 4.0), (True, 10.0)])
def test_latency_close_to_model_without_noise(model, sd, rate):
    """With fixed lengths and no extra nonlinearity the simulator agrees with the mean-value
    model within 12% below saturation (Poisson queueing adds a little)."""
    sc = Scenario.model_validate(
        {
            "duration_s": 900,
            "arrival_rate": {"kind": "constant", "value": rate},
            "acceptance": {"kind": "constant", "value": 0.8},
            "engine": {"initial_sd": sd, "cost_noise_sigma": 0.0},
        }
    )
    e = Engine(sc, model)
    e.advance_to(900)
    log = e.finished_log()
    lat = log[log[:, F_ARR] > 200]
    sim = float((lat[:, F_FIN] - lat[:, F_ARR]).mean())
    p = predict_point(model, rate, 0.8, 4, Workload(512, 256))
    expected = p.latency_on_s if sd else p.latency_off_s
    assert sim == pytest.approx(expected, rel=0.12)


def test_nonlinearity_and_scale_slow_it_down(model):
    base = Engine(scenario(8.0, 300, cost_noise_sigma=0.0), model)
    bent = Engine(scenario(8.0, 300, cost_noise_sigma=0.0, cost_quadratic_s_per_token2=1e-8, cost_scale_on=1.3), model)
    for e in (base, bent):
        e.advance_to(300)
    lat = [float((lg[:, F_FIN] - lg[:, F_ARR]).mean()) for lg in (base.finished_log(), bent.finished_log())]
    assert lat[1] > 1.2 * lat[0]


def test_deterministic_for_a_seed(model):
    runs = []
    for _ in range(2):
        e = Engine(scenario(6.0, 200), model)
        e.advance_to(200)
        runs.append(e.finished_log())
    np.testing.assert_array_equal(runs[0], runs[1])
