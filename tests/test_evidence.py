"""The evidence store: a bounded JSON-lines history on a real file that survives restarts."""

import dataclasses
import json
import math

import pytest
import structlog

from controller.evidence import EVIDENCE_KIND, EvidenceRecord, Excluded, FileEvidenceStore, MemoryEvidenceStore


def rec(t, mode="on", excluded=None, predicted=2.0):
    return EvidenceRecord(
        time_s=t, mode=mode, draft_length=4 if mode == "on" else None, arrival_rate_rps=3.0,
        acceptance_rate=0.6 if mode == "on" else None, alpha=0.7 if mode == "on" else None,
        prompt_tokens=512.0, gen_tokens=256.0, running=8.0, waiting=0.0, observed_latency_s=2.1,
        predicted_latency_s=predicted, calibrated_latency_s=1.8, excluded=excluded,
    )  # fmt: skip


def test_history_survives_a_restart_of_the_controller(tmp_path):
    path = tmp_path / "ev.jsonl"
    store = FileEvidenceStore(path, max_records=100)
    store.load()
    for i in range(10):
        store.append(rec(60.0 * i, excluded=Excluded.SETTLING if i < 2 else None))
    again = FileEvidenceStore(path, max_records=100).load()
    assert again == [rec(60.0 * i, excluded=Excluded.SETTLING if i < 2 else None) for i in range(10)]
    assert [r.usable for r in again[:3]] == [False, False, True]
    assert json.loads(path.read_text().splitlines()[0])["kind"] == EVIDENCE_KIND


def test_bounded_on_disk_and_in_memory(tmp_path):
    path = tmp_path / "ev.jsonl"
    store = FileEvidenceStore(path, max_records=40)
    for i in range(500):
        store.append(rec(float(i)))
        assert len(path.read_text().splitlines()) <= 1 + 40 + 16
    assert len(store.records) == 40
    loaded = FileEvidenceStore(path, max_records=40).load()
    assert [r.time_s for r in loaded] == [float(i) for i in range(460, 500)]
    mem = MemoryEvidenceStore(5)
    for i in range(10):
        mem.append(rec(float(i)))
    assert [r.time_s for r in mem.load()] == [5.0, 6.0, 7.0, 8.0, 9.0]


def test_an_overloaded_prediction_round_trips(tmp_path):
    store = FileEvidenceStore(tmp_path / "ev.jsonl")
    store.append(rec(1.0, predicted=math.inf))
    assert FileEvidenceStore(tmp_path / "ev.jsonl").load()[0].predicted_latency_s == math.inf


def test_a_torn_last_line_is_dropped_with_one_log_line(tmp_path):
    path = tmp_path / "ev.jsonl"
    store = FileEvidenceStore(path)
    for i in range(3):
        store.append(rec(float(i)))
    with open(path, "a") as fh:
        fh.write('{"time_s": 3.0, "mo')  # the crash mid-append
    with structlog.testing.capture_logs() as logs:
        loaded = FileEvidenceStore(path).load()
    assert [r.time_s for r in loaded] == [0.0, 1.0, 2.0]
    assert [e["event"] for e in logs] == ["evidence_last_line_torn"]
    assert path.read_text().endswith("\n")  # rewritten clean


@pytest.mark.parametrize(
    "content",
    [
        "not json\n",
        json.dumps({"kind": "something-else", "schema": 1}) + "\n",
        json.dumps({"kind": EVIDENCE_KIND, "schema": 99}) + "\n",
        json.dumps({"kind": EVIDENCE_KIND, "schema": 1}) + "\n{bad}\n" + json.dumps(rec(1.0).to_dict()) + "\n",
        json.dumps({"kind": EVIDENCE_KIND, "schema": 1})
        + "\n"
        + json.dumps({**rec(1.0).to_dict(), "mode": "x"})
        + "\n",
        json.dumps({"kind": EVIDENCE_KIND, "schema": 1}) + "\n" + json.dumps({**rec(1.0).to_dict(), "extra": 1}) + "\n",
        b"\xff\xfe".decode("latin-1"),
    ],
)
def test_an_untrusted_file_is_set_aside_with_one_log_line(tmp_path, content):
    path = tmp_path / "ev.jsonl"
    path.write_text(content, encoding="utf-8" if content.isascii() else "latin-1")
    store = FileEvidenceStore(path)
    with structlog.testing.capture_logs() as logs:
        assert store.load() == []
    assert [e["event"] for e in logs] == ["evidence_file_corrupt"]
    assert store.set_aside is not None and store.set_aside.exists() and not path.exists()
    store.append(rec(5.0))  # and the store goes on, fresh
    assert [r.time_s for r in FileEvidenceStore(path).load()] == [5.0]


def test_the_measured_running_context_round_trips_and_older_records_load_without_it(tmp_path):
    path = tmp_path / "ev.jsonl"
    store = FileEvidenceStore(path)
    store.append(dataclasses.replace(rec(1.0), running_context_tokens=2100.5))
    old = rec(2.0).to_dict()
    del old["running_context_tokens"]  # written before the field existed
    with open(path, "a") as fh:
        fh.write(json.dumps(old) + "\n")
    loaded = FileEvidenceStore(path).load()
    assert [r.running_context_tokens for r in loaded] == [2100.5, None]
