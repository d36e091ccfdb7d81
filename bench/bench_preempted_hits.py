"""Diagnostic: what a preempted request's cached blocks change, on the step simulation.

The fidelity truths recompute a preempted request from scratch. vLLM with prefix caching (its
default) keeps the blocks it had computed cached, and its readmission hits those that were not
evicted since (``ServerSpec.cache_preempted_blocks``). Where a full cache preempts prompts
longer than the step's budget in the middle of their prefill (the L40S truth, 2048-token budget,
4k prompts), the truth without hits wastes the chunks it computed and the model's limit reads
15 % above what it serves. This runs one directory's load test at its rates on both truths (the
same arrivals) and sets each run, and the capacity of each truth's first saturated rate, beside
the model (DIR/calibration.json, given each run's workload as ``validate`` gives it, and told
whether the server caches prefixes as a bench of it records: the recompute priced at 1 + r or
1 + r², model._kv_thrash_rps). Prints figures; asserts nothing.

    python bench/bench_preempted_hits.py bench/results/fidelity-l40s --truth l40s --workload long_prompt \\
        --draft-lengths 0,2,4 --rates 1,1.25,1.5,1.75,2.5
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

from bench_fidelity import TRUTHS  # the truths by name (this script's folder is on the path)

from controller import calibration as cal_mod
from controller.sim import fidelity
from controller.validation import check_row, validate


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="a bench_fidelity.py result directory (its calibration.json)")
    ap.add_argument("--truth", choices=sorted(TRUTHS), required=True, help="the truth the directory was run on")
    ap.add_argument("--workload", default="long_prompt")
    ap.add_argument("--draft-lengths", type=_floats, default=(0.0,), help="0: SD off (default 0)")
    ap.add_argument("--rates", type=_floats, required=True, help="req/s, the last past capacity")
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of arrivals per rate")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    base = cal_mod.load(args.dir / "calibration.json").latency_model()
    truth = TRUTHS[args.truth][0]
    if base.max_num_batched_tokens is not None:
        truth = dataclasses.replace(truth, max_num_batched_tokens=base.max_num_batched_tokens)
    print(f"{args.truth} {args.workload}, {args.duration:.0f} s per rate, seed {args.seed}, calibration {args.dir}")
    for gamma in (int(g) for g in args.draft_lengths):
        load = fidelity.LoadSettings(
            rates=args.rates,
            duration_s=args.duration,
            workloads=(args.workload,),
            draft_lengths=(gamma,),
            seed=args.seed,
        )
        print(f"\n{'SD off' if gamma == 0 else f'γ = {gamma}'}")
        for hits in (False, True):
            with tempfile.TemporaryDirectory() as tmp:
                rows = fidelity.load_test(
                    dataclasses.replace(truth, cache_preempted_blocks=hits), load, args.workload, Path(tmp)
                )
            name = "blocks cached" if hits else "recomputed  "
            # The calibration a bench of this server writes: told by it whether it caches
            # (vllm:cache_config_info), the micro-benchmarks the same (they never preempt).
            model = dataclasses.replace(base, prefix_caching=hits)
            for row in rows:
                check = check_row(model, row)
                pred = "overloaded" if check.predicted_overloaded else f"{check.predicted_s:7.2f} s"
                print(
                    f"  {name} {row.rate:5.2f} req/s: measured {row.mean_e2e_s:7.2f} s"
                    f"{' (saturated)' if row.saturated else '            '}  served {row.served_rps:5.2f}"
                    f"  predicted {pred}"
                )
            (mode,) = validate(model, rows).modes
            fill = "" if mode.limit_cache_fill_rps is None else f"-{mode.limit_cache_fill_rps:.2f}"
            capacity = "-" if mode.limit_served_rps is None else f"{mode.limit_served_rps:.2f}"
            error = "" if mode.capacity_error is None else f" ({mode.capacity_error:+.1%})"
            print(f"  {name} capacity served {capacity}, limit predicted {mode.limit_predicted_rps:.2f}{fill}{error}")


if __name__ == "__main__":
    main()
