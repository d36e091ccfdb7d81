"""``sd-controller backtest``: replay recorded observations through the real decision logic.

Input: a CSV of observations, one row per evaluation (columns ``time_s, arrival_rate_rps,
acceptance_rate, mean_prompt_tokens, mean_gen_tokens, sd_enabled``; empty cells are missing
data). Each row becomes an :class:`~controller.observation.Observation` fed to the unchanged
:class:`~controller.loop.Controller`; the hook applies a change at once and reports the
recorded state otherwise. Prints the decisions it would have taken and the model's predicted
gain; optionally plots them.

Open-loop caveat: history recorded with SD off carries no acceptance (vLLM exports none), and
history with SD on never shows what SD off would have done; the backtest cannot observe the
counterfactual, so its "gain" is the model's prediction, not a measurement.

Reading history straight from Prometheus (query_range with the daemon's own PromQL) is not
implemented yet: export it to this CSV format.
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
from pathlib import Path

from controller.commands._common import EXAMPLE_CALIBRATION, calibration_path, exits_on_input_error
from controller.errors import InputError

COLUMNS = ("time_s", "arrival_rate_rps", "acceptance_rate", "mean_prompt_tokens", "mean_gen_tokens", "sd_enabled")
CAVEAT = (
    "open-loop caveat: acceptance is unobserved while SD was off and the counterfactual state is "
    "never observed; gains are model predictions, not measurements"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--csv", required=True, help=f"observations CSV with columns {', '.join(COLUMNS)}")
    parser.add_argument("--calibration", default=EXAMPLE_CALIBRATION, help="calibration JSON, or 'example'")
    parser.add_argument("--plot", default=None, help="write a PNG of the decisions here")


def read_rows(path: Path) -> list[dict[str, float | None]]:
    try:
        text = path.read_text(encoding="utf-8-sig")
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    reader = csv.DictReader(text.splitlines())
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise InputError(f"{path}: missing column(s) {', '.join(missing)}")
    rows = []
    for line, raw in enumerate(reader, start=2):
        row: dict[str, float | None] = {}
        for c in COLUMNS:
            v = (raw.get(c) or "").strip()
            if v == "" or v.lower() == "nan":
                row[c] = None
                continue
            try:
                row[c] = float(v) if c != "sd_enabled" else float(v.lower() in ("1", "true", "on", "yes"))
            except ValueError:
                raise InputError(f"{path}: row {line}, column {c}: {v!r} is not a number") from None
        if row["time_s"] is None:
            raise InputError(f"{path}: row {line}, column time_s: empty")
        rows.append(row)
    if not rows:
        raise InputError(f"{path}: no rows")
    return rows


class _ReplaySource:
    def __init__(self) -> None:
        self.row: dict | None = None

    def observe(self, now: float):
        from controller.observation import Observation

        r = self.row or {}
        return Observation(
            time_s=now,
            arrival_rate_rps=r.get("arrival_rate_rps"),
            acceptance_rate=r.get("acceptance_rate") if r.get("sd_enabled") else None,
            mean_prompt_tokens=r.get("mean_prompt_tokens"),
            mean_gen_tokens=r.get("mean_gen_tokens"),
            sd_series_present=bool(r.get("sd_enabled")),
            sample_age_s=0.0,
        )


class _ReplayHook:
    """Reports the recorded state; a requested change counts as applied at once."""

    def __init__(self) -> None:
        self.enabled = False

    def request(self, change) -> None:
        self.enabled = change.enabled

    def status(self):
        from controller.hooks.base import HookPhase, HookStatus

        return HookStatus(phase=HookPhase.READY, applied_enabled=self.enabled, applied_draft_length=4)


@exits_on_input_error
def run(args: argparse.Namespace) -> int:
    import structlog
    from prometheus_client import CollectorRegistry

    from controller import calibration
    from controller.loop import Controller
    from controller.sim.runner import default_settings
    from controller.state_store import MemoryStateStore

    rows = read_rows(Path(args.csv))
    model = calibration.load(calibration_path(args.calibration)).latency_model()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    settings = default_settings()
    source, hook = _ReplaySource(), _ReplayHook()
    clock = [0.0]
    ctl = Controller(settings, model, source, hook, lambda: clock[0], CollectorRegistry(), MemoryStateStore())
    print(CAVEAT)
    print(f"{'time_s':>10} {'rate':>7} {'accept':>7} {'recorded':>8} {'speedup':>8} {'action':>8}  reason")
    out = []
    for r in rows:
        clock[0] = float(r["time_s"])  # type: ignore[arg-type]
        source.row = r
        if r["sd_enabled"] is not None and not ctl.state.pending:
            hook.enabled = bool(r["sd_enabled"]) if not out else hook.enabled
        res = ctl.tick()
        a = res.assessment
        sp = a.predicted_speedup if a is not None else math.nan
        out.append((clock[0], r["arrival_rate_rps"], sp, res.decision.action.value, hook.enabled))
        print(
            f"{clock[0]:>10.0f} {_f(r['arrival_rate_rps']):>7} {_f(r['acceptance_rate']):>7} "
            f"{'on' if r['sd_enabled'] else 'off':>8} {_f(sp):>8} {res.decision.action.value:>8}  {res.decision.reason.value}"
        )
    toggles = sum(1 for o in out if o[3] != "none")
    print(f"{len(out)} evaluations, {toggles} changes the controller would have made")
    print(CAVEAT)
    if args.plot:
        _plot(out, Path(args.plot))
        print(f"wrote {args.plot}")
    return 0


def _f(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f}"


def _plot(out, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [o[0] / 3600 for o in out]
    fig, axes = plt.subplots(3, 1, figsize=(10, 7), sharex=True)
    axes[0].plot(t, [o[1] if o[1] is not None else float("nan") for o in out])
    axes[0].set_ylabel("req/s")
    axes[1].plot(t, [min(o[2], 3) for o in out], color="C2")
    axes[1].set_ylabel("predicted speedup")
    axes[2].step(t, [1 if o[4] else 0 for o in out], where="post", color="C1")
    axes[2].set_ylabel("SD (controller)")
    axes[2].set_xlabel("hours")
    fig.suptitle("backtest (" + CAVEAT[:60] + "...)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
