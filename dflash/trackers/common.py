"""What the trackers' hub and backends share: the names, the extra, the interface."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Mapping
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


def quiet() -> contextlib.AbstractContextManager:
    """The trackers' own prints (greetings, dashboards' addresses, goodbyes) held back: stdout
    carries only the JSON records, stderr only dflash's lines; the run's summary says where each
    tracker wrote (`where`)."""
    return contextlib.redirect_stdout(io.StringIO())


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
