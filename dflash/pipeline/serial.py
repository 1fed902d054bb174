"""The serial loop: the readable specification of one training run (`pipeline.mode = "serial"`).

Every stage function the pipeline runs, called one after another, top to bottom: the
pipeline (dflash/pipeline/topology.py) computes exactly this — the same losses and the same
weights for one target and one replica — only with the stages overlapped. (With a feature
cache, which later batches find their features cached depends on timing, and cached
features are bf16: then the two agree to rounding, not bit for bit. A feature store holds the
same for every run: store-fed runs agree bit for bit.) Each call still
goes through its stage's `Device` (so it runs off the event loop, is timed under the same
stage names, and on CUDA on the same streams, each waiting on the `ready` event of the
work it consumes), but nothing overlaps: the loop awaits each call before the next.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from dflash.runtime.devices import Device
from dflash.runtime.messages import Batch, StepGrads, TargetFeatures
from dflash.runtime.profiler import Profiler, Stage
from dflash.stages import drafter_step, feature_read, pack, prefetch, target_forward, transfer
from dflash.stages import optimizer as optimizer_stage
from dflash.train.build import Training
from dflash.train.hooks import StepBook
from dflash.train.step import Accumulator

__all__ = ["train"]


async def train(
    training: Training,
    data: Device,
    target: Device,
    drafters: Sequence[Device],
    optimizer: Device,
    book: StepBook,
    stop: asyncio.Event,
    profiler: Profiler,
    reader: Sequence[Device] = (),
) -> int:
    """Train until the data, `train.max_steps`, `train.max_minutes` or a stop request ends it;
    the last step."""
    plan = iter(training.plan)  # (index, epoch, rows) in the run's fixed order, from the resume cursor
    cache, store = training.cache, training.store
    tgt = training.targets[0]
    updated, result = None, None  # the last update's ready event: the next forward reads those weights
    while not stop.is_set() and not training.steps.ended(book.progress.step):  # the budget: read by the last update
        step = book.progress.step
        contribs: list[StepGrads] = []
        own = result.updated if result is not None else {}  # a replica on another GPU: its own update
        for group in drafter_step.groups(training.replicas):  # a sequence-parallel group takes each batch together
            reps, devs = [training.replicas[i] for i in group], [drafters[i] for i in group]
            accs, ready = [Accumulator(counts=r.seq_rank == 0) for r in reps], [None] * len(group)
            for _ in range(training.steps.grad_accum):
                batch, _ = await data.run(Stage.PREFETCH, prefetch.next_batch, plan, training.pin)
                if batch is None:  # the data is done
                    break
                item: Batch | TargetFeatures = batch
                if reader:  # the store (and the cache above it)
                    item = await feature_read.lookup(reader[0], target, batch, tgt.embed_weight.dtype, cache, store)
                feats = await target_forward.features(tgt, target, item, profiler, None if reader else cache)
                packed = await pack.packed(target, feats)
                host = await transfer.host_features(target, packed, 0, cache)
                members = list(zip(reps, devs, strict=True))
                prepared = await drafter_step.together(
                    reps, [drafter_step.prepare(rep, training.micro, dev, host, step) for rep, dev in members])
                # after the last update, and on its own GPU each replica's
                ready = await drafter_step.together(reps, [
                    drafter_step.compute(acc, rep, training.micro, dev, p, [updated, own.get(rep.index)])
                    for acc, (rep, dev), p in zip(accs, members, prepared, strict=True)
                ])  # fmt: skip
                profiler.count("drafter_tokens", batch.num_tokens)
            contribs += [a.grads(r.index, step, done) for a, r, done in zip(accs, reps, ready, strict=True) if a.n]
        if not contribs:
            break
        result, updated = await optimizer_stage.update(training.apply, optimizer, contribs, book)
    await book.close()
    return book.progress.step
