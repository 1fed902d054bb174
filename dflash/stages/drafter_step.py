"""drafter step: one replica's forward and backward over hidden-state batches.

Per optimizer step a replica takes `grad_accum` batches from the hidden-state channel
(waiting there is `drafter.queue_wait`: starved by the targets) and runs each in two
phases on two streams: *prepare* (H2D, anchors, labels, block ids, masks; no weights
touched) on `drafter.prepare`, and *compute* (forward + loss, backward; gradients
accumulate in .grad) on `drafter.forward`, after the prepare's event. It sends its
StepGrads to the optimizer and waits for the reply (`drafter.step_wait`) before touching
its weights again. With `lookahead` the next batch is taken and prepared meanwhile
(`Lookahead`), so the compute after the reply waits only on the weight update. It ends
when the optimizer says stop or the channel ends (then it sends a last StepGrads with 0
micro-batches).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash.runtime.channel import Channel, EndOfStream
from dflash.runtime.devices import Device
from dflash.runtime.messages import HostFeatures, StepGrads, StepReply
from dflash.runtime.profiler import Profiler, Stage
from dflash.stages._link import linked
from dflash.train.replicas import DrafterReplica
from dflash.train.step import Accumulator, MicroStep, PreparedBatch

__all__ = ["Lookahead", "Prepared", "ReplicaWork", "compute", "groups", "prepare", "run", "together"]


@dataclass(frozen=True)
class ReplicaWork:
    """What a replica's stage does each step: `micro` on `grad_accum` batches; `start_step`:
    the last step done before this run (a resumed one's checkpoint). `lookahead`: take and
    prepare the next batch while the optimizer steps. Only for a single replica: with
    several, a batch taken ahead by a fast replica would fall behind the ones a slower
    replica still takes for the same step, and the step's data cursor (its highest batch
    index) would pass over it."""

    micro: MicroStep
    grad_accum: int = 1
    start_step: int = 0
    lookahead: bool = False


@dataclass(frozen=True)
class Prepared:
    """A batch after its prepare phase: what the compute reads, the event that ends the
    prepare work (None on CPU), and the device tensors it made on the prepare stream."""

    batch: PreparedBatch
    ready: Any
    tensors: tuple[Any, ...] = ()


async def prepare(rep: DrafterReplica, micro: MicroStep, device: Device, feats: HostFeatures, step: int) -> Prepared:
    """The prepare phase of one batch on the prepare stream: after the features' event when
    they are still on the target's GPU (holding their memory for this stream); a pooled
    pinned buffer goes back to its pool with the event after its upload."""
    on_device = [t for t in (feats.hidden, *(feats.teacher or ())) if device.on_device(t)]
    out, ready = await device.run(
        None, micro.prepare, rep, device, feats, step,
        wait_for=[feats.ready], uses=on_device, stream=Stage.DRAFTER_PREPARE,
    )  # fmt: skip
    if feats.release is not None:  # (after a failure it stays out: the pool makes another)
        feats.release(ready)
    made = tuple(t for t in device_tensors(out) if device.on_device(t)) if device.accelerated else ()
    return Prepared(out, ready, made)


async def compute(
    acc: Accumulator, rep: DrafterReplica, micro: MicroStep, device: Device, prepared: Prepared, updated: Sequence[Any]
) -> Any:
    """Forward and backward of a prepared batch on the forward stream, after its prepare and
    after `updated` (the events of the last update of these weights); the event of its end."""
    _, ready = await device.run(
        None, acc.compute, micro, rep, device, prepared.batch,
        wait_for=[prepared.ready, *updated], uses=prepared.tensors, stream=Stage.DRAFTER_FORWARD,
    )  # fmt: skip
    return ready


def device_tensors(obj: Any) -> list[Any]:
    """Every tensor inside a prepared batch (dataclasses, dicts, tuples, a flex BlockMask and
    the tensors its mask_mod closes over, which its kernels read too)."""
    out: list[Any] = []
    seen: set[int] = set()
    stack = [obj]
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            stack += x.values()
        elif isinstance(x, (list, tuple)):
            stack += x
        elif hasattr(x, "__dataclass_fields__"):
            stack += [getattr(x, f) for f in x.__dataclass_fields__]
        elif hasattr(x, "as_tuple"):  # flex attention's BlockMask: its block tables and mask_mod
            stack += list(x.as_tuple())
        elif callable(x) and getattr(x, "__closure__", None):
            stack += [c.cell_contents for c in x.__closure__]
    return out


class Lookahead:
    """At most one batch taken and prepared while the optimizer steps. Its wait counts as
    `drafter.queue_wait` only for the part after the optimizer's reply: before it, the
    replica had nothing else to do."""

    def __init__(self) -> None:
        self._task: asyncio.Task[tuple[list[Prepared] | None, float]] | None = None

    def start(self, take: Any) -> None:
        self._task = asyncio.ensure_future(take)

    async def take(self, replied: float, profiler: Profiler, worker: str) -> list[Prepared] | None:
        """The batch taken ahead, once the reply came at `replied` (perf_counter). Cancelled
        meanwhile, the task stays for `drop` to end."""
        assert self._task is not None
        batch, arrived = await asyncio.shield(self._task)
        self._task = None
        profiler.record(Stage.DRAFTER_QUEUE_WAIT, max(0.0, arrived - replied), worker=worker)
        return batch

    @property
    def pending(self) -> bool:
        return self._task is not None

    async def drop(self) -> None:
        """A batch taken ahead and never computed is dropped, like queued ones."""
        task, self._task = self._task, None
        if task is None:
            return
        if not task.done():
            task.cancel()
            await asyncio.wait([task])
        if not task.cancelled():
            task.exception()  # retrieved: the stage is ending either way


def groups(replicas: Sequence[DrafterReplica]) -> list[list[int]]:
    """The replicas' indices by the batch they take: a sequence-parallel group's together, any
    other replica alone."""
    out: list[list[int]] = []
    for i, rep in enumerate(replicas):
        if out and rep.seq_group is not None and replicas[out[-1][0]].seq_group is rep.seq_group:
            out[-1].append(i)
        else:
            out.append([i])
    return out


async def together(group: Sequence[DrafterReplica], work: Sequence[Any]) -> list[Any]:
    """The group's members' work at once (each in its device's thread); a member that fails
    aborts the group's exchanges, so the others end instead of waiting for it."""
    try:
        if len(work) == 1:  # one replica: no task to make
            return [await work[0]]
        return list(await asyncio.gather(*work))
    except BaseException:
        for rep in group:
            if rep.seq_group is not None:
                rep.seq_group.abort()
        raise


async def run(
    group: Sequence[DrafterReplica],
    work: ReplicaWork,
    devices: Sequence[Device],
    inbox: Channel[HostFeatures],
    outbox: Channel[StepGrads],
    replies: Sequence[Channel[StepReply]],
    profiler: Profiler,
) -> None:
    """Forward and backward of `work.grad_accum` batches a step until the optimizer says
    stop or the inbox ends. `group`: one replica, or the replicas of a sequence-parallel group
    (on CPU devices), which take each batch together, each computing its share; the first counts
    the batch's tokens and samples."""
    micro, step, lead, ahead = work.micro, work.start_step, devices[0], Lookahead()
    updated: list[list[Any]] = [[] for _ in group]  # each member's last update's event: its next forward reads them

    async def take(step: int, early: bool = False) -> tuple[list[Prepared] | None, float]:
        """The next batch prepared by every member (None: the end) and when it came; `early`: see `Lookahead`."""
        try:
            feats, waited = await inbox.get()
        except EndOfStream:
            return None, time.perf_counter()
        arrived = time.perf_counter()
        if not early:  # waited for within the step: starved by the targets
            profiler.record(Stage.DRAFTER_QUEUE_WAIT, waited, worker=lead.name)
        shared = feats if len(group) == 1 else dataclasses.replace(feats, release=None)  # a group: CPUs, nothing pooled
        jobs = [prepare(r, micro, d, shared, step) for r, d in zip(group, devices, strict=True)]
        return await together(group, jobs), arrived

    with linked([inbox, *replies], [outbox]):
        try:
            taken: list[list[Prepared] | None] = []  # the batch taken ahead, when there is one
            while True:
                accs, ready = [Accumulator(counts=r.seq_rank == 0) for r in group], [None] * len(group)
                for _ in range(work.grad_accum):
                    batch = taken.pop() if taken else (await take(step))[0]
                    if batch is None:
                        break
                    members = zip(accs, group, devices, batch, updated, strict=True)
                    ready = await together(group, [compute(a, r, micro, d, b, u) for a, r, d, b, u in members])
                    rows = batch[0].batch.batch.num_tokens if group[0].seq_rank == 0 else 0  # a group's, once
                    profiler.count("drafter_tokens", rows)
                [await outbox.put(a.grads(r.index, step, d)) for a, r, d in zip(accs, group, ready, strict=True)]
                if accs[0].n == 0:
                    return
                if work.lookahead:
                    ahead.start(take(step + 1, early=True))
                try:
                    answers = [await r.get() for r in replies]
                except EndOfStream:
                    return
                profiler.record(Stage.DRAFTER_STEP_WAIT, answers[0][1], worker=lead.name)
                if answers[0][0].stop:
                    return
                if ahead.pending:
                    taken.append(await ahead.take(time.perf_counter(), profiler, lead.name))
                updated, step = [[reply.ready] for reply, _ in answers], answers[0][0].step
        finally:
            await ahead.drop()
