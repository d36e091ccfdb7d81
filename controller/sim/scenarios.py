"""Scenario files: a small YAML document describing load, acceptance and the simulated server.

A scenario is validated with pydantic; any problem is one :class:`InputError` line naming the
file and the field (``demo.yaml: arrival_rate.diurnal.max: Field required``). Built-in
scenarios live in ``controller/data/scenarios/`` and are referred to by name.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from controller.errors import InputError, validation_error_line
from controller.sim.workload import Constant, RequestClass, Trace

SCENARIO_KIND = "sd-controller/scenario"


class EngineSpec(BaseModel):
    """The simulated vLLM server and what deviates from the calibration (so the controller's
    model is not graded on its own assumptions)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_num_seqs: int | None = Field(None, ge=1, le=4096, description="default: the calibration's")
    max_num_batched_tokens: int = Field(2048, ge=16, description="chunked-prefill token budget per step")
    draft_length: int = Field(4, ge=1, le=64, description="num_speculative_tokens when SD is on")
    initial_sd: bool = Field(True, description="SD applied when the simulation starts")
    restart_downtime_s: float = Field(75.0, ge=0, description="vLLM down time per toggle")
    restart_jitter_s: float = Field(10.0, ge=0, description="± uniform jitter on the downtime")
    drain_limit_s: float = Field(30.0, ge=0, description="in-flight requests get this long to finish")
    cost_noise_sigma: float = Field(0.03, ge=0, le=1, description="lognormal noise on step cost, per tick")
    cost_quadratic_s_per_token2: float = Field(
        0.0, ge=0, description="extra t += q·x² per step (x: tokens in the step)"
    )
    cost_scale_off: float = Field(1.0, gt=0, le=100, description="multiplies step costs with SD off")
    cost_scale_on: float = Field(1.0, gt=0, le=100, description="multiplies step costs with SD on")


class Scenario(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str = SCENARIO_KIND
    name: str = "scenario"
    description: str = ""
    duration_s: float = Field(gt=0, le=31 * 86400)
    tick_s: float = Field(1.0, gt=0, le=60)
    seed: int = 0
    arrival_rate: Trace
    acceptance: Trace = Constant(kind="constant", value=0.8)
    classes: list[RequestClass] = Field(default_factory=lambda: [RequestClass()], min_length=1)
    engine: EngineSpec = EngineSpec()

    @model_validator(mode="after")
    def _kind(self) -> Scenario:
        if self.kind != SCENARIO_KIND:
            raise ValueError(f"kind must be {SCENARIO_KIND!r}")
        return self

    def with_changes(self, **changes) -> Scenario:
        """A copy with top-level fields replaced (``engine`` may be a dict of engine fields)."""
        eng = changes.pop("engine", None)
        if isinstance(eng, dict):
            changes["engine"] = self.engine.model_copy(update=eng)
        elif eng is not None:
            changes["engine"] = eng
        return self.model_copy(update=changes)


def builtin_dir() -> Path:
    return Path(str(resources.files("controller") / "data" / "scenarios"))


def builtin_names() -> list[str]:
    return sorted(p.stem for p in builtin_dir().glob("*.yaml"))


def parse(text: str, where: str) -> Scenario:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise InputError(f"{where}: not valid YAML{at}") from None
    if not isinstance(raw, dict):
        raise InputError(f"{where}: top level must be a mapping")
    try:
        return Scenario.model_validate(raw)
    except ValidationError as exc:
        raise InputError(validation_error_line(where, exc)) from None


def load(name_or_path: str) -> Scenario:
    """A built-in scenario by name, or a YAML file by path."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists() or "/" in name_or_path:
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as exc:
            raise InputError(f"{p}: cannot read scenario file: {exc.strerror or exc}") from None
        return parse(text, str(p))
    builtin = builtin_dir() / f"{name_or_path}.yaml"
    if not builtin.exists():
        raise InputError(
            f"--scenario {name_or_path}: no such file or built-in scenario (built-ins: {', '.join(builtin_names())})"
        )
    return parse(builtin.read_text(encoding="utf-8"), builtin.name)
