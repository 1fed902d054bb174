"""optimizer: the fan-in of all drafter replicas, one optimizer step at a time.

Waits for: one StepGrads from every active replica. Then, in its worker thread
(`apply_step`): sums the replicas' gradients in a fixed order on the first replica's
device and divides by the step's total loss weight (Σ w over all micro-batches and
replicas), clips the global norm (the clip factor stays a tensor), copies the same
gradient into every replica and steps every replica's optimizer and schedule — so
replicas stay identical. One host sync per step, named `drafter.grad_norm_sync`: a
non-finite loss or gradient skips the step (no weight or optimizer state touched).
After the step the `StepBook` (dflash/train/hooks.py) records it and runs the step hooks
(metrics, eval, checkpoints). Unblocks: every replica (a StepReply: go on, or stop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from dflash.runtime.channel import Channel, EndOfStream
from dflash.runtime.devices import Device
from dflash.runtime.distributed import World
from dflash.runtime.messages import StepGrads, StepReply
from dflash.stages._link import linked
from dflash.train.hooks import StepBook, StepResult
from dflash.train.schedule import StepPlan

__all__ = ["run"]


async def run(
    apply: Callable[..., StepResult],
    device: Device,
    inbox: Channel[StepGrads],
    replies: list[Channel[StepReply]],
    book: StepBook,
    stop: asyncio.Event,
    steps: StepPlan,
    world: World | None = None,
) -> int:
    """`apply(contribs, device, step, progress)` is `apply_step` with the replicas, the clip
    (and the world) bound; `replies`: one channel per replica. Returns the number of the
    last optimizer step taken.

    With a `world`, every rank agrees before each update (`World.agree`): the step runs on
    every rank while any rank has data, and all stop after the step in which any rank was
    asked to stop — or before it, when a stop left some rank's step incomplete (an update
    from part of the data would differ from the uninterrupted run's)."""
    active = set(range(len(replies)))
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
            done = steps.at_max_steps(book.progress.step)  # resumed at the end
            go, stop_all = bool(contribs) and not done, False  # no-sync: a list
            if world is not None:
                mine = max([mine, *(c.last_batch for c in contribs)])
                complete = len(contribs) == len(active) and all(c.micro_batches == steps.grad_accum for c in contribs)
                agreed, _ = await device.run(None, world.agree, book.next_step, go, stop.is_set(), mine, complete)
                go, stop_all = agreed.any_data and not (agreed.stop and not agreed.all_complete), agreed.stop
                if stop_all:  # asked on another rank: this one stops too (intake, the run's reason)
                    stop.set()
            ready, updated = None, {}
            if go:
                result, ready = await device.run(
                    None, apply, contribs, device, book.next_step, book.progress, wait_for=[c.ready for c in contribs]
                )
                await book.end(result, ready)
                updated = result.updated
            step = book.progress.step
            # (a time budget is refused with several processes: the ranks' clocks would differ)
            stop_now = stop_all or (world is None and stop.is_set()) or steps.ended(step)
            active -= finished
            for r in sorted(active):  # a replica on another GPU waits on its own update
                await replies[r].put(StepReply(step, stop_now, updated.get(r, ready)))
            if stop_now or not go:
                break
        await book.close()
    return book.progress.step
