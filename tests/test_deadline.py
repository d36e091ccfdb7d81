"""Whole-request deadlines: a peer that drips bytes cannot hold a call past its timeout."""

import time

import pytest
import requests

from controller import deadline
from controller.hooks.base import ChangeRequest, HookError
from controller.hooks.http import HttpHook
from controller.observation import FailureReason
from controller.sources.prometheus import PrometheusSource
from controller.sources.vllm_metrics import VllmMetricsSource
from tests.support.stub_http import StubHttp, json_answer

# Each byte arrives well within any read timeout; the whole answer would take minutes.
DRIP = {"drip_s": 0.3, "max_drip_bytes": 400}
BODY = '{"status": "success", "padding": "' + "x" * 300 + '"}'


def test_request_returns_or_raises_within_the_deadline():
    with StubHttp(json_answer(BODY), **DRIP) as stub:
        t0 = time.monotonic()
        with pytest.raises(requests.Timeout, match="within 1s"):
            deadline.request(deadline.session(), "GET", stub.url + "/x", 1.0)
        assert time.monotonic() - t0 < 2.0
    with StubHttp(json_answer('{"ok": true}')) as stub:
        assert deadline.request(deadline.session(), "GET", stub.url + "/x", 1.0).json() == {"ok": True}


def test_vllm_source_holds_a_dripping_metrics_endpoint():
    with StubHttp(json_answer(BODY), **DRIP) as stub:
        src = VllmMetricsSource(url=stub.url + "/metrics", timeout_s=0.5)
        t0 = time.monotonic()
        o = src.observe(time.time())
        assert o.reason is FailureReason.UNREACHABLE
        assert time.monotonic() - t0 < 3.0  # two attempts of 0.5 s and the retry wait


def test_prometheus_source_holds_a_dripping_api_within_its_budget():
    with StubHttp(json_answer(BODY), **DRIP) as stub:
        src = PrometheusSource(stub.url, timeout_s=0.5)
        t0 = time.monotonic()
        o = src.observe(time.time())
        assert o.reason is FailureReason.UNREACHABLE
        assert time.monotonic() - t0 < 3.0


def test_http_hook_gives_up_on_a_dripping_peer():
    with StubHttp(json_answer(BODY), **DRIP) as stub:
        hook = HttpHook(stub.url + "/admin/speculative", stub.url + "/admin/status", "t0ken", timeout_s=0.5, retries=1)
        t0 = time.monotonic()
        with pytest.raises(HookError, match="timed out"):
            hook.request(ChangeRequest(enabled=True, num_speculative_tokens=4, reason="test"))
        assert hook.status().last_error is not None
        assert time.monotonic() - t0 < 6.0


def test_a_change_answered_too_late_is_not_sent_again_and_is_uncertain():
    import threading

    first = threading.Event()

    def respond(method, path, body):
        if not first.is_set():  # the first POST is carried out, but answered too late
            first.set()
            time.sleep(1.5)
            return 202, "application/json", b'{"changed": true}'
        return 409, "application/json", b'{"error": "restart in progress"}'

    with StubHttp(respond) as stub:
        hook = HttpHook(stub.url + "/admin/speculative", None, "t0ken", timeout_s=0.5, retries=3)
        with pytest.raises(HookError, match="timed out") as exc:
            hook.request(ChangeRequest(enabled=False, num_speculative_tokens=None, reason="test"))
        assert exc.value.uncertain, "the attempt may have switched: keep the pending lock"
        # A retry would restart a server that may be restarting on the first: one POST only.
        assert [m for m, _ in stub.requests] == ["POST"]
