"""The drafter stage's helpers (dflash/stages/drafter_step.py): which tensors a prepared batch
hands to the forward stream, and the batch taken ahead while the optimizer steps."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch

from dflash.model.masks import BlockLayout, layer_masks
from dflash.stages.drafter_step import Lookahead, device_tensors


def test_a_flex_mask_hands_over_the_layout_its_kernels_read():
    """A BlockMask's mask_mod closes over the layout's anchors, valid flags and document ids,
    which flex attention's kernels read on the forward stream: they are held there too."""
    layout = BlockLayout(torch.tensor([[1, 3]]), torch.tensor([[True, True]]), torch.zeros(1, 6, dtype=torch.long), 2)
    spec = SimpleNamespace(layer_types=["full_attention"], sliding_window=4, sliding_causal_block=True)
    masks = layer_masks(layout, spec, use_flex=True)
    found = {id(t) for t in device_tensors({"masks": masks})}
    assert {id(layout.anchors), id(layout.valid), id(layout.doc_ids)} <= found
    assert len(found) > 3  # and the block tables themselves


class _Profiler:
    def __init__(self) -> None:
        self.waits: list[float] = []

    def record(self, stage: str, seconds: float, worker: str = "") -> None:
        self.waits.append(seconds)


def test_lookahead_counts_only_the_wait_after_the_reply():
    async def main() -> tuple[object, list[float]]:
        ahead, prof = Lookahead(), _Profiler()

        async def taken() -> tuple[str, float]:
            return "batch", 10.0  # arrived at t = 10

        ahead.start(taken())
        assert ahead.pending
        got = await ahead.take(7.5, prof, "drafter0")  # the reply came at t = 7.5
        assert not ahead.pending
        ahead.start(taken())
        await ahead.take(12.0, prof, "drafter0")  # arrived before the reply: no wait
        return got, prof.waits

    got, waits = asyncio.run(main())
    assert got == "batch" and waits == [2.5, 0.0]


def test_a_stage_cancelled_while_waiting_for_the_batch_ahead_drops_it():
    """Cancelled during `take`, the batch taken ahead is still cancelled by `drop` (it never
    takes a batch or runs a prepare after the stage ended)."""

    async def main() -> bool:
        ahead, gate = Lookahead(), asyncio.Event()

        async def taken() -> tuple[str, float]:
            await gate.wait()
            return "batch", 0.0

        ahead.start(taken())
        waiting = asyncio.ensure_future(ahead.take(0.0, _Profiler(), "drafter0"))
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.wait([waiting])
        assert ahead.pending  # the task is still there for drop
        task = ahead._task
        await ahead.drop()
        return task is not None and task.cancelled() and not ahead.pending

    assert asyncio.run(main())
