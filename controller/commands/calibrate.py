"""``sd-controller calibrate``: fit step costs from a micro-benchmark CSV into a calibration file."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from controller import calibration as cal_mod
from controller.commands._common import exits_on_input_error
from controller.errors import EXIT_OK, InputError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "bench_csv",
        type=Path,
        nargs="+",
        help="micro-benchmark CSV(s) from sd-controller bench (e.g. SD off, SD at γ=2, SD at γ=4): "
        + ",".join((*cal_mod.BENCH_COLUMNS, *cal_mod.BENCH_OPTIONAL_COLUMNS)),
    )
    p.add_argument("--load-test", type=Path, help="load-test CSV: " + ",".join(cal_mod.LOAD_COLUMNS))
    p.add_argument(
        "--correct-with-load-test", action="store_true", help="scale each mode's step costs to fit the load test"
    )
    p.add_argument("-o", "--output", type=Path, required=True, help="calibration JSON to write")
    p.add_argument(
        "--warmup", type=int, default=cal_mod.DEFAULT_WARMUP, help="iterations dropped per group (default %(default)s)"
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=256, help="vLLM --max-num-seqs of the server (default %(default)s)"
    )
    p.add_argument(
        "--max-num-batched-tokens", type=int, help="vLLM --max-num-batched-tokens (the per-step token budget), if set"
    )
    p.add_argument(
        "--prefix-caching",
        choices=("on", "off"),
        help="vLLM --enable-prefix-caching of the server, instead of what the bench read from its /metrics (a bench"
        " from before it did, or a server relaunched since); prices the recompute after a preemption at a full KV"
        " cache",
    )
    p.add_argument("--moe-experts", type=int, help="MoE target: number of experts E")
    p.add_argument("--moe-top-k", type=int, help="MoE target: experts per token k")
    for name in ("gpu", "target-model", "draft-model", "vllm-version", "notes"):
        p.add_argument(f"--{name}", default="", help=f"metadata: {name.replace('-', ' ')}")


@exits_on_input_error
def run(args: argparse.Namespace) -> int:
    if args.warmup < 0:
        raise InputError(f"--warmup: {args.warmup} must be >= 0")
    if not 1 <= args.max_num_seqs <= 65536:
        raise InputError(f"--max-num-seqs: {args.max_num_seqs} must be within [1, 65536]")
    if args.max_num_batched_tokens is not None and not 16 <= args.max_num_batched_tokens <= 1_048_576:
        raise InputError(f"--max-num-batched-tokens: {args.max_num_batched_tokens} must be within [16, 1048576]")
    for source in (*args.bench_csv, *([args.load_test] if args.load_test else [])):
        if args.output.exists() and source.exists() and args.output.samefile(source):
            raise InputError(f"-o {args.output}: is an input ({source}); name another file")
    if (args.moe_experts is None) != (args.moe_top_k is None):
        raise InputError("--moe-experts and --moe-top-k go together")
    if args.correct_with_load_test and not args.load_test:
        raise InputError("--correct-with-load-test needs --load-test")
    moe = None
    if args.moe_experts is not None:
        if not 1 <= args.moe_top_k <= args.moe_experts:
            raise InputError("--moe-top-k must be between 1 and --moe-experts")
        moe = cal_mod.MoeSpec(num_experts=args.moe_experts, top_k=args.moe_top_k)
    rows, digest = cal_mod.read_bench_csvs(args.bench_csv)
    load_rows, load_digest = (None, "")
    if args.load_test:
        load_rows, load_digest = cal_mod.read_load_csv(args.load_test)
    meta = cal_mod.Metadata(
        gpu=args.gpu, target_model=args.target_model, draft_model=args.draft_model,
        vllm_version=args.vllm_version, notes=args.notes,
        source_file=",".join(p.name for p in args.bench_csv), source_sha256=digest,
        load_test_file=args.load_test.name if args.load_test else "", load_test_sha256=load_digest,
    )  # fmt: skip
    cal = cal_mod.calibrate(
        rows, warmup=args.warmup, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, moe=moe, load_rows=load_rows,
        correct=args.correct_with_load_test, metadata=meta, where=",".join(map(str, args.bench_csv)),
        prefix_caching=None if args.prefix_caching is None else args.prefix_caching == "on",
    )  # fmt: skip
    cal_mod.save(cal, args.output)
    print_report(cal, Console(width=max(Console().width, 130)))
    print(f"wrote {args.output}")
    return EXIT_OK


def _fmt(x: float | None, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def print_report(cal: cal_mod.CalibrationFile, console: Console) -> None:
    """Fit quality per phase and segment, then the load-test check if there was one."""
    table = Table(title="fit quality per phase (after warm-up)")
    for col in (
        "phase",
        "segment (tokens/step)",
        "n",
        "R²",
        "RMSE ms",
        "intercept ms",
        "µs/token",
        "ns/KV token",
        "notes",
    ):
        table.add_column(col)
    for name in ("target", "draft", "prefill", "verify"):
        spec = getattr(cal.phases, name)
        fit = spec.fit if spec is not None else None
        if fit is None:
            continue
        slope = spec.slope_s_per_token
        for i, seg in enumerate(fit.segments or []):
            if i > 0:
                slope += spec.knees[i - 1].slope_delta_s_per_token
            table.add_row(
                name if i == 0 else "",
                f"{seg.from_tokens:g}-{seg.to_tokens:g}",
                str(seg.n),
                _fmt(seg.r2),
                f"{seg.rmse_s * 1e3:.3f}",
                f"{spec.intercept_s * 1e3:.3f}" if i == 0 else "",
                f"{slope * 1e6:.3f}",
                f"{spec.context_s_per_token * 1e9:.3f}" if i == 0 else "",
                "; ".join(fit.notes) if i == 0 else "",
            )
        if not fit.segments:
            table.add_row(name, "-", "0", "-", "-", "0", "0", "0", "; ".join(fit.notes))
    console.print(table)
    sv, unc = cal.serving, cal.uncertainty
    console.print(
        f"SD step overhead {cal.phases.sd_overhead_s * 1e3:.3f} ms; KV cache {sv.kv_cache_tokens_off or '-'} tokens"
        f" (SD off) / {sv.kv_cache_tokens_on or '-'} (SD on), prefix caching"
        f" {'-' if sv.prefix_caching is None else 'on' if sv.prefix_caching else 'off'}; step-cost error ±{unc.relative_sd_off * 100:.1f} % off,"
        f" ±{unc.relative_sd_on * 100:.1f} % on (1σ, carried to prediction intervals)"
    )
    if cal.load_check:
        lc = cal.load_check
        console.print(
            f"load test: {lc.n} rows, R² {_fmt(lc.r2, '.3f')} (off {_fmt(lc.r2_off, '.3f')}, on {_fmt(lc.r2_on, '.3f')}),"
            f" mean abs error {lc.mean_abs_pct_error:.1f}%; paper's C1/(1 − rate·C2) per curve: R² {_fmt(lc.paper_fit_r2, '.3f')}"
            + (
                f"; corrected: scale_off {cal.load_correction.scale_off:.3f}, scale_on {cal.load_correction.scale_on:.3f}"
                if lc.corrected
                else ""
            )
        )
