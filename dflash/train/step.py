"""One optimizer step's math: prepare → forward → loss → backward (per replica and batch),
then the update (once per step, over every replica).

The pipeline's stages (`pipeline/stages/drafter_step.py`, `optimizer.py`) and the serial
loop call these same functions; they never touch a channel or an event loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.cuda.comm as comm  # not imported by `import torch`
import torch.nn.functional as F

from dflash.config import DrafterConfig
from dflash.model.anchors import sample_anchors, sample_seed
from dflash.model.loss import BlockTargets, LossParts, block_loss, block_targets, reveal_slots
from dflash.model.masks import BlockLayout, layer_masks
from dflash.runtime import faults
from dflash.runtime.devices import Device, host_sync, upload
from dflash.runtime.distributed import World
from dflash.runtime.messages import Batch, HostFeatures, StepGrads
from dflash.runtime.profiler import Stage
from dflash.train.hooks import Progress, StepResult
from dflash.train.replicas import DrafterReplica, TimeBudget

__all__ = ["Accumulator", "MicroStep", "Prepared", "apply_step", "compute", "prepare"]


@dataclass(frozen=True)
class Prepared:
    """A micro-batch made ready for the forward: everything that touches no weights."""

    batch: Batch
    context: torch.Tensor  # (R, T, k·H) target features, on the drafter's device
    positions: torch.Tensor  # (R, T)
    block_ids: torch.Tensor  # (R, N·B) anchor token then mask / revealed tokens
    q_pos: torch.Tensor  # (R, N·B) positions of the block slots
    masks: dict[str, Any]  # per layer type
    targets: BlockTargets  # which slots count, their labels and weights (on the device)
    negatives: torch.Tensor | None = None  # train.loss_vocab = "data": this batch's drawn negatives (device)


def prepare(
    rep: DrafterReplica,
    device: Device,
    feats: HostFeatures,
    *,
    cfg: DrafterConfig,
    seed: int,
    use_flex: bool,
    reveal_prob: float = 0.0,
    target_labels: bool = False,
    greedy_prefix_only: bool = False,
    dpace: bool = False,
) -> Prepared:
    """H2D, anchors, labels, block ids and masks of one batch (in the replica's worker
    thread). It reads no weights, so it can run while the optimizer updates them."""
    b = feats.batch
    spec = rep.model.spec
    B = spec.block_size
    dev = rep.device
    with device.span(Stage.DRAFTER_H2D):
        context = upload(feats.hidden, dev)  # (R, T, k·H)
        positions = upload(b.positions, dev)  # (R, T)
    with device.span(Stage.DRAFTER_ANCHORS):
        # Host-side: anchors, labels and which slots count are known before device work,
        # so selecting the supervised slots needs no device sync.
        anchors, valid = sample_anchors(b.loss_mask, b.doc_ids, cfg.max_anchors, seed=seed, epoch=b.epoch)
        R, N = anchors.shape
        block_ids = torch.full((R, N, B), spec.mask_token_id, dtype=torch.long)
        block_ids[:, :, 0] = torch.gather(b.input_ids, 1, anchors)  # slot 0: the anchor token
        reveal = None
        if reveal_prob > 0:  # noise schedule: some slots show their true token, no loss there
            g = torch.Generator().manual_seed(sample_seed(seed, b.index, b.epoch) ^ 0x5EED)
            reveal, true_tokens = reveal_slots(b.input_ids, b.doc_ids, anchors, valid, B, reveal_prob, g)
            block_ids = torch.where(reveal, true_tokens, block_ids)
        # D-PACE weighs slots on the device, from the forward; on the host each counts 1.
        gamma = math.inf if dpace else cfg.resolved_gamma
        targets = block_targets(b.input_ids, b.loss_mask, b.doc_ids, anchors, valid, B, gamma, reveal)
        q_pos = (torch.gather(b.positions, 1, anchors)[:, :, None] + torch.arange(B)).view(R, N * B)
    with device.span(Stage.DRAFTER_MASK):
        layout = BlockLayout(upload(anchors, dev), upload(valid, dev), upload(b.doc_ids, dev), B)
        masks = layer_masks(layout, spec, use_flex)
    ids, q = upload(block_ids.view(R, N * B), dev), upload(q_pos, dev)
    teacher = _teacher_at_labels(feats, anchors, targets.sel, B, dev)
    if target_labels:  # the target's greedy token at each slot: its top-1 at position a + k − 1
        if teacher is None:
            msg = "train.labels = 'target' needs the target's top-k next-token ids with the features"
            raise RuntimeError(msg)
        labels = teacher[1][:, 0]
    else:
        labels = upload(targets.labels, dev)
    weights = upload(targets.weights.float(), dev)
    if target_labels and greedy_prefix_only:
        # Zero weight, not dropped: which slots agree is known on the target's device only,
        # and Σ w (the step's normaliser) is counted on the host.
        weights = weights * _greedy_prefix(feats, anchors, targets.sel, B, dev)
    negatives = None
    if rep.loss_vocab is not None:  # rows of the loss's LM head; a label outside it counts 0
        labels, weights = rep.loss_vocab.labels(labels, weights)
        g = torch.Generator().manual_seed(sample_seed(seed, b.index, b.epoch) ^ 0x4E6)
        negatives = upload(rep.loss_vocab.draw(g), dev)
    targets = dataclasses.replace(
        targets, sel=upload(targets.sel, dev), labels=labels,
        weights=weights, slot=upload(targets.slot, dev), teacher=teacher,
    )  # fmt: skip
    return Prepared(b, context, positions, ids, q, masks, targets, negatives)


def _greedy_prefix(
    feats: HostFeatures, anchors: torch.Tensor, sel: torch.Tensor, B: int, dev: torch.device
) -> torch.Tensor:
    """(M,) float 1 where every data token between the anchor and a supervised slot is the
    target's greedy token (its top-1 one position earlier), else 0: slot k's target label is
    then the token greedy verification compares it with."""
    assert feats.teacher is not None  # target labels checked it
    top1 = feats.teacher[1][..., 0]  # (R, T)
    ids = feats.batch.input_ids
    R, N = anchors.shape
    T = ids.shape[1]
    pos = (anchors[:, :, None] + torch.arange(B)).clamp(max=T - 1).view(R, N * B)
    prev = (pos - 1).clamp(min=0)
    if top1.device.type == "cuda":
        pos, prev, ids, sel = (upload(t, top1.device) for t in (pos, prev, ids, sel))
    agree = (torch.gather(ids, 1, pos) == torch.gather(top1.to(ids.dtype), 1, prev)).view(R, N, B)
    agree[:, :, 0] = True  # the anchor is given
    upto = torch.cumprod(agree.to(torch.int32), dim=-1)  # all agree at slots 0..k
    before = torch.ones_like(upto)
    before[:, :, 1:] = upto[:, :, :-1]  # all agree at slots 1..k-1
    return upload(before.reshape(-1)[sel].float(), dev)


def _teacher_at_labels(
    feats: HostFeatures, anchors: torch.Tensor, sel: torch.Tensor, B: int, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The target's top-k (M, k) for each supervised slot: slot k of the block at anchor a
    predicts the token at a + k, which the target predicted at position a + k − 1."""
    if feats.teacher is None:
        return None
    vals, idx = feats.teacher
    N = anchors.shape[1]
    where = (anchors[:, :, None] + torch.arange(B) - 1).clamp(min=0).reshape(-1)[sel]  # (M,) positions
    rows = sel // (N * B)
    if vals.device.type == "cuda":  # still on the target's GPU (shared with this replica)
        rows, where = upload(rows, vals.device), upload(where, vals.device)
    return upload(vals[rows, where], dev), upload(idx[rows, where], dev)


def compute(
    rep: DrafterReplica,
    device: Device,
    p: Prepared,
    *,
    loss_chunk: int,
    distill: float = 0.0,
    distill_temperature: float = 1.0,
    dpace_alpha: float | None = None,
) -> LossParts:
    """Forward + chunked loss + backward of a prepared batch (in the replica's worker thread)."""
    B = rep.model.spec.block_size
    # bf16 autocast over fp32 master weights: always on CUDA; on a CPU when the target's
    # features are bf16 (target.dtype = "bfloat16") — fp32 weights cannot take them.
    low = rep.device.type == "cuda" or p.context.dtype == torch.bfloat16
    autocast = torch.autocast(rep.device.type, dtype=torch.bfloat16) if low else contextlib.nullcontext()
    with device.span(Stage.DRAFTER_FORWARD), autocast:
        emb = F.embedding(p.block_ids, rep.head.embed)
        # (R, N·B, H); the anchors' rows (no loss there) are not computed by the last layer
        hidden = rep.model(emb, p.context, p.q_pos, p.positions, p.masks, drafts_only=True)
        lm_head, bias = rep.head.lm_head, None
        if rep.loss_vocab is not None and p.negatives is not None:
            lm_head, bias = rep.loss_vocab.head(rep.head.lm_head, p.negatives, torch.bfloat16 if low else None)
        parts = block_loss(
            hidden, lm_head, p.targets, B, loss_chunk, distill, distill_temperature, dpace_alpha, logit_bias=bias
        )
    faults.check(Stage.DRAFTER_FORWARD)
    if faults.poison("drafter.nan"):  # drills: a non-finite loss must be skipped, not applied
        parts.loss_sum = parts.loss_sum * float("nan")
    with device.span(Stage.DRAFTER_BACKWARD):
        # Σ w·CE, unnormalised: the optimizer divides by Σ w over the whole step.
        parts.loss_sum.backward()
    parts.loss_sum = parts.loss_sum.detach()
    return parts


@dataclass(frozen=True)
class MicroStep:
    """How a replica turns one batch into gradients, in two phases: `prepare` (no weights
    touched) and `compute` (forward + backward), with their settings bound. The functions
    a subclass may replace (the orchestration benchmarks put work of known cost there)."""

    cfg: DrafterConfig
    seed: int
    loss_chunk: int
    use_flex: bool
    noise: Callable[[int], float] = lambda _step: 0.0  # reveal probability at a step
    distill: float = 0.0  # weight of the target's top-k distribution in the loss
    distill_temperature: float = 1.0
    target_labels: bool = False  # labels: the target's greedy token (train.labels = "target")
    greedy_prefix_only: bool = False  # target labels: later slots only after greedy data tokens
    dpace_alpha: float | None = None  # D-PACE position weights (train.position_weights = "dpace")

    def prepare(self, rep: DrafterReplica, device: Device, feats: HostFeatures, step: int) -> Prepared:
        return prepare(
            rep,
            device,
            feats,
            cfg=self.cfg,
            seed=self.seed,
            use_flex=self.use_flex,
            reveal_prob=self.noise(step),
            target_labels=self.target_labels,
            greedy_prefix_only=self.greedy_prefix_only,
            dpace=self.dpace_alpha is not None,
        )

    def compute(self, rep: DrafterReplica, device: Device, prepared: Prepared) -> LossParts:
        return compute(
            rep, device, prepared, loss_chunk=self.loss_chunk, distill=self.distill,
            distill_temperature=self.distill_temperature, dpace_alpha=self.dpace_alpha,
        )  # fmt: skip


class Accumulator:
    """One replica's sums over the micro-batches of a step (updated in its worker thread)."""

    def __init__(self) -> None:
        self.n = self.tokens = self.samples = 0
        self.last_batch = -1
        self.weight_sum = 0.0
        self.loss_sum: torch.Tensor | None = None
        self.correct: torch.Tensor | None = None
        self.count: torch.Tensor | None = None

    def add(self, parts: LossParts, batch: Batch) -> None:
        self.n += 1
        self.last_batch = max(self.last_batch, batch.index)
        self.tokens += batch.num_tokens
        self.samples += batch.num_samples
        self.weight_sum += parts.weight_sum
        first = self.loss_sum is None
        self.loss_sum = parts.loss_sum if first else self.loss_sum + parts.loss_sum
        self.correct = parts.correct_per_slot if first else self.correct + parts.correct_per_slot
        self.count = parts.count_per_slot if first else self.count + parts.count_per_slot

    def compute(self, micro: MicroStep, rep: DrafterReplica, device: Device, prepared: Prepared) -> None:
        """Forward + backward of a prepared batch, added to the sums."""
        self.add(micro.compute(rep, device, prepared), prepared.batch)

    def grads(self, replica: int, step: int, ready: Any) -> StepGrads:
        return StepGrads(
            replica, step, self.n, self.loss_sum, self.weight_sum, self.correct, self.count,
            self.tokens, self.samples, ready, self.last_batch,
        )  # fmt: skip


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
