"""Calibration: recovery of known parameters, warm-up, the file format, and every bad input."""

import csv
import json
from dataclasses import replace
from pathlib import Path

import pytest

from controller import calibration as cal_mod
from controller.calibration import calibrate, load, read_bench_csv, read_load_csv, save
from controller.errors import InputError
from controller.model import LatencyModel, Moe, StepCost, Workload, predict_point
from controller.synthetic import bench_rows, write_bench_csv

TRUE = LatencyModel(
    target=StepCost(0.0065, 9.0e-5, (1024.0,), (-3.0e-5,), 4.0e-8, 3.0e-6),
    draft=StepCost(0.0008, 4.0e-6, (), (), 2.0e-9),
    sd_overhead_s=0.0004,
    max_num_batched_tokens=8192,
    kv_cache_tokens_off=400_000,
    kv_cache_tokens_on=300_000,
)
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def rel(a, b):
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_recovers_known_parameters_within_2_percent(seed):
    rows = bench_rows(TRUE, batch_sizes=BATCHES, noise=0.01, iterations=30, seed=seed)
    cal = calibrate(rows, max_num_batched_tokens=8192)
    spec, true = cal.phases.target, TRUE.target
    assert rel(spec.intercept_s, true.intercept_s) < 0.02
    assert rel(spec.slope_s_per_token, true.slope_s_per_token) < 0.02
    assert rel(spec.context_s_per_token, true.context_s_per_token) < 0.05
    assert spec.fit.r2 > 0.99
    # Decode steps, prompt chunks and prefills span 1..8192 tokens: the knee is found, with an
    # interval that holds it.
    assert len(spec.knees) == 1
    knee = spec.knees[0]
    assert rel(knee.at_tokens, 1024) < 0.05
    assert rel(knee.slope_delta_s_per_token, -3.0e-5) < 0.05
    assert knee.interval_tokens[0] <= 1024 <= knee.interval_tokens[1]
    # The draft pass and the SD-step overhead come out of the SD rows once the target's share
    # is removed (two draft lengths tell the overhead from the draft's intercept).
    draft = cal.phases.draft
    assert rel(draft.intercept_s, 0.0008) < 0.1
    assert rel(draft.slope_s_per_token, 4.0e-6) < 0.1
    assert abs(cal.phases.sd_overhead_s - 0.0004) < 0.0002
    assert cal.serving.kv_cache_tokens_off == 400_000 and cal.serving.kv_cache_tokens_on == 300_000
    assert 0.005 < cal.uncertainty.relative_sd_off < 0.02
    # And whole-request predictions agree within 2% across load.
    fitted = cal.latency_model()
    w = Workload(512, 256)
    for rate in (0.5, 2.0, 6.0):
        a, b = predict_point(fitted, rate, 0.7, 4, w), predict_point(TRUE, rate, 0.7, 4, w)
        assert rel(a.latency_on_s, b.latency_on_s) < 0.02
        assert rel(a.latency_off_s, b.latency_off_s) < 0.02


def test_straight_line_grows_no_knee():
    line = LatencyModel(target=StepCost(0.006, 5e-5), draft=StepCost(0.001, 2e-6))
    cal = calibrate(bench_rows(line, batch_sizes=BATCHES, noise=0.02, seed=4))
    assert cal.phases.target.knees == []
    assert cal.phases.draft.knees == []


def test_noise_on_few_small_steps_grows_no_knee():
    # The artifact a decode-only fit produced (a "knee" at 5 tokens): with decode rows at a
    # handful of small batches the knee search refuses for lack of support on both sides.
    rows = [r for r in bench_rows(TRUE, batch_sizes=(1, 2, 4, 8, 16), noise=0.05, seed=3) if r.phase != "mixed"]
    rows = [r for r in rows if not (r.phase == "prefill" and r.draft_length == 0)] + [
        r
        for r in bench_rows(TRUE, batch_sizes=(1, 2, 4, 8, 16), noise=0.05, seed=3, prompt_tokens=(64,))
        if r.phase == "prefill" and r.draft_length == 0
    ]
    cal = calibrate(rows)
    assert cal.phases.target.knees == []


def test_warmup_iterations_are_dropped():
    rows = bench_rows(TRUE, batch_sizes=BATCHES, noise=0.0, warmup_penalty=0.5, seed=0)
    good = calibrate(rows, warmup=10, max_num_batched_tokens=8192).phases.target.intercept_s
    bad = calibrate(rows, warmup=0, max_num_batched_tokens=8192).phases.target.intercept_s
    assert rel(good, 0.0065) < 1e-3
    assert rel(bad, 0.0065) > 0.05  # the slow first iterations would have leaked in


def test_one_draft_length_folds_the_overhead_into_the_draft():
    rows = bench_rows(TRUE, batch_sizes=BATCHES, draft_lengths=(4,), seed=5)
    cal = calibrate(rows, max_num_batched_tokens=8192)
    assert cal.phases.sd_overhead_s == 0.0
    assert any("one draft length" in n for n in cal.phases.draft.fit.notes)
    # It still predicts the measured draft length well.
    w = Workload(512, 256)
    a, b = predict_point(cal.latency_model(), 2.0, 0.7, 4, w), predict_point(TRUE, 2.0, 0.7, 4, w)
    assert rel(a.latency_on_s, b.latency_on_s) < 0.03


def test_moe_draft_is_fitted_against_the_target_in_expert_tokens():
    # A MoE target is fitted against the tokens its experts see; the SD rows' target share must
    # be taken out in the same units, or a verify step's share is priced as a dense pass and
    # the draft is fitted to what is left of that.
    moe = replace(TRUE, moe=Moe(num_experts=64, top_k=2))
    rows = bench_rows(moe, batch_sizes=BATCHES, noise=0.01, iterations=20, seed=3)
    cal = calibrate(rows, max_num_batched_tokens=8192, moe=cal_mod.MoeSpec(num_experts=64, top_k=2))
    assert rel(cal.phases.draft.intercept_s, TRUE.draft.intercept_s) < 0.15
    assert abs(cal.phases.sd_overhead_s - TRUE.sd_overhead_s) < 0.0002


def test_unidentifiable_prompt_cost_is_refused():
    rows = [
        r
        for r in bench_rows(TRUE, batch_sizes=BATCHES, seed=5)
        if not (r.phase in ("prefill", "mixed") and r.draft_length == 0)
    ]
    with pytest.raises(InputError, match="prompt token's cost cannot be identified"):
        calibrate(rows)


def test_schema_1_bench_csv_still_calibrates(tmp_path):
    # Six columns, no mixed rows: verify rows carry γ in tokens_per_seq, all else is SD off.
    src = tmp_path / "old.csv"
    rows = [
        r
        for r in bench_rows(TRUE, batch_sizes=BATCHES, draft_lengths=(4,), seed=12)
        if r.phase != "mixed" and not (r.phase == "prefill" and r.draft_length)
    ]
    with open(src, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(cal_mod.BENCH_COLUMNS)
        for r in rows:
            if r.phase != "kv_cache":
                w.writerow([r.phase, r.batch_size, r.tokens_per_seq, r.context_len, r.iteration, r.latency_s])
    back, _ = read_bench_csv(src)
    assert {r.draft_length for r in back if r.phase == "verify"} == {4}
    cal = calibrate(back)
    notes = " ".join(cal.phases.target.fit.notes + cal.phases.draft.fit.notes)
    assert "no mixed rows" in notes and "draft prefill not measured" in notes


def test_file_round_trip_and_metadata(tmp_path):
    src = tmp_path / "bench.csv"
    write_bench_csv(bench_rows(TRUE, batch_sizes=BATCHES, seed=6), src)
    rows, digest = read_bench_csv(src)
    cal = calibrate(rows, metadata=cal_mod.Metadata(gpu="test", source_sha256=digest), max_num_seqs=128)
    out = tmp_path / "cal.json"
    save(cal, out)
    back = load(out)
    assert back == cal
    assert back.metadata.source_sha256 == digest and len(digest) == 64
    assert back.latency_model().max_num_seqs == 128
    raw = json.loads(out.read_text())
    assert raw["schema_version"] == 2 and "r2" in raw["phases"]["target"]["fit"]


def test_shipped_example_loads_and_says_it_is_an_example():
    from controller.shipped import example_calibration_path

    cal = load(example_calibration_path())
    assert cal.example is True
    assert "EXAMPLE" in cal.metadata.notes


# --- bad CSV input: one line naming file, row, column ------------------------------------------

HEADER = "phase,batch_size,tokens_per_seq,context_len,iteration,latency_s\n"


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "bench.csv"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("phase,batch_size,latency_s\ntarget,1,0.1\n", "missing column(s) tokens_per_seq, context_len, iteration"),
        (HEADER + "target,1,1,10,0,nan\n", "bench.csv:2: column latency_s: 'nan' is not a finite number"),
        (HEADER + "target,1,1,10,0,-0.5\n", "bench.csv:2: column latency_s: -0.5 is negative"),
        (
            HEADER + "target,1,1,10,0,0.1\ntarget,two,1,10,1,0.1\n",
            "bench.csv:3: column batch_size: 'two' is not a number",
        ),
        (HEADER + "decode,1,1,10,0,0.1\n", "bench.csv:2: column phase: unknown phase 'decode'"),
        (HEADER + "target,1.5,1,10,0,0.1\n", "bench.csv:2: column batch_size: '1.5' is not an integer"),
        (HEADER + "target,0,1,10,0,0.1\n", "bench.csv:2: column batch_size: 0 must be >= 1"),
        (HEADER + "prefix_caching,1,1,2,0,0\n", "bench.csv:2: column context_len: a prefix_caching row is 1 (on)"),
        (HEADER, "no data rows"),
    ],
)
def test_bad_csv_one_line_error(tmp_path, text, expected):
    with pytest.raises(InputError) as exc:
        read_bench_csv(write(tmp_path, text))
    msg = str(exc.value)
    assert expected in msg
    assert "\n" not in msg


def test_too_few_batch_sizes(tmp_path):
    rows = [r for r in bench_rows(TRUE, batch_sizes=(1, 2), seed=7)]
    with pytest.raises(
        InputError, match=r"phase target \(decode steps, SD off\): needs at least 3 distinct batch sizes, got 2"
    ):
        calibrate(rows)


def test_missing_sd_rows():
    rows = [r for r in bench_rows(TRUE, batch_sizes=BATCHES, seed=8) if r.phase != "verify"]
    with pytest.raises(InputError, match=r"phase verify \(SD steps, on the server with SD\): needs at least 3"):
        calibrate(rows)


def test_warmup_eats_everything():
    rows = bench_rows(TRUE, batch_sizes=BATCHES, iterations=5, seed=9)
    with pytest.raises(InputError, match="all dropped as warm-up"):
        calibrate(rows, warmup=10)


# --- bad calibration files ----------------------------------------------------------------------


def good_json() -> dict:
    return calibrate(bench_rows(TRUE, batch_sizes=BATCHES, seed=10)).model_dump(mode="json")


def test_schema_1_file_migrates(tmp_path):
    from controller.shipped import example_calibration_path

    old = json.loads(Path(example_calibration_path()).read_text())
    v1 = {
        "schema_version": 1,
        "metadata": {"notes": "old"},
        "serving": {"max_num_seqs": 256, "max_num_batched_tokens": 2048},
        "phases": {
            "prefill": {"intercept_s": 0.004, "slope_s_per_token": 5e-5},
            "target": {"intercept_s": 0.0065, "slope_s_per_token": 9e-5, "context_s_per_token": 4e-8},
            "verify": {"intercept_s": 0.0072, "slope_s_per_token": 9e-5, "context_s_per_token": 4e-8},
            "draft": {"intercept_s": 0.0008, "slope_s_per_token": 1e-6},
        },
    }
    assert old["schema_version"] == 2
    p = tmp_path / "v1.json"
    p.write_text(json.dumps(v1))
    cal = load(p)
    assert cal.migrated_from == 1 and cal.schema_version == 2
    m = cal.latency_model()
    assert m.verify is not None and m.prefill is not None and not m.draft_prefills
    assert predict_point(m, 1.0, 0.7, 4, Workload(512, 256)).latency_on_s > 0
    v1["phases"].pop("target")
    p.write_text(json.dumps(v1))
    with pytest.raises(InputError, match=r"phases\.target"):
        load(p)


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda d: d.update(schema_version=3), "schema_version 3 is not supported"),
        (lambda d: d.pop("schema_version"), "schema_version None is not supported"),
        (lambda d: d["phases"].pop("target"), "phases.target: Field required"),
        (
            lambda d: d["phases"]["draft"].update(intercept_s=-1),
            "phases.draft.intercept_s: Input should be greater than or equal to 0",
        ),
        (lambda d: d["serving"].update(max_num_seqs=0), "serving.max_num_seqs"),
        (lambda d: d["phases"]["target"].update(slope_s_per_token="fast"), "phases.target.slope_s_per_token"),
        (lambda d: d.update(surprise=1), "surprise: Extra inputs are not permitted"),
        (
            lambda d: d["phases"].update(
                decode_staircase=[{"batch_size": 64, "residual_s": 0.001}, {"batch_size": 8, "residual_s": 0.0}]
            ),
            "decode_staircase batch sizes must be strictly increasing",
        ),
        (
            lambda d: d["phases"].update(decode_staircase=[{"batch_size": 0, "residual_s": 0.0}]),
            "phases.decode_staircase.0.batch_size",
        ),
        (
            lambda d: d["phases"].update(
                verify_staircase=[{"step_tokens": 96, "residual_s": 0.001}, {"step_tokens": 96, "residual_s": 0.0}]
            ),
            "verify_staircase step tokens must be strictly increasing",
        ),
        (
            lambda d: d["phases"].update(verify_staircase=[{"step_tokens": 24, "residual_s": 11.0}]),
            "phases.verify_staircase.0.residual_s",
        ),
    ],
)
def test_bad_calibration_file(tmp_path, mutate, expected):
    d = good_json()
    mutate(d)
    p = tmp_path / "cal.json"
    p.write_text(json.dumps(d))
    with pytest.raises(InputError) as exc:
        load(p)
    assert expected in str(exc.value)
    assert str(p) in str(exc.value)


def test_calibration_not_json(tmp_path):
    p = tmp_path / "cal.json"
    p.write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        load(p)
    with pytest.raises(InputError, match="cannot read"):
        load(tmp_path / "absent.json")


# --- load test ------------------------------------------------------------------------------------


def write_load_csv(path, model, scale=1.0):
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(cal_mod.LOAD_COLUMNS)
        for sd in ("off", "on"):
            for rate in (0.5, 1, 2, 4, 6, 8):
                p = predict_point(model, rate, 0.7, 4, Workload(512, 256))
                lat = p.latency_on_s if sd == "on" else p.latency_off_s
                from controller.acceptance import vllm_rate_from_alpha

                w.writerow([rate, sd, 4, float(vllm_rate_from_alpha(0.7, 4)), lat * scale, 512, 256])


def _slower_under_load(tmp_path):
    """The bench's rows, and load-test rows of a server 10% slower per step than they say."""
    rows = bench_rows(TRUE, batch_sizes=BATCHES, noise=0.005, seed=11)
    load_path = tmp_path / "load.csv"
    write_load_csv(load_path, replace(TRUE, scale_off=1.1, scale_on=1.1))
    return rows, read_load_csv(load_path)[0]


def test_load_test_check_and_correction(tmp_path):
    rows, load_rows = _slower_under_load(tmp_path)
    checked = calibrate(rows, load_rows=load_rows, max_num_batched_tokens=8192)
    assert checked.load_check.mean_abs_pct_error > 5  # off by the missing 10%
    corrected = calibrate(rows, load_rows=load_rows, correct=True, max_num_batched_tokens=8192)
    assert rel(corrected.load_correction.scale_off, 1.1) < 0.02
    assert rel(corrected.load_correction.scale_on, 1.1) < 0.02
    assert corrected.load_check.mean_abs_pct_error < 2
    assert corrected.load_check.r2 > 0.99
    # The paper's per-curve two-parameter fit is reported for comparison, and ours is no worse.
    assert corrected.load_check.r2 >= corrected.load_check.paper_fit_r2 - 0.01


def test_saturated_rows_are_neither_fitted_nor_checked(tmp_path):
    rows, steady = _slower_under_load(tmp_path)
    # A run past capacity: its mean is as long as the test ran, whatever the step costs.
    over = replace(steady[0], rate=9.0, mean_e2e_s=500.0, saturated=True)
    with_over = calibrate(rows, load_rows=[*steady, over], correct=True, max_num_batched_tokens=8192)
    alone = calibrate(rows, load_rows=steady, correct=True, max_num_batched_tokens=8192)
    assert with_over.load_correction == alone.load_correction and rel(alone.load_correction.scale_off, 1.1) < 0.02
    assert with_over.load_check.n == len(steady)
    with pytest.raises(InputError, match="load test: all 1 rows saturated; nothing steady"):
        calibrate(rows, load_rows=[over], max_num_batched_tokens=8192)


def test_bad_load_csv(tmp_path):
    p = tmp_path / "load.csv"
    p.write_text(",".join(cal_mod.LOAD_COLUMNS) + "\n1,maybe,4,0.5,1.0,512,256\n")
    with pytest.raises(InputError, match=r"load.csv:2: column sd: 'maybe' must be on or off"):
        read_load_csv(p)
    p.write_text(",".join(cal_mod.LOAD_COLUMNS) + "\n1,on,4,1.5,1.0,512,256\n")
    with pytest.raises(InputError, match=r"load.csv:2: column acceptance_rate: 1.5 > 1"):
        read_load_csv(p)


def test_prompt_attention_term_is_recovered_and_priced():
    # A prompt's own attention costs pair_s per query-key pair (P²/2 per prompt): with chunks of
    # several lengths the fit tells it from the per-token slope, and the model charges E[P²]/2.
    true = LatencyModel(
        target=StepCost(0.006, 2e-5, context_s_per_token=5e-8, seq_s=5e-6, pair_s=2e-9),
        draft=StepCost(0.001, 3e-6, pair_s=3e-10),
        max_num_seqs=256,
        max_num_batched_tokens=8192,
    )
    rows = bench_rows(true, chunk_tokens=(256, 1024, 2048, 4096), noise=0.002, seed=4)
    cal = calibrate(rows, max_num_batched_tokens=8192)
    assert cal.phases.target.attention_s_per_pair == pytest.approx(2e-9, rel=0.15)
    fitted = cal.latency_model()
    w = Workload(4000, 200, 150.0, 1000.0)
    assert w.prompt_pairs == pytest.approx(0.5 * (4000**2 + 1000**2))
    for sd in (False, True):
        want = predict_point(true, 1.0, 0.7, 4, w)
        got = predict_point(fitted, 1.0, 0.7, 4, w)
        pick = (lambda p: p.latency_on_s) if sd else (lambda p: p.latency_off_s)
        assert pick(got) == pytest.approx(pick(want), rel=0.03)


def test_rows_past_the_kv_cache_are_dropped_and_noted():
    true = LatencyModel(target=StepCost(0.006, 2e-5, context_s_per_token=5e-8), draft=StepCost(0.001, 3e-6))
    rows = bench_rows(true, iterations=4, noise=0.0, warmup_penalty=0.0)
    cap = 128 * 1024  # the 128 × 1024-token decode batch just fits; nothing bigger does
    preempted = [
        replace(r, latency_s=r.latency_s * 1.4) if r.batch_size * r.context_len > 0.98 * cap else r for r in rows
    ]
    kv = [cal_mod.BenchRow("kv_cache", 1, 1, float(cap), 0, 0.0, 0, g) for g in (0, 2, 4)]
    kept, dropped = cal_mod.drop_over_kv(preempted + kv)
    assert dropped == sum(
        1 for r in rows if r.phase in ("target", "verify", "mixed") and r.batch_size * r.context_len > 0.98 * cap
    )
    assert dropped > 0 and len(kept) == len(rows) + len(kv) - dropped
    cal = calibrate(preempted + kv, warmup=0)
    assert any("dropped" in n for n in cal.phases.target.fit.notes)
    assert cal.phases.target.context_s_per_token == pytest.approx(5e-8, rel=0.05)
    # Without the cache size nothing can be judged, so nothing is dropped.
    assert cal_mod.drop_over_kv(preempted) == (preempted, 0)


def test_mixed_rows_past_the_step_budget_are_dropped_and_noted():
    # An older bench injected chunks larger than the budget leaves beside the batch: the chunk
    # spanned steps, so the row (here made 50 % slower, as a second step would) times no pass.
    rows = bench_rows(TRUE, batch_sizes=BATCHES, noise=0.01, iterations=6, warmup_penalty=0.0)
    over = [r for r in rows if r.phase == "mixed" and r.chunk_tokens + r.batch_size * r.tokens_per_seq > 2048]
    assert over
    spanned = [replace(r, latency_s=1.5 * r.latency_s) if r in over else r for r in rows]
    kept, dropped = cal_mod.drop_over_budget(spanned, 2048)
    assert dropped == len(over) and len(kept) == len(rows) - len(over)
    assert all(r.chunk_tokens + r.batch_size * r.tokens_per_seq <= 2048 for r in kept if r.phase == "mixed")
    cal = calibrate(spanned, warmup=0, max_num_batched_tokens=2048)
    clean = calibrate(kept, warmup=0, max_num_batched_tokens=2048)
    assert cal.phases.target.slope_s_per_token == clean.phases.target.slope_s_per_token
    assert any(f"{len(over)} mixed row(s) dropped" in n for n in cal.phases.target.fit.notes)
    # Without a budget nothing can be judged, so nothing is dropped.
    assert cal_mod.drop_over_budget(spanned, None) == (spanned, 0)


def test_the_kv_read_comes_from_the_steps_repeated_at_a_longer_context(monkeypatch):
    # An SD step 10 µs a token cheaper than the target's fit prices its γ + 1 tokens (they read
    # the KV once): what is left for the draft falls with the batch faster than any non-negative
    # per-token and per-sequence cost, both sit at zero, and a joint fit takes the rest out of
    # the KV read. Two steps alike but for their context differ by the KV read alone.
    true = LatencyModel(
        target=StepCost(0.006, 2e-5, context_s_per_token=7.5e-8, seq_s=1e-5),
        draft=StepCost(0.004, 0.0, context_s_per_token=1.9e-8, seq_s=1e-5),
        sd_overhead_s=0.0002,
        max_num_batched_tokens=8192,
    )
    sizes = (1, 2, 4, *range(8, 257, 8))
    rows = bench_rows(
        true, batch_sizes=sizes, context_lens=(640.0, 2176.0), noise=0.0, iterations=1, warmup_penalty=0.0
    )
    cheaper = [
        replace(r, latency_s=r.latency_s - 1e-5 * r.batch_size * r.tokens_per_seq) if r.phase == "verify" else r
        for r in rows
    ]
    cal = calibrate(cheaper, warmup=0)
    assert cal.phases.target.context_s_per_token == pytest.approx(7.5e-8, rel=1e-6)
    assert cal.phases.draft.context_s_per_token == pytest.approx(1.9e-8, rel=1e-6)
    assert any("repeated at a longer context" in n for n in cal.phases.draft.fit.notes)
    # The joint fit, as before: the same rows put the draft's read 10 % low.
    monkeypatch.setattr(cal_mod, "MIN_CONTEXT_PAIRS", 10**9)
    joint = calibrate(cheaper, warmup=0)
    assert not any("repeated at a longer context" in n for n in joint.phases.draft.fit.notes)
    assert joint.phases.draft.context_s_per_token < 0.95 * 1.9e-8


def test_without_steps_repeated_at_another_context_the_kv_read_is_fitted_jointly():
    rows = bench_rows(
        TRUE, batch_sizes=BATCHES, context_lens=(256.0, 1024.0), noise=0.0, iterations=1, warmup_penalty=0.0
    )
    # Every decode step at one context per batch size: no pair, the joint fit reads it.
    single = [r for r in rows if r.phase not in ("target", "verify") or (r.context_len == 256.0) == (r.batch_size < 16)]
    cal = calibrate(single, warmup=0)
    assert not any("repeated at a longer context" in n for n in cal.phases.target.fit.notes)
    assert cal.phases.target.context_s_per_token == pytest.approx(TRUE.target.context_s_per_token, rel=0.05)


@pytest.mark.parametrize(
    ("said", "expected"),
    [((), None), ((1,), True), ((0,), False), ((1, 1), True), ((1, 0), False)],
)
def test_prefix_caching_is_what_every_benchmarked_server_said(tmp_path, said, expected):
    # A server with SD and one without, each saying whether it caches prefixes: the cheaper
    # recompute is priced only where every one that said so is on; None where none said.
    rows = bench_rows(TRUE, batch_sizes=BATCHES, noise=0.0, iterations=4, warmup_penalty=0.0)
    facts = [
        cal_mod.BenchRow("prefix_caching", 1, 1, float(on), 0, 0.0, 0, g)
        for on, g in zip(said, (0, 4)[: len(said)], strict=True)
    ]
    cal = calibrate(rows + facts, warmup=1)
    assert cal.serving.prefix_caching is expected
    assert cal.latency_model().prefix_caching is bool(expected)
    # The recorded fact survives the file; a file without it (older ones) loads as not recorded.
    out = tmp_path / "cal.json"
    save(cal, out)
    assert load(out).serving.prefix_caching is expected
    raw = json.loads(out.read_text())
    raw["serving"].pop("prefix_caching")
    out.write_text(json.dumps(raw))
    assert load(out).serving.prefix_caching is None


def test_prefix_caching_round_trips_from_a_bench_csv(tmp_path):
    caching = replace(TRUE, kv_cache_tokens_off=400_000, prefix_caching=True)
    path = tmp_path / "bench.csv"
    write_bench_csv(bench_rows(caching, batch_sizes=BATCHES, noise=0.0, iterations=4), path)
    rows, _ = read_bench_csv(path)
    assert [r.context_len for r in rows if r.phase == "prefix_caching"] == [1.0]
    assert calibrate(rows, warmup=1).latency_model().prefix_caching is True
