"""device-to-host copy: packed features onto the hidden-state channel that every drafter
replica reads — into pinned host memory, or (when every replica shares the target's GPU
and no feature cache needs a host copy) as the device tensor itself, with its event.

Waits for: packed features, then the copy's completion (off the loop), then room in the
hidden-state channel (timed as `target.queue_put_wait`: back-pressure from the drafters).
On CPU the features already live on the host and pass through untouched. D2H copies land
in a `PinnedPool` sized by the queue depth (topology.py), so pinned memory stays bounded.
"""

from __future__ import annotations

import torch

from dflash.features.cache import FeatureCache
from dflash.runtime import faults
from dflash.runtime.channel import Channel
from dflash.runtime.devices import Device, PinnedPool
from dflash.runtime.messages import HostFeatures, PackedFeatures, Teacher
from dflash.runtime.profiler import Profiler, Stage
from dflash.stages._link import linked

__all__ = ["host_features", "run", "to_host"]


def _pinned_copy(device: Device, t: torch.Tensor) -> torch.Tensor:
    # Same dtype as the source: a dtype change inside .to() falls back to pageable memory.
    host = device.pinned(t.shape, t.dtype)
    host.copy_(t, non_blocking=True)
    return host


def to_host(
    device: Device, hidden: torch.Tensor, pool: PinnedPool | None = None, teacher: Teacher | None = None
) -> tuple[torch.Tensor, object, Teacher | None]:
    """(host tensor, its release callback or None, the teacher's top-k on the host). Queued
    on the D2H stream; the host must wait for the returned event before it reads."""
    faults.check(Stage.TARGET_D2H)
    if not device.on_device(hidden):
        return hidden, None, teacher
    teacher_host = (_pinned_copy(device, teacher[0]), _pinned_copy(device, teacher[1])) if teacher is not None else None
    if pool is None:
        return _pinned_copy(device, hidden), None, teacher_host
    host, release = pool.take(hidden.shape, hidden.dtype)
    host.copy_(hidden, non_blocking=True)
    return host, release, teacher_host


async def host_features(
    device: Device,
    f: PackedFeatures,
    source: int,
    cache: FeatureCache | None,
    pool: PinnedPool | None = None,
    keep_on_device: bool = False,
) -> HostFeatures:
    """The copy, waited for off the loop (the host must not read before it lands), and
    stored in the feature cache. `keep_on_device`: no copy; the consumer waits on the event."""
    if keep_on_device and device.on_device(f.hidden):
        return HostFeatures(f.batch, f.hidden, source, ready=f.ready, teacher=f.teacher)
    uses = [f.hidden, *(f.teacher or ())]
    (host, release, teacher), ready = await device.run(
        Stage.TARGET_D2H, to_host, device, f.hidden, pool, f.teacher, wait_for=[f.ready], uses=uses
    )
    await device.synchronize(ready)  # sync: the host must not read the buffer before the copy lands
    if cache is not None:
        await device.run(None, cache.put, f.batch, host, teacher, stream=Stage.TARGET_D2H)
    return HostFeatures(f.batch, host, source, release=release, teacher=teacher)  # type: ignore[arg-type]


async def run(
    device: Device,
    inbox: Channel[PackedFeatures],
    outbox: Channel[HostFeatures],
    profiler: Profiler,
    source: int,
    cache: FeatureCache | None = None,
    pool: PinnedPool | None = None,
    keep_on_device: bool = False,
) -> None:
    with linked([inbox], [outbox]):
        async for f in inbox:
            waited = await outbox.put(await host_features(device, f, source, cache, pool, keep_on_device))
            profiler.record(Stage.TARGET_QUEUE_PUT, waited, worker=device.name)
