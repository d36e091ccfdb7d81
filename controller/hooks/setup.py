"""The hook's settings and which hook they ask for.

Adding a hook: its module in this package (a class with ``request(change)`` and ``status()``,
see :class:`controller.hooks.base.Hook`), a :class:`HookType` member and its settings as fields
of :class:`HookSettings` here, and its branch in :func:`build_hook`.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Self

from pydantic import BaseModel, Field, field_validator, model_validator

from controller.config import GROUP_CONFIG, http_url
from controller.errors import ConfigError
from controller.hooks.base import Hook
from controller.hooks.exec import ExecHook, NoHook
from controller.hooks.http import HttpHook, launcher_hook
from controller.tokens import read_token


class HookType(StrEnum):
    HTTP = "http"
    EXEC = "exec"
    LAUNCHER = "launcher"
    NONE = "none"


class HookSettings(BaseModel):
    """How SD is switched: the admin hook, its URL or command, token and TLS."""

    model_config = GROUP_CONFIG

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

    @field_validator("hook_url", "hook_status_url")
    @classmethod
    def _hook_urls(cls, v: str | None) -> str | None:
        return http_url(v)

    @model_validator(mode="after")
    def _hook_consistent(self) -> Self:
        if self.hook_type in (HookType.HTTP, HookType.LAUNCHER) and not self.hook_url:
            raise ValueError(f"hook_url is required for hook_type={self.hook_type.value}")
        if self.hook_type is HookType.EXEC and not self.hook_exec_argv:
            raise ValueError("hook_exec_argv is required for hook_type=exec")
        return self


def build_hook(s: HookSettings, applied_enabled: bool | None) -> Hook:
    """The hook the settings ask for (``applied_enabled``: what the state file remembers, for a
    hook that cannot ask). ConfigError when the token file cannot be read."""
    if s.hook_type is HookType.NONE:
        return NoHook()
    if s.hook_type is HookType.EXEC:
        return ExecHook(s.hook_exec_argv, s.hook_exec_timeout_s, initial_enabled=applied_enabled)
    token = read_token(s.hook_token_file, s.hook_token_env, "setting hook_token_file")
    if s.hook_ca_bundle is not None and not s.hook_ca_bundle.is_file():
        # Found missing at startup, not at the first switch, days later.
        raise ConfigError(f"setting hook_ca_bundle: {s.hook_ca_bundle} is not a readable file")
    verify: bool | str = str(s.hook_ca_bundle) if s.hook_ca_bundle else s.hook_tls_verify
    kw = {"timeout_s": s.hook_timeout_s, "retries": s.hook_retries, "verify": verify}
    assert s.hook_url
    if s.hook_type is HookType.LAUNCHER:
        return launcher_hook(s.hook_url, token, **kw)
    return HttpHook(s.hook_url, s.hook_status_url, token, **kw)
