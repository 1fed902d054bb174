"""Labels, γ-decayed weights and the chunked block loss.

Block slot k (k >= 1) of the block anchored at a predicts the token at a + k — no shift:
the slot *is* that position. Slot 0 (the anchor itself) has no loss. A slot counts when
its block is valid, a + k lies inside the row and the anchor's document, and the loss mask
is 1 there. Weights w_k = exp(-(k-1)/γ), w_0 = 0.

The step loss is Σ w·CE / Σ w over the whole optimizer step (all micro-batches and
replicas): each micro-batch returns its numerator (a tensor, for backward) and its
denominator (a host float, known before any device work), and the optimizer divides.

Every setting of the loss (the `[loss]` section, with the drafter's block size and γ) is one
`LossSpec`, built once from the config and read by the step's prepare phase and `block_loss`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash.config import Config
from dflash.model.drafter import family_shift

__all__ = [
    "BlockTargets", "FamilyTerms", "LossParts", "LossSpec", "LossVocab", "as_rows", "block_loss", "block_targets",
    "dpace_weights", "draft_rows", "gamma_weights", "reveal_slots",
]  # fmt: skip


@dataclass(frozen=True)
class LossSpec:
    """Every setting of the training loss, in one place: `[loss]` of the config, plus the
    drafter's block size and its γ (`LossSpec.from_config`). The defaults are the config's."""

    block_size: int  # B: anchor + B-1 predicted slots
    chunk: int = 1024  # rows of LM head + CE at once (bounds the [rows, V] logits)
    position_weights: Literal["gamma", "dpace"] = "gamma"
    gamma: float = 7.0  # position_weights = "gamma": w_k = exp(-(k-1)/γ) (drafter.resolved_gamma)
    dpace_alpha: float = 0.5  # position_weights = "dpace": confidence smoothing
    labels: Literal["data", "target"] = "data"  # the data's next token, or the target's greedy one
    greedy_prefix_only: bool = False  # target labels: later slots count only after greedy data tokens
    distill: float = 0.0  # weight of the target's top-k distribution against the hard labels
    distill_topk: int = 32
    distill_temperature: float = 1.0
    vocab: Literal["full", "data"] = "full"  # the softmax over every token, or the data's (LossVocab)
    negatives: int = 4096  # vocab = "data": sampled negatives per micro-batch
    noise_reveal_start: float = 0.0  # chance a slot shows its true token at step 0 ...
    noise_reveal_end: float = 0.0  # ... and at the last step (linear in between)
    selector_loss: float = 1.0  # DFlash2: the selector's cross-entropy weight (drafter.dflash2)
    confidence_loss: float = 1.0  # DSpark: the confidence head's BCE weight (drafter.dspark)
    shift: int = 0  # DrafterSpec.shift: 1 for DSpark (slot k predicts the token k + 1 after the anchor)

    @classmethod
    def from_config(cls, cfg: Config) -> LossSpec:
        d = cfg.drafter
        return cls(
            block_size=d.block_size, gamma=d.resolved_gamma, selector_loss=d.dflash2.selector_loss,
            confidence_loss=d.dspark.confidence_loss, shift=family_shift(d.family),
            **cfg.loss.model_dump(),
        )  # fmt: skip

    @property
    def dpace(self) -> bool:
        return self.position_weights == "dpace"

    @property
    def target_labels(self) -> bool:
        return self.labels == "target"

    @property
    def teacher_topk(self) -> int:
        """How many of the target's next-token logits each position keeps: distillation's
        top-k, else 1 for target labels (the greedy token), else none (the target stops at its
        last chosen layer)."""
        if self.distill > 0:
            return self.distill_topk
        return 1 if self.target_labels else 0


@dataclass(frozen=True)
class LossVocab:
    """`loss.vocab = "data"`: the training loss's softmax over the data's tokens plus,
    each micro-batch, `loss.negatives` tokens drawn from the rest (sampled softmax): the
    rest must be pushed down too, or at inference (whole vocabulary) tokens the loss never saw
    win the argmax. Each drawn token stands
    for `len(outside) / K` of them: its logit gets log of that (logQ correction), so the
    softmax's normaliser estimates the whole vocabulary's.

    `lm_head` (V', H): the LM head's rows of the data's tokens; `index` (V,): each token's
    row there, -1 outside (such a label counts 0); `outside` (V - V',): the other ids;
    `bias` (V' + K,): the logit bias of a head with K drawn negatives (None: K = 0)."""

    NEGATIVES = 4096  # the default of loss.negatives

    lm_head: torch.Tensor
    index: torch.Tensor
    outside: torch.Tensor
    bias: torch.Tensor | None
    ids: torch.Tensor | None = None  # (V',) the token of each of the data's rows
    _heads: dict[tuple[torch.dtype, int], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(  # no-sync: set-up
        cls, lm_head: torch.Tensor, tokens: torch.Tensor, negatives: int = NEGATIVES
    ) -> LossVocab:
        dev = lm_head.device
        ids = torch.unique(tokens).to(dev)  # sorted
        index = torch.full((lm_head.shape[0],), -1, dtype=torch.long, device=dev)
        index[ids] = torch.arange(len(ids), device=dev)
        outside = (index < 0).nonzero().flatten()
        k = min(negatives, len(outside))
        bias = None
        if k:
            bias = torch.zeros(len(ids) + k, device=dev)
            bias[len(ids) :] = math.log(len(outside) / k)
        return cls(lm_head[ids].contiguous(), index, outside, bias, ids)

    def cols(self, drawn: torch.Tensor) -> torch.Tensor:
        """The token id of each row of `head(full, drawn)` (V' + K,)."""
        assert self.ids is not None
        return torch.cat([self.ids, self.outside.index_select(0, drawn)])

    def draw(self, generator: torch.Generator) -> torch.Tensor:
        """Positions into `outside` of one micro-batch's K negatives (host, with replacement)."""
        k = 0 if self.bias is None else len(self.bias) - len(self.lm_head)
        return torch.randint(len(self.outside), (k,), generator=generator) if k else torch.zeros(0, dtype=torch.long)

    def labels(self, labels: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token labels as rows of the loss's head; a label outside the data's tokens gets
        weight 0 and -100 (cross_entropy's ignore_index: loss 0, never "correct")."""
        return as_rows(self.index, labels, weights)

    def head(
        self, full: torch.Tensor, drawn: torch.Tensor, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The loss's LM head (V' + K, H) in `dtype` (default: `full`'s; under autocast, the
        one its matmul computes in) and logit bias for `drawn` (device ids into `outside`).

        One buffer per dtype, the data's rows written into it once and only the K drawn rows
        each call: copying (and, under autocast, casting) the whole head every micro-batch is
        a visible share of a CPU step. A call's head is read until its backward has run, and
        the replica's next call comes after that (on a GPU, later on the same stream)."""
        dtype = dtype or full.dtype
        n = len(self.lm_head)
        buf = self._heads.get((dtype, len(drawn)))
        if buf is None:
            buf = self._heads[dtype, len(drawn)] = torch.empty(
                n + len(drawn), full.shape[1], dtype=dtype, device=full.device
            )
            buf[:n] = self.lm_head
        if not len(drawn):
            return buf, None
        buf[n:] = full.index_select(0, self.outside.index_select(0, drawn))
        return buf, self.bias


def as_rows(
    index: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token labels as rows of a head over some of the tokens (`index` (V,): each token's row, -1
    outside); a label outside gets weight 0 and -100 (cross_entropy's ignore_index: loss 0,
    never "correct")."""
    at = index[labels]
    return torch.where(at >= 0, at, -100), weights * (at >= 0)


def draft_rows(
    index: torch.Tensor,  # (V,) each target id's draft row, -1 outside the draft vocabulary
    labels: torch.Tensor,  # (M,) target ids
    weights: torch.Tensor,  # (M,)
    teacher: tuple[torch.Tensor, torch.Tensor] | None,  # (M, k) the target's top-k logits and ids
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Supervision over a draft vocabulary (`drafter.draft_vocab_size`): labels as its rows; a
    label outside gets weight 0 and -100 (cross_entropy's ignore_index): it still counts as a
    slot, never as drafted right (`tau_sim` stays honest), and Σ w is unchanged, so its share
    lowers the loss's scale by that much. The teacher's top-k is restricted to the draft
    vocabulary and renormalised (the ids outside get -inf, speculators' restricted target
    distribution); a row whose top-k lies wholly outside gets weight 0 too."""
    labels, weights = as_rows(index, labels, weights)
    if teacher is not None:
        vals, ids = teacher
        rows = index[ids]
        kept = rows >= 0
        weights = weights * kept.any(dim=-1)
        vals = torch.where(kept, vals.float(), float("-inf"))
        vals = torch.where(kept.any(dim=-1, keepdim=True), vals, 0.0)  # a wholly-outside row: weight 0, finite
        teacher = (vals, rows.clamp(min=0))
    return labels, weights, teacher


def gamma_weights(block_size: int, gamma: float, shift: int = 0) -> torch.Tensor:
    """(B,) float: w_0 = 0, w_k = exp(-(k-1)/γ) for k >= 1; with `shift` 1 (DSpark: slot k
    predicts the token k + 1 after the anchor) w_k = exp(-k/γ)."""
    return torch.tensor([0.0 if k + shift < 1 else math.exp(-(k + shift - 1) / gamma) for k in range(block_size)])


@dataclass(frozen=True)
class BlockTargets:
    """Host-side supervision for one micro-batch, computed before any device work."""

    sel: torch.Tensor  # (M,) int64 flat indices into the (R·N·B) block slots that count
    labels: torch.Tensor  # (M,) int64 token ids
    weights: torch.Tensor  # (M,) float w_k
    slot: torch.Tensor  # (M,) int64 block offset k of each selected slot
    weight_sum: float  # Σ w over the selected slots
    count_per_slot: torch.Tensor  # (B,) int64 how many slots of each offset count
    teacher: tuple[torch.Tensor, torch.Tensor] | None = None  # (M, k) top-k target logits and ids, distillation
    prev: torch.Tensor | None = None  # (M,) int64 the data's token before each label (DFlash2, DSpark)


def block_targets(
    input_ids: torch.Tensor,  # (R, T)
    loss_mask: torch.Tensor,  # (R, T)
    doc_ids: torch.Tensor,  # (R, T)
    anchors: torch.Tensor,  # (R, N)
    valid: torch.Tensor,  # (R, N)
    block_size: int,
    gamma: float,
    reveal: torch.Tensor | None = None,  # (R, N, B) bool: slots given their true token
    shift: int = 0,  # DrafterSpec.shift: slot k predicts the token at anchor + k + shift
) -> BlockTargets:
    """Which block slots count, their labels, weights and the tokens before the labels.
    Revealed slots have no loss."""
    R, T = input_ids.shape
    B = block_size
    pos = anchors[:, :, None] + torch.arange(B) + shift  # (R, N, B) the labels' positions
    inside = pos < T
    p = pos.clamp(max=T - 1).reshape(R, -1)
    labels = torch.gather(input_ids, 1, p).view_as(pos)
    prev = torch.gather(input_ids, 1, (p - 1).clamp(min=0)).view_as(pos)
    same_doc = torch.gather(doc_ids, 1, p).view_as(pos) == torch.gather(doc_ids, 1, anchors)[:, :, None]
    supervised = torch.gather(loss_mask.bool(), 1, p).view_as(pos)
    m = valid[:, :, None] & inside & same_doc & supervised
    if shift == 0:
        m[:, :, 0] = False  # the anchor itself
    if reveal is not None:
        m &= ~reveal
    sel = torch.nonzero(m.flatten()).flatten()
    slot = sel % B
    w = gamma_weights(B, gamma, shift)
    weights = w[slot]
    return BlockTargets(
        sel=sel,
        labels=labels.flatten()[sel],
        weights=weights,
        slot=slot,
        weight_sum=float(weights.sum()),  # no-sync: labels and weights are built on the host
        count_per_slot=torch.bincount(slot, minlength=B),
        prev=prev.flatten()[sel],
    )


def reveal_slots(
    input_ids: torch.Tensor,
    doc_ids: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    prob: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The noise schedule's draw: each slot k >= 1 of a valid block whose position lies in
    the anchor's document shows its true token with probability `prob` (else the mask
    token). Returns reveal (R, N, B) bool and the true tokens (R, N, B)."""
    R, T = input_ids.shape
    pos = anchors[:, :, None] + torch.arange(block_size)
    p = pos.clamp(max=T - 1).reshape(R, -1)
    tokens = torch.gather(input_ids, 1, p).view_as(pos)
    same_doc = torch.gather(doc_ids, 1, p).view_as(pos) == torch.gather(doc_ids, 1, anchors)[:, :, None]
    reveal = (torch.rand(pos.shape, generator=generator) < prob) & valid[:, :, None] & (pos < T) & same_doc
    reveal[:, :, 0] = False
    return reveal, tokens


@dataclass
class LossParts:
    loss_sum: torch.Tensor  # () Σ w·CE, differentiable
    weight_sum: float  # Σ w
    correct_per_slot: torch.Tensor  # (B,) float, argmax == label, on device (no sync)
    count_per_slot: torch.Tensor  # (B,) int64, host
    # (3,) detached: Σ w·(1−d)·CE, Σ w·d·distillation, Σ w·the family's terms (they add up to loss_sum)
    part_sums: torch.Tensor | None = None


def dpace_weights(
    label_prob: torch.Tensor, sel: torch.Tensor, num_blocks: int, block_size: int, alpha: float
) -> torch.Tensor:
    """D-PACE's per-slot weights (Wu et al. 2026, "Dynamic Position-Aware Cross-Entropy"):
    the gradient of a smooth accepted-length surrogate E[L] = Σ_k Π_{i≤k} s_i with respect to
    each slot's log s_i, s_i = (1 − α)·p_i + α the smoothed probability the drafter
    gives slot i's label. Slot j's weight is Σ_{k≥j} Π_{i≤k} s_i over the supervised slots of
    its block: large where the slots before it are already right, so training moves to the
    positions that limit acceptance now. Unnormalised: a block's weights sum to between
    ~α-powers and B − 1, so the step's scale grows as the drafter improves (Adam absorbs most
    of it). `label_prob` (M,) for the selected slots `sel` (flat indices into
    num_blocks × block_size); returns (M,), no gradient."""
    with torch.no_grad():
        grid = torch.ones(num_blocks * block_size, device=label_prob.device)
        grid[sel] = (1 - alpha) * label_prob.float() + alpha
        mask = torch.zeros_like(grid)
        mask[sel] = 1.0
        prefix = torch.cumprod(grid.view(num_blocks, block_size), dim=-1) * mask.view(num_blocks, block_size)
        suffix = prefix.flip(-1).cumsum(-1).flip(-1)  # Σ_{k≥j} prefix_k
        return suffix.reshape(-1)[sel]


class FamilyTerms(Protocol):
    """What a drafter family adds to the loss of a chunk of supervised rows (`dflash.model.
    dflash2`, `dspark`): from the unary logits (m, V'), the rows' states (m, H), labels and
    the tokens before them (m,), the token id of each logit column (`cols`; None: the column
    is the id) and the sampled softmax's logit bias in `logits` (`bias`, or None), the logits
    the cross-entropy reads, an extra loss per row (or None) and whether what the family
    drafts is the label (or None: the argmax is what it drafts)."""

    def __call__(
        self, logits: torch.Tensor, h: torch.Tensor, labels: torch.Tensor, prev: torch.Tensor,
        cols: torch.Tensor | None, teacher: tuple[torch.Tensor, torch.Tensor] | None,
        bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]: ...  # fmt: skip


def _chunk_loss(
    h: torch.Tensor,
    head: torch.Tensor,
    labels: torch.Tensor,
    t_vals: torch.Tensor | None = None,
    t_idx: torch.Tensor | None = None,
    distill: float = 0.0,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    terms: FamilyTerms | None = None,
    prev: torch.Tensor | None = None,
    cols: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: the loss, the family's extra loss (0 without one), whether what the drafter
    drafts is the label, the label's probability, and the distillation's share of the loss
    (d·its term, detached; None without distillation)."""
    logits = (h @ head.t()).float()  # (chunk, V)
    if bias is not None:  # sampled softmax's logQ correction (loss.vocab)
        logits = logits + bias
    extra = drafted_ok = None
    if terms is not None and prev is not None:
        teacher = (t_vals, t_idx) if t_vals is not None and t_idx is not None else None
        logits, extra, drafted_ok = terms(logits, h, labels, prev, cols, teacher, bias)
    ce = F.cross_entropy(logits, labels, reduction="none")
    label_prob = torch.where(labels >= 0, torch.exp(-ce.detach()), 0.0)  # an ignored label (-100) is no sure slot
    soft_part = None
    if t_vals is not None and t_idx is not None and distill > 0:
        # Cross-entropy to the target's top-k distribution (= KL to it plus its entropy, a
        # constant): same gradient as the KL, over the k tokens the target thinks likely.
        # Times T², as in Hinton et al.: softened gradients shrink as 1/T², and the factor keeps
        # the soft term's weight against the hard one the same at any temperature.
        logp = F.log_softmax(logits / temperature, dim=-1).gather(1, t_idx)  # (chunk, k)
        soft = -(F.softmax(t_vals.float() / temperature, dim=-1) * logp).sum(-1) * temperature**2
        ce = (1 - distill) * ce + distill * soft
        soft_part = distill * soft.detach()
    # max's index is argmax's (the first of tied maxima), and cheaper on a CPU.
    correct = (logits.detach().max(dim=-1).indices == labels) if drafted_ok is None else drafted_ok
    return ce, torch.zeros_like(ce) if extra is None else extra, correct.float(), label_prob, soft_part


def _chunk_losses(
    h: torch.Tensor,
    lm_head: torch.Tensor,
    labels: torch.Tensor,
    teacher: tuple[torch.Tensor, torch.Tensor] | tuple[None, None],
    prev: torch.Tensor | None,
    spec: LossSpec,
    logit_bias: torch.Tensor | None,
    terms: FamilyTerms | None,
    cols: torch.Tensor | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """`_chunk_loss` over the supervised rows `spec.chunk` at a time: each chunk's losses, the
    family's extra losses, whether what is drafted is the label (detached), the label's
    probability and the distillation's share (None without it)."""
    chunk, distill, temperature = spec.chunk, spec.distill, spec.distill_temperature
    tv, ti = teacher
    several = h.shape[0] > chunk
    losses, extras, oks, probs, softs = [], [], [], [], []
    for s in range(0, h.shape[0], chunk):
        e = s + chunk
        soft = (tv[s:e], ti[s:e]) if tv is not None and ti is not None else (None, None)
        args = (h[s:e], lm_head, labels[s:e], *soft, distill, temperature, logit_bias, terms,
                None if prev is None else prev[s:e], cols)  # fmt: skip
        if several:
            # Recompute each chunk's logits in backward rather than keep every [chunk, V] alive.
            part, more, ok, prob, soft = checkpoint(_chunk_loss, *args, use_reentrant=False)
        else:  # a single chunk: keeping its logits stays within the bound; skip the recompute
            part, more, ok, prob, soft = _chunk_loss(*args)
        losses.append(part)
        extras.append(more)
        oks.append(ok.detach())
        probs.append(prob)
        if soft is not None:
            softs.append(soft)
    return losses, extras, oks, probs, softs


def _weighted_sum(
    total: torch.Tensor,
    losses: list[torch.Tensor],
    extras: list[torch.Tensor] | None,
    probs: list[torch.Tensor],
    weights: torch.Tensor,
    sel: torch.Tensor,
    slot: torch.Tensor,
    num_blocks: int,
    spec: LossSpec,
    softs: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """`total` + Σ w·loss over the rows (+ Σ w·the family's extra loss: `extras`, None without
    family terms), and the same sums by part, detached (3,): CE, distillation, the family's
    terms. With D-PACE the loss's weights are times `dpace_weights` of this forward; the
    family's terms keep the γ decay."""
    per_row = torch.cat(losses)
    extra_weights = weights
    if spec.dpace:
        weights = weights * dpace_weights(torch.cat(probs), sel, num_blocks, spec.block_size, spec.dpace_alpha)
        # the family's terms keep the γ decay (D-PACE weighs a token cross-entropy), as speculators
        k = (slot + spec.shift - 1).float()  # gamma_weights at each row's slot, on the device
        extra_weights = extra_weights * torch.where(k >= 0, torch.exp(-k.clamp(min=0) / spec.gamma), 0.0)
    token = (per_row * weights).sum()
    total = total + token
    family = torch.zeros((), device=total.device)
    if extras is not None:
        family = (torch.cat(extras) * extra_weights).sum()
        total = total + family
    token = token.detach()
    soft = (torch.cat(softs) * weights).sum() if softs else torch.zeros_like(token)  # d·distillation's share
    return total, torch.stack([token - soft, soft, family.detach()])


def block_loss(
    hidden: torch.Tensor,  # (R, N·B, H) drafter output
    lm_head: torch.Tensor,  # (V, H) frozen
    targets: BlockTargets,
    spec: LossSpec,
    logit_bias: torch.Tensor | None = None,
    terms: FamilyTerms | None = None,
    cols: torch.Tensor | None = None,
) -> LossParts:
    """Σ w·loss over the supervised slots: cross-entropy to the labels, mixed with weight
    `spec.distill` with the cross-entropy to the target's top-k distribution (`targets.teacher`).
    With D-PACE position weights, each slot's host weight (1 for D-PACE: Σ w counts the slots)
    is multiplied by its D-PACE weight (`dpace_weights`), computed from this forward.
    `logit_bias` (V,): added to every row's logits (sampled softmax's correction); `terms`:
    the drafter family's additions (`FamilyTerms`), `cols` the token ids of the head's rows
    (sampled softmax; None: all of them, in order)."""
    block_size = spec.block_size
    dev = hidden.device
    H = hidden.shape[-1]
    # The drafter step uploads the targets while preparing (these are then no-ops); from
    # other callers (tests, CPU) they are host tensors on the host.
    sel = targets.sel.to(dev, non_blocking=True)  # no-sync: uploaded in prepare
    h = hidden.reshape(-1, H).index_select(0, sel)  # (M, H) contiguous: fast LM head
    labels = targets.labels.to(dev, non_blocking=True)  # no-sync: uploaded in prepare
    weights = targets.weights.to(dev, dtype=torch.float32, non_blocking=True)  # no-sync: uploaded in prepare
    slot = targets.slot.to(dev, non_blocking=True)  # no-sync: uploaded in prepare
    soft = targets.teacher is not None and (spec.distill > 0 or terms is not None)  # the family's terms read it too
    teacher = targets.teacher if soft else (None, None)
    prev = None
    if terms is not None and targets.prev is not None:
        prev = targets.prev.to(dev, non_blocking=True)  # no-sync: uploaded in prepare
    losses, extras, oks, probs, softs = _chunk_losses(h, lm_head, labels, teacher, prev, spec, logit_bias, terms, cols)
    correct = torch.zeros(block_size, device=dev)
    # Starts from 0·Σhidden so backward works (zero grads) even with nothing supervised.
    total = hidden.sum().float() * 0.0
    parts = torch.zeros(3, device=dev)
    if losses:
        num_blocks = hidden.shape[0] * (hidden.shape[1] // block_size)
        family = extras if terms is not None else None
        total, parts = _weighted_sum(total, losses, family, probs, weights, sel, slot, num_blocks, spec, softs)
        correct.index_add_(0, slot, torch.cat(oks))
    return LossParts(total, targets.weight_sum, correct, targets.count_per_slot, parts)
