"""Which process of a torchrun launch this one is, read from the environment alone: no torch
import, so that the CLI can name the rank in an error line without loading torch first."""

from __future__ import annotations

import os

from dflash.errors import ConfigError

__all__ = ["launched"]


def launched() -> tuple[int, int] | None:
    """(rank, world size) when this process is one of several launched by torchrun."""
    try:
        size = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        msg = f"WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} / RANK={os.environ.get('RANK')!r}: expected integers"
        raise ConfigError(msg) from None
    return (rank, size) if size > 1 else None
