"""The decision benchmark's machinery (bench/bench_decisions.py + controller/sim/decisions.py) on
one tiny scenario, so the bench cannot rot; and the start-aware oracle's bookkeeping."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from controller.sim import decisions, runner, scenarios
from controller.sim.fidelity import BenchSettings
from controller.sim.oracle import best_schedule, run_oracle_from

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "fixtures" / "decisions-tiny.yaml"
# A reduced bench plan (as tests/test_fidelity.py): enough for a usable calibration in seconds.
SMALL_BENCH = BenchSettings(batch_sizes=(1, 4, 16, 64, 128), chunk_tokens=(256, 2048), iterations=1)
# The truth's limits for the chat mix at α 0.65, as measured by the full bench (limits.json).
TINY_LIMITS = decisions.Limits(off_rps=15.2, on_rps=14.33, break_even_rps=9.0)


def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_decisions", ROOT / "bench" / "bench_decisions.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_listed_scenario_exists_matches_the_truth_and_both_kinds_are_covered():
    truth = decisions.truth_server()
    names = [n for n, _ in decisions.SCENARIOS]
    assert len(names) >= 20 and len(set(names)) == len(names)
    assert set(decisions.QUICK) <= set(names)
    kinds = {c for _, c in decisions.SCENARIOS}
    assert kinds == {decisions.FUTURE, decisions.SURPRISE}
    on_disk = {p.stem for p in decisions.scenario_dir().glob("*.yaml")}
    assert on_disk == set(names)
    for n in names:
        sc = decisions.load_scenario(n)
        assert sc.name == n
        decisions.check_scenario(sc, truth)  # raises on a scheduler mismatch
    bad = decisions.load_scenario(names[0]).with_changes(engine={"max_num_batched_tokens": 2048})
    with pytest.raises(ValueError, match="differ from the truth"):
        decisions.check_scenario(bad, truth)


def test_oracle_dp_charges_the_switch_away_from_the_start_state():
    cheap_on = np.array([1.0, 1.0, 1.0])
    dear_off = np.array([5.0, 5.0, 5.0])
    switch = np.full((3, 2), 100.0)
    # Launched off: switching on saves 12 but costs 100, so the plan stays off.
    assert best_schedule(dear_off, cheap_on, switch, start_on=False) == [False, False, False]
    assert best_schedule(dear_off, cheap_on, switch / 100, start_on=False) == [True, True, True]
    assert best_schedule(dear_off, cheap_on, switch, start_on=True) == [True, True, True]


def test_a_replayed_schedule_that_wants_the_other_state_restarts_at_t0():
    sc = scenarios.load(str(TINY)).with_changes(duration_s=300)
    costs = decisions.truth_costs()
    launched_off = runner.run_schedule(sc, costs, [True] * 5, 60.0, start_on=False)
    assert launched_off.toggles == 1
    assert launched_off.engine.restart_log[0][0] == 0.0  # requested at t=0
    free = runner.run_schedule(sc, costs, [True] * 5, 60.0)  # no start state: launched as wanted
    assert free.toggles == 0
    assert free.summary()["mean_latency_s"] < launched_off.summary()["mean_latency_s"]


def test_oracle_from_a_start_state_is_never_worse_than_staying_put():
    sc = scenarios.load(str(TINY))
    costs = decisions.truth_costs()
    on = runner.run_static(sc, costs, True, warmup_s=60)
    off = runner.run_static(sc, costs, False, warmup_s=60)
    for start in (True, False):
        o = run_oracle_from(sc, costs, on, off, start, TINY_LIMITS.off_rps, TINY_LIMITS.on_rps)
        stay = (on if start else off).summary()["mean_latency_s"]
        assert o.summary()["mean_latency_s"] <= stay
        assert o.engine.scenario.engine.initial_sd is start


def test_no_oracle_plan_restarts_inside_the_warm_up():
    """A restart at t=0 on an empty server hides its outage in the unmeasured warm-up: the
    oracle's plans keep the launch state until the measurement starts, as the controller must."""
    sc = scenarios.load(str(TINY))
    costs = decisions.truth_costs()
    on = runner.run_static(sc, costs, True, warmup_s=120)
    off = runner.run_static(sc, costs, False, warmup_s=120)
    for start in (True, False):
        o = run_oracle_from(sc, costs, on, off, start, TINY_LIMITS.off_rps, TINY_LIMITS.on_rps)
        assert all(t0 >= 120.0 for t0, *_ in o.engine.restart_log)


@pytest.mark.slow
def test_measured_limits_are_ordered_and_in_range():
    sc = scenarios.load(str(TINY))
    lim = decisions.measure_limits(sc, decisions.truth_costs(), duration_s=800.0, tol=1.0)
    # Full measurement (2400 s runs, 0.1 req/s): off 15.2, on 14.3, break-even ~9 req/s.
    assert 12.0 < lim.on_rps < lim.off_rps + 1.0 < 19.0
    assert lim.break_even_rps is not None and 5.0 < lim.break_even_rps < lim.on_rps


@pytest.mark.slow
def test_bench_runs_end_to_end_on_a_tiny_scenario(tmp_path, capsys):
    out = tmp_path / "out"
    # Calibrate the user's way (reduced plan), and seed the limits cache: the bench must reuse both.
    _, cal_path = decisions.calibrate(out, bench=SMALL_BENCH)
    assert (out / "bench-csv" / "bench-g0.csv").is_file()
    sc = scenarios.load(str(TINY))
    key = decisions.workload_key(sc)
    (out / decisions.LIMITS_FILE).write_text(json.dumps({key: TINY_LIMITS.__dict__}))
    stamp = cal_path.stat().st_mtime_ns

    rc = _bench_module().main(["--scenarios", str(TINY), "--out", str(out), "--jobs", "1"])
    assert rc == 0
    assert cal_path.stat().st_mtime_ns == stamp  # cached calibration reused, not re-measured
    text = capsys.readouterr().out
    assert "| tiny | future | on |" in text and "| tiny | future | off |" in text
    doc = json.loads((out / "decisions.json").read_text())
    (row,) = doc["scenarios"]
    assert row["limits"] == TINY_LIMITS.__dict__
    assert [s["start"] for s in row["starts"]] == ["on", "off"]
    for s in row["starts"]:
        ctl, orc = s["controller"], s["oracle"]
        assert ctl["mean_latency_s"] > 0 and orc["mean_latency_s"] > 0
        assert s["ratio"] == pytest.approx(ctl["mean_latency_s"] / orc["mean_latency_s"])
        # The oracle knows the future and pays for leaving its start state: never worse than staying.
        assert orc["mean_latency_s"] <= s["not_acting"]["mean_latency_s"]
    assert doc["aggregates"][decisions.FUTURE]["rows"] == 2
    assert (out / "decisions.md").read_text().startswith("## Decision quality on the truth")


def test_rerun_refuses_a_scenario_the_full_run_does_not_have(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("rerun", ROOT / "bench" / "bench_decisions_rerun.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    (tmp_path / "decisions.json").write_text(json.dumps({"scenarios": [{"name": "low-load", "starts": []}]}))
    assert mod.main([str(tmp_path), "--scenarios", "low-load,nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"bench_decisions_rerun: not in {tmp_path / 'decisions.json'}: nope"]


def _seeds_module():
    spec = importlib.util.spec_from_file_location("seeds", ROOT / "bench" / "bench_decisions_seeds.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _full_run_dir(tmp_path: Path, controller_s: float = 2.0) -> Path:
    """A full run's output as the seeds bench reads it: one tiny scenario launched on."""
    outcome = {"toggles": 0, "mean_latency_s": controller_s}
    row = {
        "name": str(TINY),
        "category": decisions.FUTURE,
        "duration_s": 1200.0,
        "limits": TINY_LIMITS.__dict__,
        "starts": [{"start": "on", "controller": outcome, "oracle": outcome, "not_acting": outcome}],
    }
    (tmp_path / "decisions.json").write_text(json.dumps({"scenarios": [row]}))
    truth_cal = ROOT / "controller" / "data" / "truth-calibration.json"
    (tmp_path / decisions.CALIBRATION_FILE).write_text(truth_cal.read_text())
    return tmp_path


def test_seeds_bench_refuses_unknown_scenarios_and_bad_seeds(tmp_path, capsys):
    full = _full_run_dir(tmp_path)
    assert _seeds_module().main([str(full), "--scenarios", "nope"]) == 2
    assert capsys.readouterr().err.strip() == f"bench_decisions_seeds: not in {full / 'decisions.json'}: nope"
    assert _seeds_module().main([str(full), "--scenarios", str(TINY), "--seeds", "1,x"]) == 2
    assert "--seeds must be integers" in capsys.readouterr().err
    assert _seeds_module().main([str(full), "--scenarios", str(TINY), "--starts", "sideways"]) == 2
    assert "--starts on, off or both: 'sideways'" in capsys.readouterr().err


@pytest.mark.slow
def test_seeds_bench_reruns_a_scenario_on_another_draw(tmp_path, capsys):
    full = _full_run_dir(tmp_path)
    out = tmp_path / "seeds.md"
    rc = _seeds_module().main(
        [str(full), "--scenarios", str(TINY), "--starts", "on", "--seeds", "7", "--jobs", "1", "--out", str(out)]
    )
    assert rc == 0
    text = capsys.readouterr().out
    got = {}
    for x in text.splitlines():
        if " seed " in x and " ctl " in x:
            ctl, orc = (float(x.split(k)[1].split()[0]) for k in (" ctl ", " oracle "))
            got[int(x.split(" seed ")[1].split()[0])] = (ctl, orc)
    own = scenarios.load(str(TINY)).seed
    assert set(got) == {own, 7}  # the scenario's own draw is re-run too, first in the table
    assert got[own] != got[7]  # another draw: other arrivals, another oracle
    (row,) = [x for x in out.read_text().splitlines() if x.startswith(f"| {TINY} | on |")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == ", ".join(f"{c / o:.3f}" for c, o in (got[own], got[7]))
    assert cells[4] == f"{max(c / o for c, o in got.values()):.3f}"
    assert cells[6].endswith("of 2")
