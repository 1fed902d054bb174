"""A record's `level` is its severity, and each record has one time: `warning` for a skipped
(non-finite) step and every `warning` record, `error` for `run_failed`, `info` for the rest;
the line on stdout and the line in the run folder's `records.jsonl` are the same bytes."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any

import pytest
import structlog

from dflash import Coordinator, StageError, logs

FAST = {"train.max_steps": 4, "eval.at_end": "false", "checkpoint.export_final": "false"}


def _run_logged(cfg: Any) -> tuple[list[str], list[str], BaseException | None]:
    """A run whose records go to a configured stdout (`logs.configure`): the stdout lines, the
    run folder's lines, and what the run raised. Its subscribers see each record's level as
    written (`logs.level_of`)."""
    out = io.StringIO()
    logs.configure(out)
    coord = Coordinator(cfg)
    subscribed: list[dict[str, Any]] = []
    coord.subscribe(subscribed.append)
    error: BaseException | None = None
    try:
        asyncio.run(asyncio.wait_for(coord.run(), 300))
    except Exception as err:
        error = err
    saved = (Path(cfg.run_dir) / "records.jsonl").read_text(encoding="utf-8").splitlines()
    written = [(r["event"], r["level"]) for r in map(json.loads, saved)]
    assert [(r["event"], logs.level_of(r)) for r in subscribed] == written
    return out.getvalue().splitlines(), saved, error


def _warnings(lines: list[str]) -> list[dict[str, Any]]:
    """`jq 'select(.level == "warning")'`."""
    return [r for r in map(json.loads, lines) if r["level"] == "warning"]


def test_a_skipped_non_finite_step_is_a_warning_and_stdout_is_the_run_folder_byte_for_byte(tiny_config, monkeypatch):
    """A NaN planted in step 2's loss: its `bad_step` and its (skipped) `train_step` are
    warnings, every other record info; stdout and records.jsonl hold the same lines."""
    monkeypatch.setenv("DFLASH_INJECT_FAULT", "drafter.nan@1")
    stdout, saved, error = _run_logged(tiny_config(**FAST))
    assert error is None
    assert stdout == saved  # one rendering: same keys, order, values and time
    warned = _warnings(saved)
    assert [(r["event"], r["step"]) for r in warned] == [("bad_step", 2), ("train_step", 2)]
    assert warned[1]["skipped"] is True and warned[1]["loss"] is None
    others = [json.loads(line) for line in saved]
    assert {r["level"] for r in others if r not in warned} == {"info"}
    assert others[-1]["event"] == "run_end" and len({r["timestamp"] for r in others}) > 1


def test_a_failed_run_writes_run_failed_at_level_error(tiny_config, monkeypatch):
    """A run failed by an injected fault: `run_failed` is an error, in both places alike."""
    monkeypatch.setenv("DFLASH_INJECT_FAULT", "target.model_forward@2")
    stdout, saved, error = _run_logged(tiny_config(**FAST))
    assert isinstance(error, StageError)
    assert stdout == saved
    last = json.loads(saved[-1])
    assert last["event"] == "run_failed" and last["level"] == "error" and last["stage"] == "target.model_forward[0]"
    assert {json.loads(line)["level"] for line in saved[:-1]} == {"info"}


def test_levels_come_from_one_table_whoever_logs() -> None:
    """The level is the event's, also for a record logged straight through structlog at
    `.info` (the commands' own `warning` records); a record's own `level` wins; a stamped record
    renders the same line every time."""
    out = io.StringIO()
    logs.configure(out)
    log = structlog.get_logger("dflash")
    log.info("warning", message="skipped 2 invalid record(s)")
    log.info("run_failed", error="boom", stage=None)
    log.info("train_step", step=3, loss=1.5, skipped=False)
    log.warning("setup", samples=1)  # a severer method keeps its own
    got = [(r["event"], r["level"]) for r in map(json.loads, out.getvalue().splitlines())]
    assert got == [("warning", "warning"), ("run_failed", "error"), ("train_step", "info"), ("setup", "warning")]
    assert logs.level_of({"event": "bad_step"}) == "warning"
    assert logs.level_of({"event": "train_step", "skipped": True, "loss": None}) == "warning"
    assert logs.level_of({"event": "checkpoint", "level": "warning"}) == "warning"
    record = logs.stamp({"event": "export", "path": "x"})
    assert list(record) == ["path", "event", "level", "timestamp"]
    assert logs.render(record) == logs.render(dict(record)) == json.dumps(record)


def test_an_embedding_programs_structlog_gets_each_record_at_its_level(tiny_config, monkeypatch):
    """structlog configured by the embedding program: each record reaches it through the
    method of its level, with the same time as the run folder's copy."""
    seen: list[tuple[str, dict[str, Any]]] = []

    def keep(_: Any, method: str, event_dict: dict[str, Any]) -> str:
        seen.append((method, dict(event_dict)))
        raise structlog.DropEvent

    structlog.configure(processors=[keep])
    monkeypatch.setenv("DFLASH_INJECT_FAULT", "target.model_forward@1")
    cfg = tiny_config(**FAST)
    with pytest.raises(StageError):
        asyncio.run(asyncio.wait_for(Coordinator(cfg).run(), 300))
    saved = [json.loads(line) for line in (Path(cfg.run_dir) / "records.jsonl").read_text().splitlines()]
    got = [(method, e["event"], e["timestamp"]) for method, e in seen]
    assert got == [(r["level"], r["event"], r["timestamp"]) for r in saved]
    assert seen[-1][0] == "error"
