"""Bad input found by an adversarial pass: each case a clear one-line error (or a safe hold),
never a traceback, a leaked token, a half-written file or a wrong fit."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from controller import calibration as cal_mod
from controller.errors import ConfigError, InputError, redact_url
from controller.evidence import FileEvidenceStore
from controller.hooks.base import ChangeRequest, HookError, HookPhase
from controller.hooks.exec import OUTPUT_TAIL_BYTES, ExecHook, run_in_group
from controller.hooks.http import HttpHook, parse_status
from controller.launcher.state import load_state
from controller.model import Workload, best_draft_length, predict_point, speedup_point
from controller.settings import load_settings, read_config_file
from controller.shipped import example_calibration_path
from controller.state_store import FileStateStore
from controller.tokens import read_token
from tests.support import LEGACY_CALIBRATION, zero_cost_calibration
from tests.support.stub_http import StubHttp
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench/results/fidelity-a100-coarse-2k"
SECRET = "S3CRET-part1"
CHANGE = ChangeRequest(enabled=False, num_speculative_tokens=None, reason="test", predicted_speedup=0.9)


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "controller.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The command failed with exit 2 and one error line on stderr, no traceback (after
    argparse's usage block, for an option's value)."""
    assert proc.returncode == 2, proc.stderr
    *usage, line = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr, proc.stderr
    assert not usage or (usage[0].startswith("usage:") and all(u.startswith(" ") for u in usage[1:])), proc.stderr
    return line


# ---- bench CSVs ------------------------------------------------------------------------------


def mutated(tmp_path: Path, name: str, edit) -> Path:
    lines = (BENCH / "bench-g0.csv").read_text().splitlines()
    out = tmp_path / name
    out.write_text("\n".join(edit(lines)) + "\n")
    return out


def set_latency(line: str, value: str) -> str:
    cells = line.split(",")
    cells[5] = value
    return ",".join(cells)


def test_a_timing_glitch_is_refused_with_its_line(tmp_path):
    # One decode step read at 24 µs among its repetitions at 24 ms took the fit's intercept to 0.
    path = mutated(tmp_path, "g0.csv", lambda ls: [*ls[:67], set_latency(ls[67], "0.000024"), *ls[68:]])
    rows, _ = cal_mod.read_bench_csv(path)
    with pytest.raises(InputError, match=r"g0\.csv:68: column latency_s: 2\.4e-05 s is under 0\.25 of the 3"):
        cal_mod.drop_warmup(rows, 0)


def test_a_zero_timing_is_refused_after_the_warm_up_not_in_it(tmp_path):
    # A warm-up iteration may read 0 s (two streamed chunks together; the shipped CPU bench has
    # one): dropped, it is no error; kept, it is.
    first = next(i for i, line in enumerate((BENCH / "bench-g0.csv").read_text().splitlines()) if line.endswith(",0,0"))
    path = mutated(tmp_path, "g0.csv", lambda ls: [*ls[:1], set_latency(ls[1], "0"), *ls[2:]])
    rows, _ = cal_mod.read_bench_csv(path)
    assert rows[0].iteration == 0 and first >= 0
    cal_mod.drop_warmup(rows, 1)
    with pytest.raises(InputError, match=r"g0\.csv:2: column latency_s: a \w+ step of 0 s is no timing"):
        cal_mod.drop_warmup(rows, 0)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda ls: [*ls, ls[5]], r":\d+: repeats line 6 \(the same \w+ step and iteration\)"),
        (
            lambda ls: [ls[0] + ",latency_s", *(line + ",9" for line in ls[1:])],
            r":1: column\(s\) latency_s named twice",
        ),
        (lambda ls: [*ls[:3], ls[3] + ",7", *ls[4:]], r":4: 9 cells for 8 columns"),
        (
            lambda ls: [
                ls[0].replace(",draft_length", ""),
                *(",".join(line.split(",")[:6] + line.split(",")[7:]) for line in ls[1:]),
            ],
            r":1: column chunk_tokens without draft_length",
        ),
    ],
    ids=["repeated-row", "header-twice", "extra-cell", "chunks-without-draft-length"],
)
def test_bench_csv_structure(tmp_path, edit, message):
    with pytest.raises(InputError, match=message):
        cal_mod.read_bench_csv(mutated(tmp_path, "g0.csv", edit))


def test_the_same_bench_file_twice_is_refused(tmp_path):
    copy = tmp_path / "copy.csv"
    copy.write_bytes((BENCH / "bench-g0.csv").read_bytes())
    with pytest.raises(InputError, match="the same bench file as"):
        cal_mod.read_bench_csvs([BENCH / "bench-g0.csv", copy])


def test_calibrate_refuses_to_write_over_its_input(tmp_path):
    victim = tmp_path / "bench-g4.csv"
    victim.write_bytes((BENCH / "bench-g4.csv").read_bytes())
    before = victim.read_bytes()
    proc = cli(
        "calibrate",
        str(BENCH / "bench-g0.csv"),
        str(BENCH / "bench-g2.csv"),
        str(victim),
        "--warmup",
        "0",
        "-o",
        str(victim),
    )
    assert "is an input" in one_line_error(proc)
    assert victim.read_bytes() == before


def test_calibrate_into_a_directory_is_one_line(tmp_path):
    proc = cli("calibrate", *(str(BENCH / f"bench-g{g}.csv") for g in (0, 2, 4)), "--warmup", "0", "-o", str(tmp_path))
    assert "cannot write the calibration" in one_line_error(proc)


# ---- calibration files -----------------------------------------------------------------------


def example() -> dict:
    return json.loads(example_calibration_path().read_text())


def knee_nan(c):
    c["phases"]["target"]["knees"] = [{"at_tokens": 1000.0, "slope_delta_s_per_token": float("nan")}]


def all_zero(c):
    c["phases"] = zero_cost_calibration()["phases"] | {"decode_staircase": [], "verify_staircase": []}


def stair_takes_the_step(c):
    c["phases"]["decode_staircase"] = [{"batch_size": 1, "residual_s": -0.05}]


def schema_true(c):
    c["schema_version"] = True


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (knee_nan, "slope_delta_s_per_token: Input should be a finite number"),
        (all_zero, "predicts no finite, positive latency for a request alone"),
        (stair_takes_the_step, "predicts no finite, positive latency for a request alone"),
        (schema_true, "schema_version 'true' is not supported"),
    ],
    ids=["knee-nan", "all-zero", "staircase-below-zero", "schema-true"],
)
def test_calibration_files_that_price_nothing_fail_on_load(edit, message):
    c = example()
    edit(c)
    with pytest.raises(InputError, match=message):
        cal_mod.parse(json.dumps(c), "cal.json")


def test_a_calibration_with_an_endless_integer_is_one_line():
    text = example_calibration_path().read_text().replace('"schema_version": 2', '"schema_version": ' + "9" * 5000)
    with pytest.raises(InputError, match=r"cal\.json: not a usable JSON number"):
        cal_mod.parse(text, "cal.json")


def test_predict_with_such_a_file_is_one_line(tmp_path):
    c = example()
    all_zero(c)
    path = tmp_path / "zero.json"
    path.write_text(json.dumps(c))
    assert "predicts no finite, positive latency" in one_line_error(cli("predict", "--calibration", str(path)))


# ---- predict's options and the model's inputs ------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gen-tokens", "nan"], "'nan' is not a finite number"),
        (["--prompt-tokens", "inf"], "'inf' is not a finite number"),
        (["--rates", "1,inf"], "values must be finite numbers >= 0"),
        (["--gen-tokens", "1e300"], "the model cannot price this workload"),
        (["--plot", "out.txt"], "--plot out.txt: unknown image format 'txt'"),
    ],
)
def test_predict_rejects_in_one_line(tmp_path, args, message):
    assert message in one_line_error(cli("predict", *args, cwd=tmp_path))
    assert not (tmp_path / "out.txt").exists()


@pytest.mark.parametrize(
    "kw",
    [
        {"prompt_tokens": float("nan"), "gen_tokens": 256},
        {"prompt_tokens": -5, "gen_tokens": 256},
        {"prompt_tokens": 512, "gen_tokens": 0},
        {"prompt_tokens": 512, "gen_tokens": 256, "gen_tokens_std": float("inf")},
        {"prompt_tokens": 512, "gen_tokens": 256, "cached_prompt_tokens": float("nan")},
    ],
)
def test_a_workload_that_is_no_workload_is_refused(kw):
    with pytest.raises(ValueError, match="workload "):
        Workload(**kw)


def test_the_model_refuses_a_rate_or_acceptance_that_is_no_number():
    model = cal_mod.load(example_calibration_path()).latency_model()
    w = Workload(512, 256)
    for call in (
        lambda: speedup_point(model, float("nan"), 0.7, 4, w),
        lambda: best_draft_length(model, -1.0, 0.7, w),
        lambda: predict_point(model, 2.0, float("nan"), 4, w),
    ):
        with pytest.raises(ValueError, match=r"arrival rate must be finite|acceptance: alpha nan"):
            call()


# ---- tokens and the HTTP hook ----------------------------------------------------------------


@pytest.mark.parametrize("content", [f"{SECRET}\nS3CRET-line2\n", f"{SECRET} part2", f"{SECRET}€"])
def test_a_token_no_header_can_carry_is_refused_without_showing_it(tmp_path, content):
    path = tmp_path / "token"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError) as exc:
        read_token(path, "NO_SUCH_ENV", "setting hook_token_file")
    assert "the token holds a space, a line break or a non-ASCII character" in str(exc.value)
    assert SECRET not in str(exc.value)


def test_a_token_file_with_a_byte_order_mark_reads_the_token(tmp_path):
    path = tmp_path / "token"
    path.write_bytes(b"\xef\xbb\xbf" + SECRET.encode() + b"\n")
    assert read_token(path, "NO_SUCH_ENV", "setting hook_token_file") == SECRET
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        read_token(path, "NO_SUCH_ENV", "setting hook_token_file")


def answering(delay_s: float = 0.0, status: dict | None = None) -> StubHttp:
    """A hook endpoint on 127.0.0.1: POSTs answered after ``delay_s``, GETs with ``status``."""

    def respond(method: str, path: str, body: bytes) -> tuple[int, str, bytes]:
        if method == "POST":
            time.sleep(delay_s)
            return 200, "application/json", b'{"accepted": true}'
        return 200, "application/json", json.dumps(status or {}).encode()

    return StubHttp(respond)


def posts(stub: StubHttp) -> int:
    return sum(method == "POST" for method, _ in stub.requests)


def test_a_change_is_not_posted_again_after_a_read_timeout():
    with answering(delay_s=1.0) as peer:
        hook = HttpHook(peer.url + "/admin/speculative", None, "t0ken", timeout_s=0.3, retries=3)
        with pytest.raises(HookError, match="timed out") as exc:
            hook.request(CHANGE)
        assert exc.value.uncertain
        time.sleep(1.0)
        assert posts(peer) == 1


def test_a_header_the_hook_cannot_send_never_quotes_the_token():
    with answering() as peer:
        hook = HttpHook(peer.url + "/x", peer.url + "/status", f"{SECRET}\nS3CRET-line2", retries=0, timeout_s=1)
        with pytest.raises(HookError) as exc:
            hook.request(CHANGE)
        assert "request not sent (InvalidHeader)" in str(exc.value) and SECRET not in str(exc.value)
        status = hook.status()
        assert status.phase is HookPhase.UNKNOWN and SECRET not in (status.last_error or "")
        assert posts(peer) == 0


@pytest.mark.parametrize(
    "body",
    [
        {"phase": "ready", "applied": {"enabled": True, "num_speculative_tokens": 100000}},
        {"phase": "ready", "applied": {"enabled": True, "num_speculative_tokens": -5}},
        {"phase": "ready", "applied": {"enabled": True, "num_speculative_tokens": 4}, "restart_durations_s": [-30.0]},
        {"phase": "ready", "applied": {"enabled": True, "num_speculative_tokens": 4}, "last_restart_duration_s": 1e999},
    ],
)
def test_a_status_the_controller_would_misprice_is_unreadable(body):
    with pytest.raises(ValueError):
        parse_status(body)
    with answering(status=body) as peer:
        status = HttpHook(peer.url + "/x", peer.url + "/status", None, retries=0, timeout_s=1).status()
    assert status.phase is HookPhase.UNKNOWN and status.applied_enabled is None
    assert "bad status body (status: " in status.last_error and "\n" not in status.last_error


def test_urls_are_shown_without_credentials_or_query():
    assert redact_url("http://u:pw@h:8/x?token=S3CRET") == "http://h:8/x?…"
    assert redact_url("http://u:pw@[::1]:80/a") == "http://[::1]:80/a"
    assert redact_url("http://[::1/x") == "(unreadable URL)"


# ---- the exec hook's output ------------------------------------------------------------------


def test_an_exec_hook_printing_bytes_that_are_not_utf8_still_applies(tmp_path):
    hook = ExecHook(["sh", "-c", "printf 'caf\\351\\n'"], timeout_s=10, initial_enabled=True)
    hook.request(ChangeRequest(enabled=False, num_speculative_tokens=None, reason="test"))
    wait_until(lambda: hook.status().phase is not HookPhase.RESTARTING, 10, "the hook to settle")
    status = hook.status()
    assert status.phase is HookPhase.READY and status.applied_enabled is False


def test_an_exec_hooks_output_is_kept_as_its_tail():
    code, out, _ = run_in_group(
        ["sh", "-c", "head -c 3000000 /dev/zero | tr '\\0' x; echo; echo last-line"], os.environ.copy(), 30
    )
    assert code == 0 and len(out.encode()) <= OUTPUT_TAIL_BYTES and out.strip().endswith("last-line")


# ---- config and state files ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (b"1: 2\n", "key 1 is not a setting name"),
        (b"a: [\n", "not valid YAML: expected the node content"),
        (b"\xff\xfeo\x00n\x00", "not UTF-8 text"),
        (b"a:" + b"[" * 5000, "config file"),
    ],
)
def test_config_files_that_are_not_settings(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_bytes(text)
    with pytest.raises(ConfigError, match=message) as exc:
        read_config_file(path)
    assert "\n" not in str(exc.value)


def test_yaml_switch_words_and_numbers_read_as_the_settings_mean(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("override: off\nreplica_id: 7\n")
    s = load_settings(path, calibration_file="example")
    assert s.override.value == "off" and s.replica_id == "7"
    monkeypatch.setenv("SD_CONTROLLER_EXPECTED_PEAK_RPS", "50")
    assert load_settings(None, calibration_file="example").expected_peak_rps == 50
    assert load_settings(None, calibration_file="example", expected_peak_rps=None).expected_peak_rps is None


@pytest.mark.parametrize(
    ("text", "overrides", "message"),
    [
        ("draft_length: yes\n", {}, "setting draft_length .*: true is a yes/no value, not a number"),
        ("", {"draft_length": True}, "setting draft_length .*: true is a yes/no value"),  # --set draft_length=true
        ("", {"dwell_s": False}, "setting dwell_s .*: false is a yes/no value"),
        ("draft_length_candidates: [2, true]\n", {}, r"draft_length_candidates .*: true \(in the list\) is a yes/no"),
    ],
)
def test_a_number_given_as_yes_or_no_is_refused_not_read_as_1_or_0(tmp_path, text, overrides, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_settings(path if text else None, calibration_file="example", **overrides)
    # a switch stays a switch, a number a number
    s = load_settings(None, calibration_file="example", adapt_draft_length=True, draft_length=3)
    assert s.adapt_draft_length is True and s.draft_length == 3


def test_a_state_file_with_an_endless_integer_is_set_aside(tmp_path):
    path = tmp_path / "state.json"
    path.write_text('{"version": 1, "last_change_at": ' + "9" * 400 + "}")
    FileStateStore(path).load()
    assert not path.exists() and list(tmp_path.glob("state.json.corrupt*"))


def test_an_evidence_file_nested_without_end_is_set_aside(tmp_path):
    path = tmp_path / "evidence.jsonl"
    path.write_text("[" * 100_000 + "\n")
    assert FileEvidenceStore(path).load() == []
    assert not path.exists()


def test_the_launchers_state_path_that_is_a_directory_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"--state-file .*: cannot read"):
        load_state(tmp_path)
    nested = tmp_path / "s.json"
    nested.write_text("[" * 100_000)
    assert load_state(nested) is None and (tmp_path / "s.json.corrupt").exists()


# ---- signals ---------------------------------------------------------------------------------


def test_sigterm_while_a_log_write_blocks_still_stops_the_daemon(tmp_path):
    """A slow log collector fills stderr's pipe and the main thread blocks inside a log write;
    a handler that logged would wait on that write's lock, held by its own thread, forever."""
    import fcntl
    import signal
    import socket

    from tests.support.fake_vllm import FakeVllmServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SD_CONTROLLER_")}
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, 1031, 4096)  # F_SETPIPE_SZ: a 4 KiB pipe, nobody reading it yet
    with FakeVllmServer(sd_enabled=False) as vllm:
        env |= {
            "SD_CONTROLLER_CALIBRATION_FILE": LEGACY_CALIBRATION,
            "SD_CONTROLLER_VLLM_METRICS_URL": vllm.metrics_url,
            "SD_CONTROLLER_HOOK_TYPE": "none",
            "SD_CONTROLLER_EVALUATION_INTERVAL_S": "1",
            "SD_CONTROLLER_RATE_WINDOW_S": "2",
            "SD_CONTROLLER_STATE_FILE": str(tmp_path / "state.json"),
            "SD_CONTROLLER_EXPORTER_HOST": "127.0.0.1",
            "SD_CONTROLLER_EXPORTER_PORT": str(port),
            "SD_CONTROLLER_LOG_FORMAT": "json",
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "controller.cli", "run"], env=env, stdout=write_end, stderr=write_end, cwd=tmp_path
        )
        os.close(write_end)
        got: list[bytes] = []
        try:
            for _ in range(40):  # bounded: until the pipe is full (a tick's log lines fill 4 KiB)
                vllm.advance(requests=2, prompt_tokens=1024, gen_tokens=512, e2e_latency_s=2.0)
                time.sleep(0.25)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)

            def drain() -> None:  # the collector catches up
                while chunk := os.read(read_end, 65536):
                    got.append(chunk)

            threading.Thread(target=drain, daemon=True).start()
            assert proc.wait(timeout=20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        wait_until(lambda: b'"stopped"' in b"".join(got), 5, "the last log line")
        assert b'"shutdown_requested"' in b"".join(got)


def test_an_exporter_host_that_does_not_resolve_names_the_host(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SD_CONTROLLER_")}
    env |= {
        "SD_CONTROLLER_CALIBRATION_FILE": LEGACY_CALIBRATION,  # the example's warning is a log line of its own
        "SD_CONTROLLER_EXPORTER_HOST": "nosuchhost.invalid",
        "SD_CONTROLLER_STATE_FILE": str(tmp_path / "state.json"),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "controller.cli", "run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert one_line_error(proc).startswith("sd-controller run: error: setting exporter_host: cannot listen on")


def test_rows_dropped_for_a_wrong_kv_cache_row_name_that_row(tmp_path):
    path = mutated(
        tmp_path,
        "g0.csv",
        lambda ls: [
            ",".join(c if i != 3 else "1" for i, c in enumerate(line.split(",")))
            if line.startswith("kv_cache")
            else line
            for line in ls
        ],
    )
    rows, _ = cal_mod.read_bench_csv(path)
    with pytest.raises(InputError, match=r"row\(s\) were dropped as past the KV cache of .*g0\.csv:\d+ \(1 tokens\)"):
        cal_mod.fit_phases(rows, warmup=0)


@pytest.mark.parametrize("as_json", [True, False], ids=["json", "table"])
def test_a_reader_that_leaves_early_ends_predict_quietly(as_json):
    rates = ",".join(str(i / 10) for i in range(1, 150))  # ~600 KB of JSON: past any pipe's buffer
    argv = [sys.executable, "-m", "controller.cli", "predict", "--rates", rates, "--draft-lengths", "1,2,3,4,5,6"]
    proc = subprocess.Popen(
        argv + (["--json"] if as_json else []), stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT
    )
    assert proc.stdout.read(10)  # what `| head -c 10` reads, then it goes
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr


@pytest.mark.parametrize(
    "column", ["gen_tokens_std", "prompt_tokens_std", "mean_prompt_tokens", "running_context_tokens"]
)
def test_a_load_test_length_past_any_servers_is_refused_with_its_line(tmp_path, column):
    lines = (ROOT / "bench/results/fidelity-h100/load-chat.csv").read_text().splitlines()
    at = lines[0].split(",").index(column)
    cells = lines[3].split(",")
    cells[at] = "1e200"  # squared on its way to a spread: inf, and validate printed nan
    path = tmp_path / "load.csv"
    path.write_text("\n".join([*lines[:3], ",".join(cells), *lines[4:]]) + "\n")
    with pytest.raises(InputError, match=rf"load\.csv:4: column {column}: 1e\+200 tokens a request is past any"):
        cal_mod.read_load_csv(path)
    proc = cli("validate", str(ROOT / "bench/results/fidelity-h100/calibration.json"), str(path))
    assert f"load.csv:4: column {column}" in one_line_error(proc)
