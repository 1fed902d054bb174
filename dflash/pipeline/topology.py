"""Topology: the channels, devices and stage tasks of a run — the one place that knows
every stage.

    prefetch ─► [batches] ─┬─► (read₀ ─►) target_forward₀ ─► pack₀ ─► transfer₀ ─┐
                           └─► (read₁ ─►) target_forward₁ ─► pack₁ ─► transfer₁ ─┴─► [hidden_states]
    [hidden_states] ─┬─► drafter_step₀ ─┐
                     └─► drafter_step₁ ─┴─► [grads] ─► optimizer ─► [replies₀], [replies₁]

A chain starts with feature read (`readᵢ`, its own worker `reader{i}`) when the run has a
feature store. One target chain per `pipeline.target_devices` entry, one drafter replica per
`pipeline.drafter_devices` entry. Task names are the stage names of the profiler and of
fault injection (`Stage`), with the chain or replica index: `target.model_forward[0]`.
`pipeline.mode = "serial"` builds one task instead, the serial loop (dflash/pipeline/serial.py),
over the same devices.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash.config import Config, PipelineConfig
from dflash.features.cache import FeatureCache
from dflash.features.files import FeatureStore
from dflash.pipeline import serial
from dflash.runtime.channel import Channel
from dflash.runtime.devices import Device, DeviceFactory, PinnedPool
from dflash.runtime.messages import Batch, HostFeatures, PackedFeatures, StepGrads, StepReply, TargetFeatures
from dflash.runtime.profiler import Profiler, Stage
from dflash.stages import drafter_step, feature_read, optimizer, pack, prefetch, target_forward, transfer
from dflash.train.build import Training
from dflash.train.hooks import StepBook, StepHook

__all__ = ["Topology", "build"]


@dataclass
class Topology:
    tasks: list[tuple[str, Coroutine[Any, Any, Any]]]  # (name, coroutine) per stage task
    devices: list[Device]  # closed in this order at the end
    optimizer: Device  # after a failure, its op in flight is waited for (no half update)
    book: StepBook
    cache: FeatureCache | None
    store: FeatureStore | None = None


@dataclass
class _Workers:
    """A run's devices, one a worker, in the order they are closed (`all`)."""

    all: list[Device]
    data: Device
    targets: list[Device]  # one a target chain
    drafters: list[Device]  # one a drafter replica
    readers: list[Device]  # one a target chain with a feature store, else none
    optimizer: Device


def _workers(training: Training, profiler: Profiler, make_device: DeviceFactory) -> _Workers:
    """The devices of the data, each target chain and drafter replica, the feature readers and
    the optimizer (on the first replica's device)."""
    devices: list[Device] = []

    def device(spec: str, name: str) -> Device:
        d = make_device(spec, name, profiler)
        devices.append(d)
        return d

    data = device("cpu", "data")
    targets = [device(str(tgt.device), f"target{i}") for i, tgt in enumerate(training.targets)]
    drafters = [device(str(rep.device), f"drafter{r}") for r, rep in enumerate(training.replicas)]
    readers = [device("cpu", f"reader{i}") for i in range(len(targets))] if training.store is not None else []
    opt = device(str(training.replicas[0].device), "optimizer")
    return _Workers(devices, data, targets, drafters, readers, opt)


def _channels(
    p: PipelineConfig, training: Training, profiler: Profiler
) -> tuple[Channel[Batch], Channel[HostFeatures], Channel[StepGrads], list[Channel[StepReply]]]:
    """The channels between the stages: batches, hidden states, gradients and each replica's
    replies (the first two watched by the profiler)."""
    n_t, n_d = len(training.targets), len(training.replicas)
    batches: Channel[Batch] = Channel("batches", p.batch_queue_depth, consumers=n_t)
    # Several target chains finish batches out of order: the drafters take them as they arrive
    # (a checkpoint records which batches are done), or with pipeline.in_order (and with several
    # processes, whose cursor is one index) in prefetch's order: the steps of one chain.
    in_order = n_t > 1 and (p.in_order or training.world is not None)
    hs: Channel[HostFeatures] = Channel(
        "hidden_states", p.hs_queue_depth, producers=n_t, consumers=n_d // p.sp_in_process,
        min_ready=p.hs_min_ready,
        order=(lambda f: f.batch.seq) if in_order else None,
    )  # fmt: skip
    grads: Channel[StepGrads] = Channel("grads", n_d, producers=n_d)
    replies: list[Channel[StepReply]] = [Channel(f"replies{r}", 1) for r in range(n_d)]
    profiler.add_channel(batches)
    profiler.add_channel(hs)
    return batches, hs, grads, replies


def build(
    cfg: Config,
    training: Training,
    profiler: Profiler,
    emit: Any,
    stop: asyncio.Event,
    hooks: Sequence[StepHook],
    make_device: DeviceFactory = Device,
) -> Topology:
    """The run's stage tasks over its devices and channels (`pipeline.mode = "serial"`: the
    serial loop, one task)."""
    w = _workers(training, profiler, make_device)
    opt, drafters = w.optimizer, w.drafters
    book = StepBook(
        opt, profiler, emit, start_step=training.start_step, start_batch=training.plan.start_index,
        done_ahead=training.plan.done_ahead, log_every=cfg.train.log_every,
        max_bad_steps=cfg.train.max_bad_steps, hooks=hooks,
    )  # fmt: skip
    if cfg.pipeline.mode == "serial":
        loop = serial.train(training, w.data, w.targets[0], drafters, opt, book, stop, profiler, w.readers[:1])
        return Topology([("serial", loop)], w.all, opt, book, training.cache, training.store)

    p = cfg.pipeline
    batches, hs, grads, replies = _channels(p, training, profiler)
    tasks: list[tuple[str, Coroutine[Any, Any, Any]]] = [
        (Stage.PREFETCH, prefetch.run(training.plan, w.data, batches, stop, training.pin, training.world,
                                      p.sp_across_ranks))
    ]
    for i, dev in enumerate(w.targets):
        reader = w.readers[i] if w.readers else None
        tasks += _target_chain(i, training, p, (dev, reader), drafters, (batches, hs), profiler)
    n_d = len(training.replicas)
    ahead = p.prepare_ahead if p.prepare_ahead is not None else (n_d == 1 and drafters[0].accelerated)
    work = drafter_step.ReplicaWork(training.micro, training.steps.grad_accum, training.start_step, lookahead=ahead)
    for g in drafter_step.groups(training.replicas):  # a sequence-parallel group takes each batch together: one task
        reps, devs, inboxes = [training.replicas[i] for i in g], [drafters[i] for i in g], [replies[i] for i in g]
        run = drafter_step.run(reps, work, devs, hs, grads, inboxes, profiler)
        tasks.append((f"{Stage.DRAFTER_FORWARD}[{g[0]}]", run))
    if training.world is not None:
        training.world.cursor = training.plan.start_index - 1  # resumed: the batches before the cursor are done
    tasks.append(
        (
            Stage.OPTIMIZER_STEP,
            optimizer.run(training.apply, opt, grads, replies, book, stop, training.steps, training.world),
        )
    )
    return Topology(tasks, w.all, opt, book, training.cache, training.store)


def _target_chain(
    i: int,
    training: Training,
    p: PipelineConfig,
    devs: tuple[Device, Device | None],
    drafters: list[Device],
    channels: tuple[Channel[Batch], Channel[HostFeatures]],
    profiler: Profiler,
) -> list[tuple[str, Coroutine[Any, Any, Any]]]:
    """Target chain `i`: (feature read,) forward, pack and transfer, joined by channels of their own."""
    batches, hs = channels
    dev, reader = devs
    tgt, cache = training.targets[i], training.cache  # set-up's, or a stand-in's
    feats: Channel[TargetFeatures] = Channel(f"target{i}.features", 2)
    packed: Channel[PackedFeatures] = Channel(f"target{i}.packed", 2)
    # Features stay on the GPU when every replica is there and no cache wants them on
    # the host; else D2H into reused pinned buffers: enough for a full channel (in order, with
    # several chains: up to hs_min_ready more), two per replica (one taken ahead) and the one
    # being filled.
    keep = cache is None and dev.accelerated and {d.gpu for d in drafters} == {dev.gpu}
    all_gpus = dev.accelerated and all(d.accelerated for d in drafters)
    size = p.hs_queue_depth + 2 * len(training.replicas) + 2 + (p.hs_min_ready if len(training.targets) > 1 else 0)
    pool = PinnedPool(size, alloc=lambda n: dev.pinned((n,), torch.uint8)) if all_gpus and not keep else None
    tasks: list[tuple[str, Coroutine[Any, Any, Any]]] = []
    inbox: Channel[Batch] | Channel[Batch | TargetFeatures] = batches
    looks_up = cache  # where the cache is looked up: the target forward, or feature read ahead of it
    if reader is not None:  # the store (and the cache above it): read ahead, bounded by the channel
        found: Channel[Batch | TargetFeatures] = Channel(f"target{i}.read", p.read_ahead)
        dtype = tgt.embed_weight.dtype
        read = feature_read.run(reader, dev, dtype, batches, found, cache, training.store)
        tasks.append((f"{Stage.TARGET_STORE_READ}[{i}]", read))
        inbox, looks_up = found, None
    return [
        *tasks,
        (f"{Stage.TARGET_FORWARD}[{i}]", target_forward.run(tgt, dev, inbox, feats, profiler, looks_up)),
        (f"{Stage.TARGET_PACK}[{i}]", pack.run(dev, feats, packed)),
        (f"{Stage.TARGET_D2H}[{i}]", transfer.run(dev, packed, hs, profiler, i, cache, pool, keep)),
    ]
