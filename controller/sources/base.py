"""The source contract: how the controller learns what its vLLM is doing.

Implementations: :class:`~controller.sources.prometheus.PrometheusSource` (PromQL over
Prometheus' HTTP API) and :class:`~controller.sources.vllm_metrics.VllmMetricsSource` (vLLM's
/metrics scraped directly); the simulator and the backtest bring their own.
"""

from __future__ import annotations

from typing import Protocol

import requests

from controller.observation import ObserveResult

# What an HTTP source retries once: refused, timed out, or a body cut off mid-transfer
# (requests' ChunkedEncodingError is not a ConnectionError).
TRANSIENT_HTTP_ERRORS = (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError)


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
