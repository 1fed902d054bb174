"""Replay τ: greedy speculative decoding's acceptance, computed from the target's greedy
replies and their features (regen's feature files) instead of decoding. Greedy verification
accepts, at each anchor, the drafts that equal the target's next greedy tokens; with the
target's reply in hand that is a teacher-forced forward of the drafter at every reply
position (one batched forward per reply), and eval's walk (the next anchor after the
accepted tokens and the bonus one) gives its τ. Far cheaper than `dflash eval` on a CPU, so it
can score every held-out prompt (a few prompts resolve τ coarsely): the demo's recipes are
compared with it (BENCHMARKS.md, docs/experiments.md). It is no lossless check and no speed
figure: `dflash eval` is.

    # once: the target's replies to the held-out prompts, with features (regen, 48 tokens as eval)
    bin/dflash regen configs/demo.toml --set run.name=heldout_replies --set regen.holdout=0 \\
        --set regen.prompts=runs/demo/regen.heldout.jsonl --set regen.max_new_tokens=48 \\
        --set regen.max_minutes=0 --set regen.batch_size=32 --set target.dtype=float32
    .venv/bin/python bench/replay_tau.py --replies runs/heldout_replies/regen.jsonl runs/demo/final [more drafters]

Prints one line per drafter: `tau` (eval's walk from each reply's start: what `dflash eval`
reports — the same verify steps, tested, but for two edges: eval may also count drafts that
match the target's tokens after a stop token inside the last block, and a batched float32
regen can round a near-tie differently from one-at-a-time decoding; replies whose text
re-tokenizes to other tokens are skipped), `tau_all` (every reply position as an anchor),
`p` (share of anchors accepting at least k drafts), and one JSON line each. Regen the replies
with the eval's target dtype (float32) and max_new_tokens (48).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash.config import load_config  # noqa: E402
from dflash.errors import DFlashError  # noqa: E402
from dflash.features.files import folder_for, read_folder, read_meta  # noqa: E402
from dflash.model.drafter import DFlashDrafter, FrozenHead  # noqa: E402
from dflash.model.export import load_drafter  # noqa: E402
from dflash.model.families import propose  # noqa: E402
from dflash.model.loading import load_tokenizer  # noqa: E402
from dflash.model.masks import BlockLayout, layer_masks  # noqa: E402
from dflash.model.target import load_target  # noqa: E402


def replies_with_features(replies: Path, tokenizer) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """(ids, features, prompt length) per reply in `replies` whose feature entry exists."""
    prompt_len: dict[tuple[int, ...], int] = {}
    for line in replies.read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        kwargs = r.get("chat_template_kwargs", {})
        full = tokenizer.apply_chat_template(r["messages"], tokenize=True, return_dict=True, **kwargs)["input_ids"]
        asked = [m for m in r["messages"] if m["role"] != "assistant"]
        p = tokenizer.apply_chat_template(asked, add_generation_prompt=True, tokenize=True, return_dict=True, **kwargs)
        prompt_len[tuple(full)] = len(p["input_ids"])
    out = []
    for _, e in read_folder(folder_for(replies)):
        key = tuple(e.ids.tolist())
        P = prompt_len.get(key)
        if P is None:
            continue
        # The reply as written must be the target's greedy tokens: where re-tokenizing the
        # text changed them, regen recomputed the features over other tokens: skipped.
        end = len(key) - 2  # <|im_end|> and "\n" close the turn
        if e.next is None or not torch.equal(e.next[P : end - 1], e.ids[P + 1 : end]):
            continue
        out.append((e.ids, e.features, P))
    return out


@torch.no_grad()
def accepted_per_anchor(
    drafter: DFlashDrafter, head: FrozenHead, ids: torch.Tensor, feats: torch.Tensor, start: int, end: int
) -> list[int]:
    """Drafts accepted by greedy verification at each anchor start..end-2 of a reply that the
    target generated at positions start..end-1 (consecutive matches with its next tokens; none
    past `end`, as eval's last block is cut at max_new_tokens), from one teacher-forced forward.
    Each family drafts as in eval (`propose`: DFlash2's walk, DSpark's Markov chain from its own
    drafts): up to the first miss its drafts are the truth, so the count is eval's."""
    B, mask_id = drafter.spec.block_size, drafter.spec.mask_token_id
    shift, n = drafter.spec.shift, drafter.spec.drafts
    T = len(ids)
    anchors = torch.arange(start, end - 1)[None]
    N = anchors.shape[1]
    layout = BlockLayout(anchors, torch.ones(1, N, dtype=torch.bool), torch.zeros(1, T, dtype=torch.long), B)
    masks = layer_masks(layout, drafter.spec, use_flex=False)
    block = torch.full((1, N, B), mask_id, dtype=torch.long)
    block[0, :, 0] = ids[anchors[0]]
    q_pos = (anchors[:, :, None] + torch.arange(B)).view(1, N * B)
    emb = F.embedding(block.view(1, N * B), head.embed)
    h = drafter(emb, feats.float()[None], q_pos, torch.arange(T)[None], masks)
    drafts, _ = propose(drafter, h.view(N, B, -1)[:, 1 - shift :], head.lm_head, ids[anchors[0]])  # (N, n)
    ext = torch.cat([ids[:end], torch.full((B + 1,), -1, dtype=ids.dtype)])
    truth = torch.stack([ext[anchors[0] + k] for k in range(1, n + 1)], 1)
    return (drafts == truth).int().cumprod(1).sum(1).tolist()


def walk(accepted: list[int]) -> list[int]:
    """Eval's verify steps over a reply: from the first anchor, the accepted drafts and the
    bonus token, then the next anchor. The accepted count of each step."""
    steps, i = [], 0
    while i < len(accepted):
        steps.append(accepted[i])
        i += accepted[i] + 1
    return steps


def replay(drafter: DFlashDrafter, head: FrozenHead, replies: list, stop_id: int, max_new: int = 48) -> dict:
    """`replies`: (ids, features, prompt length) each; a reply ends at its first `stop_id`
    (included, as eval counts it) or after `max_new` tokens."""
    span = drafter.spec.drafts + 1  # a verify step's tokens
    hist, every = [0] * span, [0] * span
    for ids, feats, P in replies:
        tail = ids[P:].tolist()
        n = min(tail.index(stop_id) + 1 if stop_id in tail else len(tail), max_new)
        if n < 2:
            continue
        acc = accepted_per_anchor(drafter, head, ids, feats, P, P + n)
        for a in acc:
            every[a] += 1
        for a in walk(acc):
            hist[a] += 1
    steps, n_all = sum(hist), sum(every)
    return {
        "tau": round(sum((k + 1) * c for k, c in enumerate(hist)) / steps, 4) if steps else None,
        "tau_all": round(sum((k + 1) * c for k, c in enumerate(every)) / n_all, 4) if n_all else None,
        "p": [round(sum(every[k:]) / n_all, 4) for k in range(1, span)] if n_all else [],
        "accept_hist": hist,
        "replies": len(replies),
        "verify_steps": steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafters", nargs="+", help="export or checkpoint folders")
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo.toml"))
    ap.add_argument("--replies", required=True, help="a regen output with feature files (regen.save_features)")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="the regen's (and eval's) max_new_tokens")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    cfg = load_config(args.config)
    tokenizer = load_tokenizer(cfg.target, cfg.data.cache_dir)
    if not Path(args.replies).is_file():
        sys.exit(f"replay_tau: replies not found: {args.replies} (the regen command in this script's help writes them)")
    replies = replies_with_features(Path(args.replies), tokenizer)
    if not replies:
        sys.exit(f"replay_tau: no reply of {args.replies} has a feature entry (regen.save_features = true?)")
    dev = torch.device("cpu")
    target = load_target(cfg.target.model_copy(update={"dtype": "float32"}), dev, 1, cfg.data.cache_dir)
    head = FrozenHead(target.embed_weight, target.lm_head_weight).to(dev, torch.float32)
    stop_id = int(tokenizer.eos_token_id)
    meta = read_meta(folder_for(Path(args.replies)))
    for path in args.drafters:
        try:
            drafter = load_drafter(path, dev).eval()
        except DFlashError as err:
            sys.exit(f"replay_tau: {err}")
        if meta is not None and list(meta.layer_ids) != list(drafter.spec.target_layer_ids):
            why = f"reads target layers {drafter.spec.target_layer_ids}, the feature files hold {meta.layer_ids}"
            sys.exit(f"replay_tau: {path} {why}: regen the replies with its target.layer_ids")
        rec = {"drafter": path, **replay(drafter, head, replies, stop_id, args.max_new_tokens)}
        print(f"{path}: tau {rec['tau']} (tau_all {rec['tau_all']}, p {rec['p']}, {rec['replies']} replies)")
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
