"""The simulator's /metrics: parseable, and the same families and labels as real vLLM 0.32."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from controller.calibration import load
from controller.shipped import example_calibration_path
from controller.sim.engine import Engine
from controller.sim.scenarios import Scenario

FIXTURES = Path(__file__).parent / "fixtures" / "vllm-0.32-cpu"


def shapes(text: str) -> dict[str, tuple[str, set[tuple[str, frozenset[str]]]]]:
    out = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = (fam.type, {(s.name, frozenset(k for k in s.labels)) for s in fam.samples})
    return out


@pytest.fixture(scope="module")
def engine_texts():
    model = load(example_calibration_path()).latency_model()
    sc = Scenario.model_validate(
        {"duration_s": 300, "arrival_rate": {"kind": "constant", "value": 3}, "engine": {"restart_downtime_s": 10}}
    )
    e = Engine(sc, model)
    e.advance_to(60)
    on = e.render_metrics()
    e.request_restart(False, None)
    e.advance_to(120)
    off = e.render_metrics()
    return on, off


@pytest.mark.parametrize(("which", "capture"), [(0, "metrics-sd-ngram-k4.txt"), (1, "metrics-sd-off.txt")])
def test_families_and_labels_match_real_vllm(engine_texts, which, capture):
    ours = shapes(engine_texts[which])
    real = shapes((FIXTURES / capture).read_text(encoding="utf-8"))
    assert ours, "nothing rendered"
    for name, (kind, samples) in ours.items():
        assert name in real, f"{name} is not a vLLM 0.32 family"
        assert kind == real[name][0], name
        real_label_sets = {(n, labels) for n, labels in real[name][1]}
        for sample in samples:
            assert sample in real_label_sets, (name, sample)


def test_sd_series_only_while_sd_on(engine_texts):
    on, off = engine_texts
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" in on
    assert 'position="3"' in on
    assert "spec_decode" not in off


def test_counters_are_consistent(engine_texts):
    fams = {f.name: f for f in text_string_to_metric_families(engine_texts[0])}
    val = lambda fam, sample: next(s.value for s in fams[fam].samples if s.name == sample)  # noqa: E731
    drafts = val("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_drafts_total")
    draft_tokens = val("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_draft_tokens_total")
    accepted = val("vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_total")
    per_pos = [
        s.value for s in fams["vllm:spec_decode_num_accepted_tokens_per_pos"].samples if s.name.endswith("_total")
    ]
    assert draft_tokens == pytest.approx(4 * drafts)
    assert sum(per_pos) == pytest.approx(accepted)
    assert per_pos == sorted(per_pos, reverse=True)  # later positions are accepted less often
    # vLLM-style acceptance rate for α = 0.8 at γ = 4 is (E[N] − 1)/γ ≈ 0.59
    assert accepted / draft_tokens == pytest.approx(0.59, abs=0.04)
    success = sum(s.value for s in fams["vllm:request_success"].samples if s.name.endswith("_total"))
    e2e_count = next(s.value for s in fams["vllm:e2e_request_latency_seconds"].samples if s.name.endswith("_count"))
    assert success == e2e_count > 0
