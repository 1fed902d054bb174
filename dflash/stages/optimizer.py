"""optimizer: the fan-in of all drafter replicas, one optimizer step at a time.

Waits for: one StepGrads from every active replica. Then, in its worker thread: sums the
replicas' gradients in a fixed order on the first replica's device and divides by the
step's total loss weight (Σ w over all micro-batches and replicas), clips the global norm
(the clip factor stays a tensor), copies the same gradient into every replica and steps
every replica's optimizer and schedule — so replicas stay identical. One host sync per
step, named `drafter.grad_norm_sync`: a non-finite loss or gradient skips the step (no
weight or optimizer state touched), and `train.max_bad_steps` in a row abort the run.
Unblocks: every replica (a StepReply: go on, or stop). Metrics stay device tensors and
are synced once every `log_every` steps (`metrics.sync`). With `eval.every_steps`, a
speculative-decoding eval of replica 0 runs between steps (`eval.speculative`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dflash import faults
from dflash.channel import Channel, EndOfStream
from dflash.checkpoint import Checkpointer
from dflash.devices import Device
from dflash.profile import Profiler, Stage
from dflash.records import StepGrads, StepReply
from dflash.replica import DrafterReplica
from dflash.stages._link import linked

__all__ = ["StepResult", "apply_step", "run", "to_records"]


@dataclass
class StepResult:
    step: int
    loss: torch.Tensor  # () device
    grad_norm: torch.Tensor  # () device
    lr: float
    correct: torch.Tensor  # (B,) device
    count: torch.Tensor  # (B,) host
    tokens: int
    samples: int
    weight_sum: float
    skipped: bool = False  # non-finite loss or gradient: nothing was updated


def apply_step(
    replicas: list[DrafterReplica], contribs: list[StepGrads], device: Device, grad_clip: float, step: int
) -> StepResult:
    faults.check(Stage.OPTIMIZER_STEP)
    dev0 = replicas[0].device
    weight = sum(c.weight_sum for c in contribs)
    scale = 1.0 / max(weight, 1e-12)
    with device.span(Stage.GRAD_REDUCE):
        grads: list[torch.Tensor] = []
        by_replica = {c.replica for c in contribs}
        for i, p in enumerate(replicas[0].params):
            total = torch.zeros_like(p, device=dev0)
            for r in replicas:  # fixed order: same sum on every run
                if r.index in by_replica:
                    g = r.params[i].grad
                    if g is not None:
                        total.add_(g.to(dev0, non_blocking=True))
            grads.append(total.mul_(scale))
    loss = sum((c.loss_sum.to(dev0) for c in contribs if c.loss_sum is not None), torch.zeros((), device=dev0))
    with device.span(Stage.GRAD_NORM_SYNC):
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        # The one host sync per step, on purpose: a NaN/Inf step must touch neither the
        # weights nor the optimizer state, and only the host can decide to skip it.
        finite = bool(torch.isfinite(norm) & torch.isfinite(loss))
        if grad_clip > 0 and finite:
            coef = (grad_clip / (norm + 1e-6)).clamp(max=1.0)
            for g in grads:
                g.mul_(coef)
    if not finite:
        for r in replicas:
            r.optimizer.zero_grad(set_to_none=True)
    with device.span(Stage.OPTIMIZER_STEP) if finite else contextlib.nullcontext():
        lr = replicas[0].optimizer.param_groups[0]["lr"]
        for r in replicas if finite else []:
            for p, g in zip(r.params, grads, strict=True):
                p.grad = g.to(r.device, copy=r.index != 0)
            r.optimizer.step()
            r.scheduler.step()
            r.optimizer.zero_grad(set_to_none=True)
    correct = sum(c.correct_per_slot.to(dev0) for c in contribs if c.correct_per_slot is not None)
    count = sum(c.count_per_slot for c in contribs if c.count_per_slot is not None)
    return StepResult(
        step=step,
        loss=loss * scale,
        grad_norm=norm,
        lr=lr,
        correct=correct,
        count=count,
        tokens=sum(c.tokens for c in contribs),
        samples=sum(c.samples for c in contribs),
        weight_sum=weight,
        skipped=not finite,
    )


def to_records(results: list[StepResult]) -> list[dict[str, Any]]:
    """One host sync for a batch of steps: every metric comes over together. Non-finite
    values become null (JSON has no NaN; `jq` must always parse the log)."""
    if not results:
        return []
    packed = torch.stack(
        [torch.cat([r.loss.float()[None], r.grad_norm.float()[None], r.correct.float()]) for r in results]
    ).cpu()  # sync point: once per log interval
    out = []
    for r, row in zip(results, packed.tolist(), strict=True):
        loss, gnorm, correct = row[0], row[1], row[2:]
        count = r.count.tolist()
        acc = [c / n if n else 0.0 for c, n in zip(correct[1:], count[1:], strict=True)]
        tau, run = 1.0, 1.0
        for a in acc:
            run *= a
            tau += run
        out.append(
            {
                "step": r.step,
                "loss": round(loss, 6) if math.isfinite(loss) else None,
                "lr": r.lr,
                "grad_norm": round(gnorm, 6) if math.isfinite(gnorm) else None,
                "skipped": r.skipped,
                "tokens": r.tokens,
                "samples": r.samples,
                "acc": [round(a, 4) for a in acc],
                "tau_sim": round(tau, 4),
            }
        )
    return out


async def run(
    replicas: list[DrafterReplica],
    device: Device,
    inbox: Channel[StepGrads],
    replies: list[Channel[StepReply]],
    profiler: Profiler,
    emit_steps: Callable[[list[dict[str, Any]]], None],
    stop: asyncio.Event,
    *,
    grad_clip: float,
    max_steps: int | None,
    log_every: int,
    eval_every: int = 0,
    evaluate: Callable[[int], dict[str, Any]] | None = None,
    emit_eval: Callable[[dict[str, Any]], None] | None = None,
    checkpointer: Checkpointer | None = None,
    checkpoint_every: int = 0,
    checkpoint_at_end: bool = False,
    start_step: int = 0,
    max_bad_steps: int = 5,
    emit_bad: Callable[[dict[str, Any]], None] | None = None,
    apply_fn: Callable[..., StepResult] = apply_step,  # synthetic benchmarks swap the compute
) -> int:
    """Returns the number of optimizer steps taken."""
    active = set(range(len(replicas)))
    pending: list[StepResult] = []
    ready = None
    step = start_step
    last_batch = -1
    bad = 0  # consecutive skipped steps

    async def save() -> None:
        assert checkpointer is not None
        snap, _ = await device.run(Stage.CHECKPOINT, checkpointer.take, step, last_batch, wait_for=[ready])
        await checkpointer.write(snap)

    async def flush() -> None:
        records, _ = await device.run(Stage.METRICS_SYNC, to_records, list(pending), wait_for=[ready])
        pending.clear()
        emit_steps(records)

    with linked([inbox], replies):
        while active:
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
            if contribs:
                step += 1
                result, ready = await device.run(
                    None, apply_fn, replicas, contribs, device, grad_clip, step,
                    wait_for=[c.ready for c in contribs],
                )  # fmt: skip
                pending.append(result)
                last_batch = max(last_batch, *(c.last_batch for c in contribs))
                if checkpointer is not None:
                    checkpointer.mark(step, last_batch)
                if result.skipped:
                    bad += 1
                    if emit_bad is not None:
                        emit_bad({"step": step, "consecutive": bad})
                    if bad >= max_bad_steps:
                        msg = (
                            f"{bad} optimizer steps in a row had a non-finite loss or gradient "
                            f"(train.max_bad_steps = {max_bad_steps}); lower train.lr or check the data"
                        )
                        raise FloatingPointError(msg)
                else:
                    bad = 0
                profiler.count("steps", 1)
                profiler.count("samples", result.samples)
                if step == 2:
                    profiler.mark_warm()
                if len(pending) >= log_every:
                    await flush()
                if evaluate is not None and eval_every and step % eval_every == 0:
                    # Replicas wait for this step's reply meanwhile: their weights are read.
                    record, _ = await device.run(Stage.EVAL, evaluate, step, wait_for=[ready])
                    if emit_eval is not None:
                        emit_eval(record)
                if checkpointer is not None and checkpoint_every and step % checkpoint_every == 0:
                    await save()
            stop_now = stop.is_set() or (max_steps is not None and step >= max_steps)
            active -= finished
            for r in sorted(active):
                await replies[r].put(StepReply(step, stop_now, ready))
            if stop_now or not contribs:
                break
        if pending:
            await flush()
        if checkpointer is not None:
            if checkpoint_at_end and step > start_step and checkpointer.last_step != step:
                await save()
            await checkpointer.finish()
    return step
