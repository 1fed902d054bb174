"""The DFlash drafter (docs/architecture.md, "The DFlash details"; https://github.com/z-lab/dflash).

fc + hidden_norm fuse the chosen target layers into one context feature; each draft layer
is a Qwen3-style decoder layer whose queries come from the block tokens only and whose
keys/values are `concat(proj(context), proj(block))` with the same projections (KV
injection). Parameter names match the reference export (`fc.weight`, `layers.0.self_attn.
q_proj.weight`, ...). The embedding and LM head are the target's, frozen, held outside
this module (`FrozenHead`) and never saved with it; a drafter with a draft vocabulary keeps its rows
of the head (frozen) and the maps as buffers, saved and exported.

Kept whole, like a modeling file: the training path (`forward`) and the cached inference
path (`forward_block`, `Attention.forward_cached`) must stay the same computation, so they
are read side by side.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash.model.masks import GroupedMask
from dflash.model.modeling_dflash import (
    CandidateSelector,
    ConfidenceHead,
    DFlashMLP,
    DFlashRMSNorm,
    DynamicConv,
    MarkovHead,
    _rope,
    _rotate,
    around,
    scaled_rope,
)
from dflash.model.sequence_parallel import SeqShard

__all__ = ["DFlashDrafter", "DrafterCache", "DrafterSpec", "FrozenHead", "default_target_layers", "family_shift"]

_FAMILY_HEADS = ("candidate_selector.", "markov_head.", "confidence_head.")  # the families' modules beside the layers


def family_shift(family: str) -> int:
    """Slot k of a block anchored at a predicts the token at a + k + shift: 0 (slot 0 is the
    given anchor), 1 for DSpark (every slot predicts, the anchor's the next token)."""
    return 1 if family == "dspark" else 0


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """One target layer per draft layer: L//2 for one; else evenly from 1 to L-3."""
    L, n = num_target_layers, num_draft_layers
    if n == 1:
        return [L // 2]
    if L < 5:  # too shallow for the 1..L-3 rule; spread over what there is
        return sorted({round(i * (L - 1) / (n - 1)) for i in range(n)})
    return [round(1 + i * (L - 4) / (n - 1)) for i in range(n)]


@dataclass(frozen=True)
class DrafterSpec:
    """Everything that fixes the drafter's shape; written to the export's config.json."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    target_layer_ids: list[int]
    num_target_layers: int
    block_size: int
    mask_token_id: int
    layer_types: list[str]
    sliding_window: int
    sliding_causal_block: bool = True
    max_position_embeddings: int = 32768
    rope_scaling: dict[str, Any] | None = None  # the target's (llama3, yarn, ...); None: plain RoPE
    family: str = "dflash"  # "dflash", "dflash2" or "dspark" (drafter.family)
    conv_kernel_size: int = 0  # dflash2: the dynamic convolutions' taps ...
    conv_group_size: int = 0  # ... and channels per kernel
    selector_rank: int = 0  # dflash2: the candidate selector's rank ...
    selector_top_k: int = 0  # ... and candidates per slot
    markov_rank: int = 0  # dspark: the Markov head's rank
    confidence_head: bool = False  # dspark: with a confidence head ...
    confidence_with_markov: bool = False  # ... that also reads W1[prev]
    draft_vocab_size: int = 0  # V' rows of a draft vocabulary (drafter.draft_vocab_size); 0: the whole one
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def shift(self) -> int:
        return family_shift(self.family)

    @property
    def drafts(self) -> int:
        """Tokens one block drafts: B − 1, or B for DSpark."""
        return self.block_size - 1 + self.shift

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def differences(self, other: DrafterSpec) -> list[str]:
        """'name mine vs other's' for every field (but `extra`) in which the two differ."""
        a, b = self.to_dict(), other.to_dict()
        return [f"{k} {a[k]} vs {b[k]}" for k in a if k != "extra" and a[k] != b[k]]


# The building blocks are the export's own (`modeling_dflash.py`, the file AutoModel loads
# with trust_remote_code): one definition, so training and every export compute alike.
RMSNorm = DFlashRMSNorm
MLP = DFlashMLP
rope = _rope  # cos, sin of shape (R, 1, L, head_dim) for absolute positions (R, L)
_apply_rope = _rotate


_compiled_flex: Any = None


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any) -> torch.Tensor:
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if q.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=True)
        return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=True)
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)


def _masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    visible = mask.any(dim=-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~visible, enable_gqa=True)
    return out * visible.to(out.dtype)


def _group(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mod: Any, where: tuple[int, ...]) -> torch.Tensor:
    """One `GroupedMask` group (`where`: row, q0, q1, c0, c1, T): its keys and values cut from
    the whole row's here, inside the checkpoint (so backward keeps the row's tensors, not a copy
    per group), its small mask from the mask_mod, then SDPA."""
    r, q0, q1, c0, c1, T = where
    dev = q.device
    kk = torch.cat([k[r : r + 1, :, c0:c1], k[r : r + 1, :, T + q0 : T + q1]], dim=2)
    vv = torch.cat([v[r : r + 1, :, c0:c1], v[r : r + 1, :, T + q0 : T + q1]], dim=2)
    cols = torch.cat([torch.arange(c0, c1, device=dev), torch.arange(T + q0, T + q1, device=dev)])
    b, h = torch.full((), r, dtype=torch.long, device=dev), torch.zeros((), dtype=torch.long, device=dev)
    mask = mod(b, h, torch.arange(q0, q1, device=dev)[:, None], cols[None, :])
    return _masked_sdpa(q[r : r + 1, :, q0:q1], kk, vv, mask[None, None])


def _grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: GroupedMask) -> torch.Tensor:
    """Attention over a `GroupedMask`, group by group; each group recomputed in backward."""
    from torch.utils.checkpoint import checkpoint

    rows: list[list[torch.Tensor]] = [[] for _ in range(q.shape[0])]
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    for group in mask.groups:
        args = (q, k, v, mask.mod, (*group, mask.ctx_len))
        rows[group[0]].append(checkpoint(_group, *args, use_reentrant=False) if grad else _group(*args))
    return torch.cat([torch.cat(parts, dim=2) for parts in rows], dim=0)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
    """q (R, h, Q, d), k/v (R, kvh, S, d); `mask` a dense bool (R, 1, Q, S), a `GroupedMask`
    (long rows: memory linear in S) or a BlockMask.

    Fully masked rows (disabled blocks) give 0, never NaN, on every path (flex does so by
    itself; the others let them attend anywhere, then zero them).
    """
    if isinstance(mask, GroupedMask):
        return _grouped(q, k, v, mask)
    if isinstance(mask, torch.Tensor):
        visible = mask.any(dim=-1, keepdim=True)  # (R, 1, Q, 1)
        safe = mask | ~visible
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=safe, enable_gqa=True)
        return out * visible.to(out.dtype)
    # Under bf16 autocast the q/k RMS norms (fp32 weights) give fp32 q and k while v comes
    # out of a Linear in bf16; flex wants one dtype.
    return _flex(q.to(v.dtype), k.to(v.dtype), v, mask)


class Attention(nn.Module):
    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        H, hd = spec.hidden_size, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, hd
        self.q_proj = nn.Linear(H, spec.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(H, spec.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(H, spec.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(spec.num_heads * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, spec.rms_norm_eps)
        self.k_norm = RMSNorm(hd, spec.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # (R, Q, H) normed block states
        ctx: torch.Tensor,  # (R, T, H) fused context
        rope_q: tuple[torch.Tensor, torch.Tensor],
        rope_k: tuple[torch.Tensor, torch.Tensor],
        mask: Any,
        xq: torch.Tensor | None = None,
        sp: SeqShard | None = None,
    ) -> torch.Tensor:
        """`xq` (R, Q', H): the block states that ask (default: all of `x`; `rope_q` and
        `mask` then cover those Q' queries); keys and values always come from all of `x`.
        `sp`: this rank's share of a sequence-parallel group (`x`, `ctx` its blocks and context;
        `mask` the whole row's)."""
        R, Q, _ = x.shape
        T = ctx.shape[1]
        hd = self.head_dim
        xq = x if xq is None else xq
        Qq = xq.shape[1]
        q = self.q_norm(self.q_proj(xq).view(R, Qq, self.num_heads, hd)).transpose(1, 2)
        kv_in = torch.cat([ctx, x], dim=1)  # (R, T+Q, H): KV injection, same projections
        k = self.k_norm(self.k_proj(kv_in).view(R, T + Q, self.num_kv_heads, hd)).transpose(1, 2)
        v = self.v_proj(kv_in).view(R, T + Q, self.num_kv_heads, hd).transpose(1, 2)
        q = _apply_rope(q, *rope_q)
        k = _apply_rope(k, *rope_k)
        out = attend(q, k, v, mask) if sp is None else sp.attention(q, k, v, attend, mask)  # (R, h, Q', hd)
        return self.o_proj(out.transpose(1, 2).reshape(R, Qq, self.num_heads * hd))

    def context_kv(
        self, ctx: torch.Tensor, rope_c: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of context positions (R, kvh, S, hd): they depend on the context only,
        so inference computes them once per position and caches them."""
        R, S, _ = ctx.shape
        k = self.k_norm(self.k_proj(ctx).view(R, S, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(ctx).view(R, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return _apply_rope(k, *rope_c), v

    def forward_cached(
        self,
        x: torch.Tensor,  # (R, Q, H) normed block states
        cache: tuple[torch.Tensor, torch.Tensor],  # context keys/values from context_kv
        rope_q: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,  # (R, 1, Q, S+Q) dense bool
    ) -> torch.Tensor:
        R, Q, _ = x.shape
        hd = self.head_dim
        q = _apply_rope(self.q_norm(self.q_proj(x).view(R, Q, self.num_heads, hd)).transpose(1, 2), *rope_q)
        kb = self.k_norm(self.k_proj(x).view(R, Q, self.num_kv_heads, hd)).transpose(1, 2)
        vb = self.v_proj(x).view(R, Q, self.num_kv_heads, hd).transpose(1, 2)
        k = torch.cat([cache[0], _apply_rope(kb, *rope_q)], dim=2)
        v = torch.cat([cache[1], vb], dim=2)
        out = attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(R, Q, self.num_heads * hd))


class DecoderLayer(nn.Module):
    def __init__(self, spec: DrafterSpec, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)
        self.attention_conv: DynamicConv | None = None  # DFlash2: around the attention ...
        self.mlp_conv: DynamicConv | None = None  # ... and the MLP
        if spec.family == "dflash2":
            args = (spec.hidden_size, spec.conv_kernel_size, spec.conv_group_size, spec.block_size)
            self.attention_conv, self.mlp_conv = DynamicConv(*args), DynamicConv(*args)

    def forward(
        self, x: torch.Tensor, ctx: torch.Tensor, rope_q: Any, rope_k: Any, mask: Any, sp: SeqShard | None = None
    ) -> torch.Tensor:
        x = x + around(self.attention_conv, self.input_layernorm(x),
                       lambda h: self.self_attn(h, ctx, rope_q, rope_k, mask, sp=sp))  # fmt: skip
        return x + around(self.mlp_conv, self.post_attention_layernorm(x), self.mlp)

    def forward_cached(self, x: torch.Tensor, kv: Any, rope_q: Any, mask: torch.Tensor) -> torch.Tensor:
        """`forward` for one block reading cached context keys/values (inference)."""
        x = x + around(self.attention_conv, self.input_layernorm(x),
                       lambda h: self.self_attn.forward_cached(h, kv, rope_q, mask))  # fmt: skip
        return x + around(self.mlp_conv, self.post_attention_layernorm(x), self.mlp)

    def forward_drafts(
        self, x: torch.Tensor, ctx: torch.Tensor, rope_q: Any, rope_k: Any, mask: torch.Tensor, block_size: int,
        sp: SeqShard | None = None,
    ) -> torch.Tensor:
        """`forward` for the draft slots only (every slot but each block's anchor, slot 0):
        the anchors still give keys and values, but ask no query and skip the MLP. Equal to
        `forward` at the draft slots; the anchors' rows come back as they went in. For the
        last layer in training, where the anchors' outputs feed nothing (1/B of the layer's
        queries and MLP rows). `mask`: dense (R, 1, Q, S)."""
        N, B = x.shape[1] // block_size, block_size

        def drafts(tensor: torch.Tensor, dim: int) -> torch.Tensor:  # the slots 1..B-1 of every block along `dim`
            # (the mask's blocks: with sequence parallelism the whole row's, not this rank's N)
            return tensor.unflatten(dim, (-1, B)).narrow(dim + 1, 1, B - 1).flatten(dim, dim + 1)

        h = self.input_layernorm(x)
        rq = tuple(drafts(r, 2) for r in rope_q)  # (R, 1, Q, hd) -> (R, 1, N·(B-1), hd)
        y = drafts(x, 1) + self.self_attn(h, ctx, rq, rope_k, drafts(mask, 2), xq=drafts(h, 1), sp=sp)
        y = y + self.mlp(self.post_attention_layernorm(y))
        return torch.cat([x.unflatten(1, (N, B))[:, :, :1], y.unflatten(1, (N, B - 1))], dim=2).flatten(1, 2)


class DFlashDrafter(nn.Module):
    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        self.spec = spec
        k = len(spec.target_layer_ids)
        self.fc = nn.Linear(k * spec.hidden_size, spec.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(spec, layer_type) for layer_type in spec.layer_types)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        V, H, Vd = spec.vocab_size, spec.hidden_size, spec.draft_vocab_size
        if Vd:  # a draft vocabulary: the target's rows of its tokens (frozen) and the maps
            self.lm_head = _FrozenRows(Vd, H)
            self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))  # target id = row + d2t[row]
            self.register_buffer("t2d", torch.zeros(V, dtype=torch.bool))
        if spec.family == "dflash2":
            self.candidate_selector = CandidateSelector(V, H, spec.selector_rank, spec.selector_top_k, Vd)
        if spec.family == "dspark":
            self.markov_head = MarkovHead(V, spec.markov_rank, Vd)
            if spec.confidence_head:
                self.confidence_head = ConfidenceHead(H, spec.markov_rank if spec.confidence_with_markov else 0)
        # Not a buffer: `.to(bfloat16)` would round the frequencies. Kept in fp32 and moved to
        # the device where it is first needed (once per device).
        self._scaled = scaled_rope(spec.head_dim, spec.rope_theta, spec.rope_scaling, spec.max_position_embeddings)

    @torch.no_grad()
    def set_draft_vocab(self, ids: torch.Tensor, target_lm_head: torch.Tensor) -> None:  # no-sync: set-up
        """A draft vocabulary's maps and head: the target ids `ids` (V',) ascending, and the
        target's LM head (V, H) or already its rows of those ids (V', H)."""
        assert self.spec.draft_vocab_size == len(ids), "the spec's draft_vocab_size is the map's"
        own = self.d2t.device
        if len(target_lm_head) != len(ids):
            target_lm_head = target_lm_head[ids.to(target_lm_head.device)]
        self.lm_head.weight.copy_(target_lm_head.to(self.lm_head.weight))
        ids = ids.to(own)
        self.d2t.copy_(ids - torch.arange(len(ids), device=own))
        self.t2d.zero_()
        self.t2d[ids] = True

    @torch.no_grad()
    def restricted(  # no-sync: set-up (benchmarks)
        self, ids: torch.Tensor, target_lm_head: torch.Tensor | None = None
    ) -> DFlashDrafter:
        """This drafter cut to the draft vocabulary of target ids `ids` (ascending; with a draft
        vocabulary already, a subset of it): the same weights, the head, DSpark's W2 and DFlash2's
        successor codebook at those rows (`target_lm_head`: the target's, for a drafter over the
        whole vocabulary). It drafts what this one drafts wherever that lies inside (benchmarks:
        one trained drafter at several draft sizes)."""
        import dataclasses

        have, ids = self.draft_ids(), ids.cpu()
        if have is None:
            assert target_lm_head is not None, "a whole-vocabulary drafter is cut with the target's head"
            rows, head = ids, target_lm_head
        else:
            have = have.cpu()
            rows = torch.searchsorted(have, ids)
            assert torch.equal(have[rows.clamp(max=len(have) - 1)], ids), "not a subset of the draft vocabulary"
            head = self.lm_head.weight.cpu()[rows]
        out = DFlashDrafter(dataclasses.replace(self.spec, draft_vocab_size=len(ids)))
        state = {k: v.cpu() for k, v in self.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
        for name in ("markov_head.markov_w2.weight", "candidate_selector.successor_codebook"):
            if name in state:
                state[name] = state[name][rows]
        ref = self.fc.weight
        out.load_state_dict(state, strict=False)
        out.set_draft_vocab(ids, head.cpu())
        return out.to(device=ref.device, dtype=ref.dtype)

    def draft_ids(self) -> torch.Tensor | None:
        """(V',) the target id of each draft row, on the drafter's device; None without a draft vocabulary."""
        if not self.spec.draft_vocab_size:
            return None
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    def drafting_head(self, target_lm_head: torch.Tensor) -> torch.Tensor:
        """The LM head drafting reads: the draft vocabulary's rows (V', H), or the target's (V, H)."""
        return self.lm_head.weight if self.spec.draft_vocab_size else target_lm_head

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self._scaled
        if s is not None and s[0].device != positions.device:
            s = self._scaled = (s[0].to(positions.device), s[1])  # no-sync: once per device
        return rope(positions, self.spec.head_dim, self.spec.rope_theta, s)

    @property
    def scaled_rope(self) -> tuple[torch.Tensor, float] | None:
        return self._scaled

    def init_weights(self, generator: torch.Generator, std: float = 0.02) -> None:
        """N(0, std²) but norms (1), DFlash2's convolutions (the identity) and DSpark's
        confidence bias (0). The DFlash parameters draw the same numbers in every family."""
        with torch.no_grad():
            for name, p in sorted(self.named_parameters()):
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif "_conv." in name or name.startswith(_FAMILY_HEADS):
                    continue  # drawn below, after the backbone's
                else:
                    p.copy_(torch.randn(p.shape, generator=generator) * std)
            for layer in self.layers:
                for conv in (layer.attention_conv, layer.mlp_conv):
                    if conv is not None:
                        conv.reset_parameters()
            for name, p in sorted(self.named_parameters()):
                if name.startswith(_FAMILY_HEADS):
                    p.copy_(torch.randn(p.shape, generator=generator) * std if p.dim() > 1 else torch.zeros_like(p))

    @torch.no_grad()
    def init_from_target(self, target_model: nn.Module, layer_ids: list[int]) -> list[str]:
        """Warm start: draft layer i from target decoder layer max(layer_ids) + 1 + i, the
        output norm from the target's final norm, fc as an average of the captured layers.
        Copies only tensors whose names and shapes match; returns what it copied."""
        base = getattr(target_model, "model", target_model)
        t_layers = base.layers
        copied = []
        first = max(layer_ids) + 1
        for i, layer in enumerate(self.layers):
            src_i = min(first + i, len(t_layers) - 1)
            src = dict(t_layers[src_i].named_parameters())
            for name, p in layer.named_parameters():
                if name in src and src[name].shape == p.shape:
                    p.copy_(src[name].to(p.dtype))
                    copied.append(f"layers.{i}.{name}")
            if i == 0 and "input_layernorm.weight" in src:
                # The fused context is what the first copied layer reads: normalize it the same way.
                self.hidden_norm.weight.copy_(src["input_layernorm.weight"].to(self.hidden_norm.weight.dtype))
                copied.append("hidden_norm.weight")
        norm = getattr(base, "norm", None)
        if (
            norm is not None
            and getattr(norm, "weight", None) is not None
            and norm.weight.shape == self.norm.weight.shape
        ):
            self.norm.weight.copy_(norm.weight.to(self.norm.weight.dtype))
            copied.append("norm.weight")
        H, k = self.spec.hidden_size, len(layer_ids)
        self.fc.weight.copy_(torch.eye(H).repeat(1, k) / k)  # (H, k·H): the mean of the layers
        copied.append("fc.weight")
        return copied

    def forward(
        self,
        block_emb: torch.Tensor,  # (R, Q, H) embeddings of [anchor, MASK × (B-1)] per block
        context: torch.Tensor,  # (R, T, k·H) the chosen target layers, concatenated
        q_pos: torch.Tensor,  # (R, Q) absolute positions of block slots (anchor + k)
        ctx_pos: torch.Tensor,  # (R, T) absolute positions of the context
        masks: dict[str, Any],  # layer type -> mask (dense bool or BlockMask)
        drafts_only: bool = False,
        sp: SeqShard | None = None,
    ) -> torch.Tensor:
        """`drafts_only`: the rows of the blocks' anchors (slot 0) in the output are not
        computed by the last layer (training: no loss there); the draft slots' are the same.
        With dense masks only (a BlockMask cannot drop queries): ignored with flex, and where
        the anchor's row counts (`skips_anchors`). `sp`: this rank's share of a sequence-parallel
        group (dflash/model/sequence_parallel.py): the block and context tensors are its share, the
        masks the whole row's."""
        ctx = self.hidden_norm(self.fc(context))  # (R, T, H): one feature for all layers
        rope_q = self._rope(q_pos)
        rope_k = self._rope(torch.cat([ctx_pos, q_pos], dim=1))
        x = block_emb
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            mask = masks[layer.layer_type]
            if drafts_only and i == last and isinstance(mask, torch.Tensor) and self.skips_anchors:
                x = layer.forward_drafts(x, ctx, rope_q, rope_k, mask, self.spec.block_size, sp=sp)
            else:
                x = layer(x, ctx, rope_q, rope_k, mask, sp=sp)
        return self.norm(x)

    @property
    def skips_anchors(self) -> bool:
        """Whether the last layer may leave the anchors' rows out: not where the anchor's slot
        predicts (DSpark) or feeds the next slot through a convolution (DFlash2)."""
        return self.spec.family == "dflash" and self.spec.block_size > 1

    # -- inference: context keys/values cached, one block at a time ------------------------
    def extend_context(self, cache: DrafterCache, feats: torch.Tensor, positions: torch.Tensor) -> None:
        """Append context features (R, S, k·H) at absolute `positions` (R, S) to the cache."""
        ctx = self.hidden_norm(self.fc(feats))
        rope_c = self._rope(positions)
        for i, layer in enumerate(self.layers):
            cache.append(i, *layer.self_attn.context_kv(ctx, rope_c))
        cache.length += feats.shape[1]

    def forward_block(
        self, cache: DrafterCache, block_emb: torch.Tensor, q_pos: torch.Tensor, masks: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """Block states (R, Q, H) reading the cached context; masks are (R, 1, Q, S+Q)."""
        rope_q = self._rope(q_pos)
        x = block_emb
        for i, layer in enumerate(self.layers):
            kv = cache.kv[i]
            assert kv is not None, "extend_context first"
            x = layer.forward_cached(x, kv, rope_q, masks[layer.layer_type])
        return self.norm(x)


class _FrozenRows(nn.Module):
    """A draft vocabulary's LM head: the target's rows, a buffer (`lm_head.weight` in the state
    and exports, as vLLM and speculators name it), never a parameter: frozen like the whole head."""

    def __init__(self, rows: int, hidden: int) -> None:
        super().__init__()
        self.register_buffer("weight", torch.zeros(rows, hidden))


class DrafterCache:
    """Per-layer context keys/values for speculative decoding (batch of one sequence)."""

    def __init__(self, num_layers: int) -> None:
        self.kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers
        self.length = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        old = self.kv[layer]
        self.kv[layer] = (k, v) if old is None else (torch.cat([old[0], k], 2), torch.cat([old[1], v], 2))


class FrozenHead:
    """The target's embedding and LM head on one drafter device: frozen, shared, unsaved. With a
    draft vocabulary (`pruned`) the head is its rows (V', H); the embedding stays whole."""

    def __init__(self, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        self.embed = embed.detach().requires_grad_(False)  # (V, H)
        self.lm_head = lm_head.detach().requires_grad_(False)  # (V, H)

    def to(self, device: torch.device, dtype: torch.dtype) -> FrozenHead:  # no-sync: set-up
        e = self.embed.to(device=device, dtype=dtype)
        h = e if self.lm_head is self.embed else self.lm_head.to(device=device, dtype=dtype)
        return FrozenHead(e, h)

    def pruned(self, rows: torch.Tensor) -> FrozenHead:  # no-sync: set-up
        """The same embedding, the head's `rows` only (a draft vocabulary's)."""
        return FrozenHead(self.embed, self.lm_head[rows.to(self.lm_head.device)].contiguous())

    def norm_of_row(self, token_id: int) -> float:  # no-sync: set-up
        return float(self.embed[token_id].float().norm())

    def mean_row_norm(self) -> float:  # no-sync: set-up
        return float(self.embed.float().norm(dim=-1).mean())
