"""``sd-controller simulate``: serve a simulated vLLM (/metrics, /health) and the launcher's
admin API over HTTP on 127.0.0.1, so the real daemon (and a real Prometheus) can run against it.

Time: the engine runs in real seconds (step costs, latencies, restart downtime are real, so
rates seen by Prometheus or the daemon are true rates); ``--speed`` plays the scenario's
traces faster, e.g. at 60 a 24 h scenario's load curve passes in 24 minutes.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time

from controller.commands._common import exits_on_input_error, finite_float
from controller.errors import EXIT_OK, ConfigError
from controller.shipped import EXAMPLE_CALIBRATION, calibration_path
from controller.tokens import ADMIN_TOKEN_ENV, read_admin_token


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", default="demo-day", help="built-in scenario name or YAML file (default demo-day)")
    parser.add_argument("--calibration", default=EXAMPLE_CALIBRATION, help="calibration JSON, or 'example' (default)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port of /metrics and /health (default 8000)")
    parser.add_argument("--admin-port", type=int, default=8091, help="port of the admin API (default 8091)")
    parser.add_argument(
        "--speed", type=finite_float, default=60.0, help="scenario seconds per wall second (default 60)"
    )
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: the scenario's)")
    parser.add_argument("--model-name", default="sim", help="model_name label on the metrics (default sim)")
    parser.add_argument("--restart-s", type=finite_float, default=None, help="override the restart downtime, seconds")
    parser.add_argument(
        "--admin-token-file", default=None, help=f"file holding the admin bearer token (else env {ADMIN_TOKEN_ENV})"
    )
    parser.add_argument(
        "--insecure-no-token", action="store_true", help="serve the admin API without a token (loopback only)"
    )
    parser.add_argument(
        "--duration-s",
        type=finite_float,
        default=None,
        help="stop after this many wall seconds (default: run until stopped)",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="N > 1: a fleet of N replicas behind a router, receiving N times the scenario's rate; replica i "
        "serves on --port + i and --admin-port + i (default 1)",
    )
    parser.add_argument("--router", default="lor", choices=("rr", "lor"), help="fleet: how the router splits the load")


def build(args: argparse.Namespace):
    """The SimulatedServer described by the arguments (not started)."""
    import time as _time

    from controller import calibration
    from controller.sim import scenarios
    from controller.sim.engine import Engine
    from controller.sim.server import SimulatedServer

    if args.speed <= 0:
        raise ConfigError("--speed must be > 0")
    if args.duration_s is not None and args.duration_s <= 0:
        raise ConfigError("--duration-s must be > 0")
    for name in ("port", "admin_port"):
        if not 0 <= getattr(args, name) <= 65535:
            raise ConfigError(f"--{name.replace('_', '-')} must be in 0..65535")
    scenario = scenarios.load(args.scenario)
    if args.seed is not None:
        scenario = scenario.with_changes(seed=args.seed)
    if args.restart_s is not None:
        if args.restart_s < 0:
            raise ConfigError("--restart-s must be >= 0")
        scenario = scenario.with_changes(engine={"restart_downtime_s": args.restart_s, "restart_jitter_s": 0.0})
    model = calibration.load(calibration_path(args.calibration)).latency_model()
    token = read_admin_token(args.admin_token_file, args.insecure_no_token)
    if not 1 <= args.replicas <= 64:
        raise ConfigError(f"--replicas {args.replicas}: expected 1 to 64")
    if args.replicas > 1:
        return _build_fleet(args, scenario, model, token)
    engine = Engine(scenario, model, epoch_s=_time.time(), model_name=args.model_name, trace_speed=args.speed)
    try:
        return SimulatedServer(engine, port=args.port, admin_port=args.admin_port, token=token, host=args.host)
    except OSError as exc:
        raise ConfigError(
            f"cannot listen on {args.host}:{args.port}/{args.admin_port}: {exc.strerror or exc}"
        ) from None


def _build_fleet(args: argparse.Namespace, scenario, model, token):
    import time as _time

    from controller.sim.engine import CalibratedCosts
    from controller.sim.fleet import Fleet
    from controller.sim.router import Router
    from controller.sim.server import SimulatedFleet

    n = args.replicas
    fleet = Fleet(
        scenario, CalibratedCosts(model), n, Router(args.router), epoch_s=_time.time(), trace_speed=args.speed
    )
    for e in fleet.engines:
        e.model_name = args.model_name
    ports = [args.port + i if args.port else 0 for i in range(n)]
    admin_ports = [args.admin_port + i if args.admin_port else 0 for i in range(n)]
    try:
        return SimulatedFleet(fleet, host=args.host, ports=ports, admin_ports=admin_ports, token=token)
    except OSError as exc:
        raise ConfigError(
            f"cannot listen on {args.host} ports {ports[0]}..{ports[-1]}/{admin_ports[0]}..{admin_ports[-1]}: "
            f"{exc.strerror or exc}"
        ) from None


@exits_on_input_error
def run(args: argparse.Namespace) -> int:
    server = build(args)
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server.start()
    if hasattr(server, "fleet"):
        sc = server.fleet.scenario
        where = ", ".join(f"{m} + {a}" for m, a in zip(server.metrics_urls, server.admin_urls, strict=True))
        print(
            f"simulating {sc.name} at {args.speed:g}x on {len(server.metrics)} replicas behind a {args.router} "
            f"router: {where}",
            file=sys.stderr,
            flush=True,
        )
    else:
        sc = server.engine.scenario
        print(
            f"simulating {sc.name} at {args.speed:g}x: metrics {server.metrics_url}, admin {server.admin_url}",
            file=sys.stderr,
            flush=True,
        )
    started = time.monotonic()
    try:
        while not stop.is_set():
            if args.duration_s is not None and time.monotonic() - started >= args.duration_s:
                break
            stop.wait(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        signal.signal(signal.SIGTERM, previous)
    return EXIT_OK
