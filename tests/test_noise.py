"""The noise schedule: revealed block slots carry their true token and have no loss."""

from __future__ import annotations

import pytest
import torch

from dflash.model.loss import LossSpec, block_targets, reveal_slots
from dflash.train.schedule import reveal_prob


def _batch():
    ids = torch.arange(20).view(2, 10)
    doc = torch.tensor([[3] * 6 + [4] * 4, [7] * 8 + [-1] * 2])
    mask = doc >= 0
    anchors = torch.tensor([[1, 6], [2, 0]])
    valid = torch.tensor([[True, True], [True, False]])
    return ids, doc, mask, anchors, valid


def test_reveal_probability_one_reveals_every_in_document_slot_and_drops_its_loss():
    """prob 1: every slot k>=1 of a valid block inside its document is revealed, no loss left."""
    ids, doc, mask, anchors, valid = _batch()
    reveal, tokens = reveal_slots(ids, doc, anchors, valid, 4, 1.0, torch.Generator().manual_seed(0))
    assert not reveal[:, :, 0].any() and not reveal[1, 1].any()  # anchors and disabled blocks
    assert reveal[0, 0, 1:].all()  # positions 2..4 are in doc 3
    assert reveal[0, 1, 1:].tolist() == [True, True, True]  # 7..9 in doc 4
    assert tokens[0, 0].tolist() == [1, 2, 3, 4]
    t = block_targets(ids, mask, doc, anchors, valid, 4, 2.0, reveal)
    assert t.sel.numel() == 0 and t.weight_sum == 0.0


def test_reveal_probability_zero_changes_nothing():
    """prob 0: nothing revealed; the targets equal those without a noise schedule."""
    ids, doc, mask, anchors, valid = _batch()
    reveal, _ = reveal_slots(ids, doc, anchors, valid, 4, 0.0, torch.Generator().manual_seed(0))
    assert not reveal.any()
    a = block_targets(ids, mask, doc, anchors, valid, 4, 2.0, reveal)
    b = block_targets(ids, mask, doc, anchors, valid, 4, 2.0)
    assert torch.equal(a.sel, b.sel) and a.weight_sum == b.weight_sum > 0


def test_the_reveal_probability_goes_linearly_from_start_to_end_over_the_run():
    """`loss.noise_reveal_start` at step 0, `loss.noise_reveal_end` at the last planned step,
    linear in between, and the end's value after it; no schedule: nothing revealed."""
    spec = LossSpec(block_size=4, noise_reveal_start=0.3, noise_reveal_end=0.1)
    assert reveal_prob(spec, 0, 11) == 0.3
    assert reveal_prob(spec, 5, 11) == pytest.approx(0.2)
    assert reveal_prob(spec, 10, 11) == pytest.approx(0.1) == reveal_prob(spec, 50, 11)
    assert reveal_prob(LossSpec(block_size=4), 7, 11) == 0.0
