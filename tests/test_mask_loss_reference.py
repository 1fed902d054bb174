"""Vectorised mask / anchors / labels / loss checked against slow loop references.

The reference functions below (`ref_*`) are written from docs/dflash-reference.md
("Mask", "Anchors", "Labels", "Loss") with plain Python loops; they never call the
package. Everything runs on CPU with tiny shapes.
"""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch

from dflash.model.anchors import sample_anchors
from dflash.model.drafter import DFlashDrafter, DrafterSpec, attend
from dflash.model.loss import LossSpec, block_loss, block_targets
from dflash.model.masks import BlockLayout, dense_mask, flex_block_mask, layer_masks, make_mask_mod

# --------------------------------------------------------------------------------------
# Loop references (from the reference doc, not from the package)
# --------------------------------------------------------------------------------------


def ref_mask(anchors, valid, doc_ids, T, B, window, causal_in_block):
    """(R, Q, T+Q) bool, True = attend, computed query by query and key by key."""
    anchors, valid, doc_ids = _lists(anchors), _lists(valid), _lists(doc_ids)
    R, N = len(anchors), len(anchors[0])
    Q = N * B
    out = []
    for r in range(R):
        rows = []
        for q in range(Q):
            j, k = q // B, q % B
            a, ok = anchors[r][j], bool(valid[r][j])
            keys = []
            for kv in range(T + Q):
                if not ok:
                    see = False
                elif kv < T:
                    c = kv
                    see = c < a and doc_ids[r][c] == doc_ids[r][a]
                    if window is not None and c < a + k - (window - 1):
                        see = False
                else:
                    jj, kk = (kv - T) // B, (kv - T) % B
                    see = jj == j
                    if causal_in_block and kk > k:
                        see = False
                keys.append(see)
            rows.append(keys)
        out.append(rows)
    return torch.tensor(out, dtype=torch.bool)


def ref_candidates(loss_mask, doc_ids):
    """Per row, the positions t with loss_mask[t], loss_mask[t+1], same doc (not padding)."""
    loss_mask, doc_ids = _lists(loss_mask), _lists(doc_ids)
    out = []
    for lm, doc in zip(loss_mask, doc_ids, strict=True):
        row = []
        for t in range(len(doc) - 1):
            if lm[t] and lm[t + 1] and doc[t] == doc[t + 1] and doc[t] >= 0:
                row.append(t)
        out.append(row)
    return out


def ref_targets(input_ids, loss_mask, doc_ids, anchors, valid, B, gamma):
    """List of (row, j, k, label, weight) for every block slot that carries loss."""
    input_ids, loss_mask, doc_ids = _lists(input_ids), _lists(loss_mask), _lists(doc_ids)
    anchors, valid = _lists(anchors), _lists(valid)
    T = len(input_ids[0])
    out = []
    for r in range(len(anchors)):
        for j in range(len(anchors[r])):
            a = anchors[r][j]
            for k in range(1, B):
                p = a + k
                if not valid[r][j] or p >= T:
                    continue
                if doc_ids[r][p] != doc_ids[r][a] or not loss_mask[r][p]:
                    continue
                out.append((r, j, k, input_ids[r][p], math.exp(-(k - 1) / gamma)))
    return out


def ref_loss(hidden, lm_head, slots, B):
    """(L, Σw, count_per_slot, correct_per_slot) from explicit float64 logits, per slot."""
    num = torch.zeros((), dtype=torch.float64)
    den = 0.0
    count = [0] * B
    correct = [0] * B
    for r, j, k, label, w in slots:
        logits = hidden[r, j * B + k].double() @ lm_head.double().t()
        ce = torch.logsumexp(logits, 0) - logits[label]
        num = num + w * ce
        den += w
        count[k] += 1
        correct[k] += int(int(logits.argmax()) == label)
    return num / den, den, count, correct


def _lists(x):
    return x.tolist() if isinstance(x, torch.Tensor) else x


# --------------------------------------------------------------------------------------
# Random packed batches
# --------------------------------------------------------------------------------------


def random_docs(g: torch.Generator, R: int, T: int, first_id: int = 1) -> torch.Tensor:
    """(R, T) doc ids: 1-3 documents per row (distinct ids over the batch), -1 padding."""
    doc = torch.full((R, T), -1, dtype=torch.long)
    nid = first_id
    for r in range(R):
        pad = int(torch.randint(0, T // 4 + 1, (1,), generator=g))
        used = T - pad
        ndocs = int(torch.randint(1, 4, (1,), generator=g))
        cuts = sorted(torch.randperm(used - 1, generator=g)[: ndocs - 1].add(1).tolist())
        bounds = [0, *cuts, used]
        for s, e in itertools.pairwise(bounds):
            doc[r, s:e] = nid * 4 + 1  # sparse, non-contiguous ids
            nid += 1
    return doc


def random_anchors(g: torch.Generator, doc: torch.Tensor, N: int):
    """(R, N) anchors inside documents (some at a doc start), ~1/3 disabled (junk value)."""
    R, _ = doc.shape
    anchors = torch.zeros(R, N, dtype=torch.long)
    valid = torch.zeros(R, N, dtype=torch.bool)
    for r in range(R):
        used = int((doc[r] >= 0).sum())
        starts = [t for t in range(used) if t == 0 or doc[r, t] != doc[r, t - 1]]
        for j in range(N):
            u = float(torch.rand((), generator=g))
            if u < 0.2:
                anchors[r, j] = starts[int(torch.randint(0, len(starts), (1,), generator=g))]
            else:
                anchors[r, j] = int(torch.randint(0, used, (1,), generator=g))
            valid[r, j] = float(torch.rand((), generator=g)) > 0.33
            if not valid[r, j] and u > 0.6:
                anchors[r, j] = 0  # the documented "0 where disabled"
    valid[0, 0] = True  # at least one live block
    return anchors, valid


# --------------------------------------------------------------------------------------
# 1. Mask
# --------------------------------------------------------------------------------------


def test_mask_example_by_hand():
    """The doc's rule on a tiny hand-checked packed row: strictly before anchor, same doc, own block."""
    doc = torch.tensor([[5, 5, 5, 9, 9, 9, 9, -1, -1]])
    anchors = torch.tensor([[5, 1]])
    valid = torch.tensor([[True, False]])
    B, T = 2, 9
    lay = BlockLayout(anchors, valid, doc, B)
    m = dense_mask(make_mask_mod(lay, None, False), lay)[0, 0]
    # block 0 (anchor 5, doc 9) sees context 3, 4 and block keys T+0, T+1; block 1 nothing.
    want = torch.zeros(4, T + 4, dtype=torch.bool)
    want[0:2, [3, 4, T, T + 1]] = True
    assert torch.equal(m, want)


@pytest.mark.parametrize("B", [4, 8, 16])
@pytest.mark.parametrize("window", [None, 3, 7])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_mask_matches_loop_reference(B, window, causal):
    """dense_mask(make_mask_mod(...)) equals the per-query, per-key loop reference."""
    g = torch.Generator().manual_seed(1000 * B + 10 * (window or 0) + int(causal))
    for T, R, N in [(19, 2, 3), (9, 3, 2)]:
        doc = random_docs(g, R, T)
        anchors, valid = random_anchors(g, doc, N)
        lay = BlockLayout(anchors, valid, doc, B)
        got = dense_mask(make_mask_mod(lay, window, causal), lay)
        assert got.shape == (R, 1, N * B, T + N * B) and got.dtype == torch.bool
        want = ref_mask(anchors, valid, doc, T, B, window, causal)
        assert torch.equal(got[:, 0], want), (doc, anchors, valid)


# --------------------------------------------------------------------------------------
# 2. Anchors
# --------------------------------------------------------------------------------------


def _random_loss_mask(g: torch.Generator, doc: torch.Tensor) -> torch.Tensor:
    """Per document: an unsupervised prompt prefix, then supervised tokens with a few holes."""
    lm = torch.zeros_like(doc, dtype=torch.bool)
    R, T = doc.shape
    for r in range(R):
        t = 0
        while t < T:
            if doc[r, t] < 0:
                break
            e = t
            while e < T and doc[r, e] == doc[r, t]:
                e += 1
            n = e - t
            prompt = int(torch.randint(0, max(1, n // 2), (1,), generator=g))
            lm[r, t + prompt : e] = True
            holes = torch.rand(n, generator=g) < 0.1
            lm[r, t:e] &= ~holes
            t = e
    return lm


def _check_anchor_invariants(anchors, valid, loss_mask, doc, max_anchors):
    cands = ref_candidates(loss_mask, doc)
    R = doc.shape[0]
    for r in range(R):
        live = anchors[r][valid[r]].tolist()
        assert live == sorted(live) and len(set(live)) == len(live)
        for t in live:
            assert t in cands[r], (r, t)
        assert not valid[r, len(live) :].any(), "valid slots must come first"
        assert (anchors[r][~valid[r]] == 0).all(), "unused slots hold 0"
        per_doc: dict[int, int] = {}
        for t in live:
            per_doc[int(doc[r, t])] = per_doc.get(int(doc[r, t]), 0) + 1
        n_cand: dict[int, int] = {}
        for t in cands[r]:
            n_cand[int(doc[r, t])] = n_cand.get(int(doc[r, t]), 0) + 1
        for d, n in n_cand.items():
            # at most max_anchors per document, and as many as possible (all when few)
            assert per_doc.get(d, 0) == min(n, max_anchors), (r, d)
        assert set(per_doc) <= set(n_cand)


def test_anchor_invariants_random_batches():
    """Valid anchors are candidates (t, t+1 supervised, same doc), sorted, <= max per doc, rest disabled."""
    g = torch.Generator().manual_seed(7)
    for trial in range(12):
        R, T = 3, 40
        doc = random_docs(g, R, T)
        lm = _random_loss_mask(g, doc)
        max_anchors = [1, 3, 8, 64][trial % 4]
        anchors, valid = sample_anchors(lm, doc, max_anchors, seed=trial, epoch=trial % 3)
        assert anchors.dtype == torch.long and valid.dtype == torch.bool
        assert anchors.shape == valid.shape and anchors.shape[0] == R and anchors.shape[1] >= 1
        _check_anchor_invariants(anchors, valid, lm, doc, max_anchors)


def test_anchor_all_candidates_used_when_few():
    """With candidates <= max_anchors, the anchors are exactly the loop-reference candidates."""
    g = torch.Generator().manual_seed(11)
    doc = random_docs(g, 3, 30)
    lm = _random_loss_mask(g, doc)
    anchors, valid = sample_anchors(lm, doc, 1000, seed=0, epoch=0)
    for r, cands in enumerate(ref_candidates(lm, doc)):
        assert anchors[r][valid[r]].tolist() == cands


def test_anchor_no_candidates_gives_one_disabled_slot():
    """Nothing supervised: shape (R, 1), all disabled."""
    doc = torch.tensor([[3, 3, 3, -1], [4, 4, 4, 4]])
    lm = torch.tensor([[1, 0, 1, 0], [0, 0, 0, 1]], dtype=torch.bool)
    anchors, valid = sample_anchors(lm, doc, 4, seed=0, epoch=0)
    assert anchors.shape == (2, 1) and not valid.any()


def test_anchor_boundaries():
    """No anchor whose next token is padding, another document, or unsupervised."""
    doc = torch.tensor([[5, 5, 5, 9, 9, 9, 9, -1, -1]])
    lm = torch.tensor([[1, 1, 1, 1, 1, 0, 1, 1, 1]], dtype=torch.bool)
    anchors, valid = sample_anchors(lm, doc, 100, seed=0, epoch=0)
    # 0,1 (doc 5); 2 -> 3 crosses docs; 3 (4 supervised); 4 -> 5 unsupervised;
    # 6 -> 7 padding; padding positions never anchor.
    assert anchors[0][valid[0]].tolist() == [0, 1, 3]


def _sample_42(g: torch.Generator, n: int = 30):
    lm = torch.ones(n, dtype=torch.bool)
    lm[:4] = False  # prompt
    lm[17] = False
    ids = torch.randint(0, 100, (n,), generator=g)
    return ids, lm


def _place(rows: list[list[tuple[int, torch.Tensor]]], T: int):
    """rows of [(doc id, loss mask)] packed left to right, padded with -1 / 0."""
    doc = torch.full((len(rows), T), -1, dtype=torch.long)
    lm = torch.zeros(len(rows), T, dtype=torch.bool)
    for r, row in enumerate(rows):
        t = 0
        for d, m in row:
            doc[r, t : t + m.numel()] = d
            lm[r, t : t + m.numel()] = m
            t += m.numel()
    return doc, lm


def _rel_anchors(anchors, valid, doc, r, d):
    start = int(torch.nonzero(doc[r] == d)[0])
    live = anchors[r][valid[r]]
    return [int(a) - start for a in live if doc[r, a] == d]


def test_anchor_determinism_independent_of_batch_and_packing():
    """Sample 42 gets the same anchors (rel. to its start) alone, beside other rows, or packed after another doc."""
    g = torch.Generator().manual_seed(3)
    _, lm42 = _sample_42(g)
    lm_other = torch.ones(13, dtype=torch.bool)
    lm_other2 = torch.ones(25, dtype=torch.bool)
    lm_other2[::5] = False
    T, max_anchors = 64, 6
    layouts = [
        ([[(42, lm42)]], 0),  # alone
        ([[(42, lm42)]], 0),  # alone again, different T below
        ([[(7, lm_other)], [(42, lm42)], [(8, lm_other2)]], 1),  # other rows around it
        ([[(7, lm_other), (42, lm42)]], 0),  # packed after another document
        ([[(8, lm_other2)], [(7, lm_other), (42, lm42), (9, lm_other)]], 1),  # both
    ]
    for epoch in (0, 1, 5):
        seen = []
        for i, (rows, r) in enumerate(layouts):
            doc, lm = _place(rows, T if i != 1 else 31)
            anchors, valid = sample_anchors(lm, doc, max_anchors, seed=123, epoch=epoch)
            _check_anchor_invariants(anchors, valid, lm, doc, max_anchors)
            seen.append(_rel_anchors(anchors, valid, doc, r, 42))
        assert len(seen[0]) == max_anchors
        assert all(s == seen[0] for s in seen), seen


def test_anchor_resampled_per_epoch_and_seed():
    """Candidates > max_anchors: a new epoch (or run seed) draws a different set; same inputs repeat."""
    # 60 candidates, 6 anchors: C(60, 6) = 5e7 sets, so a collision in 8 draws is ~1e-6.
    doc = torch.full((1, 61), 42, dtype=torch.long)
    lm = torch.ones(1, 61, dtype=torch.bool)
    draws = []
    for epoch in range(8):
        a, v = sample_anchors(lm, doc, 6, seed=1, epoch=epoch)
        a2, v2 = sample_anchors(lm, doc, 6, seed=1, epoch=epoch)
        assert torch.equal(a, a2) and torch.equal(v, v2)
        draws.append(tuple(a[0][v[0]].tolist()))
    assert len(set(draws)) == len(draws)
    a_s, v_s = sample_anchors(lm, doc, 6, seed=2, epoch=0)
    assert tuple(a_s[0][v_s[0]].tolist()) != draws[0]


# --------------------------------------------------------------------------------------
# 3. Labels and loss
# --------------------------------------------------------------------------------------


def _loss_batch(seed: int, B: int, use_sampler: bool):
    g = torch.Generator().manual_seed(seed)
    R, T, N, H, V = 3, 23, 4, 6, 11
    doc = random_docs(g, R, T)
    lm = _random_loss_mask(g, doc)
    ids = torch.randint(0, V, (R, T), generator=g)
    if use_sampler:
        anchors, valid = sample_anchors(lm, doc, 3, seed=seed, epoch=0)
        N = anchors.shape[1]
    else:
        anchors, valid = random_anchors(g, doc, N)
        anchors[0, 0] = T - 2  # a block running past the row end
        valid[0, 0] = doc[0, T - 2] >= 0
        valid[0, 1] = True
    hidden = torch.randn(R, N * B, H, generator=g)
    lm_head = torch.randn(V, H, generator=g)
    return ids, lm, doc, anchors, valid, hidden, lm_head


@pytest.mark.parametrize("B", [4, 8])
@pytest.mark.parametrize("use_sampler", [False, True])
def test_block_targets_and_loss_match_loop_reference(B, use_sampler):
    """Labels x[a+k], weights exp(-(k-1)/γ), mask m, Σw·CE/Σw, counts, accuracy: chunk 1/3/large agree with the loop."""
    gamma = 3.0
    ids, lm, doc, anchors, valid, hidden, lm_head = _loss_batch(5 + B, B, use_sampler)
    slots = ref_targets(ids, lm, doc, anchors, valid, B, gamma)
    assert slots, "the batch must supervise something"
    L_ref, den_ref, count_ref, correct_ref = ref_loss(hidden, lm_head, slots, B)

    tg = block_targets(ids, lm, doc, anchors, valid, B, gamma)
    N = anchors.shape[1]
    want_sel = [(r * N + j) * B + k for r, j, k, _, _ in slots]
    assert tg.sel.tolist() == want_sel
    assert tg.labels.tolist() == [s[3] for s in slots]
    assert tg.slot.tolist() == [s[2] for s in slots]
    assert torch.allclose(tg.weights.double(), torch.tensor([s[4] for s in slots], dtype=torch.float64))
    assert tg.weight_sum == pytest.approx(den_ref, rel=1e-6)
    assert tg.count_per_slot.tolist() == count_ref and count_ref[0] == 0

    grads = []
    for chunk in (1, 3, 10_000):
        h = hidden.clone().requires_grad_(True)
        parts = block_loss(h, lm_head, tg, LossSpec(block_size=B, chunk=chunk))
        L = parts.loss_sum / parts.weight_sum
        assert float(L.detach()) == pytest.approx(float(L_ref), rel=1e-5, abs=1e-5), chunk
        assert parts.weight_sum == pytest.approx(den_ref, rel=1e-6)
        assert parts.count_per_slot.tolist() == count_ref
        assert parts.correct_per_slot.tolist() == [float(c) for c in correct_ref]
        assert parts.correct_per_slot[0] == 0
        L.backward()
        grads.append(h.grad.clone())
    # The explicit-logits reference gradient (float64) and the chunked, checkpointed ones.
    h64 = hidden.double().requires_grad_(True)
    ref_loss(h64, lm_head, slots, B)[0].backward()
    for g_ in grads:
        assert torch.allclose(g_, grads[0], atol=1e-6, rtol=0)
        assert torch.allclose(g_.double(), h64.grad, atol=1e-5, rtol=0)
    # Unsupervised slots (slot 0, disabled blocks, outside the doc) get exactly zero gradient.
    sup = torch.zeros(hidden.shape[0] * hidden.shape[1], dtype=torch.bool)
    sup[tg.sel] = True
    assert (grads[0].reshape(-1, hidden.shape[-1])[~sup] == 0).all()


def test_block_loss_nothing_supervised_has_zero_grads():
    """No supervised slot: loss_sum 0, weight 0, backward still works with zero grads."""
    B, R, T, N = 4, 1, 6, 2
    ids = torch.zeros(R, T, dtype=torch.long)
    lm = torch.zeros(R, T, dtype=torch.bool)
    doc = torch.zeros(R, T, dtype=torch.long)
    anchors = torch.zeros(R, N, dtype=torch.long)
    valid = torch.tensor([[True, False]])
    tg = block_targets(ids, lm, doc, anchors, valid, B, 2.0)
    assert tg.sel.numel() == 0 and tg.weight_sum == 0.0
    h = torch.randn(R, N * B, 3, requires_grad=True)
    parts = block_loss(h, torch.randn(5, 3), tg, LossSpec(block_size=B, chunk=2))
    parts.loss_sum.backward()
    assert float(parts.loss_sum.detach()) == 0.0 and (h.grad == 0).all()


# --------------------------------------------------------------------------------------
# 4-5. The drafter really masks what the mask says
# --------------------------------------------------------------------------------------

_R, _T, _B, _W = 2, 12, 4, 3
_DOC = torch.tensor([[5] * 5 + [9] * 5 + [-1] * 2, [3] * 12])
_ANCHORS = torch.tensor([[3, 7, 0], [2, 9, 5]])
_VALID = torch.tensor([[True, True, False], [True, True, True]])


def _drafter(layer_types: list[str], causal: bool = True, seed: int = 0):
    spec = DrafterSpec(
        hidden_size=32,
        num_layers=len(layer_types),
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=50,
        rms_norm_eps=1e-6,
        rope_theta=10_000.0,
        target_layer_ids=[1, 2],
        num_target_layers=4,
        block_size=_B,
        mask_token_id=49,
        layer_types=layer_types,
        sliding_window=_W,
        sliding_causal_block=causal,
    )
    model = DFlashDrafter(spec)
    model.init_weights(torch.Generator().manual_seed(seed), std=0.2)
    model.eval()
    return model


def _inputs(anchors=_ANCHORS, valid=_VALID, doc=_DOC, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    R, N = anchors.shape
    T = doc.shape[1]
    emb = torch.randn(R, N * _B, 32, generator=g)
    ctx = torch.randn(R, T, 64, generator=g)
    q_pos = (anchors[:, :, None] + torch.arange(_B)).reshape(R, N * _B)
    ctx_pos = torch.arange(T).expand(R, T)
    layout = BlockLayout(anchors, valid, doc, _B)
    return emb, ctx, q_pos, ctx_pos, layout


def _run(model, emb, ctx, q_pos, ctx_pos, layout):
    masks = layer_masks(layout, model.spec, use_flex=False)
    with torch.no_grad():
        return model(emb, ctx, q_pos, ctx_pos, masks)


@pytest.mark.parametrize(
    ("layer_type", "causal"),
    [("full_attention", False), ("sliding_attention", True), ("sliding_attention", False)],
)
def test_single_layer_output_moves_iff_key_visible(layer_type, causal):
    """One draft layer: perturbing key p moves query q's output iff the loop-reference mask says q sees p."""
    model = _drafter([layer_type], causal)
    emb, ctx, q_pos, ctx_pos, layout = _inputs()
    base = _run(model, emb, ctx, q_pos, ctx_pos, layout)
    window = _W if layer_type == "sliding_attention" else None
    ref = ref_mask(_ANCHORS, _VALID, _DOC, _T, _B, window, causal and window is not None)
    Q = ref.shape[1]
    g = torch.Generator().manual_seed(9)
    for r in range(_R):
        for p in range(_T + Q):
            c2, e2 = ctx.clone(), emb.clone()
            if p < _T:
                c2[r, p] += 3 * torch.randn(64, generator=g)
            else:
                e2[r, p - _T] += 3 * torch.randn(32, generator=g)
            out = _run(model, e2, c2, q_pos, ctx_pos, layout)
            moved = (out - base).abs().amax(-1)  # (R, Q)
            other = 1 - r
            assert moved[other].max() <= 1e-6, "another row moved"
            for q in range(Q):
                if ref[r, q, p] or (p >= _T and p - _T == q):
                    # a visible key, or the query's own residual input
                    assert moved[r, q] > 1e-4, (r, q, p)
                else:
                    assert moved[r, q] <= 1e-6, (r, q, p, float(moved[r, q]))


def test_mixed_layers_hidden_positions_do_not_leak():
    """2 layers (full + sliding): a block ignores its anchor, later positions, other docs, other blocks."""
    model = _drafter(["full_attention", "sliding_attention"], causal=True)
    emb, ctx, q_pos, ctx_pos, layout = _inputs()
    base = _run(model, emb, ctx, q_pos, ctx_pos, layout)
    g = torch.Generator().manual_seed(4)

    def moved_block(r, j, ctx_at=None, blk_at=None):
        c2, e2 = ctx.clone(), emb.clone()
        if ctx_at is not None:
            c2[r, ctx_at] += 3 * torch.randn(64, generator=g)
        if blk_at is not None:
            e2[r, blk_at] += 3 * torch.randn(32, generator=g)
        out = _run(model, e2, c2, q_pos, ctx_pos, layout)
        return float((out - base)[r, j * _B : (j + 1) * _B].abs().max())

    # row 0, block 1: anchor 7 in doc 9 (positions 5..9); sees context 5, 6 only.
    r, j = 0, 1
    for p in [7, 8, 9, 0, 3, 4, 10, 11]:  # anchor, after it, doc 5, padding
        assert moved_block(r, j, ctx_at=p) <= 1e-6, p
    for p in [5, 6]:
        assert moved_block(r, j, ctx_at=p) > 1e-4, p
    # tokens of other blocks (including the disabled one) never reach block 1
    for q in [0, 3, 8, 11]:
        assert moved_block(r, j, blk_at=q) <= 1e-6, q
    assert moved_block(r, j, blk_at=j * _B + 2) > 1e-4
    # row 1, block 1: anchor 9; the other row's perturbation cannot matter either
    assert moved_block(1, 1, ctx_at=9) <= 1e-6
    assert moved_block(1, 1, ctx_at=8) > 1e-4


def test_disabled_blocks_are_finite_forward_and_backward():
    """Fully masked query rows (disabled blocks, a row with none valid) give finite outputs and grads."""
    model = _drafter(["full_attention", "sliding_attention"], causal=True)
    model.train()
    anchors = torch.tensor([[3, 7, 0], [0, 0, 0]])
    valid = torch.tensor([[True, False, False], [False, False, False]])
    # also an anchor at a document start: a valid block that sees no context at all
    anchors2 = torch.tensor([[5, 7, 0], [0, 0, 0]])
    valid2 = torch.tensor([[True, True, False], [True, False, False]])
    for a, v in [(anchors, valid), (anchors2, valid2)]:
        emb, ctx, q_pos, ctx_pos, layout = _inputs(a, v)
        emb.requires_grad_(True)
        ctx.requires_grad_(True)
        model.zero_grad()
        masks = layer_masks(layout, model.spec, use_flex=False)
        out = model(emb, ctx, q_pos, ctx_pos, masks)
        assert torch.isfinite(out).all()
        (out.square().sum() + out.sum()).backward()
        assert torch.isfinite(emb.grad).all() and torch.isfinite(ctx.grad).all()
        for name, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name


# --------------------------------------------------------------------------------------
# 6. Flex attention vs the dense SDPA path
# --------------------------------------------------------------------------------------


def _flex_attention():
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError as e:  # pragma: no cover - torch too old
        pytest.skip(f"flex_attention unavailable: {e}")
    return flex_attention


_FLEX_CASES = [
    (4, None, False, 10, 3),
    (4, 3, True, 10, 3),
    (8, 7, False, 19, 2),
    (16, 7, True, 150, 5),  # Q=80, KV=230: neither a multiple of 128, no padding needed
]


def _flex_case(B, window, causal, T, N, requires_grad):
    g = torch.Generator().manual_seed(B + T)
    R = 2
    doc = random_docs(g, R, T)
    anchors, valid = random_anchors(g, doc, N)
    valid[1, 0] = False  # guarantee at least one fully masked block
    lay = BlockLayout(anchors, valid, doc, B)
    mod = make_mask_mod(lay, window, causal)
    Q, S = N * B, T + N * B
    q = torch.randn(R, 4, Q, 8, generator=g, requires_grad=requires_grad)  # GQA: 4 q heads
    k = torch.randn(R, 2, S, 8, generator=g, requires_grad=requires_grad)  # over 2 kv heads
    v = torch.randn(R, 2, S, 8, generator=g, requires_grad=requires_grad)
    return lay, mod, q, k, v, g


@pytest.mark.parametrize(("B", "window", "causal", "T", "N"), _FLEX_CASES)
def test_flex_matches_dense_sdpa(B, window, causal, T, N):
    """flex_attention + flex_block_mask (CPU, eager) equals attend() with the dense mask, GQA, disabled blocks."""
    flex_attention = _flex_attention()
    lay, mod, q, k, v, _ = _flex_case(B, window, causal, T, N, requires_grad=False)
    dense = dense_mask(mod, lay)
    ref = attend(q, k, v, dense)
    # disabled blocks attend to nothing and give exactly 0
    dead = ~dense.any(-1)[:, 0]  # (R, Q)
    assert dead.any()
    assert (ref.permute(0, 2, 1, 3)[dead] == 0).all()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
            bm = flex_block_mask(mod, lay)
            out = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
            via_attend = attend(q, k, v, bm)  # the package's CPU flex path
    except Exception as e:  # pragma: no cover - depends on the torch build
        pytest.skip(f"flex_attention forward on CPU raised {type(e).__name__}: {e}")
    assert torch.isfinite(out).all()
    assert torch.allclose(out, ref, atol=1e-5, rtol=0), float((out - ref).abs().max())
    assert torch.allclose(via_attend, ref, atol=1e-5, rtol=0)


def test_flex_backward_matches_dense_sdpa():
    """flex_attention gradients equal the dense path's (skipped where CPU flex has no backward)."""
    flex_attention = _flex_attention()
    lay, mod, q, k, v, g = _flex_case(*_FLEX_CASES[1], requires_grad=True)
    ref = attend(q, k, v, dense_mask(mod, lay))
    w = torch.randn(ref.shape, generator=g)
    gr = torch.autograd.grad((ref * w).sum(), (q, k, v))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = flex_attention(q, k, v, block_mask=flex_block_mask(mod, lay), enable_gqa=True)
            gf = torch.autograd.grad((out * w).sum(), (q, k, v))
    except Exception as e:  # torch 2.13 CPU: NotImplementedError, no backward on CPU
        pytest.skip(f"flex_attention backward on CPU raised {type(e).__name__}: {e}")
    for a, b in zip(gf, gr, strict=True):
        assert torch.isfinite(a).all()
        assert torch.allclose(a, b, atol=1e-4, rtol=0), float((a - b).abs().max())


@pytest.mark.parametrize("chunk", [3, 1000])
def test_distillation_with_a_one_hot_teacher_is_cross_entropy(chunk):
    """`loss.distill`: with a teacher whose top-1 is the label, the soft loss equals the hard
    cross-entropy (any distill weight, through the chunked path too); with a real top-k
    teacher it differs, and moves the drafter's distribution toward the teacher's."""
    import dataclasses

    from dflash.model.loss import BlockTargets

    g = torch.Generator().manual_seed(0)
    M, H, V, B = 7, 8, 11, 4
    hidden = torch.randn(1, M, H, generator=g, requires_grad=True)
    head = torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (M,), generator=g)
    targets = BlockTargets(
        sel=torch.arange(M), labels=labels, weights=torch.rand(M, generator=g), slot=torch.arange(M) % B,
        weight_sum=1.0, count_per_slot=torch.bincount(torch.arange(M) % B, minlength=B),
    )  # fmt: skip
    spec = LossSpec(block_size=B, chunk=chunk)
    hard = block_loss(hidden, head, targets, spec).loss_sum
    one_hot = dataclasses.replace(targets, teacher=(torch.randn(M, 1, generator=g), labels[:, None]))
    for alpha in (0.3, 1.0):
        soft = block_loss(hidden, head, one_hot, dataclasses.replace(spec, distill=alpha)).loss_sum
        assert torch.allclose(soft, hard, rtol=1e-6), (alpha, soft, hard)
    vals, idx = torch.randn(M, 5, generator=g) * 3, torch.stack([torch.randperm(V, generator=g)[:5] for _ in range(M)])
    teacher = dataclasses.replace(targets, teacher=(vals, idx))
    soft = block_loss(hidden, head, teacher, dataclasses.replace(spec, distill=1.0)).loss_sum
    assert not torch.allclose(soft, hard)
    # one gradient step on the hidden states lowers the KL to the teacher's top-k distribution
    (grad,) = torch.autograd.grad(soft, hidden)
    with torch.no_grad():

        def kl(h: torch.Tensor) -> torch.Tensor:
            logp = torch.log_softmax(h[0] @ head.T, -1).gather(1, idx)
            p = torch.softmax(vals, -1)
            return (p * (p.log() - logp)).sum()

        assert kl(hidden - 0.05 * grad) < kl(hidden)
    # `loss.distill_temperature` T softens both distributions, and the soft term is scaled by T²
    T = 2.5
    soft_t = block_loss(hidden, head, teacher, dataclasses.replace(spec, distill=1.0, distill_temperature=T)).loss_sum
    logp_t = torch.log_softmax(hidden[0] @ head.T / T, -1).gather(1, idx)
    manual = -(torch.softmax(vals / T, -1) * logp_t).sum(-1) * T**2
    assert torch.allclose(soft_t, (manual * targets.weights).sum(), rtol=1e-5)


def test_dpace_weights_follow_the_accepted_length_surrogate():
    """`loss.position_weights = "dpace"`: slot j's weight is Σ_{k≥j} Π_{i≤k} s_i over the
    supervised slots of its block, s = (1 − α)·p + α — computed by hand here; the loss is
    Σ w·CE with those weights (no gradient through them), over the host's count of slots."""
    from dflash.model.loss import BlockTargets, dpace_weights

    B, alpha = 4, 0.5
    # two blocks (slot 0 = anchor, unsupervised); block 1 has slot 3 outside its document
    sel = torch.tensor([1, 2, 3, 5, 6])
    p = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.2])
    w = dpace_weights(p, sel, 2, B, alpha)
    s1, s2 = 0.5, 0.5 * 0.2 + 0.5  # block 1's smoothed confidences
    expected = torch.tensor([3.0, 2.0, 1.0, s1 + s1 * s2, s1 * s2])
    torch.testing.assert_close(w, expected)

    g = torch.Generator().manual_seed(1)
    H, V = 6, 9
    hidden = torch.randn(1, 2 * B, H, generator=g, requires_grad=True)
    head = torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (5,), generator=g)
    targets = BlockTargets(
        sel=sel, labels=labels, weights=torch.ones(5), slot=sel % B, weight_sum=5.0,
        count_per_slot=torch.bincount(sel % B, minlength=B),
    )  # fmt: skip
    for chunk in (2, 100):
        spec = LossSpec(block_size=B, chunk=chunk, position_weights="dpace", dpace_alpha=alpha)
        parts = block_loss(hidden, head, targets, spec)
        logits = hidden[0, sel] @ head.T
        ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
        manual = (dpace_weights(torch.exp(-ce.detach()), sel, 2, B, alpha) * ce).sum()
        torch.testing.assert_close(parts.loss_sum, manual)
        assert parts.weight_sum == 5.0
        (grad,) = torch.autograd.grad(parts.loss_sum, hidden)
        (ref,) = torch.autograd.grad(manual, hidden)
        torch.testing.assert_close(grad, ref)


def test_dpace_trains_and_differs_from_the_fixed_decay(tiny_config):
    """A run with D-PACE weights trains (finite losses) and is not the γ-decay run."""
    import math

    from tests.conftest import run_records

    def losses(**extra: object) -> list[float]:
        cfg = tiny_config(**{"train.max_steps": 4, "eval.at_end": "false", **extra})
        return [r["loss"] for r in run_records(cfg) if r["event"] == "train_step"]

    dpace = losses(**{"loss.position_weights": '"dpace"'})
    assert len(dpace) == 4 and all(math.isfinite(x) for x in dpace)
    assert dpace != losses()


@pytest.mark.parametrize("layer_types", [["full_attention"], ["sliding_attention", "full_attention"],
                                         ["full_attention", "sliding_attention"]])  # fmt: skip
def test_drafts_only_forward_equals_the_full_one_at_the_draft_slots(layer_types):
    """Training's `drafts_only` forward (the last layer skips the anchors' queries and MLP rows)
    gives the full forward's outputs at every draft slot, and its gradients to the weights.
    In float64: most weights' gradients here are ~1e-5, differences of larger terms, and in
    float32 the two paths' rounding (which depends on torch's thread count) is of that size."""
    model = _drafter(layer_types).train().double()
    emb, ctx, q_pos, ctx_pos, layout = _inputs()
    emb, ctx = emb.double(), ctx.double()
    masks = layer_masks(layout, model.spec, use_flex=False)
    drafts = torch.arange(emb.shape[1]) % _B != 0
    outs, grads = [], []
    for only in (False, True):
        model.zero_grad()
        out = model(emb, ctx, q_pos, ctx_pos, masks, drafts_only=only)
        (out[:, drafts] ** 2).sum().backward()
        outs.append(out[:, drafts].detach())
        grads.append([p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # the fast path ran: the anchors' rows are the last layer's input there
        full, fast = (model(emb, ctx, q_pos, ctx_pos, masks, drafts_only=o)[:, ~drafts] for o in (False, True))
    assert not torch.allclose(full, fast)
    for g1, g0 in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(g1, g0, rtol=1e-9, atol=1e-15)
