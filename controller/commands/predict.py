"""``sd-controller predict``: what-if table of SD speedup vs arrival rate and draft length."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from controller import calibration as cal_mod
from controller.acceptance import alpha_from_vllm_rate, vllm_rate_from_alpha
from controller.commands._common import (
    check_plot_path,
    exits_on_input_error,
    finite_float,
    finite_or_none,
    float_list,
    int_list,
    save_plot,
)
from controller.errors import EXIT_OK, InputError
from controller.model import (
    DEFAULT_DRAFT_LENGTHS,
    DEFAULT_THRESHOLDS,
    LatencyModel,
    Workload,
    best_draft_length,
    break_even_rates,
    curves,
    predict_point,
)
from controller.shipped import calibration_path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--calibration", default="example", help="calibration JSON, or 'example' for the shipped example (default)"
    )
    acc = p.add_mutually_exclusive_group()
    acc.add_argument(
        "--acceptance-rate",
        type=finite_float,
        default=0.6,
        help="vLLM's acceptance rate (accepted/drafted tokens), default %(default)s",
    )
    acc.add_argument("--alpha", type=finite_float, help="per-token acceptance α instead of vLLM's rate")
    p.add_argument(
        "--measured-draft-length",
        type=int,
        default=4,
        help="draft length the acceptance rate was measured at (default %(default)s)",
    )
    p.add_argument("--prompt-tokens", type=finite_float, default=512, help="mean prompt tokens (default %(default)s)")
    p.add_argument("--gen-tokens", type=finite_float, default=256, help="mean generated tokens (default %(default)s)")
    p.add_argument(
        "--cached-prompt-tokens",
        type=finite_float,
        default=0.0,
        help="prompt tokens per request served from vLLM's prefix cache, e.g. a shared system prompt "
        "(vllm:prompt_tokens_cached_total / requests; default %(default)s)",
    )
    p.add_argument(
        "--rates",
        type=float_list("--rates"),
        default=[1, 2, 4, 8, 16],
        help="arrival rates, req/s (default 1,2,4,8,16)",
    )
    p.add_argument(
        "--draft-lengths",
        type=int_list("--draft-lengths"),
        default=[2, 4, 8, 16],
        help="draft lengths to tabulate (default 2,4,8,16)",
    )
    p.add_argument(
        "--candidates",
        type=int_list("--candidates"),
        default=list(DEFAULT_DRAFT_LENGTHS),
        help="draft lengths searched for the best (default 1..16)",
    )
    p.add_argument(
        "--gen-tokens-std",
        type=finite_float,
        help="standard deviation of generated tokens (default: equal to the mean, geometric lengths)",
    )
    p.add_argument("--max-num-seqs", type=int, help="override the calibration's max_num_seqs")
    p.add_argument("--plot", type=Path, help="write speedup-vs-rate curves (an image: .png, .svg, .pdf, …)")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON instead of tables")


@exits_on_input_error
def run(args: argparse.Namespace) -> int:
    if args.alpha is not None and not 0 <= args.alpha <= 1:
        raise InputError(f"--alpha: {args.alpha} must be within [0, 1]")
    if args.alpha is None and not 0 <= args.acceptance_rate <= 1:
        raise InputError(f"--acceptance-rate: {args.acceptance_rate} must be within [0, 1]")
    if args.measured_draft_length < 1:
        raise InputError("--measured-draft-length must be >= 1")
    if args.prompt_tokens < 0 or args.gen_tokens < 1:
        raise InputError("--prompt-tokens must be >= 0 and --gen-tokens >= 1")
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        raise InputError("--max-num-seqs must be >= 1")
    if not 0 <= args.cached_prompt_tokens <= args.prompt_tokens:
        raise InputError(f"--cached-prompt-tokens: {args.cached_prompt_tokens:g} must be within [0, --prompt-tokens]")
    check_plot_path("--plot", args.plot)
    path = calibration_path(args.calibration)
    cal = cal_mod.load(path)
    model = cal.latency_model(args.max_num_seqs)
    if args.alpha is not None:
        alpha = args.alpha
        rate = float(vllm_rate_from_alpha(alpha, args.measured_draft_length))
    else:
        rate = args.acceptance_rate
        alpha = float(alpha_from_vllm_rate(rate, args.measured_draft_length))
    if args.gen_tokens_std is not None and args.gen_tokens_std < 0:
        raise InputError("--gen-tokens-std must be >= 0")
    try:
        workload = Workload(
            args.prompt_tokens, args.gen_tokens, args.gen_tokens_std, cached_prompt_tokens=args.cached_prompt_tokens
        )
        report = build_report(model, alpha, workload, args.rates, args.draft_lengths, args.candidates)
    except (ValueError, ArithmeticError) as exc:  # lengths far past any server's (1e300 tokens)
        raise InputError(f"the model cannot price this workload: {exc}") from None
    report["calibration"] = {"path": str(path), "example": cal.example}
    report["inputs"] = {
        "acceptance_rate": rate,
        "measured_draft_length": args.measured_draft_length,
        "alpha": alpha,
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens,
        "cached_prompt_tokens": args.cached_prompt_tokens,
        "max_num_seqs": model.max_num_seqs,
    }
    if args.plot:
        plot_speedup(model, alpha, workload, args.draft_lengths, args.plot, max(args.rates))
    if args.json:
        json.dump(report, sys.stdout, indent=2, allow_nan=False)
        print()
    else:
        print_tables(report, Console(width=max(Console().width, 110)))
        if args.plot:
            print(f"wrote {args.plot}")
    return EXIT_OK


def build_report(
    model: LatencyModel,
    alpha: float,
    workload: Workload,
    rates: list[float],
    draft_lengths: list[int],
    candidates: list[int],
) -> dict[str, Any]:
    """Every number the table and --json show (JSON-safe: +inf becomes null with a flag)."""
    points = []
    for r in rates:
        for g in draft_lengths:
            p = predict_point(model, r, alpha, g, workload)
            points.append({
                "rate_rps": r, "draft_length": g, "speedup": finite_or_none(p.speedup),
                "accepted_length": p.accepted_length,
                "latency_off_s": finite_or_none(p.latency_off_s), "latency_on_s": finite_or_none(p.latency_on_s),
                "latency_off_interval_s": [finite_or_none(p.latency_off_lo_s), finite_or_none(p.latency_off_hi_s)],
                "latency_on_interval_s": [finite_or_none(p.latency_on_lo_s), finite_or_none(p.latency_on_hi_s)],
                "speedup_interval": [finite_or_none(p.speedup_lo), finite_or_none(p.speedup_hi)],
                "batch_off": p.batch_off, "batch_on": p.batch_on,
                "overloaded_off": p.overloaded_off, "overloaded_on": p.overloaded_on,
            })  # fmt: skip
    best = []
    for r in rates:
        c = best_draft_length(model, r, alpha, workload, candidates)
        best.append({"rate_rps": r, "draft_length": c.draft_length, "speedup": finite_or_none(c.speedup)})
    breaks = []
    limits_on, reasons_on = {}, {}
    limit_off = reason_off = None
    for g in draft_lengths:
        for th, be in break_even_rates(model, alpha, g, workload, DEFAULT_THRESHOLDS).items():
            breaks.append(
                {"draft_length": g, "threshold": th, "rate_rps": be.rate_rps, "always_above": be.always_above}
            )
        off, on = curves(model, alpha, g, workload)
        limits_on[str(g)], reasons_on[str(g)] = on.stability_limit_rps, on.limit_reason
        limit_off, reason_off = off.stability_limit_rps, off.limit_reason
    return {
        "points": points,
        "best_draft_length": best,
        "break_even": breaks,
        "stability_limit_rps": {"off": limit_off, "on": limits_on},
        "stability_limit_reason": {"off": reason_off, "on": reasons_on},
    }


def _cell(x: float | None, spec: str) -> str:
    return "overloaded" if x is None else format(x, spec)


def print_tables(report: dict[str, Any], console: Console) -> None:
    inp = report["inputs"]
    if report["calibration"]["example"]:
        console.print(
            "[bold yellow]EXAMPLE calibration (not measured): calibrate on your own GPU for real decisions[/]"
        )
    console.print(
        f"acceptance rate {inp['acceptance_rate']:.3f} at γ={inp['measured_draft_length']} → per-token α {inp['alpha']:.3f};"
        f" prompt {inp['prompt_tokens']:g} / generated {inp['gen_tokens']:g} tokens; max_num_seqs {inp['max_num_seqs']}"
    )
    t = Table(title="predicted latency with and without SD")
    for col in ("rate req/s", "γ", "speedup", "E[N]", "batch off", "batch on", "latency off s", "latency on s"):
        t.add_column(col, justify="right")
    for p in report["points"]:
        t.add_row(
            f"{p['rate_rps']:g}", str(p["draft_length"]),
            "∞" if p["speedup"] is None else f"{p['speedup']:.3f}", f"{p['accepted_length']:.2f}",
            f"{p['batch_off']:.1f}", f"{p['batch_on']:.1f}",
            _cell(p["latency_off_s"], ".3f"), _cell(p["latency_on_s"], ".3f"),
        )  # fmt: skip
    console.print(t)
    b = Table(title="best draft length per rate")
    for col in ("rate req/s", "best γ", "speedup"):
        b.add_column(col, justify="right")
    for row in report["best_draft_length"]:
        b.add_row(
            f"{row['rate_rps']:g}", str(row["draft_length"]), "∞" if row["speedup"] is None else f"{row['speedup']:.3f}"
        )
    console.print(b)
    e = Table(title="break-even rates (req/s) and stability limits")
    for col in ("γ", "S = 1", "S = 1.05 (disable)", "S = 1.2 (enable)", "limit with SD", "limit without SD"):
        e.add_column(col, justify="right")
    by_g: dict[int, dict[float, dict]] = {}
    for row in report["break_even"]:
        by_g.setdefault(row["draft_length"], {})[row["threshold"]] = row
    lim = report["stability_limit_rps"]
    for g, ths in by_g.items():
        cells = []
        for th in DEFAULT_THRESHOLDS:
            r = ths[th]
            cells.append("never below" if r["always_above"] else f"{r['rate_rps']:.2f}")
        e.add_row(str(g), *cells, f"{lim['on'][str(g)]:.2f}", f"{lim['off']:.2f}")
    console.print(e)


def plot_speedup(
    model: LatencyModel, alpha: float, workload: Workload, draft_lengths: list[int], path: Path, max_rate: float
) -> None:
    """Speedup vs arrival rate per draft length, with the 1.05 and 1.2 thresholds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from controller.model import predict

    p0 = predict_point(model, 0.0, alpha, 1, workload)
    top = max(max_rate, p0.stability_limit_off_rps) * 1.05
    rates = np.linspace(0.0, top, 400)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for g in draft_lengths:
        s = predict(model, rates, alpha, g, workload).speedup
        s = np.where(np.isfinite(s), s, np.nan)  # plot gaps where plain decoding is overloaded
        ax.plot(rates, s, label=f"γ = {g}")
    ax.axhline(1.2, color="green", ls="--", lw=1, label="enable 1.2")
    ax.axhline(1.05, color="red", ls="--", lw=1, label="disable 1.05")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("arrival rate (req/s)")
    ax.set_ylabel("predicted speedup T_off / T_on")
    ax.set_title(f"SD speedup vs load (α = {alpha:.2f}, P = {workload.prompt_tokens:g}, G = {workload.gen_tokens:g})")
    ax.set_ylim(bottom=0)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    save_plot(fig, path, 110)
    plt.close(fig)
