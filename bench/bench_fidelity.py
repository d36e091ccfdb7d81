"""Benchmark: the latency model's fidelity against an independent ground truth.

The truth is the step-level vLLM simulation in controller/sim (stepsim.py, costs from the
roofline in gpu.py: Llama-3.1-8B target, Llama-3.2-1B draft, H100, max_num_seqs 256, 8192-token
step budget). The controller reaches it only as a user reaches a real server: micro-benchmarks
(SD off; SD at γ = 2 and 4; batch sizes every 8) → CSV → ``calibrate``; constant-rate load tests (chat, code, mixed,
long prompts; 600 s per rate) → CSV → ``validate``. Prints per workload and mode the mean and
worst error on the runs that were not saturated, whether every saturated run was predicted
overloaded, stability limits and break-even rates; asserts nothing. About 15 minutes.

    python bench/bench_fidelity.py [--quick] [--out DIR] [--truth h100|a100-coarse|l40s] [--rates 1,2,4]
    python bench/bench_fidelity.py --revalidate bench/results/fidelity-h100   # same runs, this code's model
    python bench/bench_fidelity.py --revalidate DIR --recalibrate BENCH_DIR   # ... and this code's calibrate
    python bench/bench_fidelity.py --reload DIR --truth a100-coarse [--seed 11]   # DIR's load tests, this code's
    python bench/bench_fidelity.py --rebench DIR --truth a100-coarse   # this code's bench and calibrate, DIR's load tests
    python bench/bench_fidelity.py --replicate DIR --truth a100-coarse --seeds 101,102 [--from-fraction 0.7]
    python bench/bench_fidelity.py --refine DIR --truth a100-coarse [--seed 11]   # rates inside the break-evens' brackets
    python bench/bench_fidelity.py --draft-lengths 3,6 --workloads chat,code   # γ the bench never ran
    python bench/bench_fidelity.py --truth a100-coarse --max-num-batched-tokens 2048   # vLLM's A100 default
    python bench/bench_fidelity.py --pool bench/results [--json pooled.json]   # every stored directory, pooled

``--truth a100-coarse`` is a second truth held out from the model's development (gpu.py's
A100_COARSE: another GPU, 128-token GEMM tiles, a slower host); its load tests default to the
rates around its capacity. ``--truth l40s`` is a third (gpu.py's L40S run with vLLM's defaults
for a 48 GB card: a 2048-token step budget, so long prompts span steps, and a KV cache that
fills before 256 sequences do). ``--cache-preempted-blocks`` makes the truth keep a preempted
request's computed blocks cached for its readmission, as vLLM 0.32 does with prefix caching on
(its default); the stored directories recompute, except those named ``-apc``.

Near a limit one run's mean is one draw of a queue that remembers its bursts for minutes (±5–10 %
from arrival seed to arrival seed at 0.9 of capacity). ``--replicate`` runs DIR's load tests again
on other arrival seeds (each mode's rates from ``--from-fraction`` of its highest) into
DIR/replicates/seed<S>/load-<workload>.csv; ``--revalidate`` and the rest then pool the runs at
one rate (controller.validation) and report per rate as well as per run.

A measured break-even is the crossing of the measured speedup interpolated between two rates,
and a truth's default rates are a whole req/s apart where its break-evens lie (4 and 5 on the
A100: a fifth of the rate). ``--refine DIR`` runs SD off and the draft length at rates inside
each bracket wider than 5 % of the rate, on every seed DIR holds, into
DIR/refined/seed<S>/load-<workload>.csv, which the rest pool like replicates; rates refined on
some seed run on the seeds that lack them (replicates added since).

``--pool ROOT`` re-validates every directory under ROOT that holds a calibration and load tests
(this code's model, nothing written) and prints the figures pooled over all of them: the steady
rates and their mean and worst error (apart: the rates of the load tests' own grids and those
``--refine`` added), every rate past 10 %, the saturated rates not flagged, the steady ones called
overloaded, the stability limits and the break-evens; ``--json FILE`` writes them with each
rate's error. The README's pooled figures are this command's.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from controller import calibration as cal_mod
from controller.atomic import write_bytes_atomic
from controller.benchmark.loadtest import rate_rng
from controller.commands.validate import to_dict
from controller.errors import InputError
from controller.sim import fidelity, gpu
from controller.sim.truth_workloads import MIXES
from controller.validation import BREAK_EVEN_STEP, INTERVAL_COVERAGE, ValidationReport, validate

H200_RATES = (1, 2, 3, 4, 5, 6, 8, 12, 14, 16, 17, 18, 19, 20, 21, 22, 24)
L40S_RATES = (0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 3, 4, 4.5, 5, 5.5, 6)
TRUTHS = {
    "h100": (fidelity.TruthServer(gpu=gpu.H100_SXM), (1, 2, 4, 6, 8, 10, 12, 13, 14, 15, 16, 17, 18, 20)),
    "a100-coarse": (fidelity.TruthServer(gpu=gpu.A100_COARSE), (1, 2, 3, 4, 5, 5.5, 6, 6.5, 7, 7.5, 8, 9, 10)),
    # vLLM's API-server defaults below 70 GiB: a 2048-token step budget, so long prompts span
    # steps and a 2048-token chunk never rides beside a batch; a KV cache that fills first.
    "l40s": (fidelity.TruthServer(gpu=gpu.L40S, max_num_batched_tokens=2048), L40S_RATES),
    "h200-smooth": (fidelity.TruthServer(gpu=gpu.H200_SMOOTH), H200_RATES),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="120 s per rate, chat only (a smoke run)")
    ap.add_argument("--out", type=Path, default=Path("fidelity-out"), help="where CSVs and the report go")
    ap.add_argument(
        "--duration",
        type=float,
        default=1800.0,
        help="seconds per load-test rate (near capacity a 600 s run's mean varies by ±10 %% from seed to seed)",
    )
    ap.add_argument("--truth", choices=sorted(TRUTHS), default="h100", help="the simulated server (gpu.py)")
    ap.add_argument("--seed", type=int, default=fidelity.LoadSettings.seed, help="the load tests' arrivals")
    ap.add_argument("--workloads", default=None, help="comma-separated (default: chat,code,mixed,long_prompt)")
    ap.add_argument("--rates", default=None, help="load-test rates, req/s, comma-separated (default: the truth's)")
    ap.add_argument(
        "--draft-lengths",
        default=None,
        help="load-test draft lengths, 0 = SD off, comma-separated (default: 0,2,4); the bench always runs 0, 2 and 4,"
        " so others ask how the calibration carries to a draft length it never measured",
    )
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the truth's step token budget instead of its own (e.g. 2048, vLLM's API-server default on A100s);"
        " the bench and the calibration are told it, as a user would",
    )
    ap.add_argument(
        "--cache-preempted-blocks",
        action="store_true",
        help="the truth keeps a preempted request's computed blocks cached for its readmission, as vLLM with prefix"
        " caching (its default) does; its bench records it and the calibration prices the recompute so"
        " (not with the prefix-group workloads)",
    )
    ap.add_argument(
        "--revalidate",
        type=Path,
        default=None,
        metavar="DIR",
        help="no simulation: validate DIR/load-*.csv against DIR/calibration.json with this code (a model change"
        " on the same runs) and rewrite DIR/fidelity.json",
    )
    ap.add_argument(
        "--recalibrate",
        type=Path,
        default=None,
        metavar="BENCH_DIR",
        help="with --revalidate: first calibrate BENCH_DIR/bench-g*.csv with this code (the bench DIR's calibration"
        " was made from: the same source_sha256) and rewrite DIR/calibration.json",
    )
    ap.add_argument(
        "--reload",
        type=Path,
        default=None,
        metavar="DIR",
        help="run DIR's load tests again (its workloads, draft lengths, duration and rates, from its CSVs; --truth and"
        " --seed as they were made) with this code's load test, check that every row both runs has the same"
        " latencies, rewrite DIR/load-*.csv and re-validate (a change in what the load test records or flags)",
    )
    ap.add_argument(
        "--rebench",
        type=Path,
        default=None,
        metavar="DIR",
        help="run this code's micro-benchmarks on --truth (with --max-num-batched-tokens and --cache-preempted-blocks"
        " as DIR was made) into DIR/bench-g*.csv, calibrate them into DIR/calibration.json and re-validate DIR's"
        " load tests (a change in what the bench measures)",
    )
    ap.add_argument(
        "--replicate",
        type=Path,
        default=None,
        metavar="DIR",
        help="run DIR's load tests again on the arrival seeds --seeds (DIR/replicates/seed<S>/), then re-validate"
        " DIR pooling the runs at one rate",
    )
    ap.add_argument("--seeds", default=None, help="with --replicate: arrival seeds, comma-separated")
    ap.add_argument(
        "--refine",
        type=Path,
        default=None,
        metavar="DIR",
        help="where DIR's runs measured a speedup crossing 1 between two rates more than"
        f" {100 * BREAK_EVEN_STEP:.0f} %% apart, run SD off and that draft length at rates between them (each seed DIR holds:"
        " --seed and its replicates) into DIR/refined/seed<S>/, then re-validate DIR: the measured break-even is"
        " interpolated over a step that short",
    )
    ap.add_argument(
        "--from-fraction",
        type=float,
        default=0.0,
        help="with --replicate: only each mode's rates from this fraction of its highest rate in DIR (where a run's"
        " noise is)",
    )
    ap.add_argument(
        "--pool",
        type=Path,
        default=None,
        metavar="ROOT",
        help="no simulation: re-validate every directory under ROOT holding a calibration.json and load-*.csv"
        " (nothing written) and print the figures pooled over all of them",
    )
    ap.add_argument(
        "--json", type=Path, default=None, metavar="FILE", help="with --pool: the figures and every rate's error"
    )
    args = ap.parse_args()
    if (args.json is not None) and args.pool is None:
        ap.error("--json: only with --pool ROOT")
    if args.pool is not None:
        started = time.monotonic()
        try:
            pooled = _pool(args.pool, lambda line: print(line, file=sys.stderr, flush=True))
        except InputError as exc:
            raise SystemExit(f"bench_fidelity: {exc}") from None
        _print_pool(pooled, args.pool, time.monotonic() - started)
        if args.json is not None:
            write_bytes_atomic(args.json, json.dumps(pooled, indent=1, allow_nan=False).encode())
        return
    if args.recalibrate is not None and args.revalidate is None:
        ap.error("--recalibrate: only with --revalidate DIR")
    if (args.seeds is None) != (args.replicate is None):
        ap.error("--replicate DIR and --seeds go together")
    if args.replicate is not None:
        try:
            seeds = tuple(int(x) for x in args.seeds.split(","))
        except ValueError:
            ap.error(f"--seeds: not a comma-separated list of integers: {args.seeds!r}")
        if not 0.0 <= args.from_fraction <= 1.0:
            ap.error(f"--from-fraction: a fraction in [0, 1], got {args.from_fraction:g}")
        started = time.monotonic()
        try:
            _replicate(args.replicate, TRUTHS[args.truth][0], seeds, args.from_fraction)
            reports = _revalidate(args.replicate)
        except InputError as exc:
            raise SystemExit(f"bench_fidelity: {exc}") from None
        print(
            f"replicated the load tests on seeds {args.seeds} in {time.monotonic() - started:.1f} s: {args.replicate}/"
        )
        _summarize(reports, args.replicate)
        return
    if args.refine is not None:
        _redo(args.refine, "refined the break-evens", lambda: _refine(args.refine, TRUTHS[args.truth][0], args.seed))
        return
    if args.reload is not None:
        _redo(args.reload, "re-ran the load tests", lambda: _reload(args.reload, TRUTHS[args.truth][0], args.seed))
        return
    if args.revalidate is not None:
        recalibrate = args.recalibrate
        _redo(args.revalidate, "re-validated", lambda: recalibrate and _recalibrate(args.revalidate, recalibrate))
        return
    truth, rates = TRUTHS[args.truth]
    if args.max_num_batched_tokens is not None:
        if args.max_num_batched_tokens < 256:
            ap.error(f"--max-num-batched-tokens: a budget of at least 256 tokens, got {args.max_num_batched_tokens}")
        truth = dataclasses.replace(truth, max_num_batched_tokens=args.max_num_batched_tokens)
    if args.cache_preempted_blocks:
        truth = dataclasses.replace(truth, cache_preempted_blocks=True)
    if args.rebench is not None:
        _redo(args.rebench, "re-benched and re-calibrated", lambda: _rebench(args.rebench, truth))
        return
    if args.rates:
        try:
            rates = tuple(float(r) for r in args.rates.split(","))
        except ValueError:
            ap.error(f"--rates: not a comma-separated list of numbers: {args.rates!r}")
    load = fidelity.LoadSettings(duration_s=args.duration, rates=rates, seed=args.seed)
    if args.workloads:
        load = dataclasses.replace(load, workloads=tuple(args.workloads.split(",")))
    if args.draft_lengths:
        try:
            gammas = tuple(int(g) for g in args.draft_lengths.split(","))
        except ValueError:
            ap.error(f"--draft-lengths: not a comma-separated list of integers: {args.draft_lengths!r}")
        if any(g < 0 for g in gammas):
            ap.error(f"--draft-lengths: a draft length is 0 (SD off) or more: {args.draft_lengths!r}")
        load = dataclasses.replace(load, draft_lengths=gammas)
    if args.quick:
        load = fidelity.LoadSettings(duration_s=120.0, rates=(1, 4, 8, 12), workloads=("chat",))
    unknown = [w for w in load.workloads if w not in MIXES]
    if unknown:
        ap.error(
            f"--workloads: unknown {unknown[0]!r} in {','.join(load.workloads)} (expected one of {', '.join(MIXES)})"
        )
    shared = [w for w in load.workloads if any(c.prefix_groups for c, _ in MIXES[w].classes)]
    if args.cache_preempted_blocks and shared:
        ap.error(f"--cache-preempted-blocks: not modelled with prefix groups (workload {shared[0]!r})")
    started = time.monotonic()
    run = fidelity.run(
        truth=truth,
        bench=fidelity.BenchSettings(batch_sizes=fidelity.EVERY_8),
        load=load,
        workdir=args.out,
        log=lambda m: print(f"  {m}", flush=True),
    )
    print(f"done in {time.monotonic() - started:.0f} s; CSVs and calibration.json in {args.out}/")
    _summarize(run.reports, args.out)


def _redo(workdir: Path, done: str, step: Callable[[], object]) -> None:
    """``step`` on a stored directory, then re-validate it and print the summary; a bad input
    is one line (what is wrong and where)."""
    started = time.monotonic()
    try:
        step()
        reports = _revalidate(workdir)
    except InputError as exc:
        raise SystemExit(f"bench_fidelity: {exc}") from None
    print(f"{done} in {time.monotonic() - started:.1f} s: {workdir}/")
    _summarize(reports, workdir)


def _rebench(workdir: Path, truth: fidelity.TruthServer) -> None:
    """This code's micro-benchmarks on ``truth`` into ``workdir``'s bench CSVs and calibration;
    its load tests stay as they were run."""
    if not sorted(workdir.glob("load-*.csv")):
        raise InputError(f"{workdir}: no load-*.csv to re-validate")
    cal = fidelity.measure_and_calibrate(truth, fidelity.BenchSettings(batch_sizes=fidelity.EVERY_8), workdir)
    cal_mod.save(cal, workdir / "calibration.json")


def _recalibrate(workdir: Path, bench_dir: Path) -> None:
    """Calibrate the bench CSVs ``workdir``'s calibration was made from with this code, in place."""
    stored = cal_mod.load(workdir / "calibration.json")
    paths = sorted(bench_dir.glob("bench-g*.csv"))
    if not paths:
        raise InputError(f"{bench_dir}: no bench-g*.csv to calibrate")
    rows, digest = cal_mod.read_bench_csvs(paths)
    if digest != stored.metadata.source_sha256:
        raise InputError(
            f"{bench_dir}: its bench CSVs (sha256 {digest[:12]}…) are not the ones {workdir}/calibration.json was"
            f" made from ({stored.metadata.source_sha256[:12]}…)"
        )
    serving = stored.latency_model()
    cal = cal_mod.calibrate(
        rows,
        warmup=0,
        max_num_seqs=serving.max_num_seqs,
        max_num_batched_tokens=serving.max_num_batched_tokens,
        metadata=stored.metadata,
        where=str(bench_dir),
    )
    cal_mod.save(cal, workdir / "calibration.json")


# What a rerun of the same load test must reproduce to the digit (all but the flag it may change).
_REPRODUCED = ("mean_e2e_s", "mean_gen_tokens", "sent", "completed", "mean_e2e_first_half_s", "mean_e2e_second_half_s")


def _typed_rates(path: Path, old: list[dict[str, str]], workload: str, duration: float, seed: int) -> tuple:
    """The rates as the run that wrote ``old`` was given them: --rates gives floats, the truths'
    defaults whole numbers as ints, and the two seed other arrivals (loadtest.rate_rng). Found
    from the requests each row sent, which the workload alone decides."""
    rates = sorted({float(r["rate"]) for r in old})
    sent = {float(r["rate"]): int(r["sent"]) for r in old}
    make = fidelity.truth_requests(workload)
    for typed in (rates, [int(r) if r.is_integer() else r for r in rates]):
        drawn = {float(rate): len(make(rate, duration, rate_rng(seed, i, rate))) for i, rate in enumerate(typed)}
        if drawn == sent:
            return tuple(typed)
    raise InputError(f"{path}: no rates give the requests its rows sent with --seed {seed}: another seed?")


def _stored_load_tests(
    workdir: Path, truth: fidelity.TruthServer, what: str
) -> tuple[list[Path], fidelity.TruthServer]:
    """``workdir``'s load-test CSVs, and the truth with the step budget its calibration was told."""
    csvs = sorted(workdir.glob("load-*.csv"))
    if not csvs:
        raise InputError(f"{workdir}: no load-*.csv to {what}")
    model = cal_mod.load(workdir / "calibration.json").latency_model()
    if model.max_num_batched_tokens is not None:
        truth = dataclasses.replace(truth, max_num_batched_tokens=model.max_num_batched_tokens)
    # A truth that cached a preempted request's blocks said so to its bench (--cache-preempted-blocks).
    return csvs, dataclasses.replace(truth, cache_preempted_blocks=model.prefix_caching)


def _test_duration(path: Path, rows: list[dict[str, str]]) -> float:
    durations = {float(r["duration_s"]) for r in rows}
    if len(durations) != 1:
        raise InputError(f"{path}: rows of several durations ({sorted(durations)}): not one load test")
    return durations.pop()


def _reload(workdir: Path, truth: fidelity.TruthServer, seed: int) -> None:
    """Run ``workdir``'s load tests again with this code; rewrite its CSVs only when every row
    both runs hold reproduces (the same truth and seed) and no rate runs that did not before."""
    csvs, truth = _stored_load_tests(workdir, truth, "run again")
    fresh: dict[Path, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for path in csvs:
            old = list(csv.DictReader(path.open(encoding="utf-8")))
            gammas = tuple(dict.fromkeys(int(r["draft_length"]) for r in old))
            duration, workload = _test_duration(path, old), path.stem.removeprefix("load-")
            load = fidelity.LoadSettings(
                rates=_typed_rates(path, old, workload, duration, seed),
                duration_s=duration,
                workloads=(workload,),
                draft_lengths=gammas,
                seed=seed,
            )
            fidelity.load_test(truth, load, load.workloads[0], Path(tmp))
            text = (Path(tmp) / path.name).read_text(encoding="utf-8")
            new = {(r["draft_length"], r["rate"]): r for r in csv.DictReader(io.StringIO(text))}
            for r in old:
                again = new.pop((r["draft_length"], r["rate"]), None)
                if again is None:
                    continue  # the new flag stopped that mode at a lower rate
                moved = [c for c in _REPRODUCED if again[c] != r[c]]
                if moved:
                    raise InputError(
                        f"{path}: γ={r['draft_length']} at {r['rate']} req/s did not reproduce ({moved[0]}"
                        f" {r[moved[0]]} -> {again[moved[0]]}): another truth or --seed than it was made with?"
                    )
            if new:
                raise InputError(f"{path}: the rerun ran rates the old one had not: {sorted(new)}")
            fresh[path] = text
    for path, text in fresh.items():  # nothing is rewritten unless every file reproduced
        path.write_text(text, encoding="utf-8")


def _replicate(workdir: Path, truth: fidelity.TruthServer, seeds: tuple[int, ...], from_fraction: float) -> None:
    """``workdir``'s load tests on other arrival seeds, each mode from ``from_fraction`` of its
    highest rate, into ``workdir/replicates/seed<S>/load-<workload>.csv`` (written whole, per file)."""
    csvs, truth = _stored_load_tests(workdir, truth, "replicate")
    for path in csvs:
        old = list(csv.DictReader(path.open(encoding="utf-8")))
        duration, workload = _test_duration(path, old), path.stem.removeprefix("load-")
        by_gamma: dict[int, list[float]] = {}
        for r in old:
            by_gamma.setdefault(int(r["draft_length"]), []).append(float(r["rate"]))
        for seed in seeds:
            parts = []
            with tempfile.TemporaryDirectory() as tmp:
                for gamma, rates in by_gamma.items():
                    top = max(rates)
                    load = fidelity.LoadSettings(
                        rates=tuple(r for r in rates if r >= from_fraction * top),
                        duration_s=duration,
                        workloads=(workload,),
                        draft_lengths=(gamma,),
                        seed=seed,
                    )
                    fidelity.load_test(truth, load, workload, Path(tmp))
                    parts.append((Path(tmp) / path.name).read_text(encoding="utf-8").splitlines())
            out = workdir / "replicates" / f"seed{seed}" / path.name
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(_joined_csv(parts))


def _joined_csv(parts: list[list[str]]) -> str:
    """Load-test CSVs' lines as one file: the first's header, then every file's rows."""
    return "\n".join([parts[0][0], *(line for part in parts for line in part[1:])]) + "\n"


def _refine(workdir: Path, truth: fidelity.TruthServer, seed: int) -> None:
    """Each measured break-even bracket of ``workdir`` wider than BREAK_EVEN_STEP: SD off and
    the draft length at its ``refine_rps`` (validation.refine_rates), on every arrival seed the
    directory holds, into ``workdir/refined/seed<S>/load-<workload>.csv`` (both modes of a seed
    in one file, so validate pairs them). Rates already refined on some seed are run on the
    seeds that lack them (replicates added since); none is run twice on a seed."""
    csvs, truth = _stored_load_tests(workdir, truth, "refine")
    seeds = [seed, *sorted(int(p.name.removeprefix("seed")) for p in workdir.glob("replicates/seed*"))]
    reports = _revalidate(workdir)
    for path in csvs:
        workload = path.stem.removeprefix("load-")
        duration = _test_duration(path, list(csv.DictReader(path.open(encoding="utf-8"))))
        wanted = {be.draft_length: set(be.refine_rps) for be in reports[workload].break_even if be.refine_rps}
        for earlier in workdir.glob(f"refined/seed*/{path.name}"):
            for r in csv.DictReader(earlier.open(encoding="utf-8")):
                if int(r["draft_length"]) > 0:
                    wanted.setdefault(int(r["draft_length"]), set()).add(float(r["rate"]))
        for s in seeds:
            out = workdir / "refined" / f"seed{s}" / path.name
            done = (
                {(int(r["draft_length"]), float(r["rate"])) for r in csv.DictReader(out.open(encoding="utf-8"))}
                if out.exists()
                else set()
            )
            parts = [out.read_text(encoding="utf-8").splitlines()] if out.exists() else []
            kept = len(parts)
            with tempfile.TemporaryDirectory() as tmp:
                for gamma, rates in wanted.items():
                    for g in (0, gamma):
                        todo = tuple(r for r in sorted(rates) if (g, r) not in done)
                        if not todo:
                            continue
                        done |= {(g, r) for r in todo}
                        load = fidelity.LoadSettings(
                            rates=todo, duration_s=duration, workloads=(workload,), draft_lengths=(g,), seed=s
                        )
                        fidelity.load_test(truth, load, workload, Path(tmp))
                        parts.append((Path(tmp) / path.name).read_text(encoding="utf-8").splitlines())
            if len(parts) > kept:
                out.parent.mkdir(parents=True, exist_ok=True)
                write_bytes_atomic(out, _joined_csv(parts).encode("utf-8"))


def _revalidate(workdir: Path) -> dict[str, ValidationReport]:
    """Each workload's load test (with its replicates on other seeds, if any) against the calibration."""
    model = cal_mod.load(workdir / "calibration.json").latency_model()
    csvs = sorted(workdir.glob("load-*.csv"))
    if not csvs:
        raise InputError(f"{workdir}: no load-*.csv to re-validate")
    order = {w: i for i, w in enumerate(fidelity.LoadSettings.workloads)}
    named = sorted(((p.stem.removeprefix("load-"), p) for p in csvs), key=lambda x: (order.get(x[0], len(order)), x[0]))
    reports = {}
    for w, p in named:
        rows = cal_mod.read_load_csv(p)[0]
        for extra in sorted([*workdir.glob(f"replicates/seed*/{p.name}"), *workdir.glob(f"refined/seed*/{p.name}")]):
            rows += cal_mod.read_load_csv(extra)[0]
        reports[w] = validate(model, rows)
    return reports


def _summarize(reports: dict[str, ValidationReport], out: Path) -> None:
    errors, worst, flagged, limits, bes, capacities = [], 0.0, True, [], [], []
    run_errors: list[float] = []
    replicated = any(rep.replicated for rep in reports.values())
    for workload, rep in reports.items():
        print(f"\n{workload}:")
        for m in rep.modes:
            lo, hi = m.limit_measured_rps
            mae = "-" if m.mean_abs_error is None else f"{m.mean_abs_error * 100:.1f} %"
            worst_m = "-" if m.worst_error is None else f"{m.worst_error * 100:+.1f} %"
            print(
                f"  {m.mode:8s} runs {m.runs:2d}{'' if m.points == m.runs else f' at {m.points:2d} rates'}  mean |error| {mae:>7s}  worst {worst_m:>8s}  saturated flagged"
                f" {m.saturated_flagged}/{m.saturated_runs}  called overloaded but steady {m.false_overloads}"
                f"{f' (+{m.metastable_runs} metastable)' if m.metastable_runs else ''}  limit predicted {m.limit_predicted_rps:.2f}"
                f"{'' if m.limit_cache_fill_rps is None else f'-{m.limit_cache_fill_rps:.2f}'} ({m.limit_reason})"
                f" measured ({lo}, {hi})"
                + ("" if m.limit_served_rps is None else f" served {m.limit_served_rps:.2f} ({m.capacity_error:+.1%})")
            )
            if m.limit_error is not None:
                limits.append(abs(m.limit_error))
            if m.capacity_error is not None:
                capacities.append(abs(m.capacity_error))
        for be in rep.break_even:
            between = (
                "" if be.measured_between_rps is None else " (between {:g} and {:g})".format(*be.measured_between_rps)
            )
            print(f"  break-even γ={be.draft_length}: predicted {be.predicted_rps} measured {be.measured_rps}{between}")
            if be.error is not None:
                bes.append(abs(be.error))
        if rep.replicated:
            for pt in rep.points:
                if len(pt.runs) > 1:
                    se = "" if pt.measured_se_s is None else f" ± {pt.measured_se_s:.2f}"
                    print(
                        f"  {pt.mode:8s} at {pt.rate:g} req/s: {len(pt.runs)} runs ({pt.saturated_runs} saturated),"
                        f" measured {'saturated' if pt.measured_s is None else f'{pt.measured_s:.2f}{se} s'},"
                        f" predicted {'overloaded' if pt.predicted_overloaded else f'{pt.predicted_s:.2f} s'}"
                        + ("" if pt.error is None else f" ({pt.error:+.1%}")
                        + ("" if pt.error_in_se is None else f", {pt.error_in_se:+.1f} se")
                        + (", beyond the runs' spread" if pt.beyond_noise else "")
                        + ("" if pt.error is None else ")")
                    )
        errors += [abs(pt.error) for pt in rep.points if pt.error is not None]
        run_errors += [abs(c.error) for c in rep.rows if c.error is not None]
        worst = max([worst, *(abs(pt.error) for pt in rep.points if pt.error is not None)])
        flagged = flagged and rep.saturated_all_flagged
    mae = sum(errors) / len(errors) if errors else math.nan
    unit = "rates (runs at one rate pooled)" if replicated else "runs"
    print(
        f"\nall workloads: {len(errors)} steady {unit}, mean |error| {mae * 100:.1f} %, worst {worst * 100:.1f} %;"
        f" every saturated {unit.split()[0][:-1]} flagged: {'yes' if flagged else 'NO'}; worst stability-limit error"
        f" {max(limits, default=0) * 100:.1f} %; worst break-even error {max(bes, default=0) * 100:.1f} %;"
        f" worst limit error against what a saturated rate served {max(capacities, default=0) * 100:.1f} %"
    )
    if replicated:
        print(
            f"each run alone: {len(run_errors)} steady runs, mean |error| {sum(run_errors) / len(run_errors) * 100:.1f} %,"
            f" worst {max(run_errors) * 100:.1f} %"
        )
    report = {w: to_dict(r) for w, r in reports.items()}
    (out / "fidelity.json").write_text(json.dumps(report, indent=2, allow_nan=False))


PAST = 0.10  # the worst error on a steady rate
BREAK_EVEN_WITHIN = 0.05  # ... and on a break-even


def _pool(root: Path, log: Callable[[str], None]) -> dict:
    """Every stored directory under ``root`` re-validated, pooled: per directory and over all."""
    dirs = sorted(d for d in root.iterdir() if (d / "calibration.json").is_file() and any(d.glob("load-*.csv")))
    if not dirs:
        raise InputError(f"{root}: no directory with a calibration.json and load-*.csv to pool")
    rates: dict[str, float] = {}
    grid: dict[str, bool] = {}  # a rate of the load tests' own grids (else one --refine added)
    past, break_evens, limits, capacities = [], [], [], []
    per_dir, unflagged, overloads = {}, 0, 0
    inside = checked = 0  # runs inside the predicted interval, of those checked
    for d in dirs:
        errors = []
        for workload, rep in _revalidate(d).items():
            inside, checked = inside + rep.interval_coverage[0], checked + rep.interval_coverage[1]
            own = {
                (r.draft_length, round(r.rate, 9))
                for f in (d / f"load-{workload}.csv", *d.glob(f"replicates/seed*/load-{workload}.csv"))
                for r in cal_mod.read_load_csv(f)[0]
            }
            for pt in rep.points:
                if pt.error is None:
                    continue
                key = f"{d.name}/{workload}/{pt.mode}@{pt.rate:g}"
                rates[key] = pt.error
                errors.append(pt.error)
                grid[key] = (pt.runs[0].row.draft_length, round(pt.rate, 9)) in own
                if abs(pt.error) > PAST:
                    se, beyond = pt.error_in_se, pt.beyond_noise
                    past.append(
                        {
                            "rate": key,
                            "error": pt.error,
                            "error_in_se": se,
                            "beyond_noise": beyond,
                            "refined": not grid[key],
                        }
                    )
            for m in rep.modes:
                unflagged += m.saturated_runs - m.saturated_flagged
                overloads += m.false_overloads
                where = f"{d.name}/{workload}/{m.mode}"
                if m.limit_error is not None:
                    limits.append({"mode": where, "error": m.limit_error})
                if m.capacity_error is not None:
                    capacities.append({"mode": where, "error": m.capacity_error})
            for be in rep.break_even:
                if be.error is not None:
                    break_evens.append(
                        {
                            "where": f"{d.name}/{workload}/γ={be.draft_length}",
                            "predicted_rps": be.predicted_rps,
                            "measured_rps": be.measured_rps,
                            "measured_between_rps": be.measured_between_rps,
                            "error": be.error,
                        }
                    )
        per_dir[d.name] = _errors(errors)
        log(f"{d.name}: {len(errors)} steady rates")
    worst = max(rates.values(), key=abs, default=None)

    def worst_first(rows: list[dict]) -> list[dict]:
        return sorted(rows, key=lambda x: -abs(x["error"]))

    return {
        "directories": per_dir,
        "all": _errors(list(rates.values())),
        "grid": _errors([e for k, e in rates.items() if grid[k]]),
        "refined": _errors([e for k, e in rates.items() if not grid[k]]),
        "worst_rate": None if worst is None else next(k for k, e in rates.items() if e == worst),
        "past_10": worst_first(past),
        "saturated_not_flagged": unflagged,
        "steady_called_overloaded": overloads,
        "interval_coverage": {"inside": inside, "runs": checked, "nominal": INTERVAL_COVERAGE},
        "limits": worst_first(limits),
        "capacities": worst_first(capacities),
        "break_evens": worst_first(break_evens),
        "rates": rates,
    }


def _errors(errors: list[float]) -> dict:
    """Count, mean |error|, worst (signed) and mean signed error of some rates' errors."""
    if not errors:
        return {"rates": 0, "mean_abs_error": None, "worst_error": None, "bias": None, "past_10": 0}
    return {
        "rates": len(errors),
        "mean_abs_error": sum(map(abs, errors)) / len(errors),
        "worst_error": max(errors, key=abs),
        "bias": sum(errors) / len(errors),
        "past_10": sum(abs(e) > PAST for e in errors),
    }


def _print_pool(pooled: dict, root: Path, seconds: float) -> None:
    def line(name: str, e: dict) -> str:
        if not e["rates"]:
            return f"  {name:42s} {0:5d}"
        return (
            f"  {name:42s} {e['rates']:5d} {e['mean_abs_error'] * 100:8.2f} % {e['worst_error'] * 100:+8.1f} %"
            f" {e['bias'] * 100:+7.2f} % {e['past_10']:5d}"
        )

    dirs = pooled["directories"]
    print(
        f"pooled {len(dirs)} directories under {root}/ (re-validated with this code in {seconds:.1f} s; nothing written)"
    )
    print(
        f"  {'steady rates (the runs at one rate pooled)':42s} {'rates':>5s} {'mean |err|':>10s} {'worst':>10s} {'bias':>9s} {'>10 %':>5s}"
    )
    for name, e in dirs.items():
        print(line(name, e))
    print(line("all", pooled["all"]))
    print(line("  the load tests' own rates", pooled["grid"]))
    print(line("  rates --refine added", pooled["refined"]))
    # A rate near a limit varies by ±10 % from seed to seed: the mark reads against what
    # the runs' own spread allows (validation.PointCheck.beyond_noise), one run alone unknown.
    beyond = sum(p["beyond_noise"] is True for p in pooled["past_10"])
    alone = sum(p["beyond_noise"] is None for p in pooled["past_10"])
    print(
        f"rates past {PAST:.0%}: {len(pooled['past_10'])} ({beyond} beyond the 95 % band of their runs' spread,"
        f" {alone} with one steady run)"
    )
    for p in pooled["past_10"]:
        se = "" if p["error_in_se"] is None else f", {p['error_in_se']:+.1f} se"
        noise = ", beyond noise" if p["beyond_noise"] else ""
        print(f"  {p['rate']}: {p['error']:+.1%}{se}{noise}{' (refined)' if p['refined'] else ''}")
    print(f"saturated rates not flagged overloaded: {pooled['saturated_not_flagged']}")
    print(f"steady rates called overloaded: {pooled['steady_called_overloaded']}")
    cover = pooled["interval_coverage"]
    if cover["runs"]:
        print(
            f"runs inside the predicted interval: {cover['inside']} of {cover['runs']}"
            f" ({cover['inside'] / cover['runs'] * 100:.1f} %; drawn for {cover['nominal'] * 100:.0f} %)"
        )
    limits, capacities = pooled["limits"], pooled["capacities"]
    if limits:
        outside = sum(x["error"] != 0.0 for x in limits)
        print(
            f"stability limits: {outside} of {len(limits)} modes outside the measured bracket (highest steady rate,"
            f" lowest saturated), worst {limits[0]['error']:+.1%} ({limits[0]['mode']})"
        )
    if capacities:
        mean = sum(abs(x["error"]) for x in capacities) / len(capacities)
        print(
            f"stability limits against what the lowest saturated rate served: {len(capacities)} modes, mean |error|"
            f" {mean:.2%}, worst {capacities[0]['error']:+.1%} ({capacities[0]['mode']})"
        )
    bes = pooled["break_evens"]
    if bes:
        within = sum(abs(b["error"]) <= BREAK_EVEN_WITHIN for b in bes)
        mean = sum(abs(b["error"]) for b in bes) / len(bes)
        print(f"break-evens measured: {len(bes)}, within {BREAK_EVEN_WITHIN:.0%}: {within}, mean |error| {mean:.2%}")
        for b in bes:
            if abs(b["error"]) > BREAK_EVEN_WITHIN:
                between = (
                    ""
                    if b["measured_between_rps"] is None
                    else " between {:g} and {:g}".format(*b["measured_between_rps"])
                )
                print(
                    f"  {b['where']}: predicted {b['predicted_rps']:.3f}, measured {b['measured_rps']:.3f}{between} ({b['error']:+.1%})"
                )


if __name__ == "__main__":
    main()
