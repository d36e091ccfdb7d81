"""bench/bench_fidelity.py refuses a bad option with one line naming it, before anything runs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def bench_fidelity(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "bench/bench_fidelity.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("option", "value", "why"),
    [
        ("--draft-lengths", "3,x", "not a comma-separated list of integers"),
        ("--draft-lengths", "3,-1", "0 (SD off) or more"),
        ("--max-num-batched-tokens", "64", "at least 256 tokens"),
        ("--workloads", "chat,nope", "unknown 'nope'"),
    ],
)
def test_a_bad_option_is_refused_before_anything_runs(tmp_path, option, value, why):
    out = tmp_path / "out"
    run = bench_fidelity(option, value, "--out", str(out))
    assert run.returncode == 2
    last = run.stderr.strip().splitlines()[-1]
    assert option in last and why in last and value in last
    assert not out.exists()  # nothing benched, nothing written


def test_cached_preempted_blocks_are_refused_with_prefix_groups(tmp_path):
    out = tmp_path / "out"
    run = bench_fidelity("--cache-preempted-blocks", "--workloads", "long_tail,agent", "--out", str(out))
    assert run.returncode == 2
    last = run.stderr.strip().splitlines()[-1]
    assert "--cache-preempted-blocks: not modelled with prefix groups (workload 'agent')" in last
    assert not out.exists()


def test_recalibrate_needs_revalidate(tmp_path):
    run = bench_fidelity("--recalibrate", str(tmp_path))
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].endswith("--recalibrate: only with --revalidate DIR")


def test_recalibrate_refuses_bench_csvs_the_calibration_was_not_made_from(tmp_path):
    # A directory of one truth's runs and another truth's bench: one line, nothing rewritten.
    work = tmp_path / "runs"
    work.mkdir()
    stored = ROOT / "bench/results/fidelity-a100-coarse-prefix"
    for name in ("calibration.json", "load-agent.csv"):
        (work / name).write_bytes((stored / name).read_bytes())
    before = (work / "calibration.json").read_bytes()
    run = bench_fidelity("--revalidate", str(work), "--recalibrate", "bench/results/fidelity-h100")
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("bench_fidelity: bench/results/fidelity-h100: its bench CSVs") and "not the ones" in last
    assert (work / "calibration.json").read_bytes() == before


def _one_row_dir(tmp_path: Path, stored: str = "fidelity-a100-coarse") -> Path:
    """A result directory of a stored A100 calibration and its chat load test's first row."""
    work = tmp_path / "runs"
    work.mkdir()
    stored = ROOT / "bench/results" / stored
    (work / "calibration.json").write_bytes((stored / "calibration.json").read_bytes())
    lines = (stored / "load-chat.csv").read_text(encoding="utf-8").splitlines(keepends=True)
    assert lines[1].startswith("1,off,0,")  # SD off at 1 req/s, 30 minutes: a second to simulate
    (work / "load-chat.csv").write_text(lines[0] + lines[1], encoding="utf-8")
    return work


@pytest.mark.parametrize("stored", ["fidelity-a100-coarse", "fidelity-a100-coarse-2k"])
def test_reload_reproduces_the_rows_it_runs_again(tmp_path, stored):
    # The first was run with --rates (1.0), the second with the truth's default rates (1): other arrivals.
    work = _one_row_dir(tmp_path, stored)
    before = (work / "load-chat.csv").read_text(encoding="utf-8")
    run = bench_fidelity("--reload", str(work), "--truth", "a100-coarse")
    assert run.returncode == 0, run.stderr
    after = (work / "load-chat.csv").read_text(encoding="utf-8").splitlines()
    # The same latencies, steady as before; an older file gains the columns added since.
    old = before.splitlines()[1].split(",")
    assert after[1].split(",")[: len(old)] == old and len(after[1].split(",")) == len(after[0].split(","))
    assert (work / "fidelity.json").exists()


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (("--truth", "h100"), "γ=0 at 1 req/s did not reproduce (mean_e2e_s 7.424060 -> "),
        (("--truth", "a100-coarse", "--seed", "11"), "no rates give the requests its rows sent with --seed 11"),
    ],
)
def test_reload_refuses_runs_another_truth_or_seed_made(tmp_path, args, why):
    work = _one_row_dir(tmp_path)
    before = (work / "load-chat.csv").read_bytes()
    run = bench_fidelity("--reload", str(work), *args)
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"bench_fidelity: {work}/load-chat.csv: {why}")
    assert (work / "load-chat.csv").read_bytes() == before and not (work / "fidelity.json").exists()


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (("--replicate", "DIR"), "--replicate DIR and --seeds go together"),
        (("--seeds", "3"), "--replicate DIR and --seeds go together"),
        (("--replicate", "DIR", "--seeds", "3,x"), "--seeds: not a comma-separated list of integers: '3,x'"),
        (
            ("--replicate", "DIR", "--seeds", "3", "--from-fraction", "1.5"),
            "--from-fraction: a fraction in [0, 1], got 1.5",
        ),
    ],
)
def test_replicate_refuses_bad_options_and_writes_nothing(tmp_path, args, why):
    work = _one_row_dir(tmp_path)
    run = bench_fidelity(*(str(work) if a == "DIR" else a for a in args))
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].endswith(why)
    assert sorted(p.name for p in work.iterdir()) == ["calibration.json", "load-chat.csv"]


def test_replicate_runs_the_rates_on_other_seeds_and_pools_them(tmp_path):
    work = _one_row_dir(tmp_path)
    before = (work / "load-chat.csv").read_text(encoding="utf-8")
    run = bench_fidelity("--replicate", str(work), "--truth", "a100-coarse", "--seeds", "101,102")
    assert run.returncode == 0, run.stderr
    assert (work / "load-chat.csv").read_text(encoding="utf-8") == before  # the original runs stay as they are
    latencies = {before.splitlines()[1].split(",")[4]}
    for seed in (101, 102):
        lines = (work / f"replicates/seed{seed}/load-chat.csv").read_text(encoding="utf-8").splitlines()
        assert lines[0] == before.splitlines()[0] and len(lines) == 2
        assert lines[1].startswith("1,off,0,")
        latencies.add(lines[1].split(",")[4])
    assert len(latencies) == 3  # other arrivals, other means
    (point,) = json.loads((work / "fidelity.json").read_text())["chat"]["points"]
    assert (point["mode"], point["rate_rps"], point["runs"]) == ("off", 1.0, 3)
    mean = sum(float(x) for x in latencies) / 3
    assert point["measured_s"] == pytest.approx(mean, rel=1e-6)
    assert "off      at 1 req/s: 3 runs (0 saturated), measured" in run.stdout


def test_rebench_needs_load_tests_to_revalidate(tmp_path):
    # No load tests in DIR: one line before anything is benched, nothing written.
    run = bench_fidelity("--rebench", str(tmp_path), "--truth", "a100-coarse")
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1] == f"bench_fidelity: {tmp_path}: no load-*.csv to re-validate"
    assert list(tmp_path.iterdir()) == []


def test_refine_runs_both_modes_inside_the_measured_bracket_once(tmp_path):
    # A100, 2048-token budget, `code`: SD at γ = 4 is ahead at 5 req/s and saturated at 5.5.
    work = tmp_path / "runs"
    work.mkdir()
    stored = ROOT / "bench/results/fidelity-a100-coarse-2k"
    (work / "calibration.json").write_bytes((stored / "calibration.json").read_bytes())
    lines = (stored / "load-code.csv").read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [ln for ln in lines[1:] if ln.startswith(("5,off,0,", "5.5,off,0,", "5,on,4,", "5.5,on,4,"))]
    assert len(kept) == 4
    (work / "load-code.csv").write_text(lines[0] + "".join(kept), encoding="utf-8")
    run = bench_fidelity("--refine", str(work), "--truth", "a100-coarse")
    assert run.returncode == 0, run.stderr
    refined = work / "refined/seed7/load-code.csv"
    rows = refined.read_text(encoding="utf-8").splitlines()
    assert rows[0] == lines[0].strip()
    assert sorted(r.split(",")[:3] for r in rows[1:]) == [["5.25", "off", "0"], ["5.25", "on", "4"]]
    (be,) = json.loads((work / "fidelity.json").read_text())["code"]["break_even"]
    assert be["draft_length"] == 4 and be["measured_between_rps"] in ([5.0, 5.25], [5.25, 5.5])
    assert "break-even γ=4" in run.stdout and f"(between {be['measured_between_rps'][0]:g} and" in run.stdout
    before = refined.read_bytes()
    again = bench_fidelity("--refine", str(work), "--truth", "a100-coarse")  # nothing left to run
    assert again.returncode == 0, again.stderr
    assert refined.read_bytes() == before
    # A seed replicated since: the bracket is narrow now, but the rates refined on seed 7 run on it.
    (work / "replicates/seed101").mkdir(parents=True)
    (work / "replicates/seed101/load-code.csv").write_text(lines[0] + "".join(kept), encoding="utf-8")
    later = bench_fidelity("--refine", str(work), "--truth", "a100-coarse")
    assert later.returncode == 0, later.stderr
    assert refined.read_bytes() == before
    added = (work / "refined/seed101/load-code.csv").read_text(encoding="utf-8").splitlines()
    assert sorted(r.split(",")[:3] for r in added[1:]) == [["5.25", "off", "0"], ["5.25", "on", "4"]]


def test_refine_needs_load_tests(tmp_path):
    (tmp_path / "calibration.json").write_bytes((ROOT / "bench/results/fidelity-h100/calibration.json").read_bytes())
    run = bench_fidelity("--refine", str(tmp_path), "--truth", "h100")
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1] == f"bench_fidelity: {tmp_path}: no load-*.csv to refine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calibration.json"]


def _rows(path: Path, *prefixes: str) -> str:
    """The header of a stored load CSV and its rows starting with ``prefixes``, in order."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [ln for ln in lines[1:] if ln.startswith(prefixes)]
    assert len(kept) == len(prefixes)
    return lines[0] + "".join(kept)


def test_pool_pools_every_directory_and_writes_nothing(tmp_path):
    from controller import calibration
    from controller.validation import validate

    stored = {
        "one": ROOT / "bench/results/fidelity-h100",
        "two": ROOT / "bench/results/fidelity-a100-coarse-long-prompt",
    }
    one, two = stored["one"], stored["two"]
    # Long prompts, γ = 2 at 2 req/s on five seeds (one saturated): −27.0 %, beyond its runs' spread (README, Stop 58).
    at_two = "2,on,2,"
    files = {
        "one/load-chat.csv": _rows(one / "load-chat.csv", "12,off,0,", "13,off,0,", "13,on,2,"),
        "one/replicates/seed101/load-chat.csv": _rows(one / "replicates/seed101/load-chat.csv", "13,off,0,"),
        "one/refined/seed7/load-chat.csv": _rows(one / "refined/seed7/load-chat.csv", "10.5,off,0,", "11,off,0,"),
        "two/load-long_prompt.csv": _rows(two / "load-long_prompt.csv", "1,on,2,", "1.75,off,0,", at_two),
        **{
            f"two/replicates/seed{s}/load-long_prompt.csv": _rows(
                two / f"replicates/seed{s}/load-long_prompt.csv", at_two
            )
            for s in (101, 102, 103, 104)
        },
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    for d in ("one", "two"):
        (tmp_path / d / "calibration.json").write_bytes((stored[d] / "calibration.json").read_bytes())
    (tmp_path / "notes").mkdir()  # neither a calibration nor load tests: not a result directory
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    out = tmp_path.parent / f"{tmp_path.name}-pooled.json"
    run = bench_fidelity("--pool", str(tmp_path), "--json", str(out))
    assert run.returncode == 0, run.stderr
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written in ROOT
    pooled = json.loads(out.read_text())
    # The same points validate finds in each directory, its load tests and replicates and refined runs pooled.
    expected, points, covered = {}, {}, [0, 0]
    for d, files_of in (
        ("one", [k for k in files if k.startswith("one/")]),
        ("two", [k for k in files if k.startswith("two/")]),
    ):
        model = calibration.load(stored[d] / "calibration.json").latency_model()
        rows = [r for f in files_of for r in calibration.read_load_csv(tmp_path / f)[0]]
        workload = files_of[0].split("load-")[1].removesuffix(".csv")
        report = validate(model, rows)
        covered = [a + b for a, b in zip(covered, report.interval_coverage, strict=True)]
        for pt in report.points:
            if pt.error is not None:
                points[f"{d}/{workload}/{pt.mode}@{pt.rate:g}"] = pt
                expected[f"{d}/{workload}/{pt.mode}@{pt.rate:g}"] = pt.error
    assert pooled["rates"] == pytest.approx(expected, rel=1e-12)
    assert set(expected) >= {
        "one/chat/off@13",
        "one/chat/off@10.5",
        "two/long_prompt/on(γ=2)@1",
        "two/long_prompt/on(γ=2)@2",
    }
    errors = list(expected.values())
    assert pooled["all"]["rates"] == len(errors) == pooled["grid"]["rates"] + pooled["refined"]["rates"]
    assert pooled["all"]["mean_abs_error"] == pytest.approx(sum(map(abs, errors)) / len(errors), rel=1e-12)
    assert pooled["refined"]["rates"] == 2  # 10.5 and 11 req/s, only in refined/
    assert pooled["directories"]["one"]["rates"] + pooled["directories"]["two"]["rates"] == len(errors)
    assert set(pooled["directories"]) == {"one", "two"}
    worst = max(errors, key=abs)
    assert pooled["all"]["worst_error"] == pytest.approx(worst, rel=1e-12)
    assert pooled["rates"][pooled["worst_rate"]] == pytest.approx(worst, rel=1e-12)
    assert f"pooled 2 directories under {tmp_path}/" in run.stdout
    assert f"rates past 10%: {sum(abs(e) > 0.10 for e in errors)} (" in run.stdout
    # Each rate past 10 % says whether its runs' own spread explains it, as validate judges it.
    assert any(p["beyond_noise"] for p in pooled["past_10"])  # long prompts γ = 2 at 2 req/s, five runs
    for p in pooled["past_10"]:
        assert p["beyond_noise"] == points[p["rate"]].beyond_noise
    # The runs inside their predicted intervals, summed over the directories as validate counts them.
    cover = pooled["interval_coverage"]
    assert [cover["inside"], cover["runs"]] == covered and covered[1] > 0
    assert f"runs inside the predicted interval: {covered[0]} of {covered[1]}" in run.stdout


@pytest.mark.parametrize(
    ("args", "rc", "why"),
    [
        (("--json", "out.json"), 2, "--json: only with --pool ROOT"),
        (
            ("--pool", "{root}"),
            1,
            "bench_fidelity: {root}: no directory with a calibration.json and load-*.csv to pool",
        ),
    ],
)
def test_pool_refuses_what_it_cannot_pool(tmp_path, args, rc, why):
    run = bench_fidelity(*(a.format(root=tmp_path) for a in args))
    assert run.returncode == rc
    assert run.stderr.strip().splitlines()[-1].endswith(why.format(root=tmp_path))
    assert list(tmp_path.iterdir()) == []
