"""Forming one epoch's batches: length buckets, shuffling, token-budget grouping, packing.

`BatchPlan` (`batching.py`) owns the run — its inputs, epochs and resume cursor — and asks
this module for each epoch's layout: which sample indices sit in which row of which
batch, and the order batches are served in. Everything here is a pure function of
sample lengths, the knobs and `(seed, epoch)`, so a layout can be rebuilt at will.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["EpochLayout", "epoch_seed", "group_rows", "layout_epoch", "length_buckets", "pack_rows"]

# Batches of one bucket as formed: batches, each a list of rows of sample indices.
Formed = list[list[list[int]]]

# Open rows that first-fit packing may still add to: a wider window packs tighter at
# O(window) per document; a narrow one keeps rows close to the shuffled order.
_PACK_WINDOW = 32


def length_buckets(lengths: Sequence[int], num_buckets: int) -> list[list[int]]:
    """Split sample indices into up to `num_buckets` length buckets at the length quantiles.

    Bucket k holds lengths in [edge_{k-1}, edge_k); the edges are the lengths at ranks
    k·N/num_buckets, so buckets hold about equal counts, and equal lengths always share a
    bucket (hence fewer buckets when many lengths tie). Members keep sample order.
    """
    n = len(lengths)
    ranked = sorted(lengths)
    edges = sorted({ranked[(k * n) // num_buckets] for k in range(1, num_buckets)} - {ranked[0]})
    buckets: list[list[int]] = [[] for _ in range(len(edges) + 1)]
    for i, length in enumerate(lengths):
        buckets[bisect_right(edges, length)].append(i)
    return [b for b in buckets if b]


def epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed from (seed, epoch) only: no collisions between nearby pairs."""
    digest = hashlib.blake2b(f"dflash.batching:{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class EpochLayout:
    """One epoch's batches, flat (8 bytes per sample, not a Python list per row).

    Batches are stored in the order they were formed (bucket after bucket) and served in
    `order`, so that shuffling batches across buckets never moves the sample indices.
    """

    docs: torch.Tensor  # (D,) int64 sample indices, row after row, in formation order
    row_ends: torch.Tensor | None  # (rows,) int64 end offset into `docs`; None: one document per row
    batch_ends: torch.Tensor  # (batches,) int64 end offset into the rows of each formed batch
    order: torch.Tensor  # (batches,) int64 formed-batch id of each served batch

    def __len__(self) -> int:
        return int(self.order.numel())

    def rows(self, b: int) -> list[list[int]]:
        """Served batch `b` as rows of sample indices."""
        k = int(self.order[b])
        r0, r1 = (int(self.batch_ends[k - 1]) if k else 0), int(self.batch_ends[k])
        if self.row_ends is None:
            return [[i] for i in self.docs[r0:r1].tolist()]
        ends = self.row_ends[r0:r1].tolist()
        starts = [int(self.row_ends[r0 - 1]) if r0 else 0, *ends[:-1]]
        docs = self.docs[starts[0] : ends[-1]].tolist()
        return [docs[a - starts[0] : e - starts[0]] for a, e in zip(starts, ends, strict=True)]


def layout_epoch(
    buckets: Sequence[torch.Tensor],
    generator: torch.Generator | None,
    batch_size: int,
    form: Callable[[list[int]], Formed] | None,
) -> EpochLayout:
    """Lay out one epoch from the bucket members ((n_b,) sample indices each).

    `generator` shuffles (None: keep sample order); it is drawn from in a fixed order
    (buckets, then batches), so the layout depends on its seed only. `form` turns one
    bucket's shuffled members into batches of rows; None means one sample per row,
    `batch_size` per batch, done vectorized (this runs on the loop thread).
    """
    docs: list[torch.Tensor] = []  # per bucket (n_b,) sample indices
    row_ends: list[int] = []
    batch_ends: list[torch.Tensor] = []  # per bucket (batches_b,) row offsets
    rows_so_far = 0
    for members in buckets:
        if generator is not None:
            members = members[torch.randperm(members.numel(), generator=generator)]
        if form is None:
            n = members.numel()
            ends = (torch.arange(1, -(-n // batch_size) + 1) * batch_size).clamp_(max=n)
            docs.append(members)
            batch_ends.append(ends + rows_so_far)
            rows_so_far += n
            continue
        ends_b = []
        flat: list[int] = []
        for batch in form(members.tolist()):
            for row in batch:
                flat += row
                row_ends.append((row_ends[-1] if row_ends else 0) + len(row))
            ends_b.append(len(row_ends))
        docs.append(torch.tensor(flat, dtype=torch.long))
        batch_ends.append(torch.tensor(ends_b, dtype=torch.long))
    all_ends = torch.cat(batch_ends)
    n_batches = all_ends.numel()
    # Interleave the buckets: no stretch of only-long or only-short batches.
    order = torch.randperm(n_batches, generator=generator) if generator is not None else torch.arange(n_batches)
    return EpochLayout(
        docs=torch.cat(docs),
        row_ends=None if form is None else torch.tensor(row_ends, dtype=torch.long),
        batch_ends=all_ends,
        order=order,
    )


def group_rows(members: list[int], lengths: Sequence[int], batch_size: int, token_budget: int) -> Formed:
    """One document per row; close a batch when one more sample would exceed
    batch_size rows or the token budget (padded to the longest sample so far)."""
    batches: Formed = []
    cur: list[list[int]] = []
    longest = 0
    for i in members:
        n = lengths[i]
        grown = max(longest, n)
        full = len(cur) >= batch_size or (token_budget and (len(cur) + 1) * grown > token_budget)
        if cur and full:
            batches.append(cur)
            cur, grown = [], n
        cur.append([i])
        longest = grown
    if cur:
        batches.append(cur)
    return batches


def pack_rows(members: list[int], lengths: Sequence[int], capacity: int, rows_per_batch: int) -> Formed:
    """First-fit packing of whole documents into rows of `capacity` tokens, over a
    window of the last `_PACK_WINDOW` open rows (in the given, shuffled order), then
    `rows_per_batch` rows per batch in the order rows were closed."""
    rows: list[list[int]] = []
    open_rows: list[list[int]] = []
    fills: list[int] = []
    for i in members:
        n = lengths[i]
        if n >= capacity:  # longer only when capacity = token_budget < max_seq_len: alone (rows_per_batch is 1)
            rows.append([i])
            continue
        for k, f in enumerate(fills):
            if f + n <= capacity:
                open_rows[k].append(i)
                fills[k] += n
                if fills[k] == capacity:  # nothing more fits: close it at once
                    rows.append(open_rows.pop(k))
                    fills.pop(k)
                break
        else:
            if len(open_rows) == _PACK_WINDOW:
                rows.append(open_rows.pop(0))
                fills.pop(0)
            open_rows.append([i])
            fills.append(n)
    rows += open_rows
    k = rows_per_batch
    return [rows[s : s + k] for s in range(0, len(rows), k)]
