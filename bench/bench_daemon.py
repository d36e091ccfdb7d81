"""Benchmark: resident memory of the running daemon and CPU time per tick.

Targets (issue: daemon): <= 80 MB RSS, <= 10 ms CPU per tick excluding network waits.
Prints figures; asserts nothing.

    python bench/bench_daemon.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controller.calibration import load
from controller.hooks.exec import NoHook
from controller.learning import Learner
from controller.loop import Controller
from controller.settings import Settings
from controller.shipped import example_calibration_path
from controller.sources.vllm_metrics import VllmMetricsSource
from tests.support.fake_vllm import FakeVllmServer


def cpu_per_tick(ticks: int = 2000, sd_on: bool = True) -> float:
    """In-process: parse a full vLLM /metrics payload, assess, learn, decide, export, save state, log.

    ``sd_on=False``: SD off, so the tick also computes the posterior width of the speedup
    (four more solver points on corrected models) for the enabling decision.
    Logs go to /dev/null as JSON lines, as the daemon writes them when not on a terminal.
    """
    import structlog

    from controller.logs import configure

    configure("json", "info")
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=open(os.devnull, "w")))  # noqa: SIM115 - lives as long as the process
    t = [1_800_000_000.0]
    vllm = FakeVllmServer(clock=lambda: t[0])
    # vLLM's side (rendering the payload) happens before the clock starts: only our work counts.
    payloads = []
    if not sd_on:
        vllm.restart(sd_enabled=False)
    for _ in range(ticks):
        if sd_on:
            vllm.advance(requests=300, prompt_tokens=300 * 512, gen_tokens=300 * 256, drafts=2000, draft_tokens=8000,
                         accepted_tokens=4800, accepted_per_pos=[1600, 1300, 1100, 800], e2e_latency_s=2.0)  # fmt: skip
        else:
            vllm.advance(requests=300, prompt_tokens=300 * 512, gen_tokens=300 * 256, e2e_latency_s=2.0)
        payloads.append(vllm.render())
    it = iter(payloads)
    tmp = tempfile.mkdtemp()
    settings = Settings(calibration_file="example", hook_type="none", state_file=f"{tmp}/state.json")
    model = load(example_calibration_path()).latency_model()
    ctl = Controller(
        settings,
        model,
        VllmMetricsSource(fetch=lambda: next(it)),
        NoHook(),
        clock=lambda: t[0],
        learner=Learner.from_settings(settings, model),  # evidence file + posterior, as the daemon
    )
    ctl.state = ctl.state.__class__(applied_enabled=sd_on, applied_draft_length=4 if sd_on else None)
    lines = payloads[-1].count("\n")
    start = time.process_time()
    for _ in range(ticks):
        t[0] += 60
        ctl.tick()
    per_tick = (time.process_time() - start) / ticks
    learned = ctl.learner.posterior.evidence
    print(
        f"online correction: learned from {learned} of {ticks} ticks (evidence appended every tick, posterior every 5th update)"
    )
    real = Path(__file__).resolve().parents[1] / "tests/fixtures/vllm-0.32-cpu/metrics-sd-ngram-k4.txt"
    real_text = real.read_text()
    src = VllmMetricsSource(fetch=lambda: real_text)
    start = time.process_time()
    for i in range(ticks):
        src.observe(60.0 * i)
    parse = (time.process_time() - start) / ticks
    print(
        f"payload: {lines} lines (fake vLLM); parsing a real vLLM 0.32 capture ({real_text.count(chr(10))} lines): {parse * 1e3:.2f} ms"
    )
    return per_tick


def daemon_rss(seconds: float = 20.0) -> tuple[float, int]:
    """A real `sd-controller run` process ticking every 0.2 s against a fake vLLM over HTTP."""
    with FakeVllmServer() as vllm, tempfile.TemporaryDirectory() as tmp:
        env = {
            **os.environ,
            "SD_CONTROLLER_CALIBRATION_FILE": "example",
            "SD_CONTROLLER_HOOK_TYPE": "none",
            "SD_CONTROLLER_VLLM_METRICS_URL": vllm.metrics_url,
            "SD_CONTROLLER_EVALUATION_INTERVAL_S": "0.2",
            "SD_CONTROLLER_STATE_FILE": f"{tmp}/state.json",
            "SD_CONTROLLER_EXPORTER_HOST": "127.0.0.1",
            "SD_CONTROLLER_EXPORTER_PORT": "0",
            "SD_CONTROLLER_LOG_LEVEL": "warning",
        }
        proc = subprocess.Popen([sys.executable, "-m", "controller.cli", "run"], env=env, stderr=subprocess.DEVNULL)
        peak = 0.0
        try:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                vllm.advance(
                    requests=5, prompt_tokens=2560, gen_tokens=1280, drafts=40, draft_tokens=160, accepted_tokens=96
                )
                status = Path(f"/proc/{proc.pid}/status").read_text()
                rss_kb = int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])
                peak = max(peak, rss_kb / 1024)
                time.sleep(0.5)
            scrapes = vllm.scrapes
        finally:
            proc.terminate()
            proc.wait(10)
        return peak, scrapes


def main() -> None:
    per_tick = cpu_per_tick()
    print(
        f"CPU per tick (parse /metrics + assess + learn + decide + export + state), in process: {per_tick * 1e3:.2f} ms   target <= 10 ms"
    )
    off_tick = cpu_per_tick(sd_on=False)
    print(
        f"CPU per tick with SD off (+ the posterior width of the speedup for enabling): {off_tick * 1e3:.2f} ms   target <= 10 ms"
    )
    peak, scrapes = daemon_rss()
    print(f"daemon peak RSS over 20 s ({scrapes} ticks, direct scraping):            {peak:.1f} MB   target <= 80 MB")


if __name__ == "__main__":
    main()
