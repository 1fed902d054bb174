"""target forward: the frozen target runs over a batch; the chosen layers' outputs are kept.

With a feature cache, a batch whose every document was seen before skips the target.

Waits for: a batch. Unblocks: pack. One such stage per target device.
"""

from __future__ import annotations

import torch

from dflash.features.cache import FeatureCache
from dflash.model.target import Target
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


async def features(
    target: Target, device: Device, batch: Batch, profiler: Profiler, cache: FeatureCache | None
) -> TargetFeatures:
    """A batch's features: from the cache when every document is there, else the target's."""
    if cache is not None:
        # A hit skips the target: one host tensor with the layers already concatenated.
        alloc = device.pinned if device.accelerated else None
        hit, _ = await device.run(Stage.TARGET_CACHE_HIT, cache.get, batch, target.embed_weight.dtype, alloc)
        if hit is not None:
            return TargetFeatures(batch, [hit[0]], None, hit[1])
    (layers, teacher), ready = await device.run(Stage.TARGET_FORWARD, forward, target, batch, target.teacher_topk)
    profiler.count("target_tokens", batch.num_tokens)
    return TargetFeatures(batch, layers, ready, teacher)


async def run(
    target: Target,
    device: Device,
    inbox: Channel[Batch],
    outbox: Channel[TargetFeatures],
    profiler: Profiler,
    cache: FeatureCache | None = None,
) -> None:
    await relay(inbox, outbox, lambda batch: features(target, device, batch, profiler, cache))
