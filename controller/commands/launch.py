"""``sd-controller launch [options] -- <vLLM command line>``: run vLLM as a child and serve
the admin API that switches speculative decoding by restarting it."""

from __future__ import annotations

import argparse
import ipaddress
import signal
import sys
import threading
from pathlib import Path

import structlog

from controller.commands._common import finite_float
from controller.errors import EXIT_RUNTIME, EXIT_USAGE, ConfigError, InputError
from controller.launcher.admin import AdminServer
from controller.launcher.profile import parse_profile, shutdown_timeout_s, vllm_url
from controller.launcher.state import INITIAL_STATES, initial_config, load_state
from controller.launcher.supervisor import Supervisor, SupervisorOptions
from controller.logs import configure as configure_logs
from controller.tokens import ADMIN_TOKEN_ENV, read_admin_token

log = structlog.get_logger("controller.commands.launch")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--admin-host", default="127.0.0.1", help="admin API bind address (default 127.0.0.1)")
    parser.add_argument("--admin-port", type=int, default=8091, help="admin API port (default 8091; 0 = any)")
    parser.add_argument(
        "--admin-token-file",
        help=f"file holding the admin bearer token (else env {ADMIN_TOKEN_ENV})",
    )
    parser.add_argument(
        "--insecure-no-token",
        action="store_true",
        help="serve the admin API without a token (only for a loopback-only test setup)",
    )
    parser.add_argument(
        "--initial-state",
        choices=INITIAL_STATES,
        default="last",
        help="SD at start: on, off, or last = the persisted setting, else the command line's",
    )
    parser.add_argument(
        "--state-file",
        default="./sd-launcher-state.json",
        help="where the applied setting is persisted (default ./sd-launcher-state.json)",
    )
    parser.add_argument("--vllm-url", help="base URL to probe (default: from --host/--port of the vLLM line)")
    parser.add_argument(
        "--drain-s",
        type=finite_float,
        default=30.0,
        help="grace after SIGTERM before SIGKILL, unless the vLLM line sets --shutdown-timeout (default 30)",
    )
    parser.add_argument(
        "--ready-timeout-s",
        type=finite_float,
        default=600.0,
        help="a start not ready (/health and /metrics 200) within this is rolled back (default 600)",
    )
    parser.add_argument(
        "--max-crash-restarts",
        type=int,
        default=5,
        help="consecutive restarts after vLLM dies by itself before giving up (default 5)",
    )
    parser.add_argument(
        "--crash-backoff-s",
        type=finite_float,
        default=1.0,
        help="first crash-restart delay, doubled each attempt up to 60 s (default 1)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "vllm_argv",
        nargs=argparse.REMAINDER,
        metavar="-- VLLM_COMMAND ...",
        help="the vLLM command line; with a speculative config it is the SD-on profile",
    )


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _check_args(args: argparse.Namespace) -> list[str]:
    argv = list(args.vllm_argv or [])
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise ConfigError("missing vLLM command line: sd-controller launch [options] -- python -m vllm...")
    for name in ("drain_s", "ready_timeout_s", "crash_backoff_s"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0")
    if args.max_crash_restarts < 0:
        raise ConfigError("--max-crash-restarts must be >= 0")
    if not 0 <= args.admin_port <= 65535:
        raise ConfigError("--admin-port must be in 0..65535")
    return argv


def run(args: argparse.Namespace) -> int:
    """Run the launcher until SIGTERM/SIGINT; exit with the child's status."""
    configure_logs(level=args.log_level)
    try:
        vllm_argv = _check_args(args)
        token = read_admin_token(args.admin_token_file, args.insecure_no_token)
        profile = parse_profile(vllm_argv)
        url = args.vllm_url.rstrip("/") if args.vllm_url else vllm_url(profile.base_argv)
        grace_s = shutdown_timeout_s(profile.base_argv)
        persisted = load_state(args.state_file) if args.initial_state == "last" else None
        initial = initial_config(args.initial_state, profile, persisted)
    except InputError as exc:
        print(f"sd-controller launch: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if token is None and not _is_loopback(args.admin_host):
        log.warning("admin_api_without_token", admin_host=args.admin_host)

    options = SupervisorOptions(
        vllm_url=url,
        ready_timeout_s=args.ready_timeout_s,
        stop_grace_s=grace_s if grace_s is not None else args.drain_s,
        max_crash_restarts=args.max_crash_restarts,
        crash_backoff_s=args.crash_backoff_s,
        state_file=Path(args.state_file),
    )
    supervisor = Supervisor(profile, initial, options)
    try:
        server = AdminServer((args.admin_host, args.admin_port), supervisor, token)
    except OSError as exc:
        print(
            f"sd-controller launch: cannot bind admin API {args.admin_host}:{args.admin_port}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return EXIT_USAGE

    signals: list[str] = []

    def on_signal(signum: int, _frame: object) -> None:
        # No logging here: the signal may land inside a log write on this thread, whose lock
        # the handler would then wait on forever. Logged once the main loop sees it.
        signals.append(signal.Signals(signum).name)
        supervisor.shutdown()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    server.start()
    log.info(
        "launcher_started",
        admin_url=server.url,
        vllm_url=url,
        initial=initial.to_json(),
        sd_available=profile.sd_available,
        auth=token is not None,
        stop_grace_s=options.stop_grace_s,
    )
    result: dict[str, int] = {}
    worker = threading.Thread(target=lambda: result.update(code=supervisor.run()), name="supervisor")
    worker.start()
    # join() with a timeout keeps the main thread responsive to signals.
    logged = 0
    while worker.is_alive():
        worker.join(0.5)
        for name in signals[logged:]:
            log.info("launcher_signal", signal=name)
        logged = len(signals)
    server.stop()
    code = result.get("code", EXIT_RUNTIME)
    log.info("launcher_exit", exit_status=code)
    return code
