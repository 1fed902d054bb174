"""Records have one format wherever they land (stdout, --log-file, the run folder, `dflash export`),
and the progress bar on stderr shows only on a terminal."""

from __future__ import annotations

import datetime
import io
import json
from pathlib import Path
from typing import Any

import pytest
import structlog

from dflash import logs
from tests.conftest import CliRun, dflash, json_lines

ENVELOPE = {"event", "level", "timestamp"}


class _FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def _when(record: dict[str, Any]) -> datetime.datetime:
    return datetime.datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00"))


def _without_time(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "timestamp"} for r in records]


def test_run_log_writes_what_stdout_writes_whatever_structlog_does(tmp_path: Path) -> None:
    """RunLog's lines equal the configured stdout's (same keys, same order, same values but the
    time), and stay so after an embedding program configures structlog its own way."""
    out = io.StringIO()
    logs.configure(out)
    record = {"event": "setup", "rank": 1, "samples": 3, "path": tmp_path, "nested": {"a": [1.5, None]}}
    structlog.contextvars.bind_contextvars(job="j1")
    try:
        structlog.get_logger("dflash").info(record["event"], **{k: v for k, v in record.items() if k != "event"})
        structlog.configure(processors=[structlog.processors.KeyValueRenderer()])  # someone else's set-up
        run_log = logs.RunLog(tmp_path / "records.jsonl")
        run_log.write(record)
        run_log.close()
    finally:
        structlog.contextvars.clear_contextvars()
    stdout = [json.loads(line) for line in out.getvalue().splitlines()]
    saved = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert [list(r) for r in saved] == [list(r) for r in stdout]
    assert _without_time(saved) == _without_time(stdout)
    assert saved[0]["level"] == "info" and saved[0]["path"] == str(tmp_path) and saved[0]["job"] == "j1"
    assert _when(saved[0]).tzinfo == datetime.UTC
    assert record == {"event": "setup", "rank": 1, "samples": 3, "path": tmp_path, "nested": {"a": [1.5, None]}}


@pytest.mark.slow
def test_stdout_run_folder_and_export_records_carry_the_same_fields(cli_run: CliRun, tmp_path: Path) -> None:
    """A run's stdout and its records.jsonl hold the same records, key for key (all but the time
    equal); every one, and `dflash export`'s record too, carries event, level and timestamp."""
    assert cli_run.proc.returncode == 0, cli_run.proc.stderr
    stdout = json_lines(cli_run.proc.stdout)
    saved = json_lines((cli_run.out / "tiny" / "records.jsonl").read_text(encoding="utf-8"))
    assert [list(r) for r in saved] == [list(r) for r in stdout]
    assert _without_time(saved) == _without_time(stdout)
    kinds = {r["event"] for r in saved}
    assert {"run_start", "setup", "train_step", "profile", "export", "eval", "run_end"} <= kinds
    proc = dflash("export", str(cli_run.out / "tiny"), str(tmp_path / "exp"))
    assert proc.returncode == 0, proc.stderr
    (export,) = json_lines(proc.stdout)
    for record in [*saved, export]:
        assert set(record) >= ENVELOPE and record["level"] == "info", record
        assert _when(record).tzinfo == datetime.UTC
    assert set.intersection(*(set(r) for r in saved)) == ENVELOPE  # what every record has, export's too
    assert export["event"] == "export" and {"checkpoint", "path", "vllm_speculative_config"} <= set(export)


def _step(step: int, tokens: int = 100) -> dict[str, Any]:
    return {"event": "train_step", "step": step, "tokens": tokens, "loss": 2.25, "tau_sim": 1.3}


def test_progress_line_shows_step_loss_tau_rate_and_eta_on_a_terminal() -> None:
    """On a terminal: steps done of the total, loss, tau_sim, tokens/s and tqdm's ETA; other records ignored."""
    tty = _FakeTTY()
    line = logs.ProgressLine(40, start_step=10, stream=tty)
    line({"event": "profile"})
    line(_step(12))
    line(_step(14))
    shown = tty.getvalue().split("\r")[-1]
    line.close()
    assert "14/40" in shown and "loss 2.2500" in shown and "tau_sim 1.30" in shown and "tok/s" in shown, shown
    assert "<" in shown  # tqdm's [elapsed<remaining]


def test_progress_line_writes_nothing_off_a_terminal() -> None:
    """Off a terminal (a pipe, a log file) the training bar writes nothing."""
    pipe = io.StringIO()
    line = logs.ProgressLine(40, stream=pipe)
    line(_step(1))
    line.close()
    assert pipe.getvalue() == ""


def test_bars_start_no_monitor_thread_and_other_bars_monitors_are_stopped() -> None:
    """Our bars, on a terminal or off it, start no tqdm monitor thread (tqdm starts one even for
    a disabled bar and never stops it); `stop_monitors` stops one another library's bar started
    meanwhile, once its bars are closed, and keeps those that were there before."""
    import threading

    from tqdm import tqdm

    if tqdm.monitor is not None and tqdm.monitor.report():
        tqdm.monitor.exit()
    before = frozenset(threading.enumerate())
    for stream in (_FakeTTY(), io.StringIO()):
        line = logs.ProgressLine(10, stream=stream)
        line(_step(1))
        line.close()
        with logs.progress("files", 3, stream=stream) as bar:
            bar.update(3)
    assert [t for t in threading.enumerate() if t not in before] == []
    theirs = tqdm(total=2, file=io.StringIO())  # someone else's bar: tqdm's monitor starts
    monitor = tqdm.monitor
    assert monitor is not None and monitor.is_alive()
    logs.stop_monitors(before)
    assert monitor.is_alive()  # its bar is still open
    theirs.close()
    logs.stop_monitors(before | {monitor})
    assert monitor.is_alive()  # one the caller had before is kept
    logs.stop_monitors(before)
    assert not monitor.is_alive()
