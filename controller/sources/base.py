"""The source contract: how the controller learns what its vLLM is doing.

Implementations: :class:`~controller.sources.prometheus.PrometheusSource` (PromQL over
Prometheus' HTTP API) and :class:`~controller.sources.vllm_metrics.VllmMetricsSource` (vLLM's
/metrics scraped directly); the simulator and the backtest bring their own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

import requests

from controller.model import MAX_TOKENS_PER_REQUEST
from controller.observation import ObserveResult

# What an HTTP source retries once: refused, timed out, or a body cut off mid-transfer
# (requests' ChunkedEncodingError is not a ConnectionError).
TRANSIENT_HTTP_ERRORS = (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError)

# vLLM's /metrics is ~100 kB and a PromQL answer of ours a few kB: a body past this is not one
# of them, and reading it all could exhaust the sidecar's memory.
MAX_BODY_BYTES = 32 * 2**20

# What no request can be (MAX_TOKENS_PER_REQUEST: the model's bound on a request's tokens), and
# no server keeps one request this long. A mean past them is a glitch, never a workload.
MAX_E2E_LATENCY_S = 30 * 86400.0
# A probability read as a ratio of counters may overshoot 1 by rounding, never by more.
PROBABILITY_SLACK = 1e-6


class BodyTooLarge(Exception):
    """A response body past :data:`MAX_BODY_BYTES`: read no further."""


def capped_body(max_bytes: int = MAX_BODY_BYTES) -> dict[str, Any]:
    """``hooks=`` for a requests call that reads the body in chunks and raises
    :class:`BodyTooLarge` past ``max_bytes`` (decoded), before holding it all in memory."""

    def read(resp: requests.Response, *args: Any, **kwargs: Any) -> requests.Response:
        declared = resp.headers.get("Content-Length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            resp.close()
            raise BodyTooLarge(f"response body over {max_bytes} bytes ({int(declared)} declared; not read)")
        chunks, size = [], 0
        for chunk in resp.iter_content(64 * 1024):
            size += len(chunk)
            if size > max_bytes:
                resp.close()
                raise BodyTooLarge(f"response body over {max_bytes} bytes (not read further)")
            chunks.append(chunk)
        # requests reads the body after its response hooks, unless it has been read already.
        resp._content = b"".join(chunks)
        return resp

    return {"response": read}


def out_of_range(values: Mapping[str, float | None], limits: Mapping[str, tuple[float, float, str]]) -> str | None:
    """Why one of ``values`` cannot be true: outside its ``(low, high, why)`` in ``limits`` (NaN
    and ±Inf included); None when all are in range or unmeasured (None). Pure."""
    for name, value in values.items():
        low, high, why = limits[name]
        if value is not None and not (math.isfinite(value) and low <= value <= high):
            return f"{name} is {value:g}, outside [{low:g}, {high:g}] ({why})"
    return None


def observation_limits(max_e2e_latency_s: float = MAX_E2E_LATENCY_S) -> dict[str, tuple[float, float, str]]:
    """What each bounded field of an observation can be: ``(low, high, why)``."""
    share = (0.0, 1.0 + PROBABILITY_SLACK, "a share of the drafted tokens")
    length = (0.0, MAX_TOKENS_PER_REQUEST, "tokens a request")
    return {
        "acceptance_rate": share,
        "position_acceptance": (0.0, 1.0 + PROBABILITY_SLACK, "accepted per draft"),
        "mean_draft_tokens": (0.0, math.inf, "draft tokens per draft"),
        "mean_prompt_tokens": length,
        "mean_gen_tokens": length,
        "mean_e2e_latency_s": (0.0, max_e2e_latency_s, f"seconds, {_latency_limit(max_e2e_latency_s)}"),
        "running": (0.0, math.inf, "requests"),
        "waiting": (0.0, math.inf, "requests"),
    }


def _latency_limit(max_e2e_latency_s: float) -> str:
    if max_e2e_latency_s < MAX_E2E_LATENCY_S:
        return "the server's uptime"
    return f"{MAX_E2E_LATENCY_S / 86400:g} days, longer than any request lasts"


def probability(value: float | None) -> float | None:
    """A ratio already checked against :func:`observation_limits`, its rounding excess over 1 removed."""
    return None if value is None else min(max(value, 0.0), 1.0)


class Source(Protocol):
    def observe(self, now: float) -> ObserveResult:
        """What the server looks like at ``now`` (the controller's clock, unix seconds).

        What the controller relies on:

        * It never raises for a server or a network that misbehaves: the result is then an
          :class:`~controller.observation.ObservationFailure` with a reason (unreachable,
          empty, NaN, implausible, ...), and the controller holds its state.
        * A number it could not measure is ``None``, never 0 (KEDA #3065): a missing
          acceptance rate means SD is off or drafted nothing, and the assessment uses the
          last measured one.
        * ``sample_age_s`` says how old the newest sample is; an observation older than
          ``max_observation_age_s`` is held as stale.
        * ``arrival_rate_long_rps`` (optional) is the rate over ``long_window_s``: with the
          short one it gives the load trend the switch price is projected along.
        """
        ...
