"""The demo on the independent truth: what ``sd-controller demo`` runs by default.

The simulated server runs on the GPU roofline (:mod:`controller.sim.truth_costs`; H100,
Llama-3.1-8B target, Llama-3.2-1B draft), with the truth server's scheduler limits. The
controller believes a calibration produced the user's way — ``bench`` → ``calibrate`` against
that simulated server — shipped as ``controller/data/truth-calibration.json`` so the demo does
not spend its first 15 s measuring (``decisions.calibrate`` reproduces it).
"""

from __future__ import annotations

import math
from importlib import resources
from pathlib import Path

import numpy as np

TRUTH = "truth"
RESTART_TAIL_S = 900.0  # a restart's backlog is charged until this long after vLLM is back


def truth_calibration_path() -> Path:
    return Path(str(resources.files("controller") / "data" / "truth-calibration.json"))


def truth_scenario(scenario):
    """The scenario on the truth server's scheduler (max_num_seqs, max_num_batched_tokens): the
    calibration was measured there, so a different budget would be an unmeasured change."""
    from controller.sim.decisions import truth_server

    t = truth_server()
    return scenario.with_changes(
        engine={"max_num_seqs": t.max_num_seqs, "max_num_batched_tokens": t.max_num_batched_tokens}
    )


def server_costs(kind: str, model):
    """What the engine runs on: the truth's costs for ``truth``, else the calibration's model."""
    if kind == TRUTH:
        from controller.sim.decisions import truth_costs

        return truth_costs()
    return model


def requests_of(result) -> tuple[np.ndarray, np.ndarray]:
    """(arrival s, latency s) of every request that did not get aborted (unfinished: censored)."""
    from controller.sim.engine import F_ARR, F_FIN

    e = result.engine
    log = e.finished_log()
    pend = e.pending_arrivals()
    return np.concatenate([log[:, F_ARR], pend]), np.concatenate([log[:, F_FIN] - log[:, F_ARR], e.t - pend])


def restart_cost(
    restarts: list[tuple[float, float, bool, int]],
    ctl: tuple[np.ndarray, np.ndarray],
    static: dict[bool, tuple[np.ndarray, np.ndarray]],
) -> tuple[float, int]:
    """(request-seconds, requests aborted) the controller's restarts cost.

    For each restart (requested at t0, back at t1, into state s): the latency of the requests
    arriving in [t0, t1 + RESTART_TAIL_S) beyond what the same arrivals (same seed, same times)
    saw in the static run of state s. Aborted requests are counted, not priced.
    """
    arr_c, lat_c = ctl
    total, lost = 0.0, 0
    for t0, t1, enabled, aborted in restarts:
        lost += int(aborted)
        arr_s, lat_s = static[enabled]
        lo, hi = t0, t1 + RESTART_TAIL_S
        mc = (arr_c >= lo) & (arr_c < hi)
        ms = (arr_s >= lo) & (arr_s < hi)
        # Match by arrival time: the arrival stream is drawn from its own seeded generator.
        common, ic, is_ = np.intersect1d(arr_c[mc], arr_s[ms], return_indices=True)
        if common.size:
            total += float(lat_c[mc][ic].sum() - lat_s[ms][is_].sum())
    return total, lost


def verdict(rows: dict[str, dict], cost_s: float, lost: int) -> str:
    """One line: the controller against the better static policy, and its restarts' price."""
    ctl = rows["controller"]
    statics = {k: v for k, v in rows.items() if k in ("always-on", "always-off")}
    if not statics:
        return f"controller: {ctl['mean_latency_s']:.2f} s mean latency, {ctl['toggles']:.0f} restarts"
    best = min(statics, key=lambda k: statics[k]["mean_latency_s"])
    b = statics[best]["mean_latency_s"]
    c = ctl["mean_latency_s"]
    change = (b - c) / b if b > 0 and math.isfinite(b) else math.nan
    word = "gained" if change >= 0 else "lost"
    n = int(ctl["toggles"])
    per = f" ({cost_s / n:,.0f} each)" if n else ""
    return (
        f"controller vs the better static policy ({best}): {word} {abs(change) * 100:.1f} % mean latency "
        f"({c:.2f} s vs {b:.2f} s); its {n} restart{'s' if n != 1 else ''} cost {cost_s:,.0f} request-s{per} "
        f"and {lost} aborted request{'s' if lost != 1 else ''}"
    )
