"""Diagnostic: where a load-test error comes from, the model's batch against the truth's.

A validated run says only that the mean latency is off. This re-runs one of its points on the
step simulation and sets, side by side, what the truth's step log shows and what the model's
law of requests and step line say: the time split of a request, the law of the
number running (time-weighted), and the decode step's cost at each batch it ran. The model is
the one the pipeline calibrated (DIR/calibration.json from bench_fidelity.py), given the run's
measured workload from DIR/load-WORKLOAD.csv, as ``validate`` gives it; the truth's internals are
read only here, to find which term misses, never to fit one. The model's law is the one with
arrivals in bursts where prompts stall the batch (queueing.burst_law; README *Stop 49*), printed
beside the birth–death chain's it replaced. Prints figures; asserts nothing.

    python bench/bench_batch_law.py bench/results/fidelity-a100-coarse-prefix --truth a100-coarse \\
        --workload system_prompt --draft-length 4 --rate 3
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from pathlib import Path

import numpy as np
from bench_fidelity import TRUTHS  # the truths by name (this script's folder is on the path)

from controller import calibration as cal_mod
from controller import model as model_mod
from controller.queueing import burst_law, burst_ratio_at, stationary_law
from controller.sim.simserver import serve
from controller.sim.stepsim import SimResult, StepView
from controller.sim.truth_workloads import poisson_load
from controller.validation import _alpha

WARMUP_FRACTION = 0.1  # as the load test: the first tenth fills the server
MIN_STEPS = 50  # a batch size's decode steps shown when at least this many ran


def _mean_sd(law: np.ndarray) -> str:
    n = np.arange(law.size)
    mean = float(law @ n) / float(law.sum())
    return f"{mean:.1f} (sd {float(np.sqrt(law @ (n - mean) ** 2 / law.sum())):.1f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="a bench_fidelity.py result directory (calibration.json, load-*.csv)")
    ap.add_argument("--truth", choices=sorted(TRUTHS), required=True, help="the truth the directory was run on")
    ap.add_argument("--workload", required=True)
    ap.add_argument("--draft-length", type=int, default=0, help="0: SD off")
    ap.add_argument("--rate", type=float, required=True, help="req/s: a rate the load CSV has a row for")
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of arrivals")
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args()
    gamma = args.draft_length

    lm = cal_mod.load(args.dir / "calibration.json").latency_model()
    rows, _ = cal_mod.read_load_csv(args.dir / f"load-{args.workload}.csv")
    matches = [r for r in rows if r.draft_length == gamma and abs(r.rate - args.rate) < 1e-9]
    if not matches:
        raise SystemExit(f"bench_batch_law: load-{args.workload}.csv has no row at γ={gamma}, {args.rate:g} req/s")
    row = matches[0]
    curve = model_mod.curves(lm, _alpha(row) if row.sd else 0.5, max(gamma, 1), row.workload())[1 if gamma else 0]

    rng = np.random.default_rng(args.seed)
    truth = TRUTHS[args.truth][0]
    budget = lm.max_num_batched_tokens  # the step budget the directory was run with (--max-num-batched-tokens)
    if budget is not None and budget != truth.max_num_batched_tokens:
        truth = dataclasses.replace(truth, max_num_batched_tokens=int(budget))
    priced = StepPrices(lm, gamma)
    res: SimResult = serve(
        truth.spec(gamma), poisson_load(args.rate, args.duration, args.workload, rng), rng, on_step=priced
    )
    kept = res.arrival_s >= WARMUP_FRACTION * args.duration
    ends = np.cumsum(res.step_s)
    late = ends > WARMUP_FRACTION * args.duration
    dur, seqs, tokens = res.step_s[late], res.step_seqs[late], res.step_tokens[late]
    print(f"{args.truth} {args.workload} γ={gamma} at {args.rate:g} req/s, {args.duration:g} s")
    steps = (res.num_drafts if gamma else res.step_seqs.sum()) / max(res.arrival_s.size, 1)
    print(
        f"truth: mean {res.latency_s[kept].mean():.3f} s (load CSV {row.mean_e2e_s:.3f}): "
        f"to first scheduled {(res.admitted_s - res.arrival_s)[kept].mean():.3f}, first token "
        f"{(res.first_token_s - res.arrival_s)[kept].mean():.3f}, decode "
        f"{(res.finish_s - res.first_token_s)[kept].mean():.3f}; "
        f"{steps:.1f} steps a request, "
        f"{1e3 * np.average(dur, weights=seqs):.1f} ms a step as a request sees it"
    )
    _priced_steps(priced.table()[late])
    limit = curve.stability_limit_rps
    latency = curve.latency_s(args.rate)
    print(
        f"model: mean {latency:.3f} s (fluid fixed point {curve.fluid_latency_s(args.rate):.3f}); "
        f"{curve.steps:.1f} steps a request; limit {limit:.2f} req/s ({curve.limit_reason})"
    )
    if not args.rate < limit:
        return

    chain_law, past = stationary_law(args.rate, curve.cum_log_rates, limit)
    law, past = (chain_law, past) if curve.bursts is None else burst_law(args.rate, curve.bursts, limit)
    running = res.step_running[late]
    truth_law = np.bincount(running, weights=dur) / dur.sum()
    width = max(1, int(np.ceil(max(running.max(), 1) / 16)))
    print(f"\nrequests in the server (time-weighted; the truth's running gauge, the model's chain), width {width}")
    queue = f"with its queue, each past the bound counted {curve.queue_variability:.2f}"  # queueing.queue_variability
    print(f"  truth mean {_mean_sd(truth_law)}, model {_mean_sd(law)} ({queue}: mean {args.rate * latency:.1f})")
    for lo in range(0, int(running.max()) + 1, width):
        t = truth_law[lo : lo + width].sum()
        m = law[lo : lo + width].sum()
        print(f"  {lo:4d}-{lo + width - 1:<4d} truth {t:6.3f}  model {m:6.3f}  {'#' * round(40 * t):40s}|")
    print(f"  past the chain's bound: model {past:.3g}")
    h = np.exp(np.diff(curve.cum_log_rates))  # the chain's h(n), n = 1..
    _bursts(args.rate, curve, chain_law)
    _departures(res, h, law, WARMUP_FRACTION * args.duration, args.duration, steps)

    # The decode (verify) step at each batch it ran alone: the truth against the line and the
    # calibration's staircase residual at those tokens, as the chain prices it.
    per_seq = gamma + 1 if gamma else 1
    table = lm.verify_staircase_on if gamma else lm.decode_staircase_off
    alone = tokens <= seqs * per_seq
    print("\ndecode steps with no prompt: batch, steps, truth ms, model ms (line + staircase), error")
    for b in np.unique(seqs[alone]):
        pick = alone & (seqs == b)
        if pick.sum() < MIN_STEPS:
            continue
        stair = float(model_mod.stair_residual(table, b * per_seq)) if table else 0.0
        # A batch of b decoders runs b − 1 besides each request; the chain's τ(B) decodes 1 + φ·B
        # of B others (the rest compute prompts), so b decoders are about its τ at (b − 1)/φ.
        model_s = curve.step((b - 1.0) / curve.decoding_share) + stair
        truth_s = float(dur[pick].mean())
        print(
            f"  {b:4d} {pick.sum():6d} {1e3 * truth_s:8.2f} {1e3 * model_s:8.2f} {100 * (model_s / truth_s - 1):+6.1f} %"
        )

    # Steps that carried prompt tokens: what they cost over the decode step of the same batch
    # (the truth's own, where it ran alone often enough), per prompt token, against Δ(B) / P.
    decode_ms = {b: float(dur[alone & (seqs == b)].mean()) for b in np.unique(seqs[alone])}
    mixed = ~alone & np.isin(seqs, [b for b in decode_ms if (alone & (seqs == b)).sum() >= MIN_STEPS])
    if mixed.any():
        extra = np.array([d - decode_ms[b] for d, b in zip(dur[mixed], seqs[mixed], strict=True)])
        prompt_tokens = tokens[mixed] - seqs[mixed] * per_seq  # a prefilling sequence's chunk beyond its one token
        computed = row.workload().computed_prompt_tokens
        model_us = np.array([curve.prompt(b - 1.0) for b in seqs[mixed]]) / computed
        print(
            f"\nsteps with prompts: {mixed.sum()} ({mixed.mean() * 100:.0f} % of steps), "
            f"{prompt_tokens.mean():.0f} prompt tokens each; beyond the decode step "
            f"{1e6 * extra.sum() / prompt_tokens.sum():.1f} µs a prompt token, model Δ(B)/P "
            f"{1e6 * float(model_us.mean()):.1f} µs ({computed:.0f} computed tokens a prompt)"
        )
        if not gamma:
            _by_chunk(lm.target, seqs[mixed], prompt_tokens, extra)


def calibrated_step_s(lm: model_mod.LatencyModel, gamma: int, view: StepView) -> float:
    """One step the truth ran, priced by the calibration's passes as ``calibrate`` read its bench
    rows (calibration.target_passes, draft_passes): the target over every token, the KV the
    decoders read and each prompt's own attention; with SD the draft's first pass over the same,
    its γ − 1 single-token passes over the sequences that draft, the step's overhead; and the
    staircase's residual at the decode tokens, of which a step computing prompt tokens keeps
    its tread share (model.prompt_step_tread)."""
    q, ctx, prefill = view.query_tokens, view.context_tokens, view.prefill
    tokens, seqs = float(q.sum()), float(q.size)
    read = float(ctx[~prefill].sum())
    pairs = float((q[prefill] * (ctx[prefill] + 0.5 * q[prefill])).sum())
    t = lm.target.scalar(tokens, read, seqs, pairs)
    per_seq = gamma + 1 if gamma else 1
    if gamma:
        drafting = view.drafting
        t += lm.draft.scalar(tokens, read, seqs, pairs) + lm.sd_overhead_s
        n_draft = float(drafting.sum())
        t += (gamma - 1) * lm.draft.scalar(n_draft, float((ctx + q)[drafting].sum()), n_draft)
    table = lm.verify_staircase_on if gamma else lm.decode_staircase_off
    if table:
        decoders = float((~prefill).sum())
        stair = float(model_mod.stair_residual(table, decoders * per_seq))
        t += stair * (model_mod.prompt_step_tread(lm, float(gamma)) if prefill.any() else 1.0)
    return t


class StepPrices:
    """An ``on_step`` observer: each step the truth ran as four numbers (its noise-free seconds,
    :func:`calibrated_step_s`'s price of it, its decoders, whether it computed prompt tokens),
    priced as it runs: an hour at high load is a million steps, and their per-sequence arrays
    would hold hundreds of MB until the end."""

    def __init__(self, lm: model_mod.LatencyModel, gamma: int) -> None:
        self.lm, self.gamma = lm, gamma
        self._rows: list[tuple[float, float, int, bool]] = []

    def __call__(self, view: StepView) -> None:
        price = calibrated_step_s(self.lm, self.gamma, view)
        self._rows.append((view.seconds, price, int((~view.prefill).sum()), bool(view.prefill.any())))

    def table(self) -> np.ndarray:
        """One row a step, in order: seconds, price, decoders, prompts (1.0 or 0.0)."""
        return np.array(self._rows, dtype=float).reshape(-1, 4)


def _priced_steps(table: np.ndarray) -> None:
    """Every step of the measured window priced by the calibration (:class:`StepPrices`) against
    the truth's noise-free seconds, in all and by decoders, without and with prompts: the
    step's cost apart from how the chain composes steps into a latency."""
    if table.size == 0:
        return
    truth_s, model_s = table[:, 0], table[:, 1]
    decoders, prompts = table[:, 2].astype(int), table[:, 3] > 0.5

    def error(pick: np.ndarray) -> str:
        return f"{100 * (model_s[pick].sum() / truth_s[pick].sum() - 1):+6.2f} %" if pick.any() else "      -"

    everything = np.ones(truth_s.size, dtype=bool)
    print(
        f"\nthe truth's steps priced by the calibration's passes: {truth_s.size} steps, {truth_s.sum():.1f} s,"
        f" error {error(everything)} (decode only {error(~prompts)}, with prompt tokens {error(prompts)},"
        f" {100 * truth_s[prompts].sum() / truth_s.sum():.0f} % of the time)"
    )
    print("  decoders   steps  decode only  with prompts")
    width = max(8, int(np.ceil((decoders.max() + 1) / 8)))
    for lo in range(0, int(decoders.max()) + 1, width):
        band = (decoders >= lo) & (decoders < lo + width)
        if band.sum() >= MIN_STEPS:
            cells = f"{error(band & ~prompts)}     {error(band & prompts)}"
            print(f"  {lo:4d}-{lo + width - 1:<4d} {band.sum():6d}    {cells}")


def _bursts(rate: float, curve: model_mod.ModeCurve, chain_law: np.ndarray) -> None:
    """The terms of the model's law when prompts stall the batch and arrivals come in bursts
    (queueing.burst_law; README *Stop 49*, *Stop 50*), and its mean and sd beside the birth–death
    chain's, which it replaced where the workload has prompts."""
    if curve.bursts is None:
        return
    ratio = float(burst_ratio_at(rate, curve.bursts))
    share = rate * curve.prompt(curve.batch(rate))
    law, _past = burst_law(rate, curve.bursts, curve.stability_limit_rps)
    print(
        f"  bursts (prefill share λ·Δ {share:.3f}, length overlap κ {curve.bursts.overlap:.3f}, "
        f"ratio r {ratio:.3f}): {_mean_sd(law)}; the chain {_mean_sd(chain_law)}"
    )


def departures_by_state(
    arrival_s: np.ndarray, finish_s: np.ndarray, start_s: float, end_s: float
) -> tuple[np.ndarray, np.ndarray]:
    """Over [start, end): the seconds the server held n requests (arrived, not finished) and the
    completions out of n, indexed by n. Their ratio is the departure rate a birth–death chain
    needs in state n to hold the same law (the flow up out of n − 1 equals the flow down out of n)."""
    times = np.concatenate([[start_s], arrival_s, finish_s])
    moves = np.concatenate([[0], np.ones(arrival_s.size, dtype=np.int64), -np.ones(finish_s.size, dtype=np.int64)])
    order = np.argsort(times, kind="stable")
    times, moves = times[order], moves[order]
    after = np.cumsum(moves)  # n from each event to the next
    held = np.clip(np.append(times[1:], np.inf), start_s, end_s) - np.clip(times, start_s, end_s)
    seconds = np.bincount(after, weights=held)
    out = (moves < 0) & (times >= start_s) & (times < end_s)
    done = np.bincount(after[out] + 1, minlength=seconds.size)
    return seconds, done[: seconds.size]


def _departures(res: SimResult, h: np.ndarray, law: np.ndarray, start_s: float, end_s: float, steps: float):
    """Completions a second by requests in the server: the truth's, what its own steps in that
    band give (n over a request's steps times the mean step), and the chain's h(n). The chain's
    h is the step's; where the truth's falls below its own steps' the requests in the server
    are younger than the steps assume (they came in a burst), and its law is wider than the
    chain's."""
    seconds, done = departures_by_state(res.arrival_s, res.finish_s, start_s, end_s)
    n = np.arange(seconds.size)
    mean = float(seconds @ n / seconds.sum())
    sd = float(np.sqrt(seconds @ (n - mean) ** 2 / seconds.sum()))
    ends = np.cumsum(res.step_s)
    late = (ends > start_s) & (ends <= end_s)
    width = max(1, round(sd / 2))
    print(
        f"\nrequests in the server (arrived, not finished): truth mean {mean:.1f} (sd {sd:.1f}), "
        f"chain {_mean_sd(law)}; completions a second by n, width {width}: "
        "share of time, truth, n/(steps·mean step) of the truth's steps there, chain h(n)"
    )
    for lo in range(max(1, int(mean - 3 * sd)), int(mean + 3 * sd) + 1, width):
        band = slice(lo, min(lo + width, seconds.size))
        held = float(seconds[band].sum())
        pick = late & (res.step_running >= lo) & (res.step_running < lo + width)
        if held < 0.01 * seconds.sum() or pick.sum() < MIN_STEPS:
            continue
        at = n[band]
        step_rate = float(seconds[band] @ at) / held / (steps * float(res.step_s[pick].mean()))
        chain = float(seconds[band] @ h[np.minimum(at, h.size) - 1]) / held
        print(
            f"  {lo:4d}-{lo + width - 1:<4d} {held / seconds.sum():6.3f} {done[band].sum() / held:8.2f}"
            f" {step_rate:8.2f} {chain:8.2f}"
        )


def _by_chunk(target: model_mod.StepCost, seqs: np.ndarray, prompt_tokens: np.ndarray, extra: np.ndarray) -> None:
    """SD off: a mixed step's cost beyond the decode step, by its prompt tokens (quartiles),
    against the target's fitted pass for the same tokens at the same batch. The model's pairs
    are one prompt's (x²/2): a step holding several prompts has fewer, so its long bins read
    the model high by their attention."""
    edges = np.quantile(prompt_tokens, [0.0, 0.25, 0.5, 0.75, 1.0])
    print("  by prompt tokens in the step: steps, mean tokens, truth µs a token, the fitted pass's, error")
    for lo, hi in itertools.pairwise(edges):
        pick = (prompt_tokens >= lo) & (prompt_tokens <= hi)
        if not pick.any():
            continue
        x, b = prompt_tokens[pick].astype(float), seqs[pick].astype(float)
        fit = np.array(
            [target.scalar(bi + xi, pairs=0.5 * xi * xi) - target.scalar(bi) for bi, xi in zip(b, x, strict=True)]
        )
        truth_us, fit_us = 1e6 * extra[pick].sum() / x.sum(), 1e6 * fit.sum() / x.sum()
        print(
            f"  {lo:6.0f}-{hi:<6.0f} {pick.sum():6d} {x.mean():7.0f} {truth_us:8.1f} {fit_us:8.1f}"
            f" {100 * (fit_us / truth_us - 1):+6.1f} %"
        )


if __name__ == "__main__":
    main()
