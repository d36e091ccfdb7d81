"""HTTP admin hook: POST the desired state, poll a status URL until it is applied.

Bearer token from a file or an env var (never logged, never in an error message), TLS
verification on by default, per-call timeouts, tenacity retries on connection errors and 5xx
only (a 4xx is an answer, not a glitch); a change is not retried after a read timeout (the
server may be restarting on it). The ``launcher`` hook is this one pointed at
``sd-controller launch``'s admin API.
"""

from __future__ import annotations

from typing import Any

import requests
from pydantic import ValidationError
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential

from controller import deadline
from controller.admin_api import AdminStatus
from controller.errors import redact_url, validation_error_line
from controller.hooks.base import ChangeRequest, HookError, HookPhase, HookStatus


class _Retryable(Exception):
    """A 5xx: worth another try."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, requests.ConnectionError | requests.Timeout | _Retryable)


def _retryable_post(exc: BaseException) -> bool:
    """A change is retried only where it cannot have reached the server: a connection that
    failed or timed out before it was made, or a 5xx. A read timeout may be a server that is
    restarting on it: a retry would restart it again."""
    if isinstance(exc, requests.ConnectTimeout):
        return True
    if isinstance(exc, requests.Timeout):  # a read timeout, or the whole call's deadline
        return False
    return isinstance(exc, requests.ConnectionError | _Retryable)


class HttpHook:
    """``request`` POSTs JSON to ``url``; ``status`` GETs ``status_url``.

    The status body is :class:`~controller.admin_api.AdminStatus`, ``{"phase": ..., "applied": {"enabled": ...,
    "num_speculative_tokens": ...}, "restart_durations_s": [...], "last_error": ...}``; a plain
    ``{"enabled": bool}`` is read as a ready server with that state.
    """

    def __init__(
        self,
        url: str,
        status_url: str | None,
        token: str | None,
        timeout_s: float = 10.0,
        retries: int = 3,
        verify: bool | str = True,
        session: requests.Session | None = None,
    ) -> None:
        self.url = url
        self.status_url = status_url
        self._token = token
        self.timeout_s = timeout_s
        self.verify = verify
        self._session = deadline.session(session)
        self._timed_out = False  # an attempt of the current request timed out
        self._send, self._post = (
            retry(
                retry=retry_if_exception(when),
                stop=stop_after_attempt(retries + 1),
                wait=wait_exponential(multiplier=0.5, max=5),
                reraise=True,
            )(self._send_once)
            for when in (_retryable, _retryable_post)
        )

    def __repr__(self) -> str:  # never show the token
        return f"HttpHook(url={redact_url(self.url)!r}, status_url={self.status_url and redact_url(self.status_url)!r})"

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._token:
            h["Authorization"] = f"Bearer {self._token}"
        return h

    def _send_once(self, method: str, url: str, body: dict[str, Any] | None) -> requests.Response:
        # timeout_s bounds each whole call (a dripping peer included), not each read.
        try:
            resp = deadline.request(
                self._session, method, url, self.timeout_s, json=body, headers=self._headers(), verify=self.verify
            )
        except requests.Timeout:
            self._timed_out = True
            raise
        if resp.status_code >= 500:
            raise _Retryable(resp.status_code)
        return resp

    def request(self, change: ChangeRequest) -> None:
        body = {
            "enabled": change.enabled,
            "num_speculative_tokens": change.num_speculative_tokens,
            "reason": change.reason,
            "predicted_speedup": change.predicted_speedup,
            "requested_by": "sd-controller",
        }
        if change.num_speculative_tokens is None:
            body.pop("num_speculative_tokens")
        where = redact_url(self.url)
        self._timed_out = False
        try:
            resp = self._post("POST", self.url, body)
        except _Retryable as exc:
            raise HookError(f"{where}: HTTP {exc.status} after retries", uncertain=self._timed_out) from None
        except requests.Timeout:
            raise HookError(f"{where}: timed out after {self.timeout_s}s", uncertain=True) from None
        except requests.ConnectionError as exc:
            raise HookError(f"{where}: connection failed ({type(exc).__name__})", uncertain=self._timed_out) from None
        except (requests.RequestException, ValueError, OSError) as exc:
            # Before any byte was sent (a header it cannot encode, a CA bundle it cannot read):
            # the type alone, as the message may quote a header, the token with it.
            raise HookError(f"{where}: request not sent ({type(exc).__name__})", uncertain=self._timed_out) from None
        # An earlier attempt that timed out may have been carried out (a 409 "restart in
        # progress" on the retry says so): whatever the last answer, the outcome is uncertain.
        if resp.status_code == 401 or resp.status_code == 403:
            raise HookError(f"{where}: HTTP {resp.status_code}: token rejected", uncertain=self._timed_out)
        if not 200 <= resp.status_code < 300:
            raise HookError(f"{where}: HTTP {resp.status_code}: {_brief(resp)}", uncertain=self._timed_out)

    def status(self) -> HookStatus:
        if not self.status_url:
            return HookStatus(HookPhase.UNKNOWN)
        try:
            resp = self._send("GET", self.status_url, None)
        except (_Retryable, requests.RequestException, ValueError, OSError) as exc:
            return HookStatus(HookPhase.UNKNOWN, last_error=f"{redact_url(self.status_url)}: {type(exc).__name__}")
        if resp.status_code != 200:
            return HookStatus(HookPhase.UNKNOWN, last_error=f"{redact_url(self.status_url)}: HTTP {resp.status_code}")
        try:
            return parse_status(resp.json())
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            why = validation_error_line("status", exc) if isinstance(exc, ValidationError) else str(exc)
            return HookStatus(HookPhase.UNKNOWN, last_error=f"{redact_url(self.status_url)}: bad status body ({why})")


def parse_status(body: Any) -> HookStatus:
    """Read an :class:`~controller.admin_api.AdminStatus` (or a bare ``{"enabled": bool}``, a
    ready server with that state); ValueError when the body does not fit."""
    if not isinstance(body, dict):
        raise ValueError("status is not a JSON object")
    if "applied" not in body:
        applied = {"enabled": body.get("enabled"), "num_speculative_tokens": body.get("num_speculative_tokens")}
        body = {**body, "phase": HookPhase.READY, "applied": applied}
    status = AdminStatus.model_validate(body)
    applied = status.applied
    return HookStatus(
        phase=status.phase,
        applied_enabled=applied.enabled if applied is not None else None,
        applied_draft_length=applied.num_speculative_tokens if applied is not None else None,
        restart_durations_s=status.durations_s,
        last_error=status.last_error,
        restart_count=status.restart_count if "restart_count" in body else None,
    )


def launcher_hook(base_url: str, token: str | None, **kw: Any) -> HttpHook:
    """The hook for ``sd-controller launch``: its admin API under ``base_url``."""
    base = base_url.rstrip("/")
    return HttpHook(f"{base}/admin/speculative", f"{base}/admin/status", token, **kw)


def _brief(resp: requests.Response) -> str:
    try:
        body = resp.json()
        if isinstance(body, dict) and "error" in body:
            return str(body["error"])[:200]
    except ValueError:
        pass
    return resp.text[:200].replace("\n", " ")
