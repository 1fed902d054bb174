"""target forward: the frozen target runs over a batch; the chosen layers' outputs are kept.

A batch whose features the feature read stage found (cache or store) passes through untouched;
without a feature store, a batch whose every document was seen before skips the target here.

Waits for: a batch (or its features, from feature read). Unblocks: pack. One such stage per
target device.
"""

from __future__ import annotations

import torch

from dflash.features.cache import FeatureCache
from dflash.model.target import Target
from dflash.roofline import flops
from dflash.runtime import faults
from dflash.runtime.channel import Channel
from dflash.runtime.devices import Device
from dflash.runtime.messages import Batch, TargetFeatures, Teacher
from dflash.runtime.profiler import Profiler, Stage
from dflash.stages._link import relay

__all__ = ["forward", "run"]


def forward(target: Target, batch: Batch, teacher_topk: int = 0) -> tuple[list[torch.Tensor], Teacher | None]:
    """The target up to its last chosen layer (in the target's worker thread); with
    `teacher_topk` the whole target and its top-k next-token logits (`Target.of_batch`)."""
    faults.check(Stage.TARGET_FORWARD)
    return target.of_batch(batch, teacher_topk)


def engine_call(target: Target, batch: Batch) -> object:
    faults.check(Stage.TARGET_ENGINE_WAIT)
    return target.engine_call(batch)  # type: ignore[attr-defined]


async def features(
    target: Target,
    device: Device,
    item: Batch | TargetFeatures,
    profiler: Profiler,
    cache: FeatureCache | None = None,
) -> TargetFeatures:
    """A batch's features: as feature read found them, else from the cache when every
    document is there (a run without a feature store: looked up here, as late as can be, so a
    small data set's next epoch finds what this one stored), else the target's."""
    if isinstance(item, TargetFeatures):  # a hit: one host tensor, the layers already concatenated
        return item
    batch = item
    if cache is not None:
        alloc = device.pinned if device.accelerated else None
        hit, _ = await device.run(Stage.TARGET_CACHE_HIT, cache.get, batch, target.embed_weight.dtype, alloc)
        if hit is not None:
            return TargetFeatures(batch, [hit[0]], None, hit[1])
    if hasattr(target, "engine_call"):  # a live engine (target.engine): its call and the hand-off apart
        pending, _ = await device.run(Stage.TARGET_ENGINE_WAIT, engine_call, target, batch)
        read = target.engine_read  # type: ignore[attr-defined]
        (layers, teacher), ready = await device.run(Stage.TARGET_ENGINE_READ, read, batch, pending, target.teacher_topk)
    else:
        (layers, teacher), ready = await device.run(Stage.TARGET_FORWARD, forward, target, batch, target.teacher_topk)
        if hasattr(target, "model"):  # the decoder layers ran here
            device.flops(Stage.TARGET_FORWARD, flops.of_target(target, batch, target.teacher_topk))
    profiler.count("target_tokens", batch.num_tokens)
    return TargetFeatures(batch, layers, ready, teacher)


async def run(
    target: Target,
    device: Device,
    inbox: Channel[Batch] | Channel[Batch | TargetFeatures],
    outbox: Channel[TargetFeatures],
    profiler: Profiler,
    cache: FeatureCache | None = None,
) -> None:
    await relay(inbox, outbox, lambda item: features(target, device, item, profiler, cache))
