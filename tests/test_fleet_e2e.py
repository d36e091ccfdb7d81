"""Fleet mode end to end, all real: an etcd, three simulated vLLM replicas behind a
least-outstanding-requests router (one ``sd-controller simulate --replicas 3`` process: each
replica its own vLLM /metrics and launcher admin API) and three ``sd-controller run``
processes, one per replica, on 127.0.0.1.

The controllers are pushed to switch at the same moment (the operator's override file flipped
for all three at once). Who is restarting is observed from the replicas' own admin status,
polled every 0.1 s, never from the controllers. Checked: never more than max_unavailable (1)
replicas restarting at once; with etcd stopped no replica restarts; SIGKILL of the
controller holding the slot frees the slot within its TTL and the fleet completes the switch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from tests.support.prometheus import _die_with_parent_prefix, free_port

pytestmark = [pytest.mark.slow]

N = 3
# The slot must outlive a restart: a holder killed as its replica starts restarting frees the
# slot after TTL_S, and its replica must be back by then (drain + RESTART_S, a few seconds).
TTL_S = 10
RESTART_S = 2.0
ROOT = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SD_CONTROLLER_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args} exited {proc.returncode}: {log.read_text()[-1500:]}")
        try:
            if requests.get(url, timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not up after {timeout_s}s: {log.read_text()[-1500:]}")


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive TCP ports on 127.0.0.1 that were free a moment ago."""
    import socket

    for _ in range(50):
        base = free_port()
        try:
            for p in range(base, base + n):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise AssertionError(f"no {n} consecutive free ports")


class Replica:
    """One simulated vLLM + admin API (replica ``i`` of the fleet's simulator), and the
    controller process beside it."""

    def __init__(self, i: int, tmp: Path, etcd_url: str, port: int, admin_port: int) -> None:
        self.i, self.name = i, f"replica-{i}"
        self.dir = tmp / self.name
        self.dir.mkdir()
        self.port, self.admin_port, self.exporter_port = port, admin_port, free_port()
        self.override = self.dir / "override"
        self.etcd_url = etcd_url
        self.ctl: subprocess.Popen | None = None

    def start_controller(self) -> None:
        log = self.dir / "controller.log"
        env = _env(
            SD_CONTROLLER_CALIBRATION_FILE="example",
            SD_CONTROLLER_VLLM_METRICS_URL=f"http://127.0.0.1:{self.port}/metrics",
            SD_CONTROLLER_VLLM_MODEL_NAME="sim",
            SD_CONTROLLER_HOOK_TYPE="launcher",
            SD_CONTROLLER_HOOK_URL=f"http://127.0.0.1:{self.admin_port}",
            SD_CONTROLLER_HOOK_TIMEOUT_S="2",
            SD_CONTROLLER_HOOK_RETRIES="1",
            SD_CONTROLLER_EVALUATION_INTERVAL_S="1",
            SD_CONTROLLER_PENDING_TIMEOUT_S="60",
            SD_CONTROLLER_RATE_WINDOW_S="4",
            SD_CONTROLLER_OVERRIDE_FILE=str(self.override),
            SD_CONTROLLER_STATE_FILE=str(self.dir / "state.json"),
            SD_CONTROLLER_EXPORTER_HOST="127.0.0.1",
            SD_CONTROLLER_EXPORTER_PORT=str(self.exporter_port),
            SD_CONTROLLER_LOG_FORMAT="json",
            SD_CONTROLLER_COORDINATION_BACKEND="etcd",
            SD_CONTROLLER_COORDINATION_ENDPOINTS=json.dumps([self.etcd_url]),
            SD_CONTROLLER_COORDINATION_PREFIX="/fleet-e2e",
            SD_CONTROLLER_COORDINATION_TIMEOUT_S="1",
            SD_CONTROLLER_MAX_UNAVAILABLE="1",
            SD_CONTROLLER_RESTART_SLOT_TTL_S=str(TTL_S),
            SD_CONTROLLER_RESTART_DOWNTIME_S=str(RESTART_S),
            SD_CONTROLLER_REPLICA_ID=self.name,
        )
        with log.open("a") as out:
            self.ctl = subprocess.Popen(
                [*_die_with_parent_prefix(), sys.executable, "-m", "controller.cli", "run"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        _wait_http(f"http://127.0.0.1:{self.exporter_port}/healthz", self.ctl, log)

    def status(self) -> dict | None:
        try:
            return requests.get(f"http://127.0.0.1:{self.admin_port}/admin/status", timeout=1).json()
        except (requests.RequestException, ValueError):
            return None

    def metric(self, name: str, **labels: str) -> float | None:
        from prometheus_client.parser import text_string_to_metric_families

        text = requests.get(f"http://127.0.0.1:{self.exporter_port}/metrics", timeout=2).text
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return None

    def stop(self) -> None:
        p = self.ctl
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


class FleetSim:
    """One ``sd-controller simulate --replicas N`` process: N replicas behind a router, replica
    i on ports base + i."""

    def __init__(self, tmp: Path) -> None:
        self.port, self.admin_port = free_ports(N), free_ports(N)
        self.log = tmp / "fleet-sim.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [*_die_with_parent_prefix(), sys.executable, "-m", "controller.cli", "simulate", "--scenario", "quick", "--speed", "1",
                 "--replicas", str(N), "--router", "lor",
                 "--port", str(self.port), "--admin-port", str(self.admin_port), "--insecure-no-token",
                 "--restart-s", str(RESTART_S), "--duration-s", "400"],
                env=_env(), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
            )  # fmt: skip
        for i in range(N):
            _wait_http(f"http://127.0.0.1:{self.admin_port + i}/admin/status", self.proc, self.log)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class Observer:
    """Polls every replica's admin status; records how many restart at once, and when."""

    def __init__(self, replicas: list[Replica], max_s: float = 400) -> None:
        self.replicas, self.max_s = replicas, max_s
        self.max_restarting = 0
        self.samples = 0
        self.restarting_since: dict[str, float] = {}
        self.starts: list[tuple[float, str]] = []  # (monotonic time, replica) a restart was first seen
        self.status: dict[str, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        end = time.monotonic() + self.max_s
        while not self._stop.is_set() and time.monotonic() < end:
            now = time.monotonic()
            restarting = 0
            for r in self.replicas:
                st = r.status()
                if st is None:
                    continue
                self.status[r.name] = st
                if st["phase"] != "ready":
                    restarting += 1
                    if r.name not in self.restarting_since:
                        self.restarting_since[r.name] = now
                        self.starts.append((now, r.name))
                else:
                    self.restarting_since.pop(r.name, None)
            self.max_restarting = max(self.max_restarting, restarting)
            self.samples += 1
            self._stop.wait(0.1)

    def applied(self) -> dict[str, bool | None]:
        return {n: (st.get("applied") or {}).get("enabled") for n, st in self.status.items()}

    def restart_counts(self) -> dict[str, int]:
        return {n: st["restart_count"] for n, st in self.status.items()}

    def wait_all(self, enabled: bool, timeout_s: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            a = self.applied()
            if len(a) == N and all(v is enabled for v in a.values()) and not self.restarting_since:
                return time.monotonic() - t0
            time.sleep(0.2)
        raise AssertionError(f"fleet did not reach enabled={enabled} in {timeout_s}s: {self.status}")

    def __enter__(self) -> Observer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def flip(replicas: list[Replica], mode: str) -> None:
    for r in replicas:  # as close to "the same moment" as three file writes get
        r.override.write_text(mode)


def slot_holder(etcd_url: str) -> str | None:
    from controller.coordination.etcd import EtcdCoordinator

    holders = EtcdCoordinator([etcd_url], prefix="/fleet-e2e", ttl_s=TTL_S).holders()
    return holders[0].split("#", 1)[0] if holders else None  # <replica id>#<instance>


def test_fleet_switches_one_replica_at_a_time_through_etcd(etcd_server, tmp_path):
    sim = FleetSim(tmp_path)
    replicas = [Replica(i, tmp_path, etcd_server.url, sim.port + i, sim.admin_port + i) for i in range(N)]
    try:
        sim.start()
        for r in replicas:
            r.override.write_text("auto")
            r.start_controller()
        with Observer(replicas) as obs:
            time.sleep(3)
            assert obs.applied() == {r.name: True for r in replicas}  # the scenario starts with SD on
            base = obs.restart_counts()

            # 1. All three told to switch SD off at the same moment: one at a time.
            flip(replicas, "off")
            took = obs.wait_all(False, timeout_s=90)
            assert obs.restart_counts() == {n: c + 1 for n, c in base.items()}
            assert obs.max_restarting == 1
            starts = [t for t, _ in obs.starts]
            print(
                f"\nphase 1: 3 replicas off in {took:.1f}s, restarts began at +{[round(t - starts[0], 1) for t in starts]}s"
            )

            deadline = time.monotonic() + 10
            while slot_holder(etcd_server.url) is not None:  # the last controller confirms a tick later
                assert time.monotonic() < deadline, "the last slot was never released"
                time.sleep(0.2)

            # 2. etcd stopped, all three told to switch back on: nobody restarts.
            etcd_server.stop()
            counts = obs.restart_counts()
            flip(replicas, "on")
            time.sleep(8)
            assert obs.restart_counts() == counts and not obs.restarting_since
            assert obs.applied() == {r.name: False for r in replicas}
            held = [
                r.metric("sd_controller_restart_slot_waits_total", reason="coordination_unavailable") for r in replicas
            ]
            assert all(h and h >= 3 for h in held), held
            print(f"phase 2: etcd down 8 s, 0 restarts; coordination_unavailable holds per controller {held}")

            # 3. etcd back: the first replica to restart has the slot; SIGKILL its controller.
            etcd_server.start()
            n_starts = len(obs.starts)
            deadline = time.monotonic() + 30
            while len(obs.starts) == n_starts:
                assert time.monotonic() < deadline, "no restart after etcd came back"
                time.sleep(0.05)
            first = obs.starts[-1][1]
            assert slot_holder(etcd_server.url) == first
            victim = next(r for r in replicas if r.name == first)
            victim.ctl.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            victim.ctl.wait(5)
            while len(obs.starts) == n_starts + 1:
                assert time.monotonic() - killed_at < TTL_S + 20, "the killed holder's slot was never freed"
                time.sleep(0.05)
            next_start = obs.starts[-1][0] - killed_at
            # Its lease runs out within TTL_S of its last renewal (≤ TTL_S after the kill); the
            # next controller takes the slot on its next tick (1 s) and calls the launcher.
            assert next_start <= TTL_S + 3, next_start
            obs.wait_all(True, timeout_s=90)  # the victim's replica finished its own restart too
            durations = {n: st["restart_durations_s"] for n, st in obs.status.items()}
            assert max(d for ds in durations.values() for d in ds) < TTL_S, durations  # the premise
            assert obs.max_restarting == 1
            print(
                f"phase 3: SIGKILL of the slot holder -> next restart began {next_start:.1f}s later"
                f" (TTL {TTL_S}s); max restarting at once over the run {obs.max_restarting},"
                f" {obs.samples} status samples; restart durations {durations}"
            )
    finally:
        for r in replicas:
            r.stop()
        sim.stop()
