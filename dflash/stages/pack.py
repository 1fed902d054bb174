"""pack hidden states: the chosen layers, concatenated on the feature axis into one buffer.

Waits for: target features. Unblocks: the device-to-host copy.
"""

from __future__ import annotations

import torch

from dflash.runtime import faults
from dflash.runtime.channel import Channel
from dflash.runtime.devices import Device
from dflash.runtime.messages import PackedFeatures, TargetFeatures
from dflash.runtime.profiler import Stage
from dflash.stages._link import relay

__all__ = ["pack", "run"]


def pack(layers: list[torch.Tensor]) -> torch.Tensor:
    faults.check(Stage.TARGET_PACK)
    if len(layers) == 1:  # one layer, or a feature-cache hit (pinned host memory: keep it)
        return layers[0].contiguous()
    return torch.cat(layers, dim=-1).contiguous()  # (R, T, k·H)


async def packed(device: Device, f: TargetFeatures) -> PackedFeatures:
    hidden, ready = await device.run(Stage.TARGET_PACK, pack, f.layers, wait_for=[f.ready], uses=f.layers)
    return PackedFeatures(f.batch, hidden, ready, f.teacher)


async def run(device: Device, inbox: Channel[TargetFeatures], outbox: Channel[PackedFeatures]) -> None:
    await relay(inbox, outbox, lambda f: packed(device, f))
