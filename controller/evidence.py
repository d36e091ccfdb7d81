"""The evidence store: what the server did, tick by tick, next to what the model predicted.

One :class:`EvidenceRecord` per tick for the applied mode: load, acceptance, lengths, queue,
the observed mean latency and the predictions (corrected and calibrated). Ticks that must not
teach the model (a restart in flight, the backlog draining after one, missing data) are kept
but marked with the reason they are excluded.

:class:`FileEvidenceStore` is a JSON-lines file: a header line (kind, schema) and one record
per line, appended as a single write per tick (cheap, and a crash can tear only the last
line, which is dropped on load). When it holds a quarter more than ``max_records`` it is
rewritten atomically (controller/atomic.py) with the newest ``max_records``: bounded on disk
and in memory. A file that cannot be trusted (bad header, a bad line before the last, another
schema) is set aside as ``*.corrupt-<time>`` with one log line and the store starts empty.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from controller.atomic import write_bytes_atomic
from controller.errors import ConfigError

log = structlog.get_logger("sd_controller.evidence")

EVIDENCE_KIND = "sd-controller/evidence"
EVIDENCE_SCHEMA = 1


class Excluded:
    """Why a record does not update the model (None: it does)."""

    PENDING = "restart_pending"
    SETTLING = "settling_after_restart"
    NO_LATENCY = "no_observed_latency"
    NO_LOAD = "no_load"
    UNSTEADY = "load_not_steady"
    NO_ACCEPTANCE = "acceptance_not_measured"
    OVERLOADED = "predicted_overloaded"
    CONGESTED = "congested"
    NOT_READY = "hook_not_ready"
    DISABLED = "correction_disabled"


@dataclass(frozen=True, slots=True)  # slots: a week of records is a few MB, not tens
class EvidenceRecord:
    time_s: float
    mode: str  # "off" | "on"
    draft_length: int | None
    arrival_rate_rps: float
    acceptance_rate: float | None  # vLLM-style, measured this tick (None with SD off)
    alpha: float | None  # per-token α the prediction used
    prompt_tokens: float
    gen_tokens: float
    running: float | None
    waiting: float | None
    observed_latency_s: float | None
    predicted_latency_s: float  # corrected model, applied mode (what the policy used)
    calibrated_latency_s: float  # the calibration alone
    excluded: str | None = None
    gen_tokens_std: float | None = None
    prompt_tokens_std: float | None = None
    running_context_tokens: float | None = None  # measured KV context per running sequence (None: not measured)
    cached_prompt_tokens: float = 0.0  # prefix-cache hits per request the prediction used

    def to_dict(self) -> dict[str, Any]:
        return {k: _json_num(v) for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, raw: Any) -> EvidenceRecord:
        if not isinstance(raw, dict):
            raise ValueError("record is not an object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - names
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))}")
        try:
            rec = cls(**{k: (math.inf if v == "inf" else v) for k, v in raw.items()})
        except TypeError as exc:
            raise ValueError(str(exc).split(") ", 1)[-1]) from None
        if rec.mode not in ("off", "on"):
            raise ValueError(f"mode {rec.mode!r} is not off|on")
        for name in ("time_s", "arrival_rate_rps", "prompt_tokens", "gen_tokens"):
            v = getattr(rec, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number")
        return rec

    @property
    def usable(self) -> bool:
        return self.excluded is None and self.observed_latency_s is not None


def _json_num(v: Any) -> Any:
    if isinstance(v, float) and math.isinf(v):
        return "inf"  # strict JSON has no infinity; an overloaded prediction is one
    return v


class MemoryEvidenceStore:
    """Bounded in-memory history (tests, simulations, a daemon without a file)."""

    def __init__(self, max_records: int = 10080) -> None:
        self.max_records = max_records
        self.records: deque[EvidenceRecord] = deque(maxlen=max_records)

    def load(self) -> list[EvidenceRecord]:
        return list(self.records)

    def append(self, record: EvidenceRecord) -> None:
        self.records.append(record)


class FileEvidenceStore(MemoryEvidenceStore):
    """The history in a JSON-lines file that survives controller restarts (see the module doc)."""

    def __init__(self, path: str | os.PathLike[str], max_records: int = 10080) -> None:
        super().__init__(max_records)
        self.path = Path(path)
        self.set_aside: Path | None = None
        self._lines = 0  # records in the file (may exceed max_records until compaction)
        self._loaded = False

    def load(self) -> list[EvidenceRecord]:
        """The saved history (newest ``max_records``); ConfigError when the file cannot be read."""
        self._loaded = True
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise ConfigError(f"setting evidence_file: {self.path}: cannot read: {exc.strerror or exc}") from None
        try:
            records, torn = _parse(raw)
        except ValueError as exc:
            self._set_aside(str(exc))
            return []
        if torn:
            log.warning("evidence_last_line_torn", path=str(self.path), detail="dropped (a crash mid-append)")
        self.records.clear()
        self.records.extend(records)
        self._lines = len(records)
        if torn or len(records) > self.max_records:
            self._compact()
        return list(self.records)

    def _set_aside(self, why: str) -> None:
        aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
        try:
            os.replace(self.path, aside)
        except OSError as err:
            raise ConfigError(
                f"setting evidence_file: {self.path} is corrupt and cannot be set aside: {err.strerror or err}"
            ) from None
        self.set_aside = aside
        log.error("evidence_file_corrupt", path=str(self.path), moved_to=str(aside), error=why[:200])

    def append(self, record: EvidenceRecord) -> None:
        if not self._loaded:
            self.load()
        super().append(record)
        if self._lines == 0 and not self.path.exists():
            self._compact()
            return
        line = json.dumps(record.to_dict(), allow_nan=False, separators=(",", ":")) + "\n"
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line)  # one write: a crash tears at most this line
        self._lines += 1
        if self._lines > self.max_records + max(self.max_records // 4, 16):
            self._compact()

    def _compact(self) -> None:
        head = json.dumps({"kind": EVIDENCE_KIND, "schema": EVIDENCE_SCHEMA, "max_records": self.max_records})
        body = "".join(json.dumps(r.to_dict(), allow_nan=False, separators=(",", ":")) + "\n" for r in self.records)
        write_bytes_atomic(self.path, (head + "\n" + body).encode("utf-8"))
        self._lines = len(self.records)


def _parse(raw: bytes) -> tuple[list[EvidenceRecord], bool]:
    """Records of a file; ValueError when it cannot be trusted. True when the last line was torn."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8: {exc}") from None
    lines = text.split("\n")
    try:
        head = json.loads(lines[0])
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"line 1: header is not JSON: {type(exc).__name__}") from None
    if not isinstance(head, dict) or head.get("kind") != EVIDENCE_KIND:
        raise ValueError(f"line 1: not an {EVIDENCE_KIND} file")
    if head.get("schema") != EVIDENCE_SCHEMA:
        raise ValueError(f"line 1: schema {head.get('schema')!r} is not {EVIDENCE_SCHEMA}")
    body = lines[1:]
    torn = False
    if body and body[-1] == "":
        body = body[:-1]
    elif body:
        torn = True  # no newline at the end: the last append did not finish
        body = body[:-1]
    out = []
    for i, line in enumerate(body, start=2):
        try:
            out.append(EvidenceRecord.from_dict(json.loads(line)))
        except (ValueError, TypeError, RecursionError, ArithmeticError) as exc:
            raise ValueError(f"line {i}: {exc}") from None
    return out, torn
