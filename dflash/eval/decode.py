"""DFlash speculative decoding with a trained drafter, and the target's own decoding it is
checked against (the lossless reference).

One sequence at a time, KV caches on both sides:
prefill the target on the prompt (first token from its logits, the chosen layers' outputs
become the drafter's context, cached as per-layer keys/values); then loop:
block = [last token, MASK × (B-1)] at positions start..start+B-1; the drafter proposes
B-1 tokens; the target verifies the block in one forward; accept the longest prefix where
proposal == target's greedy token, plus the target's next token (bonus); append the
accepted positions' layer outputs to the drafter's context; crop the target cache.
Sampled (temperature > 0), the proposals are drawn and verified by speculative sampling's
rule (`verify_sampled`). Several prompts at once (`speculative_generate_batch`, greedy):
the same steps over a left-padded batch, nothing cropped, hidden slots masked instead.
The layer outputs come from the same hooks as training's (`Target.forward_with_features`),
the drafter's attention masks from the same `layer_masks`. Every loop asks `should_stop`
(when given) once per step, a host-side flag read: True ends the decoding with `EvalStopped`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from dflash.model.drafter import DFlashDrafter, DrafterCache, FrozenHead
from dflash.model.families import propose, verify_lengths
from dflash.model.hf_compat import cache_kwarg, crop_cache, output_cache
from dflash.model.masks import BlockLayout, layer_masks
from dflash.model.target import Target

__all__ = [
    "GREEDY",
    "EvalStopped",
    "Sampling",
    "SpecOutput",
    "greedy_accepted",
    "greedy_generate",
    "greedy_generate_batch",
    "inference_masks",
    "speculative_generate",
    "speculative_generate_batch",
    "verify_sampled",
]


class EvalStopped(Exception):
    """A decoding ended early because its `should_stop` said so (e.g. Ctrl-C after training)."""


StopCheck = Callable[[], bool] | None  # asked once per decoding step; True: raise EvalStopped


def _check(should_stop: StopCheck) -> None:
    if should_stop is not None and should_stop():
        raise EvalStopped


@dataclass
class SpecOutput:
    tokens: list[int]
    accepted: list[int]  # per verify step: how many proposals were accepted (0..drafts)


def inference_masks(drafter: DFlashDrafter, ctx_len: int, block: int, device: torch.device) -> dict[str, torch.Tensor]:
    """(1, 1, block, ctx_len + block) per layer type, from `layer_masks` as in training.

    One block anchored right after the context: a layout with one extra (dummy) context
    slot at the anchor position, which `c < anchor` excludes, then dropped.
    """
    layout = BlockLayout(
        anchors=torch.tensor([[ctx_len]], device=device),
        valid=torch.ones(1, 1, dtype=torch.bool, device=device),
        doc_ids=torch.zeros(1, ctx_len + 1, dtype=torch.long, device=device),
        block_size=block,
    )
    # Each mask is (1, 1, block, ctx_len + 1 + block): drop the dummy slot.
    return {
        lt: torch.cat([m[..., :ctx_len], m[..., ctx_len + 1 :]], dim=-1)
        for lt, m in layer_masks(layout, drafter.spec, use_flex=False).items()
    }


def _truncate(tokens: list[int], max_new: int, stop_ids: AbstractSet[int]) -> list[int]:
    """At most `max_new` tokens, ending at (and keeping) the first stop id."""
    out = []
    for token in tokens[:max_new]:
        out.append(token)
        if token in stop_ids:
            break
    return out


def greedy_accepted(props: list[int], post: list[int], limit: int) -> int:
    """Greedy verification: how many of the first `limit` proposals equal the target's token
    at their slot (`post[i]`: its greedy token after slot i), up to the first that does not."""
    acc = 0
    while acc < limit and props[acc] == post[acc]:
        acc += 1
    return acc


def verify_sampled(
    props: list[int], q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None
) -> tuple[int, int]:
    """Speculative sampling's verification (Leviathan et al. 2023; Chen et al. 2023), which
    keeps the target's distribution exactly: proposal i (drawn from the drafter's q[i]) is
    accepted with probability min(1, p[i][x] / q[i][x]); the first rejected one is replaced by
    a draw from the normalised max(0, p[i] - q[i]); after all are accepted, a bonus token from
    p[n]. `q` (n, V), `p` (n+1, V): probabilities. Returns (accepted, next token)."""
    for i, x in enumerate(props):
        u = float(torch.rand((), generator=generator))
        if u * float(q[i, x]) <= float(p[i, x]):  # accept: u < p/q without dividing by 0
            continue
        residual = (p[i] - q[i]).clamp(min=0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else p[i]
        return i, int(torch.multinomial(dist, 1, generator=generator))
    return len(props), int(torch.multinomial(p[len(props)], 1, generator=generator))


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: greedy at temperature 0, else drawn at `temperature` from
    `generator` (and the drafter's proposals verified by speculative sampling's rule)."""

    temperature: float = 0.0
    generator: torch.Generator | None = None
    confidence: float = 0.0  # DSpark: verify only the drafts whose joint confidence stays above this (0: all)
    family_head: bool = True  # False: draft from the backbone's logits alone (`families.propose`)

    def pick(self, logits: torch.Tensor) -> int:
        """The next token from logits (V,): argmax at temperature 0, else a sample."""
        if self.temperature <= 0:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        return int(torch.multinomial(probs.cpu(), 1, generator=self.generator))

    def accept(self, props: list[int], q: torch.Tensor | None, logits: torch.Tensor) -> tuple[int, int]:
        """(accepted, next token) for `props` given the target's logits (n+1, V) over the
        block: greedy verification, or (with the drafter's q) speculative sampling's."""
        if q is not None:
            p = torch.softmax(logits.float().cpu() / self.temperature, dim=-1)  # (n+1, V)
            return verify_sampled(props, q, p, self.generator)
        post = logits.argmax(dim=-1).tolist()  # target's next token after each slot
        acc = greedy_accepted(props, post, len(props))
        return acc, post[acc]


GREEDY = Sampling()


@torch.no_grad()
def greedy_generate(
    target: Target,
    prompt: torch.Tensor,
    max_new: int,
    stop_ids: AbstractSet[int],
    sampling: Sampling = GREEDY,
    should_stop: StopCheck = None,
) -> list[int]:
    """The target alone (greedy: the lossless reference; with a temperature: sampled)."""
    model, key = target.model, cache_kwarg(target.model)
    _check(should_stop)
    out = model(input_ids=prompt[None].to(target.device), use_cache=True)
    tokens = [sampling.pick(out.logits[0, -1])]
    while len(tokens) < max_new and tokens[-1] not in stop_ids:
        _check(should_stop)
        nxt = torch.tensor([[tokens[-1]]], device=target.device)
        out = model(input_ids=nxt, use_cache=True, **{key: output_cache(out)})
        tokens.append(sampling.pick(out.logits[0, -1]))
    return _truncate(tokens, max_new, stop_ids)


class _Speculation:
    """Both models of one speculative decoding and their KV caches, over R rows."""

    def __init__(self, target: Target, drafter: DFlashDrafter, head: FrozenHead) -> None:
        self.target, self.drafter, self.head = target, drafter, head
        self.cache_key = cache_kwarg(target.model)
        self.target_device = target.device
        self.drafter_device = next(drafter.parameters()).device
        self.drafter_dtype = next(drafter.parameters()).dtype
        self.block_size, self.mask_id = drafter.spec.block_size, drafter.spec.mask_token_id
        self.shift = drafter.spec.shift  # DSpark: the anchor's slot drafts too
        self.target_cache: Any = None
        self.drafter_cache = DrafterCache(len(drafter.layers))

    def prefill(self, positions: torch.Tensor, valid: torch.Tensor | None = None, **inputs: Any) -> torch.Tensor:
        """The target over the prompts (`inputs`: its keywords); the chosen layers' outputs at
        `positions` (R, P) become the drafter's context. Returns the logits after the last slot (R, V)."""
        out, feats = self.target.forward_with_features(use_cache=True, **inputs)
        self.target_cache = output_cache(out)
        if valid is not None:
            feats = torch.where(valid[..., None].to(feats.device), feats, 0.0)  # padding: never seen, never NaN
        self.extend(feats, positions)
        return out.logits[:, -1]

    def extend(self, feats: torch.Tensor, positions: torch.Tensor) -> None:
        """Target features (R, S, k·H) at `positions` (R, S) appended to the drafter's context."""
        self.drafter.extend_context(self.drafter_cache, feats.to(self.drafter_device, self.drafter_dtype), positions)

    def draft(self, last: torch.Tensor, positions: torch.Tensor, masks: dict[str, torch.Tensor]) -> torch.Tensor:
        """The drafter's hidden states (R, bs, H) over the blocks [last token, MASK × (bs-1)]
        at `positions` (R, bs); `last` (R,)."""
        rows, size = positions.shape
        block = torch.full((rows, size), self.mask_id, dtype=torch.long, device=self.drafter_device)
        block[:, 0] = last
        emb = F.embedding(block, self.head.embed).to(self.drafter_dtype)
        return self.drafter.forward_block(self.drafter_cache, emb, positions, masks)

    def verify(self, ids: torch.Tensor, positions: torch.Tensor, **inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The target over the blocks `ids` (R, bs) at `positions`, after its cache: its logits
        (R, bs, V) and the chosen layers' outputs (R, bs, k·H)."""
        out, feats = self.target.forward_with_features(
            input_ids=ids.to(self.target_device), position_ids=positions.to(self.target_device), use_cache=True,
            **inputs, **{self.cache_key: self.target_cache},
        )  # fmt: skip
        self.target_cache = output_cache(out)
        return out.logits, feats


@torch.no_grad()
def speculative_generate(
    target: Target,
    drafter: DFlashDrafter,
    head: FrozenHead,
    prompt: torch.Tensor,
    max_new: int,
    stop_ids: AbstractSet[int],
    sampling: Sampling = GREEDY,
    should_stop: StopCheck = None,
) -> SpecOutput:
    """Greedy (temperature 0: output equal to `greedy_generate`'s), or sampled with
    speculative sampling's verification (`verify_sampled`: the target's distribution)."""
    _check(should_stop)
    state = _Speculation(target, drafter, head)
    ddev, P = state.drafter_device, prompt.numel()
    first = state.prefill(torch.arange(P, device=ddev)[None], input_ids=prompt[None].to(state.target_device))
    tokens = [sampling.pick(first[0])]
    accepted: list[int] = []
    while len(tokens) < max_new and tokens[-1] not in stop_ids:
        _check(should_stop)
        start = P + len(tokens) - 1  # absolute position of the last token: the anchor
        n = min(drafter.spec.drafts, max_new - len(tokens))  # tokens drafted
        size = n + 1 - state.shift  # the drafter's block: the anchor's slot, then masks
        q_pos = torch.arange(start, start + n + 1, device=ddev)[None]  # (1, n + 1) the verified block
        last = torch.tensor([tokens[-1]], device=ddev)
        h = state.draft(last, q_pos[:, :size], inference_masks(drafter, state.drafter_cache.length, size, ddev))
        drafting = h[:, 1 - state.shift :]
        proposals, qs = propose(
            drafter, drafting, head.lm_head, last, sampling.temperature, sampling.generator, sampling.family_head
        )
        (keep,) = verify_lengths(drafter, drafting, proposals, last, sampling.confidence, sampling.family_head)
        proposals, q, q_pos = proposals[0, :keep], None if qs is None else qs[0, :keep], q_pos[:, : keep + 1]
        logits, feats = state.verify(torch.cat([last, proposals])[None], q_pos)
        props = proposals.tolist()
        acc, nxt = sampling.accept(props, q, logits[0])
        new = [*props[:acc], nxt]
        tokens += new
        accepted.append(acc)
        if not stop_ids.isdisjoint(new):  # a stop id anywhere in the accepted tokens ends it (as the reference)
            break
        crop_cache(state.target_cache, start + acc + 1)
        state.extend(feats[:, : acc + 1], q_pos[:, : acc + 1])
    return SpecOutput(_truncate(tokens, max_new, stop_ids), accepted)


def _left_padded(prompts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts as one left-padded batch: ids (R, P), valid (R, P) bool, positions (R, P)."""
    P = max(p.numel() for p in prompts)
    ids = torch.zeros(len(prompts), P, dtype=torch.long)
    valid = torch.zeros(len(prompts), P, dtype=torch.bool)
    for r, p in enumerate(prompts):
        ids[r, P - p.numel() :] = p
        valid[r, P - p.numel() :] = True
    return ids, valid, (valid.long().cumsum(1) - 1).clamp(min=0)


def _batch_masks(
    drafter: DFlashDrafter, valid: torch.Tensor, ctx_lens: list[int], sizes: list[int], block: int
) -> dict[str, torch.Tensor]:
    """Per layer type (R, 1, block, S + block): row r's `inference_masks` for its own context
    (`ctx_lens[r]` positions, found at the slots `valid[r]` marks among the cache's S) and
    its own block size `sizes[r]` (the slots past it are left out, as a shorter block would
    be; each such slot sees only itself, so no row of the softmax is empty)."""
    R, S = valid.shape
    out: dict[str, torch.Tensor] = {}
    slots = [torch.nonzero(valid[r]).flatten() for r in range(R)]
    for r in range(R):
        L, bs = ctx_lens[r], sizes[r]
        for lt, m in inference_masks(drafter, L, bs, valid.device).items():
            if lt not in out:
                out[lt] = torch.zeros(R, 1, block, S + block, dtype=torch.bool, device=valid.device)
                idx = torch.arange(block, device=valid.device)
                out[lt][:, 0, idx, S + idx] = True
            out[lt][r, 0, :bs, slots[r]] = m[0, 0, :, :L]
            out[lt][r, 0, :bs, S : S + bs] = m[0, 0, :, L:]
    return out


@dataclass
class _Row:
    """One prompt's progress in a batched speculative decoding."""

    tokens: list[int]
    context: int  # its positions in the caches so far: the next block's anchor
    done: bool
    accepted: list[int] = field(default_factory=list)

    def block_size(self, block: int, max_new: int, shift: int = 0) -> int:
        """The slots of the next drafter block it uses (a finished row: its anchor only);
        it drafts this many − 1 + `shift` tokens."""
        return 1 if self.done else min(block, max_new - len(self.tokens) + 1 - shift)

    def take(self, props: list[int], post: list[int], n: int, max_new: int, stop_ids: AbstractSet[int]) -> int:
        """Greedy verification of its first `n` proposals against the target's tokens `post`;
        returns how many were accepted."""
        acc = greedy_accepted(props, post, n)
        new = [*props[:acc], post[acc]]
        self.tokens += new
        self.accepted.append(acc)
        self.context += acc + 1
        self.done = len(self.tokens) >= max_new or not stop_ids.isdisjoint(new)
        return acc


@torch.no_grad()
def speculative_generate_batch(
    target: Target,
    drafter: DFlashDrafter,
    head: FrozenHead,
    prompts: Sequence[torch.Tensor],
    max_new: int,
    stop_ids: AbstractSet[int],
    should_stop: StopCheck = None,
    confidence: float = 0.0,
    family_head: bool = True,
) -> list[SpecOutput]:
    """Greedy speculative decoding of several prompts at once: each verify step is one target
    forward over every row's block (on a CPU or a GPU, R rows cost far less than R forwards).

    Each row keeps its own positions. Nothing is cropped: every step appends a block's B slots
    to both KV caches, and the slots of rejected proposals (and a finished row's) stay there,
    hidden by the attention masks from then on. Row r's drafter sees exactly the context and
    block `speculative_generate` gives it (`_batch_masks`), so each row's tokens and verify
    steps equal the one-prompt loop's, up to the float rounding of batched matmuls."""
    _check(should_stop)
    state = _Speculation(target, drafter, head)
    R, B, ddev, dev = len(prompts), state.block_size, state.drafter_device, state.target_device
    shift = state.shift
    span = B + shift  # each step verifies the anchor and the tokens drafted after it
    ids, valid, pos = _left_padded(prompts)
    first = state.prefill(
        pos.to(ddev), valid, input_ids=ids.to(dev), attention_mask=valid.long().to(dev), position_ids=pos.to(dev)
    )
    rows = [_Row([tok], p.numel(), False) for tok, p in zip(first.argmax(dim=-1).tolist(), prompts, strict=True)]
    for row in rows:
        row.done = len(row.tokens) >= max_new or row.tokens[-1] in stop_ids
    valid = valid.to(ddev)  # (R, S): the cache slots each row sees, growing by `span` a step
    while not all(row.done for row in rows):
        _check(should_stop)
        sizes = [row.block_size(B, max_new, shift) for row in rows]
        q_pos = torch.tensor([row.context for row in rows], device=ddev)[:, None] + torch.arange(span, device=ddev)
        last = torch.tensor([row.tokens[-1] for row in rows], device=ddev)
        h = state.draft(last, q_pos[:, :B], _batch_masks(drafter, valid, [row.context for row in rows], sizes, B))
        proposals, _ = propose(drafter, h[:, 1 - shift :], head.lm_head, last, family_head=family_head)  # (R, span - 1)
        keep = verify_lengths(drafter, h[:, 1 - shift :], proposals, last, confidence, family_head)
        attn = torch.cat([valid, torch.ones(R, span, dtype=torch.bool, device=ddev)], dim=1).long().to(dev)
        logits, feats = state.verify(torch.cat([last[:, None], proposals], dim=1), q_pos, attention_mask=attn)
        post = logits.argmax(dim=-1).tolist()  # (R, span): the target's token after each slot
        props = proposals.tolist()
        seen = torch.zeros(R, span, dtype=torch.bool)
        for r, row in enumerate(rows):
            if not row.done:
                n = min(sizes[r] - 1 + shift, keep[r])
                seen[r, : row.take(props[r], post[r], n, max_new, stop_ids) + 1] = True
        valid = torch.cat([valid, seen.to(ddev)], dim=1)
        state.extend(feats, q_pos)
    return [SpecOutput(_truncate(row.tokens, max_new, stop_ids), row.accepted) for row in rows]


@torch.no_grad()
def greedy_generate_batch(
    target: Target,
    prompts: Sequence[torch.Tensor],
    max_new: int,
    stop_ids: AbstractSet[int],
    should_stop: StopCheck = None,
) -> list[list[int]]:
    """The target alone, greedy, several prompts at once (left-padded): `greedy_generate` row
    by row, up to the float rounding of batched matmuls."""
    model, key, dev = target.model, cache_kwarg(target.model), target.device
    _check(should_stop)
    ids, valid, pos = _left_padded(prompts)
    valid = valid.to(dev)
    out = model(input_ids=ids.to(dev), attention_mask=valid.long(), position_ids=pos.to(dev), use_cache=True)
    nxt = out.logits[:, -1].argmax(dim=-1)
    tokens = [[token] for token in nxt.tolist()]
    last = torch.tensor([p.numel() - 1 for p in prompts], device=dev)
    done = [row[-1] in stop_ids for row in tokens]
    while len(tokens[0]) < max_new and not all(done):
        _check(should_stop)
        valid = torch.cat([valid, torch.ones(len(prompts), 1, dtype=torch.bool, device=dev)], dim=1)
        last = last + 1
        out = model(
            input_ids=nxt[:, None], attention_mask=valid.long(), position_ids=last[:, None], use_cache=True,
            **{key: output_cache(out)},
        )  # fmt: skip
        nxt = out.logits[:, -1].argmax(dim=-1)
        for r, token in enumerate(nxt.tolist()):
            tokens[r].append(token)
            done[r] = done[r] or token in stop_ids
    return [_truncate(row, max_new, stop_ids) for row in tokens]
