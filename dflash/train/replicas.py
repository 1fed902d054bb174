"""A drafter replica: its module, the frozen embedding / LM head on its device, and its
optimizer and schedule. Replicas start identical and receive identical updates.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dflash.config import TrainConfig
from dflash.model.drafter import DFlashDrafter, DrafterSpec, FrozenHead
from dflash.model.loss import LossVocab

__all__ = ["DrafterReplica", "TimeBudget", "build_replicas", "lr_lambda"]


class TimeBudget:
    """`train.max_minutes`: the share of a training time budget spent, counted from `start()`
    (the first step's start, after setup) in this process. The clock is read once per step
    (`tick`, at the start of the update), so that every replica's schedule, and the stop
    check after the step, see the same reading."""

    _now = staticmethod(time.monotonic)  # tests bring their own clock

    def __init__(self, minutes: float) -> None:
        self.seconds = 60.0 * minutes
        self._t0: float | None = None
        self._frac = 0.0

    def start(self) -> None:
        if self._t0 is None:
            self._t0 = self._now()

    def tick(self) -> float:
        if self._t0 is not None:
            self._frac = min(1.0, (self._now() - self._t0) / self.seconds)
        return self._frac

    def fraction(self) -> float:
        """The share spent at the last `tick`."""
        return self._frac

    @property
    def spent(self) -> bool:
        return self._frac >= 1.0


def lr_lambda(
    total_steps: int,
    warmup_ratio: float,
    min_ratio: float,
    schedule: str = "cosine",
    decay_ratio: float = 0.2,
    clock: Callable[[], float] | None = None,
):
    """LR factor after `step` optimizer steps: linear warmup, then `cosine` decay to
    `min_ratio` over the rest, or `wsd` (warmup-stable-decay): constant, then a linear decay to
    `min_ratio` over the last `decay_ratio` of the steps. With a `clock` (the share of a time
    budget spent, 0..1) the schedule is at whichever is further along, the steps or the time:
    a run cut by its budget still ends decayed."""
    warmup = max(1, round(total_steps * warmup_ratio)) if warmup_ratio > 0 else 0
    decay = max(1, round(total_steps * decay_ratio))

    def f(step: float) -> float:  # step = number of optimizer steps already taken
        if clock is not None:
            step = max(step, clock() * total_steps)
        if step < warmup:
            return min(1.0, (step + 1) / warmup)
        if schedule == "wsd":
            into = step - (total_steps - decay)
            return 1.0 if into <= 0 else max(min_ratio, 1 - (1 - min_ratio) * min(1.0, into / decay))
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


@dataclass
class DrafterReplica:
    index: int
    device: torch.device
    model: DFlashDrafter
    head: FrozenHead
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    loss_vocab: LossVocab | None = None  # the loss's softmax over these tokens; None: all

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return list(self.model.parameters())


def build_replicas(
    spec: DrafterSpec,
    head: FrozenHead,
    devices: list[torch.device],
    train: TrainConfig,
    total_steps: int,
    seed: int,
    init_from: torch.nn.Module | None = None,
    budget: TimeBudget | None = None,
    loss_tokens: torch.Tensor | None = None,
) -> list[DrafterReplica]:
    """`loss_tokens`: the token ids the loss's softmax runs over (`train.loss_vocab`); None: all."""
    base = DFlashDrafter(spec)
    base.init_weights(torch.Generator().manual_seed(seed + 104729))
    if init_from is not None:
        base.init_from_target(init_from, spec.target_layer_ids)
    state = base.state_dict()
    out = []
    for i, dev in enumerate(devices):
        model = DFlashDrafter(spec).to(dev)
        model.load_state_dict(state)
        model.train()
        # The frozen head in the dtype of the features the drafter computes in.
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        opt = torch.optim.AdamW(
            model.parameters(),
            lr=train.lr,
            betas=train.betas,
            weight_decay=train.weight_decay,
            # CPU: the fused kernel (one pass over each tensor; 3-5x faster than the per-tensor
            # loop for a small drafter, measured); CUDA: the multi-tensor one.
            foreach=True if dev.type == "cuda" else None,
            fused=True if dev.type == "cpu" else None,
        )
        clock = budget.fraction if budget is not None else None
        f = lr_lambda(total_steps, train.warmup_ratio, train.min_lr_ratio, train.schedule, train.decay_ratio, clock)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, f)
        rhead = head.to(dev, dtype)
        vocab = LossVocab.of(rhead.lm_head, loss_tokens, train.loss_negatives) if loss_tokens is not None else None
        out.append(DrafterReplica(i, dev, model, rhead, opt, sched, vocab))
    return out
