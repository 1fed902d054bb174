"""Set-up ends with a device fence: its work queued on the legacy default stream (a head
copied to a replica's GPU, the loss vocabulary's rows, a tiny target's random weights) is
done before any stage, on a stream of torch's pool that does not wait on it, reads it.
On CPU: `torch.cuda.synchronize` and the fence itself are stand-ins."""

from __future__ import annotations

import json

import torch

from dflash.train import build


def test_fence_syncs_each_cuda_device_once_and_nothing_else(monkeypatch):
    """Every distinct CUDA device, in first-seen order; CPU devices are skipped, and nothing
    else of CUDA is touched (these devices exist on no machine running this test)."""
    synced: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", synced.append)
    cuda0, cuda1, cpu = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")
    build.fence([cuda0, cpu, cuda1, cuda0, cuda1, cpu])
    assert synced == [cuda0, cuda1]
    build.fence([cpu, cpu])
    assert synced == [cuda0, cuda1]


def test_build_training_fences_every_device_it_used(tiny_config, monkeypatch):
    """Once, at the end of set-up, with the devices of every target and every replica."""
    calls: list[list[torch.device]] = []
    monkeypatch.setattr(build, "fence", lambda devices: calls.append(list(devices)))
    cfg = tiny_config(**{"pipeline.drafter_devices": json.dumps(["cpu", "cpu"]), "eval.at_end": "false"})
    training = build.build_training(cfg)
    used = [*(t.device for t in training.targets), *(r.device for r in training.replicas)]
    assert len(used) == 3
    assert calls == [used]
