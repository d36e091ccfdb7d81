"""The sources' settings and which source they ask for.

Adding a source: its module in this package (a class with ``observe(now) -> ObserveResult``,
see :class:`controller.sources.base.Source`), its settings as fields of :class:`SourceSettings`
here, and its branch in :func:`build_source`.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, Field, field_validator

from controller.config import GROUP_CONFIG, http_url
from controller.errors import ConfigError
from controller.model import LatencyModel, Workload, stability_limits
from controller.sources.base import Source
from controller.sources.fleet import FleetSource
from controller.sources.prometheus import PrometheusSource, render_queries
from controller.sources.vllm_metrics import VllmMetricsSource


class SourceSettings(BaseModel):
    """Where observations come from: Prometheus (PromQL) or vLLM's /metrics scraped directly."""

    model_config = GROUP_CONFIG

    prometheus_url: str | None = Field(
        None, description="Prometheus base URL; when unset, vLLM's /metrics is scraped directly."
    )
    prometheus_selector: str = Field(
        "", description='Label matchers for this vLLM instance, e.g. model_name="llama",instance="10.0.0.5:8000".'
    )
    prometheus_fleet_selector: str | None = Field(
        None,
        description='Fleet mode: label matchers for every replica of the fleet, e.g. job="vllm",namespace="llm"; a switch is then priced with the replicas serving now (needs prometheus_url).',
    )
    prometheus_timeout_s: float = Field(5.0, gt=0, description="Timeout of one Prometheus query.")
    rate_window_s: float = Field(60.0, gt=0, description="Window of the arrival-rate estimate.")
    acceptance_window_s: float = Field(300.0, gt=0, description="Window of the rolling acceptance rate.")
    queries: dict[str, str] = Field(
        default_factory=dict,
        description="PromQL overrides by name (arrival_rate, acceptance_rate, ...); see docs/daemon.md.",
    )
    vllm_metrics_url: str = Field(
        "http://127.0.0.1:8000/metrics", description="vLLM /metrics, scraped directly when no Prometheus URL is set."
    )
    vllm_model_name: str | None = Field(
        None, description="Only count series with this model_name label (direct scraping)."
    )

    @field_validator("prometheus_url", "vllm_metrics_url")
    @classmethod
    def _source_urls(cls, v: str | None) -> str | None:
        return http_url(v)


def plausible_rate_limit_rps(model: LatencyModel) -> float:
    """The highest arrival rate a source believes: no server completes requests faster than
    with one-token prompts and one-token answers; twice that, for a calibration that is off."""
    off, _ = stability_limits(model, 0.5, 1, Workload(prompt_tokens=1.0, gen_tokens=1.0))
    return 2.0 * off if math.isfinite(off) and off > 0 else math.inf


def build_source(s: Any, model: LatencyModel | None = None) -> Source:
    """The source the settings ask for: Prometheus when ``prometheus_url`` is set, else vLLM's
    /metrics. ``s`` is the Settings (the windows include the pricing group's ``long_window_s``);
    ``model`` bounds what a source believes. ConfigError names a bad setting."""
    bounds: dict[str, Any] = {}
    if model is not None:
        limit = plausible_rate_limit_rps(model)
        bounds = {"max_num_seqs": model.max_num_seqs, "max_rate_rps": limit if math.isfinite(limit) else None}
    if s.prometheus_url:
        try:
            render_queries(s.prometheus_selector, s.rate_window_s, s.acceptance_window_s, s.long_window_s, s.queries)
        except ValueError as exc:
            raise ConfigError(f"setting queries: {exc}") from exc
        source = PrometheusSource(
            s.prometheus_url, s.prometheus_selector, s.rate_window_s, s.acceptance_window_s, s.long_window_s,
            s.queries, s.prometheus_timeout_s, **bounds,
        )  # fmt: skip
        if s.prometheus_fleet_selector:
            return FleetSource(source, source, s.prometheus_fleet_selector, s.rate_window_s, s.long_window_s)
        return source
    if s.prometheus_fleet_selector:
        raise ConfigError("setting prometheus_fleet_selector: needs prometheus_url (the fleet is read from Prometheus)")
    if not s.vllm_metrics_url:  # set empty (SD_CONTROLLER_VLLM_METRICS_URL=): no source at all
        raise ConfigError("setting vllm_metrics_url: required when prometheus_url is unset (vLLM's /metrics URL)")
    return VllmMetricsSource(
        url=s.vllm_metrics_url, model_name=s.vllm_model_name, rate_window_s=s.rate_window_s,
        acceptance_window_s=s.acceptance_window_s, long_window_s=s.long_window_s, timeout_s=s.prometheus_timeout_s,
        **bounds,
    )  # fmt: skip
