"""Daemon settings: environment (prefix ``SD_CONTROLLER_``), an optional YAML/JSON file, defaults.

The fields are defined by concern in :mod:`controller.config` (decision, pricing, sources,
hook, exporter, files); this module reads them. Every field has a description; the README's
settings tables are generated from the groups
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
from typing import Any, TypeVar, get_args

import yaml
from pydantic import BaseModel, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

from controller.config import (
    DecisionSettings,
    ExporterSettings,
    FileSettings,
    LearningSettings,
    OverrideMode,
    PolicyConfig,
    PricingSettings,
)
from controller.coordination.setup import CoordinationSettings
from controller.errors import ConfigError
from controller.hooks.setup import HookSettings, HookType
from controller.sources.setup import SourceSettings

__all__ = ["HookType", "OverrideMode", "Settings", "load_settings"]

ENV_PREFIX = "SD_CONTROLLER_"
# Variables with the prefix that are not settings: the compose file's image tag.
NOT_SETTINGS = frozenset({"SD_CONTROLLER_IMAGE"})


M = TypeVar("M", bound=BaseModel)

# The groups by name: ``Settings.<name>`` is that group's values (and the README's headings).
GROUPS: dict[str, type[BaseModel]] = {
    "decision": DecisionSettings,
    "pricing": PricingSettings,
    "sources": SourceSettings,
    "hook": HookSettings,
    "exporter": ExporterSettings,
    "files": FileSettings,
    "learning": LearningSettings,
    "coordination": CoordinationSettings,
}


class Settings(
    BaseSettings,
    DecisionSettings,
    PricingSettings,
    SourceSettings,
    HookSettings,
    ExporterSettings,
    FileSettings,
    LearningSettings,
    CoordinationSettings,
):
    """All knobs of ``sd-controller run``: the seven groups, flat (:data:`GROUPS`).

    Each field is read from ``SD_CONTROLLER_<NAME>``; ``settings.<group>`` (decision, pricing,
    sources, hook, exporter, files, coordination) is one group's values, ``settings.policy`` what the pure
    core is given.
    """

    # allow_inf_nan=False: evaluation_interval_s=inf (or a NaN threshold) is a typo, not a setting.
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="forbid",
        validate_default=True,
        allow_inf_nan=False,
        frozen=False,
        coerce_numbers_to_str=True,  # `replica_id: 1` in YAML is the string an env var gives
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_yes_no_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """A number given as true/false (YAML's ``draft_length: yes``, ``--set draft_length=true``)
        is a slip, not 1 or 0, which pydantic's lax mode would read it as."""
        field = cls.model_fields[info.field_name]
        numeric = {field.annotation, *get_args(field.annotation)} & {int, float}
        values = value if isinstance(value, list) else [value]
        slip = next((v for v in values if isinstance(v, bool)), None) if numeric else None
        if slip is not None:
            within = " (in the list)" if isinstance(value, list) else ""
            raise ValueError(f"{str(slip).lower()}{within} is a yes/no value, not a number")
        return value

    def group(self, name: str) -> BaseModel:
        """The values of one group of :data:`GROUPS`."""
        return self._as(GROUPS[name])

    def _as(self, cls: type[M]) -> M:
        return cls.model_validate({field: getattr(self, field) for field in cls.model_fields})

    @property
    def decision(self) -> DecisionSettings:
        return self._as(DecisionSettings)

    @property
    def pricing(self) -> PricingSettings:
        return self._as(PricingSettings)

    @property
    def sources(self) -> SourceSettings:
        return self._as(SourceSettings)

    @property
    def hook(self) -> HookSettings:
        return self._as(HookSettings)

    @property
    def exporter(self) -> ExporterSettings:
        return self._as(ExporterSettings)

    @property
    def files(self) -> FileSettings:
        return self._as(FileSettings)

    @property
    def coordination(self) -> CoordinationSettings:
        return self._as(CoordinationSettings)

    @property
    def policy(self) -> PolicyConfig:
        """The frozen part the decision core (policy.py, assessment.py) is given."""
        return self._as(PolicyConfig)

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
    kind = "JSON" if p.suffix == ".json" else "YAML"
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config file {p}: cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {p}: not UTF-8 text (byte {exc.start})") from None
    try:
        data = json.loads(text) if kind == "JSON" else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {p}: not valid JSON: {exc.msg} at line {exc.lineno}") from None
    except yaml.YAMLError as exc:  # its own text spans lines (a snippet, a caret): one line here
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(
            f"config file {p}: not valid YAML: {getattr(exc, 'problem', None) or 'unreadable'}{where}"
        ) from None
    except RecursionError:
        raise ConfigError(f"config file {p}: nested too deeply") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p}: top level must be a mapping of setting names to values")
    odd = next((k for k in data if not isinstance(k, str)), None)
    if odd is not None:
        raise ConfigError(f"config file {p}: key {odd!r} is not a setting name")
    return data


def load_settings(config_file: str | os.PathLike[str] | None = None, **overrides: Any) -> Settings:
    """Build Settings from file + overrides (beating the environment); one-line ConfigError."""
    values: dict[str, Any] = {}
    if config_file:
        values.update(read_config_file(config_file))
    values.update(overrides)  # None included: --set NAME=null clears what the environment set
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
    # A nested field (queries.arrival_rate) lives in its setting's variable (SD_CONTROLLER_QUERIES).
    env = f"{ENV_PREFIX}{str(err['loc'][0]).upper()}" if err["loc"] else ""
    name = f"setting {loc} ({env})" if loc else "settings"
    msg = err["msg"].removeprefix("Value error, ")
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{name}: {msg}{more}"


def markdown_table() -> str:
    """The README's settings tables, one per group, generated from the model."""
    parts = []
    for group, cls in GROUPS.items():
        doc = " ".join((cls.__doc__ or "").split())
        rows = [f"**{group}** — {doc}", "", "| setting | env | default | description |", "|---|---|---|---|"]
        for name, field in cls.model_fields.items():
            default = field.default_factory() if field.default_factory else field.default  # type: ignore[call-arg]
            if isinstance(default, StrEnum):
                default = default.value
            shown = (
                "—"
                if default in (None, "")
                else f"`{json.dumps(default) if isinstance(default, list | dict) else default}`"
            )
            rows.append(f"| `{name}` | `{ENV_PREFIX}{name.upper()}` | {shown} | {field.description} |")
        parts.append("\n".join(rows))
    return "\n\n".join(parts)


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
