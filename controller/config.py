"""Typed settings groups, one per concern, and what the pure core is given.

Each group is a frozen pydantic model with a description per field (the README's settings
tables are generated from them). Here: decision, pricing, exporter and files; the sources'
group lives with the sources (:mod:`controller.sources.setup`), the hook's with the hooks
(:mod:`controller.hooks.setup`). :class:`controller.settings.Settings` composes all six and
reads them from the environment (``SD_CONTROLLER_<NAME>``, names unchanged by the grouping)
or a file; nothing here reads an environment variable, a file or a clock.

:class:`PolicyConfig` is the part the decision core (``policy.py``, ``assessment.py``) sees:
the decision and pricing groups plus the rate window the trend is measured over.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Any, Self
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from controller.admin_api import MAX_SPEC_TOKENS

MAX_DRAFT_LENGTH = MAX_SPEC_TOKENS  # what the launcher accepts; draft_length has the same bound


class OverrideMode(StrEnum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"


def http_url(v: str | None) -> str | None:
    """An http(s) URL with a host and a valid port (a bare one without its trailing slash);
    empty is None. ValueError says what is wrong."""
    if v is None or v == "":
        return None
    parts = urlsplit(v)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an http(s) URL with a host")
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise ValueError("has an invalid port (must be 1..65535)")
    return v.rstrip("/") if parts.path in ("", "/") else v


# allow_inf_nan=False: evaluation_interval_s=inf (or a NaN threshold) is a typo, not a setting.
# coerce_numbers_to_str: `replica_id: 1` in YAML (or --set replica_id=1) is the string an env var gives.
GROUP_CONFIG = ConfigDict(
    frozen=True, extra="forbid", validate_default=True, allow_inf_nan=False, coerce_numbers_to_str=True
)


class DecisionSettings(BaseModel):
    """When to switch: the tick, the thresholds, the dwell, failures, acceptance, draft length and
    the operator's override."""

    model_config = GROUP_CONFIG

    evaluation_interval_s: float = Field(
        60.0, gt=0, description="Seconds between ticks (observe, predict, decide, act)."
    )
    enable_threshold: float = Field(1.2, gt=0, description="Enable SD when the predicted speedup is above this.")
    enable_on_pessimistic_speedup: bool = Field(
        True,
        description="Enable SD only when the pessimistic end of the prediction interval (step costs off by the calibration's residual error) clears enable_threshold.",
    )
    enable_posterior_z: float = Field(
        1.645,
        ge=0,
        description="With online correction, enabling also takes this many posterior standard deviations of the log speedup off its pessimistic end (combined with the calibration's interval, which is 1.645 σ: both ≈ 90 %): what SD-off evidence cannot pin down (the draft's own terms, the split of the target's fixed and load costs at one load) must not talk the controller into a restart. 0: the calibration's interval only.",
    )
    disable_threshold: float = Field(1.05, gt=0, description="Disable SD when the predicted speedup is below this.")
    dwell_s: float = Field(300.0, ge=0, description="Minimum seconds between two applied changes.")
    pending_timeout_s: float = Field(
        600.0, gt=0, description="A change not confirmed by the hook within this many seconds is marked failed."
    )
    failure_backoff_s: float = Field(
        300.0, gt=0, description="Wait after a failed change before trying again; doubles per consecutive failure."
    )
    failure_backoff_max_s: float = Field(3600.0, gt=0, description="Upper bound of the failure backoff.")
    acceptance_floor: float = Field(
        0.2,
        ge=0,
        le=1,
        description="Rolling acceptance (vLLM's accepted / draft tokens) below this for acceptance_floor_window_s disables SD whatever the model says: a draft that has stopped working. vLLM's rate falls with the draft length (α 0.65 reads 0.38 at γ 4, where SD still pays at low load), so keep it low; the model already weighs the measured acceptance.",
    )
    acceptance_floor_window_s: float = Field(600.0, gt=0, description="How long acceptance must stay below the floor.")
    acceptance_prior: float = Field(
        0.6,
        ge=0,
        le=1,
        description="vLLM-style acceptance rate assumed when none was ever measured or the last one is too old.",
    )
    acceptance_prior_sd: float = Field(
        0.15,
        ge=0,
        le=1,
        description="How far the prior may be off (vLLM rate). A prior is a guess and enabling SD on it is a restart into the state with less capacity, so an unmeasured acceptance is taken enable_posterior_z of these below the prior (0: the prior as is). Once SD runs, its counters replace it.",
    )
    acceptance_max_age_s: float = Field(
        604800.0,
        gt=0,
        description="A measured acceptance older than this (SD off for long) is replaced by the prior. A week: the last measurement of this server's drafts is a better guess than a generic prior (a 6 h limit let a 0.6 prior re-enable SD at 0.38 measured, to be disabled again 20 minutes later).",
    )
    max_observation_age_s: float = Field(
        180.0, gt=0, description="Observations whose newest sample is older than this are stale: hold."
    )
    draft_length: int = Field(
        4,
        ge=1,
        le=MAX_DRAFT_LENGTH,
        description="num_speculative_tokens used when SD is enabled (and assumed for the running config if the hook does not report it).",
    )
    adapt_draft_length: bool = Field(
        False, description="When enabling SD, request the model's best draft length instead of draft_length."
    )
    draft_length_candidates: list[int] = Field(
        default_factory=lambda: list(range(1, 17)), description="Draft lengths searched for the best one."
    )
    default_prompt_tokens: float = Field(512.0, gt=0, description="Mean prompt length assumed until one is measured.")
    default_gen_tokens: float = Field(256.0, gt=0, description="Mean generated length assumed until one is measured.")
    override: OverrideMode = Field(
        OverrideMode.AUTO,
        description="auto: the controller decides; on/off: force SD through the hook (the pending lock still holds).",
    )

    @field_validator("override", mode="before")
    @classmethod
    def _yaml_switch(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare on/off as a boolean: `override: off` means the string.
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v

    @field_validator("draft_length_candidates")
    @classmethod
    def _candidates(cls, v: list[int]) -> list[int]:
        if not v or min(v) < 1 or max(v) > MAX_DRAFT_LENGTH:
            raise ValueError(
                f"must be a non-empty list of integers in 1..{MAX_DRAFT_LENGTH} (what the launcher accepts)"
            )
        return sorted(set(v))

    @model_validator(mode="after")
    def _decision_consistent(self) -> Self:
        if self.enable_threshold <= self.disable_threshold:
            raise ValueError(
                f"enable_threshold ({self.enable_threshold}) must be greater than disable_threshold ({self.disable_threshold})"
            )
        if self.failure_backoff_max_s < self.failure_backoff_s:
            raise ValueError("failure_backoff_max_s must be >= failure_backoff_s")
        return self


class PricingSettings(BaseModel):
    """What a switch costs (a restart's downtime, replicas) against what it gains (the projected
    load's latency until the load would undo it)."""

    model_config = GROUP_CONFIG

    price_switches: bool = Field(
        True, description="Weigh each switch's projected gain against its restart cost (otherwise thresholds only)."
    )
    restart_downtime_s: float = Field(
        90.0, gt=0, description="Assumed restart downtime until the hook reports measured ones."
    )
    replicas: int = Field(
        1,
        ge=1,
        description="Replicas behind the router: 1 means a restart is an outage; N > 1 a capacity dip of one replica.",
    )
    gain_horizon_max_s: float = Field(
        14400.0,
        gt=0,
        description="A switch's gain is integrated until the projected load would undo it (by the trend), at least the dwell and at most this.",
    )
    switch_margin: float = Field(
        1.5, ge=1, description="Switch only when projected gain exceeds the switch cost times this."
    )
    load_age_prior: bool = Field(
        True,
        description="When nothing forecasts how long the load lasts (no earlier days in the rate history, no steady fitted trend), weigh a switch's gain (enabling or disabling SD), and the safety net's observed harm, by the chance the load is still there: one seen for a seconds lasts T more with probability a/(a+T) (Gott's rule), so minutes of a load vouch for little and an hour of it for most of an hour's gain. Off: the gain runs to the horizon whatever the load's age.",
    )
    disable_ahead_of_rise: bool = Field(
        True,
        description="With SD on and the load rising along a steady line (r² ≥ 0.8 over the last two hours, ≥ 10 % an hour) toward SD's break-even, at most two hours before the rule would disable SD anyway, disable it as soon as restarting now is cheaper than at any later time until then: the restart's backlog grows with the rate, and SD's last gains before the crossing are small. Off: SD is disabled only once the load has passed the break-even.",
    )
    rise_saving_margin: float = Field(
        0.2,
        ge=0,
        description="Disable ahead of a rising load only when that saves more than this fraction of the restart's price against the restart the rule would make later (the model's error in both prices).",
    )
    capacity_headroom: float = Field(
        0.98,
        gt=0,
        le=1,
        description="A state run above this fraction of its stability limit counts as overloaded when pricing. The model's latency already rises toward the limit (the batch's chain of requests in the server) and its limits sit within 1 % of the measured ones on the fidelity bench, so this only covers that error (twice over): lower it for a model you trust less. Too low, and a busy but stable state is left by a restart under load that costs more than hours in it (the busiest minute of a steady load is 1–1.5 req/s above it at 12 req/s).",
    )
    long_window_s: float = Field(
        900.0, gt=0, description="Long rate window used with the short one to project the load trend."
    )
    congestion_margin: float = Field(
        0.8,
        gt=0,
        le=1,
        description="After SD was seen congested (full batch and a queue, two ticks running) at some rate, enabling it counts as entering an overload above this fraction of that rate, for congestion_memory_s (it guards re-enabling; SD that runs is judged by what it shows now).",
    )
    congestion_memory_s: float = Field(21600.0, gt=0, description="How long a seen SD congestion is remembered.")
    trend_lookahead_s: float = Field(
        900.0, ge=0, description="How far ahead a rising load trend is projected when deciding (at least the dwell)."
    )
    excursion_filter_s: float | None = Field(
        None,
        ge=0,
        description="A switch signal must persist this long before it acts: a load excursion shorter than a restart's recovery is over before the switch could help. Unset: the restart downtime estimate plus restart_drain_s plus the time the new state needs to work off the outage's backlog (λ·D/(μ − λ), μ at the low end of its prediction interval; none for an overload the server shows and the rate history never saw arrive), at most excursion_filter_max_s.",
    )
    excursion_filter_max_s: float = Field(
        3600.0,
        gt=0,
        description="Upper bound of the excursion filter (a load that lasts this long is acted on, however long the backlog would take to drain).",
    )
    restart_drain_s: float = Field(
        30.0,
        ge=0,
        description="Seconds a restart drains in-flight requests before vLLM goes down (added to the downtime for the excursion filter).",
    )
    startup_hold_s: float = Field(
        600.0,
        ge=0,
        description="After the controller starts, keep the state vLLM was launched with this long unless it is clearly wrong (predicted overloaded, or congested).",
    )
    expected_peak_rps: float | None = Field(
        None,
        gt=0,
        description="Peak arrival rate the next hours may bring (operator's knowledge). Enabling SD must then also pay for the restart back when the load climbs past SD's break-even; the controller's own rate history (the same hours yesterday and a week ago) counts as well.",
    )


class ExporterSettings(BaseModel):
    """What the controller reports: its /metrics and /healthz, webhook notices, logs."""

    model_config = GROUP_CONFIG

    exporter_host: str = Field(
        "127.0.0.1",
        description="Address of the controller's /metrics and /healthz (loopback by default; 0.0.0.0 for a scraper in another network namespace).",
    )
    exporter_port: int = Field(
        9464, ge=0, le=65535, description="Port of the controller's /metrics and /healthz (0 = pick one)."
    )
    webhook_url: str | None = Field(
        None, description="POSTed a JSON notice on acceptance-floor trips and failed changes."
    )
    log_format: str = Field("auto", description="auto (JSON lines unless on a TTY), json or console.")
    log_level: str = Field("info", description="debug, info, warning or error.")

    @field_validator("webhook_url")
    @classmethod
    def _webhook_url(cls, v: str | None) -> str | None:
        return http_url(v)

    @field_validator("log_format")
    @classmethod
    def _log_format(cls, v: str) -> str:
        if v not in ("auto", "json", "console"):
            raise ValueError("must be auto, json or console")
        return v

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, v: str) -> str:
        if v.lower() not in ("debug", "info", "warning", "error"):
            raise ValueError("must be debug, info, warning or error")
        return v.lower()


class FileSettings(BaseModel):
    """The files it reads and writes: the calibration, the state file, the override file."""

    model_config = GROUP_CONFIG

    calibration_file: str = Field(
        "",
        description="Calibration JSON (sd-controller calibrate); 'example' for the shipped example (not for production).",
    )
    max_num_seqs: int | None = Field(None, ge=1, description="Override the calibration's max_num_seqs.")
    state_file: Path = Field(
        Path("sd-controller-state.json"),
        description="Where the dwell clock, pending change and last acceptance survive restarts.",
    )
    override_file: Path | None = Field(
        None, description="File whose content (auto|on|off) overrides `override`; read every tick."
    )


class LearningSettings(BaseModel):
    """Closing the loop: the evidence history, the online correction of the model's step costs
    from the server's own latency, and the model-free safety net (controller/learning.py)."""

    model_config = GROUP_CONFIG

    online_correction: bool = Field(
        True, description="Correct the calibration's step costs online from the server's observed latency."
    )
    follow_prefix_caching: bool = Field(
        True,
        description="Price a full KV cache's preemptions by the server's own enable_prefix_caching (vllm:cache_config_info) when it reports one, over what the calibration recorded; off: keep the calibration's and only warn.",
    )
    evidence_file: Path | None = Field(
        None,
        description="Bounded per-tick history of load, observed and predicted latency (JSON lines); default: sd-controller-evidence.jsonl next to state_file.",
    )
    evidence_max_records: int = Field(4320, ge=16, le=100000, description="Records the evidence history keeps.")
    correction_file: Path | None = Field(
        None,
        description="Where the correction's posterior survives restarts; default: sd-controller-correction.json next to state_file.",
    )
    evidence_settle_s: float = Field(
        600.0,
        ge=0,
        description="After a restart, ticks are recorded but do not teach the model for this long (the backlog drains, windows mix modes).",
    )
    correction_prior_width: float = Field(
        0.3,
        gt=0,
        le=3,
        description="Prior standard deviation of the SD-only log correction factors; the target's (shared by both modes) get half.",
    )
    correction_half_life_s: float = Field(
        7200.0, gt=0, description="Evidence loses half its weight in this time (exponential forgetting)."
    )
    correction_max_factor: float = Field(
        2.0,
        gt=1,
        le=10,
        description="Corrections are clamped to [1/this, this]; wanting more raises the recalibration alarm.",
    )
    correction_noise: float = Field(
        0.03,
        gt=0,
        le=1,
        description="Relative model error assumed on top of the sampling noise of a tick's mean latency.",
    )
    model_error_threshold: float = Field(
        0.15,
        gt=0,
        le=1,
        description="Smoothed |observed/predicted − 1| above this is drift: the correction forgets 8× faster until it is back.",
    )
    safety_net: bool = Field(
        True, description="With SD on, disable it on observed harm or a growing queue, whatever the model says."
    )
    sd_harm_margin: float = Field(
        1.1,
        gt=1,
        description="Observed latency above this times the corrected SD-off prediction at the same load counts as harm.",
    )
    safety_net_ticks: int = Field(
        5, ge=1, description="Consecutive ticks of harm (or of a growing waiting queue) before the safety net acts."
    )


class PolicyConfig(DecisionSettings, PricingSettings, LearningSettings):
    """What the pure decision core is given (``Settings.policy``): the decision and pricing
    groups, and the short rate window that, with ``long_window_s``, measures the load trend."""

    model_config = GROUP_CONFIG

    rate_window_s: float = Field(60.0, gt=0, description="The sources' arrival-rate window (see rate_window_s).")
