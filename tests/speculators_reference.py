"""dflash's DFlash2 and DSpark against speculators' (a reference no one here wrote), run in
.venv-engines (where `make test` installs speculators) by tests/test_families.py.

For each family: a small drafter with random weights (its family's modules far from their
initial values, so they matter) is exported in the speculators format and loaded into
speculators' own class. Then, on the same target hidden states:
- drafting: one block after a context, through both backbones; DFlash2's greedy walk over
  the selector's edge scores, DSpark's Markov-biased tokens left to right and its
  confidence; dflash's tokens from `dflash.model.families.propose`.
- training: one batch's loss, speculators' forward (eager attention, eager losses, hard
  labels "ce") with dflash's anchors put in place of its random ones, against dflash's
  `block_loss` with the family's terms. speculators divides by the count of supervised
  slots, dflash by Σ w (the step's normaliser): the sums are compared.
Prints one JSON object; the test reads the differences.

speculators' package imports its trainer's data modules (`datasets`, `hs_connectors`), which
its model classes never use: they are stubbed here rather than installed.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import json
import sys
import tempfile
import types
from pathlib import Path

import torch


def _stub(name: str) -> types.ModuleType:
    """A module whose every public name is an empty class."""

    def attribute(attr: str) -> type:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return type(attr, (), {})

    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__getattr__ = attribute  # type: ignore[method-assign]
    return module


for _name in ("datasets", "hs_connectors"):
    sys.modules.setdefault(_name, _stub(_name))

from safetensors.torch import load_file  # noqa: E402
from speculators.config import SpeculatorModelConfig  # noqa: E402
from speculators.losses import resolve_loss_config  # noqa: E402
from speculators.models.dflash import core as dflash_core  # noqa: E402
from speculators.models.dflash2 import DFlash2DraftModel  # noqa: E402
from speculators.models.dspark import DSparkDraftModel  # noqa: E402

from dflash.eval.decode import inference_masks  # noqa: E402
from dflash.model.drafter import DFlashDrafter, DrafterCache, DrafterSpec  # noqa: E402
from dflash.model.export import export_drafter  # noqa: E402
from dflash.model.families import family_terms, propose  # noqa: E402
from dflash.model.loss import LossSpec, block_loss, block_targets  # noqa: E402
from dflash.model.masks import BlockLayout, layer_masks  # noqa: E402

H, V, B, MASK, GAMMA, ALPHA = 64, 512, 4, 500, 4.0, 0.7
LAYERS = [0, 2]  # the target layers read (speculators' aux ids: these + 1)
FAMILY = {
    "dflash2": (DFlash2DraftModel, {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 32,
                                    "selector_top_k": 6}),
    "dspark": (DSparkDraftModel, {"markov_rank": 16, "confidence_head": True, "confidence_with_markov": True}),
}  # fmt: skip


def drafter(family: str, g: torch.Generator) -> DFlashDrafter:
    spec = DrafterSpec(
        hidden_size=H, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
        vocab_size=V, rms_norm_eps=1e-6, rope_theta=10000.0, target_layer_ids=LAYERS, num_target_layers=4,
        block_size=B, mask_token_id=MASK, layer_types=["full_attention"] * 2, sliding_window=2048,
        family=family, **FAMILY[family][1],
    )  # fmt: skip
    model = DFlashDrafter(spec)
    model.init_weights(g)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_conv." in name:
                p.add_(torch.randn(p.shape, generator=g) * (0.3 if "base_kernel" in name else 0.05))
            elif name.startswith(("candidate_selector.", "markov_head.")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.startswith("confidence_head."):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def theirs(family: str, folder: Path, embed: torch.Tensor, lm_head: torch.Tensor) -> torch.nn.Module:
    cfg = SpeculatorModelConfig.from_pretrained(str(folder))
    cfg.transformer_layer_config._attn_implementation = "eager"
    model = FAMILY[family][0](cfg)
    missing, unexpected = model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    with torch.no_grad():  # the target's, which speculators reloads from the verifier
        model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(lm_head)
        model.verifier_lm_head.weight.copy_(lm_head * 1000)  # near one-hot targets: their soft labels are hard
        model.verifier_norm.weight.fill_(1.0)
    return model.eval()


@torch.no_grad()
def their_block(model: torch.nn.Module, feats: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """The normed block states (1, B, H) after the context `feats` (1, S, k·H)."""
    S = feats.shape[1]
    ctx = model.hidden_norm(model.fc(feats))
    x = model.embed_tokens(block)
    pos = torch.arange(S + block.shape[1])[None]
    pe = model.rotary_emb(x, pos)
    for layer in model.layers:
        x = layer(hidden_states=x, target_hidden=ctx, attention_mask=None, position_ids=pos, position_embeddings=pe)
    return model.norm(x)


@torch.no_grad()
def drafting(family: str, ours: DFlashDrafter, ref: torch.nn.Module, g: torch.Generator) -> dict:
    S = int(torch.randint(3, 12, (), generator=g))
    feats = torch.randn(1, S, len(LAYERS) * H, generator=g)
    anchor = torch.randint(0, MASK, (1,), generator=g)
    block = torch.full((1, B), MASK)
    block[0, 0] = anchor
    cache = DrafterCache(len(ours.layers))
    ours.extend_context(cache, feats, torch.arange(S)[None])
    masks = inference_masks(ours, S, B, torch.device("cpu"))
    h = ours.forward_block(cache, ref.embed_tokens(block), torch.arange(S, S + B)[None], masks)
    shift = ours.spec.shift
    tokens, _ = propose(ours, h[:, 1 - shift :], ref.lm_head.weight, anchor)
    mine: list[torch.Tensor] = []  # dflash's scores along its own draft
    theirs_tokens, their_scores = [], []
    h_ref = their_block(ref, feats, block)
    unary = ref.lm_head(h_ref)[0]
    prev = anchor
    for i, slot in enumerate(range(1 - shift, B)):
        if family == "dflash2":
            cands, scores = ref.candidate_selector.select(unary[slot], h_ref[0, slot], prev)
            pick = cands[scores.argmax()]
            u = h[0, slot] @ ref.lm_head.weight.t()
            c = u.topk(ours.candidate_selector.top_k).indices
            mine.append(ours.candidate_selector.scores(u[c], h[0, slot], tokens[0, i - 1] if i else anchor[0], c))
        else:
            bias = ref.markov_head.block_bias(prev_token_ids=prev[:, None], hidden_states=h_ref[:, slot : slot + 1])
            scores = unary[slot] + bias[0, 0]
            pick = scores.argmax()
            prev_mine = tokens[0, i - 1 : i] if i else anchor
            mine.append(h[0, slot] @ ref.lm_head.weight.t() + ours.markov_head.bias(prev_mine)[0])
            emb = ref.markov_head.prev_embeddings(prev)
            conf_ref = torch.sigmoid(ref.confidence_head(torch.cat([h_ref[0, slot], emb[0]])))
            conf_ours = torch.sigmoid(ours.confidence_head(h[0, slot], ours.markov_head.markov_w1(prev_mine)[0]))
            scores = torch.cat([scores, conf_ref[None]])
            mine[-1] = torch.cat([mine[-1], conf_ours[None]])
        theirs_tokens.append(int(pick))
        their_scores.append(scores)
        prev = pick.view(1)
    score_diff = max(float((a - b).abs().max()) for a, b in zip(mine, their_scores, strict=True))
    return {"ours": tokens[0].tolist(), "theirs": theirs_tokens, "score_diff": score_diff}


def training(family: str, ours: DFlashDrafter, ref: torch.nn.Module, embed: torch.Tensor, g: torch.Generator) -> dict:
    T, N = 40, 6
    shift = ours.spec.shift
    ids = torch.randint(0, MASK, (1, T), generator=g)
    feats = torch.randn(1, T, len(LAYERS) * H, generator=g)
    last_hidden = torch.randn(1, T, H, generator=g)
    loss_mask = torch.ones(1, T)
    doc = torch.zeros(1, T, dtype=torch.long)
    anchors = torch.sort(torch.randperm(T - B - 1, generator=g)[:N]).values[None]
    valid = torch.ones(1, N, dtype=torch.bool)
    # speculators with these anchors in place of its random draw
    dflash_core.select_anchors = lambda *_: (anchors[0], valid[0])
    kwargs = {"selector_loss_alpha": ALPHA} if family == "dflash2" else {"confidence_head_alpha": ALPHA}
    eager = resolve_loss_config("ce", "eager")
    _, their_loss, _ = ref(
        hidden_states=feats, input_ids=ids, loss_mask=loss_mask, verifier_last_hidden_states=last_hidden,
        document_ids=doc, loss_config=eager, tv_loss_fn=resolve_loss_config("tv", "eager")["tv"][0],
        gamma=GAMMA, max_anchors=N, **kwargs,
    )  # fmt: skip
    with torch.no_grad():  # their hard labels: the target's argmax one position before each label
        greedy = ref.verifier_lm_head(ref.verifier_norm(last_hidden))[0].argmax(-1)
    targets = block_targets(ids, loss_mask, doc, anchors, valid, B, GAMMA, None, shift)
    label_pos = (anchors[:, :, None] + torch.arange(B) + shift).reshape(-1)[targets.sel]
    targets = dataclasses.replace(targets, labels=greedy[label_pos - 1])
    layout = BlockLayout(anchors, valid, doc, B)
    block = torch.full((1, N, B), MASK)
    block[:, :, 0] = torch.gather(ids, 1, anchors)
    q_pos = (anchors[:, :, None] + torch.arange(B)).view(1, -1)
    hidden = ours(torch.nn.functional.embedding(block.view(1, -1), embed), feats, q_pos, torch.arange(T)[None],
                  layer_masks(layout, ours.spec, use_flex=False), drafts_only=True)  # fmt: skip
    spec = LossSpec(block_size=B, gamma=GAMMA, selector_loss=ALPHA, confidence_loss=ALPHA)
    parts = block_loss(hidden, ref.lm_head.weight.detach(), targets, spec, terms=family_terms(ours, spec))
    n = len(targets.sel)
    eps = 1e-5  # speculators' in its denominator
    return {"ours_sum": parts.loss_sum.item(), "theirs_sum": their_loss.item() * (n + eps), "slots": n}


def main() -> None:
    out = {}
    for family in FAMILY:
        g = torch.Generator().manual_seed(7)
        ours = drafter(family, g)
        embed, lm_head = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) * 0.2
        folder = Path(tempfile.mkdtemp()) / family
        export_drafter(ours, folder, dtype=torch.float32, fmt="speculators")
        ref = theirs(family, folder, embed, lm_head)
        blocks = [drafting(family, ours, ref, g) for _ in range(4)]
        out[family] = {
            "drafting": {key: [b[key] for b in blocks] for key in ("ours", "theirs")}
            | {"score_diff": max(b["score_diff"] for b in blocks)},
            "training": training(family, ours, ref, embed, g),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
