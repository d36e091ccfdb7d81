"""Model fidelity against the independent step-level truth (controller/sim/fidelity.py).

The pipeline test runs a reduced bench → calibrate → load test → validate (≈ 15 s) and prints
what it measured; the structural test keeps the truth from borrowing the model it judges.
"""

from __future__ import annotations

import ast
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from controller import calibration as cal_mod
from controller.model import Workload, predict_point
from controller.sim import fidelity, gpu, stepsim
from controller.sim.truth_workloads import MIXES, poisson_load
from controller.validation import validate

ROOT = Path(__file__).resolve().parents[1]
TRUTH_MODULES = ("gpu.py", "stepsim.py", "simserver.py", "truth_workloads.py")
FORBIDDEN = ("controller.model", "controller.calibration")
MAX_MEAN_ABS_ERROR = 0.10

BENCH = fidelity.BenchSettings(batch_sizes=(1, 2, 4, 8, 16, 32, 64, 128), chunk_tokens=(256, 1024, 2048), iterations=1)
LOAD = fidelity.LoadSettings(rates=(1.0, 4.0, 8.0), duration_s=120, workloads=("chat",), draft_lengths=(0, 4))


@pytest.mark.slow
def test_pipeline_predicts_the_simulated_server_within_ten_percent(tmp_path):
    truth = fidelity.TruthServer()
    log: list[str] = []
    cal = fidelity.measure_and_calibrate(truth, BENCH, tmp_path, log.append)

    # The bench went through CSV files, one per server, as a user's would.
    for gamma in (0, *BENCH.draft_lengths):
        bench_csv = tmp_path / f"bench-g{gamma}.csv"
        rows, _ = cal_mod.read_bench_csv(bench_csv)
        phases = {r.phase for r in rows}
        assert phases == (
            {"prefill", "target", "mixed", "kv_cache"} if gamma == 0 else {"prefill", "verify", "mixed", "kv_cache"}
        )
        assert {r.draft_length for r in rows} == {gamma}
    assert len(log) == 1 + len(BENCH.draft_lengths)

    assert cal.schema_version == 2
    assert cal.migrated_from is None
    assert cal.phases.target.knees, "the target's compute knee was not found"
    assert cal.phases.verify is None and cal.phases.prefill is None  # schema-2 fit, not migrated
    assert cal.phases.draft.slope_s_per_token > 0 or cal.phases.draft.intercept_s > 0
    serving = cal.serving
    assert (serving.max_num_seqs, serving.max_num_batched_tokens) == (truth.max_num_seqs, truth.max_num_batched_tokens)
    assert serving.kv_cache_tokens_off == truth.spec(0).kv_tokens()
    assert serving.kv_cache_tokens_on == truth.spec(4).kv_tokens()
    assert serving.kv_cache_tokens_off > serving.kv_cache_tokens_on  # the draft's weights and KV take room
    assert serving.prefix_caching is None  # this truth recomputes a preempted request and says nothing

    rows = fidelity.load_test(truth, LOAD, "chat", tmp_path, log.append)
    assert (tmp_path / "load-chat.csv").is_file()
    reread, _ = cal_mod.read_load_csv(tmp_path / "load-chat.csv")
    assert reread == rows
    assert sorted((r.sd, r.draft_length, r.rate) for r in rows) == sorted(
        (g > 0, g, rate) for g in LOAD.draft_lengths for rate in LOAD.rates
    )

    report = validate(cal.latency_model(), rows)
    print()
    for c in report.rows:
        err = "-" if c.error is None else f"{c.error * 100:+.1f} %"
        print(
            f"{c.mode:>8} {c.row.rate:5.1f} req/s measured {c.row.mean_e2e_s:.3f} s "
            f"predicted {c.predicted_s:.3f} s error {err} saturated={c.row.saturated}"
        )
    for m in report.modes:
        print(f"{m.mode}: limit predicted {m.limit_predicted_rps:.2f} req/s, measured bracket {m.limit_measured_rps}")
    for b in report.break_even:
        print(f"γ={b.draft_length}: break-even predicted {b.predicted_rps} measured {b.measured_rps}")

    steady = [c for c in report.rows if not c.measured_saturated]
    assert len(steady) >= 4, "too few non-saturated runs to judge"
    assert all(c.error is not None for c in steady), "a steady run was predicted overloaded"
    mae = sum(abs(c.error) for c in steady) / len(steady)
    print(
        f"mean |error| over {len(steady)} non-saturated runs: {mae * 100:.1f} % (worst {report.worst_abs_error * 100:.1f} %)"
    )
    assert mae == pytest.approx(report.mean_abs_error)
    assert mae < MAX_MEAN_ABS_ERROR
    assert report.saturated_all_flagged
    # SD must come out ahead at low load on both sides: measured and predicted.
    by = {(c.row.sd, c.row.rate): c for c in report.rows}
    assert by[(True, 1.0)].row.mean_e2e_s < by[(False, 1.0)].row.mean_e2e_s
    assert by[(True, 1.0)].predicted_s < by[(False, 1.0)].predicted_s
    assert all(math.isfinite(m.limit_predicted_rps) and m.limit_error is not None for m in report.modes)


def _imported_modules(path: Path, package: str = "controller.sim") -> set[str]:
    """Every module an ``import`` names; relative imports resolved against ``package``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = package.split(".")
                parent = here[: len(here) - (node.level - 1)]
                base = ".".join([*parent, base] if base else parent)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # from controller import model
    return names


def _module_path(name: str) -> Path | None:
    parts = name.split(".")
    if parts[0] != "controller":
        return None
    as_file = ROOT.joinpath(*parts).with_suffix(".py")
    if as_file.is_file():
        return as_file
    as_package = ROOT.joinpath(*parts, "__init__.py")
    return as_package if as_package.is_file() else None


def _package_inits(name: str) -> list[Path]:
    """``import a.b.c`` runs a/__init__.py and a/b/__init__.py too."""
    parts = name.split(".")
    paths = [ROOT.joinpath(*parts[:i], "__init__.py") for i in range(1, len(parts))]
    return [p for p in paths if p.is_file()]


@pytest.mark.slow
def test_draft_pass_is_read_where_the_target_is_known(tmp_path):
    """On 128-token GEMM tiles (A100_COARSE) a mixed step's chunk lands on a staircase the
    target's lines miss by more than a whole draft pass costs. Fitted against those residuals,
    the draft's per-pass cost came out 21 % low and the SD-step overhead 27× the truth's, and
    SD's short steps at γ = 4 were under-priced by 5 % (SD looked better than it is)."""
    truth = fidelity.TruthServer(gpu=gpu.A100_COARSE)
    cal = fidelity.measure_and_calibrate(truth, fidelity.BenchSettings(), tmp_path)
    one = gpu.Seqs(np.ones(1, dtype=np.int64), np.full(1, 640, dtype=np.int64))
    true_pass = gpu.forward_time_s(truth.draft, truth.gpu, one, engine_step=False)
    draft = cal.phases.draft
    fitted_pass = draft.intercept_s + draft.slope_s_per_token + draft.seq_s + 640 * draft.context_s_per_token
    assert abs(fitted_pass / true_pass - 1) < 0.10, (fitted_pass, true_pass)
    assert cal.phases.sd_overhead_s < 0.25 * true_pass
    # The whole γ = 4 step of one sequence, as the bench measured it.
    model = cal.latency_model()
    rows = [
        r for r in cal_mod.read_bench_csv(tmp_path / "bench-g4.csv")[0] if r.phase == "verify" and r.batch_size == 1
    ]
    measured = float(np.mean([r.latency_s for r in rows]))
    ctx = rows[0].context_len
    predicted = (
        model.target.scalar(5, ctx, 1)
        + model.draft.scalar(5, ctx, 1)
        + 3 * model.draft.scalar(1, ctx, 1)
        + model.sd_overhead_s
    )
    assert abs(predicted / measured - 1) < 0.025, (predicted, measured)


@pytest.mark.slow
def test_a_cache_filled_by_long_prompts_is_overloaded_before_the_batch_is():
    """Heavy-tailed prompts fill the KV cache before max_num_seqs; then every completion leaves
    less room than the running sequences grow by, the newest is preempted and recomputed, and
    the server falls behind at rates its full batch would keep up with. The model's limit stood
    at the full batch's rate (7.17 req/s with SD at γ = 4 here), above this test's 7.0."""
    model = cal_mod.load(ROOT / "controller" / "data" / "truth-calibration.json").latency_model()
    spec = fidelity.TruthServer().spec(4)

    def serve(rate: float, kv_cache_tokens: int | None = None):
        rng = np.random.default_rng(7)
        reqs = poisson_load(rate, 900.0, "long_tail", rng)
        arrival, prompt, gen = (
            np.array(x) for x in zip(*((r.send_at_s, r.prompt_tokens, r.max_tokens) for r in reqs), strict=True)
        )
        alpha = spec.alpha_class("long_tail").draw(rng, len(reqs))
        server = spec if kv_cache_tokens is None else replace(spec, kv_cache_tokens=kv_cache_tokens)
        res = stepsim.simulate(server, arrival, prompt, gen, alpha, rng)
        w = Workload(float(prompt.mean()), float(gen.mean()), float(gen.std()), float(prompt.std()))
        return res, w

    res, w = serve(7.0)
    unbounded, _ = serve(7.0, kv_cache_tokens=10**8)
    assert res.preemptions.sum() > 0.05 * res.preemptions.size  # the cache thrashes
    assert res.latency_s.mean() > 2.0 * unbounded.latency_s.mean()
    assert unbounded.preemptions.sum() == 0
    assert predict_point(model, 7.0, 0.7, 4, w).overloaded_on

    calm, w = serve(5.0)
    assert calm.preemptions.sum() == 0
    p = predict_point(model, 5.0, 0.7, 4, w)
    assert not p.overloaded_on
    assert abs(p.latency_on_s / calm.latency_s.mean() - 1) < 0.15


@pytest.mark.parametrize("module", TRUTH_MODULES)
def test_truth_modules_do_not_import_the_model_or_its_calibration(module):
    start = ROOT / "controller" / "sim" / module
    assert start.is_file()
    direct = _imported_modules(start)
    assert not {n for n in direct if n.startswith(FORBIDDEN)}, direct
    # Nor through anything they import from the controller package.
    seen: set[Path] = set()
    todo = [start]
    reached: set[str] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        package = ".".join(path.parent.relative_to(ROOT).parts)
        for name in _imported_modules(path, package):
            reached.add(name)
            for p in (_module_path(name), *_package_inits(name)):
                if p is not None and p not in seen:
                    todo.append(p)
    assert not {n for n in reached if n.startswith(FORBIDDEN)}, sorted(n for n in reached if n.startswith(FORBIDDEN))


def test_import_scan_sees_the_forms_a_leak_would_take(tmp_path):
    leaky = tmp_path / "leaky.py"
    leaky.write_text(
        "import controller.model\nfrom controller import calibration\nfrom ..model import LatencyModel\n",
        encoding="utf-8",
    )
    names = _imported_modules(leaky)
    assert {"controller.model", "controller.calibration"} <= names
    assert all(any(n.startswith(f) for n in names) for f in FORBIDDEN)


@pytest.mark.slow
def test_a_load_test_measures_the_running_context_when_prompts_and_answers_are_correlated(tmp_path):
    """rag_mix: 30 % 6k-token prompts with 150-token answers among chat. The running batch is
    mostly chat (long answers stay longer), so it holds E[P·G]/E[G] + E[G²]/(2·E[G]) ≈ 2,044
    tokens a sequence, where the independent-lengths formula says ~2,600 and over-predicted
    this server by 15–27 % near its limit. The load test reads it from the truth's gauges (KV
    usage, running sequences) through the CSV, and validate predicts with it."""
    model = cal_mod.load(ROOT / "controller" / "data" / "truth-calibration.json").latency_model()
    load = fidelity.LoadSettings(rates=(6.5,), duration_s=600, workloads=("rag_mix",), draft_lengths=(0,))
    (row,) = fidelity.load_test(fidelity.TruthServer(), load, "rag_mix", tmp_path)
    assert "running_context_tokens" in (tmp_path / "load-rag_mix.csv").read_text().splitlines()[0]
    assert not row.saturated

    def moment(f):  # over the mix's classes: lognormal prompts, gamma answers (var = mean²/shape)
        return sum(w * f(c.prompt_mean_tokens, c.gen_mean_tokens, c.gen_mean_tokens**2 / c.gen_shape)
                   for c, w in MIXES["rag_mix"].classes)  # fmt: skip

    g = moment(lambda p, g, v: g)
    expected = moment(lambda p, g, v: p * g) / g + moment(lambda p, g, v: g * g + v) / (2 * g)
    assert row.running_context_tokens == pytest.approx(expected, rel=0.05)
    formula = replace(row.workload(), running_context_tokens=None).mean_context_tokens
    assert formula > 1.2 * row.running_context_tokens

    measured = validate(model, [row]).rows[0]
    assumed = validate(model, [replace(row, running_context_tokens=None)]).rows[0]
    print(f"context {row.running_context_tokens:.0f} (formula {formula:.0f}); error {measured.error:+.3f} "
          f"with it, {assumed.error:+.3f} without")  # fmt: skip
    assert abs(measured.error) < 0.10  # one 600 s draw near the limit: ±10 % from draw to draw (stop 41: +8.4 %)
    assert assumed.error > measured.error + 0.10
