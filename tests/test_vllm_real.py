"""The launcher against a real vLLM (CPU build, tiny random Llama): SD on, off, on again.

Needs ``scripts/setup-vllm.sh`` (venv at $SD_VLLM_VENV, model at $SD_TINY_MODEL_DIR);
skipped otherwise. Each vLLM start takes ~65–110 s here, so the test takes ~5 minutes.
Run: ``pytest -m vllm tests/test_vllm_real.py -s`` (``-s`` shows the measured restarts).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from controller.benchmark.http import HttpServer
from controller.benchmark.loadtest import LoadPlan, lognormal_workload, run_load
from tests.support.prometheus import free_port
from tests.support.vllm_env import MODEL, NGRAM, VLLM_PYTHON, requires_vllm
from tests.support.waiting import wait_until as _wait_until


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 1.0):
    return _wait_until(predicate, timeout_s, what, poll_s)


REPO = Path(__file__).resolve().parents[1]
TOKEN = "real-vllm-test-token"
START_TIMEOUT_S = 420
SD_SERIES = "vllm:spec_decode_num_drafts_total"

pytestmark = requires_vllm


def test_launcher_toggles_sd_on_real_vllm(tmp_path):
    admin_port, vllm_port = free_port(), free_port()
    admin = f"http://127.0.0.1:{admin_port}"
    vllm = f"http://127.0.0.1:{vllm_port}"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    http = requests.Session()
    http.trust_env = False
    env = {
        **os.environ,
        "SD_LAUNCHER_ADMIN_TOKEN": TOKEN,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    vllm_argv = [
        str(VLLM_PYTHON),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(MODEL),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "1024",
        "--dtype",
        "bfloat16",
        "--host",
        "127.0.0.1",
        "--port",
        str(vllm_port),
        "--speculative-config",
        json.dumps(NGRAM),
    ]
    log_path = tmp_path / "launcher.log"
    with log_path.open("wb") as log:
        launcher = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "controller.cli",
                "launch",
                "--admin-port",
                str(admin_port),
                "--state-file",
                str(tmp_path / "state.json"),
                "--ready-timeout-s",
                str(START_TIMEOUT_S),
                "--",
                *vllm_argv,
            ],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    child_pids: set[int] = set()

    def status() -> dict | None:
        assert launcher.poll() is None, f"launcher exited: {log_path.read_text()[-3000:]}"
        try:
            r = http.get(admin + "/admin/status", headers=auth, timeout=5)
        except requests.ConnectionError:
            return None
        s = r.json()
        if s["child_pid"]:
            child_pids.add(s["child_pid"])
        return s

    def ready_with(enabled: bool) -> dict | None:
        s = status()
        if s and s["phase"] == "failed":
            raise AssertionError(f"switch failed: {s['last_error']}")
        return s if s and s["phase"] == "ready" and s["applied"]["enabled"] is enabled else None

    def complete(n: int = 3) -> None:
        for i in range(n):
            r = http.post(
                vllm + "/v1/completions",
                timeout=60,
                json={
                    "model": "tiny",
                    "prompt": f"the model token draft {i} the model token draft",
                    "max_tokens": 16,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 16

    def metrics() -> str:
        r = http.get(vllm + "/metrics", timeout=10)
        assert r.status_code == 200
        return r.text

    def switch(enabled: bool) -> float:
        started = time.monotonic()
        r = http.post(
            admin + "/admin/speculative",
            headers=auth,
            timeout=10,
            json={"enabled": enabled, "reason": "test_vllm_real"},
        )
        assert r.status_code == 202, r.text
        assert r.json()["phase"] == "restarting"
        assert status()["phase"] == "restarting"
        wait_until(lambda: ready_with(enabled), START_TIMEOUT_S + 60, f"SD {enabled} ready")
        return time.monotonic() - started

    try:
        t0 = time.monotonic()
        wait_until(lambda: ready_with(True), START_TIMEOUT_S, "initial start with SD")
        first_start_s = time.monotonic() - t0

        complete()
        text = metrics()
        assert SD_SERIES in text
        drafts = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(SD_SERIES)]
        assert sum(drafts) > 0

        off_s = switch(False)
        assert SD_SERIES not in metrics()
        complete()

        # The bench's load test against the real server: its batch gauges parse (a fraction
        # of the cache, its block size from cache_config_info) and give a plausible running
        # context: 200-token prompts growing by up to 256, in 128-token CPU blocks. Long enough
        # generations that a fast machine still runs several at once (a mean under one
        # sequence measures nothing).
        bench = HttpServer(vllm, "tiny", 60)
        # On a loaded 2-core box the few scrapes of a 10 s test have seen under one running
        # sequence on average (nothing to measure: None); a second, longer test then (bounded).
        for duration_s in (10.0, 30.0):
            plan = LoadPlan(rates=(8.0,), duration_s=duration_s, drain_s=60.0, workload="chat", seed=3)
            (row,) = run_load(bench, lognormal_workload(200, 256, 0.0), plan)
            if row.running_context_tokens is not None:
                break
            print(f"\nload test of {duration_s:g} s measured no running context; gauges {bench.gauges()}")
        assert bench.info().block_size, "vllm:cache_config_info has no block_size"
        assert any(g.running > 0 and 0 < g.kv_usage <= 1 for g in bench.gauges()), bench.gauges()
        assert row.running_context_tokens is not None, bench.gauges()
        assert 0.5 * 200 < row.running_context_tokens < 1.5 * (200 + 256), row.running_context_tokens
        # vLLM v1's prefix cache (on by default): requests behind one shared 512-token prefix
        # (4 whole 128-token CPU blocks) find it cached once the first has scheduled it, and the
        # load test reads the hits off vllm:prompt_tokens_cached_total.
        shared = lognormal_workload(64, 16, 0.0, prefix_tokens=512, prefix_groups=1)
        plan = LoadPlan(rates=(2.0,), duration_s=8.0, drain_s=60.0, workload="chat", seed=4)
        (hit,) = run_load(bench, shared, plan)
        assert hit.cached_prompt_tokens is not None, "no vllm:prompt_tokens_cached_total"
        assert 128 <= hit.cached_prompt_tokens <= 512, hit.cached_prompt_tokens

        on_s = switch(True)
        assert SD_SERIES in metrics()
        complete()

        final = status()
        assert final["restart_count"] == 2
        assert len(final["restart_durations_s"]) == 2
        print(
            f"\nreal vLLM: first start {first_start_s:.1f} s; SD off restart {off_s:.1f} s; "
            f"SD on restart {on_s:.1f} s; launcher-measured {final['restart_durations_s']}; "
            f"load test: running context {row.running_context_tokens:.0f} tokens, "
            f"{hit.cached_prompt_tokens:.0f} prompt tokens a request from the prefix cache"
        )
        child_pid = final["child_pid"]
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=90) == 0
        with pytest.raises(ProcessLookupError):
            os.killpg(child_pid, 0)  # the whole vLLM process group is gone
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            try:
                launcher.wait(timeout=90)
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.wait(timeout=30)
        for pid in child_pids:  # never leave a vLLM behind, whatever failed
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        http.close()
