"""prefetch: collates the next batches ahead of the target.

Waits for: room in the batch channel. Unblocks: the target forward stages.
Stops taking new data as soon as the run is asked to stop (intake first).
"""

from __future__ import annotations

import asyncio
import dataclasses

from dflash import faults
from dflash.channel import Channel
from dflash.data.batching import BatchPlan, collate
from dflash.devices import Device
from dflash.profile import Stage
from dflash.records import Batch
from dflash.stages._link import linked

__all__ = ["run"]


def _collate(samples: list, index: int, epoch: int, pin: bool) -> Batch:
    faults.check(Stage.PREFETCH)
    batch = collate(samples, index, epoch)
    if pin:  # pinned host memory makes the target's H2D copy asynchronous
        batch = dataclasses.replace(
            batch, input_ids=batch.input_ids.pin_memory(), positions=batch.positions.pin_memory()
        )
    return batch


async def run(plan: BatchPlan, device: Device, outbox: Channel[Batch], stop: asyncio.Event, pin: bool) -> None:
    with linked([], [outbox]):
        for index, epoch, samples in plan:
            if stop.is_set():
                break
            batch, _ = await device.run(Stage.PREFETCH, _collate, samples, index, epoch, pin)
            await outbox.put(batch)
