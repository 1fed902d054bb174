"""Typed errors at the boundary. The CLI prints each as one line, no traceback."""

from __future__ import annotations

__all__ = ["CheckpointError", "ConfigError", "DFlashError", "DataError", "StageError"]


class DFlashError(Exception):
    """Base class for every error a user of dflash is meant to read."""

    exit_code = 1


class ConfigError(DFlashError):
    """A config file, value or override is wrong. Exit code 2, as for usage errors."""

    exit_code = 2


class DataError(DFlashError):
    """A dataset file is missing, malformed, or yields nothing to train on."""


class CheckpointError(DFlashError):
    """A checkpoint or exported drafter cannot be read or written."""


class StageError(DFlashError):
    """A pipeline stage raised; names the stage (and replica) and the cause."""

    def __init__(self, stage: str, cause: BaseException) -> None:
        self.stage = stage
        self.cause = cause
        detail = str(cause) or type(cause).__name__
        super().__init__(f"stage {stage} failed: {type(cause).__name__}: {detail}")
