"""Calibration: fit step costs from a micro-benchmark CSV; the calibration file format.

Fitting is pure (rows in, parameters out); reading and writing files is at the edges
(:func:`read_bench_csv`, :func:`load`, :func:`save`). Every input problem raises
:class:`~controller.errors.InputError` with one line naming the file, row and column.
"""

from __future__ import annotations

import bisect
import csv
import datetime as dt
import hashlib
import itertools
import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from controller.atomic import write_json_atomic
from controller.errors import InputError, validation_error_line
from controller.model import (
    MAX_TOKENS_PER_REQUEST,
    STAIR_MAX_GAP_TOKENS,
    LatencyModel,
    Moe,
    StepCost,
    Workload,
    predict_point,
    stair_residual,
)
from controller.treads import describe as describe_treads
from controller.treads import table_period

SCHEMA_VERSION = 2
BENCH_COLUMNS = ("phase", "batch_size", "tokens_per_seq", "context_len", "iteration", "latency_s")
BENCH_OPTIONAL_COLUMNS = ("draft_length", "chunk_tokens")
BENCH_PHASES = ("prefill", "target", "verify", "mixed", "draft", "kv_cache", "prefix_caching")
# Rows that record a fact about the server, not a timing: kv_cache (the capacity in tokens, as
# context_len) and prefix_caching (context_len 1 when it caches prefixes, 0 when not).
FACT_PHASES = ("kv_cache", "prefix_caching")
LOAD_COLUMNS = (
    "rate",
    "sd",
    "draft_length",
    "acceptance_rate",
    "mean_e2e_s",
    "mean_prompt_tokens",
    "mean_gen_tokens",
)
LOAD_OPTIONAL_COLUMNS = (
    "gen_tokens_std",
    "prompt_tokens_std",
    "saturated",
    "duration_s",
    "warmup_s",
    "running_context_tokens",
    "cached_prompt_tokens",
    "served_rps",
    "workload",
    "sent",
)
DEFAULT_WARMUP = 10
MIN_BATCH_SIZES = 3
# A knee must have this many distinct step sizes on each side, lower the BIC by this much and
# the weighted squared error by this fraction: a kink that noise or one odd point can make is
# not a compute knee.
KNEE_MIN_SIDE = 3
KNEE_MIN_BIC_GAIN = 10.0
KNEE_MIN_SSE_GAIN = 0.03
KNEE_LR_CHI2 = 3.84  # 95 % profile-likelihood interval of the knee position

# --------------------------------------------------------------------------------------------
# The file format (pydantic: out-of-range or missing fields fail with the field's path)
# --------------------------------------------------------------------------------------------


class _Strict(BaseModel):
    # Python's json reads NaN and Infinity; no field of a calibration means either.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class KneeSpec(_Strict):
    at_tokens: float = Field(gt=0, description="tokens in the step where the slope changes")
    slope_delta_s_per_token: float = Field(ge=-1, le=1, description="slope added past the knee")
    interval_tokens: tuple[float, float] | None = Field(
        default=None, description="95 % profile-likelihood interval of the knee position"
    )


class SegmentFit(_Strict):
    from_tokens: float
    to_tokens: float
    n: int = Field(ge=0)
    r2: float | None
    rmse_s: float = Field(ge=0)


class PhaseFit(_Strict):
    n: int = Field(ge=0, description="rows used after dropping warm-up iterations")
    r2: float | None
    rmse_s: float = Field(ge=0)
    max_abs_residual_s: float = Field(ge=0)
    relative_rmse: float = Field(default=0.0, ge=0, description="RMSE of residual / measured")
    segments: list[SegmentFit] = []
    notes: list[str] = []


class PhaseSpec(_Strict):
    intercept_s: float = Field(ge=0, le=60, description="load-independent cost of one pass")
    slope_s_per_token: float = Field(ge=0, le=1, description="cost per token in the pass")
    context_s_per_token: float = Field(default=0.0, ge=0, le=1, description="per KV token read")
    seq_s: float = Field(default=0.0, ge=0, le=1, description="per sequence in the pass (sampling, scheduling)")
    attention_s_per_pair: float = Field(
        default=0.0, ge=0, le=1, description="per query-key pair of a prompt chunk's attention (P²/2 for a prompt)"
    )
    knees: list[KneeSpec] = []
    fit: PhaseFit | None = None

    @model_validator(mode="after")
    def _slope_stays_non_negative(self) -> PhaseSpec:
        slope = self.slope_s_per_token
        for knee in sorted(self.knees, key=lambda k: k.at_tokens):
            slope += knee.slope_delta_s_per_token
            if slope < 0:
                raise ValueError("slope past a knee must stay >= 0")
        return self

    def step_cost(self) -> StepCost:
        knees = sorted(self.knees, key=lambda k: k.at_tokens)
        return StepCost(
            self.intercept_s,
            self.slope_s_per_token,
            tuple(k.at_tokens for k in knees),
            tuple(k.slope_delta_s_per_token for k in knees),
            self.context_s_per_token,
            self.seq_s,
            self.attention_s_per_pair,
        )


ZERO_PHASE = PhaseSpec(intercept_s=0.0, slope_s_per_token=0.0)


class StairStep(_Strict):
    batch_size: int = Field(ge=1, le=65536)
    residual_s: float = Field(ge=-10, le=10, description="measured decode step minus the fitted pass")


class VerifyStairStep(_Strict):
    step_tokens: int = Field(ge=1, le=16_777_216, description="target tokens in the SD step: batch × (γ + 1)")
    residual_s: float = Field(ge=-10, le=10, description="measured SD step minus the fitted passes")


class PromptStepTread(_Strict):
    draft_length: int = Field(ge=0, le=64, description="the SD server's draft length; 0: SD off")
    tread_share: float = Field(
        ge=0, le=1, description="share of the decode (verify) step's staircase residual a step carrying a prompt keeps"
    )


class Phases(_Strict):
    target: PhaseSpec = Field(description="one target forward pass: decode, verify or prompt-chunk tokens")
    draft: PhaseSpec = Field(default=ZERO_PHASE, description="one draft forward pass (zero: n-gram)")
    sd_overhead_s: float = Field(default=0.0, ge=0, le=10, description="fixed cost per SD step")
    draft_prefills: bool = Field(default=True, description="the draft model prefills every prompt")
    prefill: PhaseSpec | None = Field(default=None, description="schema 1 only: stand-alone prefill fit")
    verify: PhaseSpec | None = Field(default=None, description="schema 1 only: the whole SD step as one fit")
    decode_staircase: list[StairStep] = Field(
        default=[],
        description="SD off: the decode steps' mean residual per benchmarked batch size (GEMM tiles and "
        "CUDA-graph padding make the step a staircase the fitted line only averages)",
    )
    verify_staircase: list[VerifyStairStep] = Field(
        default=[],
        description="SD on: the SD steps' mean residual per benchmarked step size in target tokens, every "
        "draft length's together (the target's tiles count tokens, not sequences)",
    )
    prompt_step_treads: list[PromptStepTread] = Field(
        default=[],
        description="per benchmarked draft length (0: SD off), what a step carrying a prompt chunk keeps of the "
        "staircase, from the mixed rows (none: the whole tread, as files from before it were read)",
    )

    @model_validator(mode="after")
    def _staircase_ascends(self) -> Phases:
        sizes = [s.batch_size for s in self.decode_staircase]
        if any(b <= a for a, b in itertools.pairwise(sizes)):
            raise ValueError("decode_staircase batch sizes must be strictly increasing")
        tokens = [s.step_tokens for s in self.verify_staircase]
        if any(b <= a for a, b in itertools.pairwise(tokens)):
            raise ValueError("verify_staircase step tokens must be strictly increasing")
        lengths = [t.draft_length for t in self.prompt_step_treads]
        if any(b <= a for a, b in itertools.pairwise(lengths)):
            raise ValueError("prompt_step_treads draft lengths must be strictly increasing")
        return self


class Serving(_Strict):
    max_num_seqs: int = Field(default=256, ge=1, le=65536, description="vLLM --max-num-seqs")
    max_num_batched_tokens: int | None = Field(
        default=None, ge=16, le=1_048_576, description="vLLM --max-num-batched-tokens (chunked-prefill budget per step)"
    )
    kv_cache_tokens_off: int | None = Field(
        default=None, ge=1, le=10**12, description="KV cache capacity without SD, tokens"
    )
    kv_cache_tokens_on: int | None = Field(
        default=None, ge=1, le=10**12, description="KV cache capacity with SD, tokens"
    )
    prefix_caching: bool | None = Field(
        default=None,
        description="vLLM --enable-prefix-caching as the bench read it (vllm:cache_config_info): a preempted"
        " request's blocks stay cached for its readmission; None: not recorded, priced as off (the dearer)",
    )


class Uncertainty(_Strict):
    relative_sd_off: float = Field(default=0.0, ge=0, le=1, description="relative error of a step cost, SD off")
    relative_sd_on: float = Field(default=0.0, ge=0, le=1, description="relative error of a step cost, SD on")


class MoeSpec(_Strict):
    num_experts: int = Field(ge=1)
    top_k: int = Field(ge=1)

    @model_validator(mode="after")
    def _k_within_e(self) -> MoeSpec:
        if self.top_k > self.num_experts:
            raise ValueError("top_k must be <= num_experts")
        return self


class LoadCorrection(_Strict):
    scale_off: float = Field(default=1.0, ge=0.01, le=100)
    scale_on: float = Field(default=1.0, ge=0.01, le=100)


class LoadCheck(_Strict):
    n: int
    r2: float | None
    r2_off: float | None
    r2_on: float | None
    mean_abs_pct_error: float
    paper_fit_r2: float | None = Field(description="L = C1/(1 − rate·C2) per curve, for comparison")
    corrected: bool


class Metadata(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)
    gpu: str = ""
    target_model: str = ""
    draft_model: str = ""
    vllm_version: str = ""
    created: str = ""
    source_file: str = ""
    source_sha256: str = ""
    load_test_file: str = ""
    load_test_sha256: str = ""
    notes: str = ""


class CalibrationFile(_Strict):
    schema_version: Literal[2]
    kind: Literal["sd-controller/calibration"] = "sd-controller/calibration"
    example: bool = False
    metadata: Metadata = Metadata()
    serving: Serving = Serving()
    moe: MoeSpec | None = None
    phases: Phases
    uncertainty: Uncertainty = Uncertainty()
    load_correction: LoadCorrection = LoadCorrection()
    load_check: LoadCheck | None = None
    migrated_from: int | None = Field(default=None, description="schema version this file was read from")

    def latency_model(self, max_num_seqs: int | None = None) -> LatencyModel:
        """The model this calibration describes (optionally with another max_num_seqs)."""
        ph = self.phases
        return LatencyModel(
            target=ph.target.step_cost(),
            draft=ph.draft.step_cost(),
            sd_overhead_s=ph.sd_overhead_s,
            draft_prefills=ph.draft_prefills,
            verify=ph.verify.step_cost() if ph.verify else None,
            prefill=ph.prefill.step_cost() if ph.prefill else None,
            max_num_seqs=max_num_seqs or self.serving.max_num_seqs,
            max_num_batched_tokens=self.serving.max_num_batched_tokens,
            kv_cache_tokens_off=self.serving.kv_cache_tokens_off,
            kv_cache_tokens_on=self.serving.kv_cache_tokens_on,
            prefix_caching=bool(self.serving.prefix_caching),
            moe=Moe(self.moe.num_experts, self.moe.top_k) if self.moe else None,
            scale_off=self.load_correction.scale_off,
            scale_on=self.load_correction.scale_on,
            relative_sd_off=self.uncertainty.relative_sd_off,
            relative_sd_on=self.uncertainty.relative_sd_on,
            decode_staircase_off=tuple((float(x.batch_size), x.residual_s) for x in ph.decode_staircase),
            verify_staircase_on=tuple((float(x.step_tokens), x.residual_s) for x in ph.verify_staircase),
            prompt_step_treads=tuple((float(t.draft_length), t.tread_share) for t in ph.prompt_step_treads),
        )


def load(path: str | Path) -> CalibrationFile:
    """Read and validate a calibration file; one-line :class:`InputError` on any problem."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise InputError(f"{p}: cannot read calibration file: {exc.strerror or exc}") from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{p}: calibration file is not UTF-8 text (byte {exc.start})") from exc
    return parse(text, str(p))


RECALIBRATE_HINT = "recalibrate: sd-controller bench (prefill,target,mixed; verify on the SD server), then calibrate"


def _migrate_v1(raw: dict, where: str) -> dict:
    """Schema 1 → 2: keep the stand-alone prefill and whole-SD-step fits as they were.

    Schema 1 had no mixed-step or draft-prefill data, so the prompt cost stays the stand-alone
    prefill slope and the draft's prefill is not priced; the file says so in ``migrated_from``.
    """
    phases = raw.get("phases")
    if not isinstance(phases, dict):
        raise InputError(f"{where}: schema 1 file without a phases object; {RECALIBRATE_HINT}")
    out = dict(raw)
    out["schema_version"] = 2
    out["migrated_from"] = 1
    out["phases"] = {
        "target": phases.get("target"),
        "draft": phases.get("draft", ZERO_PHASE.model_dump()),
        "prefill": phases.get("prefill"),
        "verify": phases.get("verify"),
        "draft_prefills": False,
        "sd_overhead_s": 0.0,
    }
    return out


def parse(text: str, where: str = "calibration") -> CalibrationFile:
    import json

    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: not valid JSON: {exc.msg} at line {exc.lineno}") from exc
    except RecursionError:
        raise InputError(f"{where}: JSON nested too deeply") from None
    except ValueError as exc:  # an integer past Python's 4,300 digits
        raise InputError(f"{where}: not a usable JSON number: {exc}") from None
    if not isinstance(raw, dict):
        raise InputError(f"{where}: top level must be a JSON object")
    version = raw.get("schema_version")
    if isinstance(version, bool):  # true == 1 in Python: a v2 file would be migrated as v1
        version = str(version).lower()
    if version == 1:
        raw = _migrate_v1(raw, where)
    elif version != SCHEMA_VERSION:
        raise InputError(
            f"{where}: schema_version {version!r} is not supported (this build reads 1 and {SCHEMA_VERSION}); {RECALIBRATE_HINT}"
        )
    try:
        cal = CalibrationFile.model_validate(raw)
    except ValidationError as exc:
        raise InputError(validation_error_line(where, exc)) from exc
    _check_idle(cal, where)
    return cal


def prices_a_request(model: LatencyModel, workload: Workload, draft_length: int = 2) -> bool:
    """Whether the model predicts a finite, positive latency for a request alone, both modes.

    Every field of a calibration can be in range and its costs still price nothing (an
    all-zero target, a staircase residual that takes a whole step): each prediction would then
    divide by zero. A nanosecond is no server either: a zero-cost chain reads 1e-300 s there.
    """
    try:
        with np.errstate(all="ignore"):  # a zero cost's 0/0 is this check's answer, not a warning
            p = predict_point(model, 0.0, 0.5, draft_length, workload)
    except (ArithmeticError, ValueError):
        return False
    return all(math.isfinite(t) and t > 1e-9 for t in (p.latency_off_s, p.latency_on_s))


def _check_idle(cal: CalibrationFile, where: str) -> None:
    """InputError unless the calibration prices a request alone (:func:`prices_a_request`)."""
    if not prices_a_request(cal.latency_model(), Workload(512, 128)):
        raise InputError(
            f"{where}: predicts no finite, positive latency for a request alone (a step costing zero or less); {RECALIBRATE_HINT}"
        )


def save(cal: CalibrationFile, path: str | Path) -> None:
    """Write atomically: a failed run never leaves half a file."""
    try:
        write_json_atomic(path, cal.model_dump(mode="json"))
    except OSError as exc:
        raise InputError(f"{path}: cannot write the calibration: {exc.strerror or exc}") from None


# --------------------------------------------------------------------------------------------
# Reading CSVs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchRow:
    phase: str
    batch_size: int
    tokens_per_seq: int
    context_len: float
    iteration: int
    latency_s: float
    line: int
    draft_length: int = 0  # γ of the measured server; 0 = SD off
    chunk_tokens: int = 0  # prompt tokens riding in the same step (phase mixed)
    source: str = ""


@dataclass(frozen=True)
class LoadRow:
    rate: float
    sd: bool
    draft_length: int
    acceptance_rate: float
    mean_e2e_s: float
    mean_prompt_tokens: float
    mean_gen_tokens: float
    line: int
    gen_tokens_std: float | None = None
    saturated: bool | None = None  # measured: the queue kept growing (None: not recorded)
    prompt_tokens_std: float | None = None
    duration_s: float | None = None  # the test's arrivals span [0, duration) (None: not recorded)
    warmup_s: float = 0.0  # arrivals before this were left out of mean_e2e_s
    # KV tokens per running sequence from the server's gauges (controller.occupancy); None: not measured.
    running_context_tokens: float | None = None
    # Prompt tokens per request served from the prefix cache (vllm:prompt_tokens_cached_total
    # over the run); None: not recorded (priced as no hits).
    cached_prompt_tokens: float | None = None
    # Requests finished per second inside the measured window (at a saturated rate: the
    # server's capacity); None: not recorded.
    served_rps: float | None = None
    # The load test's workload name (``bench --load-test --workload``); "" when not recorded.
    workload_name: str = ""
    # The file the run was read from ("" when built otherwise): one load test's runs, every mode,
    # are sent the same arrivals (its --seed), so validate pairs the modes' runs by it.
    source: str = ""
    # Requests the test sent over [0, duration_s): Poisson arrivals at ``rate`` send ±√n of
    # them; None: not recorded.
    sent: int | None = None

    @property
    def offered_rps(self) -> float:
        """The arrival rate the run was offered: what it sent over its duration where both are
        recorded, else the rate it was asked for."""
        if self.sent and self.duration_s:
            return self.sent / self.duration_s
        return self.rate

    def workload(self) -> Workload:
        """The request shape the run measured, as the model takes it."""
        return Workload(
            self.mean_prompt_tokens,
            self.mean_gen_tokens,
            self.gen_tokens_std,
            self.prompt_tokens_std,
            running_context_tokens=self.running_context_tokens,
            cached_prompt_tokens=self.cached_prompt_tokens or 0.0,
        )


def _read_csv(path: Path, columns: Sequence[str]) -> tuple[list[dict[str, str]], str]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text (byte {exc.start})") from exc
    reader = csv.DictReader(text.splitlines())
    header = [h.strip() for h in (reader.fieldnames or [])]
    missing = [c for c in columns if c not in header]
    if missing:
        raise InputError(f"{path}: missing column(s) {', '.join(missing)} (header: {','.join(header)})")
    twice = sorted({h for h in header if header.count(h) > 1})
    if twice:
        raise InputError(f"{path}:1: column(s) {', '.join(twice)} named twice in the header")
    reader.fieldnames = header
    rows = list(reader)
    if not rows:
        raise InputError(f"{path}: no data rows")
    for i, row in enumerate(rows):
        if None in row:  # DictReader files the cells past the header under None
            raise InputError(f"{path}:{i + 2}: {len(header) + len(row[None])} cells for {len(header)} columns")
    return rows, hashlib.sha256(data).hexdigest()


def _number(path: Path, line: int, column: str, cell: str | None, kind: type = float) -> float:
    value = (cell or "").strip()
    try:
        x = float(value)
    except ValueError:
        raise InputError(f"{path}:{line}: column {column}: {value!r} is not a number") from None
    if not math.isfinite(x):
        raise InputError(f"{path}:{line}: column {column}: {value!r} is not a finite number")
    if kind is int and x != int(x):
        raise InputError(f"{path}:{line}: column {column}: {value!r} is not an integer")
    return x


def read_bench_csv(path: str | Path) -> tuple[list[BenchRow], str]:
    """Rows of a micro-benchmark CSV and the file's SHA-256.

    ``draft_length`` and ``chunk_tokens`` are optional (files from before mixed-step
    benchmarks): then verify rows were measured at γ = tokens_per_seq − 1, everything else with
    SD off.
    """
    p = Path(path)
    raw, digest = _read_csv(p, BENCH_COLUMNS)
    if "chunk_tokens" in raw[0] and "draft_length" not in raw[0]:
        # Mixed-step files record the server's γ: without it an SD server's rows pass for SD off's.
        raise InputError(f"{p}:1: column chunk_tokens without draft_length: the rows cannot say which server ran them")
    rows = []
    for i, r in enumerate(raw):
        line = i + 2  # header is line 1
        phase = (r["phase"] or "").strip().lower()
        if phase not in BENCH_PHASES:
            raise InputError(f"{p}:{line}: column phase: unknown phase {phase!r} (expected {'|'.join(BENCH_PHASES)})")
        batch = _number(p, line, "batch_size", r["batch_size"], int)
        tps = _number(p, line, "tokens_per_seq", r["tokens_per_seq"], int)
        ctx = _number(p, line, "context_len", r["context_len"])
        it = _number(p, line, "iteration", r["iteration"], int)
        lat = _number(p, line, "latency_s", r["latency_s"])
        cell = (r.get("draft_length") or "").strip()
        gamma = int(_number(p, line, "draft_length", cell, int)) if cell else (tps - 1 if phase == "verify" else 0)
        cell = (r.get("chunk_tokens") or "").strip()
        chunk = int(_number(p, line, "chunk_tokens", cell, int)) if cell else 0
        for col, val, low in (("batch_size", batch, 1), ("tokens_per_seq", tps, 1)):
            if val < low:
                raise InputError(f"{p}:{line}: column {col}: {val:g} must be >= {low}")
        if ctx < 0:
            raise InputError(f"{p}:{line}: column context_len: {ctx:g} is negative")
        if lat < 0:
            raise InputError(f"{p}:{line}: column latency_s: {lat:g} is negative")
        if gamma < 0 or chunk < 0:
            raise InputError(f"{p}:{line}: columns draft_length/chunk_tokens must be >= 0")
        if phase == "verify" and (gamma < 1 or tps != gamma + 1):
            raise InputError(f"{p}:{line}: verify row needs tokens_per_seq = draft_length + 1 >= 2")
        if phase == "mixed" and chunk < 1:
            raise InputError(f"{p}:{line}: column chunk_tokens: a mixed row needs a prompt chunk >= 1")
        if phase == "kv_cache" and ctx < 1:
            raise InputError(f"{p}:{line}: column context_len: a kv_cache row needs the capacity in tokens")
        if phase == "prefix_caching" and ctx not in (0, 1):
            raise InputError(f"{p}:{line}: column context_len: a prefix_caching row is 1 (on) or 0 (off), got {ctx:g}")
        rows.append(BenchRow(phase, int(batch), int(tps), ctx, int(it), lat, line, gamma, chunk, str(p)))
    _check_repeats(rows, p)
    return rows, digest


def _check_repeats(rows: Sequence[BenchRow], path: Path) -> None:
    """InputError on a row that repeats another: the same step and iteration (a file pasted
    twice weighs its steps double)."""
    seen: dict[tuple, int] = {}
    for r in rows:
        step = (r.phase, r.batch_size, r.tokens_per_seq, r.context_len, r.draft_length, r.chunk_tokens, r.iteration)
        first = seen.setdefault(step, r.line)
        if first != r.line:
            raise InputError(f"{path}:{r.line}: repeats line {first} (the same {r.phase} step and iteration)")


def read_bench_csvs(paths: Sequence[str | Path]) -> tuple[list[BenchRow], str]:
    """Several bench CSVs (e.g. SD off, γ = 2, γ = 4) as one row list; a digest over all."""
    rows: list[BenchRow] = []
    digests = []
    for path in paths:
        r, d = read_bench_csv(path)
        if d in digests:
            raise InputError(
                f"{path}: the same bench file as {paths[digests.index(d)]} (given twice, it weighs double)"
            )
        rows.extend(r)
        digests.append(d)
    combined = digests[0] if len(digests) == 1 else hashlib.sha256("".join(digests).encode()).hexdigest()
    return rows, combined


def read_load_csv(path: str | Path) -> tuple[list[LoadRow], str]:
    """Rows of a load-test CSV (whole-request latency under load) and the file's SHA-256."""
    p = Path(path)
    raw, digest = _read_csv(p, LOAD_COLUMNS)
    rows = []
    for i, r in enumerate(raw):
        line = i + 2
        sd = (r["sd"] or "").strip().lower()
        if sd not in ("on", "off"):
            raise InputError(f"{p}:{line}: column sd: {sd!r} must be on or off")
        vals = {c: _number(p, line, c, r[c]) for c in LOAD_COLUMNS if c not in ("sd", "acceptance_rate")}
        acc_cell = (r["acceptance_rate"] or "").strip()
        if sd == "on" or acc_cell:
            vals["acceptance_rate"] = _number(p, line, "acceptance_rate", acc_cell)
        else:
            vals["acceptance_rate"] = 0.0
        for c, v in vals.items():
            if v < 0:
                raise InputError(f"{p}:{line}: column {c}: {v:g} is negative")
        if vals["acceptance_rate"] > 1:
            raise InputError(f"{p}:{line}: column acceptance_rate: {vals['acceptance_rate']:g} > 1")
        if sd == "on" and vals["draft_length"] < 1:
            raise InputError(f"{p}:{line}: column draft_length: must be >= 1 when sd is on")
        if vals["mean_gen_tokens"] <= 0:
            raise InputError(f"{p}:{line}: column mean_gen_tokens: must be > 0")
        opt: dict[str, float | None] = {}  # the optional numeric columns: None when empty
        for col in (
            "gen_tokens_std",
            "prompt_tokens_std",
            "duration_s",
            "warmup_s",
            "running_context_tokens",
            "cached_prompt_tokens",
            "served_rps",
            "sent",
        ):
            cell = (r.get(col) or "").strip()
            opt[col] = _number(p, line, col, cell) if cell else None
        for col in ("gen_tokens_std", "prompt_tokens_std", "cached_prompt_tokens", "served_rps"):
            if (opt[col] or 0.0) < 0:
                raise InputError(f"{p}:{line}: column {col}: {opt[col]:g} is negative")
        lengths = {c: vals[c] for c in ("mean_prompt_tokens", "mean_gen_tokens")}
        lengths |= {
            c: opt[c] for c in ("gen_tokens_std", "prompt_tokens_std", "cached_prompt_tokens", "running_context_tokens")
        }
        for col, v in lengths.items():
            if v is not None and v > MAX_TOKENS_PER_REQUEST:
                raise InputError(f"{p}:{line}: column {col}: {v:g} tokens a request is past any server's")
        sent = opt["sent"]
        if sent is not None and (sent < 0 or sent != int(sent)):
            raise InputError(f"{p}:{line}: column sent: {sent:g} must be a whole number of requests >= 0")
        context = opt["running_context_tokens"]
        if context is not None and context < 1:
            raise InputError(f"{p}:{line}: column running_context_tokens: {context:g} must be >= 1 (or empty)")
        duration = opt["duration_s"]
        if duration is not None and duration <= 0:
            raise InputError(f"{p}:{line}: column duration_s: must be > 0")
        warmup = opt["warmup_s"] or 0.0
        if warmup < 0 or (duration is not None and warmup >= duration):
            raise InputError(f"{p}:{line}: column warmup_s: {warmup:g} must be >= 0 and below duration_s")
        saturated = None
        cell = (r.get("saturated") or "").strip().lower()
        if cell:
            if cell not in ("0", "1", "true", "false"):
                raise InputError(f"{p}:{line}: column saturated: {cell!r} must be 0 or 1")
            saturated = cell in ("1", "true")
        if vals["mean_e2e_s"] <= 0 and not saturated:
            raise InputError(f"{p}:{line}: column mean_e2e_s: must be > 0")
        rows.append(
            LoadRow(
                vals["rate"],
                sd == "on",
                int(vals["draft_length"]),
                vals["acceptance_rate"],
                vals["mean_e2e_s"],
                vals["mean_prompt_tokens"],
                vals["mean_gen_tokens"],
                line,
                opt["gen_tokens_std"],
                saturated,
                opt["prompt_tokens_std"],
                duration,
                warmup,
                context,
                opt["cached_prompt_tokens"],
                opt["served_rps"],
                (r.get("workload") or "").strip(),
                str(p),
                None if sent is None else int(sent),
            )
        )
    return rows, digest


# --------------------------------------------------------------------------------------------
# Fitting (pure)
# --------------------------------------------------------------------------------------------


def drop_warmup(rows: Iterable[BenchRow], warmup: int, where: str = "bench") -> list[BenchRow]:
    """Drop the first ``warmup`` iterations of every measured group (FACT_PHASES rows are facts)."""
    groups: dict[tuple, list[BenchRow]] = defaultdict(list)
    kept: list[BenchRow] = []
    for r in rows:
        if r.phase in FACT_PHASES:
            kept.append(r)
            continue
        groups[
            (r.source, r.phase, r.draft_length, r.batch_size, r.tokens_per_seq, r.context_len, r.chunk_tokens)
        ].append(r)
    for (_, phase, gamma, batch, tps, ctx, chunk), group in groups.items():
        group.sort(key=lambda r: r.iteration)
        if len(group) <= warmup:
            raise InputError(
                f"{where}: phase {phase} draft_length {gamma} batch_size {batch} tokens_per_seq {tps}"
                f" context_len {ctx:g} chunk_tokens {chunk}: only {len(group)} iteration(s), all dropped"
                f" as warm-up (warmup={warmup}); lower --warmup"
            )
        _check_timings(group[warmup:])
        kept.extend(group[warmup:])
    return kept


# A timing this far below its repetitions' median is a glitch, not a fast step: the fit weighs
# rows by 1/latency, and one such row took a 703-row calibration's intercept to zero.
GLITCH_FRACTION = 0.25


def _check_timings(group: Sequence[BenchRow]) -> None:
    """InputError on a kept repetition of one step that is no timing: zero (two streamed chunks
    read together; the warm-up's first iterations show it) or far below the others
    (GLITCH_FRACTION of their median, with three or more to tell)."""
    median = statistics.median(r.latency_s for r in group) if len(group) >= 3 else 0.0
    for r in group:
        if r.latency_s <= 0.0:
            raise InputError(
                f"{r.source}:{r.line}: column latency_s: a {r.phase} step of {r.latency_s:g} s is no timing:"
                " remove the row or re-run the bench"
            )
        if r.latency_s < GLITCH_FRACTION * median:
            raise InputError(
                f"{r.source}:{r.line}: column latency_s: {r.latency_s:g} s is under {GLITCH_FRACTION:g} of the"
                f" {len(group)} repetitions' median {median:g} s (a timing glitch): remove the row or re-run the bench"
            )


def _r2(y: np.ndarray, pred: np.ndarray) -> float | None:
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    if ss_tot <= 0:
        return None
    return 1.0 - float(np.sum((y - pred) ** 2)) / ss_tot


def _weights(y: np.ndarray) -> np.ndarray:
    # Timing noise is relative (a 2 s step jitters more than a 2 ms one): weight by 1/y so a
    # few long prefill steps cannot drown the intercept that the short steps pin down.
    return 1.0 / np.maximum(np.abs(y), 1e-9)


def _nonneg_lstsq(
    cols: dict[str, np.ndarray], y: np.ndarray, free: set[str], weights: np.ndarray | None = None
) -> dict[str, float]:
    """Weighted least squares, the columns not in ``free`` kept >= 0 (drop negatives, refit)."""
    active = [k for k, v in cols.items() if np.ptp(v) > 0 or (k == "intercept" and np.any(v != 0))]
    w = _weights(y) if weights is None else weights
    while True:
        if not active:
            return dict.fromkeys(cols, 0.0)
        a = np.column_stack([cols[k] for k in active]) * w[:, None]
        coef, *_ = np.linalg.lstsq(a, y * w, rcond=None)
        negative = [k for k, c in zip(active, coef, strict=True) if c < 0 and k not in free]
        if not negative:
            out = dict.fromkeys(cols, 0.0)
            out.update({k: float(c) for k, c in zip(active, coef, strict=True)})
            return out
        # Drop the most negative one: a cost cannot fall as work grows.
        worst = min(negative, key=lambda k: coef[active.index(k)])
        active.remove(worst)


# A row's passes: (count, tokens, KV tokens read, sequences, prompt attention pairs) of one
# forward function.
Passes = tuple[tuple[float, float, float, float, float], ...]


@dataclass(frozen=True)
class _Sample:
    """One measured latency explained as a sum of passes of the function being fitted."""

    passes: Passes
    y: float  # seconds, after subtracting what is already known (e.g. the target's passes)
    weight: float  # 1 / measured latency: errors are relative to what was measured
    sd_step: bool = False


def _prefill_passes(total_tokens: float, seqs: float, budget: int | None, prompt_tokens: float) -> Passes:
    """A batch's prompts as chunks of at most ``budget`` tokens, one pass each (its sequences
    spread over the chunks in proportion to their tokens). A prompt token attends to P/2 keys
    on average, in whichever chunk it lands: P²/2 pairs per prompt."""
    half = prompt_tokens / 2.0
    if budget is None or total_tokens <= budget:
        return ((1.0, total_tokens, 0.0, seqs, total_tokens * half),)
    full = math.floor(total_tokens / budget)
    rest = total_tokens - full * budget
    per_token = seqs / total_tokens
    out = [(float(full), float(budget), 0.0, budget * per_token, budget * half)]
    if rest > 0:
        out.append((1.0, rest, 0.0, rest * per_token, rest * half))
    return tuple(out)


def target_passes(row: BenchRow, budget: int | None) -> Passes:
    """The target forward passes one bench row measured."""
    b, k, ctx = row.batch_size, row.tokens_per_seq, row.context_len
    if row.phase == "prefill":
        return _prefill_passes(b * k, b, budget, k)
    if row.phase == "mixed":  # the chunk is a fresh prompt: its own attention, C²/2 pairs
        c = row.chunk_tokens
        return ((1.0, b * k + c, b * ctx, b + 1.0, c * c / 2.0),)
    return ((1.0, b * k, b * ctx, float(b), 0.0),)  # target, verify


def draft_passes(row: BenchRow, budget: int | None) -> Passes:
    """The draft passes inside one SD bench row (first pass carries any prompt chunk)."""
    b, gamma, ctx = row.batch_size, row.draft_length, row.context_len
    if row.phase == "prefill":
        return _prefill_passes(b * row.tokens_per_seq, b, budget, row.tokens_per_seq)
    # vLLM v1's proposer runs the draft first over every token the target just processed (the
    # γ+1 verified tokens of each sequence and any prompt chunk, to catch its KV up), then γ − 1
    # single-token passes.
    step = b * (gamma + 1.0)
    rest = (gamma - 1.0, float(b), b * ctx, float(b), 0.0)
    if row.phase == "mixed":
        c = row.chunk_tokens
        return ((1.0, step + c, b * ctx, b + 1.0, c * c / 2.0), rest)
    if row.phase == "draft":  # a direct measurement of one draft pass
        return ((1.0, float(b * row.tokens_per_seq), b * ctx, float(b), 0.0),)
    return ((1.0, step, b * ctx, float(b), 0.0), rest)  # verify


@dataclass(frozen=True)
class _Terms:
    """Which terms a fit may use (each only when the data can tell it from the others)."""

    context: bool
    seq: bool
    overhead: bool
    attention: bool = False

    @property
    def count(self) -> int:
        return 2 + int(self.context) + int(self.seq) + int(self.overhead) + int(self.attention)


def _columns(samples: Sequence[_Sample], knees: Sequence[float], terms: _Terms) -> dict[str, np.ndarray]:
    n = len(samples)
    cols = {"intercept": np.zeros(n), "slope": np.zeros(n)}
    if terms.context:
        cols["context"] = np.zeros(n)
    if terms.seq:
        cols["seq"] = np.zeros(n)
    if terms.attention:
        cols["attention"] = np.zeros(n)
    for j in range(len(knees)):
        cols[f"knee{j}"] = np.zeros(n)
    if terms.overhead:
        cols["overhead"] = np.array([1.0 if s.sd_step else 0.0 for s in samples])
    for i, s in enumerate(samples):
        for count, x, z, q, a in s.passes:
            cols["intercept"][i] += count
            cols["slope"][i] += count * x
            if terms.context:
                cols["context"][i] += count * z
            if terms.seq:
                cols["seq"][i] += count * q
            if terms.attention:
                cols["attention"][i] += count * a
            for j, k in enumerate(knees):
                cols[f"knee{j}"][i] += count * max(0.0, x - k)
    return cols


@dataclass(frozen=True)
class _PassFit:
    spec: PhaseSpec
    overhead_s: float
    sse: float
    pred: np.ndarray


def _fit_passes(samples: Sequence[_Sample], knees: Sequence[float], terms: _Terms) -> _PassFit:
    knees = sorted(knees)
    cols = _columns(samples, knees, terms)
    y = np.array([s.y for s in samples])
    w = np.array([s.weight for s in samples])
    coef = _nonneg_lstsq(cols, y, free={f"knee{j}" for j in range(len(knees))}, weights=w)
    slope = coef["slope"]
    for j in range(len(knees)):  # the slope past every knee must stay >= 0
        if slope + coef[f"knee{j}"] < 0:
            coef[f"knee{j}"] = -slope
        slope += coef[f"knee{j}"]
    pred = sum(coef[k] * cols[k] for k in cols)
    sse = float(np.sum(((y - pred) * w) ** 2))
    spec = PhaseSpec(
        intercept_s=max(coef["intercept"], 0.0),
        slope_s_per_token=coef["slope"],
        context_s_per_token=coef.get("context", 0.0),
        seq_s=coef.get("seq", 0.0),
        attention_s_per_pair=coef.get("attention", 0.0),
        knees=[
            KneeSpec(at_tokens=k, slope_delta_s_per_token=coef[f"knee{j}"])
            for j, k in enumerate(knees)
            if coef[f"knee{j}"] != 0
        ],
    )
    return _PassFit(spec, max(coef.get("overhead", 0.0), 0.0), sse, pred)


def _bic(n: int, sse: float, params: int) -> float:
    return n * math.log(max(sse, 1e-300) / n) + params * math.log(n)


def _step_tokens(samples: Sequence[_Sample]) -> np.ndarray:
    """Tokens of the largest pass of each sample (what a knee is placed against)."""
    return np.array([max(p[1] for p in s.passes) for s in samples])


MAX_KNEES = 5


def _add_knee(
    samples: Sequence[_Sample], terms: _Terms, knees: list[float], base: _PassFit
) -> tuple[_PassFit | None, float, str]:
    """The best further knee, only where the data support it; (fit or None, knee, note).

    Candidates sit between measured step sizes with at least KNEE_MIN_SIDE distinct sizes
    between them and every other knee or end; the best is refined by golden section between its
    neighbours and kept only when it lowers the BIC by KNEE_MIN_BIC_GAIN and the weighted error
    by KNEE_MIN_SSE_GAIN. Its interval is where the profile likelihood stays within the 95 %
    χ² bound (widened to the scan's resolution).
    """
    xs = np.unique(_step_tokens(samples))
    n = len(samples)
    mids = [(float(a) + float(b)) / 2.0 for a, b in itertools.pairwise(xs)]

    def room(k: float) -> bool:
        edges = [-math.inf, *knees, math.inf]
        lo = max(e for e in edges if e < k)
        hi = min(e for e in edges if e > k)
        return int(np.sum((xs < k) & (xs > lo))) >= KNEE_MIN_SIDE and int(np.sum((xs > k) & (xs < hi))) >= KNEE_MIN_SIDE

    cands = [k for k in mids if room(k)]
    if not cands:
        return None, math.nan, f"no room for knee {len(knees) + 1} ({xs.size} distinct step sizes)"
    scans = [(_fit_passes(samples, [*knees, k], terms), k) for k in cands]
    best, k_best = min(scans, key=lambda t: t[0].sse)
    i = cands.index(k_best)
    a_, b_ = (cands[i - 1] if i > 0 else k_best), (cands[i + 1] if i + 1 < len(cands) else k_best)
    g = (math.sqrt(5) - 1) / 2
    for _ in range(25 if b_ > a_ else 0):
        a, b = b_ - g * (b_ - a_), a_ + g * (b_ - a_)
        if _fit_passes(samples, [*knees, a], terms).sse < _fit_passes(samples, [*knees, b], terms).sse:
            b_ = b
        else:
            a_ = a
    refined = _fit_passes(samples, [*knees, 0.5 * (a_ + b_)], terms)
    if refined.sse < best.sse:
        best, k_best = refined, 0.5 * (a_ + b_)
    params = terms.count + 2 * len(knees)
    gain_bic = _bic(n, base.sse, params) - _bic(n, best.sse, params + 2)
    gain_sse = 1.0 - best.sse / max(base.sse, 1e-300)
    if len(best.spec.knees) <= len(knees) or gain_bic < KNEE_MIN_BIC_GAIN or gain_sse < KNEE_MIN_SSE_GAIN:
        return (
            None,
            k_best,
            f"no knee {len(knees) + 1}: best at {k_best:.0f} tokens gains BIC {gain_bic:.1f}, error {gain_sse * 100:.0f} %",
        )
    inside = [
        j for j, (f, _) in enumerate(scans) if n * math.log(max(f.sse, 1e-300) / max(best.sse, 1e-300)) <= KNEE_LR_CHI2
    ]
    j_lo, j_hi = (min(inside), max(inside)) if inside else (i, i)
    interval = (min(cands[max(j_lo - 1, 0)], k_best), max(cands[min(j_hi + 1, len(cands) - 1)], k_best))
    new_knees = [
        kn.model_copy(update={"interval_tokens": interval}) if abs(kn.at_tokens - k_best) < 1e-9 else kn
        for kn in best.spec.knees
    ]
    best = _PassFit(best.spec.model_copy(update={"knees": new_knees}), best.overhead_s, best.sse, best.pred)
    note = f"knee at {k_best:.0f} tokens per pass (95 % {interval[0]:.0f}-{interval[1]:.0f}; BIC -{gain_bic:.0f})"
    return best, k_best, note


def _fit_report(samples: Sequence[_Sample], fit: _PassFit, measured: np.ndarray, notes: list[str]) -> PhaseFit:
    """Fit quality against the measured latencies (not the residual targets)."""
    y = np.array([s.y for s in samples])
    offset = measured - y  # what was known before this fit
    pred = fit.pred + offset
    resid = measured - pred
    rel = resid / np.maximum(measured, 1e-12)
    tokens = _step_tokens(samples)
    bounds = [0.0, *(k.at_tokens for k in fit.spec.knees), math.inf]
    segments = []
    for lo, hi in itertools.pairwise(bounds):
        mask = (tokens > lo if lo > 0 else tokens >= lo) & (tokens <= hi)
        segments.append(
            SegmentFit(
                from_tokens=float(tokens[mask].min()) if mask.any() else lo,
                to_tokens=float(tokens[mask].max()) if mask.any() else lo,
                n=int(mask.sum()),
                r2=_r2(measured[mask], pred[mask]) if mask.sum() > 1 else None,
                rmse_s=float(np.sqrt(np.mean(resid[mask] ** 2))) if mask.any() else 0.0,
            )
        )
    return PhaseFit(
        n=len(samples),
        r2=_r2(measured, pred),
        rmse_s=float(np.sqrt(np.mean(resid**2))),
        max_abs_residual_s=float(np.max(np.abs(resid))),
        relative_rmse=float(np.sqrt(np.mean(rel**2))),
        segments=segments,
        notes=notes,
    )


def _independent(col: np.ndarray, others: Sequence[np.ndarray]) -> bool:
    """Whether ``col`` varies in a way the other columns cannot reproduce."""
    if np.ptp(col) <= 0:
        return False
    a = np.column_stack([np.ones_like(col), *others])
    coef, *_ = np.linalg.lstsq(a, col, rcond=None)
    resid = col - a @ coef
    return float(np.sqrt(np.mean(resid**2))) > 1e-3 * float(np.sqrt(np.mean(col**2)))


def _fit_function(
    samples: Sequence[_Sample], measured: np.ndarray, use_overhead: bool, allow_knee: bool, notes: list[str]
) -> tuple[PhaseSpec, float]:
    """Fit one forward function (target or draft) from its samples; (spec with fit, overhead)."""
    x = np.array([sum(p[0] * p[1] for p in s.passes) for s in samples])
    z = np.array([sum(p[0] * p[2] for p in s.passes) for s in samples])
    q = np.array([sum(p[0] * p[3] for p in s.passes) for s in samples])
    a = np.array([sum(p[0] * p[4] for p in s.passes) for s in samples])
    n_pass = np.array([sum(p[0] for p in s.passes) for s in samples])
    use_ctx = _independent(z, [x, n_pass])
    use_seq = _independent(q, [x, n_pass, *([z] if use_ctx else [])])
    # A prompt's own attention needs prompts (or chunks) of several lengths to be told from
    # the per-token cost; with one length it is folded into the token slope.
    use_attn = _independent(a, [x, n_pass, *([z] if use_ctx else []), *([q] if use_seq else [])])
    if not use_ctx:
        notes.append(
            "context term not identifiable (KV read does not vary independently of tokens); set to 0: long contexts"
            " are priced as the bench's, rerun sd-controller bench with --context-prompt-tokens 2048"
        )
    if not use_seq:
        notes.append("per-sequence term not identifiable (sequences move with tokens); folded into the token slope")
    if not use_attn and np.any(a > 0):
        notes.append("prompt attention term not identifiable (one prompt length): folded into the token slope")
    paired = _paired_context(samples) if use_ctx else None
    if paired is not None:  # the KV read fixed from the repeats; the rest fitted to what it leaves
        context_s, pairs = paired
        samples = [replace(s, y=s.y - context_s * zi) for s, zi in zip(samples, z, strict=True)]
        notes.append(
            f"context {context_s * 1e9:.4g} ns per KV token read: the median over {pairs} steps repeated at a longer context"
        )
    terms = _Terms(use_ctx and paired is None, use_seq, use_overhead, use_attn)
    fit = _fit_passes(samples, [], terms)
    knees: list[float] = []
    while allow_knee and len(knees) < MAX_KNEES:
        knee_fit, k, note = _add_knee(samples, terms, knees, fit)
        notes.append(note)
        if knee_fit is None:
            break
        fit = knee_fit
        knees.append(k)
    report = _fit_report(samples, fit, measured, notes)
    update: dict[str, object] = {"fit": report}
    if paired is not None:
        update["context_s_per_token"] = paired[0]
    return fit.spec.model_copy(update=update), fit.overhead_s


# Steps repeated at another context that fix the KV read on their own (_paired_context).
MIN_CONTEXT_PAIRS = 3


def _paired_context(samples: Sequence[_Sample]) -> tuple[float, int] | None:
    """Seconds per KV token read from the steps measured twice, alike but for their context
    (``bench --context-prompt-tokens`` repeats each decode batch at a longer prompt): the
    difference of two such steps is the KV read alone, whatever else the fit gets wrong at their
    tokens (a staircase of tiles, the target's error inside an SD step) cancels. The median over
    batch sizes; None with fewer than MIN_CONTEXT_PAIRS such steps (the joint fit then reads it).

    Fitted jointly instead, the read is traded against the per-token and per-sequence terms,
    which the KV read moves with at one context: where the draft's per-token slope sat at its
    floor of 0, the simulated A100's draft read 23 % too little per token (0.0143 µs for 0.0185).
    """
    groups: dict[tuple, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for s in samples:
        key = (s.sd_step, *((round(c, 9), round(x, 6), round(q, 6), round(a, 6)) for c, x, _z, q, a in s.passes))
        groups[key][sum(c * zz for c, _x, zz, _q, _a in s.passes)].append(s.y)
    slopes = []
    for by_z in groups.values():
        if len(by_z) >= 2:
            lo, hi = min(by_z), max(by_z)
            slopes.append((statistics.fmean(by_z[hi]) - statistics.fmean(by_z[lo])) / (hi - lo))
    if len(slopes) < MIN_CONTEXT_PAIRS:
        return None
    return max(float(np.median(slopes)), 0.0), len(slopes)


def _require_batches(rows: Sequence[BenchRow], what: str, where: str) -> None:
    batches = sorted({r.batch_size for r in rows})
    if len(batches) < MIN_BATCH_SIZES:
        raise InputError(
            f"{where}: {what}: needs at least {MIN_BATCH_SIZES} distinct batch sizes, "
            f"got {len(batches)} ({','.join(map(str, batches)) or 'none'})"
        )


def _target_rows(rows: Sequence[BenchRow]) -> tuple[list[BenchRow], list[BenchRow]]:
    """(decode steps, prompt rows) of the server without SD: what the target is fitted to."""
    decode = [r for r in rows if r.phase == "target" and r.draft_length == 0]
    prompt = [r for r in rows if r.phase in ("prefill", "mixed") and r.draft_length == 0]
    return decode, prompt


def _in_moe_tokens(passes: Passes, moe: Moe | None) -> Passes:
    """A MoE target is fitted against the tokens its experts see, not the tokens in the pass."""
    if moe is None:
        return passes
    return tuple((c, float(moe.effective_tokens(x)), z, q, a) for c, x, z, q, a in passes)


def fit_target(rows: Sequence[BenchRow], budget: int | None, moe: Moe | None, where: str) -> PhaseSpec:
    """The target forward pass from SD-off rows: decode steps, mixed steps and prefills together.

    One function of the tokens in a pass: a decode batch, a decode batch plus a prompt chunk and
    a prompt alone are all one forward pass over that many tokens, so the prompt token's cost on
    a busy server is read off the same curve as a decode token's, past its knee.
    """
    decode, prompt = _target_rows(rows)
    _require_batches(decode, "phase target (decode steps, SD off)", where)
    if not prompt:
        raise InputError(
            f"{where}: no prefill or mixed rows with SD off: the prompt token's cost cannot be identified; "
            "run sd-controller bench --phase prefill,target,mixed on the server without SD"
        )
    used = decode + prompt
    samples = [
        _Sample(_in_moe_tokens(target_passes(r, budget), moe), r.latency_s, 1.0 / max(r.latency_s, 1e-9)) for r in used
    ]
    notes: list[str] = []
    if not any(r.phase == "mixed" for r in prompt):
        notes.append("no mixed rows: a prompt's marginal cost on a busy step is inferred from stand-alone prefills")
    measured = np.array([r.latency_s for r in used])
    spec, _ = _fit_function(samples, measured, False, moe is None, notes)
    return spec


# Relative timing noise of one bench row (its iterations' jitter): the floor of a sample's error.
TIMING_NOISE = 0.01
# The target's error on a pass is read off its rows within this factor of the pass's tokens.
LOCAL_ERROR_SPAN = 2.0


@dataclass(frozen=True)
class _TargetError:
    """The fitted target's relative error around a pass size, from its own rows' residuals.

    GEMM tiles make the measured cost a staircase the fitted lines cross: short decode steps
    sit on one tread (a small error), a long chunk between two (a large one).
    """

    tokens: np.ndarray  # sorted tokens of each row's largest pass
    rel_sq: np.ndarray  # its squared relative residual
    overall: float  # RMS of all: where no row is near

    def relative(self, x: float) -> float:
        lo = bisect.bisect_left(self.tokens, x / LOCAL_ERROR_SPAN)
        hi = bisect.bisect_right(self.tokens, x * LOCAL_ERROR_SPAN)
        return float(np.sqrt(self.rel_sq[lo:hi].mean())) if hi > lo else self.overall


def _target_residual(row: BenchRow, target: StepCost, budget: int | None, moe: Moe | None) -> tuple[float, float]:
    """(the row's largest target pass in tokens, measured − the fitted target passes' seconds)."""
    passes = _in_moe_tokens(target_passes(row, budget), moe)
    pred = sum(c * target.scalar(x, z, q, a) for c, x, z, q, a in passes)
    return max(p[1] for p in passes), row.latency_s - pred


def _target_error(rows: Sequence[BenchRow], target: StepCost, budget: int | None, moe: Moe | None) -> _TargetError:
    decode, prompt = _target_rows(rows)
    tokens, rel_sq = [], []
    for r in decode + prompt:
        x, resid = _target_residual(r, target, budget, moe)
        tokens.append(x)
        rel_sq.append((resid / max(r.latency_s, 1e-12)) ** 2)
    order = np.argsort(tokens)
    t, e = np.asarray(tokens, dtype=float)[order], np.asarray(rel_sq, dtype=float)[order]
    return _TargetError(t, e, float(np.sqrt(e.mean())) if e.size else 0.0)


def fit_draft(
    rows: Sequence[BenchRow], target: StepCost, budget: int | None, where: str, moe: Moe | None = None
) -> tuple[PhaseSpec, float, bool]:
    """The draft pass and the fixed SD-step overhead from SD-on rows, the target's share removed.

    A row's draft share inherits the target fit's error on the target's passes in it: a mixed
    step's long chunk on a staircase of GEMM tiles can be off by more than the whole draft
    costs. Each row is weighted by its timing noise and that error together, so the draft's
    per-pass cost is read where the target is known well (short verify steps), not traded
    against the target's residuals.

    Returns (draft spec, overhead per SD step, whether the draft's prefill was measured).
    """
    sd_rows = [r for r in rows if r.draft_length > 0 and r.phase in ("verify", "mixed", "prefill", "draft")]
    verify = [r for r in sd_rows if r.phase == "verify"]
    _require_batches(verify, "phase verify (SD steps, on the server with SD)", where)
    error = _target_error(rows, target, budget, moe)
    samples, measured = [], []
    for r in sd_rows:
        passes = () if r.phase == "draft" else _in_moe_tokens(target_passes(r, budget), moe)
        costs = [(c * target.scalar(x, z, q, a), x) for c, x, z, q, a in passes]
        known = sum(t for t, _x in costs)
        # Passes of one row err together: their errors add, not in quadrature.
        target_err = sum(t * error.relative(x) for t, x in costs)
        sigma = math.hypot(TIMING_NOISE * r.latency_s, target_err)
        samples.append(
            _Sample(
                draft_passes(r, budget), r.latency_s - known, 1.0 / max(sigma, 1e-9), r.phase in ("verify", "mixed")
            )
        )
        measured.append(r.latency_s)
    gammas = sorted({r.draft_length for r in verify})
    notes: list[str] = []
    use_overhead = len(gammas) >= 2
    if not use_overhead:
        notes.append(f"one draft length measured ({gammas[0]}): SD-step overhead folded into the draft pass")
    prefill_measured = any(r.phase == "prefill" for r in sd_rows)
    if not prefill_measured:
        notes.append("draft prefill not measured (no prefill rows on the SD server): extrapolated from decode passes")
    spec, overhead = _fit_function(samples, np.array(measured), use_overhead, True, notes)
    return spec, overhead, prefill_measured


def _kv_tokens(rows: Sequence[BenchRow], sd: bool) -> int | None:
    caps = [r.context_len for r in rows if r.phase == "kv_cache" and (r.draft_length > 0) == sd]
    return int(min(caps)) if caps else None


def _prefix_caching(rows: Sequence[BenchRow]) -> bool | None:
    """Whether the benchmarked servers cache prefixes: on only where every one that said so is
    on (the cheaper recompute is priced only where it is sure); None where none said."""
    said = [r.context_len > 0 for r in rows if r.phase == "prefix_caching"]
    return all(said) if said else None


# A batch whose KV context fills this much of the cache is about to be preempted as it grows.
KV_FILL_LIMIT = 0.98


def drop_over_kv(rows: Sequence[BenchRow]) -> tuple[list[BenchRow], int]:
    """Rows whose batch could not hold its KV context in the measured server's cache, removed.

    Past the cache vLLM preempts and recomputes sequences, so such a step time measures the
    preemption, not the pass: fitting it would bend the context slope. Needs the ``kv_cache``
    row of the same server (same draft length); without it nothing is dropped.
    """
    caps = {r.draft_length: r.context_len for r in rows if r.phase == "kv_cache" and r.context_len > 0}
    kept, dropped = [], 0
    for r in rows:
        cap = caps.get(r.draft_length)
        if (
            cap is not None
            and r.phase in ("target", "verify", "mixed")
            and r.batch_size * r.context_len > KV_FILL_LIMIT * cap
        ):
            dropped += 1
            continue
        kept.append(r)
    return kept, dropped


def drop_over_budget(rows: Sequence[BenchRow], budget: int | None) -> tuple[list[BenchRow], int]:
    """Mixed rows whose chunk and decode tokens together exceed the step's token budget, removed.

    vLLM gives a prompt only the budget left beside the running sequences, so such a chunk
    spanned several steps and the row timed none of them (``bench`` now measures at the
    remainder; older files may hold them). Without a budget nothing is dropped.
    """
    if budget is None:
        return list(rows), 0
    kept = [r for r in rows if r.phase != "mixed" or r.chunk_tokens + r.batch_size * r.tokens_per_seq <= budget]
    return kept, len(rows) - len(kept)


def fit_phases(
    rows: Sequence[BenchRow],
    warmup: int = DEFAULT_WARMUP,
    moe: Moe | None = None,
    where: str = "bench",
    budget: int | None = None,
) -> tuple[Phases, Uncertainty]:
    """Fit the target and draft passes; prefill (or mixed), target and verify rows are required."""
    kept, over_budget = drop_over_budget(drop_warmup(rows, warmup, where), budget)
    kept, dropped = drop_over_kv(kept)
    try:
        target = fit_target(kept, budget, moe, where)
    except InputError as exc:
        if not dropped:
            raise
        # The rows it lacks were dropped for the KV cache's sake: its row is what to look at.
        caps = ", ".join(f"{r.source}:{r.line} ({r.context_len:g} tokens)" for r in rows if r.phase == "kv_cache")
        raise InputError(f"{exc}; {dropped} row(s) were dropped as past the KV cache of {caps}: is it right?") from None
    if dropped:
        target = _noted(
            target, f"{dropped} row(s) dropped: their batch's KV context exceeds the server's KV cache (vLLM preempts)"
        )
    if over_budget:
        target = _noted(
            target,
            f"{over_budget} mixed row(s) dropped: chunk plus decode tokens exceed the step budget {budget}"
            " (the chunk spanned steps); rebench: bench now measures at the budget's remainder",
        )
    draft, overhead, _draft_prefill = fit_draft(kept, target.step_cost(), budget, where, moe)
    unc = Uncertainty(
        relative_sd_off=min(target.fit.relative_rmse if target.fit else 0.0, 1.0),
        relative_sd_on=min(
            max(draft.fit.relative_rmse if draft.fit else 0.0, target.fit.relative_rmse if target.fit else 0.0), 1.0
        ),
    )
    staircase = decode_staircase(kept, target.step_cost(), budget, moe)
    verify = verify_staircase(kept, target.step_cost(), draft.step_cost(), overhead, budget, moe)
    target = _noted(target, _coarse_note("decode staircase", "batch sizes", [s.batch_size for s in staircase]))
    target = _noted(target, _period_note("decode staircase", [(s.batch_size, s.residual_s) for s in staircase]))
    draft = _noted(draft, _coarse_note("SD step staircase", "step sizes", [s.step_tokens for s in verify]))
    draft = _noted(draft, _period_note("SD step staircase", [(s.step_tokens, s.residual_s) for s in verify]))
    treads = prompt_step_treads(kept, target.step_cost(), draft.step_cost(), overhead, budget, moe, staircase, verify)
    phases = Phases(
        target=target,
        draft=draft,
        sd_overhead_s=overhead,
        draft_prefills=True,
        decode_staircase=staircase,
        verify_staircase=verify,
        prompt_step_treads=treads,
    )
    return phases, unc


def _noted(spec, note: str):
    """The phase with one more fit note (unchanged without a note or a fit)."""
    if not note or spec.fit is None:
        return spec
    return spec.model_copy(update={"fit": spec.fit.model_copy(update={"notes": [*spec.fit.notes, note]})})


def _coarse_note(name: str, what: str, sizes: Sequence[int]) -> str:
    """Say so when the sizes benchmarked lie too far apart for the model to read a staircase
    between them (model.STAIR_MAX_GAP_TOKENS): there it adds nothing, and a denser grid helps."""
    wide = sum(1 for a, b in itertools.pairwise(sizes) if b - a > STAIR_MAX_GAP_TOKENS)
    if not wide:
        return ""
    return (
        f"{name}: {wide} of {len(sizes) - 1} gaps between the {what} benchmarked exceed {STAIR_MAX_GAP_TOKENS:g}"
        " tokens and are not read (bench every 8 sequences to place the risers)"
    )


def _period_note(name: str, table: Sequence[tuple[int, float]]) -> str:
    """Where the staircase's risers are placed (treads.table_period); nothing where it shows no period."""
    found = table_period(table)
    return "" if found is None else f"{name}: {describe_treads(found)}"


def decode_staircase(
    rows: Sequence[BenchRow], target: StepCost, budget: int | None, moe: Moe | None
) -> list[StairStep]:
    """Each benchmarked batch size's mean residual of its SD-off decode steps (seconds).

    The fitted pass is a line with knees through all sizes; GEMMs run in whole tiles (and vLLM
    pads a decode batch to a captured CUDA-graph size), so the measured step is a staircase
    around it, a few per cent above the line just past a tile boundary and below it at the
    boundary. Near capacity that is a few per cent of throughput at the batch the server runs,
    so the model's chain adds it back, interpolated between the sizes measured (the denser the
    bench's batch grid, the better it places the steps).
    """
    decode, _prompt = _target_rows(rows)
    residuals = [(r, _target_residual(r, target, budget, moe)[1]) for r in decode]
    means = _supported_means(residuals, lambda r: r.batch_size)
    return [StairStep(batch_size=b, residual_s=v) for b, v in sorted(means.items())]


def _step_residual(
    row: BenchRow, target: StepCost, draft: StepCost, overhead_s: float, budget: int | None, moe: Moe | None
) -> float:
    """Measured − the fitted passes' seconds: the target's, and on an SD server the draft's and
    the step's overhead."""
    resid = _target_residual(row, target, budget, moe)[1]
    if row.draft_length > 0:
        resid -= sum(c * draft.scalar(x, z, q, a) for c, x, z, q, a in draft_passes(row, budget)) + overhead_s
    return resid


def verify_staircase(
    rows: Sequence[BenchRow],
    target: StepCost,
    draft: StepCost,
    overhead_s: float,
    budget: int | None,
    moe: Moe | None,
) -> list[VerifyStairStep]:
    """Each benchmarked SD step size's mean residual of its verify steps (seconds), keyed by the
    target tokens in the step, B·(γ + 1), every draft length's rows together.

    The same tiles that make the decode step a staircase in its batch make the SD step one in
    its tokens: a verify step's treads are (γ + 1)× narrower in the batch than a decode step's,
    finer than a bench grid resolves one draft length at a time. Keyed by tokens, the draft
    lengths' rows interleave (γ = 2 every 3·8 tokens, γ = 4 every 5·8) and place the risers
    between them; a draft length never benchmarked reads the same table.
    """
    residuals = [
        (r, _step_residual(r, target, draft, overhead_s, budget, moe))
        for r in rows
        if r.phase == "verify" and r.draft_length > 0
    ]
    means = _supported_means(residuals, lambda r: r.batch_size * (r.draft_length + 1))
    return [VerifyStairStep(step_tokens=t, residual_s=v) for t, v in sorted(means.items())]


def prompt_step_treads(
    rows: Sequence[BenchRow],
    target: StepCost,
    draft: StepCost,
    overhead_s: float,
    budget: int | None,
    moe: Moe | None,
    staircase: Sequence[StairStep],
    verify: Sequence[VerifyStairStep],
) -> list[PromptStepTread]:
    """Per draft length (0: SD off), what a step carrying a prompt chunk keeps of the staircase.

    The mixed rows' mean residual at each batch B is regressed on the staircase's residual there
    (the decode table at B; with SD the verify table at B·(γ + 1)): m(B) = c + share·s(B), c the
    line's mean misfit of the mixed rows (fitted beside the share, not added to the chain).
    A chunk of whole tiles leaves B + C on B's tread (share near 1: a bench of 128, 512, …
    token chunks on 128-token tiles reads 0.7–0.9); a chunk anywhere on the tiles moves the
    target's passes off it (SD off: near 0), and with SD the draft's single-token passes stay
    (γ = 4 on the simulated A100: 0.37). Fewer than three batch sizes with mixed rows: none.
    """
    off = tuple((float(s.batch_size), s.residual_s) for s in staircase)
    on = tuple((float(s.step_tokens), s.residual_s) for s in verify)
    by_length: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r.phase != "mixed":
            continue
        by_length[r.draft_length][r.batch_size].append(_step_residual(r, target, draft, overhead_s, budget, moe))
    out = []
    for gamma, by_batch in sorted(by_length.items()):
        if len(by_batch) < 3:
            continue
        batches = np.array(sorted(by_batch), dtype=float)
        mean = np.array([np.mean(by_batch[int(b)]) for b in batches])
        table = on if gamma > 0 else off
        tread = stair_residual(table, batches * (gamma + 1)) if table else np.zeros_like(batches)
        share = 0.0
        if np.ptp(tread) > 0:
            coef, *_ = np.linalg.lstsq(np.column_stack([np.ones_like(tread), tread]), mean, rcond=None)
            share = min(max(float(coef[1]), 0.0), 1.0)
        out.append(PromptStepTread(draft_length=gamma, tread_share=share))
    return out


def _supported_means(residuals: Sequence[tuple[BenchRow, float]], size: Callable[[BenchRow], int]) -> dict[int, float]:
    """Each step size's mean residual, less what the bench's own jitter would show: ``r − se²/r``
    (0 where |r| ≤ se), the positive-part James–Stein estimate per size.

    A server whose step is smooth in the batch (no tiles, or tiles the bench cannot see) leaves
    residuals that are noise; added to every state of the chain they would move its rates and the
    limit at random. The jitter is relative (a step's scales with its length), so its variance is
    pooled over every configuration measured more than once (the same phase, batch, draft length,
    context and chunk: rows of one size that differ in those differ by the fit, not by noise), and
    a size's standard error is that share of its mean step over √(its rows). A bench with one
    iteration per configuration has no such estimate: its residuals are kept as measured.
    """
    same: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    by_size: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for r, res in residuals:
        same[(r.phase, r.batch_size, r.draft_length, r.context_len, r.chunk_tokens)].append((res, r.latency_s))
        by_size[size(r)].append((res, r.latency_s))
    dof = spread = 0.0
    for runs in same.values():
        if len(runs) > 1:
            res, lat = np.array(runs).T
            spread += float(np.var(res, ddof=1)) / float(np.mean(lat)) ** 2 * (len(runs) - 1)
            dof += len(runs) - 1
    rel_var = spread / dof if dof else 0.0
    out = {}
    for key, runs in by_size.items():
        res, lat = np.array(runs).T
        mean, se2 = float(np.mean(res)), rel_var * float(np.mean(lat)) ** 2 / len(runs)
        out[key] = mean - se2 / mean if mean * mean > se2 else 0.0
    return out


# --------------------------------------------------------------------------------------------
# Load-test check and correction
# --------------------------------------------------------------------------------------------


def _predicted_latency(model: LatencyModel, row: LoadRow) -> float:
    from controller.acceptance import alpha_from_vllm_rate
    from controller.model import predict_point

    workload = row.workload()
    gamma = row.draft_length if row.sd else 0
    alpha = float(alpha_from_vllm_rate(row.acceptance_rate, max(gamma, 1)))
    p = predict_point(model, row.offered_rps, alpha, max(gamma, 1), workload)
    return p.latency_on_s if row.sd else p.latency_off_s


def _paper_fit_r2(rows: Sequence[LoadRow]) -> float | None:
    """R² of the paper's L = C1/(1 − rate·C2), fitted per (sd, draft_length) curve."""
    curves: dict[tuple, list[LoadRow]] = defaultdict(list)
    for r in rows:
        curves[(r.sd, r.draft_length if r.sd else 0, round(r.acceptance_rate, 3))].append(r)
    y_all, p_all = [], []
    for group in curves.values():
        rate = np.array([r.offered_rps for r in group])
        lat = np.array([r.mean_e2e_s for r in group])
        if np.unique(rate).size >= 2:
            # 1/L = 1/C1 − (C2/C1)·rate is linear in rate.
            slope, icpt = np.polyfit(rate, 1.0 / lat, 1)
            with np.errstate(divide="ignore"):
                pred = np.where(icpt + slope * rate > 0, 1.0 / (icpt + slope * rate), np.inf)
        else:
            pred = np.full_like(lat, lat.mean())
        y_all.append(lat)
        p_all.append(pred)
    y, p = np.concatenate(y_all), np.concatenate(p_all)
    return _r2(y, p) if np.all(np.isfinite(p)) else None


def check_load_test(
    model: LatencyModel, rows: Sequence[LoadRow], corrected: bool = False
) -> tuple[LoadCheck, list[tuple[LoadRow, float]]]:
    """Compare predicted with observed whole-request latency; returns the summary and per-row."""
    pairs = [(r, _predicted_latency(model, r)) for r in rows]
    y = np.array([r.mean_e2e_s for r, _ in pairs])
    p = np.array([pred for _, pred in pairs])
    finite = np.isfinite(p)
    # A row the model calls overloaded counts as a 100% miss, not a silent drop.
    ape = np.where(finite, np.abs(p - y) / y, 1.0)

    def r2_of(mask: np.ndarray) -> float | None:
        m = mask & finite
        return _r2(y[m], p[m]) if m.sum() >= 2 else None

    sd = np.array([r.sd for r in rows])
    check = LoadCheck(
        n=len(rows),
        r2=r2_of(np.ones_like(sd)),
        r2_off=r2_of(~sd),
        r2_on=r2_of(sd),
        mean_abs_pct_error=float(ape.mean() * 100.0),
        paper_fit_r2=_paper_fit_r2(rows),
        corrected=corrected,
    )
    return check, pairs


def fit_load_correction(model: LatencyModel, rows: Sequence[LoadRow]) -> LoadCorrection:
    """Scale each mode's step costs so predicted whole-request latency matches the load test.

    One factor per mode, chosen by golden-section search on log scale to minimize the squared
    relative error (a micro-benchmark that misses, say, scheduler overhead is off by a factor).
    """
    import dataclasses

    def loss(scale: float, sd: bool) -> float:
        m = dataclasses.replace(model, **{"scale_on" if sd else "scale_off": scale})
        errs = []
        for r in rows:
            if r.sd != sd:
                continue
            pred = _predicted_latency(m, r)
            errs.append(1.0 if not math.isfinite(pred) else (pred - r.mean_e2e_s) / r.mean_e2e_s)
        return float(np.mean(np.square(errs))) if errs else 0.0

    def search(sd: bool) -> float:
        if not any(r.sd == sd for r in rows):
            return 1.0
        lo, hi = math.log(0.1), math.log(10.0)
        g = (math.sqrt(5) - 1) / 2
        for _ in range(60):
            a, b = hi - g * (hi - lo), lo + g * (hi - lo)
            if loss(math.exp(a), sd) < loss(math.exp(b), sd):
                hi = b
            else:
                lo = a
        return math.exp(0.5 * (lo + hi))

    return LoadCorrection(scale_off=search(False), scale_on=search(True))


def calibrate(
    bench_rows: Sequence[BenchRow],
    *,
    warmup: int = DEFAULT_WARMUP,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int | None = None,
    moe: MoeSpec | None = None,
    load_rows: Sequence[LoadRow] | None = None,
    correct: bool = False,
    metadata: Metadata | None = None,
    where: str = "bench",
    prefix_caching: bool | None = None,
) -> CalibrationFile:
    """Fit a whole calibration (pure: rows and options in, file object out).

    ``prefix_caching`` overrides what the bench recorded (its ``prefix_caching`` rows): for a
    bench made before it recorded that, or a server relaunched with the other setting since.
    A fit no calibration file can hold (a cost past its field's range: the bench's rows in the
    wrong unit, say) is an InputError naming the field, as the file would be.
    """
    try:
        cal = _calibrate(
            bench_rows, warmup, max_num_seqs, max_num_batched_tokens, moe, load_rows, correct, metadata, where,
            prefix_caching,
        )  # fmt: skip
    except ValidationError as exc:
        raise InputError(validation_error_line(where, exc)) from None
    _check_idle(cal, where)
    return cal


def _calibrate(
    bench_rows: Sequence[BenchRow],
    warmup: int,
    max_num_seqs: int,
    max_num_batched_tokens: int | None,
    moe: MoeSpec | None,
    load_rows: Sequence[LoadRow] | None,
    correct: bool,
    metadata: Metadata | None,
    where: str,
    prefix_caching: bool | None,
) -> CalibrationFile:
    moe_model = Moe(moe.num_experts, moe.top_k) if moe else None
    phases, unc = fit_phases(bench_rows, warmup, moe_model, where, max_num_batched_tokens)
    meta = metadata or Metadata()
    if not meta.created:
        meta = meta.model_copy(update={"created": dt.date.today().isoformat()})
    serving = Serving(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        kv_cache_tokens_off=_kv_tokens(bench_rows, False),
        kv_cache_tokens_on=_kv_tokens(bench_rows, True),
        prefix_caching=_prefix_caching(bench_rows) if prefix_caching is None else prefix_caching,
    )
    cal = CalibrationFile(
        schema_version=SCHEMA_VERSION, metadata=meta, serving=serving, moe=moe, phases=phases, uncertainty=unc
    )
    if load_rows:
        # A saturated rate's mean is the test's length, not the server's: neither fitted nor checked.
        steady = [r for r in load_rows if not r.saturated]
        if not steady:
            raise InputError(
                f"load test: all {len(load_rows)} rows saturated; nothing steady to check the model against"
            )
        correction = LoadCorrection()
        if correct:
            correction = fit_load_correction(cal.latency_model(), steady)
            cal = cal.model_copy(update={"load_correction": correction})
        check, _ = check_load_test(cal.latency_model(), steady, corrected=correct)
        cal = cal.model_copy(update={"load_check": check})
    return cal
