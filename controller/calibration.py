"""Calibration: fit step costs from a micro-benchmark CSV; the calibration file format.

Fitting is pure (rows in, parameters out); reading and writing files is at the edges
(:func:`read_bench_csv`, :func:`load`, :func:`save`). Every input problem raises
:class:`~controller.errors.InputError` with one line naming the file, row and column.
"""

from __future__ import annotations

import csv
import datetime as dt
import hashlib
import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from controller.atomic import write_json_atomic
from controller.errors import InputError, validation_error_line
from controller.model import PHASES, LatencyModel, Moe, StepCost

SCHEMA_VERSION = 1
BENCH_COLUMNS = ("phase", "batch_size", "tokens_per_seq", "context_len", "iteration", "latency_s")
LOAD_COLUMNS = (
    "rate",
    "sd",
    "draft_length",
    "acceptance_rate",
    "mean_e2e_s",
    "mean_prompt_tokens",
    "mean_gen_tokens",
)
REQUIRED_PHASES = ("prefill", "target", "verify")  # draft may be free (n-gram lookup)
DEFAULT_WARMUP = 10
MIN_BATCH_SIZES = 3

# --------------------------------------------------------------------------------------------
# The file format (pydantic: out-of-range or missing fields fail with the field's path)
# --------------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KneeSpec(_Strict):
    at_tokens: float = Field(gt=0, description="tokens in the step where the slope changes")
    slope_delta_s_per_token: float = Field(description="slope added past the knee")


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
    segments: list[SegmentFit] = []
    notes: list[str] = []


class PhaseSpec(_Strict):
    intercept_s: float = Field(ge=0, le=60, description="load-independent cost of one step")
    slope_s_per_token: float = Field(ge=0, le=1, description="cost per token in the step")
    context_s_per_token: float = Field(default=0.0, ge=0, le=1, description="per KV token read")
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
        )


class Phases(_Strict):
    prefill: PhaseSpec
    target: PhaseSpec
    verify: PhaseSpec
    draft: PhaseSpec = PhaseSpec(intercept_s=0.0, slope_s_per_token=0.0)


class Serving(_Strict):
    max_num_seqs: int = Field(default=256, ge=1, le=65536, description="vLLM --max-num-seqs")
    max_num_batched_tokens: int | None = Field(
        default=None, ge=16, le=1_048_576, description="vLLM --max-num-batched-tokens (chunked-prefill budget per step)"
    )


class MoeSpec(_Strict):
    num_experts: int = Field(ge=1)
    top_k: int = Field(ge=1)

    @model_validator(mode="after")
    def _k_within_e(self) -> MoeSpec:
        if self.top_k > self.num_experts:
            raise ValueError("top_k must be <= num_experts")
        return self


class LoadCorrection(_Strict):
    scale_off: float = Field(default=1.0, gt=0, le=100)
    scale_on: float = Field(default=1.0, gt=0, le=100)


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
    schema_version: Literal[1]
    kind: Literal["sd-controller/calibration"] = "sd-controller/calibration"
    example: bool = False
    metadata: Metadata = Metadata()
    serving: Serving = Serving()
    moe: MoeSpec | None = None
    phases: Phases
    load_correction: LoadCorrection = LoadCorrection()
    load_check: LoadCheck | None = None

    def latency_model(self, max_num_seqs: int | None = None) -> LatencyModel:
        """The model this calibration describes (optionally with another max_num_seqs)."""
        return LatencyModel(
            prefill=self.phases.prefill.step_cost(),
            target=self.phases.target.step_cost(),
            verify=self.phases.verify.step_cost(),
            draft=self.phases.draft.step_cost(),
            max_num_seqs=max_num_seqs or self.serving.max_num_seqs,
            max_num_batched_tokens=self.serving.max_num_batched_tokens,
            moe=Moe(self.moe.num_experts, self.moe.top_k) if self.moe else None,
            scale_off=self.load_correction.scale_off,
            scale_on=self.load_correction.scale_on,
        )


def load(path: str | Path) -> CalibrationFile:
    """Read and validate a calibration file; one-line :class:`InputError` on any problem."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"{p}: cannot read calibration file: {exc.strerror or exc}") from exc
    return parse(text, str(p))


def parse(text: str, where: str = "calibration") -> CalibrationFile:
    import json

    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: not valid JSON: {exc.msg} at line {exc.lineno}") from exc
    if not isinstance(raw, dict):
        raise InputError(f"{where}: top level must be a JSON object")
    version = raw.get("schema_version")
    if version != SCHEMA_VERSION:
        raise InputError(f"{where}: schema_version {version!r} is not supported (this build reads {SCHEMA_VERSION})")
    try:
        return CalibrationFile.model_validate(raw)
    except ValidationError as exc:
        raise InputError(validation_error_line(where, exc)) from exc


def save(cal: CalibrationFile, path: str | Path) -> None:
    """Write atomically: a failed run never leaves half a file."""
    write_json_atomic(path, cal.model_dump(mode="json"))


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
    reader.fieldnames = header
    rows = list(reader)
    if not rows:
        raise InputError(f"{path}: no data rows")
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
    """Rows of a micro-benchmark CSV and the file's SHA-256."""
    p = Path(path)
    raw, digest = _read_csv(p, BENCH_COLUMNS)
    rows = []
    for i, r in enumerate(raw):
        line = i + 2  # header is line 1
        phase = (r["phase"] or "").strip().lower()
        if phase not in PHASES:
            raise InputError(f"{p}:{line}: column phase: unknown phase {phase!r} (expected {'|'.join(PHASES)})")
        batch = _number(p, line, "batch_size", r["batch_size"], int)
        tps = _number(p, line, "tokens_per_seq", r["tokens_per_seq"], int)
        ctx = _number(p, line, "context_len", r["context_len"])
        it = _number(p, line, "iteration", r["iteration"], int)
        lat = _number(p, line, "latency_s", r["latency_s"])
        for col, val, low in (("batch_size", batch, 1), ("tokens_per_seq", tps, 1)):
            if val < low:
                raise InputError(f"{p}:{line}: column {col}: {val:g} must be >= {low}")
        if ctx < 0:
            raise InputError(f"{p}:{line}: column context_len: {ctx:g} is negative")
        if lat < 0:
            raise InputError(f"{p}:{line}: column latency_s: {lat:g} is negative")
        rows.append(BenchRow(phase, int(batch), int(tps), ctx, int(it), lat, line))
    return rows, digest


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
        vals = {c: _number(p, line, c, r[c]) for c in LOAD_COLUMNS if c != "sd"}
        for c, v in vals.items():
            if v < 0:
                raise InputError(f"{p}:{line}: column {c}: {v:g} is negative")
        if vals["acceptance_rate"] > 1:
            raise InputError(f"{p}:{line}: column acceptance_rate: {vals['acceptance_rate']:g} > 1")
        if sd == "on" and vals["draft_length"] < 1:
            raise InputError(f"{p}:{line}: column draft_length: must be >= 1 when sd is on")
        if vals["mean_e2e_s"] <= 0 or vals["mean_gen_tokens"] <= 0:
            raise InputError(f"{p}:{line}: mean_e2e_s and mean_gen_tokens must be > 0")
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
            )
        )
    return rows, digest


# --------------------------------------------------------------------------------------------
# Fitting (pure)
# --------------------------------------------------------------------------------------------


def drop_warmup(rows: Iterable[BenchRow], warmup: int, where: str = "bench") -> list[BenchRow]:
    """Drop the first ``warmup`` iterations of every (phase, batch, tokens, context) group."""
    groups: dict[tuple, list[BenchRow]] = defaultdict(list)
    for r in rows:
        groups[(r.phase, r.batch_size, r.tokens_per_seq, r.context_len)].append(r)
    kept: list[BenchRow] = []
    for (phase, batch, tps, ctx), group in groups.items():
        group.sort(key=lambda r: r.iteration)
        if len(group) <= warmup:
            raise InputError(
                f"{where}: phase {phase} batch_size {batch} tokens_per_seq {tps} context_len {ctx:g}:"
                f" only {len(group)} iteration(s), all dropped as warm-up (warmup={warmup});"
                " lower --warmup"
            )
        kept.extend(group[warmup:])
    return kept


def _r2(y: np.ndarray, pred: np.ndarray) -> float | None:
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    if ss_tot <= 0:
        return None
    return 1.0 - float(np.sum((y - pred) ** 2)) / ss_tot


def _weights(y: np.ndarray) -> np.ndarray:
    # Timing noise is relative (a 2 s step jitters more than a 2 ms one): weight by 1/y so a
    # few long prefill steps cannot drown the intercept that the short steps pin down.
    return 1.0 / np.maximum(y, 1e-9)


def _nonneg_lstsq(cols: dict[str, np.ndarray], y: np.ndarray, free: set[str]) -> dict[str, float]:
    """Weighted least squares, the columns not in ``free`` kept >= 0 (drop negatives, refit)."""
    active = [k for k, v in cols.items() if np.ptp(v) > 0 or k == "intercept"]
    w = _weights(y)
    while True:
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


@dataclass(frozen=True)
class _Fit:
    spec: PhaseSpec
    sse: float


def _design(x: np.ndarray, z: np.ndarray, knee: float | None, use_ctx: bool) -> dict[str, np.ndarray]:
    cols = {"intercept": np.ones_like(x), "slope": x}
    if use_ctx:
        cols["context"] = z
    if knee is not None:
        cols["knee"] = np.maximum(0.0, x - knee)
    return cols


def _fit_once(
    x: np.ndarray, x_raw: np.ndarray, z: np.ndarray, y: np.ndarray, knee: float | None, use_ctx: bool
) -> _Fit:
    cols = _design(x, z, knee, use_ctx)
    coef = _nonneg_lstsq(cols, y, free={"knee"})
    if knee is not None and coef["slope"] + coef["knee"] < 0:
        coef["knee"] = -coef["slope"]
    pred = sum(coef[k] * cols[k] for k in cols)
    sse = float(np.sum(((y - pred) * _weights(y)) ** 2))
    spec = PhaseSpec(
        intercept_s=max(coef["intercept"], 0.0),
        slope_s_per_token=coef["slope"],
        context_s_per_token=coef.get("context", 0.0),
        knees=[KneeSpec(at_tokens=knee, slope_delta_s_per_token=coef["knee"])] if knee else [],
    )
    return _Fit(spec, sse)


def _best_knee(
    x: np.ndarray, x_raw: np.ndarray, z: np.ndarray, y: np.ndarray, distinct: np.ndarray, use_ctx: bool
) -> _Fit:
    """Best single knee: scan the measured token counts, then refine between neighbours.

    The knee rarely sits on a measured point; the SSE is smooth in the knee position between
    two measured points, so a golden-section search there finds it.
    """
    inner = distinct[2:-2]  # at least two distinct points on each side
    scans = [(_fit_once(x, x_raw, z, y, float(k), use_ctx), i) for i, k in enumerate(inner, start=2)]
    best, i = min(scans, key=lambda t: t[0].sse)
    lo, hi = float(distinct[i - 1]), float(distinct[i + 1])
    g = (math.sqrt(5) - 1) / 2
    for _ in range(40):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if _fit_once(x, x_raw, z, y, a, use_ctx).sse < _fit_once(x, x_raw, z, y, b, use_ctx).sse:
            hi = b
        else:
            lo = a
    refined = _fit_once(x, x_raw, z, y, 0.5 * (lo + hi), use_ctx)
    return refined if refined.sse < best.sse else best


def _bic(n: int, sse: float, params: int) -> float:
    return n * math.log(max(sse, 1e-300) / n) + params * math.log(n)


def fit_phase(rows: Sequence[BenchRow], moe: Moe | None = None, where: str = "bench") -> PhaseSpec:
    """Fit one phase: a + b·x (+ c·z) by weighted least squares, with one knee where a line won't do.

    x = batch_size·tokens_per_seq (MoE: effective tokens), z = batch_size·context_len. The knee
    is kept only when it lowers the BIC by more than 10 (strong evidence), so noise on a straight
    line does not grow a knee.
    """
    phase = rows[0].phase
    batches = sorted({r.batch_size for r in rows})
    if len(batches) < MIN_BATCH_SIZES:
        raise InputError(
            f"{where}: phase {phase}: needs at least {MIN_BATCH_SIZES} distinct batch sizes, "
            f"got {len(batches)} ({','.join(map(str, batches))})"
        )
    x_raw = np.array([r.batch_size * r.tokens_per_seq for r in rows], dtype=float)
    x = moe.effective_tokens(x_raw) if moe and phase != "draft" else x_raw
    z = np.array([r.batch_size * r.context_len for r in rows], dtype=float)
    y = np.array([r.latency_s for r in rows], dtype=float)
    notes: list[str] = []
    # The context term is identifiable only if z varies independently of x.
    use_ctx = np.ptp(z) > 0 and len({r.context_len for r in rows}) >= 2
    if use_ctx and abs(np.corrcoef(x, z)[0, 1]) > 0.999:
        use_ctx = False
    if not use_ctx:
        notes.append("context term not identifiable (context_len does not vary independently); set to 0")
    n = len(y)
    best = _fit_once(x, x_raw, z, y, None, use_ctx)
    base_params = 2 + int(use_ctx)
    best_bic = _bic(n, best.sse, base_params)
    distinct = np.unique(x)
    if moe is None and distinct.size >= 5:
        knee_fit = _best_knee(x, x_raw, z, y, distinct, use_ctx)
        bic = _bic(n, knee_fit.sse, base_params + 2)
        if bic < best_bic - 10.0:
            best, best_bic = knee_fit, bic
    if best.spec.knees:
        notes.append(f"compute knee at {best.spec.knees[0].at_tokens:g} tokens per step")
    cost = best.spec.step_cost()
    pred = np.asarray(cost(x, z))
    resid = y - pred
    bounds = [0.0, *(k.at_tokens for k in best.spec.knees), math.inf]
    segments = []
    for lo, hi in itertools.pairwise(bounds):
        mask = (x > lo if lo > 0 else x >= lo) & (x <= hi)
        seg_y, seg_p = y[mask], pred[mask]
        segments.append(
            SegmentFit(
                from_tokens=float(x[mask].min()) if mask.any() else lo,
                to_tokens=float(x[mask].max()) if mask.any() else lo,
                n=int(mask.sum()),
                r2=_r2(seg_y, seg_p) if mask.sum() > 1 else None,
                rmse_s=float(np.sqrt(np.mean((seg_y - seg_p) ** 2))) if mask.any() else 0.0,
            )
        )
    fit = PhaseFit(
        n=n,
        r2=_r2(y, pred),
        rmse_s=float(np.sqrt(np.mean(resid**2))),
        max_abs_residual_s=float(np.max(np.abs(resid))),
        segments=segments,
        notes=notes,
    )
    return best.spec.model_copy(update={"fit": fit})


def fit_phases(
    rows: Sequence[BenchRow],
    warmup: int = DEFAULT_WARMUP,
    moe: Moe | None = None,
    where: str = "bench",
) -> Phases:
    """Fit every phase present; prefill, target and verify are required."""
    kept = drop_warmup(rows, warmup, where)
    by_phase: dict[str, list[BenchRow]] = defaultdict(list)
    for r in kept:
        by_phase[r.phase].append(r)
    missing = [p for p in REQUIRED_PHASES if p not in by_phase]
    if missing:
        raise InputError(f"{where}: no rows for phase(s) {', '.join(missing)}")
    specs = {p: fit_phase(by_phase[p], moe, where) for p in PHASES if p in by_phase}
    if "draft" not in specs:
        specs["draft"] = PhaseSpec(
            intercept_s=0.0,
            slope_s_per_token=0.0,
            fit=PhaseFit(
                n=0,
                r2=None,
                rmse_s=0.0,
                max_abs_residual_s=0.0,
                notes=["no draft rows: drafting taken as free (n-gram)"],
            ),
        )
    return Phases(**specs)


# --------------------------------------------------------------------------------------------
# Load-test check and correction
# --------------------------------------------------------------------------------------------


def _predicted_latency(model: LatencyModel, row: LoadRow) -> float:
    from controller.acceptance import alpha_from_vllm_rate
    from controller.model import Workload, predict_point

    workload = Workload(row.mean_prompt_tokens, row.mean_gen_tokens)
    gamma = row.draft_length if row.sd else 0
    alpha = float(alpha_from_vllm_rate(row.acceptance_rate, max(gamma, 1)))
    p = predict_point(model, row.rate, alpha, max(gamma, 1), workload)
    return p.latency_on_s if row.sd else p.latency_off_s


def _paper_fit_r2(rows: Sequence[LoadRow]) -> float | None:
    """R² of the paper's L = C1/(1 − rate·C2), fitted per (sd, draft_length) curve."""
    curves: dict[tuple, list[LoadRow]] = defaultdict(list)
    for r in rows:
        curves[(r.sd, r.draft_length if r.sd else 0, round(r.acceptance_rate, 3))].append(r)
    y_all, p_all = [], []
    for group in curves.values():
        rate = np.array([r.rate for r in group])
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
) -> CalibrationFile:
    """Fit a whole calibration (pure: rows and options in, file object out)."""
    moe_model = Moe(moe.num_experts, moe.top_k) if moe else None
    phases = fit_phases(bench_rows, warmup, moe_model, where)
    meta = metadata or Metadata()
    if not meta.created:
        meta = meta.model_copy(update={"created": dt.date.today().isoformat()})
    cal = CalibrationFile(
        schema_version=SCHEMA_VERSION,
        metadata=meta,
        serving=Serving(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        moe=moe,
        phases=phases,
    )
    if load_rows:
        correction = LoadCorrection()
        if correct:
            correction = fit_load_correction(cal.latency_model(), load_rows)
            cal = cal.model_copy(update={"load_correction": correction})
        check, _ = check_load_test(cal.latency_model(), load_rows, corrected=correct)
        cal = cal.model_copy(update={"load_check": check})
    return cal
