"""Feature cache (the peers' "offline mode", online): target features kept per sample.

After a sample's first pass through the target, its features (the chosen layers,
concatenated, in bfloat16 — compact and safe from fp16 overflow) stay in memory up to
`data.feature_cache_mb`; a later batch whose every document is cached skips the target
forward altogether (`target.feature_cache_hit` in the profile). On a small prompt set
trained for many epochs — the demo — this removes most of the target's cost. Features of a
document do not depend on its row or neighbours (rows are document-masked), so a cached
document can be placed into any later row layout.
"""

from __future__ import annotations

import itertools
import threading

import torch

from dflash.records import Batch

__all__ = ["FeatureCache"]


class FeatureCache:
    def __init__(self, max_bytes: int, dtype: torch.dtype = torch.bfloat16) -> None:
        self.max_bytes = max_bytes
        self.dtype = dtype
        self.bytes = 0
        self.hits = self.misses = 0
        self._store: dict[int, torch.Tensor] = {}  # sample id -> (L, k·H) on the host
        self._lock = threading.Lock()  # target chains put and get from their worker threads

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

    def get(self, batch: Batch, dtype: torch.dtype, pin: bool = False) -> torch.Tensor | None:
        """(R, T, k·H) host features if every document of the batch is cached, else None;
        in pinned memory with `pin` (a CUDA drafter uploads it without a host sync)."""
        spans = self._spans(batch)
        with self._lock:
            parts = [self._store.get(d) for *_, d in spans]
            if not parts or any(p is None for p in parts):
                self.misses += 1
                return None
            self.hits += 1
        R, T = batch.doc_ids.shape
        out = torch.zeros(R, T, parts[0].shape[-1], dtype=dtype, pin_memory=pin)
        for (r, s, e, _), p in zip(spans, parts, strict=True):
            out[r, s:e] = p
        return out

    def put(self, batch: Batch, hidden: torch.Tensor) -> None:
        """Store each document's slice of host features `hidden` (R, T, k·H), budget permitting."""
        if self.bytes >= self.max_bytes:
            return
        for r, s, e, d in self._spans(batch):
            with self._lock:
                if d in self._store:
                    continue
                piece = hidden[r, s:e].to(self.dtype, copy=True)
                size = piece.numel() * piece.element_size()
                if self.bytes + size > self.max_bytes:
                    return
                self._store[d] = piece
                self.bytes += size
