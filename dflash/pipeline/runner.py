"""`dflash.run`: a run on its own event loop (uvloop when installed), with Ctrl-C / SIGTERM
handled. The first signal stops the run cleanly, as its phase allows (`Coordinator.stop`):
set-up ends at its next phase boundary, training after the current step, the end-of-run eval
at its next decoding step (the export is kept); the run still ends with `run_end` and exit 0.
The second aborts (exit 130). `hold_signals` takes them from before the event loop exists
(the CLI calls it first thing), so that no signal ends a run without its `run_end`.

Nothing here imports torch at module level: `hold_signals` must be cheap to reach."""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dflash.config import Config
    from dflash.pipeline.coordinator import Coordinator, Record
    from dflash.train.checkpoint import ResumeFrom

__all__ = ["hold_signals", "run"]

# What the first signal does, by the run's phase (`Coordinator.phase`).
_STOPPING = {
    "setup": "stopping set-up",
    "training": "stopping after the current step",
    "finishing": "training is over: stopping the end-of-run eval, the export is kept",
}


ABORT_GRACE_S = 3.0  # after a second signal: how long the loop may wait for its worker threads


def _abort_after(seconds: float) -> threading.Timer:
    """A second signal cancels the run; the loop then waits for its worker threads (a model
    still loading, an eval between steps), which nothing interrupts. Past `seconds`, end the
    process: what is on disk is complete (checkpoints and exports are written atomically)."""
    import os

    def go() -> None:
        print("\ndflash: aborted (a worker thread was still busy)", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(130)

    timer = threading.Timer(seconds, go)
    timer.daemon = True
    timer.start()
    return timer


class _Signals:
    """One run's Ctrl-C / SIGTERM: the first stops it, the second aborts."""

    def __init__(self) -> None:
        self.hits = 0
        self.coord: Coordinator | None = None
        self.main: asyncio.Task[Any] | None = None  # cancelled by the second signal once the loop runs
        self.abort_timer: threading.Timer | None = None  # ends the process if the cancel is not enough

    def hit(self, signame: str) -> None:
        self.hits += 1
        if self.hits > 1:
            if self.main is None:  # before the loop runs: abort from the main thread, where this runs
                raise KeyboardInterrupt
            self.main.cancel()
            self.abort_timer = _abort_after(ABORT_GRACE_S)
            return
        phase = self.coord.phase if self.coord is not None else "setup"
        print(f"\ndflash: {signame}: {_STOPPING.get(phase, 'stopping')} (again to abort)", file=sys.stderr)
        if self.coord is not None:
            self.coord.stop()

    def attach(self, coord: Coordinator) -> None:
        """The run these signals stop; one taken already (`hold_signals`) stops it before it starts."""
        self.coord = coord
        if self.hits:
            coord.stop()

    def install(self, loop: asyncio.AbstractEventLoop, main: asyncio.Task[Any]) -> None:
        self.main = main
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self.hit, sig.name)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread / Windows
                pass


_held: _Signals | None = None  # hold_signals(): the signals the next `run` takes over


def hold_signals() -> None:
    """From now on (main thread only), Ctrl-C / SIGTERM are taken, not fatal: the next `run`
    starts stopped if one came (`run_start`, then `run_end` with reason "stopped") and a second
    aborts (KeyboardInterrupt). Call it as early as possible; `run` takes over on its loop."""
    global _held
    held = _held = _Signals()

    def on_signal(signum: int, _frame: Any) -> None:
        held.hit(signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)


def run(config: Config, *, install_signals: bool = True, resume: ResumeFrom | str | Path | None = None) -> Record:
    """Run synchronously (uvloop when installed); Ctrl-C / SIGTERM stop cleanly."""
    global _held
    from dflash.pipeline.coordinator import Coordinator

    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:
        factory = None
    signals, _held = _held or _Signals(), None
    coord = Coordinator(config, resume=resume)
    if install_signals:
        signals.attach(coord)

    async def main() -> Record:
        task = asyncio.current_task()
        assert task is not None
        if install_signals:
            signals.install(asyncio.get_running_loop(), task)
        return await coord.run()

    try:
        with asyncio.Runner(loop_factory=factory) as runner:  # leaving it waits for worker threads
            try:
                return runner.run(main())
            except asyncio.CancelledError:  # a second Ctrl-C / SIGTERM: abort now
                raise KeyboardInterrupt from None
    finally:
        if signals.abort_timer is not None:  # the run ended in time: the caller decides what is next
            signals.abort_timer.cancel()
