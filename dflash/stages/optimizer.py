"""optimizer: the fan-in of all drafter replicas, one optimizer step at a time.

Waits for: one StepGrads from every active replica. Then `decide` says whether this step
updates and whether the run stops after it, and `update` runs `apply_step` on the
optimizer's stream (`drafter.optimizer_step`): the replicas' gradients summed in a fixed
order, divided by the step's Σ w, clipped (the grad norm's one host sync,
`drafter.grad_norm_sync`: a non-finite step is skipped), every replica's AdamW stepped. The
`StepBook` (dflash/train/hooks.py) then records the step and runs the step hooks.
Unblocks: every replica (a StepReply: go on, or stop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dflash.runtime.channel import Channel, EndOfStream
from dflash.runtime.devices import Device
from dflash.runtime.distributed import Agreement, World
from dflash.runtime.messages import StepGrads, StepReply
from dflash.runtime.profiler import Stage
from dflash.stages._link import linked
from dflash.train.hooks import StepBook, StepResult
from dflash.train.schedule import StepPlan

__all__ = ["Decision", "decide", "run", "update"]


@dataclass(frozen=True)
class Decision:
    """What the optimizer does with one step: `go` updates the weights with its gradients;
    `stop_all`: a stop asked on some rank ends every rank after this step."""

    go: bool
    stop_all: bool = False

    def stops(self, asked_here: bool, alone: bool, ended: bool) -> bool:
        """Whether the run stops after this step: asked on any rank (alone: here), or the
        step plan ended (max steps, time budget), or there was nothing to update."""
        return self.stop_all or (alone and asked_here) or ended or not self.go


def decide(has_data: bool, at_max_steps: bool, agreed: Agreement | None = None) -> Decision:
    """Alone: update when some replica sent gradients and the step limit is not reached.
    With several ranks (`agreed`, from `World.agree` over each rank's `has_data and not
    at_max_steps`): update while any rank has data — a rank without contributes zeros —
    unless a stop left some rank's step incomplete (an update from part of the data would
    differ from the uninterrupted run's); any rank's stop stops all."""
    if agreed is None:
        return Decision(go=has_data and not at_max_steps)
    return Decision(go=agreed.any_data and (agreed.all_complete or not agreed.stop), stop_all=agreed.stop)


async def update(
    apply: Callable[..., StepResult], device: Device, contribs: Sequence[StepGrads], book: StepBook
) -> tuple[StepResult, Any]:
    """`apply_step` on the optimizer's stream after every contribution's backward, then the
    step's records and hooks; the result and the event of the update."""
    result, ready = await device.run(
        None, apply, contribs, device, book.next_step, book.progress,
        wait_for=[c.ready for c in contribs], stream=Stage.OPTIMIZER_STEP,
    )  # fmt: skip
    await book.end(result, ready)
    return result, ready


async def _gather(inbox: Channel[StepGrads], active: set[int]) -> tuple[list[StepGrads], set[int]]:
    """One StepGrads from every active replica: the contributions with data, and the replicas
    that finished (a last message with no micro-batches, or closed without one)."""
    msgs: list[StepGrads] = []
    try:
        for _ in range(len(active)):
            msg, _ = await inbox.get()
            msgs.append(msg)
    except EndOfStream:
        pass
    finished = {m.replica for m in msgs if m.micro_batches == 0} | (active - {m.replica for m in msgs})
    return [m for m in msgs if m.micro_batches > 0], finished


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
    last optimizer step taken. With a `world`, every rank agrees before each update
    (`World.agree`, then `decide`)."""
    active = set(range(len(replies)))
    mine = book.progress.last_batch  # the highest batch index this rank has consumed
    with linked([inbox], replies):
        while True:
            contribs, finished = await _gather(inbox, active)
            has_data, at_max = len(contribs) > 0, steps.at_max_steps(book.progress.step)
            agreed = None
            if world is not None:
                mine = max([mine, *(c.last_batch for c in contribs)])
                complete = len(contribs) == len(active) and all(c.micro_batches == steps.grad_accum for c in contribs)
                go_here = has_data and not at_max
                agreed, _ = await device.run(
                    None, world.agree, book.next_step, go_here, stop.is_set(), mine, complete,
                    stream=Stage.OPTIMIZER_STEP,
                )  # fmt: skip
            decision = decide(has_data, at_max, agreed)
            if decision.stop_all:  # asked on another rank: this one stops too (intake, the run's reason)
                stop.set()
            ready, updated = None, {}
            if decision.go:
                result, ready = await update(apply, device, contribs, book)
                updated = result.updated
            # (a time budget is refused with several processes: the ranks' clocks would differ)
            stop_now = decision.stops(stop.is_set(), world is None, steps.ended(book.progress.step))
            active -= finished
            for r in sorted(active):  # a replica on another GPU waits on its own update
                await replies[r].put(StepReply(book.progress.step, stop_now, updated.get(r, ready)))
            if stop_now:
                break
        await book.close()
    return book.progress.step
