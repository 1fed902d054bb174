"""device-to-host copy: packed features into pinned host memory, then onto the
hidden-state channel that every drafter replica reads.

Waits for: packed features, then the copy's completion (off the loop), then room in the
hidden-state channel (timed as `target.queue_put_wait`: back-pressure from the drafters).
On CPU the features already live on the host and pass through untouched.
"""

from __future__ import annotations

import torch

from dflash import faults
from dflash.channel import Channel
from dflash.devices import Device
from dflash.feature_cache import FeatureCache
from dflash.profile import Profiler, Stage
from dflash.records import HostFeatures, PackedFeatures
from dflash.stages._link import linked

__all__ = ["host_features", "run", "to_host"]


def to_host(hidden: torch.Tensor) -> torch.Tensor:
    faults.check(Stage.TARGET_D2H)
    if hidden.device.type == "cpu":
        return hidden
    # Same dtype as the source: a dtype change inside .to() falls back to pageable memory.
    host = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=True)
    host.copy_(hidden, non_blocking=True)
    return host


async def host_features(device: Device, f: PackedFeatures, source: int, cache: FeatureCache | None) -> HostFeatures:
    """The copy, waited for off the loop (the host must not read before it lands), and
    stored in the feature cache."""
    host, ready = await device.run(Stage.TARGET_D2H, to_host, f.hidden, wait_for=[f.ready])
    await device.synchronize(ready)  # sync: the host must not read the buffer before the copy lands
    if cache is not None:
        await device.run(None, cache.put, f.batch, host)
    return HostFeatures(f.batch, host, source)


async def run(
    device: Device,
    inbox: Channel[PackedFeatures],
    outbox: Channel[HostFeatures],
    profiler: Profiler,
    source: int,
    cache: FeatureCache | None = None,
) -> None:
    with linked([inbox], [outbox]):
        async for f in inbox:
            waited = await outbox.put(await host_features(device, f, source, cache))
            profiler.record(Stage.TARGET_QUEUE_PUT, waited, worker=device.name)
