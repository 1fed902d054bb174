"""structlog set-up: JSON lines on stdout (and a copy in --log-file); humans on stderr.

Configured once, by the entry point (`configure`). A program that embeds the Coordinator
may configure structlog its own way, or subscribe to records with `Coordinator.subscribe`.
Every record, wherever it lands, is rendered by one processor chain (`render`): the same
fields (`event`, `level`, `timestamp`, and `rank` where the run has ranks) on stdout, in the
log file and in the run folder. Two subscribers every run has: `RunLog` (the run folder's own
`records.jsonl`, whatever structlog does) and `ProgressLine` (a bar on stderr when it is a
terminal).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import structlog
from structlog.typing import Processor
from tqdm import tqdm

__all__ = ["ProgressLine", "RunLog", "configure", "human", "progress", "render"]

# The one chain: `configure` hands it to structlog, `render` runs it without structlog's config.
_PROCESSORS: tuple[Processor, ...] = (
    structlog.contextvars.merge_contextvars,
    structlog.processors.add_log_level,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
    structlog.processors.JSONRenderer(default=str),
)


def render(record: dict[str, Any], method: str = "info") -> str:
    """`{"event": ..., **fields}` as the JSON line a configured structlog logger writes for it."""
    fields = {k: v for k, v in record.items() if k != "event"}
    event_dict: Any = {**fields, "event": record["event"]}  # structlog puts `event` after the fields
    for proc in _PROCESSORS:
        event_dict = proc(None, method, event_dict)
    return event_dict


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
        processors=list(_PROCESSORS),
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=lambda *_: _JSONLines(sinks),
        cache_logger_on_first_use=True,
    )


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False


def progress(
    desc: str, total: int | None = None, unit: str = "it", initial: int = 0, stream: IO[str] | None = None
) -> Any:
    """A tqdm bar on stderr for people: live on a terminal, off otherwise (the JSON records
    on stdout carry the same progress, and a log file stays free of `\\r`)."""
    out = stream if stream is not None else sys.stderr
    off = not _is_terminal(out)
    return tqdm(total=total, desc=desc, unit=unit, initial=initial, file=out, disable=off, leave=False)


def human(message: str, **_: Any) -> None:
    """A line for people, on stderr (never on stdout, which stays pure JSON)."""
    print(message, file=sys.stderr, flush=True)


class RunLog:
    """Appends every record to a JSON-lines file (a resumed run continues the same file),
    rendered as stdout renders it (`render`), whatever structlog's configuration."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._f: IO[str] | None = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()

    def write(self, record: dict[str, Any]) -> None:
        if self._f is None:
            return
        self._f.write(render(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class ProgressLine:
    """The training bar on stderr, for people: steps with tqdm's rate and ETA, and the last
    `train_step`'s loss, tau_sim and tokens/s; only when stderr is a terminal."""

    def __init__(self, total_steps: int, start_step: int = 0, stream: IO[str] | None = None) -> None:
        self.bar = progress("train", total=total_steps, unit="step", initial=start_step, stream=stream)
        self.tokens = 0
        self.t0 = time.perf_counter()

    def __call__(self, record: dict[str, Any]) -> None:
        if self.bar.disable or record.get("event") != "train_step":
            return
        self.tokens += record["tokens"]
        elapsed = time.perf_counter() - self.t0
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        loss = f"{record['loss']:.4f}" if record["loss"] is not None else "nan"
        self.bar.update(record["step"] - self.bar.n)
        # records come every train.log_every steps: each is shown as it comes
        self.bar.set_postfix_str(f"loss {loss} tau_sim {record['tau_sim']:.2f} {rate:.0f} tok/s")

    def close(self) -> None:
        self.bar.close()
