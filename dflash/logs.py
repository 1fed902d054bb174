"""structlog set-up: JSON lines on stdout (and a copy in --log-file); humans on stderr.

Configured once, by the entry point (`configure`). A program that embeds the Coordinator
may configure structlog its own way, or subscribe to records with `Coordinator.subscribe`.
Every record, wherever it lands, is rendered by one processor chain (`render`): the same
fields (`event`, `level`, `timestamp`, and `rank` where the run has ranks) on stdout, in the
log file and in the run folder. A record's `level` is its severity, decided here by its event
(`LEVELS`, `level_of`): `warning` for a skipped step, for every `warning` record (a dropped
sample, a fallback) and for an `eval` that was not lossless, `error` for `run_failed`, `info`
for the rest. A run's record is stamped
once (`stamp`: level and time) and rendered once: the line on stdout and the line in the run
folder's `records.jsonl` (`RunLog`) are the same bytes. Every run also has `ProgressLine` (a bar
on stderr when it is a terminal) among its record subscribers.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import IO, Any

import structlog
from structlog.typing import EventDict, Processor
from tqdm import tqdm
from tqdm._monitor import TMonitor

__all__ = [
    "LEVELS",
    "ProgressLine",
    "RunLog",
    "configure",
    "human",
    "level_of",
    "progress",
    "render",
    "stamp",
    "stop_monitors",
    "write_line",
]

# The one table of severities: an event not named here is `info`. `train_step` is either
# (`level_of`): `warning` when its step was skipped (a non-finite loss or gradient).
LEVELS: dict[str, str] = {
    "warning": "warning",  # set-up's and the run's warnings: dropped or skipped samples, fallbacks
    "bad_step": "warning",  # an optimizer step skipped: non-finite loss or gradient
    "run_failed": "error",
}

_SEVERITY = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
_METHOD_LEVEL = {"warn": "warning", "exception": "error", "fatal": "critical", "msg": "info", "log": "info"}


def _by_event(record: Mapping[str, Any]) -> str | None:
    """The level an event calls for (`LEVELS`; a skipped `train_step` and an `eval` whose
    outputs were not the target's own are warnings); None for an event that calls for none."""
    event = record.get("event")
    if event == "train_step" and (record.get("skipped") or ("loss" in record and record["loss"] is None)):
        return "warning"
    if event == "eval" and record.get("lossless") is False:
        return "warning"
    return LEVELS.get(str(event))


def level_of(record: Mapping[str, Any]) -> str:
    """The record's level: its own `level` where it has one (`Coordinator.emit(level=...)`),
    else by its event (`_by_event`), else `info`."""
    given = record.get("level")
    if given:
        return str(given)
    return _by_event(record) or "info"


def _add_level(_: Any, method: str, event_dict: EventDict) -> EventDict:
    """`level`: the record's own, else the severer of the event's (`_by_event`, where it calls
    for one) and the logging method's (`.info("warning", ...)` is a warning; `.debug("x")` stays
    debug; `.error("x")` an error)."""
    if not event_dict.get("level"):
        by_method = _METHOD_LEVEL.get(method, method)
        by_event = _by_event(event_dict) or by_method
        severer = max(by_method, by_event, key=lambda lv: _SEVERITY.get(lv, 20))
        event_dict["level"] = severer if severer in _SEVERITY else level_of(event_dict)
    return event_dict


_timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)


def _add_timestamp(logger: Any, method: str, event_dict: EventDict) -> EventDict:
    """The time, unless the record carries its own already (`stamp`: one time per record)."""
    return event_dict if "timestamp" in event_dict else _timestamper(logger, method, event_dict)


def _envelope_last(_: Any, __: str, event_dict: EventDict) -> EventDict:
    """The fields in their order, then `event`, `level`, `timestamp`: one key order however
    the record came (fields alone, or stamped already)."""
    tail = {k: event_dict.pop(k) for k in ("event", "level", "timestamp") if k in event_dict}
    event_dict.update(tail)
    return event_dict


# The one chain: `configure` hands it to structlog, `stamp` and `render` run it without structlog's config.
_STAMP: tuple[Processor, ...] = (structlog.contextvars.merge_contextvars, _add_level, _add_timestamp, _envelope_last)
_JSON = structlog.processors.JSONRenderer(default=str)
_PROCESSORS: tuple[Processor, ...] = (*_STAMP, _JSON)


def stamp(record: Mapping[str, Any], level: str | None = None, method: str = "info") -> dict[str, Any]:
    """`{"event": ..., **fields}` as it is written: the fields, structlog's context variables,
    then `event`, `level` (`level`, else `level_of`) and `timestamp` (now). A stamped record
    comes back as it is: its level and time stay."""
    fields = {k: v for k, v in record.items() if k != "event"}
    event_dict: Any = {**fields, "event": record["event"]}
    if level is not None:
        event_dict["level"] = level
    for proc in _STAMP:
        event_dict = proc(None, method, event_dict)
    return event_dict


def render(record: Mapping[str, Any], method: str = "info") -> str:
    """`{"event": ..., **fields}` as the JSON line a configured structlog logger writes for it
    (a stamped record: the same line every time)."""
    return _JSON(None, method, stamp(record, method=method))


class _JSONLines:
    """A structlog logger that writes each rendered line to every sink and flushes."""

    _lock = threading.Lock()

    def __init__(self, sinks: list[IO[str]], level: str = "info") -> None:
        self._sinks = sinks
        self.level = _SEVERITY.get(level.lower(), 20)

    def msg(self, message: str) -> None:
        with self._lock:
            for s in self._sinks:
                s.write(message + "\n")
                s.flush()

    info = debug = warning = error = critical = exception = log = msg

    def factory(self, *_: Any) -> _JSONLines:
        return self


_lines: _JSONLines | None = None  # the sinks `configure` set up (in force while structlog keeps its factory)


def configure(stream: IO[str] | None = sys.stdout, log_file: IO[str] | None = None, level: str = "info") -> None:
    """JSON lines to `stream` (None: not to a stream) and to `log_file`, from `level` up."""
    global _lines
    sinks = [stream] if stream is not None else []
    if log_file is not None:
        sinks.append(log_file)
    lines = _lines = _JSONLines(sinks, level)
    structlog.reset_defaults()
    structlog.configure(
        processors=list(_PROCESSORS),
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=lines.factory,
        cache_logger_on_first_use=True,
    )


def write_line(line: str, level: str) -> bool:
    """Write a rendered line where `configure`'s JSON lines go (stdout, --log-file) as they are;
    False, writing nothing, when structlog is configured some other way (then log the record
    through structlog)."""
    lines = _lines
    if lines is None or structlog.get_config()["logger_factory"] != lines.factory:
        return False
    if _SEVERITY.get(level, 20) >= lines.level:
        lines.msg(line)
    return True


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
    return _Bar(total=total, desc=desc, unit=unit, initial=initial, file=out, disable=off, leave=False)


class _Bar(tqdm):  # type: ignore[type-arg]
    """Our bars start no monitor thread: tqdm starts one in `__new__`, even for a disabled bar,
    and nothing ever stops it (an embedding program would find a thread left by every run).
    It only forces a redraw of a bar that waits long between updates; ours are updated by hand."""

    monitor_interval = 0


def stop_monitors(keep: Collection[threading.Thread]) -> None:
    """Stop the tqdm monitor threads started since `keep` was taken (by other libraries' bars:
    downloads, dataset loading) whose bars are all closed; tqdm starts a new one if needed."""
    for t in threading.enumerate():
        if isinstance(t, TMonitor) and t not in keep and not t.tqdm_cls._instances:
            t.exit()  # sets its event and joins it: it wakes at once


def human(message: str, **_: Any) -> None:
    """A line for people, on stderr (never on stdout, which stays pure JSON)."""
    print(message, file=sys.stderr, flush=True)


class RunLog:
    """Appends every record to a JSON-lines file (a resumed run continues the same file),
    rendered as stdout renders it (`render`), whatever structlog's configuration. The
    Coordinator hands it the very line it wrote on stdout (`write_line`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._f: IO[str] | None = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()

    def write(self, record: Mapping[str, Any]) -> None:
        self.write_line(render(record))

    def write_line(self, line: str) -> None:
        if self._f is None:
            return
        self._f.write(line + "\n")
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
