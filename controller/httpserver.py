"""A threading HTTP server that runs in a daemon thread: the exporter, the launcher's admin
API and the simulator all serve this way.

Hardened against peers that hold connections: every accepted socket gets an idle timeout
(``idle_timeout_s`` per read or write) and a whole-connection deadline (``max_connection_s``,
after which its socket is shut down, so a client dripping a byte a second is cut too); at most
``max_workers`` connections are served at once, the rest wait in the kernel's listen backlog
(``request_queue_size``) and use no file descriptor of ours. So a flood of idle connections
cannot exhaust the process's descriptors (which a launcher needs to start vLLM), and the
accept loop does not spin when the descriptors run out anyway.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class BackgroundHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    thread_name = "http"
    request_queue_size = 128  # listen backlog (socketserver's default is 5)
    idle_timeout_s = 10.0
    max_connection_s = 30.0
    max_workers = 16

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self._thread: threading.Thread | None = None
        self._slots = threading.BoundedSemaphore(self.max_workers)
        self._stopping = threading.Event()

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start(self):
        """Serve in a daemon thread; returns self."""
        self._thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.2}, name=self.thread_name, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # -- hardening ------------------------------------------------------------------------

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            sock, addr = super().get_request()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                time.sleep(0.1)  # out of descriptors: back off instead of spinning on accept
            raise
        sock.settimeout(self.idle_timeout_s)
        return sock, addr

    def process_request(self, request: Any, client_address: Any) -> None:
        # Wait for a free worker here, in the accept thread: meanwhile new connections stay in
        # the kernel's backlog instead of becoming threads and descriptors of ours.
        while not self._slots.acquire(timeout=0.2):
            if self._stopping.is_set():
                self.shutdown_request(request)
                return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        def cut() -> None:
            with contextlib.suppress(OSError):
                request.shutdown(socket.SHUT_RDWR)

        deadline = threading.Timer(self.max_connection_s, cut)
        deadline.daemon = True
        deadline.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            deadline.cancel()
            self._slots.release()
