"""Feature cache (the peers' "offline mode", online): target features kept per sample.

After a sample's first pass through the target, its features (the chosen layers,
concatenated, in bfloat16 — compact and safe from fp16 overflow) stay in memory up to
`data.feature_cache_mb`; a later batch whose every document is cached skips the target
forward altogether (`target.feature_cache_hit` in the profile). On a small prompt set
trained for many epochs — the demo — this removes most of the target's cost. Features of a
document do not depend on its row or neighbours (rows are document-masked), so a cached
document can be placed into any later row layout.

With target labels or distillation (`loss.labels = "target"`, `loss.distill`) the
target's top-k next-token logits and ids at each position are kept beside the features
(k·8 bytes a position: float32 values, int32 ids), so cached epochs still have them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from dflash.runtime.messages import Batch, Teacher

__all__ = ["FeatureCache", "doc_spans"]


def doc_spans(batch: Batch) -> list[tuple[int, int, int, int]]:
    """(row, start, end, sample id) of every document in the batch, row by row."""
    docs = batch.doc_ids
    R, T = docs.shape
    starts = torch.ones(R, T, dtype=torch.bool)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    rows, cols = starts.nonzero(as_tuple=True)  # row-major: a row's runs in order
    ends = torch.full_like(cols, T)
    same_row = rows[1:] == rows[:-1]
    ends[:-1] = torch.where(same_row, cols[1:], T)
    ids = docs[rows, cols]
    return [
        (r, s, e, d)
        for r, s, e, d in zip(rows.tolist(), cols.tolist(), ends.tolist(), ids.tolist(), strict=True)
        if d >= 0
    ]


class FeatureCache:
    def __init__(self, max_bytes: int, dtype: torch.dtype = torch.bfloat16) -> None:
        self.max_bytes = max_bytes
        self.dtype = dtype
        self.bytes = 0
        self.hits = self.misses = 0
        # sample id -> (L, k·H) features on the host, and the teacher's (L, k) values and ids or None
        self._store: dict[int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = {}
        self._lock = threading.Lock()  # target chains put and get from their worker threads

    @classmethod
    def from_config(cls, megabytes: int) -> FeatureCache | None:
        """The cache `data.feature_cache_mb` asks for (None at 0)."""
        return cls(megabytes * 2**20) if megabytes else None

    def __len__(self) -> int:
        return len(self._store)

    def stats(self) -> dict[str, float]:
        return {"hits": self.hits, "misses": self.misses, "samples": len(self), "mb": round(self.bytes / 2**20, 1)}

    def get(
        self, batch: Batch, dtype: torch.dtype, alloc: Callable[..., torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, Teacher | None] | None:
        """(R, T, k·H) host features and the teacher's top-k (or None, if none was stored) when
        every document of the batch is cached, else None; in buffers from `alloc(shape, dtype)`
        when given (the device's pinned memory: it uploads them without a host sync)."""

        def zeros(shape: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dt) if alloc is None else alloc(shape, dt).zero_()

        spans = doc_spans(batch)
        with self._lock:
            parts = [self._store.get(d) for *_, d in spans]
            # all or nothing, the top-k included: a missing one would leave zeros as labels
            if not parts or any(p is None or (p[1] is None) != (parts[0][1] is None) for p in parts):
                self.misses += 1
                return None
            self.hits += 1
        R, T = batch.doc_ids.shape
        first = parts[0]
        assert first is not None
        out = zeros((R, T, first[0].shape[-1]), dtype)
        teacher = None
        if first[1] is not None:
            k = first[1].shape[-1]
            teacher = (zeros((R, T, k), torch.float32), zeros((R, T, k), torch.int64))
        for (r, s, e, _), p in zip(spans, parts, strict=True):
            assert p is not None
            out[r, s:e] = p[0]
            if teacher is not None and p[1] is not None and p[2] is not None:
                teacher[0][r, s:e] = p[1]
                teacher[1][r, s:e] = p[2]
        return out, teacher

    def put(self, batch: Batch, hidden: torch.Tensor, teacher: Teacher | None = None) -> None:
        """Store each document's slice of host features `hidden` (R, T, k·H), and of the
        teacher's top-k when given, budget permitting."""
        if self.bytes >= self.max_bytes:
            return
        for r, s, e, d in doc_spans(batch):
            with self._lock:
                if d in self._store:
                    continue
                piece = hidden[r, s:e].to(self.dtype, copy=True)
                vals = idx = None
                size = piece.numel() * piece.element_size()
                if teacher is not None:
                    vals = teacher[0][r, s:e].to(torch.float32, copy=True)
                    idx = teacher[1][r, s:e].to(torch.int32, copy=True)  # vocabularies fit in int32
                    size += vals.numel() * 4 + idx.numel() * 4
                if self.bytes + size > self.max_bytes:
                    return
                self._store[d] = (piece, vals, idx)
                self.bytes += size
