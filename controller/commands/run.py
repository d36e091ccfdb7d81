"""``sd-controller run``: the daemon. Builds the shell from settings and runs the tick loop."""

from __future__ import annotations

import argparse
import json
import signal
import socket
import sys
import threading
import time
from typing import Any

import structlog

from controller import calibration as cal_mod
from controller.coordination.setup import build_gate
from controller.errors import EXIT_OK, EXIT_USAGE, ConfigError, InputError, redact_url
from controller.hooks.setup import build_hook
from controller.learning import Learner
from controller.logs import configure as configure_logs
from controller.loop import Controller, WebhookNotifier, override_from_file, run_loop
from controller.model import LatencyModel, Workload
from controller.settings import Settings, load_settings
from controller.shipped import calibration_path
from controller.sources.setup import build_source
from controller.sources.vllm_metrics import VllmMetricsSource
from controller.state_store import FileStateStore

log = structlog.get_logger("sd_controller")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML or JSON settings file (keys are setting names)")
    p.add_argument("--calibration", help="calibration file (overrides calibration_file)")
    p.add_argument("--dry-run", action="store_true", help="decide and export, never call the hook")
    p.add_argument(
        "--once",
        action="store_true",
        help="run one tick, print the decision with its reasons, exit (scraping vLLM directly, it waits"
        " rate_window_s between two scrapes first)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override one setting (repeatable; JSON values allowed)",
    )


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """--set NAME=VALUE, then --calibration (which, as its help says, beats calibration_file)."""
    sets = _parse_sets(args.set)
    return sets | {"calibration_file": args.calibration} if args.calibration is not None else sets


def _parse_sets(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ConfigError(f"--set {item!r}: expected NAME=VALUE")
        try:
            out[name.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[name.strip()] = value
    return out


def check_model(model: LatencyModel, s: Settings, where: object) -> None:
    """ConfigError unless the calibration predicts a positive, finite latency at idle.

    An all-zero calibration validates field by field but divides by zero on every tick.
    """
    if not cal_mod.prices_a_request(model, Workload(s.default_prompt_tokens, s.default_gen_tokens), s.draft_length):
        raise ConfigError(
            f"setting calibration_file: {where}: predicts no finite, positive latency at idle (all step costs zero?)"
        )


def build(args: argparse.Namespace, settings: Settings | None = None, clock=time.time) -> tuple[Controller, bool]:
    """Everything ``run`` needs, from args and environment; ConfigError names the setting.

    Returns the controller and whether its calibration is the shipped example (``run`` warns
    once the exporter listens: its port is the last check that can refuse the start)."""
    s = settings or load_settings(args.config, **_overrides(args))
    if not s.calibration_file:
        raise ConfigError("setting calibration_file: required (a file from sd-controller calibrate)")
    path = calibration_path(s.calibration_file)
    try:
        cal = cal_mod.load(path)
    except InputError as exc:
        raise ConfigError(f"setting calibration_file: {exc}") from exc
    except UnicodeDecodeError:
        raise ConfigError(f"setting calibration_file: {path}: not UTF-8 text") from None
    except RecursionError:
        raise ConfigError(f"setting calibration_file: {path}: JSON nested too deeply") from None
    model = cal.latency_model(s.max_num_seqs)
    check_model(model, s, path)
    # Every check that can refuse the start comes before the first file is touched (the state
    # file written, a corrupt one set aside): a refused start changes nothing.
    source = build_source(s, model)
    gate = build_gate(s)
    build_hook(s.hook, None)  # its token and CA bundle; built again below with the state's word
    store = FileStateStore(s.state_file)
    try:
        s.state_file.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"setting state_file: cannot create {s.state_file.parent}: {exc.strerror}") from exc
    state = store.load()
    try:
        store.save(state)  # a read-only state directory fails here, not on every tick
    except OSError as exc:
        raise ConfigError(f"setting state_file: cannot write {s.state_file}: {exc.strerror or exc}") from None
    controller = Controller(
        settings=s,
        model=model,
        source=source,
        # A pending lock in the state file: the last process may have died after its change took
        # effect (an exec hook's script outlives it). A hook that cannot ask must not vouch for
        # the old setting then, or the change is never confirmed and made a second time.
        hook=build_hook(s.hook, None if state.pending is not None else state.applied_enabled),
        clock=clock,
        state_store=store,
        dry_run=args.dry_run,
        override=override_from_file(s.override_file, s.override),
        notify=WebhookNotifier(s.webhook_url),
        state=state,
        learner=Learner.from_settings(s, model),
        gate=gate,
    )
    return controller, cal.example


def run(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.config, **_overrides(args))
        configure_logs(settings.log_format, settings.log_level)
        controller, example = build(args, settings)
    except (ConfigError, InputError) as exc:
        print(f"sd-controller run: error: {exc}", file=sys.stderr)
        return EXIT_USAGE

    def warn_example() -> None:  # after every check, so a config error stays the only line on stderr
        if example:
            log.warning("example_calibration", detail="the shipped EXAMPLE calibration is not a measurement")

    if args.once:
        warn_example()
        if isinstance(controller.source, VllmMetricsSource):
            # A rate needs two scrapes: take the first now, the tick's a rate window later.
            print(
                f"sd-controller run --once: scraping {redact_url(controller.source.url)} now and again in"
                f" {settings.rate_window_s:g}s (rate_window_s), for a rate",
                file=sys.stderr,
            )
            controller.source.observe(time.time())
            time.sleep(settings.rate_window_s)
        result = controller.tick()
        d, a = result.decision, result.assessment
        print(f"decision: {d.action.value} ({d.reason.value}) — {d.detail}")
        print(
            f"state: {d.phase.value}; applied SD: {result.state.applied_enabled}; events: {', '.join(map(str, result.events)) or '-'}"
        )
        if a is not None:
            print(
                f"rate {a.arrival_rate_rps:.3f} req/s (projected {a.projected_rate_rps:.3f}); acceptance {a.acceptance.rate:.3f}"
                f" ({a.acceptance.source.value}); predicted speedup {a.predicted_speedup:.3f} at γ={a.draft_length}"
                f" (best γ {a.best_draft_length}); break-even {a.break_even_rate_rps}; switch cost"
                f" {a.switch_cost_request_s:.0f} req·s vs gain {a.projected_gain_request_s:.0f} req·s"
            )
        return EXIT_OK
    from controller.exporter import MetricsServer

    try:
        server = MetricsServer(
            controller.registry, settings.exporter_host, settings.exporter_port, controller.healthy
        ).start()
    except (OSError, UnicodeError) as exc:  # UnicodeError: a host name IDNA cannot encode
        # A name that does not resolve is the host's fault; a port in use (or refused) the port's.
        which = "exporter_host" if isinstance(exc, socket.gaierror | UnicodeError) else "exporter_port"
        print(
            f"sd-controller run: error: setting {which}: cannot listen on {settings.exporter_host}:{settings.exporter_port}:"
            f" {getattr(exc, 'strerror', None) or type(exc).__name__}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    warn_example()
    stop = threading.Event()
    signals: list[str] = []

    def on_signal(signum: int, _frame: object) -> None:
        # No logging here: the signal may land inside a log write on this thread, whose lock
        # the handler would then wait on forever. The loop logs it once it has stopped.
        signals.append(signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info(
        "started",
        exporter_port=server.port,
        source="prometheus" if settings.prometheus_url else "vllm_metrics",
        hook=settings.hook_type.value,
        interval_s=settings.evaluation_interval_s,
        dry_run=args.dry_run,
    )
    try:
        ticks = run_loop(controller, stop, settings.evaluation_interval_s)
    finally:
        server.stop()
    if signals:
        log.info("shutdown_requested", signal=signals[0])
    log.info("stopped", ticks=ticks)
    return EXIT_OK
