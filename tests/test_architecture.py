"""docs/architecture.md stays true: the walkthroughs name real places, the core stays pure."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
PURE = ("model", "policy", "assessment", "switch_cost", "risk", "acceptance", "queueing", "treads", "fleet")
# What the pure core may import: each other and value types without I/O.
PURE_MAY_IMPORT = {f"controller.{m}" for m in PURE} | {
    "controller.observation",
    "controller.state",
    "controller.config",
    "controller.hooks.base",
    "controller.admin_api",
    "controller.events",
}


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names if node.module == "controller")
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("controller.")}


@pytest.mark.parametrize("module", PURE)
def test_the_core_imports_nothing_with_io(module):
    assert imports(ROOT / "controller" / f"{module}.py") <= PURE_MAY_IMPORT


@pytest.mark.parametrize(
    ("path", "names"),
    [
        ("controller/sources/base.py", ["class Source(Protocol)"]),
        ("controller/sources/setup.py", ["class SourceSettings(", "def build_source("]),
        ("controller/hooks/base.py", ["class Hook(Protocol)", "class HookStatus", "class ChangeRequest"]),
        (
            "controller/hooks/setup.py",
            ["class HookType(", "class HookSettings(", "def _hook_consistent(", "def build_hook("],
        ),
        ("controller/policy.py", ["class Reason(", "def decide("]),
        ("controller/config.py", ["class DecisionSettings(", "class PricingSettings(", "class PolicyConfig("]),
        ("controller/state_store.py", ["class StateStore(Protocol)"]),
    ],
)
def test_walkthroughs_name_real_places(path, names):
    assert path in DOC or Path(path).name in DOC
    text = (ROOT / path).read_text(encoding="utf-8")
    for name in names:
        assert name in text, f"{path}: {name}"


def test_policy_config_carries_the_decision_and_pricing_groups():
    from controller.config import DecisionSettings, PolicyConfig, PricingSettings

    assert issubclass(PolicyConfig, DecisionSettings) and issubclass(PolicyConfig, PricingSettings)


def test_the_library_never_imports_the_commands():
    for path in (ROOT / "controller").rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("controller/commands/", "controller/cli.py")):
            continue
        bad = [m for m in imports(path) if re.match(r"controller\.(commands|cli)\b", m)]
        assert not bad, f"{rel} imports {bad}"


def test_every_import_of_the_package_resolves_lazy_ones_included():
    import importlib

    missing = []
    for path in sorted((ROOT / "controller").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("controller"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if not hasattr(module, alias.name):
                        try:
                            importlib.import_module(f"{node.module}.{alias.name}")
                        except ModuleNotFoundError:
                            missing.append(f"{path.relative_to(ROOT)}: {node.module}.{alias.name}")
    assert not missing
