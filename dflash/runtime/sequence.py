"""Sequence parallelism's transport: the all-to-all of a group of drafter ranks that train one
row together (`pipeline.sequence_parallel`).

`ThreadGroup` joins N replicas of one process, each in its own worker thread: torch.distributed
does not work across threads, so the ranks meet at a barrier and read each other's chunks (CPU
tensors, shared). Every rank calls the same exchanges in the same order (forward, then backward
in reverse); a rank that fails aborts the group, so the others raise instead of waiting forever.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

import torch

__all__ = ["GroupAborted", "SequenceGroup", "ThreadGroup"]


class GroupAborted(RuntimeError):
    """Another rank of the sequence-parallel group failed: this one stops too."""


class SequenceGroup(Protocol):
    """N ranks that exchange chunks: `exchange(rank, chunks)` sends chunks[j] to rank j and
    returns what each rank j sent to this one, in rank order."""

    size: int

    def exchange(self, rank: int, chunks: Sequence[torch.Tensor]) -> list[torch.Tensor]: ...

    def abort(self) -> None: ...


class ThreadGroup:
    """The ranks of one process, one worker thread each (CPU tensors)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._slots: list[list[torch.Tensor | None]] = [[None] * size for _ in range(size)]
        self._barrier = threading.Barrier(size)

    def exchange(self, rank: int, chunks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        assert len(chunks) == self.size, "one chunk per rank"
        for j, chunk in enumerate(chunks):
            self._slots[rank][j] = chunk
        self._wait()
        got = [self._slots[j][rank] for j in range(self.size)]
        self._wait()  # every rank has read its chunks before any writes the next exchange's
        for j in range(self.size):
            self._slots[rank][j] = None
        return got  # type: ignore[return-value]  # all written before the first barrier

    def _wait(self) -> None:
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise GroupAborted("another rank of the sequence-parallel group failed") from None

    def abort(self) -> None:
        """Wake every rank waiting in (or later entering) an exchange with `GroupAborted`."""
        self._barrier.abort()
