"""The launcher's admin HTTP API (stdlib ThreadingHTTPServer).

    GET  /healthz            200 while the launcher runs (no auth: for liveness probes)
    GET  /admin/status       the supervisor snapshot
    POST /admin/speculative  {"enabled": bool, "num_speculative_tokens": int?, ...}

Every /admin call needs ``Authorization: Bearer <token>`` (constant-time compare). The
token is never logged, echoed or put in an error. A switch's body must come as
``Content-Type: application/json``: a web page can send a form or ``text/plain`` to another
origin without asking, never JSON, so a launcher run with ``--insecure-no-token`` cannot be
switched by a page its host's browser opens.
"""

from __future__ import annotations

import hmac
import json
import re
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any

import structlog

from controller.errors import InputError
from controller.httpserver import BackgroundHTTPServer
from controller.launcher.state import parse_request
from controller.launcher.supervisor import Busy, Supervisor

log = structlog.get_logger("controller.launcher.admin")

MAX_BODY_BYTES = 64 * 1024


_QUERY = re.compile(r"\?[^\s\"']*")


def without_query(text: str) -> str:
    """``text`` with every URL query string (``?...`` up to a space or quote) replaced."""
    return _QUERY.sub("?<query>", text)


def token_matches(expected: str | None, authorization: str | None) -> bool:
    """True when no token is configured, or the header is ``Bearer <expected>``."""
    if expected is None:
        return True
    if not authorization:
        return False
    scheme, _, presented = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(presented.strip().encode("utf-8"), expected.encode("utf-8"))


class AdminServer(BackgroundHTTPServer):
    thread_name = "admin-http"

    def __init__(self, address: tuple[str, int], supervisor: Supervisor, token: str | None) -> None:
        super().__init__(address, _Handler)
        self.supervisor = supervisor
        self.token = token


class _Handler(BaseHTTPRequestHandler):
    server: AdminServer
    server_version = "sd-launcher"
    sys_version = ""
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/healthz":
            self._send(HTTPStatus.OK, {"ok": True})
        elif not self._authorized():
            return
        elif path == "/admin/status":
            self._send(HTTPStatus.OK, self.server.supervisor.snapshot())
        elif path == "/admin/speculative":
            self._send(HTTPStatus.METHOD_NOT_ALLOWED, {"error": "use POST"})
        else:
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no such endpoint: {path}"})

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        body = self._read_body()
        if body is None:
            return
        if not path.startswith("/admin/"):
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no such endpoint: {path}"})
        elif not self._authorized():
            return
        elif path == "/admin/speculative":
            if self._json_body():
                self._switch(body)
        elif path == "/admin/status":
            self._send(HTTPStatus.METHOD_NOT_ALLOWED, {"error": "use GET"})
        else:
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no such endpoint: {path}"})

    def _other_method(self) -> None:
        # Not the stdlib's 501 HTML page: a JSON answer a client can read, with what is allowed.
        if self._read_body() is None:  # drained, so the connection can carry the next request
            return
        if self.command == "HEAD":  # headers only: a body would be read as the next response
            self.send_response(HTTPStatus.METHOD_NOT_ALLOWED)
            self.send_header("Allow", "GET, POST")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        error = {"error": f"{self.command} is not served: use GET or POST"}
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, error, {"Allow": "GET, POST"})

    do_HEAD = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _other_method

    def _switch(self, body: bytes) -> None:
        supervisor = self.server.supervisor
        try:
            request = parse_request(body)
            outcome = supervisor.request_switch(request)
        except InputError as exc:
            log.info("switch_rejected", status=400, error=str(exc))
            self._send(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
            return
        except Busy as exc:
            log.info("switch_rejected", status=409, phase=exc.phase)
            self._send(HTTPStatus.CONFLICT, {"error": str(exc), "phase": exc.phase})
            return
        status = HTTPStatus.ACCEPTED if outcome.changed else HTTPStatus.OK
        if not outcome.changed:
            log.info("switch_noop", applied=outcome.snapshot["applied"], **request.log_fields())
        self._send(status, {"changed": outcome.changed, **outcome.snapshot})

    def _json_body(self) -> bool:
        media = (self.headers.get("Content-Type") or "").partition(";")[0].strip().lower()
        if media == "application/json":
            return True
        log.info("switch_rejected", status=415, content_type=media[:64] or None)
        error = {"error": "the body must be JSON, sent as Content-Type: application/json"}
        self._send(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, error)
        return False

    def _authorized(self) -> bool:
        if token_matches(self.server.token, self.headers.get("Authorization")):
            return True
        log.warning("admin_unauthorized", path=self.path.split("?", 1)[0], client=self.client_address[0])
        self._send(
            HTTPStatus.UNAUTHORIZED,
            {"error": "missing or wrong bearer token"},
            {"WWW-Authenticate": 'Bearer realm="sd-launcher"'},
        )
        return False

    def _read_body(self) -> bytes | None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0 or length > MAX_BODY_BYTES:
            self._send(HTTPStatus.BAD_REQUEST, {"error": f"Content-Length must be 0..{MAX_BODY_BYTES}"})
            self.close_connection = True
            return None
        return self.rfile.read(length) if length else b""

    def _send(self, status: HTTPStatus, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        data = (json.dumps(payload) + "\n").encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        # The request line only, without its query string (a client may put a token there);
        # headers (and so the bearer token) are never logged.
        log.debug("admin_http", client=self.client_address[0], line=without_query(format % args))
