"""Pure argv handling of the launcher: tables of command lines in, profiles out."""

from __future__ import annotations

import json

import pytest

from controller.admin_api import OFF, SdConfig
from controller.errors import InputError
from controller.launcher.profile import (
    build_argv,
    parse_profile,
    redact_argv,
    resolve_config,
    shutdown_timeout_s,
    vllm_url,
)

BASE = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m", "--port", "9000"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
NGRAM_JSON = json.dumps(NGRAM)


@pytest.mark.parametrize(
    ("argv", "spec"),
    [
        pytest.param(BASE, None, id="no-sd"),
        pytest.param([*BASE, "--speculative-config", NGRAM_JSON], NGRAM, id="json"),
        pytest.param([*BASE, "-sc", NGRAM_JSON], NGRAM, id="short"),
        pytest.param([*BASE, f"--speculative-config={NGRAM_JSON}"], NGRAM, id="equals"),
        pytest.param(["python", "--speculative-config", NGRAM_JSON, *BASE[1:]], NGRAM, id="json-in-middle"),
        pytest.param(
            [
                *BASE,
                "--speculative-config.method",
                "ngram",
                "--speculative-config.num_speculative_tokens",
                "4",
                "--speculative-config.prompt_lookup_max=3",
            ],
            NGRAM,
            id="dotted",
        ),
        pytest.param(
            [
                *BASE,
                "--spec-method",
                "ngram",
                "--spec-tokens",
                "4",
                "--speculative-config.prompt_lookup_max",
                "3",
            ],
            NGRAM,
            id="spec-aliases",
        ),
        pytest.param(
            [*BASE, "--spec-model", "org/draft", "--spec-tokens=2"],
            {"model": "org/draft", "num_speculative_tokens": 2},
            id="spec-model",
        ),
        pytest.param(
            [
                *BASE,
                "--speculative-config",
                NGRAM_JSON,
                "--speculative-config.num_speculative_tokens",
                "6",
            ],
            {**NGRAM, "num_speculative_tokens": 6},
            id="later-overrides",
        ),
        pytest.param(
            [*BASE, "--speculative-config.draft.tp", "1"],
            {"draft": {"tp": 1}},
            id="nested-dotted",
        ),
    ],
)
def test_parse_profile_splits_sd_from_the_rest(argv, spec):
    profile = parse_profile(argv)
    assert list(profile.base_argv) == BASE
    assert profile.spec == spec
    assert profile.sd_available is (spec is not None)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([*BASE, "--speculative-config", "{nope"], "not valid JSON"),
        ([*BASE, "--speculative-config", "[1]"], "expected a JSON object"),
        ([*BASE, "--speculative-config"], "missing value"),
        ([*BASE, "--spec-tokens"], "missing value"),
        ([*BASE, "--speculative-config", '{"num_speculative_tokens": 0}'], "outside 1..64"),
        ([*BASE, "--speculative-config", '{"num_speculative_tokens": "4"}'], "expected an integer"),
        ([*BASE, "--speculative-config.", "1"], "empty key"),
    ],
)
def test_parse_profile_rejects_bad_spec_in_one_line(argv, message):
    with pytest.raises(InputError, match=message) as exc:
        parse_profile(argv)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize(
    ("config", "expected_tail"),
    [
        (OFF, []),
        (
            SdConfig(True, None),
            ["--speculative-config", json.dumps(NGRAM, separators=(",", ":"), sort_keys=True)],
        ),
        (
            SdConfig(True, 7),
            [
                "--speculative-config",
                json.dumps({**NGRAM, "num_speculative_tokens": 7}, separators=(",", ":"), sort_keys=True),
            ],
        ),
    ],
)
def test_build_argv_adds_one_canonical_spec_flag(config, expected_tail):
    profile = parse_profile(
        [
            *BASE,
            "--spec-method",
            "ngram",
            "--speculative-config.num_speculative_tokens",
            "4",
            "--speculative-config",
            '{"prompt_lookup_max": 3}',
        ]
    )
    assert build_argv(profile, config) == [*BASE, *expected_tail]


def test_build_argv_refuses_sd_without_spec():
    with pytest.raises(InputError, match="no --speculative-config"):
        build_argv(parse_profile(BASE), SdConfig(True, 4))


def test_round_trip_keeps_off_profile_free_of_sd():
    profile = parse_profile([*BASE, "-sc", NGRAM_JSON])
    again = parse_profile(build_argv(profile, SdConfig(True, 5)))
    assert again.base_argv == profile.base_argv
    assert again.spec == {**NGRAM, "num_speculative_tokens": 5}
    assert parse_profile(build_argv(profile, OFF)).spec is None


@pytest.mark.parametrize(
    ("enabled", "tokens", "expected"),
    [
        (False, None, OFF),
        (False, 9, OFF),
        (True, None, SdConfig(True, 4)),
        (True, 9, SdConfig(True, 9)),
    ],
)
def test_resolve_config(enabled, tokens, expected):
    assert resolve_config(parse_profile([*BASE, "-sc", NGRAM_JSON]), enabled, tokens) == expected


def test_resolve_config_without_spec():
    assert resolve_config(parse_profile(BASE), False, None) == OFF
    with pytest.raises(InputError, match="no speculative config"):
        resolve_config(parse_profile(BASE), True, None)


def test_default_config_without_token_count():
    assert parse_profile([*BASE, "--spec-model", "d"]).default_config == SdConfig(True, None)


@pytest.mark.parametrize(
    ("argv", "url"),
    [
        ([], "http://127.0.0.1:8000"),
        (["--port", "9000"], "http://127.0.0.1:9000"),
        (["--host", "0.0.0.0", "--port=9001"], "http://127.0.0.1:9001"),
        (["--host=10.1.2.3"], "http://10.1.2.3:8000"),
        (["--host", "::1", "--port", "8001"], "http://[::1]:8001"),
        (["--host", "::"], "http://127.0.0.1:8000"),
        (["--port", "1", "--port", "2"], "http://127.0.0.1:2"),
    ],
)
def test_vllm_url(argv, url):
    assert vllm_url(argv) == url


def test_vllm_url_bad_port():
    with pytest.raises(InputError, match="--port"):
        vllm_url(["--port", "http"])


@pytest.mark.parametrize(
    ("argv", "expected"),
    [([], None), (["--shutdown-timeout", "12"], 12.0), (["--shutdown-timeout=0.5"], 0.5)],
)
def test_shutdown_timeout(argv, expected):
    assert shutdown_timeout_s(argv) == expected


@pytest.mark.parametrize("bad", ["x", "-1"])
def test_shutdown_timeout_bad(bad):
    with pytest.raises(InputError, match="--shutdown-timeout"):
        shutdown_timeout_s(["--shutdown-timeout", bad])


def test_redact_argv_hides_secret_values():
    argv = ["vllm", "--api-key", "s3cret", "--hf-token=abc", "--model", "m", "--port", "1"]
    assert redact_argv(argv) == [
        "vllm",
        "--api-key",
        "***",
        "--hf-token=***",
        "--model",
        "m",
        "--port",
        "1",
    ]
