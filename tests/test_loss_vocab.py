"""`loss.vocab = "data"`: the loss's softmax over the data's tokens plus sampled negatives."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from dflash.errors import ConfigError
from dflash.model.drafter import FrozenHead
from dflash.model.loss import LossSpec, LossVocab, block_loss, block_targets
from tests.conftest import run_records


def _head(V: int = 50, H: int = 8) -> FrozenHead:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(V, H, generator=g)
    return FrozenHead(w, w)


def test_loss_vocab_maps_the_data_tokens_and_keeps_the_rest_outside() -> None:
    head = _head()
    vocab = LossVocab.of(head.lm_head, torch.tensor([7, 3, 3, 41, 7]))
    assert vocab.index[torch.tensor([3, 7, 41])].tolist() == [0, 1, 2]
    assert (vocab.index >= 0).sum() == 3 and vocab.index[0] == -1
    assert torch.equal(vocab.lm_head, head.lm_head[torch.tensor([3, 7, 41])])
    assert sorted(vocab.outside.tolist()) == [t for t in range(50) if t not in (3, 7, 41)]


def test_data_vocab_covering_every_token_is_the_full_loss() -> None:
    """With every token in the data nothing is sampled, and the loss and its gradient equal the
    whole vocabulary's cross-entropy."""
    head = _head()
    vocab = LossVocab.of(head.lm_head, torch.arange(50))
    assert len(vocab.outside) == 0 and len(vocab.draw(torch.Generator())) == 0
    ids = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(1))
    doc = torch.zeros(2, 10, dtype=torch.long)
    anchors, valid = torch.tensor([[1, 5], [0, 4]]), torch.ones(2, 2, dtype=torch.bool)
    t = block_targets(ids, torch.ones(2, 10, dtype=torch.bool), doc, anchors, valid, 4, 2.0)
    hidden = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(2), requires_grad=True)
    spec = LossSpec(block_size=4, chunk=64)
    full = block_loss(hidden, head.lm_head, t, spec)
    (g_full,) = torch.autograd.grad(full.loss_sum, hidden)
    lm, bias = vocab.head(head.lm_head, vocab.draw(torch.Generator()))
    mapped = block_loss(hidden, lm, dataclasses.replace(t, labels=vocab.index[t.labels]), spec, logit_bias=bias)
    (g_mapped,) = torch.autograd.grad(mapped.loss_sum, hidden)
    assert torch.allclose(full.loss_sum, mapped.loss_sum) and torch.allclose(g_full, g_mapped)


def test_sampled_negatives_estimate_the_whole_normaliser() -> None:
    """The drawn negatives, each with log(outside / drawn) added to its logit, give an
    unbiased estimate of the softmax normaliser over the whole vocabulary."""

    V = 2000
    head = _head(V, 16)
    vocab = LossVocab.of(head.lm_head, torch.arange(300), negatives=256)
    h = torch.randn(16, generator=torch.Generator().manual_seed(3)) * 0.5
    true = torch.exp(head.lm_head @ h).sum()
    g = torch.Generator().manual_seed(4)
    est = []
    for _ in range(200):
        drawn = vocab.draw(g)
        lm, bias = vocab.head(head.lm_head, drawn)
        assert len(drawn) == 256 and bias is not None and lm.shape[0] == bias.shape[0] == 300 + 256
        assert bias[-1] == pytest.approx(math.log(1700 / 256)) and not bias[:300].any()
        est.append(torch.exp(lm @ h + bias).sum())
    assert float(torch.stack(est).mean()) == pytest.approx(float(true), rel=0.02)


def test_loss_negatives_sets_how_many_are_drawn_and_zero_draws_none() -> None:
    """`loss.negatives`: each micro-batch draws that many (at most all outside tokens);
    0 draws none and adds no bias: the softmax over the data's tokens alone."""
    head = _head(200, 8)
    tokens = torch.arange(20)
    for k, drawn in ((64, 64), (500, 180), (0, 0)):
        vocab = LossVocab.of(head.lm_head, tokens, negatives=k)
        d = vocab.draw(torch.Generator().manual_seed(0))
        assert len(d) == drawn
        lm, bias = vocab.head(head.lm_head, d)
        assert lm.shape[0] == 20 + drawn and (bias is None) == (drawn == 0)


def test_the_loss_head_is_the_data_rows_and_each_draw_in_the_asked_dtype() -> None:
    """`head` reuses one buffer per dtype: every call gives the data's rows, then exactly the
    rows of that call's draw, in the dtype asked (bf16: the cast autocast would make)."""
    head = _head(500, 8)
    vocab = LossVocab.of(head.lm_head, torch.arange(40), negatives=32)
    g = torch.Generator().manual_seed(1)
    for dtype in (None, torch.bfloat16, None, torch.bfloat16):
        drawn = vocab.draw(g)
        lm, _ = vocab.head(head.lm_head, drawn, dtype)
        want = torch.cat([head.lm_head[:40], head.lm_head[vocab.outside[drawn]]])
        assert lm.dtype == (dtype or torch.float32) and torch.equal(lm, want.to(lm.dtype))
    assert len(vocab._heads) == 2  # one buffer per dtype, reused


def test_labels_outside_the_data_count_zero_and_never_correct() -> None:
    """A label outside the data's tokens (e.g. the target's greedy token on text that never
    contains it) gets weight 0 and the ignore index: no loss, not counted correct."""
    head = _head()
    vocab = LossVocab.of(head.lm_head, torch.tensor([3, 7, 41]))
    labels, weights = vocab.labels(torch.tensor([7, 5, 41]), torch.tensor([1.0, 0.8, 0.5]))
    assert labels.tolist() == [1, -100, 2] and weights.tolist() == [1.0, 0.0, 0.5]
    ids = torch.tensor([[7, 5, 41, 3, 3, 3]])
    t = block_targets(ids, torch.ones(1, 6, dtype=torch.bool), torch.zeros(1, 6, dtype=torch.long),
                      torch.tensor([[0]]), torch.ones(1, 1, dtype=torch.bool), 4, 2.0)  # fmt: skip
    lab, w = vocab.labels(t.labels, t.weights)
    hidden = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(5))
    lm, bias = vocab.head(head.lm_head, vocab.draw(torch.Generator().manual_seed(6)))
    spec = LossSpec(block_size=4, chunk=64)
    out = block_loss(hidden, lm, dataclasses.replace(t, labels=lab, weights=w), spec, logit_bias=bias)
    kept = dataclasses.replace(t, labels=lab[lab >= 0], weights=w[lab >= 0], sel=t.sel[lab >= 0], slot=t.slot[lab >= 0])
    ref = block_loss(hidden, lm, kept, spec, logit_bias=bias)
    assert torch.allclose(out.loss_sum, ref.loss_sum)
    assert torch.equal(out.correct_per_slot, ref.correct_per_slot)  # the ignored slot adds no "correct"


def test_a_run_with_data_vocab_trains_counts_its_vocab_and_evaluates_losslessly(tiny_config) -> None:
    """A tiny run with `loss.vocab = "data"` learns (tau_sim rises), its setup record
    counts the data's distinct tokens, and the full-vocabulary eval stays lossless."""
    cfg = tiny_config(
        **{"data.num_samples": 256, "train.epochs": 4, "optimizer.lr": 2e-2, "loss.vocab": "data",
           "loss.negatives": 8, "eval.num_prompts": 2, "eval.max_new_tokens": 24, "eval.at_end": "true"}
    )  # fmt: skip
    records = run_records(cfg)
    (setup,) = [r for r in records if r["event"] == "setup"]
    assert 0 < setup["data"]["loss_vocab"] <= cfg.target.tiny.vocab_size
    steps = [r for r in records if r["event"] == "train_step"]
    assert sum(s["tau_sim"] for s in steps[-5:]) / 5 > sum(s["tau_sim"] for s in steps[:5]) / 5 + 0.2
    (ev,) = [r for r in records if r["event"] == "eval"]
    assert ev["lossless"] is True


def test_data_vocab_with_distillation_is_refused(tiny_config) -> None:
    """The distillation top-k may lie outside the data's tokens: the two are not combined."""
    with pytest.raises(ConfigError, match=r"loss\.vocab = 'data' with loss\.distill"):
        tiny_config(**{"loss.vocab": '"data"', "loss.distill": 0.5})
