"""``sd-controller run`` with bad configuration: exit 2 and one line naming the thing, no traceback."""

import json
from pathlib import Path

import pytest

from controller.cli import main
from controller.shipped import example_calibration_path
from tests.support import zero_cost_calibration


@pytest.fixture
def run_once(tmp_path, monkeypatch, capsys):
    """Run ``run --once --dry-run`` with env and --set; returns (exit code, stderr lines)."""
    for key in list(__import__("os").environ):
        if key.startswith("SD_CONTROLLER_"):
            monkeypatch.delenv(key)

    def run(env=None, sets=(), calibration=None):
        monkeypatch.setenv("SD_CONTROLLER_STATE_FILE", str(tmp_path / "state" / "state.json"))
        monkeypatch.setenv("SD_CONTROLLER_CALIBRATION_FILE", str(calibration or example_calibration_path()))
        monkeypatch.setenv("SD_CONTROLLER_VLLM_METRICS_URL", "http://127.0.0.1:9/metrics")
        monkeypatch.setenv("SD_CONTROLLER_HOOK_TYPE", "none")
        monkeypatch.setenv("SD_CONTROLLER_PROMETHEUS_TIMEOUT_S", "0.2")
        monkeypatch.setenv("SD_CONTROLLER_RATE_WINDOW_S", "0.2")  # --once waits one window
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        args = ["run", "--once", "--dry-run"]
        for item in sets:
            args += ["--set", item]
        code = main(args)
        captured = capsys.readouterr()
        run.out = captured.out
        return code, [line for line in captured.err.splitlines() if line.strip()]

    run.out = ""
    return run


def test_baseline_runs(run_once):
    code, err = run_once()
    assert code == 0, err


def write(tmp_path: Path, name: str, data: bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def zero_calibration(tmp_path: Path) -> Path:
    cal = zero_cost_calibration()
    return write(tmp_path, "zero.json", json.dumps(cal).encode())


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"SD_CONTROLLER_QUERIES": "{bad"}, "setting queries (SD_CONTROLLER_QUERIES): value is not valid JSON"),
        ({"SD_CONTROLLER_DRAFT_LENGTH_CANDIDATES": "[1, 2"}, "SD_CONTROLLER_DRAFT_LENGTH_CANDIDATES"),
        ({"SD_CONTROLLER_HOOK_EXEC_ARGV": "not json"}, "SD_CONTROLLER_HOOK_EXEC_ARGV"),
        ({"SD_CONTROLLER_VLLM_METRICS_URL": "http://127.0.0.1:99999/metrics"}, "vllm_metrics_url"),
        ({"SD_CONTROLLER_HOOK_URL": "http://127.0.0.1:port"}, "hook_url"),
        ({"SD_CONTROLLER_EVALUATION_INTERVAL_S": "inf"}, "evaluation_interval_s"),
        ({"SD_CONTROLLER_ENABLE_THRESHOLD": "nan"}, "enable_threshold"),
        ({"SD_CONTROLLER_ENABLE_TRESHOLD": "2"}, "SD_CONTROLLER_ENABLE_TRESHOLD"),
        ({"SD_CONTROLLER_DRAFT_LENGTH_CANDIDATES": "[1, 100]"}, "1..64"),
    ],
)
def test_bad_settings_exit_2_with_one_line(run_once, env, needle):
    code, err = run_once(env)
    assert code == 2 and len(err) == 1, err
    assert needle in err[0] and "Traceback" not in err[0]


def test_hook_token_variable_is_not_an_unknown_setting(run_once):
    code, err = run_once({"SD_CONTROLLER_HOOK_TOKEN": "s3cret"})
    assert code == 0, err


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda d: write(d, "bin.json", b"\xff\xfe\x00garbage"), "not UTF-8"),
        (lambda d: write(d, "deep.json", b"[" * 100_000), "nested too deeply"),
        (lambda d: d, "Is a directory"),
        (zero_calibration, "no finite, positive latency"),
    ],
)
def test_bad_calibration_files_exit_2_with_one_line(run_once, tmp_path, make, needle):
    code, err = run_once(calibration=make(tmp_path))
    assert code == 2 and len(err) == 1, err
    assert needle in err[0] and "calibration_file" in err[0]


def test_state_file_that_is_a_directory_exits_2(run_once, tmp_path):
    (tmp_path / "state" / "state.json").mkdir(parents=True)
    code, err = run_once()
    assert code == 2 and len(err) == 1 and "state_file" in err[0], err


def test_unwritable_state_directory_exits_2(run_once):
    # /proc/self refuses new files even to root: a read-only state directory without chmod.
    code, err = run_once({"SD_CONTROLLER_STATE_FILE": "/proc/self/sd-state.json"})
    assert code == 2 and len(err) == 1 and "cannot write" in err[0], err


@pytest.mark.parametrize("data", [b"\xff\xfe\x00garbage", b"[" * 100_000], ids=["not-utf8", "deep"])
def test_undecodable_state_file_is_set_aside_not_a_traceback(run_once, tmp_path, data):
    path = tmp_path / "state" / "state.json"
    path.parent.mkdir()
    path.write_bytes(data)
    code, err = run_once()
    assert code == 0, err
    assert list(path.parent.glob("state.json.corrupt-*"))


def test_once_in_direct_mode_takes_two_scrapes_and_decides(run_once):
    from tests.support.fake_vllm import FakeVllmServer

    with FakeVllmServer() as fake:
        code, err = run_once({"SD_CONTROLLER_VLLM_METRICS_URL": fake.metrics_url, "SD_CONTROLLER_RATE_WINDOW_S": "1"})
        assert fake.scrapes == 2
    assert code == 0, err
    assert any("again in 1s" in line for line in err), err
    assert "warming_up" not in run_once.out and "predicted speedup" in run_once.out, run_once.out


def test_state_file_is_read_once_at_start(run_once, monkeypatch):
    from controller.state_store import FileStateStore

    loads = []
    real_load = FileStateStore.load
    monkeypatch.setattr(FileStateStore, "load", lambda self: loads.append(self.path) or real_load(self))
    code, err = run_once()
    assert code == 0, err
    assert len(loads) == 1
