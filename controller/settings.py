"""Daemon settings: environment (prefix ``SD_CONTROLLER_``), an optional YAML/JSON file, defaults.

Every field has a description; the README's settings table is generated from this model
(``python -m controller.settings --markdown``) so the two never drift. Invalid settings raise
:class:`~controller.errors.ConfigError` naming the setting (exit code 2 at startup).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

from controller.errors import ConfigError

ENV_PREFIX = "SD_CONTROLLER_"
# Variables with the prefix that are not settings: the compose file's image tag.
NOT_SETTINGS = frozenset({"SD_CONTROLLER_IMAGE"})
MAX_DRAFT_LENGTH = 64  # the launcher's MAX_SPEC_TOKENS; draft_length has the same bound


class HookType(StrEnum):
    HTTP = "http"
    EXEC = "exec"
    LAUNCHER = "launcher"
    NONE = "none"


class OverrideMode(StrEnum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"


class Settings(BaseSettings):
    """All knobs of ``sd-controller run``."""

    # allow_inf_nan=False: evaluation_interval_s=inf (or a NaN threshold) is a typo, not a setting.
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True, allow_inf_nan=False)

    # --- loop and decision -------------------------------------------------------------------
    evaluation_interval_s: float = Field(
        60.0, gt=0, description="Seconds between ticks (observe, predict, decide, act)."
    )
    enable_threshold: float = Field(1.2, gt=0, description="Enable SD when the predicted speedup is above this.")
    enable_on_pessimistic_speedup: bool = Field(
        True,
        description="Enable SD only when the pessimistic end of the prediction interval (step costs off by the calibration's residual error) clears enable_threshold.",
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
        0.4,
        ge=0,
        le=1,
        description="Rolling acceptance below this for acceptance_floor_window_s disables SD whatever the model says.",
    )
    acceptance_floor_window_s: float = Field(600.0, gt=0, description="How long acceptance must stay below the floor.")
    acceptance_prior: float = Field(
        0.6,
        ge=0,
        le=1,
        description="vLLM-style acceptance rate assumed when none was ever measured or the last one is too old.",
    )
    acceptance_max_age_s: float = Field(
        21600.0, gt=0, description="A measured acceptance older than this (SD off for long) is replaced by the prior."
    )
    max_observation_age_s: float = Field(
        180.0, gt=0, description="Observations whose newest sample is older than this are stale: hold."
    )
    draft_length: int = Field(
        4,
        ge=1,
        le=64,
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

    # --- pricing the switch ------------------------------------------------------------------
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
    capacity_headroom: float = Field(
        0.9,
        gt=0,
        le=1,
        description="A state run above this fraction of its stability limit counts as overloaded when pricing (the model is a fluid one: real queues blow up before the limit).",
    )
    long_window_s: float = Field(
        900.0, gt=0, description="Long rate window used with the short one to project the load trend."
    )
    congestion_margin: float = Field(
        0.8,
        gt=0,
        le=1,
        description="After SD was seen congested (full batch and a queue) at some rate, it is treated as overloaded above this fraction of that rate, for congestion_memory_s.",
    )
    congestion_memory_s: float = Field(21600.0, gt=0, description="How long a seen SD congestion is remembered.")
    trend_lookahead_s: float = Field(
        900.0, ge=0, description="How far ahead a rising load trend is projected when deciding (at least the dwell)."
    )

    # --- closing the loop: evidence, online correction, safety net (controller/learning.py) ---
    online_correction: bool = Field(
        True, description="Correct the calibration's step costs online from the server's observed latency."
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

    # --- observation sources -----------------------------------------------------------------
    prometheus_url: str | None = Field(
        None, description="Prometheus base URL; when unset, vLLM's /metrics is scraped directly."
    )
    prometheus_selector: str = Field(
        "", description='Label matchers for this vLLM instance, e.g. model_name="llama",instance="10.0.0.5:8000".'
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

    # --- admin hook --------------------------------------------------------------------------
    hook_type: HookType = Field(
        HookType.LAUNCHER,
        description="How to switch SD: http, exec, launcher (sd-controller launch) or none (observe only).",
    )
    hook_url: str | None = Field(
        "http://127.0.0.1:8091", description="http: the POST URL; launcher: the launcher's base URL."
    )
    hook_status_url: str | None = Field(
        None, description="http: URL polled for the applied state (JSON with phase and applied.enabled)."
    )
    hook_token_env: str = Field(
        "SD_CONTROLLER_HOOK_TOKEN", description="Name of the environment variable holding the bearer token."
    )
    hook_token_file: Path | None = Field(None, description="File holding the bearer token (wins over the env var).")
    hook_tls_verify: bool = Field(True, description="Verify TLS certificates of the hook URL.")
    hook_ca_bundle: Path | None = Field(None, description="CA bundle for the hook's TLS.")
    hook_timeout_s: float = Field(10.0, gt=0, description="Timeout of one hook HTTP call.")
    hook_retries: int = Field(3, ge=0, le=10, description="Retries on connection errors and 5xx.")
    hook_exec_argv: list[str] = Field(
        default_factory=list,
        description='exec: the command as a JSON list, e.g. ["/usr/local/bin/toggle-sd"]; gets SD_ENABLED, SD_NUM_SPECULATIVE_TOKENS, SD_REASON.',
    )
    hook_exec_timeout_s: float = Field(
        900.0, gt=0, description="exec: kill the command after this many seconds (the change fails)."
    )

    # --- operator controls, state, exporter, notifications -----------------------------------
    override: OverrideMode = Field(
        OverrideMode.AUTO,
        description="auto: the controller decides; on/off: force SD through the hook (the pending lock still holds).",
    )
    override_file: Path | None = Field(
        None, description="File whose content (auto|on|off) overrides `override`; read every tick."
    )
    state_file: Path = Field(
        Path("sd-controller-state.json"),
        description="Where the dwell clock, pending change and last acceptance survive restarts.",
    )
    calibration_file: str = Field(
        "",
        description="Calibration JSON (sd-controller calibrate); 'example' for the shipped example (not for production).",
    )
    max_num_seqs: int | None = Field(None, ge=1, description="Override the calibration's max_num_seqs.")
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

    @field_validator("prometheus_url", "hook_url", "hook_status_url", "webhook_url", "vllm_metrics_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
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

    @field_validator("draft_length_candidates")
    @classmethod
    def _candidates(cls, v: list[int]) -> list[int]:
        if not v or min(v) < 1 or max(v) > MAX_DRAFT_LENGTH:
            raise ValueError(
                f"must be a non-empty list of integers in 1..{MAX_DRAFT_LENGTH} (what the launcher accepts)"
            )
        return sorted(set(v))

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.enable_threshold <= self.disable_threshold:
            raise ValueError(
                f"enable_threshold ({self.enable_threshold}) must be greater than disable_threshold ({self.disable_threshold})"
            )
        if self.failure_backoff_max_s < self.failure_backoff_s:
            raise ValueError("failure_backoff_max_s must be >= failure_backoff_s")
        if self.hook_type in (HookType.HTTP, HookType.LAUNCHER) and not self.hook_url:
            raise ValueError(f"hook_url is required for hook_type={self.hook_type.value}")
        if self.hook_type is HookType.EXEC and not self.hook_exec_argv:
            raise ValueError("hook_exec_argv is required for hook_type=exec")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Explicit arguments (CLI flags, config file) beat the environment, which beats defaults.
        return (init_settings, env_settings)


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Settings from a YAML or JSON file (keys are field names, without the env prefix)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config file {p}: cannot read: {exc.strerror or exc}") from exc
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {p}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p}: top level must be a mapping of setting names to values")
    return data


def load_settings(config_file: str | os.PathLike[str] | None = None, **overrides: Any) -> Settings:
    """Build Settings from file + overrides (beating the environment); one-line ConfigError."""
    values: dict[str, Any] = {}
    if config_file:
        values.update(read_config_file(config_file))
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        settings = Settings(**values)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from exc
    except SettingsError as exc:  # a list or dict setting whose env value is not JSON
        field = re.search(r'field "(\w+)"', str(exc))
        name = field.group(1) if field else "?"
        raise ConfigError(f"setting {name} ({ENV_PREFIX}{name.upper()}): value is not valid JSON") from None
    unknown = unknown_env(os.environ, settings)
    if unknown:
        raise ConfigError(
            f"unknown environment variable(s) {', '.join(unknown)}: no such setting (typo?);"
            " see `python -m controller.settings` for the list"
        )
    return settings


def unknown_env(environ: Mapping[str, str], settings: Settings) -> list[str]:
    """``SD_CONTROLLER_*`` variables that name no setting (nor the hook token variable).

    pydantic-settings ignores them, so ``SD_CONTROLLER_ENABLE_TRESHOLD=2`` would be a silent
    no-op; a typo in a setting must stop the start instead.
    """
    known = {ENV_PREFIX + name.upper() for name in Settings.model_fields} | {settings.hook_token_env.upper()}
    known |= NOT_SETTINGS
    return sorted(k for k in environ if k.upper().startswith(ENV_PREFIX) and k.upper() not in known)


def describe_validation_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(x) for x in err["loc"])
    name = f"setting {loc} ({ENV_PREFIX}{loc.upper()})" if loc else "settings"
    msg = err["msg"].removeprefix("Value error, ")
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{name}: {msg}{more}"


def markdown_table() -> str:
    """The README's settings table, generated from the model."""
    rows = ["| setting | env | default | description |", "|---|---|---|---|"]
    for name, field in Settings.model_fields.items():
        default = field.default_factory() if field.default_factory else field.default
        if isinstance(default, StrEnum):
            default = default.value
        shown = (
            "—"
            if default in (None, "")
            else f"`{json.dumps(default) if isinstance(default, list | dict) else default}`"
        )
        rows.append(f"| `{name}` | `{ENV_PREFIX}{name.upper()}` | {shown} | {field.description} |")
    return "\n".join(rows)


README_MARKERS = ("<!-- settings-table:start -->", "<!-- settings-table:end -->")


def readme_with_table(readme: str) -> str:
    """The README text with the generated table between its markers."""
    start, end = README_MARKERS
    head, rest = readme.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{markdown_table()}\n{end}{tail}"


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--write-readme"]:
        path = Path(sys.argv[2] if len(sys.argv) > 2 else "README.md")
        path.write_text(readme_with_table(path.read_text(encoding="utf-8")), encoding="utf-8")
    else:
        print(markdown_table())
