"""The simulator over HTTP: vLLM's /metrics and /health, and the launcher's admin API.

The admin API is the launcher's own :class:`controller.launcher.admin.AdminServer` (same
routes, auth, status codes and body parser) in front of :class:`SimSupervisor`, which applies
switches to the simulated engine instead of restarting a process. A background thread keeps
the engine's clock in step with the wall clock.
"""

from __future__ import annotations

import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any

from controller.admin_api import HookPhase
from controller.hooks.base import HookError
from controller.httpserver import BackgroundHTTPServer
from controller.launcher.admin import AdminServer
from controller.launcher.state import SwitchRequest
from controller.launcher.supervisor import Busy, SwitchOutcome
from controller.sim.engine import Engine


class SimSupervisor:
    """What AdminServer needs from a supervisor (``snapshot``, ``request_switch``), backed by
    a simulated engine. All engine access goes through one lock shared with the clock."""

    def __init__(self, engine: Engine, lock: threading.Lock, vllm_url: str) -> None:
        self.engine = engine
        self.lock = lock
        self.vllm_url = vllm_url

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return self.engine.admin_status(self.vllm_url)

    def request_switch(self, request: SwitchRequest) -> SwitchOutcome:
        with self.lock:
            try:
                changed = self.engine.request_restart(request.enabled, request.num_speculative_tokens)
            except HookError:
                raise Busy(HookPhase.RESTARTING) from None
            return SwitchOutcome(changed, self.engine.admin_status(self.vllm_url))


class SimClock:
    """Advances the engine to the wall clock's elapsed time, tick by tick, in a thread."""

    def __init__(self, engine: Engine, lock: threading.Lock, poll_s: float = 0.05) -> None:
        self.engine = engine
        self.lock = lock
        self.poll_s = poll_s
        self.started_at = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sim-clock", daemon=True)

    def start(self) -> None:
        self.started_at = time.monotonic() - self.engine.t
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            target = time.monotonic() - self.started_at
            with self.lock:
                # Bounded catch-up per iteration keeps scrapes responsive after a stall.
                self.engine.advance_to(min(target, self.engine.t + 60.0))
            self._stop.wait(self.poll_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class MetricsServer(BackgroundHTTPServer):
    """GET /metrics (vLLM exposition; 503 while restarting) and GET /health."""

    thread_name = "sim-metrics"

    def __init__(self, address: tuple[str, int], engine: Engine, lock: threading.Lock) -> None:
        super().__init__(address, _MetricsHandler)
        self.engine = engine
        self.lock = lock


class _MetricsHandler(BaseHTTPRequestHandler):
    server: MetricsServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        with self.server.lock:
            serving = self.server.engine.serving
            body = self.server.engine.render_metrics() if serving and path == "/metrics" else ""
        if path == "/metrics":
            if serving:
                self._send(HTTPStatus.OK, body, "text/plain; version=0.0.4; charset=utf-8")
            else:
                self._send(HTTPStatus.SERVICE_UNAVAILABLE, "vLLM is restarting\n")
        elif path == "/health":
            self._send(HTTPStatus.OK if serving else HTTPStatus.SERVICE_UNAVAILABLE, "")
        else:
            self._send(HTTPStatus.NOT_FOUND, "not found\n")

    def _send(self, status: HTTPStatus, text: str, ctype: str = "text/plain; charset=utf-8") -> None:
        data = text.encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # quiet: scrapes every second
        return


class SimulatedServer:
    """Engine + clock thread + /metrics server + admin API. Use as a context manager."""

    def __init__(
        self,
        engine: Engine,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        admin_port: int = 0,
        token: str | None = None,
        run_clock: bool = True,
    ) -> None:
        self.engine = engine
        self.lock = threading.Lock()
        self.metrics = MetricsServer((host, port), engine, self.lock)
        self.supervisor = SimSupervisor(engine, self.lock, self.metrics.url)
        self.admin = AdminServer((host, admin_port), self.supervisor, token)  # type: ignore[arg-type]
        self.clock = SimClock(engine, self.lock) if run_clock else None

    @property
    def metrics_url(self) -> str:
        return self.metrics.url + "/metrics"

    @property
    def admin_url(self) -> str:
        return self.admin.url

    def start(self) -> SimulatedServer:
        self.metrics.start()
        self.admin.start()
        if self.clock is not None:
            self.clock.start()
        return self

    def stop(self) -> None:
        if self.clock is not None:
            self.clock.stop()
        self.admin.stop()
        self.metrics.stop()

    def __enter__(self) -> SimulatedServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class SimulatedFleet:
    """A :class:`~controller.sim.fleet.Fleet` over HTTP: each replica its own /metrics server and
    admin API (``ports[i]``, ``admin_ports[i]``; 0 picks a free one), one clock and one lock
    for the whole fleet, the router inside. Use as a context manager."""

    def __init__(
        self,
        fleet,
        *,
        host: str = "127.0.0.1",
        ports: list[int] | None = None,
        admin_ports: list[int] | None = None,
        token: str | None = None,
        run_clock: bool = True,
    ) -> None:
        n = len(fleet.engines)
        ports, admin_ports = ports or [0] * n, admin_ports or [0] * n
        if len(ports) != n or len(admin_ports) != n:
            raise ValueError(f"{n} replicas need {n} ports and {n} admin ports")
        self.fleet = fleet
        self.lock = threading.Lock()
        self.metrics = [MetricsServer((host, p), e, self.lock) for p, e in zip(ports, fleet.engines, strict=True)]
        self.admins = [
            AdminServer((host, a), SimSupervisor(e, self.lock, m.url), token)  # type: ignore[arg-type]
            for a, e, m in zip(admin_ports, fleet.engines, self.metrics, strict=True)
        ]
        self.clock = SimClock(fleet, self.lock) if run_clock else None  # type: ignore[arg-type]

    @property
    def metrics_urls(self) -> list[str]:
        return [m.url + "/metrics" for m in self.metrics]

    @property
    def admin_urls(self) -> list[str]:
        return [a.url for a in self.admins]

    def start(self) -> SimulatedFleet:
        for server in (*self.metrics, *self.admins):
            server.start()
        if self.clock is not None:
            self.clock.start()
        return self

    def stop(self) -> None:
        if self.clock is not None:
            self.clock.stop()
        for server in (*self.admins, *self.metrics):
            server.stop()

    def __enter__(self) -> SimulatedFleet:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
