"""Values the launcher reasons about, the admin request parser and the state file.

``parse_request`` and ``initial_config`` are pure; ``load_state``/``save_state`` do the
file I/O (atomic write; a corrupt file is moved aside, never trusted).
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from controller.admin_api import MAX_SPEC_TOKENS, MIN_SPEC_TOKENS, OFF, SdConfig
from controller.atomic import write_json_atomic
from controller.errors import ConfigError, InputError
from controller.launcher.profile import Profile, resolve_config

log = structlog.get_logger("controller.launcher.state")

STATE_VERSION = 1
INITIAL_STATES = ("on", "off", "last")
MAX_NOTE_CHARS = 200


@dataclass(frozen=True)
class SwitchRequest:
    """A validated POST /admin/speculative body. ``notes`` are the extra keys, for the log."""

    enabled: bool
    num_speculative_tokens: int | None
    notes: dict[str, str]

    def log_fields(self) -> dict[str, str]:
        """The notes as structlog keys (``note_<key>``), which cannot clash with its own."""
        return {"note_" + re.sub(r"\W", "_", key): value for key, value in self.notes.items()}


def parse_request(body: bytes) -> SwitchRequest:
    """Validate a POST /admin/speculative body; InputError (one line) says what is wrong.

    ``enabled`` (bool) is required; ``num_speculative_tokens`` is an optional int in 1..64
    (null: the command line's). Other keys (reason, requested_by, ...) are kept as short
    strings for the log, never rejected.
    """
    try:
        obj = json.loads(body.decode("utf-8") if body else "")
    except RecursionError:
        raise InputError("body is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of 5000 digits
        too_long = "digits" in str(exc) and not isinstance(exc, json.JSONDecodeError | UnicodeDecodeError)
        raise InputError("body has an integer that is too long" if too_long else "body is not valid JSON") from None
    if not isinstance(obj, dict):
        raise InputError(f"body must be a JSON object, got {type(obj).__name__}")
    if "enabled" not in obj:
        raise InputError("missing key 'enabled' (bool)")
    enabled = obj["enabled"]
    if not isinstance(enabled, bool):
        raise InputError(f"'enabled' must be a bool, got {type(enabled).__name__}")
    tokens = obj.get("num_speculative_tokens")
    if tokens is not None:
        if isinstance(tokens, bool) or not isinstance(tokens, int):
            raise InputError(f"'num_speculative_tokens' must be an integer, got {type(tokens).__name__}")
        if not MIN_SPEC_TOKENS <= tokens <= MAX_SPEC_TOKENS:
            raise InputError(f"'num_speculative_tokens' must be in {MIN_SPEC_TOKENS}..{MAX_SPEC_TOKENS}, got {tokens}")
    notes = {str(k)[:64]: _short(v) for k, v in obj.items() if k not in ("enabled", "num_speculative_tokens")}
    return SwitchRequest(enabled, tokens, notes)


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = " ".join(text.split())
    return text if len(text) <= MAX_NOTE_CHARS else text[: MAX_NOTE_CHARS - 3] + "..."


def initial_config(initial_state: str, profile: Profile, persisted: SdConfig | None) -> SdConfig:
    """The setting to start with.

    ``on``/``off`` force it (``on`` needs a speculative config: ConfigError otherwise);
    ``last`` takes the persisted setting when this command line can honour it, else the
    command line's own (on when it carries a speculative config).
    """
    if initial_state not in INITIAL_STATES:
        raise ConfigError(f"--initial-state: expected one of {', '.join(INITIAL_STATES)}")
    if initial_state == "off":
        return OFF
    if initial_state == "on":
        if not profile.sd_available:
            raise ConfigError("--initial-state on: the vLLM command line has no speculative config")
        return profile.default_config
    if persisted is not None:
        if not persisted.enabled:
            return OFF
        if profile.sd_available:
            return resolve_config(profile, True, persisted.num_speculative_tokens)
    return profile.default_config


def _config_from_json(obj: Any) -> SdConfig:
    if not isinstance(obj, dict) or obj.get("version") != STATE_VERSION:
        raise ValueError("not a version-1 launcher state object")
    applied = obj.get("applied")
    if not isinstance(applied, dict) or not isinstance(applied.get("enabled"), bool):
        raise ValueError("'applied.enabled' missing or not a bool")
    tokens = applied.get("num_speculative_tokens")
    if tokens is not None and (
        isinstance(tokens, bool) or not isinstance(tokens, int) or not MIN_SPEC_TOKENS <= tokens <= MAX_SPEC_TOKENS
    ):
        raise ValueError("'applied.num_speculative_tokens' is not an integer in 1..64")
    return SdConfig(applied["enabled"], tokens if applied["enabled"] else None)


def load_state(path: str | os.PathLike[str]) -> SdConfig | None:
    """The persisted applied setting, or None when there is none.

    A corrupt file is logged and renamed to ``<path>.corrupt`` so the next save starts
    clean and a human can look at it; the caller then falls back to its default.
    """
    target = Path(path)
    try:
        raw = target.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:  # a directory, no permission
        raise ConfigError(f"--state-file {target}: cannot read: {exc.strerror or exc}") from None
    try:
        return _config_from_json(json.loads(raw.decode("utf-8")))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        aside = target.with_name(target.name + ".corrupt")
        try:
            os.replace(target, aside)
        except OSError as move:
            raise ConfigError(
                f"--state-file {target}: corrupt, and cannot be set aside: {move.strerror or move}"
            ) from None
        log.warning("state_file_corrupt", path=str(target), moved_to=str(aside), error=str(exc))
        return None


def save_state(path: str | os.PathLike[str], applied: SdConfig, now: float | None = None) -> None:
    """Persist the applied setting atomically (readers see the old file or the new one)."""
    write_json_atomic(
        path,
        {
            "version": STATE_VERSION,
            "applied": applied.to_json(),
            "updated_at_unix_s": round(time.time() if now is None else now, 3),
        },
    )
