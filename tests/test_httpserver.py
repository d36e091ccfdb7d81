"""The shared HTTP server holds up against idle, dripping and parallel clients (127.0.0.1)."""

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests
from prometheus_client import CollectorRegistry

from controller.exporter import MetricsServer
from controller.settings import Settings
from tests.support.waiting import wait_until


class QuickServer(MetricsServer):
    idle_timeout_s = 0.5
    max_connection_s = 1.5
    max_workers = 4


def start(cls=QuickServer):
    return cls(CollectorRegistry(), "127.0.0.1", 0, lambda: (True, "ok")).start()


def closed_by_peer(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        return sock.recv(1) == b""
    except (TimeoutError, ConnectionResetError):
        return False


def test_idle_connection_is_closed():
    server = start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as idle:
            assert closed_by_peer(idle, 3.0)
    finally:
        server.stop()


def test_dripping_client_is_cut_at_the_connection_deadline():
    server = start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as drip:
            t0 = time.monotonic()
            request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * 100
            cut = False
            for byte in request:  # a byte every 0.1 s: never idle for 0.5 s, but never done
                try:
                    drip.sendall(bytes([byte]))
                except OSError:
                    cut = True
                    break
                if time.monotonic() - t0 > 5:
                    break
                time.sleep(0.1)
            assert cut or closed_by_peer(drip, 1.0)
            assert time.monotonic() - t0 < 4
    finally:
        server.stop()


def test_idle_flood_is_bounded_and_the_server_still_answers():
    server = start()
    threads_before = threading.active_count()
    socks = []
    try:
        for _ in range(100):  # within the backlog: more would wait in SYN retries, not here
            socks.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        time.sleep(0.3)
        # At most max_workers handler threads (and their deadline timers), not one per connection.
        assert threading.active_count() - threads_before <= 2 * QuickServer.max_workers + 2
        for s in socks[10:]:  # most of the flood gives up; the rest stays idle until timed out
            s.close()
        r = wait_until(lambda: _get(server.url + "/healthz"), timeout_s=20, what="an answer after a flood", poll_s=0.2)
        assert r.status_code == 200
    finally:
        for s in socks:
            s.close()
        server.stop()


def _get(url: str):
    try:
        return requests.get(url, timeout=2)
    except requests.RequestException:
        return None


def test_parallel_requests_are_all_answered():
    server = start(MetricsServer)
    try:
        with ThreadPoolExecutor(max_workers=100) as pool:
            codes = list(pool.map(lambda _: requests.get(server.url + "/metrics", timeout=20).status_code, range(100)))
        assert codes == [200] * 100
        assert server.request_queue_size >= 128
    finally:
        server.stop()


def test_exporter_listens_on_loopback_unless_configured():
    assert Settings.model_fields["exporter_host"].default == "127.0.0.1"
