"""A real etcd server for tests, started from the system binary (Debian's ``etcd-server``).

Usage::

    with EtcdServer(tmp_path) as etcd:
        EtcdCoordinator([etcd.url], ...)

One member on 127.0.0.1 with random client and peer ports and its data under ``workdir``;
``stop`` and ``start`` again keep the data (a restart of the same member). Like the test
Prometheus it runs in its own session, is SIGKILLed by the kernel if the test process dies
(setpriv --pdeathsig), and an ``atexit`` hook stops it on a normal exit.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import time
import weakref
from pathlib import Path

import requests

from tests.support.prometheus import _die_with_parent_prefix, free_port

ENV_BIN = "SD_ETCD_BIN"


class EtcdError(RuntimeError):
    """etcd failed to start or a wait timed out."""


def etcd_binary() -> str | None:
    """Path of the etcd binary: ``$SD_ETCD_BIN`` if set, else ``etcd`` on PATH."""
    env = os.environ.get(ENV_BIN)
    if env:
        return env if os.access(env, os.X_OK) else None
    return shutil.which("etcd")


_LIVE: weakref.WeakSet[EtcdServer] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop()


class EtcdServer:
    """One etcd member serving clients at :attr:`url` (http://127.0.0.1:<random port>)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.port = free_port()
        self.peer_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data_dir = self.workdir / "data"
        self.log_path = self.workdir / "etcd.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 30) -> EtcdServer:
        """Start (or start again, on the same ports and data) and wait until /health is ok."""
        binary = etcd_binary()
        if binary is None:
            raise EtcdError(f"no etcd binary (PATH or ${ENV_BIN})")
        if self.running:
            return self
        self.workdir.mkdir(parents=True, exist_ok=True)
        peer = f"http://127.0.0.1:{self.peer_port}"
        log = self.log_path.open("ab")
        try:
            self._proc = subprocess.Popen(
                [
                    *_die_with_parent_prefix(),
                    binary,
                    "--name=test",
                    f"--data-dir={self.data_dir}",
                    f"--listen-client-urls={self.url}",
                    f"--advertise-client-urls={self.url}",
                    f"--listen-peer-urls={peer}",
                    f"--initial-advertise-peer-urls={peer}",
                    f"--initial-cluster=test={peer}",
                    "--log-level=warn",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()
        _LIVE.add(self)
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc.poll() is not None:
                raise EtcdError(f"etcd exited with {self._proc.returncode} on {self.url}: {self.log_tail()}")
            with contextlib.suppress(requests.RequestException, ValueError):
                r = requests.get(f"{self.url}/health", timeout=1)
                if r.status_code == 200 and r.json().get("health") in ("true", True):
                    return self
            if time.monotonic() > deadline:
                self.stop()
                raise EtcdError(f"etcd at {self.url} not healthy after {timeout_s}s: {self.log_tail()}")
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s. Idempotent; the data directory stays."""
        proc, self._proc = self._proc, None
        _LIVE.discard(self)
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def log_tail(self, chars: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
