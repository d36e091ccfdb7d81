"""A programmable HTTP peer on 127.0.0.1 for fault tests: a fixed answer, or one that drips.

``StubHttp(respond)`` calls ``respond(method, path, body) -> (status, content_type, bytes)``;
``drip_s`` > 0 sends the answer one byte at a time with that pause (a peer that stalls without
ever timing out a single read). Every loop is bounded by ``max_drip_bytes``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Respond = Callable[[str, str, bytes], tuple[int, str, bytes]]


class StubHttp:
    def __init__(self, respond: Respond, drip_s: float = 0.0, max_drip_bytes: int = 200) -> None:
        self.respond = respond
        self.drip_s = drip_s
        self.max_drip_bytes = max_drip_bytes
        self.requests: list[tuple[str, str]] = []
        self._stop = threading.Event()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                stub.requests.append((self.command, self.path))
                status, ctype, data = stub.respond(self.command, self.path, body)
                raw = (
                    f"HTTP/1.1 {status} X\r\nContent-Type: {ctype}\r\nContent-Length: {len(data)}\r\n\r\n"
                ).encode() + data
                if stub.drip_s <= 0:
                    self.wfile.write(raw)
                    return
                for byte in raw[: stub.max_drip_bytes]:
                    if stub._stop.wait(stub.drip_s):
                        return
                    try:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                    except OSError:
                        return
                self.close_connection = True

            do_GET = do_POST = _any

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> StubHttp:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def json_answer(payload: bytes | str, status: int = 200) -> Respond:
    data = payload.encode() if isinstance(payload, str) else payload
    return lambda method, path, body: (status, "application/json", data)


def elapsed(fn: Callable[[], object]) -> tuple[object, float]:
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0
