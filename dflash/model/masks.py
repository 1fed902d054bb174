"""The DFlash attention mask, defined once as a `mask_mod(b, h, q, kv)`.

Layout per row b: keys/values are `[context 0..T-1 | block_0 .. block_{N-1}]` (T + N·B),
queries are the N·B block positions. A query in block j at offset k (anchor a_j) sees:

- context position c iff the block is valid, c < a_j (strictly before the anchor), and
  c is in the same document as a_j; for sliding-window layers also c >= a_j + k - (W-1)
  (the draft token itself takes one slot of the window);
- block position (jj, kk) iff jj == j (its own block; never another block), and for
  sliding layers with in-block causality, kk <= k.

The same function feeds flex attention's `create_block_mask` (CUDA) and, evaluated on
broadcast index tensors, the dense boolean mask for SDPA (CPU, and tests' reference).
`layer_masks` builds one mask per attention layer type; training and eval both call it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = [
    "BlockLayout", "GroupedMask", "LayerSpec", "MaskMod", "dense_mask", "flex_block_mask", "grouped_mask",
    "layer_masks", "make_mask_mod",
]  # fmt: skip

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class BlockLayout:
    """What the mask needs to know about one micro-batch."""

    anchors: torch.Tensor  # (R, N) int64 anchor positions; 0 where disabled
    valid: torch.Tensor  # (R, N) bool
    doc_ids: torch.Tensor  # (R, T) int64 document id per context position; -1 = padding
    block_size: int

    @property
    def ctx_len(self) -> int:
        return self.doc_ids.shape[1]

    @property
    def num_queries(self) -> int:
        return self.anchors.shape[1] * self.block_size


def make_mask_mod(layout: BlockLayout, window: int | None, causal_in_block: bool) -> MaskMod:
    anchors, valid, doc = layout.anchors, layout.valid, layout.doc_ids
    B, T = layout.block_size, layout.ctx_len

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        j = q // B
        k = q % B
        a = anchors[b, j]
        ok = valid[b, j]
        c = kv.clamp(max=T - 1)  # index safely; is_ctx decides which branch counts
        ctx_ok = (c < a) & (doc[b, c] == doc[b, a])
        if window is not None:
            ctx_ok = ctx_ok & (c >= a + k - (window - 1))
        rel = (kv - T).clamp(min=0)
        blk_ok = (rel // B) == j
        if causal_in_block:
            blk_ok = blk_ok & ((rel % B) <= k)
        return ok & torch.where(kv < T, ctx_ok, blk_ok)

    return mask_mod


def dense_mask(mask_mod: MaskMod, layout: BlockLayout) -> torch.Tensor:
    """(R, 1, Q, T+Q) bool, True = attend: the mask_mod evaluated by broadcasting."""
    R, Q = layout.anchors.shape[0], layout.num_queries
    dev = layout.anchors.device
    b = torch.arange(R, device=dev)[:, None, None, None]
    q = torch.arange(Q, device=dev)[None, None, :, None]
    kv = torch.arange(layout.ctx_len + Q, device=dev)[None, None, None, :]
    h = torch.zeros((), dtype=torch.long, device=dev)
    return mask_mod(b, h, q, kv)


_compiled_block_mask: Any = None
_block_mask_lock = threading.Lock()


def flex_block_mask(mask_mod: MaskMod, layout: BlockLayout) -> object:
    """The flex-attention BlockMask for the same mask_mod (GPU path). On CUDA the builder is
    one module-level `torch.compile(create_block_mask, dynamic=True)`: eager, it would
    evaluate the mask over the whole (Q, KV) grid, the dense cost flex avoids; compiled with
    dynamic shapes, one compile serves every batch shape. Dynamo is not thread-safe, and
    every drafter replica builds masks in its own thread: the calls take a lock (a built
    mask costs little; the first compile is the slow part)."""
    global _compiled_block_mask
    from torch.nn.attention.flex_attention import create_block_mask

    R, Q = layout.anchors.shape[0], layout.num_queries
    dev = layout.anchors.device
    kwargs = {"B": R, "H": None, "Q_LEN": Q, "KV_LEN": layout.ctx_len + Q, "device": dev}
    if dev.type != "cuda":
        return create_block_mask(mask_mod, **kwargs)
    with _block_mask_lock:
        if _compiled_block_mask is None:
            _compiled_block_mask = torch.compile(create_block_mask, dynamic=True)
        return _compiled_block_mask(mask_mod, **kwargs)


@dataclass(frozen=True)
class GroupedMask:
    """The mask of a long row without the (Q, T + Q) grid: the block queries in groups of
    consecutive blocks, each group attending to the one context slice that holds every key its
    blocks may see (from the earliest document start, or window start, to the latest anchor) and
    to its own blocks' keys. `attend` runs SDPA group by group, each group's small mask from the
    same `mask_mod` (exact), recomputed in backward (checkpointed): memory O((T + Q)·d) plus one
    group's scores, not O(Q·T). `groups`: (row, q0, q1, c0, c1) — queries [q0, q1) of the row
    see context [c0, c1) and block keys T + q0 … T + q1 − 1."""

    mod: MaskMod
    groups: tuple[tuple[int, int, int, int, int], ...]
    ctx_len: int


GROUP_SCORES = 1 << 22  # scores (queries × keys) one group's SDPA may hold per head


def grouped_mask(  # no-sync: host tensors (the batch's anchors and documents)
    layout: BlockLayout,
    host_anchors: torch.Tensor,
    host_valid: torch.Tensor,
    host_doc: torch.Tensor,
    window: int | None,
    causal_in_block: bool,
    budget: int = GROUP_SCORES,
) -> GroupedMask:
    """`GroupedMask` of `layout` (its tensors on the drafter's device), the groups laid out from
    the same anchors, valid flags and document ids on the host: consecutive blocks while the
    group's queries × (its context slice + its block keys) stay within `budget`."""
    R, N = host_anchors.shape
    B, T = layout.block_size, layout.ctx_len
    doc, anchors, valid = host_doc.tolist(), host_anchors.tolist(), host_valid.tolist()
    groups = []
    for r in range(R):
        starts, row = {}, doc[r]
        for t in range(T):  # each document's first position
            starts.setdefault(row[t], t)
        j = 0
        while j < N:
            c0, c1, j1 = T, 0, j
            while j1 < N:
                a, ok = anchors[r][j1], valid[r][j1]
                lo = max(starts.get(row[a], 0), a - (window - 1) if window is not None else 0) if ok else c0
                n0, n1 = (min(c0, lo), max(c1, a)) if ok else (c0, c1)
                span = max(0, n1 - n0) + (j1 + 1 - j) * B
                if j1 > j and (j1 + 1 - j) * B * span > budget:
                    break
                c0, c1, j1 = n0, n1, j1 + 1
            groups.append((r, j * B, j1 * B, min(c0, c1), c1))
            j = j1
    return GroupedMask(make_mask_mod(layout, window, causal_in_block), tuple(groups), T)


class LayerSpec(Protocol):
    """What the masks need from a drafter's shape (`DrafterSpec` has it)."""

    @property
    def layer_types(self) -> Sequence[str]: ...
    @property
    def sliding_window(self) -> int: ...
    @property
    def sliding_causal_block(self) -> bool: ...


def layer_masks(
    layout: BlockLayout, spec: LayerSpec, use_flex: bool, grouped: tuple[torch.Tensor, ...] | None = None
) -> dict[str, Any]:
    """One mask per layer type present in `spec.layer_types`, all from the one mask_mod:
    flex BlockMasks when `use_flex`, `GroupedMask`s when `grouped` gives the host's (anchors,
    valid, doc ids), else dense (R, 1, Q, T+Q) bool masks. Training and eval both build their
    masks here."""
    masks: dict[str, Any] = {}
    for lt in dict.fromkeys(spec.layer_types):
        sliding = lt == "sliding_attention"
        window = spec.sliding_window if sliding else None
        causal = spec.sliding_causal_block if sliding else False
        if grouped is not None:
            masks[lt] = grouped_mask(layout, *grouped, window, causal)
            continue
        mod = make_mask_mod(layout, window=window, causal_in_block=causal)
        masks[lt] = flex_block_mask(mod, layout) if use_flex else dense_mask(mod, layout)
    return masks
