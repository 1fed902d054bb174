"""structlog set-up: JSON lines on stdout (and a copy in --log-file); humans on stderr.

Configured once, by the entry point (`configure`). A program that embeds the Coordinator
may configure structlog its own way, or subscribe to records with `Coordinator.subscribe`.
Two subscribers every run has: `RunLog` (the run folder's own `records.jsonl`, whatever
structlog does) and `ProgressLine` (one updating line on stderr when it is a terminal).
"""

from __future__ import annotations

import datetime
import json
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import structlog

__all__ = ["ProgressLine", "RunLog", "configure", "human", "progress"]


class _JSONLines:
    """A structlog logger that writes each rendered line to every sink and flushes."""

    _lock = threading.Lock()

    def __init__(self, sinks: list[IO[str]]) -> None:
        self._sinks = sinks

    def msg(self, message: str) -> None:
        with self._lock:
            for s in self._sinks:
                s.write(message + "\n")
                s.flush()

    info = debug = warning = error = critical = exception = log = msg


def configure(stream: IO[str] | None = sys.stdout, log_file: IO[str] | None = None, level: str = "info") -> None:
    """JSON lines to `stream` (None: not to a stream) and to `log_file`."""
    sinks = [stream] if stream is not None else []
    if log_file is not None:
        sinks.append(log_file)
    structlog.reset_defaults()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=lambda *_: _JSONLines(sinks),
        cache_logger_on_first_use=True,
    )


def progress(
    desc: str, total: int | None = None, unit: str = "it", initial: int = 0, stream: IO[str] | None = None
) -> Any:
    """A tqdm bar on stderr for people: live on a terminal, off otherwise (the JSON records
    on stdout carry the same progress, and a log file stays free of `\\r`)."""
    from tqdm import tqdm

    out = stream if stream is not None else sys.stderr
    return tqdm(total=total, desc=desc, unit=unit, initial=initial, file=out, disable=not out.isatty(), leave=False)


def human(message: str, **_: Any) -> None:
    """A line for people, on stderr (never on stdout, which stays pure JSON)."""
    print(message, file=sys.stderr, flush=True)


class RunLog:
    """Appends every record to a JSON-lines file (a resumed run continues the same file)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._f: IO[str] | None = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()

    def write(self, record: dict[str, Any]) -> None:
        if self._f is None:
            return
        now = datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")
        self._f.write(json.dumps({**record, "level": "info", "timestamp": now}, default=str) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class ProgressLine:
    """`step 40/605 loss 2.1 tau_sim 1.3 812 tok/s ETA 3.1 min` on stderr, for people; only
    when stderr is a terminal (stdout stays pure JSON, and logs stay free of `\\r`)."""

    def __init__(self, total_steps: int, start_step: int = 0, stream: IO[str] | None = None) -> None:
        self.total = total_steps
        self.start_step = start_step
        self.stream = stream if stream is not None else sys.stderr
        self.on = self.stream.isatty()
        self.tokens = 0
        self.t0 = time.perf_counter()
        self.shown = False

    def __call__(self, record: dict[str, Any]) -> None:
        if not self.on or record.get("event") != "train_step":
            return
        self.tokens += record["tokens"]
        elapsed = time.perf_counter() - self.t0
        done = record["step"] - self.start_step
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        left = (self.total - record["step"]) * elapsed / done if done > 0 else 0.0
        loss = f"{record['loss']:.4f}" if record["loss"] is not None else "nan"
        self.stream.write(
            f"\rstep {record['step']}/{self.total} loss {loss} tau_sim {record['tau_sim']:.2f} "
            f"{rate:.0f} tok/s ETA {left / 60:.1f} min   "
        )
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()
