"""Fleet mode's view of the whole fleet: its arrival rate summed over the replicas, and how
many replicas serve it, read from Prometheus beside this replica's own observation.

Each controller still decides from its own replica's load; the fleet's figures only price a
switch (:func:`priced_for_fleet`): with N replicas serving, a restart is a capacity dip of
one replica that the other N − 1 absorb (``switch_cost`` with ``replicas`` = N), not an
outage. A fleet query that fails leaves both figures ``None`` (the configured ``replicas``
stays), never a reason to hold.
"""

from __future__ import annotations

import dataclasses
import math

import structlog

from controller.config import PolicyConfig
from controller.observation import Observation, ObserveResult
from controller.sources.base import Source
from controller.sources.prometheus import PrometheusSource, QueryFailed

log = structlog.get_logger("sd_controller")

FLEET_RATE = "sum(rate(vllm:request_success_total{$SEL}[$W]))"
# A replica counts as serving while its completions counter has fresh samples in the window.
FLEET_REPLICAS = "count(count by (namespace, pod, instance) (rate(vllm:request_success_total{$SEL}[$W])))"


class FleetSource:
    """This replica's ``inner`` source, its observation completed with the fleet's figures."""

    def __init__(
        self,
        inner: Source,
        prometheus: PrometheusSource,
        selector: str,
        rate_window_s: float,
        long_window_s: float | None = None,
    ) -> None:
        self.inner = inner
        self.prometheus = prometheus
        sel = selector.strip().strip("{}")
        window = f"{round(rate_window_s)}s"
        self.rate_query = FLEET_RATE.replace("$SEL", sel).replace("$W", window)
        self.replicas_query = FLEET_REPLICAS.replace("$SEL", sel).replace("$W", window)
        self.long_query = (
            FLEET_RATE.replace("$SEL", sel).replace("$W", f"{round(long_window_s)}s") if long_window_s else None
        )

    def __getattr__(self, name: str):  # url and the like, as the wrapped source has them
        return getattr(self.inner, name)

    def observe(self, now: float) -> ObserveResult:
        obs = self.inner.observe(now)
        if not isinstance(obs, Observation):
            return obs
        try:
            rate = sum(v for _, v in self.prometheus.query(self.rate_query, now))
            count = sum(v for _, v in self.prometheus.query(self.replicas_query, now))
        except QueryFailed as exc:
            log.warning("fleet_query_failed", reason=exc.reason.value, detail=exc.detail)
            return obs
        if not (math.isfinite(rate) and rate >= 0 and math.isfinite(count) and count >= 1):
            return obs  # empty fleet, NaN: not known
        long = None
        if self.long_query is not None:
            try:
                long = sum(v for _, v in self.prometheus.query(self.long_query, now))
            except QueryFailed as exc:  # the trend is a refinement: the rate alone still serves
                log.warning("fleet_query_failed", reason=exc.reason.value, detail=exc.detail)
            long = long if long is not None and math.isfinite(long) and long >= 0 else None
        return dataclasses.replace(
            obs, fleet_arrival_rate_rps=rate, fleet_replicas=round(count), fleet_arrival_rate_long_rps=long
        )


def priced_for_fleet(cfg: PolicyConfig, obs: ObserveResult) -> PolicyConfig:
    """``cfg`` with ``replicas`` set to the replicas serving the fleet now, when measured."""
    n = obs.fleet_replicas if isinstance(obs, Observation) else None
    if n is None or n == cfg.replicas:
        return cfg
    return cfg.model_copy(update={"replicas": n})
