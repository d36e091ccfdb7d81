"""Prompts longer than the step's token budget leaves beside the batch: chunked over steps."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from controller import calibration
from controller.model import LatencyModel, StepCost, Workload, _mode_terms, chunking_excess, predict_point
from controller.sim import fidelity, stepsim
from controller.sim.demo_truth import truth_calibration_path
from controller.sim.truth_workloads import MIXES

# One knee at 1024 tokens: past it a token costs half as much, so a chunk cut below it is dearer.
KNEED = LatencyModel(
    target=StepCost(0.010, 1.0e-4, (1024.0,), (-5.0e-5,)),
    draft=StepCost(0.001, 4.0e-6),
    max_num_batched_tokens=2048,
)


def target_terms():
    return _mode_terms(KNEED, False, 0.0)


def test_a_fixed_prompt_past_the_room_pays_its_chunks_and_its_steps():
    # State 0: one running sequence, 2047 tokens of room: a 4000-token prompt takes two chunks
    # (2047 + 1953) over two steps.
    per_prompt, extra_steps = chunking_excess(target_terms(), ((1.0, 4000.0),), None, 2048.0, 8.0)

    def g(kb, c):  # the token part of t(kb + c) − t(kb)
        t = lambda x: 1.0e-4 * x - 5.0e-5 * max(0.0, x - 1024.0)  # noqa: E731
        return t(kb + c) - t(kb)

    assert extra_steps[0] == 1.0
    assert per_prompt[0] == pytest.approx(g(1, 2047) + g(1, 1953) - g(1, 4000), rel=1e-12)
    assert per_prompt[0] > 0  # each chunk crosses the knee on its own: dearer than one pass
    # State 7: eight running sequences leave 2040 tokens; still two chunks.
    assert extra_steps[7] == 1.0
    assert per_prompt[7] == pytest.approx(g(8, 2040) + g(8, 1960) - g(8, 4000), rel=1e-12)


def test_prompts_within_the_room_cost_nothing_more():
    assert chunking_excess(target_terms(), ((1.0, 2000.0),), None, 2048.0, 16.0) is None
    # Lognormal prompts of mean 500: not one in 10⁴ reaches 8192 − 256 tokens.
    nodes = Workload(500.0, 100.0, prompt_tokens_std=250.0).prompt_nodes
    assert chunking_excess(target_terms(), nodes, 250.0, 8192.0, 256.0) is None


def test_extra_steps_are_the_lognormal_expectation_of_the_chunks():
    mean, sd = 3000.0, 1500.0
    w = Workload(mean, 100.0, prompt_tokens_std=sd)
    _, extra_steps = chunking_excess(target_terms(), w.prompt_nodes, sd, 2048.0, 64.0)
    s = math.sqrt(math.log1p((sd / mean) ** 2))
    prompts = np.random.default_rng(1).lognormal(math.log(mean) - s * s / 2, s, 400_000)
    for state in (0, 31, 63):
        room = 2048.0 - (state + 1)
        assert extra_steps[state] == pytest.approx(np.mean(np.ceil(prompts / room) - 1.0), rel=0.01)
    assert np.all(np.diff(extra_steps) > 0)  # a fuller batch leaves less room: more steps


@pytest.mark.parametrize("draft_length", [0, 4])
def test_the_model_slows_with_a_smaller_budget_as_the_truth_does(draft_length):
    # The simulated H100 (stepsim) serving 4k-token prompts with vLLM's 8192-token budget and
    # with 2048 (its default on smaller GPUs): the same arrivals, the same step costs; only the
    # scheduler cuts prompts. The truth's calibration (budget aside) predicts the change.
    base = calibration.load(truth_calibration_path()).latency_model()
    cls = MIXES["long_prompt"].classes[0][0]
    rate, duration = 2.0, 1200.0
    change = {}
    for budget in (8192, 2048):
        spec = fidelity.TruthServer(max_num_batched_tokens=budget).spec(draft_length)
        rng = np.random.default_rng(3)
        arrival = np.sort(rng.uniform(0.0, duration, rng.poisson(rate * duration)))
        prompt, gen = cls.draw(rng, arrival.size)
        alpha = np.full(arrival.size, spec.alpha_class(cls.kind).alpha_mean)
        run = stepsim.simulate(spec, arrival, prompt, gen, alpha, rng)
        after_warmup = arrival > 0.1 * duration
        truth = float((run.finish_s - arrival)[after_warmup].mean())
        model = dataclasses.replace(base, max_num_batched_tokens=budget)
        w = Workload(float(prompt.mean()), float(gen.mean()), float(gen.std()), float(prompt.std()))
        p = predict_point(model, rate, float(alpha[0]), max(draft_length, 1), w)
        change[budget] = (truth, p.latency_on_s if draft_length else p.latency_off_s)
    truth_slows = change[2048][0] / change[8192][0] - 1.0
    model_slows = change[2048][1] / change[8192][1] - 1.0
    assert truth_slows > 0.03  # the cut is real: 4–7 % here
    assert model_slows == pytest.approx(truth_slows, abs=0.3 * truth_slows)


def test_limits_stay_python_floats_where_chunks_price_them():
    # The KV-thrash and token-budget limits read the chunks' numpy per-state costs; a numpy
    # scalar leaking into the limits made `validate --json` fail on its comparisons (np.bool_).
    import json

    from controller.model import mode_curve

    model = dataclasses.replace(KNEED, kv_cache_tokens_off=100_000)
    curve = mode_curve(model, Workload(4000.0, 200.0, 150.0, 1600.0), False, 1.0, 0.0)
    assert curve.limit_reason in ("kv_recompute", "token_budget")
    for value in (curve.stability_limit_rps, curve.cache_fill_limit_rps, curve.peak_batch):
        assert type(value) is float, (value, type(value))
    json.dumps({"metastable": curve.stability_limit_rps < 1.0 < curve.cache_fill_limit_rps})
