"""prefetch: lays out and collates the next batches ahead of the target.

Waits for: room in the batch channel. Unblocks: the target forward stages.
Stops taking new data as soon as the run is asked to stop (intake first). Everything it
does — walking the batch plan (which lays out an epoch when one begins) and collating —
runs in the data worker, never on the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Iterator

from dflash.data.batching import BatchPlan, collate
from dflash.runtime import faults
from dflash.runtime.channel import Channel
from dflash.runtime.devices import Device
from dflash.runtime.distributed import World, shard
from dflash.runtime.messages import Batch
from dflash.runtime.profiler import Stage
from dflash.stages._link import linked

__all__ = ["next_batch", "run"]


def next_batch(plan: Iterator[tuple[int, int, list]], pin: bool, seq: int = 0) -> Batch | None:
    """The plan's next batch, collated, numbered `seq` (`Batch.seq`); None when the plan is done."""
    item = next(plan, None)
    if item is None:
        return None
    faults.check(Stage.PREFETCH)
    index, epoch, rows = item
    batch = collate(rows, index, epoch, seq)
    if pin:  # pinned host memory makes the target's H2D copy asynchronous
        batch = dataclasses.replace(
            batch,
            input_ids=batch.input_ids.pin_memory(),
            positions=batch.positions.pin_memory(),
            doc_ids=batch.doc_ids.pin_memory(),
        )
    return batch


async def run(
    plan: BatchPlan, device: Device, outbox: Channel[Batch], stop: asyncio.Event, pin: bool, world: World | None = None,
    groups_of: int = 1,
) -> None:
    """With a `world`, this rank's shard of the plan (`distributed.shard`); `groups_of`: ranks
    that train each batch together (sequence parallelism) take the same shard, and go on past a
    stop asked here: a group's ranks must take the same batches, so the stop the ranks agree on
    (the optimizer's) ends them all at one step."""
    batches = iter(plan) if world is None else shard(plan, world.rank // groups_of, world.size // groups_of)
    with linked([], [outbox]):
        for seq in itertools.count():
            if stop.is_set() and groups_of == 1:
                break
            batch, _ = await device.run(Stage.PREFETCH, next_batch, batches, pin, seq)
            if batch is None:
                break
            await outbox.put(batch)
