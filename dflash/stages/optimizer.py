"""optimizer: the fan-in of all drafter replicas, one optimizer step at a time.

Waits for: one StepGrads from every active replica. Then, in its worker thread
(`apply_step`): sums the replicas' gradients in a fixed order on the first replica's
device and divides by the step's total loss weight (Σ w over all micro-batches and
replicas), clips the global norm (the clip factor stays a tensor), copies the same
gradient into every replica and steps every replica's optimizer and schedule — so
replicas stay identical. One host sync per step, named `drafter.grad_norm_sync`: a
non-finite loss or gradient skips the step (no weight or optimizer state touched).
After the step the `StepBook` (dflash/steps.py) records it and runs the step hooks
(metrics, eval, checkpoints). Unblocks: every replica (a StepReply: go on, or stop).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.cuda.comm as comm  # not imported by `import torch`

from dflash import faults
from dflash.channel import Channel, EndOfStream
from dflash.devices import Device, host_sync, upload
from dflash.distributed import World
from dflash.profile import Stage
from dflash.records import StepGrads, StepReply
from dflash.replica import DrafterReplica, TimeBudget
from dflash.stages._link import linked
from dflash.steps import Progress, StepBook, StepResult

__all__ = ["apply_step", "run"]


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
            tensors += [t for t in (c.loss_sum, c.correct_per_slot) if t is not None]
        stream = None
        if r.device.type == "cuda":
            if r.device != dev0:
                stream = device.stream(Stage.OPTIMIZER_STEP, on=r.device)
                if c is not None and c.ready is not None:
                    stream.wait_event(c.ready)
                torch.cuda.set_stream(stream)  # this thread's current stream on that GPU
            else:
                stream = torch.cuda.current_stream(dev0)
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


def _spread(replicas: list[DrafterReplica], grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The step's gradient for every replica: the tensors themselves for the first, a copy
    on each other replica's device (torch's multi-GPU broadcast on distinct GPUs)."""
    if len(replicas) == 1:
        return [grads]
    if _multi_gpu(replicas):
        copies = comm.broadcast_coalesced(grads, [r.device.index or 0 for r in replicas])
        return [grads, *(list(c) for c in copies[1:])]
    copies = [[g.to(r.device, copy=True, non_blocking=True) for g in grads] for r in replicas[1:]]  # no-sync: d2d
    return [grads, *copies]


def _update(device: Device, r: DrafterReplica, grads: list[torch.Tensor]) -> Any:
    """AdamW and schedule of one replica, on its own GPU's stream of this thread; the event
    of its update on another GPU (None for the first: `Device.run`'s event covers it)."""
    for p, g in zip(r.params, grads, strict=True):
        p.grad = g
    r.optimizer.step()
    r.scheduler.step()
    r.optimizer.zero_grad(set_to_none=True)
    if r.device.type != "cuda" or r.device == device.device:
        return None
    ev = torch.cuda.Event()
    ev.record(device.stream(Stage.OPTIMIZER_STEP, on=r.device))
    return ev


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


def _across_ranks(world: World, grads: list[torch.Tensor], sums: tuple[Any, ...], dev0: torch.device) -> tuple:
    """Gradients and the step's sums, summed over every rank (`drafter.allreduce`). The loss
    weight and the per-slot counts come back as one device tensor `[Σ w, counts...]`: the
    update divides by the global Σ w, and the step's one host sync brings both over."""
    weight, loss, correct, count = sums
    B = correct.shape[0]
    host = torch.cat([torch.tensor([float(weight)], dtype=torch.float64), count.double()])  # no-sync: host values
    stats = torch.cat([upload(host, dev0), loss.double()[None], correct.double()])
    world.all_reduce([*grads, stats], "the gradient all-reduce")
    return stats[: 1 + B], stats[1 + B].float(), stats[2 + B :].float(), None


def apply_step(
    replicas: list[DrafterReplica],
    contribs: list[StepGrads],
    device: Device,
    step: int,
    progress: Progress,
    *,
    grad_clip: float,
    world: World | None = None,
    budget: TimeBudget | None = None,
) -> StepResult:
    """Reduce, normalise, clip and apply one step to every replica (in the optimizer's worker).
    `progress.updating` is set just before the first change of state and cleared, with the
    step and cursor advanced, when the last replica is updated: whenever a crash stops the
    run, `progress` says whether the state is consistent and which step it is. With a
    `world`, gradients and sums are summed over every rank too (this rank may contribute
    nothing: its shard has ended while others' have not)."""
    faults.check(Stage.OPTIMIZER_STEP)
    if budget is not None:
        budget.tick()  # one reading for every replica's schedule and the stop check after the step
    dev0 = replicas[0].device
    block_size = replicas[0].model.spec.block_size
    with device.span(Stage.GRAD_REDUCE):
        _take_over(device, replicas, contribs)
        grads = _reduced(replicas, {c.replica for c in contribs}, dev0)
        sums = _sums(contribs, dev0, block_size)
    if world is not None:
        with device.span(Stage.ALLREDUCE):
            sums = _across_ranks(world, grads, sums, dev0)
    weight, loss, correct, count = sums  # with a world: weight = [Σ w, counts...] on the device
    scale = (1.0 / weight[0].clamp(min=1e-12)).float() if world is not None else 1.0 / max(weight, 1e-12)
    torch._foreach_mul_(grads, scale)  # the fused multi-tensor kernel clip_grad_norm_ uses too
    with device.span(Stage.GRAD_NORM_SYNC):
        norm = torch.nn.utils.get_total_norm(grads, foreach=dev0.type == "cuda")
        # The one host sync per step, on purpose: a NaN/Inf step must touch neither the
        # weights nor the optimizer state, and only the host can decide to skip it.
        ok = torch.isfinite(norm) & torch.isfinite(loss)
        if world is None:
            finite, weight_h = bool(host_sync(ok)), weight
        else:  # the global Σ w and per-slot counts come over in the same sync
            host = host_sync(torch.cat([ok.double()[None], weight]))
            finite, weight_h = bool(host[0]), float(host[1])  # no-sync: host tensor
            count = host[2:].round().long()
        if grad_clip > 0 and finite:
            coef = (grad_clip / (norm + 1e-6)).clamp(max=1.0)  # stays a tensor: no sync
            torch._foreach_mul_(grads, coef)
    if not finite:
        for r in replicas:
            r.optimizer.zero_grad(set_to_none=True)
    updated: dict[int, Any] = {}
    with device.span(Stage.OPTIMIZER_STEP) if finite else contextlib.nullcontext():
        lr = replicas[0].optimizer.param_groups[0]["lr"]
        progress.updating = finite  # from here until StepBook.end, weights and AdamW state may disagree
        for r, g in zip(replicas, _spread(replicas, grads) if finite else [], strict=False):
            updated[r.index] = _update(device, r, g)
    last = world.cursor if world is not None else max(c.last_batch for c in contribs)
    progress.finish(step, last)
    return StepResult(
        step=step,
        loss=loss * scale,  # float32 × float32 scale, as with one process
        grad_norm=norm,
        lr=lr,
        correct=correct,
        count=count,
        tokens=sum(c.tokens for c in contribs),
        samples=sum(c.samples for c in contribs),
        weight_sum=weight_h,
        skipped=not finite,
        updated={r: ev for r, ev in updated.items() if ev is not None},
    )


async def run(
    replicas: list,
    apply: Callable[..., StepResult],
    device: Device,
    inbox: Channel[StepGrads],
    replies: list[Channel[StepReply]],
    book: StepBook,
    stop: asyncio.Event,
    max_steps: int | None,
    world: World | None = None,
    grad_accum: int = 1,
    budget: TimeBudget | None = None,
) -> int:
    """`apply(replicas, contribs, device, step, progress)` is `apply_step` with the clip
    (and the world) bound. Returns the number of the last optimizer step taken.

    With a `world`, every rank agrees before each update (`World.agree`): the step runs on
    every rank while any rank has data, and all stop after the step in which any rank was
    asked to stop — or before it, when a stop left some rank's step incomplete (an update
    from part of the data would differ from the uninterrupted run's)."""
    active = set(range(len(replicas)))
    mine = book.progress.last_batch  # the highest batch index this rank has consumed
    with linked([inbox], replies):
        while True:
            msgs: list[StepGrads] = []
            try:
                for _ in range(len(active)):
                    msg, _ = await inbox.get()
                    msgs.append(msg)
            except EndOfStream:
                pass
            contribs = [m for m in msgs if m.micro_batches > 0]
            finished = {m.replica for m in msgs if m.micro_batches == 0}
            if len(msgs) < len(active):  # a replica closed without a final message
                finished |= active - {m.replica for m in msgs}
            done = max_steps is not None and book.progress.step >= max_steps  # resumed at the end
            go, stop_all = bool(contribs) and not done, False  # no-sync: a list
            if world is not None:
                mine = max([mine, *(c.last_batch for c in contribs)])
                complete = len(contribs) == len(active) and all(c.micro_batches == grad_accum for c in contribs)
                agreed, _ = await device.run(None, world.agree, book.next_step, go, stop.is_set(), mine, complete)
                go, stop_all = agreed.any_data and not (agreed.stop and not agreed.all_complete), agreed.stop
                if stop_all:  # asked on another rank: this one stops too (intake, the run's reason)
                    stop.set()
            ready, updated = None, {}
            if go:
                result, ready = await device.run(
                    None, apply, replicas, contribs, device, book.next_step, book.progress,
                    wait_for=[c.ready for c in contribs],
                )  # fmt: skip
                await book.end(result, ready)
                updated = result.updated
            step = book.progress.step
            stop_now = stop_all or (world is None and stop.is_set()) or (max_steps is not None and step >= max_steps)
            stop_now = stop_now or (budget is not None and budget.spent)  # one process only
            active -= finished
            for r in sorted(active):  # a replica on another GPU waits on its own update
                await replies[r].put(StepReply(step, stop_now, updated.get(r, ready)))
            if stop_now or not go:
                break
        await book.close()
    return book.progress.step
