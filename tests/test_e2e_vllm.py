"""The whole chain with real parts: load -> real vLLM -> real Prometheus -> controller -> launcher.

``sd-controller launch`` runs a real vLLM (CPU build, tiny random Llama, SD by n-gram lookup);
a real Prometheus scrapes vLLM (job "vllm") and the controller (job "controller") every second;
``python -m controller.cli run`` reads Prometheus and switches SD through the launcher; an
open-loop load generator sends completions in phases:

1. low load (SD predicted to pay): the controller holds SD on;
2. high load (SD predicted to lose): it disables SD, the launcher restarts vLLM without SD, the
   ``vllm:spec_decode_*`` series leave Prometheus and the controller exports the new state;
3. low load again: after the dwell it enables SD, vLLM restarts with SD, the series come back.

The calibration is **synthetic** (written into tmp_path, not a measurement): on this CPU SD
barely ever pays, so the step costs are chosen to put the break-even rate between the two load
levels, whatever acceptance the n-gram drafts reach. ``price_switches`` is off: this test is
about the mechanics (observation, decision, restart, confirmation, dwell, metrics), not about
whether a 70 s restart is worth it. Every request sent must end in a 200, or fail while a
restart is in flight; none may be lost outside a restart window.

Needs ``scripts/setup-vllm.sh`` and a ``prometheus`` binary; skipped otherwise. Takes about
6-8 minutes (three vLLM starts of ~65-90 s each on the 2-core box).
Run: ``pytest -m vllm tests/test_e2e_vllm.py -s`` (``-s`` prints the measured numbers).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import requests

from controller.acceptance import alpha_from_vllm_rate
from controller.calibration import CalibrationFile, KneeSpec, Metadata, Phases, PhaseSpec, save
from controller.model import Workload, break_even_rates, predict_point
from controller.policy import Reason
from tests.support.prometheus import free_port
from tests.support.vllm_env import MODEL, NGRAM, VLLM_PYTHON, requires_vllm
from tests.support.waiting import wait_until as _wait_until


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 1.0):
    return _wait_until(predicate, timeout_s, what, poll_s)


REPO = Path(__file__).resolve().parents[1]
TOKEN = "e2e-vllm-test-token-5678"
SD_SERIES = "vllm:spec_decode_num_drafts_total"

START_TIMEOUT_S = 420  # one vLLM start (65-90 s here, more when the cores are shared)
TEST_BUDGET_S = 690  # the whole test, vLLM starts included (< 12 minutes)
LOW_RPS = 0.15  # SD predicted to pay
HIGH_RPS = 2.0  # SD predicted to lose; this CPU vLLM serves 3 req/s with SD at ~0.16 s
PROMPT_TOKENS, GEN_TOKENS = 54, 32  # what the prompts below come to with the tiny tokenizer
LOW_HOLD_S = 30  # low load with SD on: the controller must not move
HIGH_OFF_S = 20  # high load with SD off, to compare latency at the same load
DWELL_S = 20
REQUEST_TIMEOUT_S = 30
MAX_REQUESTS = 1500

pytestmark = requires_vllm


# ------------------------------------------------------------------------------------------
# The calibration: synthetic, with the break-even between LOW_RPS and HIGH_RPS
# ------------------------------------------------------------------------------------------


def synthetic_calibration() -> CalibrationFile:
    """Step costs chosen so that SD pays at LOW_RPS and loses at HIGH_RPS for any acceptance
    the n-gram drafts plausibly reach (0.3-1.0): a cheap verify step for a lone request (8 ms
    for its 5 tokens vs a 10 ms target step, but E[N] tokens per step) whose cost climbs steeply
    once others share it (a knee at 5.2 tokens, 33 ms per token past it), so SD's capacity is
    ~0.5-1 req/s while plain decoding's is far higher. Not a measurement: see examples/calibration-cpu-tiny.json."""
    return CalibrationFile(
        schema_version=2,
        metadata=Metadata(
            gpu="synthetic (tests/test_e2e_vllm.py)",
            target_model="tiny random Llama (2 layers, hidden 256)",
            draft_model="ngram (prompt lookup)",
            vllm_version="0.32.0",
            notes="synthetic step costs that put the break-even between the test's load levels; not a measurement",
        ),
        # Schema-1 style phases (a stand-alone prefill slope and the whole SD step as one fit):
        # n-gram drafting has no draft model to prefill.
        phases=Phases(
            prefill=PhaseSpec(intercept_s=0.002, slope_s_per_token=1e-5),
            target=PhaseSpec(intercept_s=0.010, slope_s_per_token=1e-4),
            verify=PhaseSpec(
                intercept_s=0.008,
                slope_s_per_token=0.0,
                knees=[KneeSpec(at_tokens=5.2, slope_delta_s_per_token=0.033)],
            ),
            draft_prefills=False,
        ),
    )


def check_calibration(cal: CalibrationFile) -> dict[float, tuple[float, float]]:
    """(enable break-even S=1.2, disable break-even S=1.05) per vLLM acceptance rate; asserts
    both lie strictly inside (LOW_RPS, HIGH_RPS) with a factor-2 margin."""
    model = cal.latency_model()
    workload = Workload(PROMPT_TOKENS, GEN_TOKENS)
    out = {}
    for rate in (0.3, 0.5, 0.6, 0.8, 0.9, 1.0):
        alpha = float(alpha_from_vllm_rate(rate, NGRAM["num_speculative_tokens"]))
        be = break_even_rates(model, alpha, 4, workload, thresholds=(1.05, 1.2))
        enable, disable = be[1.2].rate_rps, be[1.05].rate_rps
        assert enable is not None and disable is not None, (rate, be)
        assert 2 * LOW_RPS < enable <= disable < HIGH_RPS / 2, (rate, enable, disable)
        assert predict_point(model, LOW_RPS, alpha, 4, workload).speedup > 1.2
        assert predict_point(model, HIGH_RPS, alpha, 4, workload).speedup < 1.05
        out[rate] = (enable, disable)
    return out


# ------------------------------------------------------------------------------------------
# Load generator, launcher status recorder
# ------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    index: int
    phase: str
    sent: float  # time.time()
    done: float
    status: int | None  # HTTP status, None on a connection error or timeout
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200


class Load:
    """Open loop: one request every 1/rate seconds (rate changeable, 0 = pause), each on a pool
    thread; bounded by ``max_requests`` and ``max_s``. Every request sent gets an Outcome."""

    def __init__(self, url: str, max_requests: int = MAX_REQUESTS, max_s: float = TEST_BUDGET_S) -> None:
        self.url, self.max_requests, self.max_s = url, max_requests, max_s
        self.rate, self.phase = 0.0, "idle"
        self.outcomes: list[Outcome] = []
        self.sent = 0
        self._lock = threading.Lock()
        self._local = threading.local()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=48, thread_name_prefix="load")
        self._thread = threading.Thread(target=self._run, name="load-scheduler", daemon=True)

    def set(self, rate: float, phase: str) -> None:
        self.rate, self.phase = rate, phase

    def _session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
            s.trust_env = False
        return s

    def _one(self, index: int, phase: str) -> None:
        sent = time.time()
        # Repeated text, so n-gram lookup finds drafts that the greedy tiny model accepts.
        prompt = f"request {index}: " + "the model token draft verify accept " * 8
        status, error = None, ""
        try:
            r = self._session().post(
                self.url + "/v1/completions",
                json={
                    "model": "tiny",
                    "prompt": prompt,
                    "max_tokens": GEN_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                },
                timeout=REQUEST_TIMEOUT_S,
            )
            status = r.status_code
            if status == 200 and r.json()["usage"]["completion_tokens"] != GEN_TOKENS:
                status, error = None, "wrong completion length"
            elif status != 200:
                error = r.text[:200]
        except requests.RequestException as exc:
            error = type(exc).__name__
        with self._lock:
            self.outcomes.append(Outcome(index, phase, sent, time.time(), status, error))

    def _run(self) -> None:
        start = time.monotonic()
        next_at = start
        while not self._stop.is_set() and self.sent < self.max_requests and time.monotonic() - start < self.max_s:
            rate = self.rate
            if rate <= 0:
                next_at = time.monotonic() + 0.2
                self._stop.wait(0.2)
                continue
            now = time.monotonic()
            if now < next_at:
                self._stop.wait(min(next_at - now, 0.2))
                continue
            self._pool.submit(self._one, self.sent, self.phase)
            self.sent += 1
            next_at = max(next_at + 1.0 / rate, now - 1.0)  # never a burst to catch up

    def start(self) -> Load:
        self._thread.start()
        return self

    def stop(self, drain_s: float = REQUEST_TIMEOUT_S + 5) -> None:
        """Stop sending; wait (bounded) for the requests in flight."""
        self._stop.set()
        self._thread.join(5)
        deadline = time.monotonic() + drain_s
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.outcomes) >= self.sent:
                    break
            time.sleep(0.2)
        self._pool.shutdown(wait=False, cancel_futures=True)


class StatusRecorder:
    """Polls the launcher's /admin/status every 0.5 s; restart windows come from its phases."""

    def __init__(self, admin: str, auth: dict) -> None:
        self.admin, self.auth = admin, auth
        self.samples: list[tuple[float, dict | None]] = []
        self.child_pids: set[int] = set()
        self._stop = threading.Event()
        self._http = requests.Session()
        self._http.trust_env = False
        self._thread = threading.Thread(target=self._run, name="status-recorder", daemon=True)

    def poll(self, http: requests.Session | None = None) -> dict | None:
        """One status (None when the admin API does not answer); ``http`` for other threads."""
        try:
            s = (http or self._http).get(self.admin + "/admin/status", headers=self.auth, timeout=5).json()
        except (requests.RequestException, ValueError):
            return None
        if s.get("child_pid"):
            self.child_pids.add(s["child_pid"])
        return s

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self.poll()))
            self._stop.wait(0.5)

    def latest(self) -> dict | None:
        return self.samples[-1][1] if self.samples else None

    def windows(self) -> list[tuple[float, float, float]]:
        """(last poll seeing ready, first poll seeing it not ready, first poll seeing ready
        again) for every restart; a window still open ends now. The restart began between the
        first two: a request in flight then is one sent before the second, done after the first."""
        out, last_ready, start = [], None, None
        for t, s in self.samples:
            ready = bool(s) and s["phase"] == "ready"
            if ready:
                if start is not None:
                    out.append((*start, t))
                    start = None
                last_ready = t
            elif last_ready is not None and start is None:
                start = (last_ready, t)
        if start is not None:
            out.append((*start, time.time()))
        return out

    def start(self) -> StatusRecorder:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def decisions(log_path: Path) -> list[dict]:
    out = []
    for line in log_path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            e = json.loads(line)
            if isinstance(e, dict) and e.get("event") == "decision":
                out.append(e)
    return out


def one_value(prom, promql: str, at: float | None = None) -> float | None:
    result = prom.query(promql, time=at)
    return float(result[0]["value"][1]) if result else None


# ------------------------------------------------------------------------------------------
# The test
# ------------------------------------------------------------------------------------------


def test_controller_switches_sd_on_real_vllm_end_to_end(tmp_path, prometheus_server):
    t_test = time.monotonic()

    def budget_left() -> float:
        left = TEST_BUDGET_S - (time.monotonic() - t_test)
        assert left > 0, f"test budget of {TEST_BUDGET_S} s exceeded"
        return left

    cal = synthetic_calibration()
    break_evens = check_calibration(cal)
    cal_path = tmp_path / "calibration.json"
    save(cal, cal_path)

    admin_port, vllm_port, exporter_port = free_port(), free_port(), free_port()
    admin, vllm = f"http://127.0.0.1:{admin_port}", f"http://127.0.0.1:{vllm_port}"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("SD_CONTROLLER_", "SD_LAUNCHER_"))}
    base_env.update(
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    vllm_argv = [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(MODEL), "--served-model-name", "tiny",
        "--max-model-len", "1024", "--dtype", "bfloat16",
        "--host", "127.0.0.1", "--port", str(vllm_port),
        "--speculative-config", json.dumps(NGRAM),
    ]  # fmt: skip
    launcher_log = tmp_path / "launcher.log"
    controller_log = tmp_path / "controller.log"
    launcher = controller = None
    recorder = StatusRecorder(admin, auth)
    load = Load(vllm)
    numbers: dict = {
        "break_even_enable_disable_by_acceptance": {k: [round(v, 3) for v in vs] for k, vs in break_evens.items()}
    }
    try:
        with launcher_log.open("wb") as log:
            launcher = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "controller.cli",
                    "launch",
                    "--admin-port",
                    str(admin_port),
                    "--state-file",
                    str(tmp_path / "launcher-state.json"),
                    "--initial-state",
                    "on",
                    "--ready-timeout-s",
                    str(START_TIMEOUT_S),
                    "--",
                    *vllm_argv,
                ],
                cwd=tmp_path,
                env={**base_env, "SD_LAUNCHER_ADMIN_TOKEN": TOKEN, "VLLM_CPU_KVCACHE_SPACE": "1"},
                stdout=log,
                stderr=subprocess.STDOUT,
            )

        def alive() -> None:
            assert launcher.poll() is None, f"launcher exited: {launcher_log.read_text(errors='replace')[-3000:]}"
            assert controller is None or controller.poll() is None, (
                f"controller exited: {controller_log.read_text(errors='replace')[-3000:]}"
            )

        http = requests.Session()  # the main thread's own: the recorder's runs in its thread
        http.trust_env = False

        def ready_with(enabled: bool) -> dict | None:
            alive()
            s = recorder.poll(http)
            if s and s["phase"] == "failed":
                raise AssertionError(f"switch failed: {s['last_error']}")
            return s if s and s["phase"] == "ready" and s["applied"]["enabled"] is enabled else None

        def restarting() -> dict | None:
            alive()
            s = recorder.poll(http)
            return s if s and s["phase"] == "restarting" else None

        prom = prometheus_server({"vllm": [f"127.0.0.1:{vllm_port}"], "controller": [f"127.0.0.1:{exporter_port}"]})
        t0 = time.monotonic()
        wait_until(lambda: ready_with(True), min(START_TIMEOUT_S, budget_left()), "initial vLLM start with SD")
        numbers["first_start_s"] = round(time.monotonic() - t0, 1)
        recorder.start()
        prom.wait_for(f'count({SD_SERIES}{{job="vllm"}}) > 0', timeout_s=30)

        controller_env = {
            **base_env,
            "SD_CONTROLLER_PROMETHEUS_URL": prom.url,
            "SD_CONTROLLER_PROMETHEUS_SELECTOR": 'job="vllm"',
            "SD_CONTROLLER_HOOK_TYPE": "launcher",
            "SD_CONTROLLER_HOOK_URL": admin,
            "SD_CONTROLLER_HOOK_TOKEN": TOKEN,
            "SD_CONTROLLER_CALIBRATION_FILE": str(cal_path),
            "SD_CONTROLLER_EVALUATION_INTERVAL_S": "2",
            "SD_CONTROLLER_DWELL_S": str(DWELL_S),
            "SD_CONTROLLER_RATE_WINDOW_S": "10",
            "SD_CONTROLLER_ACCEPTANCE_WINDOW_S": "20",
            "SD_CONTROLLER_LONG_WINDOW_S": "40",
            "SD_CONTROLLER_MAX_OBSERVATION_AGE_S": "30",
            "SD_CONTROLLER_PENDING_TIMEOUT_S": "300",
            "SD_CONTROLLER_RESTART_DOWNTIME_S": "70",
            # Mechanics, not economics: thresholds only, no weighing of gain against restart cost,
            # and the model as calibrated (no online correction, no model-free safety net: on this
            # busy 2-core CPU the observed latency swings with the other tests' load).
            "SD_CONTROLLER_PRICE_SWITCHES": "false",
            "SD_CONTROLLER_ONLINE_CORRECTION": "false",
            "SD_CONTROLLER_SAFETY_NET": "false",
            "SD_CONTROLLER_DEFAULT_PROMPT_TOKENS": str(PROMPT_TOKENS),
            "SD_CONTROLLER_DEFAULT_GEN_TOKENS": str(GEN_TOKENS),
            "SD_CONTROLLER_STATE_FILE": str(tmp_path / "controller-state.json"),
            "SD_CONTROLLER_EXPORTER_HOST": "127.0.0.1",
            "SD_CONTROLLER_EXPORTER_PORT": str(exporter_port),
            "SD_CONTROLLER_LOG_FORMAT": "json",
        }
        with controller_log.open("wb") as log:
            controller = subprocess.Popen(
                [sys.executable, "-m", "controller.cli", "run"],
                cwd=tmp_path,
                env=controller_env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        prom.wait_for('sd_enabled{job="controller"} == 1', timeout_s=45)

        # Phase 1: low load, SD on and predicted to pay: nothing moves.
        load.start()
        load.set(LOW_RPS, "low-on")
        t_low = time.time()
        time.sleep(LOW_HOLD_S)
        alive()
        assert recorder.latest()["restart_count"] == 0
        assert one_value(prom, 'sd_toggles_total{job="controller"}') in (None, 0.0)
        low = [d for d in decisions(controller_log) if d["time"] >= t_low and "predicted_speedup" in d]
        assert low, "no assessed decision during the low phase"
        assert not any(d["acted"] for d in decisions(controller_log))
        assert all(d["reason"] == Reason.STEADY.value for d in low), [d["detail"] for d in low]

        # Phase 2: high load: disable -> restart without SD -> series gone -> controller sees it.
        load.set(HIGH_RPS, "high-on")
        t_high = time.time()
        wait_until(restarting, min(60, budget_left()), "the controller to disable SD under high load", poll_s=0.5)
        t_off_seen = time.time()
        load.set(HIGH_RPS, "high-restart")
        wait_until(lambda: ready_with(False), min(START_TIMEOUT_S, budget_left()), "vLLM back without SD")
        load.set(HIGH_RPS, "high-off")
        t_off_ready = time.time()
        prom.wait_for(f'up{{job="vllm"}} == 1 and on() absent({SD_SERIES}{{job="vllm"}})', timeout_s=30)
        prom.wait_for(
            'sd_enabled{job="controller"} == 0 and on() sd_toggles_total{job="controller",direction="off"} == 1'
            ' and on() sd_controller_state{job="controller",sd_controller_state="disabled"} == 1',
            timeout_s=30,
        )
        time.sleep(max(0.0, t_off_ready + HIGH_OFF_S - time.time()))
        t_high_end = time.time()
        assert recorder.latest()["applied"]["enabled"] is False, "SD came back while the load was still high"

        # Phase 3: load drops: after the dwell, SD on again.
        load.set(LOW_RPS, "low-off")
        wait_until(restarting, min(DWELL_S + 60, budget_left()), "the controller to enable SD at low load", poll_s=0.5)
        t_on_seen = time.time()
        load.set(LOW_RPS, "low-restart")
        wait_until(lambda: ready_with(True), min(START_TIMEOUT_S, budget_left()), "vLLM back with SD")
        load.set(LOW_RPS, "low-on-again")
        t_on_ready = time.time()
        prom.wait_for(f'count({SD_SERIES}{{job="vllm"}}) > 0', timeout_s=30)
        prom.wait_for(
            'sd_enabled{job="controller"} == 1 and on() sd_toggles_total{job="controller",direction="on"} == 1'
            ' and on() sd_toggles_total{job="controller",direction="off"} == 1',
            timeout_s=30,
        )

        # A few requests against the new server: wait for them (at 0.15 req/s a fixed 5 s often
        # saw none, and the phase was missing from the outcomes).
        def served_again() -> bool:
            with load._lock:
                return sum(o.ok for o in load.outcomes if o.phase == "low-on-again") >= 2

        wait_until(served_again, min(60.0, budget_left()), "two requests served with SD on again", poll_s=0.5)
        load.stop()
        recorder.stop()
        budget_left()

        # --- what the controller did and when ---
        final = recorder.poll(http)
        assert final["restart_count"] == 2
        acted = [d for d in decisions(controller_log) if d["acted"]]
        assert [(d["action"], d["reason"]) for d in acted] == [
            ("disable", Reason.SPEEDUP_LOW.value),
            ("enable", Reason.SPEEDUP_HIGH.value),
        ], [(d["action"], d["reason"], d["detail"]) for d in acted]
        off_d, on_d = acted
        assert off_d["arrival_rate_rps"] > LOW_RPS * 2 and on_d["arrival_rate_rps"] < HIGH_RPS / 2
        assert on_d["time"] - t_off_ready >= DWELL_S - 3, "enabled inside the dwell"  # 3 s: poll slack
        numbers.update(
            restart_durations_s=final["restart_durations_s"],
            disable_decision_after_high_load_s=round(off_d["time"] - t_high, 1),
            disable_decision=f"{off_d['detail']} at {off_d['arrival_rate_rps']} req/s, acceptance {off_d['acceptance_rate']} ({off_d['acceptance_source']})",
            enable_decision_after_load_drop_s=round(on_d["time"] - t_high_end, 1),
            enable_decision_after_off_confirmed_s=round(on_d["time"] - t_off_ready, 1),
            enable_decision=f"{on_d['detail']} at {on_d['arrival_rate_rps']} req/s, acceptance {on_d['acceptance_rate']} ({on_d['acceptance_source']})",
            restart_seen_off_s=round(t_off_ready - t_off_seen, 1),
            restart_seen_on_s=round(t_on_ready - t_on_seen, 1),
        )

        # --- controller state via Prometheus (scraped), final ---
        assert one_value(prom, 'sd_toggles_total{job="controller",direction="off"}') == 1.0
        assert one_value(prom, 'sd_toggles_total{job="controller",direction="on"}') == 1.0
        assert one_value(prom, 'sd_controller_state{job="controller",sd_controller_state="enabled"}') == 1.0

        # --- real metrics: SD series absent exactly while SD was off, latency with vs without SD ---
        mid_off = 0.5 * (t_off_ready + t_high_end)
        assert one_value(prom, f'count({SD_SERIES}{{job="vllm"}})', at=mid_off) is None
        assert one_value(prom, f'count({SD_SERIES}{{job="vllm"}})', at=t_high - 1) is not None

        def mean_e2e(t_from: float, t_to: float) -> float | None:
            w = max(int(t_to - t_from), 2)
            q = (
                f'sum(increase(vllm:e2e_request_latency_seconds_sum{{job="vllm"}}[{w}s]))'
                f' / sum(increase(vllm:e2e_request_latency_seconds_count{{job="vllm"}}[{w}s]))'
            )
            return one_value(prom, q, at=t_to)

        accept_q = (
            'sum(increase(vllm:spec_decode_num_accepted_tokens_total{job="vllm"}[%ds]))'
            ' / sum(increase(vllm:spec_decode_num_draft_tokens_total{job="vllm"}[%ds]))'
        )
        w_on = int(t_off_seen - t_high) - 1
        numbers.update(
            prom_mean_e2e_high_sd_on_s=mean_e2e(t_high + 1, t_off_seen - 1),
            prom_mean_e2e_high_sd_off_s=mean_e2e(t_off_ready + 3, t_high_end),
            prom_mean_e2e_low_sd_on_s=mean_e2e(t_low, t_high),
            prom_acceptance_low=one_value(prom, accept_q % ((int(t_high - t_low),) * 2), at=t_high),
            prom_acceptance_high=one_value(prom, accept_q % (w_on, w_on), at=t_off_seen - 1) if w_on >= 2 else None,
        )

        # --- request outcomes: nothing lost outside a restart window ---
        windows = recorder.windows()
        assert len(windows) == 2, windows
        slack = 1.0

        def in_window(o: Outcome) -> bool:
            return any(o.sent <= w1 + slack and o.done >= w0 - slack for w0, _, w1 in windows)

        assert len(load.outcomes) == load.sent, f"{load.sent - len(load.outcomes)} requests never finished"
        failed = [o for o in load.outcomes if not o.ok]
        lost = [o for o in failed if not in_window(o)]
        in_flight = [o for o in load.outcomes for w0, began, _ in windows if o.sent < began and o.done > w0]
        by_phase: dict[str, dict] = {}
        for o in load.outcomes:
            p = by_phase.setdefault(o.phase, {"sent": 0, "ok": 0, "failed": 0, "latencies": []})
            p["sent"] += 1
            p["ok" if o.ok else "failed"] += 1
            if o.ok:
                p["latencies"].append(o.done - o.sent)
        for p in by_phase.values():
            lat = p.pop("latencies")
            p["client_mean_latency_s"] = round(statistics.mean(lat), 3) if lat else None
        numbers.update(
            restart_windows_s=[round(w1 - w0, 1) for w0, _, w1 in windows],
            requests_sent=load.sent,
            requests_ok=sum(o.ok for o in load.outcomes),
            requests_failed_in_restart_window=len(failed) - len(lost),
            requests_lost_outside_windows=len(lost),
            requests_in_flight_at_restart=len(in_flight),
            in_flight_drained_ok=sum(o.ok for o in in_flight),
            in_flight_failed=sum(not o.ok for o in in_flight),
            by_phase=by_phase,
            errors=sorted({o.error for o in failed}),
            test_runtime_s=round(time.monotonic() - t_test, 1),
        )
        print("\ne2e numbers: " + json.dumps(numbers, indent=1, default=str))
        (tmp_path / "e2e-numbers.json").write_text(json.dumps(numbers, indent=1, default=str))
        assert not lost, [(o.index, o.phase, o.status, o.error) for o in lost]
        assert by_phase["low-on"]["failed"] == 0
        assert by_phase.get("high-off", {}).get("ok", 0) > 0, by_phase
        assert by_phase.get("low-on-again", {}).get("ok", 0) >= 2, by_phase
        log_text = controller_log.read_text(errors="replace") + launcher_log.read_text(errors="replace")
        assert TOKEN not in log_text
    finally:
        load.stop(drain_s=5)
        recorder.stop()
        for proc, grace in ((controller, 10), (launcher, 90)):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=30)
        for pid in recorder.child_pids:  # never leave a vLLM behind, whatever failed
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
