"""HTTP calls with a whole-request deadline, not only a per-read timeout.

``requests``' timeout bounds each socket read, so a peer that drips one byte every few
seconds holds a call (and the tick loop, and its SIGTERM) forever. :func:`request` arms a
timer that shuts the call's socket down when the deadline passes, which ends any read at
once; the call then raises :class:`DeadlineExceeded` (a ``requests.Timeout``, so callers
that already handle timeouts need nothing new). Only sessions from :func:`session` (or
passed through it; :func:`request` mounts it on a plain one) know which socket is the call's.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

_local = threading.local()


class DeadlineExceeded(requests.Timeout):
    """No complete response within the whole-request deadline."""


class _Watched:
    def _get_conn(self, timeout: float | None = None) -> Any:
        conn = super()._get_conn(timeout)  # type: ignore[misc]
        watched = getattr(_local, "watched", None)
        if watched is not None:
            watched.append(conn)
        return conn


class _HTTPPool(_Watched, HTTPConnectionPool):
    pass


class _HTTPSPool(_Watched, HTTPSConnectionPool):
    pass


class _DeadlineAdapter(HTTPAdapter):
    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {"http": _HTTPPool, "https": _HTTPSPool}


def session(base: requests.Session | None = None) -> requests.Session:
    """A session (``base`` or a new one) whose connections :func:`request` can cut."""
    s = base or requests.Session()
    if isinstance(s, requests.Session):
        adapter = _DeadlineAdapter()
        s.mount("http://", adapter)
        s.mount("https://", adapter)
    return s


def _cut(conns: list[Any]) -> None:
    for conn in list(conns):
        sock = getattr(conn, "sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):  # already closed: nothing to cut
                sock.shutdown(socket.SHUT_RDWR)


def request(http: requests.Session, method: str, url: str, deadline_s: float, **kwargs: Any) -> requests.Response:
    """``http.request(...)`` that returns or raises within ``deadline_s`` (plus scheduling).

    The per-read ``timeout`` defaults to the deadline. The body is read before returning
    (``stream`` is not supported: the deadline must cover it).
    """
    if isinstance(http, requests.Session) and not isinstance(http.get_adapter(url), _DeadlineAdapter):
        session(http)  # a plain session: teach it, or the deadline could not cut anything
    kwargs.setdefault("timeout", deadline_s)
    kwargs.pop("stream", None)
    watched: list[Any] = []
    fired, done = threading.Event(), threading.Event()

    def expire() -> None:
        fired.set()
        # Keep cutting until the call returns: a connection may be opened after the first cut.
        while True:
            _cut(watched)
            if done.wait(0.05):
                return

    _local.watched = watched
    timer = threading.Timer(max(deadline_s, 0.0), expire)
    timer.daemon = True
    timer.start()
    try:
        resp = http.request(method, url, **kwargs)
    except requests.RequestException:
        if fired.is_set():
            raise DeadlineExceeded(f"no complete response within {deadline_s:g}s") from None
        raise
    finally:
        done.set()
        timer.cancel()
        _local.watched = None
    if fired.is_set():
        raise DeadlineExceeded(f"no complete response within {deadline_s:g}s")
    return resp
