"""One optimizer step's math, top to bottom: prepare → forward → loss → backward (per replica
and batch), then the update (once per step, over every replica).

Every setting of the loss comes in one `LossSpec` (dflash/model/loss.py). How the replicas'
gradients meet on one device and go back (streams, events, ranks) is `reduce.py`; the
learning-rate and noise schedules are `schedule.py`. The pipeline's stages
(`stages/drafter_step.py`, `optimizer.py`) and the serial loop call these same
functions; they never touch a channel or an event loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dflash.model.anchors import sample_anchors, sample_seed
from dflash.model.families import family_terms
from dflash.model.loss import (
    BlockTargets,
    LossParts,
    LossSpec,
    block_loss,
    block_targets,
    draft_rows,
    reveal_slots,
)
from dflash.model.masks import BlockLayout, layer_masks
from dflash.model.sequence_parallel import SeqShard, attach, split_bounds
from dflash.roofline import flops
from dflash.runtime import faults
from dflash.runtime.devices import Device, on_device, upload
from dflash.runtime.distributed import World
from dflash.runtime.messages import Batch, HostFeatures, StepGrads
from dflash.runtime.profiler import Stage
from dflash.train.hooks import Progress, StepResult
from dflash.train.reduce import StepSums, reduce_step, update_everywhere
from dflash.train.replicas import DrafterReplica
from dflash.train.schedule import TimeBudget, reveal_prob

__all__ = ["Accumulator", "MicroStep", "PreparedBatch", "apply_step", "compute", "prepare_batch"]


@dataclass(frozen=True)
class PreparedBatch:
    """A micro-batch made ready for the forward: everything that touches no weights."""

    batch: Batch
    context: torch.Tensor  # (R, T, k·H) target features, on the drafter's device
    positions: torch.Tensor  # (R, T)
    block_ids: torch.Tensor  # (R, N·B) anchor token then mask / revealed tokens
    q_pos: torch.Tensor  # (R, N·B) positions of the block slots
    masks: dict[str, Any]  # per layer type
    targets: BlockTargets  # which slots count, their labels and weights (on the device)
    negatives: torch.Tensor | None = None  # loss.vocab = "data": this batch's drawn negatives (device)
    visible: float | None = None  # flex: keys a block query sees on average (its FLOPs count those)
    shard: SeqShard | None = None  # sequence parallelism: this rank's share (context, blocks, targets)


@dataclass(frozen=True)
class MicroStep:
    """How a replica turns one batch into gradients, in two phases: `prepare` (no weights
    touched) and `compute` (forward + loss + backward), with their settings bound. The
    functions a subclass may replace (the orchestration benchmarks put work of known cost
    there)."""

    loss: LossSpec
    seed: int = 0  # anchors, revealed slots and negatives are drawn from (seed, batch, epoch)
    max_anchors: int = 512  # blocks per document per step (drafter.max_anchors)
    use_flex: bool = False  # flex attention's BlockMask, else a dense boolean mask ...
    grouped: bool = False  # ... or a GroupedMask (drafter.attention = "grouped": memory linear in the row)
    grouped_above: int = 0  # > 0: a GroupedMask for a batch whose dense mask would exceed this many entries
    total_steps: int = 1  # the run's planned steps: the noise schedule spans them

    def prepare(self, rep: DrafterReplica, device: Device, feats: HostFeatures, step: int) -> PreparedBatch:
        return prepare_batch(rep, device, feats, self, step)

    def compute(self, rep: DrafterReplica, device: Device, batch: PreparedBatch) -> LossParts:
        return compute(rep, device, batch, self.loss)


# -- prepare ---------------------------------------------------------------------------------


def prepare_batch(
    rep: DrafterReplica, device: Device, feats: HostFeatures, micro: MicroStep, step: int
) -> PreparedBatch:
    """H2D, anchors, labels, block ids and masks of one batch (in the replica's worker
    thread). It reads no weights, so it can run while the optimizer updates them."""
    b, spec, dev = feats.batch, rep.model.spec, rep.device
    B = spec.block_size
    with device.span(Stage.DRAFTER_ANCHORS):
        # Host-side: anchors, labels and which slots count are known before device work,
        # so selecting the supervised slots needs no device sync.
        blocks = _blocks(b, micro, spec.mask_token_id, B, reveal_prob(micro.loss, step, micro.total_steps))
    shard, hidden, pos = None, feats.hidden, b.positions
    if rep.seq_group is not None:  # this rank's share of the context and of the blocks
        n = rep.seq_group.size
        shard = SeqShard(rep.seq_group, rep.seq_rank, split_bounds(pos.shape[1], n),
                         split_bounds(blocks.anchors.shape[1], n))  # fmt: skip
        hidden, pos = hidden[:, slice(*shard.ctx)], pos[:, slice(*shard.ctx)]
    with device.span(Stage.DRAFTER_H2D):
        context = upload(hidden, dev)  # (R, T, k·H)
        positions = upload(pos, dev)  # (R, T)
    with device.span(Stage.DRAFTER_MASK):
        layout = BlockLayout(upload(blocks.anchors, dev), upload(blocks.valid, dev), upload(b.doc_ids, dev), B)
        R, T, Q = b.input_ids.shape[0], b.input_ids.shape[1], blocks.ids.shape[1]
        long = 0 < micro.grouped_above < R * Q * (T + Q)
        host = (blocks.anchors, blocks.valid, b.doc_ids) if micro.grouped or long else None
        masks = layer_masks(layout, spec, micro.use_flex, host)  # the whole row's, with sequence parallelism too
    if shard is not None:
        blocks = _shard_blocks(blocks, *shard.blocks, B)
    ids, q = upload(blocks.ids, dev), upload(blocks.q_pos, dev)
    targets, negatives = _device_targets(rep, feats, blocks, micro)
    visible = None
    if micro.use_flex:  # a block query sees the context before its anchor and its block
        visible = float(blocks.anchors.float().mean()) + B  # no-sync: a host tensor
    elif host is not None:  # grouped: the keys each group's queries score (its slice and its blocks)
        groups = next(iter(masks.values())).groups
        visible = sum((q1 - q0) * (c1 - c0 + q1 - q0) for _, q0, q1, c0, c1 in groups) / max(1, R * Q)
    return PreparedBatch(b, context, positions, ids, q, masks, targets, negatives, visible, shard)


@dataclass(frozen=True)
class _Blocks:
    """One batch's blocks, laid out on the host."""

    anchors: torch.Tensor  # (R, N) anchor positions
    valid: torch.Tensor  # (R, N) bool
    ids: torch.Tensor  # (R, N·B) anchor token, then mask / revealed tokens
    q_pos: torch.Tensor  # (R, N·B) positions of the block slots
    targets: BlockTargets  # on the host


def _blocks(b: Batch, micro: MicroStep, mask_id: int, B: int, reveal: float) -> _Blocks:
    """Anchors, what each block slot shows, and which slots count with what label and weight."""
    anchors, valid = sample_anchors(b.loss_mask, b.doc_ids, micro.max_anchors, seed=micro.seed, epoch=b.epoch)
    R, N = anchors.shape
    block_ids = torch.full((R, N, B), mask_id, dtype=torch.long)
    block_ids[:, :, 0] = torch.gather(b.input_ids, 1, anchors)  # slot 0: the anchor token
    shown = None
    if reveal > 0:  # noise schedule: some slots show their true token, no loss there
        g = torch.Generator().manual_seed(sample_seed(micro.seed, b.index, b.epoch) ^ 0x5EED)
        shown, true_tokens = reveal_slots(b.input_ids, b.doc_ids, anchors, valid, B, reveal, g)
        block_ids = torch.where(shown, true_tokens, block_ids)
    # D-PACE weighs slots on the device, from the forward; on the host each counts 1.
    gamma = math.inf if micro.loss.dpace else micro.loss.gamma
    targets = block_targets(b.input_ids, b.loss_mask, b.doc_ids, anchors, valid, B, gamma, shown, micro.loss.shift)
    q_pos = (torch.gather(b.positions, 1, anchors)[:, :, None] + torch.arange(B)).view(R, N * B)
    return _Blocks(anchors, valid, block_ids.view(R, N * B), q_pos, targets)


def _shard_blocks(blocks: _Blocks, lo: int, hi: int, B: int) -> _Blocks:
    """The blocks [lo, hi) of every row, their supervised slots re-indexed into them."""
    R, N = blocks.anchors.shape
    n, t = hi - lo, blocks.targets
    within = t.sel % (N * B)
    keep = (within >= lo * B) & (within < hi * B)
    sel = ((t.sel // (N * B)) * (n * B) + within - lo * B)[keep]
    weights, slot = t.weights[keep], t.slot[keep]
    targets = dataclasses.replace(
        t, sel=sel, labels=t.labels[keep], weights=weights, slot=slot,
        weight_sum=float(weights.sum()),  # no-sync: host tensors
        count_per_slot=torch.bincount(slot, minlength=B), prev=None if t.prev is None else t.prev[keep],
    )  # fmt: skip
    part = lambda x: x.view(R, N, B)[:, lo:hi].reshape(R, n * B)  # noqa: E731
    return _Blocks(blocks.anchors[:, lo:hi], blocks.valid[:, lo:hi], part(blocks.ids), part(blocks.q_pos), targets)


def _device_targets(
    rep: DrafterReplica, feats: HostFeatures, blocks: _Blocks, micro: MicroStep
) -> tuple[BlockTargets, torch.Tensor | None]:
    """The supervised slots' labels (the data's, or the target's greedy tokens) and weights
    on the replica's device, with the target's top-k for distillation; with `loss.vocab =
    "data"`, as rows of the loss's head, and this batch's drawn negatives."""
    spec, dev, B, host = micro.loss, rep.device, rep.model.spec.block_size, blocks.targets
    teacher = _teacher_at_labels(feats, blocks.anchors, host.sel, B, dev, micro.loss.shift)
    if spec.target_labels:  # the target's greedy token at each slot: its top-1 at position a + k − 1
        if teacher is None:
            msg = "loss.labels = 'target' needs the target's top-k next-token ids with the features"
            raise RuntimeError(msg)
        labels = teacher[1][:, 0]
    else:
        labels = upload(host.labels, dev)
    weights = upload(host.weights.float(), dev)
    if spec.target_labels and spec.greedy_prefix_only:
        # Zero weight, not dropped: which slots agree is known on the target's device only,
        # and Σ w (the step's normaliser) is counted on the host.
        weights = weights * _greedy_prefix(feats, blocks.anchors, host.sel, B, dev, micro.loss.shift)
    negatives = None
    if rep.loss_vocab is not None:  # rows of the loss's LM head; a label outside it counts 0
        labels, weights = rep.loss_vocab.labels(labels, weights)
        b = feats.batch
        g = torch.Generator().manual_seed(sample_seed(micro.seed, b.index, b.epoch) ^ 0x4E6)
        negatives = upload(rep.loss_vocab.draw(g), dev)
    if rep.draft_index is not None:  # a draft vocabulary: labels and the teacher's top-k as its rows
        labels, weights, teacher = draft_rows(rep.draft_index, labels, weights, teacher)
    prev = None if host.prev is None else upload(host.prev, dev)
    targets = dataclasses.replace(
        host, sel=upload(host.sel, dev), labels=labels,
        weights=weights, slot=upload(host.slot, dev), teacher=teacher, prev=prev,
    )  # fmt: skip
    return targets, negatives


def _greedy_prefix(
    feats: HostFeatures, anchors: torch.Tensor, sel: torch.Tensor, B: int, dev: torch.device, shift: int = 0
) -> torch.Tensor:
    """(M,) float 1 where every data token between the anchor and a supervised slot is the
    target's greedy token (its top-1 one position earlier), else 0: slot k's target label is
    then the token greedy verification compares it with."""
    assert feats.teacher is not None  # target labels checked it
    top1 = feats.teacher[1][..., 0]  # (R, T)
    ids = feats.batch.input_ids
    R, N = anchors.shape
    T = ids.shape[1]
    pos = (anchors[:, :, None] + torch.arange(B) + shift).clamp(max=T - 1).view(R, N * B)
    prev = (pos - 1).clamp(min=0)
    if on_device(top1):
        pos, prev, ids, sel = (upload(t, top1.device) for t in (pos, prev, ids, sel))
    agree = (torch.gather(ids, 1, pos) == torch.gather(top1.to(ids.dtype), 1, prev)).view(R, N, B)
    if shift == 0:
        agree[:, :, 0] = True  # the anchor is given
    upto = torch.cumprod(agree.to(torch.int32), dim=-1)  # all agree at slots 0..k
    before = torch.ones_like(upto)
    before[:, :, 1:] = upto[:, :, :-1]  # all agree at slots 1..k-1
    return upload(before.reshape(-1)[sel].float(), dev)


def _teacher_at_labels(
    feats: HostFeatures, anchors: torch.Tensor, sel: torch.Tensor, B: int, dev: torch.device, shift: int = 0
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The target's top-k (M, k) for each supervised slot: slot k of the block at anchor a
    predicts the token at a + k (+ shift), which the target predicted one position earlier."""
    if feats.teacher is None:
        return None
    vals, idx = feats.teacher
    N = anchors.shape[1]
    where = (anchors[:, :, None] + torch.arange(B) + shift - 1).clamp(min=0).reshape(-1)[sel]  # (M,) positions
    rows = sel // (N * B)
    if on_device(vals):  # still on the target's GPU (shared with this replica)
        rows, where = upload(rows, vals.device), upload(where, vals.device)
    return upload(vals[rows, where], dev), upload(idx[rows, where], dev)


# -- forward → loss → backward ----------------------------------------------------------------


def _forward(rep: DrafterReplica, batch: PreparedBatch) -> torch.Tensor:
    """(R, N·B, H): the drafter's output at the block slots; the anchors' rows (no loss
    there) are not computed by the last layer."""
    emb = F.embedding(batch.block_ids, rep.head.embed)
    return rep.model(emb, batch.context, batch.q_pos, batch.positions, batch.masks, drafts_only=True, sp=batch.shard)


def _loss(
    rep: DrafterReplica, batch: PreparedBatch, hidden: torch.Tensor, spec: LossSpec, dtype: torch.dtype | None
) -> LossParts:
    """The chunked block loss over the full LM head, or (`loss.vocab = "data"`) the data's
    rows and this batch's negatives, in `dtype` (that of autocast's matmul; None: the head's)."""
    lm_head, bias, cols = rep.head.lm_head, None, None
    terms = family_terms(rep.model, spec)
    if rep.loss_vocab is not None and batch.negatives is not None:
        lm_head, bias = rep.loss_vocab.head(rep.head.lm_head, batch.negatives, dtype)
        cols = rep.loss_vocab.cols(batch.negatives) if terms is not None else None
    return block_loss(hidden, lm_head, batch.targets, spec, logit_bias=bias, terms=terms, cols=cols)


def compute(rep: DrafterReplica, device: Device, batch: PreparedBatch, spec: LossSpec) -> LossParts:
    """Forward + chunked loss + backward of a prepared batch (in the replica's worker thread)."""
    # bf16 autocast over fp32 master weights: always on CUDA; on a CPU when the target's
    # features are bf16 (target.dtype = "bfloat16") — fp32 weights cannot take them.
    low = rep.device.type == "cuda" or batch.context.dtype == torch.bfloat16
    autocast = torch.autocast(rep.device.type, dtype=torch.bfloat16) if low else contextlib.nullcontext()
    with device.span(Stage.DRAFTER_FORWARD), autocast:
        hidden = _forward(rep, batch)
        parts = _loss(rep, batch, hidden, spec, torch.bfloat16 if low else None)
        if batch.shard is not None:  # every rank runs every exchange of the backward, with or without loss slots
            parts.loss_sum = attach(parts.loss_sum, hidden)
    faults.check(Stage.DRAFTER_FORWARD)
    if faults.poison("drafter.nan"):  # drills: a non-finite loss must be skipped, not applied
        parts.loss_sum = parts.loss_sum * float("nan")
    with device.span(Stage.DRAFTER_BACKWARD):
        # Σ w·CE, unnormalised: the optimizer divides by Σ w over the whole step.
        parts.loss_sum.backward()
    if device.profiler is not None:
        work = flops.of_prepared(rep, batch, spec.chunk)
        device.flops(Stage.DRAFTER_FORWARD, work.forward, rep.device)
        device.flops(Stage.DRAFTER_BACKWARD, work.backward, rep.device)
    parts.loss_sum = parts.loss_sum.detach()
    return parts


class Accumulator:
    """One replica's sums over the micro-batches of a step (updated in its worker thread)."""

    def __init__(self, counts: bool = True) -> None:
        self.counts = counts  # counts the batches' tokens and samples (a sequence-parallel group's first rank)
        self.n = self.tokens = self.samples = 0
        self.last_batch = -1
        self.batches: list[int] = []
        self.weight_sum = 0.0
        self.loss_sum: torch.Tensor | None = None
        self.part_sums: torch.Tensor | None = None
        self.correct: torch.Tensor | None = None
        self.count: torch.Tensor | None = None

    def add(self, parts: LossParts, batch: Batch) -> None:
        self.n += 1
        self.last_batch = max(self.last_batch, batch.index)
        self.batches.append(batch.index)
        if self.counts:
            self.tokens += batch.num_tokens
            self.samples += batch.num_samples
        self.weight_sum += parts.weight_sum
        first = self.loss_sum is None
        self.loss_sum = parts.loss_sum if first else self.loss_sum + parts.loss_sum
        if parts.part_sums is not None:
            self.part_sums = parts.part_sums if self.part_sums is None else self.part_sums + parts.part_sums
        self.correct = parts.correct_per_slot if first else self.correct + parts.correct_per_slot
        self.count = parts.count_per_slot if first else self.count + parts.count_per_slot

    def compute(self, micro: MicroStep, rep: DrafterReplica, device: Device, batch: PreparedBatch) -> None:
        """Forward + backward of a prepared batch, added to the sums."""
        self.add(micro.compute(rep, device, batch), batch.batch)

    def grads(self, replica: int, step: int, ready: Any) -> StepGrads:
        return StepGrads(
            replica, step, self.n, self.loss_sum, self.weight_sum, self.correct, self.count,
            self.tokens, self.samples, ready, self.last_batch, tuple(self.batches), self.part_sums,
        )  # fmt: skip


# -- update ------------------------------------------------------------------------------------


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
    sums = reduce_step(device, replicas, contribs, world, step)
    scale = sums.scale()
    torch._foreach_mul_(sums.grads, scale)  # the fused multi-tensor kernel clip_grad_norm_ uses too
    with device.span(Stage.GRAD_NORM_SYNC):
        norm, finite, weight = _finite_then_clip(sums, grad_clip, replicas[0].device)
    lr = replicas[0].optimizer.param_groups[0]["lr"]
    updated: dict[int, Any] = {}
    if finite:
        with device.span(Stage.OPTIMIZER_STEP):
            progress.updating = True  # from here until StepBook.end, weights and AdamW state may disagree
            updated = update_everywhere(device, replicas, sums.grads, _update)
        for r in replicas:
            device.flops(Stage.OPTIMIZER_STEP, flops.optimizer(r.num_params), r.device)
    else:  # neither the weights nor the optimizer state are touched
        for r in replicas:
            r.optimizer.zero_grad(set_to_none=True)
    if world is not None:  # in order on every rank: the world's highest index
        progress.finish(step, world.cursor)
    else:  # in any order: every index the step consumed
        progress.finish(step, -1, [i for c in contribs for i in c.batches])
    return StepResult(
        step=step,
        loss=sums.loss * scale,  # float32 × float32 scale, as with one process
        parts=None if sums.parts is None else sums.parts * scale,
        grad_norm=norm,
        lr=lr,
        correct=sums.correct,
        count=sums.count,  # type: ignore[arg-type]  # with ranks: set by `StepSums.read` (the sync)
        tokens=sum(c.tokens for c in contribs),
        samples=sum(c.samples for c in contribs),
        weight_sum=weight,
        skipped=not finite,
        updated=updated,
    )


def _finite_then_clip(sums: StepSums, grad_clip: float, dev0: torch.device) -> tuple[torch.Tensor, bool, float]:
    """The global grad norm, whether the step is finite, and its Σ w on the host; the
    gradients clipped to `grad_clip` (0: not clipped) when finite."""
    norm = torch.nn.utils.get_total_norm(sums.grads, foreach=dev0.type == "cuda")
    # The one host sync per step, on purpose: a NaN/Inf step must touch neither the
    # weights nor the optimizer state, and only the host can decide to skip it.
    finite, weight = sums.read(torch.isfinite(norm) & torch.isfinite(sums.loss))
    if grad_clip > 0 and finite:
        coef = (grad_clip / (norm + 1e-6)).clamp(max=1.0)  # stays a tensor: no sync
        torch._foreach_mul_(sums.grads, coef)
    return norm, finite, weight


def _update(r: DrafterReplica, grads: list[torch.Tensor]) -> None:
    """AdamW and the LR schedule of one replica, from its copy of the step's gradient."""
    for p, g in zip(r.params, grads, strict=True):
        p.grad = g
    r.optimizer.step()
    r.scheduler.step()
    r.optimizer.zero_grad(set_to_none=True)
