"""One admin-status schema: what the launcher serves, the simulator imitates and the hook reads."""

from __future__ import annotations

from controller.admin_api import OFF, AdminStatus, HookPhase, SdConfig, admin_status
from controller.calibration import load
from controller.hooks.http import parse_status
from controller.launcher.profile import parse_profile
from controller.launcher.supervisor import Supervisor, SupervisorOptions
from controller.shipped import example_calibration_path
from controller.sim.engine import Engine
from controller.sim.scenarios import Scenario

KEYS = list(AdminStatus.model_fields)


def test_served_document_has_the_schemas_keys_in_order_and_reads_back():
    doc = admin_status(HookPhase.READY, SdConfig(True, 4), SdConfig(True, 4), 2, [70.5, 80.25], 123, None, "http://x")
    assert list(doc) == KEYS
    assert doc["phase"] == "ready" and doc["applied"] == {"enabled": True, "num_speculative_tokens": 4}
    assert doc["last_restart_duration_s"] == 80.25
    st = parse_status(doc)
    assert (st.phase, st.applied_enabled, st.applied_draft_length) == (HookPhase.READY, True, 4)
    assert st.restart_durations_s == (70.5, 80.25)


def test_launcher_and_simulator_serve_the_same_schema():
    supervisor = Supervisor(parse_profile(["vllm", "serve", "m"]), OFF, SupervisorOptions(vllm_url="http://v"))
    launcher_doc = supervisor.snapshot()
    scenario = Scenario.model_validate({"duration_s": 60, "arrival_rate": {"kind": "constant", "value": 1}})
    engine = Engine(scenario, load(example_calibration_path()).latency_model())
    sim_doc = engine.admin_status("http://v")
    assert list(launcher_doc) == list(sim_doc) == KEYS
    assert launcher_doc["phase"] == HookPhase.STARTING
    for doc in (launcher_doc, sim_doc):
        assert AdminStatus.model_validate(doc).to_json() == doc


def test_a_body_without_applied_enabled_reads_as_unknown_state():
    st = parse_status({"phase": "failed", "applied": {}, "last_error": "x"})
    assert (st.phase, st.applied_enabled, st.last_error) == (HookPhase.FAILED, None, "x")
