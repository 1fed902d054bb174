"""The small frozen records that travel between stages, named for what they are.

Batch (prefetch → target forward) → TargetFeatures (→ pack) → PackedFeatures (→ D2H)
→ HostFeatures (hidden-state channel → drafter step) → StepGrads (→ optimizer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Batch", "HostFeatures", "PackedFeatures", "StepGrads", "StepReply", "TargetFeatures"]


@dataclass(frozen=True)
class Batch:
    index: int  # position in the run's batch sequence
    epoch: int
    input_ids: torch.Tensor  # (R, T) int64
    loss_mask: torch.Tensor  # (R, T) bool: supervised (assistant) tokens
    doc_ids: torch.Tensor  # (R, T) int64 global sample id per token; -1 = padding
    positions: torch.Tensor  # (R, T) int64 position inside its document
    num_tokens: int  # non-padding tokens
    num_samples: int
    packed: bool  # some row holds several documents (known on the host: no sync to find out)
    seq: int = 0  # this process's count of batches before it (prefetch's order): several target chains hand
    # their features to the drafters in this order, the order one chain would


# The target's next-token distribution at every position, for distillation: top-k logits
# (R, T, k) float32 and their token ids (R, T, k) int64.
Teacher = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class TargetFeatures:
    batch: Batch
    layers: list[torch.Tensor]  # per chosen layer (R, T, H), on the target device
    ready: Any  # CUDA event or None
    teacher: Teacher | None = None  # with target labels or distillation


@dataclass(frozen=True)
class PackedFeatures:
    batch: Batch
    hidden: torch.Tensor  # (R, T, k·H) one contiguous buffer, on the target device
    ready: Any
    teacher: Teacher | None = None


@dataclass(frozen=True)
class HostFeatures:
    """Features on their way to a drafter replica: on the host (pinned, when a CUDA target
    copied them), or still on the target's GPU when every replica shares it."""

    batch: Batch
    hidden: torch.Tensor  # (R, T, k·H)
    source: int  # target replica that produced it
    ready: Any = None  # CUDA event: `hidden` is complete (device features only)
    release: Callable[[Any], None] | None = None  # a pooled pinned buffer: give it back after its upload
    teacher: Teacher | None = None  # with target labels or distillation: on the host, or with `hidden` on the GPU


@dataclass(frozen=True)
class StepGrads:
    """One drafter replica's contribution to optimizer step `step` (grads live in .grad)."""

    replica: int
    step: int
    micro_batches: int  # 0: the replica found the stream ended and has nothing to add
    loss_sum: torch.Tensor | None  # () Σ w·CE over its micro-batches, detached
    weight_sum: float  # Σ w over its micro-batches
    correct_per_slot: torch.Tensor | None  # (B,) on its device
    count_per_slot: torch.Tensor | None  # (B,) host
    tokens: int  # tokens of the batches it consumed
    samples: int
    ready: Any = None  # CUDA event: its backward is done (the optimizer's stream waits on it)
    last_batch: int = -1  # highest batch index it consumed (several processes: the data cursor)
    batches: tuple[int, ...] = ()  # every batch index it consumed (one process: the data cursor)
    part_sums: torch.Tensor | None = None  # (3,) the loss sum's parts on its device (`LossParts.part_sums`)


@dataclass(frozen=True)
class StepReply:
    """The optimizer's answer to every replica after a step: go on, or stop."""

    step: int
    stop: bool
    ready: Any = None  # CUDA event: the update is done (the replica's stream waits on it)
