"""drafter step: one replica's forward and backward over hidden-state batches.

Per optimizer step a replica takes `grad_accum` batches from the hidden-state channel
(waiting there is `drafter.queue_wait`: starved by the targets) and runs each in two
phases: *prepare* (H2D, anchors, labels, block ids, masks — no weights touched) and
*compute* (forward + loss, backward; gradients accumulate in .grad). It sends its
StepGrads to the optimizer and waits for the optimizer's reply (`drafter.step_wait`)
before touching its weights again — meanwhile it takes and prepares the next batch, so
the compute after the reply waits only on the weight update. It ends when the optimizer says stop or the channel
ends (it then sends a last StepGrads with 0 micro-batches).
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass
from typing import Any

from dflash.runtime.channel import Channel, EndOfStream
from dflash.runtime.devices import Device
from dflash.runtime.messages import HostFeatures, StepGrads, StepReply
from dflash.runtime.profiler import Profiler, Stage
from dflash.stages._link import linked
from dflash.train.replicas import DrafterReplica
from dflash.train.step import Accumulator, MicroStep, PreparedBatch

__all__ = ["ReplicaWork", "run", "run_prepare"]


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


async def _take(
    rep: DrafterReplica,
    micro: MicroStep,
    device: Device,
    inbox: Channel[HostFeatures],
    profiler: Profiler,
    step: int,
    early: bool = False,
) -> tuple[PreparedBatch | None, float]:
    """The next batch, prepared (None at the end of the stream), and when it arrived.
    `early`: taken while the optimizer steps (its wait is counted after the reply)."""
    try:
        feats, waited = await inbox.get()
    except EndOfStream:
        return None, time.perf_counter()
    arrived = time.perf_counter()
    if not early:  # waited for in the step itself: starved by the targets
        profiler.record(Stage.DRAFTER_QUEUE_WAIT, waited, worker=device.name)
    return await run_prepare(rep, micro, device, feats, step), arrived


async def run_prepare(
    rep: DrafterReplica, micro: MicroStep, device: Device, feats: HostFeatures, step: int
) -> PreparedBatch:
    """The prepare phase of one batch: after the features' event when they are still on the
    target's GPU (and holding their memory for this stream); a pooled pinned buffer goes
    back to its pool with the event after its upload."""
    on_device = [t for t in (feats.hidden, *(feats.teacher or ())) if device.on_device(t)]
    out, ready = await device.run(None, micro.prepare, rep, device, feats, step, wait_for=[feats.ready], uses=on_device)
    if feats.release is not None:  # (after a failure it stays out: the pool makes another)
        feats.release(ready)
    return out


async def run(
    rep: DrafterReplica,
    work: ReplicaWork,
    device: Device,
    inbox: Channel[HostFeatures],
    outbox: Channel[StepGrads],
    replies: Channel[StepReply],
    profiler: Profiler,
) -> None:
    """Forward and backward of `work.grad_accum` batches a step until the optimizer says
    stop or the inbox ends."""
    micro, step = work.micro, work.start_step
    wait_for: list[Any] = []  # CUDA: the last update must land before the next forward
    ahead: asyncio.Task[tuple[PreparedBatch | None, float]] | None = None
    take = functools.partial(_take, rep, micro, device, inbox, profiler)

    with linked([inbox, replies], [outbox]):
        try:
            while True:
                acc = Accumulator()
                ready = None
                for _ in range(work.grad_accum):
                    batch, _ = await (ahead if ahead is not None else take(step))
                    ahead = None
                    if batch is None:
                        break
                    _, ready = await device.run(None, acc.compute, micro, rep, device, batch, wait_for=wait_for)
                    profiler.count("drafter_tokens", batch.batch.num_tokens)
                await outbox.put(acc.grads(rep.index, step, ready))
                if acc.n == 0:
                    return
                if work.lookahead:  # prepared while the optimizer steps: after the reply, only the forward is left
                    ahead = asyncio.ensure_future(take(step + 1, early=True))
                try:
                    reply, waited = await replies.get()
                except EndOfStream:
                    return
                profiler.record(Stage.DRAFTER_STEP_WAIT, waited, worker=device.name)
                if reply.stop:
                    return
                if ahead is not None:  # starved only for the part of its wait after the reply
                    replied = time.perf_counter()
                    _, arrived = await asyncio.shield(ahead)
                    profiler.record(Stage.DRAFTER_QUEUE_WAIT, max(0.0, arrived - replied), worker=device.name)
                wait_for = [reply.ready]
                step = reply.step
        finally:
            if ahead is not None:  # a batch taken ahead is dropped, like queued ones
                if not ahead.done():
                    ahead.cancel()
                    await asyncio.wait([ahead])
                if not ahead.cancelled():
                    ahead.exception()  # retrieved: the stage is ending either way
