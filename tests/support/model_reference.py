"""Reference outputs of the latency model on a grid: what tests/test_model_reference.py checks.

tests/fixtures/model-reference.json was written by this module's ``main`` with the model as it
was *before* the curve build was rewritten for speed (commit 9e34608 on main):

    PYTHONPATH=$PWD python -m tests.support.model_reference

Rewrite it only for a deliberate change of the model's results (and say so in the commit). The
truth calibration's three cases were last rewritten when that file was re-measured (stop 29: the
draft fitted with each row weighted by the target's error on it; the model did not change, the
other 36 cases are as they were). The model's results were last rewritten at stop 59, when the
token budget's limit came to count the decoders by Little's law with the step its prompts make
(not the fluid batch), to price a full step's later prompts the sharing gap less than its first,
and to cap the chain's rates (``model._budget_limit``): 13 of the 39 cases move (those whose
curves the budget limits), their limits by +0.06 … +11 % (median +4.2 %), latencies at or below
0.8 of the limit by 4e-6 at the median of those that move, 0.9 % at the 90th percentile and 11 %
at most, break-even rates by −9.2 … +0.7 %; the other cases' break-even rates move within
``BREAK_EVEN_REL_TOL`` (the crossing's first step came from the grid). Before that at stop 58, when the
queue past a full batch of max_num_seqs came to hold (1 + C_s²)/2 times the memoryless chain's
(``queueing.queue_variability``, C_s the generated lengths' CV): 23 of the 39 cases move (those
with a length spread other than exponential where max_num_seqs bounds the batch); latencies at
or below 0.8 of the limit by 1e-6 at the median of those that move, 0.3 % at the 90th
percentile and 1.4 % at most; no limit moves, and points near a limit move by up to 81 %.
Before that at stop 57, when of
the others in a request's batch only the share φ that is past its prompt came to pay the
decoders' tokens in τ(B) (``model.decoding_share``): 27 of the 39 cases move (those with
prompts); latencies at or below 0.8 of the limit by 0.04 % at the median of those that move,
0.5 % at the 90th percentile and 5.6 % at most; limits rise by 0.22 % at the median (−0.11 …
+1.57 %), so points near a limit move by more. Before that at stop 52, when a
prompt's marginal cost Δ(B) came to be averaged over eight equal-probability bins of the prompt
lengths (``model.PROMPT_KNEE_BINS``) instead of three Gauss–Hermite nodes, which miss a knee's
mean by up to 4 %: 21 of the 39 cases move (those with a prompt spread), latencies at or below
0.8 of the limit by 0.03 % at the median of those that move and 1.3 % at most, limits by 0.07 %
at the median and 0.19 % at most (points near a limit by more; one break-even rate 9 %, at 0.21
req/s). Before that at stop 50, when the
latency came to be read from the chain with arrivals in bursts where a workload has prompts
(``queueing.burst_time_in_system``: the others' prompts as stalls at λ, the own prefill as a
delay) and the prompts sharing a step came to be counted by the branching process: 33 of the 39
cases move (every one with prompts). Latencies at or below 0.8 of the limit move by 0.006 % at
the median, 1.1 % at the 90th percentile and 38 % at most; limits by up to 0.76 % (the sharing
count), so points at 0.999 of a limit moved by up to 7×. Before that at stop 42, when a step
of a request's life, in the count of the prompts around the step in flight, came to be taken no
longer than twice the wait for the step in flight (with a request of one step, a 1-token prompt
and 1 token, its whole life was taken for a step, and the limit rose past what its prompts alone
allow): the 1-token cases' limits fall 2.5 %, points near them more; other cases move by float
noise (1e-8) and no stored fidelity figure moves. Before that at stop 41, when the
chain came to count the prompts around the step in flight (λ·Δ·(wait − the life's mean step) per
state) and a full cache without prefix caching came to pay for the chunks a prompt stranded
between them discards (``model.stuck_chunks``): 33 of the 39 cases move (every one with
prompts), latencies by 0.03 % at the median and 2.7 % at the 90th percentile (24 % at the 99th,
near limits), limits by 0.05 % at the median and up to 24 %. Before that, when prompts longer
than the step budget leaves beside the batch came to be priced as chunks over several steps
(stop 34: ``model.chunking_excess``; 11 of the 39 cases move: on 8192-token budgets by up to
1.1 %, where 2000-token prompts spread by 1500 reach past the room; on the 2048-token budget's
three cases most, up to 2.3× at points near a limit that the chunks lower; two of them again
when the token-budget and KV-thrash limits came to price the chunks too), and a request alone
at zero load became the chain's first state; before that, when
the wait for the step in flight came to count prompts bunching in steps (stop 32: a step's prompts are the
arrivals of the step before, so long steps breed long steps; ``model.bunched_wait_excess``);
before that, when prompts arriving during one step came to share the next (the chain's states price each prompt at the Poisson
mean of a shared step's cost; the limit and the drain rise with them); before that, when an arrival's wait for the step in flight became length-weighted
(E[S²]/2E[S]: a step that carries a prompt is Δ longer), and when the mean latency became the
batch's birth–death chain (controller/queueing.py). The
grid: the shipped calibrations and variants of them that reach every branch of the curve build
(load-test scales and intervals, MoE, schema-1 verify/prefill fits, n-gram drafting, a small
batch bound and token budget), workloads from empty to 4k-token prompts, rates from zero to past
the stability limits, acceptances and draft lengths 1..16.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from controller import model as M
from controller.calibration import load
from controller.model import LatencyModel, Moe, StepCost, Workload

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "model-reference.json"
DATA = Path(__file__).resolve().parent.parent.parent / "controller" / "data"

POINT_FIELDS = (
    "latency_off_s", "latency_on_s", "batch_off", "batch_on", "stability_limit_off_rps",
    "stability_limit_on_rps", "speedup", "accepted_length", "latency_off_lo_s", "latency_off_hi_s",
    "latency_on_lo_s", "latency_on_hi_s", "speedup_lo", "speedup_hi",
)  # fmt: skip


def _cost(d: dict) -> StepCost:
    return StepCost(
        d["intercept_s"],
        d["slope_s_per_token"],
        tuple(d.get("knees_tokens", ())),
        tuple(d.get("knee_slope_deltas", ())),
        d.get("context_s_per_token", 0.0),
        d.get("seq_s", 0.0),
        d.get("pair_s", 0.0),
    )


def build_model(spec: dict) -> LatencyModel:
    """A shipped calibration's model with the fields in ``spec["replace"]`` replaced."""
    m = load(DATA / spec["calibration"]).latency_model()
    changes = {}
    for name, value in spec.get("replace", {}).items():
        if name in ("target", "draft", "verify", "prefill") and value is not None:
            value = _cost(value)
        elif name == "moe" and value is not None:
            value = Moe(*value)
        changes[name] = value
    return replace(m, **changes)


KNEED = {
    "intercept_s": 0.008,
    "slope_s_per_token": 2e-5,
    "knees_tokens": [48.0, 600.0],
    "knee_slope_deltas": [3e-5, -1e-5],
    "context_s_per_token": 3e-8,
    "seq_s": 1e-5,
    "pair_s": 1e-9,
}
MODELS = [
    {"calibration": "example-calibration.json"},
    {"calibration": "truth-calibration.json"},
    {
        "calibration": "example-calibration.json",
        "replace": {"scale_off": 1.07, "scale_on": 1.12, "relative_sd_off": 0.04, "relative_sd_on": 0.06},
    },
    {"calibration": "example-calibration.json", "replace": {"moe": [8, 2]}},
    {
        "calibration": "example-calibration.json",
        "replace": {
            "verify": {**KNEED, "intercept_s": 0.011},
            "prefill": {
                "intercept_s": 0.004,
                "slope_s_per_token": 1e-4,
                "knees_tokens": [200.0],
                "knee_slope_deltas": [-5e-5],
            },
            "max_num_batched_tokens": None,
            "kv_cache_tokens_on": None,
        },
    },
    {
        "calibration": "example-calibration.json",
        "replace": {
            "draft": {"intercept_s": 0.0, "slope_s_per_token": 0.0},
            "draft_prefills": False,
            "sd_overhead_s": 0.0008,
            "max_num_batched_tokens": None,
            "kv_cache_tokens_off": None,
            "kv_cache_tokens_on": None,
        },
    },
    {
        "calibration": "example-calibration.json",
        "replace": {"target": KNEED, "max_num_seqs": 24, "max_num_batched_tokens": 2048},
    },
]
WORKLOADS = [
    (1000.0, 280.0, 200.0, 500.0),
    (4000.0, 200.0, None, None),
    (300.0, 500.0, 400.0, 100.0),
    (0.0, 100.0, 0.0, None),
    (2000.0, 50.0, 10.0, 1500.0),
    (1.0, 1.0, None, None),
]
RATE_FRACTIONS = (0.0, 0.1, 0.5, 0.8, 0.95, 0.999, 1.5)  # of the lower stability limit
ACCEPTANCE_DRAFTS = ((0.3, 1), (0.7, 4), (0.95, 16), (0.6, 2), (0.8, 8))
BATCHES = (1.0, 7.5, 64.0, 300.0, 5000.0)


def _round(x: float | None) -> float | None:
    # 11 significant digits (5e-12 relative): below the 1e-9 the test asks, half the JSON.
    return x if x is None or not math.isfinite(x) or x == 0.0 else float(f"{x:.11g}")


def compute(spec: dict, wl: tuple, queries: dict | None = None) -> dict:
    """Outputs at one (model, workload); ``queries`` the inputs (None: make them, as ``main`` does)."""
    m, w = build_model(spec), Workload(*wl)
    if queries is None:
        queries = {"points": [], "best": [], "break_even": [], "throughput": []}
        for alpha, gamma in ACCEPTANCE_DRAFTS:
            low = min(M.stability_limits(m, alpha, gamma, w))
            for f in RATE_FRACTIONS:
                queries["points"].append([low * f, alpha, gamma, None])
            queries["points"].append([0.37 * low, alpha, gamma, 1.0 + 0.6 * gamma])  # E[N] given
            queries["best"].append([low * 0.6, alpha])
            queries["break_even"].append([alpha, gamma])
            queries["throughput"].append([alpha, gamma])
        queries["points"].append([2.0, 0.7, 0, None])  # γ = 0: both modes plain decoding
    out = {"queries": queries, "points": [], "best": [], "break_even": [], "throughput": []}
    for rate, alpha, gamma, en in queries["points"]:
        p = M.predict_point(m, rate, alpha, gamma, w, en)
        out["points"].append([_round(getattr(p, f)) for f in POINT_FIELDS])
        s = M.speedup_point(m, rate, alpha, gamma, w) if en is None else None
        out["points"][-1].append(_round(s))
    for rate, alpha in queries["best"]:
        c = M.best_draft_length(m, rate, alpha, w)
        out["best"].append([c.draft_length, _round(c.speedup), _round(c.latency_on_s)])
    for alpha, gamma in queries["break_even"]:
        be = M.break_even_rates(m, alpha, gamma, w)
        out["break_even"].append([[_round(b.rate_rps), b.always_above] for b in be.values()])
    for alpha, gamma in queries["throughput"]:
        out["throughput"].append(
            [_round(M.throughput_at_batch(m, b, sd, alpha, gamma, w)) for sd in (False, True) for b in BATCHES]
        )
    return out


def main() -> None:
    cases = [
        {"model": spec, "workload": list(wl), **compute(spec, wl)}
        for i, spec in enumerate(MODELS)
        for j, wl in enumerate(WORKLOADS)
        if spec["calibration"] != "truth-calibration.json" or j % 2 == 0  # same costs as the example
    ]
    doc = {
        "comment": "Latency-model outputs before the fast curve build; written by "
        "`PYTHONPATH=$PWD python -m tests.support.model_reference` (see that module).",
        "point_fields": [*POINT_FIELDS, "speedup_point"],
        "cases": cases,
    }
    FIXTURE.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    print(f"{FIXTURE}: {len(cases)} cases, {FIXTURE.stat().st_size} bytes")


if __name__ == "__main__":
    main()
