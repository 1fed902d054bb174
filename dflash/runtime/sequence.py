"""Sequence parallelism's transport: the all-to-all of a group of drafter ranks that train one
row together (`pipeline.sequence_parallel`).

`ThreadGroup` joins N replicas of one process, each in its own worker thread: torch.distributed
does not work across threads, so the ranks meet at a barrier and read each other's chunks (CPU
tensors, shared). Every rank calls the same exchanges in the same order (forward, then backward
in reverse); a rank that fails aborts the group, so the others raise instead of waiting forever.
`RankGroup` joins N torchrun processes (one drafter replica each) through a process group of their
own: `all_to_all` (gloo), the chunks' shapes first; a lost rank ends the others at the group's
timeout (`distributed.timeout_s`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Protocol

import torch

__all__ = ["GroupAborted", "RankGroup", "SequenceGroup", "ThreadGroup", "rank_groups"]


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


class RankGroup:
    """The ranks [first, first + size) of a torchrun job: this process is rank `rank` there."""

    def __init__(self, group: object, size: int) -> None:
        self.size, self._group = size, group

    def exchange(self, rank: int, chunks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        try:
            return self._exchange(chunks)
        except RuntimeError as e:  # gloo's own words, on one line, naming the group
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            msg = f"the sequence-parallel all-to-all (rank {rank} of a group of {self.size}) failed: {first}"
            raise GroupAborted(msg) from e

    def _exchange(self, chunks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        import torch.distributed as dist

        assert len(chunks) == self.size, "one chunk per rank"
        shapes = torch.tensor([list(c.shape) for c in chunks], dtype=torch.int64)  # (N, dims): row j to rank j
        theirs = torch.empty_like(shapes)
        dist.all_to_all_single(theirs, shapes, group=self._group)
        sizes = [tuple(s) for s in theirs.tolist()]  # no-sync: CPU tensors
        counts = [math.prod(s) for s in sizes]
        flat = torch.empty(sum(counts), dtype=chunks[0].dtype)  # the pieces differ in size: one flat exchange
        dist.all_to_all_single(flat, torch.cat([c.reshape(-1) for c in chunks]), counts,
                               [c.numel() for c in chunks], group=self._group)  # fmt: skip
        return [piece.view(s) for piece, s in zip(flat.split(counts), sizes, strict=True)]

    def abort(self) -> None:
        """Nothing to wake: a rank that fails leaves the others' collectives to time out."""


def rank_groups(rank: int, world_size: int, size: int, timeout_s: float) -> tuple[RankGroup, int]:  # no-sync: set-up
    """This process's group of `size` consecutive ranks and its rank there. Every rank makes
    every group (torch.distributed's rule), in the same order."""
    import datetime

    import torch.distributed as dist

    mine = None
    for first in range(0, world_size, size):
        group = dist.new_group(list(range(first, first + size)), backend="gloo",
                               timeout=datetime.timedelta(seconds=timeout_s))  # fmt: skip
        if first <= rank < first + size:
            mine = group
    assert mine is not None
    return RankGroup(mine, size), rank % size
