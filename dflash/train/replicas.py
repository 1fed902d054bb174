"""A drafter replica: its module, the frozen embedding / LM head on its device, and its
optimizer and schedule. Replicas start identical and receive identical updates.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dflash.config import OptimizerConfig
from dflash.model.drafter import DFlashDrafter, DrafterSpec, FrozenHead
from dflash.model.loss import LossVocab
from dflash.model.vocab import DraftVocab
from dflash.runtime.sequence import SequenceGroup

__all__ = ["DrafterReplica", "build_replicas"]


@dataclass
class DrafterReplica:
    index: int
    device: torch.device
    model: DFlashDrafter
    head: FrozenHead
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    loss_vocab: LossVocab | None = None  # the loss's softmax over these tokens (loss.vocab = "data"); None: all
    draft_index: torch.Tensor | None = None  # (V,) each target id's draft row, -1 outside (a draft vocabulary)
    seq_group: SequenceGroup | None = None  # sequence parallelism: the group this replica trains rows with ...
    seq_rank: int = 0  # ... and its rank there

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return list(self.model.parameters())

    @functools.cached_property
    def num_params(self) -> int:
        """Parameters the optimizer updates (the frozen head is not the model's)."""
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)


def build_replicas(
    spec: DrafterSpec,
    head: FrozenHead,
    devices: list[torch.device],
    optim: OptimizerConfig,
    lr_factor: Callable[[float], float],
    seed: int,
    init_from: torch.nn.Module | None = None,
    vocab: DraftVocab | None = None,
) -> list[DrafterReplica]:
    """One replica per device, all with the same initial weights (from `seed`, or the target's
    layers with `init_from`), AdamW from `[optimizer]`, and `lr_factor` (the LR schedule,
    `schedule.lr_schedule`) times the peak LR. With a draft `vocab`, the drafter's head is the
    target's rows of its tokens, and so is each replica's frozen head."""
    base = DFlashDrafter(spec)
    base.init_weights(torch.Generator().manual_seed(seed + 104729))
    if init_from is not None:
        base.init_from_target(init_from, spec.target_layer_ids)
    if vocab is not None:
        base.set_draft_vocab(vocab.ids, head.lm_head)
        head = head.pruned(vocab.ids)
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
            lr=optim.lr,
            betas=optim.betas,
            weight_decay=optim.weight_decay,
            # CPU: the fused kernel (one pass over each tensor, faster than the per-tensor loop
            # for a small drafter); CUDA: the multi-tensor one.
            foreach=True if dev.type == "cuda" else None,
            fused=True if dev.type == "cpu" else None,
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
        index = None if vocab is None else vocab.index().to(dev)
        out.append(DrafterReplica(i, dev, model, head.to(dev, dtype), opt, sched, draft_index=index))
    return out
