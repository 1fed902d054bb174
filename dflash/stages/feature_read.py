"""feature read: a batch's features from the feature store (disk), or first the feature cache
(memory) above it, ahead of the target — a hit skips the target's forward. Runs only when
the run has a feature store (without one, the target forward stage looks up the cache).

Waits for: a batch. Unblocks: target forward, which passes a hit on and runs the target on a
miss (a batch with any document not stored). Its reads run in a worker of their own (one per
target chain), so they overlap the target's forward; read-ahead is bounded by its outbox
(`pipeline.read_ahead` batches), so memory stays flat whatever the store's size. On a GPU
target, hits land in pinned memory (the drafter uploads them without a host sync).
"""

from __future__ import annotations

import torch

from dflash.features.cache import FeatureCache
from dflash.features.files import FeatureStore
from dflash.runtime import faults
from dflash.runtime.channel import Channel
from dflash.runtime.devices import Device
from dflash.runtime.messages import Batch, TargetFeatures
from dflash.runtime.profiler import Stage
from dflash.stages._link import relay

__all__ = ["lookup", "run"]


def _read(store: FeatureStore, batch: Batch, dtype: torch.dtype, alloc: object) -> object:
    faults.check(Stage.TARGET_STORE_READ)
    return store.read(batch, dtype, alloc)  # type: ignore[arg-type]


async def lookup(
    worker: Device,
    target: Device,
    batch: Batch,
    dtype: torch.dtype,
    cache: FeatureCache | None,
    store: FeatureStore | None,
) -> Batch | TargetFeatures:
    """The batch's features when the cache or the store has every document (the cache first),
    else the batch itself. `target`: the chain's device, whose pinned memory takes a hit."""
    alloc = target.pinned if target.accelerated else None
    if cache is not None:
        hit, _ = await worker.run(Stage.TARGET_CACHE_HIT, cache.get, batch, dtype, alloc)
        if hit is not None:
            return TargetFeatures(batch, [hit[0]], None, hit[1])
    if store is not None:
        hit, _ = await worker.run(Stage.TARGET_STORE_READ, _read, store, batch, dtype, alloc)
        if hit is not None:
            return TargetFeatures(batch, [hit[0]], None, hit[1])
    return batch


async def run(
    worker: Device,
    target: Device,
    dtype: torch.dtype,
    inbox: Channel[Batch],
    outbox: Channel[Batch | TargetFeatures],
    cache: FeatureCache | None,
    store: FeatureStore | None,
) -> None:
    await relay(inbox, outbox, lambda batch: lookup(worker, target, batch, dtype, cache, store))
