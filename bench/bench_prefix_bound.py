"""Diagnostic: the KV bound with many shared prefixes, on the step simulation.

With prefix-cache hits the model's KV bound divides the cache by the context less the hits
(docs/model.md, "its blocks are held once"), the context capped by the lengths' value. That
leaves out each prefix's one copy, a real share of the cache when many distinct long prefixes
are in use, and vLLM's metrics do not say how many are. This runs chat traffic behind K
prefixes of N tokens on a truth, at a few rates, the last past capacity, and sets the model's
stability limit (from the calibration in DIR, given each run's workload as a load test measures
it) beside what the overloaded run served; and the limit with the bound from the context as
measured (the KV usage per running sequence, hits added back, which spreads the prefixes over
the sequences running then). Prints figures; asserts nothing.

    python bench/bench_prefix_bound.py --truth l40s --case 32x2048:1,3,8 --case 16x6144:0.5,1.5,5
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
from bench_fidelity import TRUTHS  # the truths by name (this script's folder is on the path)

from controller import calibration as cal_mod
from controller.model import Workload, curves
from controller.occupancy import running_context_tokens
from controller.sim import truth_workloads as tw
from controller.sim.simserver import serve

WARMUP_FRACTION = 0.4  # the window starts once the cache has had time to fill


def _case(text: str) -> tuple[int, int, list[float]]:
    try:
        shape, rates = text.split(":")
        groups, tokens = (int(v) for v in shape.split("x"))
        return groups, tokens, [float(r) for r in rates.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--case {text!r}: want GROUPSxTOKENS:RATE,RATE,...") from None


def _band(model, workload: Workload) -> tuple[float, float]:
    return curves(model, 0.5, 1, workload)[0].metastable_band_rps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--truth", default="l40s", choices=sorted(TRUTHS))
    ap.add_argument("--calibration", type=Path, help="default: bench/results/fidelity-TRUTH-prefix/calibration.json")
    ap.add_argument("--case", type=_case, action="append", help="GROUPSxTOKENS:RATES, the last past capacity")
    ap.add_argument("--duration", type=float, default=900.0)
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args()
    cases = args.case or [_case("32x2048:1,3,8"), _case("16x6144:0.5,1.5,5")]
    path = args.calibration or Path(f"bench/results/fidelity-{args.truth}-prefix/calibration.json")
    model = cal_mod.load(path).latency_model()
    spec = TRUTHS[args.truth][0].spec(0)
    kv = spec.kv_tokens()
    print(f"{args.truth}, SD off, KV cache {kv} tokens, {args.duration:.0f} s per rate, calibration {path}")
    for groups, tokens, rates in cases:
        # The fidelity bench's system_prompt chat, behind more and longer prefixes.
        chat = dataclasses.replace(tw.SYSTEM_PROMPT, prefix_tokens=tokens, prefix_groups=groups)
        mix = tw.Mix(f"{groups}x{tokens}", ((chat, 1.0),))
        print(f"\n{groups} prefixes of {tokens} tokens ({groups * tokens / kv:.0%} of the cache)")
        for rate in rates:
            rng = np.random.default_rng(args.seed)
            requests = tw.poisson_load(rate, args.duration, mix, rng)
            res = serve(spec, requests, rng)
            lo, hi = WARMUP_FRACTION * args.duration, args.duration
            inside = (res.step_end_s > lo) & (res.step_end_s < hi)
            w = res.step_s[inside]
            running = float(np.average(res.step_running[inside], weights=w))
            usage = float(np.average(res.step_kv_tokens[inside], weights=w)) / kv
            hits = res.num_cached_tokens / len(requests)
            ctx = running_context_tokens(usage, float(kv), running, spec.block_size, hits)
            served = np.count_nonzero((res.finish_s >= lo) & (res.finish_s < hi)) / (hi - lo)
            wl = Workload(
                float(res.prompt_tokens.mean()), float(res.generated_tokens.mean()),
                float(res.generated_tokens.std()), float(res.prompt_tokens.std()),
                running_context_tokens=ctx, cached_prompt_tokens=hits,
            )  # fmt: skip
            capped = _band(model, wl)
            # The bound as measured (ctx − hits per sequence): the same model with its cache
            # scaled by what the cap leaves out.
            scale = wl.held_context_tokens / max(ctx - wl.cached_tokens, 1.0)
            as_measured = _band(dataclasses.replace(model, kv_cache_tokens_off=model.kv_cache_tokens_off * scale), wl)
            print(
                f"  {rate:5.2f} req/s: served {served:5.2f}  running {running:6.1f}  KV used {usage:5.1%}"
                f"  context {ctx:6.0f} (lengths {wl.mean_context_tokens:5.0f}, hits {hits:5.0f})"
                f"  limit {capped[0]:.2f}-{capped[1]:.2f}, as measured {as_measured[0]:.2f}-{as_measured[1]:.2f}"
            )


if __name__ == "__main__":
    main()
