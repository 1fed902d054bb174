"""Deterministic batching: a fixed order per (seed, epoch), collated into padded rows.

Each row holds one document; `doc_ids` carry the global sample id per token (-1 for
padding) and `positions` restart at 0 per document, so that the mask, anchors and labels
already work per document as packed rows will need.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dflash.records import Batch

__all__ = ["BatchPlan", "Sample", "collate"]


@dataclass(frozen=True)
class Sample:
    sample_id: int
    input_ids: torch.Tensor  # (L,) int64
    loss_mask: torch.Tensor  # (L,) bool


def collate(samples: list[Sample], index: int, epoch: int) -> Batch:
    T = max(s.input_ids.numel() for s in samples)
    R = len(samples)
    input_ids = torch.zeros(R, T, dtype=torch.long)
    loss_mask = torch.zeros(R, T, dtype=torch.bool)
    doc_ids = torch.full((R, T), -1, dtype=torch.long)
    positions = torch.zeros(R, T, dtype=torch.long)
    for r, s in enumerate(samples):
        n = s.input_ids.numel()
        input_ids[r, :n] = s.input_ids
        loss_mask[r, :n] = s.loss_mask
        doc_ids[r, :n] = s.sample_id
        positions[r, :n] = torch.arange(n)
    return Batch(
        index=index,
        epoch=epoch,
        input_ids=input_ids,
        loss_mask=loss_mask,
        doc_ids=doc_ids,
        positions=positions,
        num_tokens=int(sum(s.input_ids.numel() for s in samples)),
        num_samples=R,
    )


class BatchPlan:
    """The run's sequence of batches: `epochs` passes, shuffled per epoch from `seed`."""

    def __init__(self, samples: list[Sample], batch_size: int, epochs: int, seed: int, shuffle: bool) -> None:
        assert samples and batch_size >= 1 and epochs >= 1
        self.samples = samples
        self.batch_size = batch_size
        self.epochs = epochs
        self.seed = seed
        self.shuffle = shuffle

    @property
    def batches_per_epoch(self) -> int:
        return -(-len(self.samples) // self.batch_size)

    def __len__(self) -> int:
        return self.batches_per_epoch * self.epochs

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.samples)))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.samples), generator=g).tolist()

    def __iter__(self) -> Iterator[tuple[int, int, list[Sample]]]:
        """Yields (batch index, epoch, samples)."""
        index = 0
        for epoch in range(self.epochs):
            order = self.order(epoch)
            for s in range(0, len(order), self.batch_size):
                yield index, epoch, [self.samples[i] for i in order[s : s + self.batch_size]]
                index += 1
