"""The README stays true: its example runs, its settings table is the model's, its commands run."""

import re
from pathlib import Path

from controller.settings import readme_with_table

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_library_example_runs_and_prices_the_restart(capsys):
    block = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    hook = namespace["hook"]
    assert hook.changes == []  # at 13 req/s the restart costs more than SD loses: it holds
    out = capsys.readouterr().out
    assert "39 switch_cost_exceeds_gain speedup 0.891 < 1.05" in out
    assert namespace["controller"].registry.get_sample_value("sd_enabled") == 1.0
    reasons = namespace["controller"].registry.get_sample_value(
        "sd_controller_decisions_total", {"action": "none", "reason": "excursion_shorter_than_restart"}
    )
    assert reasons == 23.0  # the filter's wait: restart, drain and backlog (1361 s) at one tick a minute


def test_settings_table_is_generated_from_the_model():
    assert readme_with_table(README) == README, "run: python -m controller.settings --write-readme"


def test_ci_runs_the_readme_test_command():
    assert "bash scripts/test.sh" in README
    ci = (ROOT / ".ci/run").read_text()
    assert re.search(r"^bash scripts/test.sh$", ci, re.M)
