"""Bearer tokens for the admin API: read from a file or an environment variable.

Shared by the daemon's hooks, the launcher and the simulator. A token never appears in a log
line, a status body or an error message: errors name the file or variable, not the value.
"""

from __future__ import annotations

import os
from pathlib import Path

from controller.errors import ConfigError


def read_token(token_file: str | os.PathLike[str] | None, env_var: str, file_option: str) -> str | None:
    """The token from ``token_file`` (wins) or ``env_var``; None when neither is set.

    ``file_option`` names the setting or flag in errors (an unreadable or empty file).
    """
    if token_file:
        path = Path(token_file)
        try:
            token = path.read_text(encoding="utf-8-sig").strip()  # an editor's byte-order mark is no part of it
        except OSError as exc:
            raise ConfigError(f"{file_option}: cannot read {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{file_option}: {path} is not UTF-8 text") from None
        if not token:
            raise ConfigError(f"{file_option}: {path} is empty")
        _check_token(token, f"{file_option}: {path}")
        return token
    token = os.environ.get(env_var, "").strip() or None
    if token is not None:
        _check_token(token, env_var)
    return token


def _check_token(token: str, where: str) -> None:
    """ConfigError unless every character is one an HTTP header carries as it is (visible
    ASCII): a line break or a non-ASCII one fails in the request, whose error would quote the
    header, token and all. Names where it came from, never the value."""
    if not all("!" <= ch <= "~" for ch in token):
        raise ConfigError(
            f"{where}: the token holds a space, a line break or a non-ASCII character (one token, one line)"
        )


ADMIN_TOKEN_ENV = "SD_LAUNCHER_ADMIN_TOKEN"


def read_admin_token(token_file: str | os.PathLike[str] | None, insecure_no_token: bool) -> str | None:
    """The admin API's token (``--admin-token-file`` or ``SD_LAUNCHER_ADMIN_TOKEN``).

    Served by ``launch`` and ``simulate`` alike. None only with ``insecure_no_token``;
    otherwise a missing token is a ConfigError.
    """
    token = read_token(token_file, ADMIN_TOKEN_ENV, f"--admin-token-file {token_file}")
    if token is None and not insecure_no_token:
        raise ConfigError(f"no admin token: set {ADMIN_TOKEN_ENV} or --admin-token-file (or --insecure-no-token)")
    return token
