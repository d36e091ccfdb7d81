"""``sd-controller backtest``: CSV replay, the Prometheus path's step building (canned answers),
arguments and one-line errors. The path against a real Prometheus is in test_sim_prometheus.py."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from controller.calibration import load
from controller.cli import main
from controller.errors import InputError
from controller.observation import FailureReason, Observation, ObservationFailure
from controller.settings import Settings
from controller.sim.backtest import history
from controller.sim.backtest.history import (
    RecordedPrometheus,
    parse_duration,
    parse_time,
    read_rows,
    steps_from_rows,
)
from controller.sim.backtest.replay import replay
from controller.sim.backtest.report import CAVEAT
from tests.support import LEGACY_CALIBRATION
from tests.support.prometheus import free_port

HEADER = "time_s,arrival_rate_rps,acceptance_rate,mean_prompt_tokens,mean_gen_tokens,sd_enabled"


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    """Settings read SD_CONTROLLER_* from the environment: keep the developer's out."""
    for k in list(os.environ):
        if k.startswith("SD_CONTROLLER_"):
            monkeypatch.delenv(k)


@pytest.fixture(scope="module")
def model():
    return load(LEGACY_CALIBRATION).latency_model()


def write_csv(path: Path, rates, sd=1, acceptance=0.6, step_s=60) -> Path:
    lines = [HEADER]
    for k, r in enumerate(rates):
        s = sd[k] if isinstance(sd, list | tuple) else sd
        lines.append(f"{k * step_s},{'' if r is None else r},{acceptance},512,256,{s}")
    path.write_text("\n".join(lines) + "\n")
    return path


def settings(**kw) -> Settings:
    # The replay's mechanics, not the excursion filter's length (tests/test_risk.py has that):
    # two one-minute steps, as restart + drain alone would give.
    kw.setdefault("excursion_filter_s", 120.0)
    return Settings(hook_type="none", **kw)


def day(low=3.0, high=15.0):
    """60 one-minute steps low, 90 high, 90 low again."""
    return [low] * 60 + [high] * 90 + [low] * 90


# ---------------------------------------------------------------------------------------------
# decisions and gain
# ---------------------------------------------------------------------------------------------


def test_replay_disables_under_load_and_enables_after(tmp_path, model):
    steps = steps_from_rows(read_rows(write_csv(tmp_path / "h.csv", day() + [3.0] * 90)))
    result = replay(settings(), model, steps)
    acts = result.decisions
    # Each signal must first outlast a restart (90 s down + 30 s drain: two one-minute steps);
    # leaving an overloaded SD needs nothing more. Enabling waits far longer: for an hour the
    # peak is recent, so the restart back is part of the price (risk.recent_peak); and nothing
    # forecasts how long the quiet load lasts, so its gain counts only as far as its age
    # vouches for it (risk.rented_gain) — 158 minutes after the step down, not 2.
    assert [(r.action, r.time_s) for r in acts] == [("disable", 3720.0), ("enable", 18480.0)]
    d, e = acts
    assert d.reason == "speedup_below_disable_threshold" and d.predicted_speedup < 1.05
    assert e.reason == "speedup_above_enable_threshold" and e.predicted_speedup > 1.2
    assert d.acceptance_source == "measured" and d.acceptance_rate == pytest.approx(0.6)
    # The replay's state follows its own decisions; the history stays what it was.
    assert all(r.recorded_enabled is True for r in result.records)
    assert [r.controller_enabled for r in result.records[61:63]] == [True, False]
    assert result.records[152].controller_enabled is False  # still waiting out the recent peak
    assert result.records[207].controller_enabled is False  # the quiet load is an hour old
    assert result.records[315].controller_enabled is True
    assert d.switch_cost_request_s > 0 and e.switch_cost_request_s > 0
    assert result.switch_cost_request_s == pytest.approx(d.switch_cost_request_s + e.switch_cost_request_s)


def test_gain_positive_when_the_history_ran_sd_under_load(tmp_path, model):
    # Short restarts: the switch is cheap next to 40 minutes of SD at 14.6 req/s (past the ~14.3
    # break-even, below SD's ~14.7 limit).
    s = settings(restart_downtime_s=5)
    steps = steps_from_rows(read_rows(write_csv(tmp_path / "h.csv", [3.0] * 5 + [14.6] * 40)))
    result = replay(s, model, steps)
    assert [r.action for r in result.decisions] == ["disable"]
    assert result.latency_gain_request_s > 0
    assert result.net_gain_request_s == pytest.approx(result.latency_gain_request_s - result.switch_cost_request_s)
    assert result.net_gain_request_s > 0
    # Per step: (L_on − L_off) · λ · Δt while the replay runs SD off and the history SD on.
    r = result.records[10]
    assert r.recorded_enabled and not r.controller_enabled and r.gain_request_s > 0


def test_gain_negative_when_the_controller_keeps_the_worse_state(tmp_path, model):
    # History: SD off under load, then SD on at low load (right both times). A controller that
    # never enables (threshold out of reach) keeps SD off at low load: the model says that loses.
    sd = [0] * 10 + [1] * 30
    steps = steps_from_rows(read_rows(write_csv(tmp_path / "h.csv", [15.0] * 10 + [3.0] * 30, sd=sd)))
    result = replay(settings(enable_threshold=50.0), model, steps)
    assert result.decisions == []
    assert all(not r.controller_enabled for r in result.records)
    assert result.latency_gain_request_s < 0 and result.switch_cost_request_s == 0
    assert result.recorded_toggles == 1


def test_no_decisions_and_zero_gain_when_history_agrees(tmp_path, model):
    steps = steps_from_rows(read_rows(write_csv(tmp_path / "h.csv", [3.0] * 30)))
    result = replay(settings(), model, steps)
    assert result.decisions == [] and result.net_gain_request_s == 0.0
    assert all(r.gain_request_s == 0.0 for r in result.records)


def test_missing_rate_holds_and_is_counted(tmp_path, model):
    rates = [3.0] * 5 + [None] * 3 + [3.0] * 5
    steps = steps_from_rows(read_rows(write_csv(tmp_path / "h.csv", rates)))
    assert isinstance(steps[5].observation, ObservationFailure)
    assert steps[5].observation.reason is FailureReason.EMPTY
    result = replay(settings(), model, steps)
    assert result.failures == {"empty": 3}
    assert [r.failure for r in result.records[5:8]] == ["empty"] * 3
    assert all(r.predicted_speedup is None and r.action == "none" for r in result.records[5:8])


def test_acceptance_recorded_with_sd_off_is_not_used(tmp_path, model):
    # vLLM exports no acceptance while SD is off: the replay must fall back to the prior.
    steps = steps_from_rows(read_rows(write_csv(tmp_path / "h.csv", [3.0] * 3, sd=0, acceptance=0.1)))
    assert all(s.observation.acceptance_rate is None for s in steps)
    result = replay(settings(), model, steps)
    assert result.records[0].acceptance_source == "prior"


def test_prefix_cache_hits_in_the_history_reach_the_model(tmp_path, model):
    path = write_csv(tmp_path / "h.csv", [3.0] * 3)
    lines = path.read_text().splitlines()
    cells = ["400", "", "nan"]
    body = [f"{r},{c}" for r, c in zip(lines[1:], cells, strict=True)]
    path.write_text("\n".join([lines[0] + ",cached_prompt_tokens", *body]))
    steps = steps_from_rows(read_rows(path))
    assert [s.observation.cached_prompt_tokens for s in steps] == [400.0, None, None]
    hit, cold, _ = replay(settings(), model, steps).records
    # 400 of 512 prompt tokens not computed, the draft's prefill included: SD gains more.
    assert hit.predicted_speedup > cold.predicted_speedup
    bad = tmp_path / "bad.csv"
    bad.write_text(lines[0] + ",cached_prompt_tokens\n" + lines[1] + ",-4\n")
    with pytest.raises(InputError, match="row 2, column cached_prompt_tokens: -4 is negative"):
        read_rows(bad)


def test_replay_leaves_structlog_configuration_alone(tmp_path, model):
    import structlog

    before = structlog.get_config()
    replay(settings(), model, steps_from_rows(read_rows(write_csv(tmp_path / "h.csv", [3.0] * 3))))
    assert structlog.get_config() == before


# ---------------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------------


def test_cli_prints_decisions_gain_and_caveat(tmp_path, capsys):
    csv = write_csv(tmp_path / "h.csv", day())
    png = tmp_path / "bt.png"
    assert main(["backtest", "--csv", str(csv), "--plot", str(png), "--calibration", LEGACY_CALIBRATION]) == 0
    out = capsys.readouterr().out
    assert CAVEAT in out and out.count("open-loop caveat") == 2  # before the table and in the summary
    assert "decisions the controller would have taken" in out
    assert "disable" in out and "enable" in out and "speedup_below_disable_threshold" in out
    assert "predicted gain (model prediction, not a measurement)" in out
    assert "EXAMPLE" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_settings_from_config(tmp_path, capsys):
    csv = write_csv(tmp_path / "h.csv", day())
    cfg = tmp_path / "c.yaml"
    cfg.write_text("disable_threshold: 0.5\nenable_threshold: 0.6\n")  # the speedup at 15 req/s is 0.83
    assert main(["backtest", "--csv", str(csv), "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "(none: it would have kept the recorded state)" in out


def test_cli_all_steps(tmp_path, capsys):
    csv = write_csv(tmp_path / "h.csv", [3.0] * 4)
    assert main(["backtest", "--csv", str(csv), "--all-steps"]) == 0
    out = capsys.readouterr().out
    assert "steps:" in out and out.count(" none ") == 4


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("time_s,arrival_rate_rps\n0,1\n", "missing column(s) acceptance_rate, mean_prompt_tokens"),
        (HEADER + "\n", "no rows"),
        ("", "missing column(s) time_s"),
        (HEADER + "\n0,abc,0.6,512,256,1\n", "row 2, column arrival_rate_rps: 'abc' is not a number"),
        (
            HEADER + "\n0,3,0.6,512,256,1\n60,inf,0.6,512,256,1\n",
            "row 3, column arrival_rate_rps: 'inf' is not a finite",
        ),
        (HEADER + "\n0,3,0.6,512,256,maybe\n", "row 2, column sd_enabled: 'maybe' is not 1/0/true/false"),
        (HEADER + "\n0,3,1.6,512,256,1\n", "row 2, column acceptance_rate: 1.6 is outside [0, 1]"),
        (HEADER + "\n0,-3,0.6,512,256,1\n", "row 2, column arrival_rate_rps: -3 is negative"),
        (HEADER + "\n,3,0.6,512,256,1\n", "row 2, column time_s: empty"),
        (HEADER + "\n60,3,0.6,512,256,1\n60,3,0.6,512,256,1\n", "row 3, column time_s: not after"),
    ],
)
def test_bad_csv_is_one_line_exit_2(tmp_path, capsys, content, expected):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    assert main(["backtest", "--csv", str(path)]) == 2
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("sd-controller backtest: error: ") and str(path) in err and expected in err, err
    assert cap.out == ""


def test_missing_csv_file(tmp_path, capsys):
    assert main(["backtest", "--csv", str(tmp_path / "nope.csv")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nope.csv: cannot read" in err


def prom_args(url="http://127.0.0.1:9", **kw):
    args = ["backtest", "--prometheus-url", url]
    for k, v in kw.items():
        args += [f"--{k}", v]
    return args


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (prom_args(start="yesterday", end="100"), "--start 'yesterday': not a time"),
        (prom_args(start="100", end="2024-13-01T00:00:00"), "--end '2024-13-01T00:00:00': not a time"),
        (prom_args(start="200", end="100"), "must be after --start"),
        (prom_args(start="100", end="100"), "must be after --start"),
        (prom_args(start="100", end="200", step="0"), "--step '0': must be > 0"),
        ([*prom_args(start="100", end="200"), "--step=-5s"], "--step '-5s': not a duration"),
        (prom_args(start="100", end="200", step="fast"), "--step 'fast': not a duration"),
        (prom_args(start="0", end="1e9", step="1s"), "more than 200000 steps"),
        (prom_args(end="100"), "--start is required with --prometheus-url"),
        (prom_args("prom:9090", start="100"), "--prometheus-url 'prom:9090': must be an http(s) URL"),
        (["backtest", "--csv", "x.csv", "--start", "100"], "--start is for --prometheus-url"),
    ],
)
def test_bad_arguments_are_one_line_exit_2(capsys, argv, expected):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err


def test_prometheus_unreachable_is_one_line_exit_1(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert main(prom_args(url, start="1700000000", end="1700000600", step="60s")) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"Prometheus {url} unreachable" in err, err


def test_bad_setting_in_config_is_exit_2(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("queries: {no_such_query: 'up'}\n")
    assert main(prom_args(start="100", end="200", config=str(cfg))) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no_such_query" in err, err


def test_parse_time_and_duration():
    assert parse_time("1700000000") == 1700000000.0
    assert parse_time("2023-11-14T22:13:20Z") == 1700000000.0
    assert parse_time("2023-11-14T22:13:20") == 1700000000.0  # no offset: UTC
    assert parse_time("2023-11-15T00:13:20+02:00") == 1700000000.0
    assert parse_time("now", now=1000.0) == 1000.0
    assert parse_time("now-1h30m", now=10000.0) == 10000.0 - 5400
    assert [parse_duration(x) for x in ("60", "60s", "5m", "1h30m", "500ms", "1.5h")] == [60, 60, 300, 5400, 0.5, 5400]
    for bad in ("", "1x", "m5", "nan", "5m5"):
        with pytest.raises(InputError):
            parse_duration(bad)
    with pytest.raises(InputError):
        parse_time("nan")


# ---------------------------------------------------------------------------------------------
# the Prometheus path, on canned query_range answers
# ---------------------------------------------------------------------------------------------


class FakeResponse:
    def __init__(self, body, status=200):
        self.body, self.status_code = body, status

    def json(self):
        return self.body


class FakeSession:
    """Answers query_range for the rendered queries it knows, with one value per step."""

    def __init__(self, by_query):
        self.by_query = by_query  # promql -> callable(t) -> list[(labels, value)] (value may be "NaN")
        self.calls = []

    def get(self, url, params, timeout):
        assert url.endswith("/api/v1/query_range")
        self.calls.append(params)
        start, end, step = float(params["start"]), float(params["end"]), float(params["step"])
        fn = self.by_query.get(params["query"])
        series = {}
        t = start
        while t <= end + 1e-9:
            for labels, v in fn(t) if fn else []:
                series.setdefault(tuple(sorted(labels.items())), []).append([t, str(v)])
            t += step
        result = [{"metric": dict(k), "values": vals} for k, vals in series.items()]
        return FakeResponse({"status": "success", "data": {"resultType": "matrix", "result": result}})


def test_recorded_prometheus_builds_the_daemons_observations(monkeypatch):
    s = settings(rate_window_s=5, acceptance_window_s=10, long_window_s=20, prometheus_selector='job="vllm"')
    t0 = 1_700_000_000.0
    src = RecordedPrometheus(
        "http://prom.invalid", s.prometheus_selector, s.rate_window_s, s.acceptance_window_s, s.long_window_s,
        s.queries, 5.0, t0, t0 + 19, 1.0,
    )  # fmt: skip
    q = src.queries
    assert 'job="vllm"' in q["arrival_rate"] and "[5s]" in q["arrival_rate"] and "[20s]" in q["arrival_rate_long"]
    assert "[10s]" in q["acceptance_rate"]

    def k(t):
        return round(t - t0)

    def sd_on(t):
        return k(t) < 12

    fake = FakeSession(
        {
            # steps 3 and 4: no arrival rate (a gap); step 7: NaN rate
            q["arrival_rate"]: lambda t: [] if k(t) in (3, 4) else [({}, "NaN" if k(t) == 7 else 2.0 + 0.1 * k(t))],
            q["arrival_rate_long"]: lambda t: [({}, 2.0)],
            q["sample_age"]: lambda t: [({}, 0.5)],
            q["sd_present"]: lambda t: [({}, 1)] if sd_on(t) else [],
            q["acceptance_rate"]: lambda t: [({}, "NaN" if k(t) == 9 else 0.6)] if sd_on(t) else [],
            q["mean_draft_tokens"]: lambda t: [({}, 4.0)] if sd_on(t) else [],
            q["position_acceptance"]: lambda t: (
                [({"position": str(i)}, p) for i, p in enumerate((0.8, 0.65, 0.55, 0.4))] if sd_on(t) else []
            ),
            q["mean_prompt_tokens"]: lambda t: [({}, 512.0)],
            q["mean_gen_tokens"]: lambda t: [({}, 256.0)],
            q["running"]: lambda t: [({}, 10.0)],
            q["waiting"]: lambda t: [({}, 0.0)],
        }
    )
    src._session = fake  # the only network access of the source
    monkeypatch.setattr(history, "POINTS_PER_QUERY", 7)  # 20 steps: 3 query_range calls per query
    src.fetch()
    assert len(fake.calls) == 3 * len(q)
    steps = src.steps()
    assert [st.time_s for st in steps] == [t0 + i for i in range(20)]
    obs = [st.observation for st in steps]
    assert isinstance(obs[3], ObservationFailure) and obs[3].reason is FailureReason.EMPTY
    assert isinstance(obs[7], ObservationFailure) and obs[7].reason is FailureReason.NAN
    o = obs[10]
    assert isinstance(o, Observation)
    assert o.time_s == t0 + 10 and o.arrival_rate_rps == pytest.approx(3.0) and o.arrival_rate_long_rps == 2.0
    assert o.acceptance_rate == 0.6 and o.position_acceptance == (0.8, 0.65, 0.55, 0.4)
    assert o.mean_prompt_tokens == 512 and o.mean_e2e_latency_s is None  # no series: None, never 0
    assert o.sd_series_present is True and o.sample_age_s == 0.5 and o.running == 10.0
    assert obs[9].acceptance_rate is None  # NaN in an optional field is None
    assert obs[15].sd_series_present is False and obs[15].acceptance_rate is None
    assert [st.recorded_enabled for st in steps[10:14]] == [True, True, False, False]
    assert steps[3].recorded_enabled is None and all(st.duration_s == 1.0 for st in steps)


def test_query_rejected_by_prometheus_is_input_error():
    src = RecordedPrometheus("http://prom.invalid", "", 60, 300, 900, {}, 5.0, 0.0, 600.0, 60.0)

    class Rejecting:
        def get(self, url, params, timeout):
            return FakeResponse({"status": "error", "errorType": "bad_data", "error": "parse error"}, 400)

    src._session = Rejecting()
    with pytest.raises(InputError, match="Prometheus rejected query arrival_rate"):
        src.fetch()


def test_gain_ignores_unbounded_steps(tmp_path, model):
    # At 15.5 req/s SD-on is past its stability limit: the latency there is unbounded, which is
    # counted apart, not summed. The disable waits out the excursion filter (two steps) first.
    steps = steps_from_rows(read_rows(write_csv(tmp_path / "h.csv", [15.5] * 5)))
    result = replay(settings(), model, steps)
    assert [r.action for r in result.decisions] == ["disable"]
    assert result.unbounded_for == 3 and math.isfinite(result.latency_gain_request_s)
    assert result.beyond_headroom_recorded == 5
