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
import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dflash import faults
from dflash.channel import Channel, EndOfStream
from dflash.config import DrafterConfig
from dflash.devices import Device, upload
from dflash.model.anchors import sample_anchors, sample_seed
from dflash.model.loss import BlockTargets, LossParts, block_loss, block_targets, reveal_slots
from dflash.model.masks import BlockLayout, layer_masks
from dflash.profile import Profiler, Stage
from dflash.records import Batch, HostFeatures, StepGrads, StepReply
from dflash.replica import DrafterReplica
from dflash.stages._link import linked

__all__ = ["Accumulator", "MicroStep", "Prepared", "compute", "prepare", "prepared", "run"]


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
    are slots: the orchestration benchmarks put work of known cost there."""

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
    prepare_fn: Callable[..., Any] = prepare
    compute_fn: Callable[..., LossParts] = compute

    def prepare(self, rep: DrafterReplica, device: Device, feats: HostFeatures, step: int) -> Prepared:
        return self.prepare_fn(
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
        return self.compute_fn(
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


async def _take(
    rep: DrafterReplica,
    micro: MicroStep,
    device: Device,
    inbox: Channel[HostFeatures],
    profiler: Profiler,
    step: int,
    early: bool = False,
) -> tuple[Prepared | None, float]:
    """The next batch, prepared (None at the end of the stream), and when it arrived.
    `early`: taken while the optimizer steps (its wait is counted after the reply)."""
    try:
        feats, waited = await inbox.get()
    except EndOfStream:
        return None, time.perf_counter()
    arrived = time.perf_counter()
    if not early:  # waited for in the step itself: starved by the targets
        profiler.record(Stage.DRAFTER_QUEUE_WAIT, waited, worker=device.name)
    return await prepared(rep, micro, device, feats, step), arrived


async def prepared(rep: DrafterReplica, micro: MicroStep, device: Device, feats: HostFeatures, step: int) -> Prepared:
    """The prepare phase of one batch: after the features' event when they are still on the
    target's GPU (and holding their memory for this stream); a pooled pinned buffer goes
    back to its pool with the event after its upload."""
    on_device = [t for t in (feats.hidden, *(feats.teacher or ())) if t.device.type == "cuda"]
    out, ready = await device.run(None, micro.prepare, rep, device, feats, step, wait_for=[feats.ready], uses=on_device)
    if feats.release is not None:  # (after a failure it stays out: the pool makes another)
        feats.release(ready)
    return out


async def run(
    rep: DrafterReplica,
    micro: MicroStep,
    grad_accum: int,
    device: Device,
    inbox: Channel[HostFeatures],
    outbox: Channel[StepGrads],
    replies: Channel[StepReply],
    profiler: Profiler,
    start_step: int = 0,
    lookahead: bool = False,
) -> None:
    """`lookahead`: take and prepare the next batch while the optimizer steps. Only for a
    single replica: with several, a batch taken ahead by a fast replica would fall behind
    the ones a slower replica still takes for the same step, and the step's data cursor
    (its highest batch index) would pass over it."""
    step = start_step
    wait_for: list[Any] = []  # CUDA: the last update must land before the next forward
    ahead: asyncio.Task[tuple[Prepared | None, float]] | None = None
    take = functools.partial(_take, rep, micro, device, inbox, profiler)

    with linked([inbox, replies], [outbox]):
        try:
            while True:
                acc = Accumulator()
                ready = None
                for _ in range(grad_accum):
                    prepared, _ = await (ahead if ahead is not None else take(step))
                    ahead = None
                    if prepared is None:
                        break
                    _, ready = await device.run(None, acc.compute, micro, rep, device, prepared, wait_for=wait_for)
                    profiler.count("drafter_tokens", prepared.batch.num_tokens)
                await outbox.put(acc.grads(rep.index, step, ready))
                if acc.n == 0:
                    return
                if lookahead:  # prepared while the optimizer steps: after the reply, only the forward is left
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
