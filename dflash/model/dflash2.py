"""DFlash2's additions to the DFlash backbone (the convolutions are the backbone's,
`modeling_dflash.DynamicConv`): the candidate selector's loss and its greedy walk.

Training: each supervised slot's candidates are the top-K of its unary logits, the label
put in the last place when it is not among them; the selector scores them given the data's
token before the label (teacher forcing) and a K-way cross-entropy learns to put the label
first (weight `drafter.dflash2.selector_loss`). What the slot drafts, counted in `acc` and
`tau_sim`, is the selector's pick, and only when the label was a candidate (serving has no
label to put in). Drafting: slot 1's predecessor is the anchor, each next slot's the token
picked before it (a greedy walk over the edge scores, as vLLM drafts; sampled: the scores'
softmax over the K candidates, which speculative sampling verifies).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash.model.modeling_dflash import CandidateSelector

__all__ = ["SelectorTerms", "walk"]


class SelectorTerms:
    """The selector's K-way cross-entropy (× `weight`) per supervised row (`FamilyTerms`)."""

    def __init__(self, selector: CandidateSelector, weight: float) -> None:
        self.selector, self.weight = selector, weight

    def __call__(
        self, logits: torch.Tensor, h: torch.Tensor, labels: torch.Tensor, prev: torch.Tensor,
        cols: torch.Tensor | None, teacher: tuple[torch.Tensor, torch.Tensor] | None = None,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        K = self.selector.top_k
        unary = logits if bias is None else logits - bias  # the candidates serving sees: no logQ correction
        gold = labels.clamp(min=0)  # an ignored label (-100, weight 0) stands as column 0
        cands = unary.detach().topk(K, dim=-1).indices  # (m, K) columns
        match = cands == gold[:, None]
        inside = match.any(dim=-1)
        where = torch.where(inside, match.to(torch.int64).argmax(dim=-1), K - 1)
        cands[:, -1] = torch.where(inside, cands[:, -1], gold)
        ids = cands if cols is None else cols[cands]
        scores = self.selector.scores(unary.gather(1, cands), h, prev, ids)
        ce = F.cross_entropy(scores.float(), where, reduction="none")
        picked = cands.gather(1, scores.detach().argmax(dim=-1, keepdim=True)).squeeze(1)
        return logits, self.weight * ce, (picked == labels) & inside


def walk(
    selector: CandidateSelector,
    logits: torch.Tensor,  # (R, n, V) unary logits of the n draft slots
    h: torch.Tensor,  # (R, n, H) their states
    anchor: torch.Tensor,  # (R,) the block's anchor token
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    ids: torch.Tensor | None = None,  # (V',) a draft vocabulary's target id of each logit column
) -> tuple[torch.Tensor, torch.Tensor | None]:  # no-sync: decoding (eval), off the training path
    """The drafted tokens (R, n), slot by slot from the anchor; sampled (temperature > 0),
    also the distributions they were drawn from (R, n, V): zero outside the candidates. With
    `ids`, candidates are draft rows, the tokens target ids and the distributions over the rows."""
    R, n, V = logits.shape
    prev, out, qs = anchor, [], []
    for slot in range(n):
        u = logits[:, slot]
        cands = u.topk(selector.top_k, dim=-1).indices  # (R, K)
        s = selector.scores(u.gather(1, cands), h[:, slot], prev, cands)
        if temperature <= 0:
            pick = cands.gather(1, s.argmax(dim=-1, keepdim=True)).squeeze(1)
        else:
            probs = torch.softmax(s.float().cpu() / temperature, dim=-1)
            drawn = torch.multinomial(probs, 1, generator=generator).to(cands.device)
            pick = cands.gather(1, drawn).squeeze(1)
            qs.append(torch.zeros(R, V).scatter(1, cands.cpu(), probs))
        pick = pick if ids is None else ids[pick]  # the predecessor is a target id
        out.append(pick)
        prev = pick
    return torch.stack(out, dim=1), torch.stack(qs, dim=1) if qs else None
