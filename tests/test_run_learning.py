"""``sd-controller run`` with the learner's files: bad ones cost one line, never the daemon."""

from tests.test_run_config import run_once  # noqa: F401 - the fixture


def test_an_evidence_path_that_is_a_directory_exits_2_with_one_line(run_once, tmp_path):  # noqa: F811
    (tmp_path / "evdir").mkdir()
    code, err = run_once(env={"SD_CONTROLLER_EVIDENCE_FILE": str(tmp_path / "evdir")})
    assert code == 2 and len(err) == 1, err
    assert "setting evidence_file" in err[0] and "evdir" in err[0]


def test_a_corrupt_correction_file_is_set_aside_and_the_run_goes_on(run_once, tmp_path):  # noqa: F811
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (state_dir / "sd-controller-correction.json").write_text("{not json")
    (state_dir / "sd-controller-evidence.jsonl").write_text("garbage\n")
    code, err = run_once(env={"SD_CONTROLLER_LOG_FORMAT": "json"})
    assert code == 0, err
    events = "\n".join(err)
    assert events.count('"correction_file_corrupt"') == 1 and events.count('"evidence_file_corrupt"') == 1
    assert len(list(state_dir.glob("sd-controller-correction.json.corrupt-*"))) == 1
    assert len(list(state_dir.glob("sd-controller-evidence.jsonl.corrupt-*"))) == 1
