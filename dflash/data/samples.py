"""A training sample, and how rows of samples become one padded `Batch` (`collate`).

`Sample` is what every data source produces (token ids and a loss mask under a unique
id); `collate` is the one place where rows of whole documents are laid into `(R, T)`
tensors with per-token document ids and per-document positions, for the mask, anchors
and labels downstream. Which samples share a batch is `BatchPlan`'s business
(`batching.py`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash.runtime.messages import Batch

__all__ = ["Rows", "Sample", "SampleTable", "batch_padding_fraction", "collate"]


@dataclass(frozen=True)
class Sample:
    sample_id: int  # global, unique in the data set: it becomes the token's doc id
    input_ids: torch.Tensor  # (L,) int32 (views of the tokenization cache) or int64
    loss_mask: torch.Tensor  # (L,) bool

    @property
    def length(self) -> int:
        return int(self.input_ids.numel())


class SampleTable(Sequence[Sample]):
    """The samples of tokenized files as flat buffers (each file's int32 ids and bool mask back
    to back, memory-mapped from the tokenization cache) and, per sample, its file and place
    there: 24 bytes a sample, whatever its length. A `Sample` (two views) is made when asked
    for and kept by no one, so set-up's memory does not grow with the data set by Python
    objects; sample i has id i."""

    def __init__(self, files: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], picks: Sequence[Any]) -> None:
        """`files`: (ids, mask, offsets) of each file; `picks`: which of each file's samples,
        in order (its weighted indices)."""
        import numpy as np

        self._files = list(files)
        picked = [np.asarray(p, dtype=np.int64) for p in picks]
        self._file = np.concatenate([np.full(len(p), f, dtype=np.int32) for f, p in enumerate(picked)] or [[]])
        starts, lengths = [], []
        for (_, _, offsets), p in zip(self._files, picked, strict=True):
            off = offsets.numpy()
            starts.append(off[p])
            lengths.append(off[p + 1] - off[p])
        self._start = np.concatenate(starts or [[]]).astype(np.int64)
        self.lengths = np.concatenate(lengths or [[]]).astype(np.int64)  # (N,) tokens of each sample

    def __len__(self) -> int:
        return len(self._start)

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        ids, mask, _ = self._files[int(self._file[i])]
        a, n = int(self._start[i]), int(self.lengths[i])
        return Sample(i, ids[a : a + n], mask[a : a + n])

    def __iter__(self) -> Iterator[Sample]:
        return (self[i] for i in range(len(self)))

    def supervised_tokens(self) -> int:
        """Loss-masked tokens over every sample (a file's sample picked twice counts twice)."""
        import numpy as np

        total = 0
        for f, (_, mask, offsets) in enumerate(self._files):
            ours = self._file == f
            if not ours.any():
                continue
            off = offsets.numpy()
            per = np.add.reduceat(mask.numpy().view(np.uint8), off[:-1], dtype=np.int64)  # no copy of the mask
            total += int(per[np.searchsorted(off[:-1], self._start[ours])].sum())
        return total


# What a plan yields per batch and `collate` takes: rows, each a list of whole documents.
Rows = list[list[Sample]]


def collate(rows: Sequence[Sample] | Sequence[Sequence[Sample]], index: int, epoch: int, seq: int = 0) -> Batch:
    """Pad `rows` into one Batch of shape (R, T), T = the longest row (`seq`: `Batch.seq`).

    `rows` is either a list of rows, each a list of documents packed back to back, or a
    list of samples, one per row. Per token, `doc_ids` is the document's
    `sample_id` (-1 for padding), `positions` count from 0 at each document's first token,
    and `loss_mask` is the document's own mask (False on padding). Vectorized: no Python
    loop per token, only per document.
    """
    nested: list[list[Sample]] = [[r] if isinstance(r, Sample) else list(r) for r in rows]
    if not nested or any(not row for row in nested):
        msg = "collate: every batch needs at least one row and every row at least one document"
        raise ValueError(msg)
    docs = [s for row in nested for s in row]
    R = len(nested)
    lengths = torch.tensor([s.input_ids.numel() for s in docs], dtype=torch.long)  # (D,)
    row_of_doc = torch.tensor([r for r, row in enumerate(nested) for _ in row], dtype=torch.long)  # (D,)
    sample_ids = torch.tensor([s.sample_id for s in docs], dtype=torch.long)  # (D,)
    fills = torch.zeros(R, dtype=torch.long).index_add_(0, row_of_doc, lengths)  # (R,) tokens per row
    T = int(fills.max())
    N = int(lengths.sum())

    # Documents are concatenated row by row, so a token's flat index minus the flat start
    # of its document (row) is its position in the document (column in the row).
    flat = torch.arange(N)  # (N,)
    doc_start = torch.cumsum(lengths, 0) - lengths  # (D,)
    row_start = torch.cumsum(fills, 0) - fills  # (R,)
    tok_row = torch.repeat_interleave(row_of_doc, lengths)  # (N,)
    tok_pos = flat - torch.repeat_interleave(doc_start, lengths)  # (N,)
    tok_col = flat - row_start[tok_row]  # (N,)
    dest = tok_row * T + tok_col  # (N,) index into the flattened (R, T) grid

    input_ids = torch.zeros(R * T, dtype=torch.long)
    loss_mask = torch.zeros(R * T, dtype=torch.bool)
    doc_ids = torch.full((R * T,), -1, dtype=torch.long)
    positions = torch.zeros(R * T, dtype=torch.long)
    input_ids[dest] = torch.cat([s.input_ids.reshape(-1) for s in docs]).long()
    loss_mask[dest] = torch.cat([s.loss_mask.reshape(-1) for s in docs]).bool()
    doc_ids[dest] = torch.repeat_interleave(sample_ids, lengths)
    positions[dest] = tok_pos
    return Batch(
        index=index,
        epoch=epoch,
        input_ids=input_ids.view(R, T),
        loss_mask=loss_mask.view(R, T),
        doc_ids=doc_ids.view(R, T),
        positions=positions.view(R, T),
        num_tokens=N,
        num_samples=len(docs),
        packed=len(docs) > R,  # every row holds at least one document
        seq=seq,
    )


def batch_padding_fraction(batch: Batch) -> float:
    """Share of a batch's R × T slots that are padding."""
    slots = batch.input_ids.numel()
    return 1.0 - batch.num_tokens / slots if slots else 0.0
