"""The plumbing of an update: the replicas' gradients and sums brought to one device, summed
over replicas (and ranks), and the step's gradient sent back to every replica.

`reduce_step` is the gather: the hand-off of each replica's gradients to the optimizer's
worker (streams and events on CUDA), their sum in a fixed order on the first replica's
device, the step's Σ w, Σ loss and per-slot tallies, and with several processes the
all-reduce of all of these. `update_everywhere` is the scatter: a copy of the step's
gradient on each replica's device and, on another GPU, the event of its update there. The
math between the two (normalise, clip, AdamW) is `step.apply_step`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.cuda.comm as comm  # not imported by `import torch`

from dflash.runtime.devices import Device, host_sync, upload
from dflash.runtime.distributed import World
from dflash.runtime.messages import StepGrads
from dflash.runtime.profiler import Stage
from dflash.train.replicas import DrafterReplica

__all__ = ["StepSums", "reduce_step", "update_everywhere"]


@dataclass
class StepSums:
    """One step's gradient and sums over every replica (and rank). `weight` is Σ w: a host
    float, or with ranks a device tensor `[Σ w, counts...]` (`count` then comes over with the
    step's one host sync, in `read`)."""

    grads: list[torch.Tensor]  # on the first replica's device
    weight: Any
    loss: torch.Tensor  # () Σ w·CE
    correct: torch.Tensor  # (B,) device
    count: torch.Tensor | None  # (B,) host; None until `read` with ranks
    world: World | None = None  # with ranks: `read` first waits, with a deadline, for
    ready: Any = None  # the end of the all-reduce (`World.collective_event`; None: gloo's ended in the call)
    what: str = "the gradient all-reduce"
    parts: torch.Tensor | None = None  # (3,) Σ of the loss's parts (`LossParts.part_sums`), device

    @property
    def ranks(self) -> bool:
        return self.world is not None

    def scale(self) -> Any:
        """1 / Σ w, the step's normaliser: a host float, or a device tensor with ranks."""
        if self.ranks:
            return (1.0 / self.weight[0].clamp(min=1e-12)).float()
        return 1.0 / max(self.weight, 1e-12)

    def read(self, ok: torch.Tensor) -> tuple[bool, float]:
        """The step's one host sync (`drafter.grad_norm_sync`): whether `ok` holds, and Σ w on
        the host. With ranks the global Σ w and per-slot counts come over in the same sync."""
        if self.world is None:
            return bool(host_sync(ok)), self.weight
        # A lost peer must end in one line naming it, not in a copy that waits forever.
        self.world.wait(self.ready, self.what)
        host = host_sync(torch.cat([ok.double()[None], self.weight]))
        self.count = host[2:].round().long()
        return bool(host[0]), float(host[1])  # no-sync: host tensor


def reduce_step(
    device: Device, replicas: list[DrafterReplica], contribs: list[StepGrads], world: World | None, step: int = 0
) -> StepSums:
    """The replicas' gradients and sums on the first replica's device (`drafter.grad_reduce`),
    then over every rank (`drafter.allreduce`)."""
    dev0 = replicas[0].device
    with device.span(Stage.GRAD_REDUCE):
        _take_over(device, replicas, contribs)
        grads = _reduced(replicas, {c.replica for c in contribs}, dev0)
        sums = _sums(contribs, dev0, replicas[0].model.spec.block_size)
        parts = _part_sums(contribs, dev0)
    if world is None:
        return StepSums(grads, *sums, parts=parts)
    with device.span(Stage.ALLREDUCE):
        *summed, parts = _across_ranks(world, grads, sums, dev0, parts)
        ready = world.collective_event(dev0)
        what = f"the gradient all-reduce of step {step}"
        return StepSums(grads, *summed, world=world, ready=ready, what=what, parts=parts)


def update_everywhere(
    device: Device,
    replicas: list[DrafterReplica],
    grads: list[torch.Tensor],
    update: Callable[[DrafterReplica, list[torch.Tensor]], None],
) -> dict[int, Any]:
    """`update(replica, its copy of grads)` for every replica, on its own GPU's stream of this
    thread; the event of each update on another GPU (the first's is `Device.run`'s)."""
    events = {}
    for r, g in zip(replicas, _spread(device, replicas, grads), strict=True):
        update(r, g)
        if device.gpu_of(r.params[0]) not in (None, device.gpu):
            events[r.index] = device.event(like=r.params[0])  # on the optimizer's stream there (`_take_over`)
    return events


def _take_over(device: Device, replicas: list[DrafterReplica], contribs: list[StepGrads]) -> None:
    """The hand-off of the replicas' gradients and sums to this (the optimizer's) worker: on
    CUDA, each replica's GPU gets a stream of the optimizer's (`drafter.optimizer_step` on
    that GPU) that waits on the replica's backward and becomes this thread's current stream
    there, so every read of its gradients (reduce, broadcast, its own update) is ordered
    after the backward; and every tensor read is held for that stream (`Device.hold`). The
    first GPU's stream is the one `Device.run` already set, waiting on `wait_for`."""
    dev0 = device.device
    by_replica = {c.replica: c for c in contribs}
    for r in replicas:
        c = by_replica.get(r.index)
        tensors = [p.grad for p in r.params if p.grad is not None]
        if c is not None:
            tensors += [t for t in (c.loss_sum, c.correct_per_slot, c.part_sums) if t is not None]
        wait = c.ready if c is not None else None
        stream = device.stream_for(r.params[0], Stage.OPTIMIZER_STEP, wait)  # this thread's stream on its GPU
        device.hold(Stage.GRAD_REDUCE, tensors, stream)
    if dev0.type == "cuda":
        torch.cuda.set_device(dev0)


def _multi_gpu(replicas: list[DrafterReplica]) -> bool:
    devs = [r.device for r in replicas]
    return all(d.type == "cuda" for d in devs) and len(set(devs)) == len(devs) and len(devs) > 1


def _reduced(replicas: list[DrafterReplica], contributing: set[int], dev0: torch.device) -> list[torch.Tensor]:
    """Σ of the contributing replicas' gradients on the first replica's device, in a fixed
    order (the same sum on every run). One replica: its own `.grad` tensors, no copy.
    Replicas on distinct GPUs: torch's multi-GPU reduce (NCCL where available), bucketed."""

    def grads_of(r: DrafterReplica) -> list[torch.Tensor]:
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in r.params]

    if len(replicas) == 1:
        return grads_of(replicas[0])
    if _multi_gpu(replicas):
        # Every replica, zeros for one without a contribution: reduce_add wants an input on
        # the destination, and the result must be the whole gradient even when no replica
        # of this rank has data (its ranks' all-reduce then sums zeros from it).
        inputs = [grads_of(r) if r.index in contributing else [torch.zeros_like(p) for p in r.params] for r in replicas]
        return list(comm.reduce_add_coalesced(inputs, destination=dev0.index or 0))
    grads = []
    for i, p in enumerate(replicas[0].params):
        total = torch.zeros_like(p, device=dev0)
        for r in replicas:
            g = r.params[i].grad
            if r.index in contributing and g is not None:
                total.add_(g.to(dev0, non_blocking=True))  # no-sync: device to device
        grads.append(total)
    return grads


def _spread(device: Device, replicas: list[DrafterReplica], grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The step's gradient for every replica: the tensors themselves for the first, a copy
    on each other replica's device (torch's multi-GPU broadcast on distinct GPUs)."""
    if len(replicas) == 1:
        return [grads]
    if _multi_gpu(replicas):
        copies = comm.broadcast_coalesced(grads, [r.device.index or 0 for r in replicas])
        return [grads, *(list(c) for c in copies[1:])]
    copies = [[device.copy_to(g, r.params[0]) for g in grads] for r in replicas[1:]]
    return [grads, *copies]


def _sums(contribs: list[StepGrads], dev0: torch.device, block_size: int) -> tuple[Any, Any, Any, Any]:
    """The step's Σ loss weight (host float), Σ loss, per-slot correct (device) and counts (host)."""
    weight = sum(c.weight_sum for c in contribs)
    losses = [c.loss_sum.to(dev0, non_blocking=True) for c in contribs if c.loss_sum is not None]  # no-sync: d2d
    loss = sum(losses, torch.zeros((), device=dev0))
    per_slot = [c.correct_per_slot for c in contribs if c.correct_per_slot is not None]
    per_slot = [t.to(dev0, non_blocking=True) for t in per_slot]  # no-sync: device to device
    correct = sum(per_slot, torch.zeros(block_size, device=dev0))
    counts = [c.count_per_slot for c in contribs if c.count_per_slot is not None]
    count = sum(counts, torch.zeros(block_size, dtype=torch.long))
    return weight, loss, correct, count


def _part_sums(contribs: list[StepGrads], dev0: torch.device) -> torch.Tensor | None:
    """Σ of the replicas' loss parts on the first replica's device (None: no replica has them)."""
    parts = [c.part_sums.to(dev0, non_blocking=True) for c in contribs if c.part_sums is not None]  # no-sync: d2d
    return sum(parts, torch.zeros(3, device=dev0)) if parts else None


def _across_ranks(
    world: World, grads: list[torch.Tensor], sums: tuple[Any, ...], dev0: torch.device, parts: torch.Tensor | None
) -> tuple:
    """Gradients and the step's sums, summed over every rank (`drafter.allreduce`). The loss
    weight and the per-slot counts come back as one device tensor `[Σ w, counts...]`: the
    update divides by the global Σ w, and the step's one host sync brings both over. The
    loss's parts ride along (zeros from a rank without any)."""
    weight, loss, correct, count = sums
    B = correct.shape[0]
    host = torch.cat([torch.tensor([float(weight)], dtype=torch.float64), count.double()])  # no-sync: host values
    mine = parts if parts is not None else torch.zeros(3, device=dev0)
    stats = torch.cat([upload(host, dev0), loss.double()[None], correct.double(), mine.double()])
    world.all_reduce([*grads, stats], "the gradient all-reduce")
    return stats[: 1 + B], stats[1 + B].float(), stats[2 + B : 2 + 2 * B].float(), None, stats[2 + 2 * B :].float()
