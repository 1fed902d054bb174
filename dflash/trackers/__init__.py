"""Experiment trackers fed from the run's own records (`run.trackers`, `dflash run --tracker`).

A tracker is a subscriber of `Coordinator.emit`: the training code makes no second set of calls.
`Trackers` (the subscriber) only turns a record into scalars and puts them on a queue, on the
loop thread; one writer thread hands them to every tracker and is joined when the run ends
(normal end, stop or failure). A tracker that raises is dropped: the next record on the loop
thread reports it as one `warning` record, and the run goes on with the same steps.

What each record gives (`scalars_of`): `train_step` → `train/loss`, its parts, `train/lr`,
`train/grad_norm`, `train/tau_sim`, `train/tokens_per_s`, `train/acc_k{k}`; `profile` →
`profile/{stage}_ms`, `profile/{stage}_mfu`, `queue/{name}`; `eval` → `eval/{set}[/turn{t}]/tau`,
`…/accept_k{k}`, `…/lossless` (at the step it ran after). The run's resolved config goes to each
tracker as its hyperparameters, the run's name as its name.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dflash.errors import ConfigError
from dflash.trackers.common import KNOWN, Scalars, Tracker, quiet


def open_trackers(
    names: list[str], run_dir: Path, run_name: str, config: Mapping[str, Any], rank: int | None = None
) -> list[Tracker]:
    """Each named tracker started for this run, or one line naming the one that cannot start
    (not installed: the extra to install) — the ones already started are closed first. `rank`:
    every rank writes (`run.trackers_all_ranks`), each to files of its own in the run folder."""
    from dflash.trackers import backends

    opened: list[Tracker] = []
    try:
        for name in names:
            if name not in KNOWN:
                msg = f"run.trackers: unknown tracker {name!r} (known: {', '.join(KNOWN)})"
                raise ConfigError(msg)
            opened.append(backends.start(name, run_dir, run_name, config, rank))
    except BaseException:
        for t in opened:
            _close_quietly(t)
        raise
    return opened


def _close_quietly(t: Tracker) -> None:
    try:
        t.close()
    except Exception:
        pass


FLUSH_S = 1.0  # the writer hands the trackers what queued at most once a second (MLflow: ~15 ms a call)
CLOSE_TIMEOUT_S = 120.0  # the most a run's end waits for its trackers


class Trackers:
    """The subscriber: records in, scalars onto a queue; a writer thread feeds the trackers."""

    def __init__(self, trackers: list[Tracker], warn: Callable[[str], None]) -> None:
        self._trackers = list(trackers)
        self._warn = warn
        self._queue: queue.SimpleQueue[tuple[int, Scalars] | None] = queue.SimpleQueue()
        self._failed: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._step = 0  # the last train_step's: where profile and eval records are drawn
        self._thread = threading.Thread(target=self._write, name="dflash-trackers", daemon=True)
        self._thread.start()
        self._closed = False

    @property
    def names(self) -> list[str]:
        return [t.name for t in self._trackers]

    @property
    def where(self) -> dict[str, str]:
        """Each tracker not dropped: how to look at its run."""
        return {t.name: getattr(t, "where", t.name) for t in self._trackers}

    def __call__(self, record: Mapping[str, Any]) -> None:
        self.report()
        if record.get("event") == "train_step":
            self._step = int(record.get("step") or self._step)
        scalars = scalars_of(record)
        if scalars:
            self._queue.put((self._step, scalars))

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Everything queued written, every tracker closed, the writer joined (any thread; then
        `report()` on the loop thread). A tracker still busy after `timeout_s` (an upload, a
        remote store retrying) is left to its daemon thread, with a warning naming it."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            busy = ", ".join(self.names) or "a tracker"
            why = f"trackers still writing after {timeout_s:.0f} s ({busy}); left behind; the run's records are whole"
            self._failed.put(why)

    def report(self) -> None:
        """Each dropped tracker's warning, through `warn` (on the loop thread)."""
        while True:
            try:
                why = self._failed.get_nowait()
            except queue.Empty:
                return
            self._warn(why)

    def _write(self) -> None:
        done, last = False, 0.0
        while not done:
            batch: list[Any] = [self._queue.get()]
            while isinstance(batch[-1], tuple):  # what comes within FLUSH_S of the last write goes in the same calls
                wait = last + FLUSH_S - time.monotonic()
                try:
                    batch.append(self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait())
                except queue.Empty:
                    break
            last = time.monotonic()
            done = batch[-1] is None
            steps = _by_step([item for item in batch if isinstance(item, tuple)])
            for t in list(self._trackers):
                try:
                    _feed(t, steps)
                except Exception as err:  # a tracker's fault must not end the run
                    self._drop(t, err)
        for t in list(self._trackers):
            try:
                with quiet():  # its goodbye held back: stdout is the records'
                    t.close()
            except Exception as err:
                self._drop(t, err, closing=True)

    def _drop(self, t: Tracker, err: BaseException, closing: bool = False) -> None:
        if t in self._trackers:
            self._trackers.remove(t)
        what = "closing" if closing else "logging"
        why = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"  # one line
        self._failed.put(f"tracker {t.name} failed while {what} ({why}); dropped, the run goes on")
        if not closing:
            _close_quietly(t)


def _by_step(items: list[tuple[int, Scalars]]) -> list[tuple[int, Scalars]]:
    """Consecutive items of one step merged (a profile or eval record joins its step's scalars)."""
    out: list[tuple[int, Scalars]] = []
    for step, scalars in items:
        if out and out[-1][0] == step:
            out[-1][1].update(scalars)
        else:
            out.append((step, dict(scalars)))
    return out


def _feed(t: Tracker, steps: list[tuple[int, Scalars]]) -> None:
    many = getattr(t, "log_many", None)
    if many is not None:  # one call for the lot (MLflow: one transaction)
        many(steps)
        return
    for step, scalars in steps:
        t.log(step, scalars)


def scalars_of(record: Mapping[str, Any]) -> Scalars:
    """The numbers a dashboard plots from one record (none for the others)."""
    event = record.get("event")
    out: Scalars = {}
    if event == "train_step":
        for key in ("loss", "lr", "grad_norm", "tau_sim", "tokens_per_s"):
            _put(out, f"train/{key}", record.get(key))
        for part, value in (record.get("loss_parts") or {}).items():
            _put(out, f"train/loss_{part}", value)
        for k, a in enumerate(record.get("acc") or [], start=1):
            _put(out, f"train/acc_k{k}", a)
    elif event == "profile":
        for stage, s in (record.get("stages") or {}).items():
            _put(out, f"profile/{stage}_ms", s.get("mean_ms"))
            _put(out, f"profile/{stage}_mfu", s.get("mfu"))
        for name, q in (record.get("queues") or {}).items():
            _put(out, f"queue/{name}", q.get("mean_depth"))
        for side, rate in (record.get("tokens_per_s") or {}).items():
            _put(out, f"profile/{side}_tokens_per_s", rate)
    elif event == "eval":
        where = f"eval/{record.get('prompt_set', 'heldout')}"
        if record.get("turn") is not None:
            where += f"/turn{record['turn']}"
        _put(out, f"{where}/tau", record.get("tau"))
        for k, p in enumerate(record.get("accept_per_position") or [], start=1):
            _put(out, f"{where}/accept_k{k}", p)
        if record.get("lossless") is not None:
            out[f"{where}/lossless"] = float(bool(record["lossless"]))
        turns = record.get("tau_per_turn") or []
        for t, tau in enumerate(turns if len(turns) > 1 else [], start=1):  # multi-turn prompts: τ by turn depth
            _put(out, f"{where}/turn{t}/tau", tau)
    return out


def _put(out: Scalars, key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    out[key] = float(value)
