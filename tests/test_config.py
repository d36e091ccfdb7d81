"""Settings grouped by concern: every setting in exactly one group, env names unchanged, and the
pure core given only its frozen PolicyConfig."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pydantic import ValidationError

from controller.config import PolicyConfig
from controller.settings import ENV_PREFIX, GROUPS, Settings

ROOT = Path(__file__).resolve().parents[1]


def test_every_setting_is_in_exactly_one_group():
    grouped = [name for cls in GROUPS.values() for name in cls.model_fields]
    assert sorted(grouped) == sorted(Settings.model_fields)
    assert len(grouped) == len(set(grouped))
    for cls in GROUPS.values():
        assert cls.__doc__ and all(f.description for f in cls.model_fields.values())


def test_env_names_are_the_flat_field_names(monkeypatch):
    monkeypatch.setenv(f"{ENV_PREFIX}DWELL_S", "12")
    monkeypatch.setenv(f"{ENV_PREFIX}HOOK_TYPE", "none")
    s = Settings()
    assert s.dwell_s == 12.0 and s.decision.dwell_s == 12.0 and s.policy.dwell_s == 12.0
    assert s.hook.hook_type.value == "none"


def test_groups_and_policy_config_are_frozen_values():
    s = Settings(hook_type="none", rate_window_s=30.0, switch_margin=2.0)
    cfg = s.policy
    assert (cfg.rate_window_s, cfg.switch_margin, cfg.enable_threshold) == (30.0, 2.0, s.enable_threshold)
    with pytest.raises(ValidationError):
        cfg.dwell_s = 1.0  # type: ignore[misc]
    assert not hasattr(cfg, "prometheus_url") and not hasattr(cfg, "hook_url")
    assert set(PolicyConfig.model_fields) <= set(Settings.model_fields)


@pytest.mark.parametrize("module", ["policy.py", "assessment.py"])
def test_the_pure_core_never_imports_the_environment_reading_settings(module):
    tree = ast.parse((ROOT / "controller" / module).read_text(encoding="utf-8"))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "controller.settings" not in imported
