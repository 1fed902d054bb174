"""DSpark's additions to the DFlash backbone: a Markov logit bias drafted left to right and a
confidence head. Every slot of a block predicts (the anchor's slot the token after the
anchor: `DrafterSpec.shift` = 1), so a block of B slots drafts B tokens.

Training: slot k's logits are the unary ones plus W2·W1[prev], prev the data's token before
its label (the anchor for slot 0); the cross-entropy reads them (speculators' "compound"
loss with one term). The confidence head learns, by binary cross-entropy (weight
`drafter.dspark.confidence_loss`), the chance the slot's draft is accepted: the overlap
Σ_v min(q_v, p_v) of the drafter's distribution q with the target's p (1 − TV) — p the
target's top-k renormalised where the features carry it (loss.labels = "target" or
distillation, full vocabulary), else the label's one-hot, for which the overlap is q(label).
Drafting: the tokens one by one from the anchor, each biased by the one before it; a
confidence threshold (`drafter.dspark.confidence_threshold`) can end the draft early.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash.model.modeling_dflash import ConfidenceHead, MarkovHead

__all__ = ["MarkovTerms", "confident", "draft"]


class MarkovTerms:
    """The Markov-biased logits and the confidence head's BCE per supervised row (`FamilyTerms`)."""

    def __init__(self, markov: MarkovHead, confidence: ConfidenceHead | None, weight: float) -> None:
        self.markov, self.confidence, self.weight = markov, confidence, weight

    def __call__(
        self, logits: torch.Tensor, h: torch.Tensor, labels: torch.Tensor, prev: torch.Tensor,
        cols: torch.Tensor | None, teacher: tuple[torch.Tensor, torch.Tensor] | None = None,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, None]:  # fmt: skip
        z = logits + self.markov.bias(prev, cols).float()
        if self.confidence is None:
            return z, None, None
        with torch.no_grad():
            accept = overlap(z, labels, teacher if cols is None else None)
        prev_emb = self.markov.markov_w1(prev) if self.confidence.proj.in_features > h.shape[-1] else None
        c = self.confidence(h, prev_emb)
        return z, self.weight * F.binary_cross_entropy_with_logits(c, accept, reduction="none"), None


def overlap(z: torch.Tensor, labels: torch.Tensor, teacher: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """Σ_v min(q_v, p_v) per row, q = softmax(z): p the target's top-k (renormalised) when
    given, else the label's one-hot (then q(label))."""
    q = torch.softmax(z.float(), dim=-1)
    if teacher is None:
        return q.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    vals, idx = teacher
    p = torch.softmax(vals.float(), dim=-1)
    return torch.minimum(q.gather(1, idx), p).sum(-1)


def draft(
    markov: MarkovHead,
    logits: torch.Tensor,  # (R, n, V) unary logits of the n drafting slots
    anchor: torch.Tensor,  # (R,)
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    ids: torch.Tensor | None = None,  # (V',) a draft vocabulary's target id of each logit column
) -> tuple[torch.Tensor, torch.Tensor | None]:  # no-sync: decoding (eval), off the training path
    """The drafted tokens (R, n), left to right from the anchor; sampled (temperature > 0),
    also the distributions they were drawn from (R, n, V), on the host. With `ids`, the logits
    are a draft vocabulary's rows: the tokens are target ids, the distributions over the rows."""
    prev, out, qs = anchor, [], []
    for slot in range(logits.shape[1]):
        z = logits[:, slot].float() + markov.bias(prev).float()
        if temperature <= 0:
            pick = z.argmax(dim=-1)
        else:
            q = torch.softmax(z.cpu() / temperature, dim=-1)
            pick = torch.multinomial(q, 1, generator=generator).squeeze(1).to(z.device)
            qs.append(q)
        pick = pick if ids is None else ids[pick]  # W1 reads target ids
        out.append(pick)
        prev = pick
    return torch.stack(out, dim=1), torch.stack(qs, dim=1) if qs else None


def confident(
    model: torch.nn.Module,
    h: torch.Tensor,  # (R, n, H) the drafting slots' states
    tokens: torch.Tensor,  # (R, n) their drafted tokens
    anchor: torch.Tensor,  # (R,)
    threshold: float,
) -> torch.Tensor:  # no-sync: decoding (eval), off the training path
    """How many of each row's drafts to verify (R,): the longest prefix whose product of
    confidences (the chance all are accepted) stays at or above `threshold`, at least one;
    all of them without a confidence head."""
    R, n, _ = h.shape
    head: ConfidenceHead | None = getattr(model, "confidence_head", None)
    if head is None or threshold <= 0:
        return torch.full((R,), n, dtype=torch.long)
    prev = torch.cat([anchor[:, None], tokens[:, :-1]], dim=1)
    with_markov = head.proj.in_features > h.shape[-1]
    survival = torch.sigmoid(head(h, model.markov_head.markov_w1(prev) if with_markov else None)).cumprod(dim=1)
    return (survival >= threshold).sum(dim=1).clamp(min=1).cpu()
