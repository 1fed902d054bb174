"""`dflash.run`: a run on its own event loop (uvloop when installed), with Ctrl-C / SIGTERM
handled — the first stops cleanly after the current step, the second aborts."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash.config import Config
from dflash.pipeline.coordinator import Coordinator, Record
from dflash.train.checkpoint import ResumeFrom

__all__ = ["run"]


def _install_signals(loop: asyncio.AbstractEventLoop, coord: Coordinator, main: asyncio.Task[Any]) -> None:
    import signal
    import sys

    hits = {"n": 0}

    def on_signal(signame: str) -> None:
        hits["n"] += 1
        if hits["n"] == 1:
            print(f"\ndflash: {signame}: stopping after the current step (again to abort)", file=sys.stderr)
            coord.stop()
        else:
            main.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal, sig.name)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread / Windows
            pass


def run(config: Config, *, install_signals: bool = True, resume: ResumeFrom | str | Path | None = None) -> Record:
    """Run synchronously (uvloop when installed); Ctrl-C / SIGTERM stop cleanly."""
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:
        factory = None
    coord = Coordinator(config, resume=resume)

    async def main() -> Record:
        task = asyncio.current_task()
        assert task is not None
        if install_signals:
            _install_signals(asyncio.get_running_loop(), coord, task)
        return await coord.run()

    with asyncio.Runner(loop_factory=factory) as runner:
        try:
            return runner.run(main())
        except asyncio.CancelledError:  # a second Ctrl-C / SIGTERM: abort now
            raise KeyboardInterrupt from None
