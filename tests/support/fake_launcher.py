"""A launcher-compatible admin API on 127.0.0.1 that "restarts" a FakeVllmServer.

Speaks the real launcher's contract (GET /admin/status, POST /admin/speculative, bearer token,
202/200/400/401/409) so the daemon's ``launcher`` hook runs unchanged against it. A restart
takes ``restart_s`` real seconds, then resets the fake vLLM's counters with or without SD.
Fault modes: ``"http500"`` (every admin call answers 500) and ``"hang"`` (calls block).
"""

from __future__ import annotations

import hmac
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.support.fake_vllm import FakeVllmServer


class FakeLauncherServer:
    def __init__(self, vllm: FakeVllmServer, token: str, restart_s: float = 1.0, enabled: bool = True) -> None:
        self.vllm = vllm
        self.token = token
        self.restart_s = restart_s
        self.applied = {"enabled": enabled, "num_speculative_tokens": 4 if enabled else None}
        self.phase = "ready"
        self.mode = "ok"
        self.requests: list[dict] = []
        self.restart_count = 0
        self.durations: list[float] = []
        self._lock = threading.Lock()
        self._unhang = threading.Event()
        handler = _handler(self)
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeLauncherServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._unhang.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    def set_mode(self, mode: str) -> None:
        self.mode = mode
        if mode == "hang":
            self._unhang.clear()
        else:
            self._unhang.set()

    def status(self) -> dict:
        with self._lock:
            return {
                "phase": self.phase,
                "applied": dict(self.applied),
                "desired": dict(self.applied),
                "restart_count": self.restart_count,
                "last_restart_duration_s": self.durations[-1] if self.durations else None,
                "restart_durations_s": list(self.durations),
                "child_pid": None,
                "last_error": None,
                "vllm_url": self.vllm.url,
            }

    def _restart(self, enabled: bool, tokens: int | None) -> None:
        t0 = time.monotonic()
        time.sleep(self.restart_s)
        self.vllm.restart(sd_enabled=enabled)
        with self._lock:
            self.applied = {"enabled": enabled, "num_speculative_tokens": tokens if enabled else None}
            self.phase = "ready"
            self.restart_count += 1
            self.durations.append(time.monotonic() - t0)

    def post(self, body: dict) -> tuple[int, dict]:
        with self._lock:
            if self.phase == "restarting":
                return 409, {"error": "restart in progress", "phase": self.phase}
            enabled = body.get("enabled")
            if not isinstance(enabled, bool):
                return 400, {"error": "enabled must be a boolean"}
            self.requests.append(body)
            if enabled == self.applied["enabled"]:
                return 200, {"changed": False}
            self.phase = "restarting"
        tokens = body.get("num_speculative_tokens") or 4
        threading.Thread(target=self._restart, args=(enabled, tokens), daemon=True).start()
        return 202, {"changed": True}


def _handler(srv: FakeLauncherServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def _reply(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _gate(self) -> bool:
            if srv.mode == "hang":
                srv._unhang.wait(30)
            if srv.mode == "http500":
                self._reply(500, {"error": "injected"})
                return False
            got = self.headers.get("Authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {srv.token}".encode()):
                self._reply(401, {"error": "unauthorized"})
                return False
            return True

        def do_GET(self) -> None:
            if self.path == "/healthz":
                return self._reply(200, {"ok": True})
            if self._gate():
                self._reply(200, srv.status())

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            raw = self.rfile.read(length)
            if not self._gate():
                return
            try:
                body = json.loads(raw)
            except ValueError:
                return self._reply(400, {"error": "body is not JSON"})
            self._reply(*srv.post(body))

    return Handler
