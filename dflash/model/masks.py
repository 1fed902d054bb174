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

__all__ = ["BlockLayout", "LayerSpec", "MaskMod", "dense_mask", "flex_block_mask", "layer_masks", "make_mask_mod"]

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


class LayerSpec(Protocol):
    """What the masks need from a drafter's shape (`DrafterSpec` has it)."""

    @property
    def layer_types(self) -> Sequence[str]: ...
    @property
    def sliding_window(self) -> int: ...
    @property
    def sliding_causal_block(self) -> bool: ...


def layer_masks(layout: BlockLayout, spec: LayerSpec, use_flex: bool) -> dict[str, Any]:
    """One mask per layer type present in `spec.layer_types`, all from the one mask_mod:
    flex BlockMasks when `use_flex`, else dense (R, 1, Q, T+Q) bool masks. Training and eval
    both build their masks here."""
    masks: dict[str, Any] = {}
    for lt in dict.fromkeys(spec.layer_types):
        sliding = lt == "sliding_attention"
        mod = make_mask_mod(
            layout,
            window=spec.sliding_window if sliding else None,
            causal_in_block=spec.sliding_causal_block if sliding else False,
        )
        masks[lt] = flex_block_mask(mod, layout) if use_flex else dense_mask(mod, layout)
    return masks
