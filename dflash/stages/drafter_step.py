"""drafter step: one replica's forward and backward over hidden-state batches.

Per optimizer step a replica takes `grad_accum` batches from the hidden-state channel
(waiting there is `drafter.queue_wait`: starved by the targets), runs H2D, anchors,
mask, forward + loss, backward for each (gradients accumulate in .grad), sends its
StepGrads to the optimizer, and waits for the optimizer's reply (`drafter.step_wait`)
before touching its weights again. It ends when the optimizer says stop or the channel
ends (it then sends a last StepGrads with 0 micro-batches).
"""

from __future__ import annotations

import contextlib
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
from dflash.model.loss import LossParts, block_loss, block_targets, reveal_slots
from dflash.model.masks import BlockLayout, layer_masks
from dflash.profile import Profiler, Stage
from dflash.records import Batch, HostFeatures, StepGrads, StepReply
from dflash.replica import DrafterReplica
from dflash.stages._link import linked

__all__ = ["Accumulator", "MicroStep", "micro_step", "run"]


def micro_step(
    rep: DrafterReplica,
    device: Device,
    feats: HostFeatures,
    *,
    cfg: DrafterConfig,
    seed: int,
    loss_chunk: int,
    use_flex: bool,
    reveal_prob: float = 0.0,
) -> LossParts:
    """Forward + backward of one batch on replica `rep` (runs in its worker thread)."""
    b = feats.batch
    spec = rep.model.spec
    B = spec.block_size
    dev = rep.device
    cuda = dev.type == "cuda"
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
        targets = block_targets(b.input_ids, b.loss_mask, b.doc_ids, anchors, valid, B, cfg.resolved_gamma, reveal)
        q_pos = (torch.gather(b.positions, 1, anchors)[:, :, None] + torch.arange(B)).view(R, N * B)
    with device.span(Stage.DRAFTER_MASK):
        layout = BlockLayout(upload(anchors, dev), upload(valid, dev), upload(b.doc_ids, dev), B)
        masks = layer_masks(layout, spec, use_flex)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    with device.span(Stage.DRAFTER_FORWARD), autocast:
        emb = F.embedding(upload(block_ids.view(R, N * B), dev), rep.head.embed)
        hidden = rep.model(emb, context, upload(q_pos, dev), positions, masks)
        parts = block_loss(hidden, rep.head.lm_head, targets, B, loss_chunk)  # (R, N·B, H) in
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
    """How a replica turns one batch into gradients: `micro_step` with its settings bound.
    `fn` is the compute (the orchestration benchmarks put work of known cost there)."""

    cfg: DrafterConfig
    seed: int
    loss_chunk: int
    use_flex: bool
    noise: Callable[[int], float] = lambda _step: 0.0  # reveal probability at a step
    fn: Callable[..., LossParts] = micro_step

    def __call__(self, rep: DrafterReplica, device: Device, feats: HostFeatures, step: int) -> LossParts:
        return self.fn(
            rep, device, feats, cfg=self.cfg, seed=self.seed, loss_chunk=self.loss_chunk,
            use_flex=self.use_flex, reveal_prob=self.noise(step),
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

    def step(self, micro: MicroStep, rep: DrafterReplica, device: Device, feats: HostFeatures, step: int) -> None:
        """Forward + backward of one batch, added to the sums (in the replica's worker thread)."""
        self.add(micro(rep, device, feats, step), feats.batch)

    def grads(self, replica: int, step: int, ready: Any) -> StepGrads:
        return StepGrads(
            replica, step, self.n, self.loss_sum, self.weight_sum, self.correct, self.count,
            self.tokens, self.samples, ready, self.last_batch,
        )  # fmt: skip


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
) -> None:
    step = start_step
    wait_for: list[Any] = []  # CUDA: the last update must land before the next forward
    with linked([inbox, replies], [outbox]):
        while True:
            acc = Accumulator()
            ready = None
            for _ in range(grad_accum):
                try:
                    feats, waited = await inbox.get()
                except EndOfStream:
                    break
                profiler.record(Stage.DRAFTER_QUEUE_WAIT, waited, worker=device.name)
                _, ready = await device.run(None, acc.step, micro, rep, device, feats, step, wait_for=wait_for)
                profiler.count("drafter_tokens", feats.batch.num_tokens)
            await outbox.put(acc.grads(rep.index, step, ready))
            if acc.n == 0:
                return
            try:
                reply, waited = await replies.get()
            except EndOfStream:
                return
            profiler.record(Stage.DRAFTER_STEP_WAIT, waited, worker=device.name)
            if reply.stop:
                return
            wait_for = [reply.ready]
            step = reply.step
