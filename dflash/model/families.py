"""The drafter families, seen from training and decoding: what each adds to the loss
(`family_terms`) and how each drafts a block from the drafter's states (`propose`).

DFlash drafts each slot's argmax; DFlash2 walks its candidate selector (`dflash2.py`);
DSpark drafts left to right with its Markov bias (`dspark.py`). The backbone is one
(`drafter.py`), its family-specific modules built from `DrafterSpec.family`.
"""

from __future__ import annotations

import torch

from dflash.model.drafter import DFlashDrafter
from dflash.model.loss import FamilyTerms, LossSpec

__all__ = ["family_terms", "propose", "verify_lengths"]


def family_terms(model: DFlashDrafter, spec: LossSpec) -> FamilyTerms | None:
    """The family's additions to the block loss; None for DFlash."""
    family = model.spec.family
    if family == "dflash2":
        from dflash.model.dflash2 import SelectorTerms

        return SelectorTerms(model.candidate_selector, spec.selector_loss)
    if family == "dspark":
        from dflash.model.dspark import MarkovTerms

        return MarkovTerms(model.markov_head, getattr(model, "confidence_head", None), spec.confidence_loss)
    return None


def propose(
    model: DFlashDrafter,
    h: torch.Tensor,  # (R, n, H) the draft slots' states
    lm_head: torch.Tensor,  # (V, H) the target's (a drafter with a draft vocabulary reads its own)
    anchor: torch.Tensor,  # (R,) each block's anchor token
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    family_head: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # no-sync: decoding (eval), off the training path
    """The drafted tokens (R, n) and, sampled (temperature > 0), the distributions (R, n, V)
    they were drawn from (on the host), which speculative sampling's verification needs; with a
    draft vocabulary drafted over its rows, returned as target ids and distributions.
    `family_head` False: drafted as DFlash drafts, from the backbone's logits alone
    (`eval.family_head`: what DFlash2's selector or DSpark's Markov head adds)."""
    R, n, H = h.shape
    head = model.drafting_head(lm_head)  # a draft vocabulary's rows, or the target's whole head
    logits = torch.nn.functional.linear(h.reshape(R * n, H).to(head.dtype), head).view(R, n, -1)
    ids = model.draft_ids()  # row → target id (None: the row is the id)
    family = model.spec.family if family_head else "dflash"
    if family == "dflash2":
        from dflash.model.dflash2 import walk

        tokens, q = walk(model.candidate_selector, logits, h, anchor, temperature, generator, ids)
    elif family == "dspark":
        from dflash.model.dspark import draft

        tokens, q = draft(model.markov_head, logits, anchor, temperature, generator, ids)
    elif temperature <= 0:
        tokens, q = logits.argmax(dim=-1), None
        tokens = tokens if ids is None else ids[tokens]
    else:
        q = torch.softmax(logits.float().cpu() / temperature, dim=-1)
        drawn = torch.multinomial(q.view(R * n, -1), 1, generator=generator).view(R, n).to(h.device)
        tokens = drawn if ids is None else ids[drawn]
    if q is not None and ids is not None:  # verification compares with the target's whole vocabulary
        q = torch.zeros(*q.shape[:-1], model.spec.vocab_size, dtype=q.dtype).index_copy_(-1, ids.cpu(), q)
    return tokens, q


def verify_lengths(
    model: DFlashDrafter,
    h: torch.Tensor,  # (R, n, H) the draft slots' states
    tokens: torch.Tensor,  # (R, n) their drafts
    anchor: torch.Tensor,  # (R,)
    threshold: float,
    family_head: bool = True,
) -> list[int]:  # no-sync: decoding (eval), off the training path
    """How many of each row's drafts to verify: all of them, but for DSpark with a confidence
    `threshold` the prefix its confidence head trusts (`dspark.confident`); without the
    family's head (`family_head` False), all of them."""
    if model.spec.family == "dspark" and threshold > 0 and family_head:
        from dflash.model.dspark import confident

        return confident(model, h, tokens, anchor, threshold).tolist()
    return [tokens.shape[1]] * tokens.shape[0]
