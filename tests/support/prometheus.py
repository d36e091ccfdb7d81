"""A real Prometheus server for tests, started from the system binary.

Usage::

    with PrometheusServer(tmp_path, {"vllm": [fake.target]}) as prom:
        prom.wait_for('rate(vllm:request_success_total[5s]) > 0')

The process is started in its own session, with the kernel asked to SIGKILL it if the
test process dies (Linux), and an ``atexit`` hook stops it on a normal exit, so no stray
Prometheus survives a crashed test run.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import requests
import yaml

ENV_BIN = "SD_PROMETHEUS_BIN"


class PrometheusError(RuntimeError):
    """Prometheus failed to start, answered with an error, or a wait timed out."""


def prometheus_binary() -> str | None:
    """Path of the Prometheus binary: ``$SD_PROMETHEUS_BIN`` if set, else ``prometheus`` on PATH."""
    env = os.environ.get(ENV_BIN)
    if env:
        return env if os.access(env, os.X_OK) else None
    return shutil.which("prometheus")


def promtool_binary() -> str | None:
    """Path of ``promtool``: next to the Prometheus binary, else on PATH."""
    prom = prometheus_binary()
    if prom:
        sibling = Path(prom).with_name("promtool")
        if os.access(sibling, os.X_OK):
            return str(sibling)
    return shutil.which("promtool")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def duration(seconds: float) -> str:
    """A Prometheus duration string (milliseconds resolution) for ``seconds``."""
    ms = max(1, round(seconds * 1000))
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def _die_with_parent_prefix() -> list[str]:
    """A command prefix that has the kernel SIGKILL the child if this process dies.

    util-linux ``setpriv --pdeathsig`` does it without a ``preexec_fn`` (which is unsafe
    once threads run, and fake servers run threads). Absent setpriv, ``atexit`` remains.
    Caveat of PDEATHSIG: it fires when the *thread* that started the child exits, so start
    servers from the main thread (pytest fixtures do).
    """
    setpriv = shutil.which("setpriv") if sys.platform.startswith("linux") else None
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []


_LIVE: weakref.WeakSet[PrometheusServer] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop()


class PrometheusServer:
    """One Prometheus process scraping ``targets``, with its data under ``workdir``.

    ``targets`` maps a job name to ``host:port`` strings scraped at ``/metrics``. Rules are
    evaluated as often as targets are scraped, so recording rules follow the data closely.
    """

    def __init__(
        self,
        workdir: Path,
        targets: Mapping[str, Sequence[str]],
        scrape_interval_s: float = 1.0,
        rule_files: Sequence[Path] = (),
        port: int | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.targets = {job: list(t) for job, t in targets.items()}
        self.scrape_interval_s = scrape_interval_s
        self.rule_files = [Path(p).resolve() for p in rule_files]
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_path = self.workdir / "prometheus.yml"
        self.data_dir = self.workdir / "data"
        self.log_path = self.workdir / "prometheus.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._session = requests.Session()

    # -- lifecycle -------------------------------------------------------------------------

    def config(self) -> dict[str, Any]:
        """The prometheus.yml content this server runs with."""
        interval = duration(self.scrape_interval_s)
        return {
            "global": {
                "scrape_interval": interval,
                "scrape_timeout": interval,
                "evaluation_interval": interval,
            },
            "rule_files": [str(p) for p in self.rule_files],
            "scrape_configs": [
                {
                    "job_name": job,
                    "metrics_path": "/metrics",
                    "static_configs": [{"targets": targets}],
                }
                for job, targets in self.targets.items()
            ],
        }

    def start(self, timeout_s: float = 30) -> None:
        """Write the config, start Prometheus and wait until ``/-/ready`` answers 200."""
        binary = prometheus_binary()
        if binary is None:
            raise PrometheusError(f"no prometheus binary (PATH or ${ENV_BIN})")
        if self.running:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.data_dir.mkdir(exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        log = self.log_path.open("ab")
        try:
            self._proc = subprocess.Popen(
                [
                    *_die_with_parent_prefix(),
                    binary,
                    f"--config.file={self.config_path}",
                    f"--storage.tsdb.path={self.data_dir}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--web.enable-lifecycle",
                    "--log.level=warn",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C in the terminal is for pytest, not for it
            )
        finally:
            log.close()
        _LIVE.add(self)
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc.poll() is not None:
                raise PrometheusError(
                    f"prometheus exited with {self._proc.returncode} on {self.url}: {self.log_tail()}"
                )
            with contextlib.suppress(requests.RequestException):
                if self._session.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return
            if time.monotonic() > deadline:
                self.stop()
                raise PrometheusError(f"prometheus at {self.url} not ready after {timeout_s}s: {self.log_tail()}")
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL after 10 s). Idempotent."""
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

    def restart(self) -> None:
        """Stop and start again on the same port with the same data directory."""
        self.stop()
        self.start()

    def reload(self) -> None:
        """Rewrite the config (targets, rule files may have changed) and hot-reload it."""
        self.config_path.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        r = self._session.post(f"{self.url}/-/reload", timeout=10)
        if r.status_code != 200:
            raise PrometheusError(f"reload of {self.url} failed: {r.status_code} {r.text.strip()}")

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, n_chars: int = 2000) -> str:
        """The end of Prometheus' own log, for error messages."""
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""

    def __enter__(self) -> PrometheusServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- HTTP API --------------------------------------------------------------------------

    def _api(self, path: str, params: Mapping[str, Any]) -> Any:
        r = self._session.get(f"{self.url}/api/v1/{path}", params=params, timeout=10)
        try:
            body = r.json()
        except ValueError as e:
            raise PrometheusError(f"{path} on {self.url}: HTTP {r.status_code}, not JSON") from e
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params.get('query')!r}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, promql: str, time: float | None = None) -> list[dict]:
        """The ``result`` list of an instant query; raises PrometheusError on an error status.

        A scalar or string result is returned as a one-element list ``[{"value": [t, v]}]``.
        """
        params: dict[str, Any] = {"query": promql}
        if time is not None:
            params["time"] = time
        data = self._api("query", params)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def query_range(self, promql: str, start: float, end: float, step: float) -> list[dict]:
        """The ``result`` list of a range query; raises PrometheusError on an error status."""
        data = self._api("query_range", {"query": promql, "start": start, "end": end, "step": step})
        return data["result"]

    def targets_health(self) -> dict[str, str]:
        """``scrapeUrl -> health`` ("up", "down", "unknown") of the active targets."""
        data = self._api("targets", {"state": "active"})
        return {t["scrapeUrl"]: t["health"] for t in data["activeTargets"]}

    def rules(self) -> list[dict]:
        """The rule groups Prometheus has loaded (``/api/v1/rules``)."""
        return self._api("rules", {})["groups"]

    def wait_for(
        self,
        promql: str,
        timeout_s: float = 30,
        predicate: Callable[[list[dict]], bool] = lambda result: bool(result),
        poll_s: float = 0.25,
    ) -> list[dict]:
        """Poll ``promql`` until ``predicate(result)`` holds; the last result, or PrometheusError.

        Query errors (bad PromQL) are raised at once, not retried.
        """
        deadline = time.monotonic() + timeout_s
        result: list[dict] = []
        while True:
            result = self.query(promql)
            if predicate(result):
                return result
            if time.monotonic() > deadline:
                raise PrometheusError(
                    f"{promql!r} on {self.url}: condition not met after {timeout_s}s; last result {result!r}"
                )
            time.sleep(poll_s)


def sample_values(result: list[dict]) -> list[float]:
    """The float values of an instant-query result (vector or scalar)."""
    return [float(r["value"][1]) for r in result]
