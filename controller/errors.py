"""Error types that carry a one-line, user-facing message naming what is wrong and where."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


class InputError(ValueError):
    """Bad user input (config, CSV, calibration file, HTTP body). ``str()`` is one line.

    CLIs turn it into exit code 2; nothing is written when it is raised.
    """

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


class ConfigError(InputError):
    """An invalid setting; the message names the setting."""


def validation_error_line(where: str, exc: Exception) -> str:
    """One line for a pydantic ValidationError: where, the first field's path, what is wrong."""
    errors = exc.errors()  # type: ignore[attr-defined]
    err = errors[0]
    loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {loc}: {err['msg']}{more}"


# Exit codes of every command: 2 for bad usage or config (an InputError), 1 for a failure at
# run time (a server that went away, a child that could not be kept up).
EXIT_OK, EXIT_RUNTIME, EXIT_USAGE = 0, 1, 2


def redact_url(url: str) -> str:
    """``url`` fit for an error or a log: without ``user:password@`` and without its query (a
    trigger URL's ``?token=``), which shows as ``?…``. Whatever cannot be read as a URL shows
    as nothing of itself."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(unreadable URL)"
    query = "…" if parts.query else ""
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, query, ""))
