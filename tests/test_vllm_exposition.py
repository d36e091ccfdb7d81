"""The simulated /metrics must look exactly like vLLM 0.32's to anything that scrapes it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from controller.sim.vllm_exposition import (
    E2E_LATENCY_BUCKETS_S,
    TOKEN_BUCKETS,
    Histogram,
    SpecDecodeCounters,
    VllmCounters,
    format_value,
    render,
)

FIXTURES = Path(__file__).parent / "fixtures" / "vllm-0.32-cpu"
CAPTURES = {
    "sd-off": FIXTURES / "metrics-sd-off.txt",
    "sd-ngram-k4": FIXTURES / "metrics-sd-ngram-k4.txt",
    "dynamic-sd-k0": FIXTURES / "metrics-dynamic-sd-k0.txt",
}
HISTOGRAMS = (
    "request_prompt_tokens",
    "request_generation_tokens",
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "request_time_per_output_token_seconds",
    "e2e_request_latency_seconds",
)


def shapes(text: str) -> dict[str, tuple[str, set[tuple[str, frozenset[str]]]]]:
    """family name -> (type, {(sample name, label names)})."""
    out = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = (fam.type, {(s.name, frozenset(s.labels)) for s in fam.samples})
    return out


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def capture_shapes() -> dict[str, tuple[str, set]]:
    merged: dict[str, tuple[str, set]] = {}
    for path in CAPTURES.values():
        for name, (kind, sample_shapes) in shapes(path.read_text()).items():
            prev = merged.setdefault(name, (kind, set()))
            assert prev[0] == kind, f"captures disagree on the type of {name}"
            prev[1].update(sample_shapes)
    return merged


def counters_from_capture(text: str) -> VllmCounters:
    """The VllmCounters whose rendering should reproduce a capture's vLLM sample values."""
    values = {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("engine",)))): (s.value)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    model = ("model_name", "tiny")

    def get(name: str, *extra: tuple[str, str]) -> float:
        return values[(name, tuple(sorted((model, *extra))))]

    def hist(stem: str, bounds: tuple[float, ...]) -> Histogram:
        return Histogram(
            bounds=bounds,
            cumulative=tuple(get(f"vllm:{stem}_bucket", ("le", format_value(b))) for b in bounds),
            sum=get(f"vllm:{stem}_sum"),
            count=get(f"vllm:{stem}_count"),
        )

    def bounds_of(stem: str) -> tuple[float, ...]:
        les = {dict(k[1]).get("le") for k in values if k[0] == f"vllm:{stem}_bucket"}
        return tuple(sorted(float(le) for le in les if le != "+Inf"))

    sd = None
    if ("vllm:spec_decode_num_drafts_total", (model,)) in values:
        positions = sorted(
            int(dict(k[1])["position"]) for k in values if k[0] == "vllm:spec_decode_num_accepted_tokens_per_pos_total"
        )
        sd = SpecDecodeCounters(
            num_drafts=get("vllm:spec_decode_num_drafts_total"),
            num_draft_tokens=get("vllm:spec_decode_num_draft_tokens_total"),
            num_accepted_tokens=get("vllm:spec_decode_num_accepted_tokens_total"),
            accepted_per_pos=tuple(
                get("vllm:spec_decode_num_accepted_tokens_per_pos_total", ("position", str(p))) for p in positions
            ),
        )
    reasons = {dict(k[1])["finished_reason"]: v for k, v in values.items() if k[0] == "vllm:request_success_total"}
    return VllmCounters(
        model_name="tiny",
        engine="0",
        created_ts=1.7959994703717847e09,
        request_success=reasons,
        prompt_tokens_total=get("vllm:prompt_tokens_total"),
        generation_tokens_total=get("vllm:generation_tokens_total"),
        num_requests_running=get("vllm:num_requests_running"),
        num_requests_waiting=get("vllm:num_requests_waiting"),
        spec_decode=sd,
        **{stem: hist(stem, bounds_of(stem)) for stem in HISTOGRAMS},
    )


SD_ON = VllmCounters(
    created_ts=1.7959994703717847e09,
    request_success={"length": 8.0},
    spec_decode=SpecDecodeCounters(128, 360, 216, (104, 72, 32, 8)),
)
SD_OFF = VllmCounters(created_ts=1.7959994703717847e09, request_success={"stop": 3.0})


@pytest.mark.parametrize("counters", [SD_ON, SD_OFF], ids=["sd-on", "sd-off"])
def test_every_rendered_family_matches_the_captures(counters: VllmCounters) -> None:
    reference = capture_shapes()
    rendered = shapes(render(counters))
    assert rendered, "nothing rendered"
    for name, (kind, sample_shapes) in rendered.items():
        assert name in reference, f"{name} is not in any vLLM 0.32 capture"
        ref_kind, ref_shapes = reference[name]
        assert kind == ref_kind, f"{name}: type {kind}, captures say {ref_kind}"
        assert sample_shapes <= ref_shapes, f"{name}: {sample_shapes - ref_shapes} not in captures"
        # Every series the captures have for this family is rendered too (e.g. all 5
        # finished_reason values, all buckets).
        assert {s for s in ref_shapes} <= sample_shapes | {s for s in ref_shapes if s[0].endswith("_created")}, name


@pytest.mark.parametrize("capture", list(CAPTURES), ids=list(CAPTURES))
def test_rendering_a_capture_s_counters_reproduces_its_values(capture: str) -> None:
    text = CAPTURES[capture].read_text()
    expected = samples(text)
    got = samples(render(counters_from_capture(text)))
    compared = 0
    for key, value in got.items():
        if key[0].endswith("_created"):
            continue  # vLLM stamps each family separately; we use one engine start time
        assert key in expected, key
        assert value == expected[key], key
        compared += 1
    assert compared > 120


def test_histogram_bucket_boundaries_are_vllms() -> None:
    text = CAPTURES["sd-ngram-k4"].read_text()
    reference = samples(text)
    rendered = samples(render(SD_ON))
    for stem in HISTOGRAMS:
        name = f"vllm:{stem}_bucket"
        ref_les = {dict(k[1])["le"] for k in reference if k[0] == name}
        got_les = {dict(k[1])["le"] for k in rendered if k[0] == name}
        assert got_les == ref_les, stem


def test_sd_series_exist_only_with_an_sd_block() -> None:
    off = render(SD_OFF)
    on = render(SD_ON)
    assert "spec_decode" not in off
    fams = shapes(on)
    for name in (
        "vllm:spec_decode_num_drafts",
        "vllm:spec_decode_num_draft_tokens",
        "vllm:spec_decode_num_accepted_tokens",
        "vllm:spec_decode_num_accepted_tokens_per_pos",
    ):
        assert fams[name][0] == "counter"
    per_pos = {k: v for k, v in samples(on).items() if k[0] == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
    assert sorted(dict(k[1])["position"] for k in per_pos) == ["0", "1", "2", "3"]
    assert sorted(per_pos.values()) == [8, 32, 72, 104]


def test_the_text_is_byte_identical_to_vllm_for_shared_lines() -> None:
    """Beyond parsing: label order, number formatting and HELP text are vLLM's, line by line."""
    fixture_lines = set(CAPTURES["sd-ngram-k4"].read_text().splitlines())
    counters = counters_from_capture(CAPTURES["sd-ngram-k4"].read_text())
    for line in render(counters).splitlines():
        if "_created" in line and not line.startswith("#"):
            continue
        assert line in fixture_lines, line


def test_label_values_are_escaped() -> None:
    text = render(VllmCounters(model_name='org/m"x\\y\nz'))
    names = {s.labels["model_name"] for f in text_string_to_metric_families(text) for s in f.samples}
    assert names == {'org/m"x\\y\nz'}


def test_histogram_observe() -> None:
    h = Histogram.empty(TOKEN_BUCKETS).observe(7, 3).observe(5000).observe(1.0)
    assert h.count == 5
    assert h.sum == 7 * 3 + 5000 + 1
    assert h.cumulative[TOKEN_BUCKETS.index(1.0)] == 1
    assert h.cumulative[TOKEN_BUCKETS.index(10.0)] == 4
    assert h.cumulative[-1] == 4  # 5000 only in +Inf
    assert Histogram.empty(E2E_LATENCY_BUCKETS_S).observe(1.0, 0).count == 0


@given(st.lists(st.floats(min_value=0, max_value=1e4), max_size=30))
def test_histogram_buckets_stay_cumulative(values: list[float]) -> None:
    h = Histogram.empty(E2E_LATENCY_BUCKETS_S)
    for v in values:
        h = h.observe(v)
    assert list(h.cumulative) == sorted(h.cumulative)
    assert all(c <= h.count for c in h.cumulative)
    assert h.count == len(values)


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_value_format_is_prometheus_clients(value: float) -> None:
    assert format_value(value) == floatToGoString(value)


def test_nan_and_inf() -> None:
    assert format_value(math.inf) == "+Inf"
    assert format_value(float("nan")) == "NaN"
