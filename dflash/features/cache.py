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

import itertools
import threading
from collections.abc import Callable

import torch

from dflash.runtime.messages import Batch, Teacher

__all__ = ["FeatureCache"]


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

    @staticmethod
    def _spans(batch: Batch) -> list[tuple[int, int, int, int]]:
        """(row, start, end, sample id) of every document in the batch."""
        out = []
        docs = batch.doc_ids
        for r in range(docs.shape[0]):
            row = docs[r]
            change = torch.nonzero(row[1:] != row[:-1]).flatten().add(1).tolist()
            bounds = [0, *change, row.numel()]
            for s, e in itertools.pairwise(bounds):
                d = int(row[s])
                if d >= 0:
                    out.append((r, s, e, d))
        return out

    def get(
        self, batch: Batch, dtype: torch.dtype, alloc: Callable[..., torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, Teacher | None] | None:
        """(R, T, k·H) host features and the teacher's top-k (or None, if none was stored) when
        every document of the batch is cached, else None; in buffers from `alloc(shape, dtype)`
        when given (the device's pinned memory: it uploads them without a host sync)."""

        def zeros(shape: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dt) if alloc is None else alloc(shape, dt).zero_()

        spans = self._spans(batch)
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

    def seed(self, sample_id: int, features: torch.Tensor, teacher: Teacher | None = None) -> bool:
        """Store one document's (L, k·H) features (and (L, k) top-k) made elsewhere (feature
        files); False when the budget has no room for it."""
        piece = features.to(self.dtype)
        vals = idx = None
        size = piece.numel() * piece.element_size()
        if teacher is not None:
            vals, idx = teacher[0].to(torch.float32), teacher[1].to(torch.int32)
            size += vals.numel() * 4 + idx.numel() * 4
        with self._lock:
            if self.bytes + size > self.max_bytes:
                return False
            if sample_id not in self._store:
                self._store[sample_id] = (piece, vals, idx)
                self.bytes += size
        return True

    def put(self, batch: Batch, hidden: torch.Tensor, teacher: Teacher | None = None) -> None:
        """Store each document's slice of host features `hidden` (R, T, k·H), and of the
        teacher's top-k when given, budget permitting."""
        if self.bytes >= self.max_bytes:
            return
        for r, s, e, d in self._spans(batch):
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
