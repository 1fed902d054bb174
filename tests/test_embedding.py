"""A run embedded in a program leaves nothing behind: once `Coordinator.run` (or `dflash.run`)
returns or raises — a normal end, a stop during set-up, a stop mid-training, a failing run —
the program has the threads it had before (the same objects), no file under the run folder
open, and no child process."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest
from tqdm import tqdm

import dflash
from dflash import Coordinator, StageError
from dflash.pipeline import coordinator as coordinator_module
from dflash.runtime import faults
from dflash.runtime.profiler import Stage

FAST = {"train.max_steps": 4, "eval.at_end": "false"}
GRACE_S = 1.0  # a thread on its way out, joined for at most this long: a guard, not a wait
LOOP_POOL = "embedder-pool"  # the program's loop's own executor (asyncio.to_thread): the loop's threads, kept


class Before:
    """What the program had before the run: its threads, its child processes."""

    def __init__(self) -> None:
        self.threads = frozenset(threading.enumerate())
        self.children = {p.pid for p in psutil.Process().children(recursive=True)}

    def new_threads(self) -> list[threading.Thread]:
        """Threads the run left, each given until GRACE_S in all to end (joined, not slept on)."""
        deadline = time.monotonic() + GRACE_S
        while True:
            left = [t for t in threading.enumerate() if t not in self.threads and not t.name.startswith(LOOP_POOL)]
            if not left or time.monotonic() >= deadline:
                return left
            left[0].join(deadline - time.monotonic())

    def new_children(self) -> list[psutil.Process]:
        new = [p for p in psutil.Process().children(recursive=True) if p.pid not in self.children]
        _, alive = psutil.wait_procs(new, timeout=GRACE_S)
        return alive


def _open_under(folder: Path) -> list[str]:
    """Files under `folder` this process holds open (/proc/self/fd)."""
    root = os.path.realpath(folder) + os.sep
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
        if target.startswith(root):
            found.append(target)
    return found


def _assert_nothing_left(before: Before, run_dir: Path) -> None:
    assert before.new_threads() == []
    assert _open_under(run_dir) == []
    assert before.new_children() == []


@pytest.fixture(autouse=True)
def _no_bar_monitor() -> Iterator[None]:
    """No tqdm monitor thread from earlier tests: one the run started would show."""
    monitor = tqdm.monitor
    if monitor is not None and monitor.report():
        monitor.exit()
    yield


Ended = tuple[dict | None, BaseException | None]  # the run's summary, or what it raised


def _stopped(ended: Ended, during: str) -> bool:
    summary, error = ended
    return (
        error is None and summary is not None and (summary["reason"], summary["stopped_during"]) == ("stopped", during)
    )


def _embedded(cfg: Any, setup: Callable[[Coordinator], None] = lambda _: None) -> Ended:
    """`await Coordinator(cfg).run()` in a program's own loop, checked in that loop right after
    the run returns or raises (the loop and its executor live on)."""

    async def main() -> Ended:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(thread_name_prefix=LOOP_POOL))
        before = Before()
        coord = Coordinator(cfg, log=False)
        setup(coord)
        summary, error = None, None
        try:
            summary = await asyncio.wait_for(coord.run(), 300)
        except Exception as err:
            error = err
        _assert_nothing_left(before, cfg.run_dir)
        return summary, error

    return asyncio.run(main())


def _stop_on(event: str, when: Callable[[dict], bool] = lambda _: True) -> Callable[[Coordinator], None]:
    def attach(coord: Coordinator) -> None:
        coord.subscribe(lambda r: r["event"] == event and when(r) and coord.stop())

    return attach


def test_a_run_to_its_end_leaves_nothing(tiny_config):
    """To its end, export and end-of-run eval included; then `dflash.run`, the same (its own loop)."""
    summary, error = _embedded(tiny_config(**{"train.max_steps": 4, "eval.num_prompts": 1, "eval.max_new_tokens": 8}))
    assert error is None and summary is not None and summary["reason"] == "max_steps"
    cfg = tiny_config(**FAST, **{"run.name": '"again"'})
    before = Before()
    assert dflash.run(cfg, install_signals=False)["reason"] == "max_steps"
    _assert_nothing_left(before, cfg.run_dir)


def test_a_stop_during_set_up_leaves_nothing(tiny_config, monkeypatch):
    """A stop at `run_start` (before set-up's work), and one at set-up's first phase boundary
    (the targets loaded, in set-up's worker thread): the run ends untrained, nothing left."""
    assert _stopped(_embedded(tiny_config(**FAST), _stop_on("run_start")), "setup")
    boundary = coordinator_module.stopping_setup
    stopper: dict[str, Coordinator] = {}
    boundaries: list[str] = []

    def stop_at_first_boundary(asked: Callable[[], bool]) -> Any:
        def first() -> bool:
            boundaries.append(stopper["coord"].phase)
            stopper["coord"].stop()
            return asked()

        return boundary(first)

    monkeypatch.setattr(coordinator_module, "stopping_setup", stop_at_first_boundary)
    ended = _embedded(tiny_config(**FAST, **{"run.name": '"boundary"'}), lambda c: stopper.update(coord=c))
    assert boundaries == ["setup"] and _stopped(ended, "setup")


def test_a_stop_mid_training_leaves_nothing(tiny_config):
    """A stop after step 2 (a checkpoint written at every step meanwhile)."""
    cfg = tiny_config(**{"train.epochs": 50, "checkpoint.every_steps": 1, "eval.at_end": "false"})
    assert _stopped(_embedded(cfg, _stop_on("train_step", lambda r: r["step"] >= 2)), "training")


def test_a_failing_run_leaves_nothing(tiny_config, monkeypatch):
    """The drafter's stage fails while the target's worker is busy (its next piece of work once
    the drafter holds a batch — a forward, pack or copy of a batch ahead, which the batch taken
    from the queues makes room for — ends only once `run_failed` is out): the run raises
    StageError after its emergency checkpoint and `run_failed`, and only once that worker is done
    and joined."""
    drafting, busy, failed, finished = threading.Event(), threading.Event(), threading.Event(), threading.Event()
    target_side = {Stage.TARGET_FORWARD, Stage.TARGET_PACK, Stage.TARGET_D2H}  # the target's worker
    planted = faults.check

    def check(stage: str) -> None:  # in the stages' worker threads
        if stage in target_side and drafting.is_set() and not busy.is_set():
            busy.set()
            if not failed.wait(60):  # the work, going on after the failure (60 s: a hang guard)
                raise AssertionError("the run never wrote run_failed")
            finished.set()
        if stage == Stage.DRAFTER_FORWARD:
            drafting.set()
            if not busy.wait(60):
                raise AssertionError("the target's worker did nothing while the drafter waited")
            raise faults.InjectedFault("injected fault in drafter.forward")
        planted(stage)

    monkeypatch.setattr(faults, "check", check)
    records: list[dict] = []
    cfg = tiny_config(**{"train.epochs": 50, "checkpoint.every_steps": 1, "eval.at_end": "false"})

    def watch(coord: Coordinator) -> None:
        coord.subscribe(records.append)
        coord.subscribe(lambda r: failed.set() if r["event"] == "run_failed" else None)

    summary, error = _embedded(cfg, watch)
    assert summary is None and isinstance(error, StageError) and "injected fault" in str(error)
    assert records[-1]["event"] == "run_failed" and records[-1]["stage"] == "drafter.forward[0]"
    assert finished.is_set()  # the busy worker ended after run_failed, and before run() returned


def test_targets_made_before_a_failed_set_up_are_closed(tiny_config, monkeypatch):
    """A target with an engine of its own (a live vLLM engine, a remote server told to stop) is
    closed when set-up fails after it was made, as the coordinator closes it after training."""
    from dflash.train import build

    closed: list[int] = []
    made = build._targets

    class Closing:
        def __init__(self, inner: Any, i: int) -> None:
            self._inner, self._i = inner, i

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

        def close(self) -> None:
            closed.append(self._i)

    def targets(*args: Any) -> list[Any]:
        return [Closing(t, i) for i, t in enumerate(made(*args))]

    def broken(*args: Any) -> None:
        raise dflash.DataError("the data is bad")

    monkeypatch.setattr(build, "_targets", targets)
    monkeypatch.setattr(build, "_samples", broken)
    with pytest.raises(dflash.DataError, match="the data is bad"):
        asyncio.run(Coordinator(tiny_config(**FAST), log=False).run())
    assert closed == [0]
