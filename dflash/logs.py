"""structlog set-up: JSON lines on stdout (and a copy in --log-file); humans on stderr.

Configured once, by the entry point (`configure`). A program that embeds the Coordinator
may configure structlog its own way, or subscribe to records with `Coordinator.subscribe`.
"""

from __future__ import annotations

import sys
import threading
from typing import IO, Any

import structlog

__all__ = ["configure", "human"]


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


def configure(stream: IO[str] | None = None, log_file: IO[str] | None = None, level: str = "info") -> None:
    sinks = [stream if stream is not None else sys.stdout]
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


def human(message: str, **_: Any) -> None:
    """A line for people, on stderr (never on stdout, which stays pure JSON)."""
    print(message, file=sys.stderr, flush=True)
