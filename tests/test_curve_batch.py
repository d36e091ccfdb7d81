"""Curves built together (model.build_curves: one array, a row per curve) are the curves built
one at a time: the same arithmetic per element, whatever else shares the batch."""

from __future__ import annotations

import math
from dataclasses import fields

import numpy as np
import pytest

from controller import model as M
from tests.support.model_reference import MODELS, WORKLOADS, build_model

# SD off and draft lengths 1..6 at per-token acceptance 0.7, and one at another acceptance: the
# keys a decision asks for (best_draft_length) and a pair (curves).
KEYS = [(False, 1.0, 0.0), *((True, M._clamped_en(0.7, g, None), float(g)) for g in range(1, 7))]
KEYS.append((True, M._clamped_en(0.4, 3, None), 3.0))


def _same(a: M.ModeCurve, b: M.ModeCurve) -> list[str]:
    bad = []
    for f in fields(M.ModeCurve):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, M.Bursts):  # the bursts' arrays, each as the curve's own
            if not isinstance(y, M.Bursts) or not all(
                np.allclose(u, v, rtol=1e-13, atol=0.0) for u, v in zip(x, y, strict=True)
            ):
                bad.append(f.name)
        elif isinstance(x, np.ndarray):
            if x.shape != y.shape or not np.allclose(x, y, rtol=1e-13, atol=0.0):
                bad.append(f.name)
        elif isinstance(x, float) and math.isnan(x):
            if not math.isnan(y):
                bad.append(f.name)
        elif x != y and not (isinstance(x, float) and math.isclose(x, y, rel_tol=1e-13)):
            bad.append(f.name)
    return bad


@pytest.mark.parametrize("spec", MODELS, ids=lambda s: f"{s['calibration']}-{sorted(s.get('replace', {}))}"[:60])
def test_curves_built_together_are_the_curves_built_alone(spec):
    model = build_model(spec)
    checked = 0
    for wl in WORKLOADS:
        w = M.Workload(*wl)
        together = M.build_curves(model, w, KEYS)
        for key, curve in zip(KEYS, together, strict=True):
            alone = M.build_curves(model, w, [key])[0]
            assert not _same(curve, alone), (wl, key, _same(curve, alone))
            assert curve.latency_s(0.5 * curve.stability_limit_rps) == pytest.approx(
                alone.latency_s(0.5 * alone.stability_limit_rps), rel=1e-12
            )
            checked += 1
    assert checked == len(WORKLOADS) * len(KEYS)


@pytest.fixture
def batches(monkeypatch) -> list[list[float]]:
    """The draft lengths of each batch the curve cache builds (0: SD off), from a clear cache."""
    built: list[list[float]] = []
    real = M.build_curves

    def spy(model, workload, keys):
        built.append([k[2] for k in keys])
        return real(model, workload, keys)

    monkeypatch.setattr(M, "build_curves", spy)
    M.mode_curve.cache_clear()
    return built


def test_a_decision_builds_its_draft_lengths_together_and_caches_each(batches):
    model = build_model(MODELS[0])
    w = M.Workload(1000.5, 280.0, 200.0, 500.0)
    choice = M.best_draft_length(model, 6.0, 0.7, w)
    M.break_even_rates(model, 0.7, choice.draft_length, w)  # its curves are cached
    # SD off and the three shortest drafts in one batch; further ones two at a time.
    assert batches[0] == [0.0, 1.0, 2.0, 3.0]
    assert all(len(b) <= 2 for b in batches[1:])
    assert sum(map(len, batches)) == len({g for b in batches for g in b})  # none built twice
    assert choice.draft_length in {g for b in batches for g in b}


def test_the_curve_cache_keeps_the_workloads_used_last():
    model = build_model(MODELS[0])
    cache = M._CurveCache(maxsize=2)
    a, b, c = (M.Workload(1000.0 + i, 280.0, 200.0, 500.0) for i in range(3))
    first = cache(model, a, *KEYS[0])
    assert cache(model, a, *KEYS[0]) is first  # cached
    cache.many(model, b, KEYS[:2])
    cache(model, a, *KEYS[1])  # a used last: b goes first
    cache(model, c, *KEYS[0])
    assert cache(model, a, *KEYS[0]) is first
    assert cache.many(model, b, KEYS[:1])[0] is not None  # rebuilt
    with pytest.raises(KeyError):  # nothing else of b was kept
        cache._curves[(model, b)][KEYS[1]]


def test_an_exhaustive_search_builds_every_draft_length_at_once(batches):
    model = build_model(MODELS[0])
    M.best_draft_length(model, 6.0, 0.7, M.Workload(1000.25, 280.0, 200.0, 500.0), patience=None)
    assert batches == [[0.0, *map(float, M.DEFAULT_DRAFT_LENGTHS)]]
