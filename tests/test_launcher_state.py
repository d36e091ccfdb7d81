"""Admin request parsing, initial-state choice and the state file."""

from __future__ import annotations

import json

import pytest

from controller.admin_api import OFF, SdConfig
from controller.errors import ConfigError, InputError
from controller.launcher.profile import parse_profile
from controller.launcher.state import initial_config, load_state, parse_request, save_state

SD = parse_profile(["vllm", "-sc", '{"method":"ngram","num_speculative_tokens":4}'])
NO_SD = parse_profile(["vllm"])


@pytest.mark.parametrize(
    ("body", "enabled", "tokens", "notes"),
    [
        (b'{"enabled": true}', True, None, {}),
        (b'{"enabled": false, "num_speculative_tokens": null}', False, None, {}),
        (b'{"enabled": true, "num_speculative_tokens": 64}', True, 64, {}),
        (
            b'{"enabled": true, "num_speculative_tokens": 1, "reason": "low load",'
            b' "predicted_speedup": 1.42, "requested_by": "ctl-0"}',
            True,
            1,
            {"reason": "low load", "predicted_speedup": "1.42", "requested_by": "ctl-0"},
        ),
    ],
)
def test_parse_request_accepts(body, enabled, tokens, notes):
    request = parse_request(body)
    assert (request.enabled, request.num_speculative_tokens, request.notes) == (
        enabled,
        tokens,
        notes,
    )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "not valid JSON"),
        (b"{nope", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[true]", "JSON object"),
        (b"{}", "missing key 'enabled'"),
        (b'{"enabled": "yes"}', "'enabled' must be a bool"),
        (b'{"enabled": 1}', "'enabled' must be a bool"),
        (b'{"enabled": true, "num_speculative_tokens": "4"}', "must be an integer"),
        (b'{"enabled": true, "num_speculative_tokens": 4.0}', "must be an integer"),
        (b'{"enabled": true, "num_speculative_tokens": true}', "must be an integer"),
        (b'{"enabled": true, "num_speculative_tokens": 0}', "1..64"),
        (b'{"enabled": true, "num_speculative_tokens": 65}', "1..64"),
        pytest.param(
            b'{"enabled": true, "num_speculative_tokens": ' + b"9" * 5000 + b"}",
            "integer that is too long",
            id="5000-digits",
        ),
        pytest.param(b"[" * 60_000, "nested too deeply", id="deep"),
        pytest.param(
            b'{"enabled": true, "reason": ' + b"[" * 30_000 + b"]" * 30_000 + b"}", "nested too deeply", id="deep-note"
        ),
    ],
)
def test_parse_request_rejects_in_one_line(body, message):
    with pytest.raises(InputError, match=message) as exc:
        parse_request(body)
    assert "\n" not in str(exc.value)


def test_log_fields_are_prefixed_and_safe():
    request = parse_request(b'{"enabled": true, "event": "x", "a-b c": [1, 2]}')
    assert request.log_fields() == {"note_event": "x", "note_a_b_c": "[1, 2]"}


def test_parse_request_truncates_long_notes():
    request = parse_request(json.dumps({"enabled": True, "reason": "x" * 5000}).encode())
    assert len(request.notes["reason"]) == 200


@pytest.mark.parametrize(
    ("initial", "profile", "persisted", "expected"),
    [
        ("last", SD, None, SdConfig(True, 4)),
        ("last", NO_SD, None, OFF),
        ("last", SD, OFF, OFF),
        ("last", SD, SdConfig(True, 7), SdConfig(True, 7)),
        ("last", SD, SdConfig(True, None), SdConfig(True, 4)),
        # Persisted "on" but this command line cannot do SD: serve what it can.
        ("last", NO_SD, SdConfig(True, 7), OFF),
        ("on", SD, OFF, SdConfig(True, 4)),
        ("off", SD, SdConfig(True, 7), OFF),
        ("off", NO_SD, None, OFF),
    ],
)
def test_initial_config(initial, profile, persisted, expected):
    assert initial_config(initial, profile, persisted) == expected


def test_initial_on_without_spec_is_a_config_error():
    with pytest.raises(ConfigError, match="--initial-state on"):
        initial_config("on", NO_SD, None)


def test_state_round_trip(tmp_path):
    path = tmp_path / "sub" / "state.json"
    assert load_state(path) is None
    save_state(path, SdConfig(True, 6), now=1000.0)
    assert json.loads(path.read_text())["applied"] == {"enabled": True, "num_speculative_tokens": 6}
    assert load_state(path) == SdConfig(True, 6)
    save_state(path, OFF)
    assert load_state(path) == OFF


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"\xff",
        b"[]",
        b'{"version": 2, "applied": {"enabled": true}}',
        b'{"version": 1, "applied": {"enabled": "yes"}}',
        b'{"version": 1, "applied": {"enabled": true, "num_speculative_tokens": 0}}',
    ],
)
def test_corrupt_state_is_moved_aside(tmp_path, content):
    from structlog.testing import capture_logs

    path = tmp_path / "state.json"
    path.write_bytes(content)
    with capture_logs() as logs:
        assert load_state(path) is None
    assert not path.exists()
    assert (tmp_path / "state.json.corrupt").read_bytes() == content
    assert [e["event"] for e in logs] == ["state_file_corrupt"]
