"""Anchor sampling: where the training blocks start.

Per document (never per packed row), up to `max_anchors` distinct positions among the
supervised positions whose next token is also supervised and in the same document,
sorted. The random draw is seeded by (run seed, sample id, epoch) alone, so a sample gets
the same anchors whichever other samples share its batch (SpecForge PR #731), and new
anchors each time it is seen again in a later epoch.
"""

from __future__ import annotations

import torch

__all__ = ["anchor_candidates", "sample_anchors", "sample_seed"]

_MASK63 = (1 << 63) - 1


def sample_seed(seed: int, sample_id: int, epoch: int) -> int:
    # A fixed integer mix (not Python's hash(), which is salted per process).
    x = seed * 0x9E3779B97F4A7C15 + sample_id * 0xBF58476D1CE4E5B9 + epoch * 0x94D049BB133111EB
    x ^= x >> 31
    return x & _MASK63


def anchor_candidates(loss_mask: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """(R, T) bool: position t may anchor a block (t and t+1 supervised, same document)."""
    cand = torch.zeros_like(loss_mask, dtype=torch.bool)
    nxt = loss_mask[:, 1:].bool() & (doc_ids[:, 1:] == doc_ids[:, :-1])
    cand[:, :-1] = loss_mask[:, :-1].bool() & nxt & (doc_ids[:, :-1] >= 0)
    return cand


def sample_anchors(
    loss_mask: torch.Tensor,
    doc_ids: torch.Tensor,
    max_anchors: int,
    *,
    seed: int,
    epoch: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns anchors (R, N) int64 (0 where unused) and valid (R, N) bool, N >= 1.

    `doc_ids` are global sample ids (>= 0) per position, -1 for padding; they seed the draw.
    Runs on the host: it is a few small ops per document.
    """
    loss_mask, doc_ids = loss_mask.cpu(), doc_ids.cpu()  # no-sync: the batch's host tensors
    cand = anchor_candidates(loss_mask, doc_ids)
    per_row: list[torch.Tensor] = []
    for r in range(doc_ids.shape[0]):
        picks = []
        row_docs = doc_ids[r]
        for d in torch.unique_consecutive(row_docs[row_docs >= 0]).tolist():  # no-sync: host
            pos = torch.nonzero(cand[r] & (row_docs == d)).flatten()
            if pos.numel() == 0:
                continue
            if pos.numel() > max_anchors:
                g = torch.Generator().manual_seed(sample_seed(seed, d, epoch))
                pos = pos[torch.randperm(pos.numel(), generator=g)[:max_anchors]].sort().values
            picks.append(pos)
        per_row.append(torch.cat(picks) if picks else torch.zeros(0, dtype=torch.long))
    n = max(1, max(p.numel() for p in per_row))
    anchors = torch.zeros(len(per_row), n, dtype=torch.long)
    valid = torch.zeros(len(per_row), n, dtype=torch.bool)
    for r, p in enumerate(per_row):
        anchors[r, : p.numel()] = p
        valid[r, : p.numel()] = True
    return anchors, valid
