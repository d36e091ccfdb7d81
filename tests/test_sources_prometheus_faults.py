"""The Prometheus source against a stub API on 127.0.0.1: answers that parse but lie."""

import json
from urllib.parse import parse_qs, urlsplit

import pytest

from controller.observation import FailureReason, Observation, ObservationFailure
from controller.sources.prometheus import PrometheusSource, render_queries
from tests.support.stub_http import StubHttp

SEL = 'model_name="tiny"'


def promql_stub(answers: dict[str, list[tuple[dict, float]]]):
    """Answer each default query by name with a vector; queries not listed get an empty one."""
    by_text = {text: name for name, text in render_queries(SEL, 60, 300, 900).items()}

    def respond(method, path, body):
        query = parse_qs(urlsplit(path).query)["query"][0]
        result = [{"metric": m, "value": [0, str(v)]} for m, v in answers.get(by_text.get(query, ""), [])]
        payload = {"status": "success", "data": {"resultType": "vector", "result": result}}
        return 200, "application/json", json.dumps(payload).encode()

    return respond


def healthy(**changes):
    answers = {
        "arrival_rate": [({}, 2.0)],
        "sample_age": [({}, 1.0)],
        "sd_present": [({}, 1.0)],
        "acceptance_rate": [({}, 0.6)],
        "position_acceptance": [({"position": "0"}, 0.8), ({"position": "1"}, 0.5)],
        "running": [({"engine": "0"}, 10.0)],
    }
    return answers | changes


def observe(answers, **kw):
    with StubHttp(promql_stub(answers)) as stub:
        return PrometheusSource(stub.url, SEL, timeout_s=2, **kw).observe(1_800_000_000.0)


def test_healthy_answers_make_an_observation():
    o = observe(healthy(), max_num_seqs=256, max_rate_rps=100)
    assert isinstance(o, Observation) and o.arrival_rate_rps == 2.0 and o.position_acceptance == (0.8, 0.5)


@pytest.mark.parametrize(
    ("changes", "kw", "needle"),
    [
        ({"position_acceptance": [({"position": "first"}, 0.8)]}, {}, "position label 'first'"),
        ({"arrival_rate": [({}, -5.0)]}, {"max_num_seqs": 16}, "negative"),
        ({"arrival_rate": [({}, -5.0)]}, {}, "negative"),
        ({"arrival_rate": [({}, 24_752.0)]}, {"max_rate_rps": 100}, "above the plausible 100"),
        ({"running": [({"engine": "0"}, 200_000.0)]}, {"max_num_seqs": 256}, "above max_num_seqs=256"),
    ],
)
def test_lies_are_held_with_a_reason(changes, kw, needle):
    o = observe(healthy(**changes), **kw)
    assert isinstance(o, ObservationFailure) and o.reason is FailureReason.IMPLAUSIBLE, o
    assert needle in o.detail


def test_negative_arrival_within_queue_drain_noise_reads_as_zero():
    # 256 requests drained mid-window: deriv() can undershoot by 1.5 * 256 / 60 = 6.4 req/s.
    o = observe(healthy(arrival_rate=[({}, -1.5)]), max_num_seqs=256)
    assert isinstance(o, Observation) and o.arrival_rate_rps == 0.0
