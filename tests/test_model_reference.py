"""The model's outputs agree with the reference recorded before the fast curve build.

tests/fixtures/model-reference.json holds predictions, speedups, stability limits, best draft
lengths, break-even rates and drain throughputs on a grid of calibrations, workloads, rates,
acceptances and draft lengths, computed by the model as it was before its curve build was
rewritten for speed (tests/support/model_reference.py says how). A refactoring of the model
must reproduce them to 1e-9 relative; break-even rates, which the model finds only to
``BREAK_EVEN_REL_TOL`` (the root finder is free to land anywhere within it), to that.
"""

from __future__ import annotations

import json
import math

import pytest

from controller import model as M
from tests.support.model_reference import FIXTURE, compute

REL = 1e-9
CASES = json.loads(FIXTURE.read_text())["cases"]


def _close(got, want, rel: float = REL) -> bool:
    if want is None or isinstance(want, bool) or (isinstance(want, int) and not isinstance(got, float)):
        return got == want
    if math.isnan(want) or math.isinf(want):
        return got == want or (math.isnan(want) and math.isnan(got))
    return math.isclose(got, want, rel_tol=rel, abs_tol=1e-15)


def _mismatches(got, want, where="", rel: float = REL):
    if isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            yield from _mismatches(g, w, f"{where}[{i}]", rel)
    elif not _close(got, want, rel):
        yield f"{where}: {got!r} != {want!r}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['model']}-{c['workload']}"[:90])
def test_outputs_match_the_reference(case):
    M.curves.cache_clear()  # build every curve anew, as a fresh workload does (both caches:
    M.mode_curve.cache_clear()  # curves holds the pairs mode_curve built)
    got = compute(case["model"], tuple(case["workload"]), case["queries"])
    bad = [m for key in ("points", "best", "throughput") for m in _mismatches(got[key], case[key], key)]
    bad += _mismatches(got["break_even"], case["break_even"], "break_even", M.BREAK_EVEN_REL_TOL)
    assert not bad, "\n".join(bad[:20])
