"""Pure argv handling: split a vLLM command line into its SD-off base and its speculative
config, and rebuild the command line for a requested SD setting.

Nothing here touches a process, a file or the network; tests are tables.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from controller.admin_api import MAX_SPEC_TOKENS, MIN_SPEC_TOKENS, OFF, SdConfig
from controller.errors import InputError

SPEC_FLAG = "--speculative-config"
SPEC_SHORT = "-sc"
# vLLM's shorthand flags -> keys of the speculative config JSON.
SPEC_ALIASES = {
    "--spec-method": "method",
    "--spec-model": "model",
    "--spec-tokens": "num_speculative_tokens",
}
TOKENS_KEY = "num_speculative_tokens"
DEFAULT_VLLM_PORT = 8000
_WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]"}


@dataclass(frozen=True)
class Profile:
    """A vLLM command line split into the part without SD and the speculative config."""

    base_argv: tuple[str, ...]
    spec: dict[str, Any] | None = field(default=None, hash=False)

    @property
    def sd_available(self) -> bool:
        return self.spec is not None

    @property
    def default_config(self) -> SdConfig:
        """The SD setting the command line itself asks for."""
        if self.spec is None:
            return OFF
        tokens = self.spec.get(TOKENS_KEY)
        return SdConfig(True, tokens if isinstance(tokens, int) else None)


def _parse_json_object(text: str, flag: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{flag}: not valid JSON ({exc.msg} at char {exc.pos})") from None
    if not isinstance(value, dict):
        raise InputError(f"{flag}: expected a JSON object, got {type(value).__name__}")
    return value


def _scalar(text: str) -> Any:
    """A dotted-flag value: JSON when it parses (4, true, null, {...}), else the raw string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _set_dotted(spec: dict[str, Any], dotted: str, value: Any, flag: str) -> None:
    keys = dotted.split(".")
    if not all(keys):
        raise InputError(f"{flag}: empty key in {dotted!r}")
    node = spec
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise InputError(f"{flag}: {key!r} is not an object")
        node = child
    node[keys[-1]] = value


def _take_value(argv: list[str], i: int, flag: str) -> tuple[str, int]:
    """Value of the flag at argv[i] (``--flag=value`` or ``--flag value``) and the next index."""
    arg = argv[i]
    if "=" in arg and arg.startswith("-"):
        return arg.split("=", 1)[1], i + 1
    if i + 1 >= len(argv):
        raise InputError(f"{flag}: missing value at the end of the vLLM command line")
    return argv[i + 1], i + 2


def parse_profile(argv: list[str] | tuple[str, ...]) -> Profile:
    """Split a vLLM command line into its SD-off base and its speculative config.

    Recognises ``--speculative-config JSON`` / ``-sc JSON`` / ``--speculative-config=JSON``,
    the dotted ``--speculative-config.KEY VALUE`` / ``--speculative-config.KEY=VALUE`` form
    and ``--spec-method`` / ``--spec-model`` / ``--spec-tokens``. Later flags override
    earlier keys, like vLLM's own parser. Raises InputError (one line) on bad JSON or a
    flag without a value. The order of the remaining arguments is kept.
    """
    argv = list(argv)
    base: list[str] = []
    spec: dict[str, Any] | None = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0] if arg.startswith("-") else arg
        if name in (SPEC_FLAG, SPEC_SHORT):
            value, i = _take_value(argv, i, name)
            obj = _parse_json_object(value, name)
            spec = {**(spec or {}), **obj}
        elif name.startswith(SPEC_FLAG + "."):
            value, i = _take_value(argv, i, name)
            spec = dict(spec or {})
            _set_dotted(spec, name[len(SPEC_FLAG) + 1 :], _scalar(value), name)
        elif name in SPEC_ALIASES:
            value, i = _take_value(argv, i, name)
            spec = dict(spec or {})
            spec[SPEC_ALIASES[name]] = _scalar(value) if name == "--spec-tokens" else value
        else:
            base.append(arg)
            i += 1
    if spec is not None and TOKENS_KEY in spec:
        _check_tokens(spec[TOKENS_KEY], f"{SPEC_FLAG} {TOKENS_KEY}")
    return Profile(tuple(base), spec)


def _check_tokens(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{what}: expected an integer, got {value!r}")
    if not MIN_SPEC_TOKENS <= value <= MAX_SPEC_TOKENS:
        raise InputError(f"{what}: {value} is outside {MIN_SPEC_TOKENS}..{MAX_SPEC_TOKENS}")
    return value


def build_argv(profile: Profile, config: SdConfig) -> list[str]:
    """The vLLM command line for ``config``: the base, plus one canonical
    ``--speculative-config JSON`` when SD is on (with the requested draft length).

    Raises InputError when SD is asked for but the command line has no speculative config.
    """
    argv = list(profile.base_argv)
    if not config.enabled:
        return argv
    if profile.spec is None:
        raise InputError("SD requested but the vLLM command line has no --speculative-config")
    spec = dict(profile.spec)
    if config.num_speculative_tokens is not None:
        spec[TOKENS_KEY] = _check_tokens(config.num_speculative_tokens, TOKENS_KEY)
    return [*argv, SPEC_FLAG, json.dumps(spec, separators=(",", ":"), sort_keys=True)]


def resolve_config(profile: Profile, enabled: bool, num_speculative_tokens: int | None) -> SdConfig:
    """The concrete setting for a request: off drops the draft length; on without one uses the
    command line's. Raises InputError when SD is requested but unavailable."""
    if not enabled:
        return OFF
    if profile.spec is None:
        raise InputError("cannot enable SD: the vLLM command line has no speculative config")
    if num_speculative_tokens is None:
        return profile.default_config
    return SdConfig(True, _check_tokens(num_speculative_tokens, TOKENS_KEY))


_SECRET_WORDS = ("key", "token", "secret", "password")


def redact_argv(argv: list[str] | tuple[str, ...]) -> list[str]:
    """The command line for a log: values of flags such as ``--api-key`` become ``***``."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append("***")
            hide_next = False
            continue
        name, eq, _value = arg.partition("=")
        secret = arg.startswith("-") and any(w in name.lower() for w in _SECRET_WORDS)
        if secret and eq:
            out.append(f"{name}=***")
        else:
            out.append(arg)
            hide_next = secret and not eq
    return out


def option_value(argv: list[str] | tuple[str, ...], flag: str) -> str | None:
    """The last value of ``flag`` (``--flag v`` or ``--flag=v``), or None."""
    found = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(flag + "="):
            found = arg[len(flag) + 1 :]
    return found


def vllm_url(argv: list[str] | tuple[str, ...]) -> str:
    """Base URL the launcher polls, from ``--host``/``--port`` (wildcards mean loopback)."""
    host = option_value(argv, "--host")
    port_text = option_value(argv, "--port")
    if host is None or host in _WILDCARD_HOSTS:
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    port = DEFAULT_VLLM_PORT
    if port_text is not None:
        try:
            port = int(port_text)
        except ValueError:
            raise InputError(f"--port in the vLLM command line: not an integer: {port_text!r}") from None
    return f"http://{host}:{port}"


def shutdown_timeout_s(argv: list[str] | tuple[str, ...]) -> float | None:
    """vLLM's own ``--shutdown-timeout`` (seconds) when the command line sets one."""
    text = option_value(argv, "--shutdown-timeout")
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise InputError(f"--shutdown-timeout in the vLLM command line: not a number: {text!r}") from None
    if value < 0:
        raise InputError(f"--shutdown-timeout in the vLLM command line: negative: {text!r}")
    return value
