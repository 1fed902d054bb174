"""What the trackers' hub and backends share: the names, the extra, the interface."""

from __future__ import annotations

import contextlib
import io
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

KNOWN = ("tensorboard", "wandb", "mlflow", "trackio")
EXTRA = "pip install 'dflash[trackers]'"

Scalars = dict[str, float]


class Tracker(Protocol):
    """What a tracker does with a run: scalars at a step, then close (flush, end its run)."""

    name: str
    where: str  # how to look at the run: a command, a folder or an address

    def log(self, step: int, scalars: Scalars) -> None: ...

    def close(self) -> None: ...


_quiet_lock = threading.Lock()
_quiet_depth = 0
_quiet_saved: Any = None


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The trackers' own prints to stdout (greetings, dashboards' addresses, goodbyes) held back:
    stdout carries only the JSON records; the run's summary says where each tracker wrote
    (`where`). `sys.stdout` is the process's: nested or overlapping uses (the writer thread
    closing while another run opens) swap it once and the last one out puts it back."""
    global _quiet_depth, _quiet_saved
    with _quiet_lock:
        if _quiet_depth == 0:
            _quiet_saved, sys.stdout = sys.stdout, io.StringIO()
        _quiet_depth += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_depth -= 1
            if _quiet_depth == 0:
                sys.stdout, _quiet_saved = _quiet_saved, None


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """The resolved config as `section.key` → text, for trackers whose parameters are flat."""
    out: dict[str, str] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out |= flat_config(v, key + ".")
        else:
            out[key] = str(v)
    return out
