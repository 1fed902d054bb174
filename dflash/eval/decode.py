"""DFlash speculative decoding with a trained drafter: τ, per-position acceptance, and the
lossless check against the target's own greedy output.

Greedy, one sequence at a time, KV caches on both sides:
prefill the target on the prompt (first token from its logits, the chosen layers' outputs
become the drafter's context, cached as per-layer keys/values); then loop:
block = [last token, MASK × (B-1)] at positions start..start+B-1; the drafter proposes
B-1 tokens; the target verifies the block in one forward; accept the longest prefix where
proposal == target's greedy token, plus the target's next token (bonus); append the
accepted positions' layer outputs to the drafter's context; crop the target cache.
The layer outputs come from the same hooks as training's (`Target.forward_with_features`),
the drafter's attention masks from the same `layer_masks`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dflash.model.drafter import DFlashDrafter, DrafterCache, FrozenHead
from dflash.model.hf_compat import cache_kwarg, crop_cache, output_cache, plain_kv_cache
from dflash.model.masks import BlockLayout, layer_masks
from dflash.model.target import Target

__all__ = [
    "SpecOutput",
    "evaluate",
    "evaluate_chat",
    "greedy_generate",
    "greedy_generate_batch",
    "inference_masks",
    "speculative_generate",
    "speculative_generate_batch",
]


@dataclass
class SpecOutput:
    tokens: list[int]
    accepted: list[int]  # per verify step: how many proposals were accepted (0..B-1)


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


def _truncate(tokens: list[int], max_new: int, stop_ids: set[int]) -> list[int]:
    out = []
    for t in tokens[:max_new]:
        out.append(t)
        if t in stop_ids:
            break
    return out


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """The next token from logits (V,): argmax at temperature 0, else a sample."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


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


@torch.no_grad()
def greedy_generate(
    target: Target,
    prompt: torch.Tensor,
    max_new: int,
    stop_ids: set[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The target alone (greedy: the lossless reference; with a temperature: sampled)."""
    model, key = target.model, cache_kwarg(target.model)
    out = model(input_ids=prompt[None].to(target.device), use_cache=True)
    tokens = [_pick(out.logits[0, -1], temperature, generator)]
    while len(tokens) < max_new and tokens[-1] not in stop_ids:
        nxt = torch.tensor([[tokens[-1]]], device=target.device)
        out = model(input_ids=nxt, use_cache=True, **{key: output_cache(out)})
        tokens.append(_pick(out.logits[0, -1], temperature, generator))
    return _truncate(tokens, max_new, stop_ids)


@torch.no_grad()
def speculative_generate(
    target: Target,
    drafter: DFlashDrafter,
    head: FrozenHead,
    prompt: torch.Tensor,
    max_new: int,
    stop_ids: set[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> SpecOutput:
    """Greedy (temperature 0: output equal to `greedy_generate`'s), or sampled with
    speculative sampling's verification (`verify_sampled`: the target's distribution)."""
    key = cache_kwarg(target.model)
    dev = target.device
    ddev = next(drafter.parameters()).device
    pdtype = next(drafter.parameters()).dtype
    B, mask_id = drafter.spec.block_size, drafter.spec.mask_token_id
    P = prompt.numel()
    # The drafter's context: the chosen layers read by the same hooks as in training.
    out, feats = target.forward_with_features(input_ids=prompt[None].to(dev), use_cache=True)
    tcache = output_cache(out)
    dcache = DrafterCache(len(drafter.layers))
    drafter.extend_context(dcache, feats.to(ddev, pdtype), torch.arange(P, device=ddev)[None])
    tokens = [_pick(out.logits[0, -1], temperature, generator)]
    accepted: list[int] = []
    while len(tokens) < max_new and tokens[-1] not in stop_ids:
        start = P + len(tokens) - 1  # absolute position of the last token: the anchor
        bs = min(B, max_new - len(tokens) + 1)
        block = torch.full((1, bs), mask_id, dtype=torch.long, device=ddev)
        block[0, 0] = tokens[-1]
        q_pos = torch.arange(start, start + bs, device=ddev)[None]
        masks = inference_masks(drafter, dcache.length, bs, ddev)
        emb = F.embedding(block, head.embed).to(pdtype)
        h = drafter.forward_block(dcache, emb, q_pos, masks)  # (1, bs, H)
        draft_logits = h[0, 1:].to(head.lm_head.dtype).contiguous() @ head.lm_head.t()  # (bs-1, V)
        if temperature > 0:
            q = torch.softmax(draft_logits.float().cpu() / temperature, dim=-1)
            proposals = torch.multinomial(q, 1, generator=generator).flatten().to(ddev)
        else:
            proposals = draft_logits.argmax(dim=-1)
        verify = torch.cat([block[0, :1], proposals]).to(dev)[None]
        vout, vfeats = target.forward_with_features(
            input_ids=verify, position_ids=q_pos.to(dev), use_cache=True, **{key: tcache}
        )
        tcache = output_cache(vout)
        props = proposals.tolist()
        if temperature > 0:
            p = torch.softmax(vout.logits[0].float().cpu() / temperature, dim=-1)  # (bs, V)
            acc, nxt = verify_sampled(props, q, p, generator)
        else:
            post = vout.logits[0].argmax(dim=-1).tolist()  # target's next token after each slot
            acc = greedy_accepted(props, post, bs - 1)
            nxt = post[acc]
        new = [*props[:acc], nxt]
        tokens += new
        accepted.append(acc)
        if not stop_ids.isdisjoint(new):  # a stop id anywhere in the accepted tokens ends it (as the reference)
            break
        crop_cache(tcache, start + acc + 1)
        drafter.extend_context(dcache, vfeats[:, : acc + 1].to(ddev, pdtype), q_pos[:, : acc + 1])
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


@torch.no_grad()
def speculative_generate_batch(
    target: Target,
    drafter: DFlashDrafter,
    head: FrozenHead,
    prompts: Sequence[torch.Tensor],
    max_new: int,
    stop_ids: set[int],
) -> list[SpecOutput]:
    """Greedy speculative decoding of several prompts at once: each verify step is one target
    forward over every row's block (on a CPU or a GPU, R rows cost far less than R forwards).

    Each row keeps its own positions. Nothing is cropped: every step appends a block's B slots
    to both KV caches, and the slots of rejected proposals (and a finished row's) stay there,
    hidden by the attention masks from then on. Row r's drafter sees exactly the context and
    block `speculative_generate` gives it (`_batch_masks`), so each row's tokens and verify
    steps equal the one-prompt loop's, up to the float rounding of batched matmuls."""
    R = len(prompts)
    key = cache_kwarg(target.model)
    dev = target.device
    ddev = next(drafter.parameters()).device
    pdtype = next(drafter.parameters()).dtype
    B, mask_id = drafter.spec.block_size, drafter.spec.mask_token_id
    ids, valid, pos = _left_padded(prompts)
    out, feats = target.forward_with_features(
        input_ids=ids.to(dev), attention_mask=valid.long().to(dev), position_ids=pos.to(dev), use_cache=True
    )
    tcache = output_cache(out)
    dcache = DrafterCache(len(drafter.layers))
    feats = torch.where(valid[..., None].to(feats.device), feats, 0.0)  # padding: never seen, never NaN
    drafter.extend_context(dcache, feats.to(ddev, pdtype), pos.to(ddev))
    tokens = [[t] for t in out.logits[:, -1].argmax(dim=-1).tolist()]
    accepted: list[list[int]] = [[] for _ in range(R)]
    ctx = [p.numel() for p in prompts]  # each row's context: its tokens in the caches
    done = [len(t) >= max_new or t[-1] in stop_ids for t in tokens]
    valid = valid.to(ddev)
    while not all(done):
        sizes = [1 if done[r] else min(B, max_new - len(tokens[r]) + 1) for r in range(R)]
        block = torch.full((R, B), mask_id, dtype=torch.long, device=ddev)
        block[:, 0] = torch.tensor([t[-1] for t in tokens], device=ddev)
        q_pos = torch.tensor(ctx, device=ddev)[:, None] + torch.arange(B, device=ddev)
        masks = _batch_masks(drafter, valid, ctx, sizes, B)
        h = drafter.forward_block(dcache, F.embedding(block, head.embed).to(pdtype), q_pos, masks)
        drafts = h[:, 1:].reshape(-1, h.shape[-1]).to(head.lm_head.dtype)  # 2-D: one plain GEMM with the head
        proposals = F.linear(drafts, head.lm_head).argmax(dim=-1).view(R, B - 1)
        verify = torch.cat([block[:, :1], proposals], dim=1).to(dev)
        attn = torch.cat([valid, torch.ones(R, B, dtype=torch.bool, device=ddev)], dim=1).long().to(dev)
        vout, vfeats = target.forward_with_features(
            input_ids=verify, position_ids=q_pos.to(dev), attention_mask=attn, use_cache=True, **{key: tcache}
        )
        tcache = output_cache(vout)
        post = vout.logits.argmax(dim=-1).tolist()  # (R, B): the target's token after each slot
        props = proposals.tolist()
        keep = torch.zeros(R, B, dtype=torch.bool)
        for r in range(R):
            if done[r]:
                continue
            acc = greedy_accepted(props[r], post[r], sizes[r] - 1)
            new = [*props[r][:acc], post[r][acc]]
            tokens[r] += new
            accepted[r].append(acc)
            keep[r, : acc + 1] = True
            ctx[r] += acc + 1
            done[r] = len(tokens[r]) >= max_new or not stop_ids.isdisjoint(new)
        valid = torch.cat([valid, keep.to(ddev)], dim=1)
        drafter.extend_context(dcache, vfeats.to(ddev, pdtype), q_pos)
    return [SpecOutput(_truncate(tokens[r], max_new, stop_ids), accepted[r]) for r in range(R)]


@torch.no_grad()
def greedy_generate_batch(
    target: Target, prompts: Sequence[torch.Tensor], max_new: int, stop_ids: set[int]
) -> list[list[int]]:
    """The target alone, greedy, several prompts at once (left-padded): `greedy_generate` row
    by row, up to the float rounding of batched matmuls."""
    model, key, dev = target.model, cache_kwarg(target.model), target.device
    ids, valid, pos = _left_padded(prompts)
    valid = valid.to(dev)
    out = model(input_ids=ids.to(dev), attention_mask=valid.long(), position_ids=pos.to(dev), use_cache=True)
    nxt = out.logits[:, -1].argmax(dim=-1)
    tokens = [[t] for t in nxt.tolist()]
    last = torch.tensor([p.numel() - 1 for p in prompts], device=dev)
    done = [t[-1] in stop_ids for t in tokens]
    while len(tokens[0]) < max_new and not all(done):
        valid = torch.cat([valid, torch.ones(len(prompts), 1, dtype=torch.bool, device=dev)], dim=1)
        last = last + 1
        out = model(
            input_ids=nxt[:, None], attention_mask=valid.long(), position_ids=last[:, None], use_cache=True,
            **{key: output_cache(out)},
        )  # fmt: skip
        nxt = out.logits[:, -1].argmax(dim=-1)
        for r, t in enumerate(nxt.tolist()):
            tokens[r].append(t)
            done[r] = done[r] or t in stop_ids
    return [_truncate(t, max_new, stop_ids) for t in tokens]


class _Tally:
    """What the `eval` record reports, summed over generations."""

    def __init__(self, block_size: int, temperature: float = 0.0, batch_size: int = 1) -> None:
        self.B = block_size
        self.temperature = temperature
        self.batch_size = batch_size if temperature <= 0 else 1
        self.largest_batch = 1  # the most prompts decoded at once
        self.singly = 0  # batched rows whose outputs differed, decided again one prompt at a time
        self.hist = [0] * block_size
        self.spec_s = self.plain_s = 0.0
        self.mismatches = self.generated = 0
        self.per_generation: list[float] = []  # each generation's own τ

    def add(self, spec: SpecOutput, plain: list[int], spec_s: float, plain_s: float) -> None:
        self.spec_s += spec_s
        self.plain_s += plain_s
        self.generated += len(spec.tokens)
        self.mismatches += self.temperature <= 0 and spec.tokens != plain
        for a in spec.accepted:
            self.hist[a] += 1
        if spec.accepted:
            self.per_generation.append(sum(a + 1 for a in spec.accepted) / len(spec.accepted))

    def record(self, prompts: int) -> dict[str, Any]:
        hist, steps = self.hist, sum(self.hist)
        tau = sum((a + 1) * n for a, n in enumerate(hist)) / steps if steps else 0.0
        per_position = [sum(hist[k:]) / steps if steps else 0.0 for k in range(1, self.B)]
        gens = self.per_generation
        return {
            "tau": round(tau, 4),
            # the reference benchmark's "average acceptance length": the mean of each generation's τ
            "tau_per_generation": round(sum(gens) / len(gens), 4) if gens else 0.0,
            "accept_hist": hist,
            "accept_per_position": [round(x, 4) for x in per_position],
            "verify_steps": steps,
            "prompts": prompts,
            "generations": len(gens),
            "tokens": self.generated,
            "spec_s": round(self.spec_s, 4),
            "plain_s": round(self.plain_s, 4),
            # at batch_size > 1: batched speculative decoding against batched plain decoding
            "speedup": round(self.plain_s / self.spec_s, 3) if self.spec_s > 0 else None,
            "batch_size": self.largest_batch,
            "decided_singly": self.singly,
            # sampled: outputs differ from a plain sample by chance; exactness is in distribution
            "lossless": self.mismatches == 0 if self.temperature <= 0 else None,
            "mismatched_prompts": self.mismatches,
            "block_size": self.B,
            "temperature": self.temperature,
        }


@contextlib.contextmanager
def _eval_mode(drafter: DFlashDrafter) -> Iterator[None]:
    """The drafter in eval mode for the block, then back to what it was (training)."""
    was_training = drafter.training
    drafter.eval()
    try:
        yield
    finally:
        drafter.train(was_training)


def _generate(
    target: Target,
    drafter: DFlashDrafter,
    head: FrozenHead,
    ids: torch.Tensor,
    max_new: int,
    stop: set[int],
    tally: _Tally,
    generator: torch.Generator | None = None,
) -> SpecOutput:
    """One speculative generation and the plain one (greedy: it must equal it), both timed."""
    T = tally.temperature
    t0 = time.perf_counter()
    spec = speculative_generate(target, drafter, head, ids, max_new, stop, T, generator)
    t1 = time.perf_counter()
    plain = greedy_generate(target, ids, max_new, stop, T, generator)
    tally.add(spec, plain, t1 - t0, time.perf_counter() - t1)
    return spec


def _generate_many(
    target: Target,
    drafter: DFlashDrafter,
    head: FrozenHead,
    prompts: Sequence[torch.Tensor],
    max_new: int,
    stop: set[int],
    tally: _Tally,
    generator: torch.Generator | None = None,
) -> list[SpecOutput]:
    """`_generate` for each prompt, or (greedy, `tally.batch_size` > 1) batches of them: batched
    speculative decoding, then batched plain decoding, each batch's time shared by its rows. A
    row whose two outputs differ is decided one prompt at a time, as batch size 1 decides it:
    a batched matmul can round a near-tie the other way, and only a mismatch there counts."""
    if tally.batch_size <= 1 or not plain_kv_cache(target.model):  # a sliding window counts hidden slots
        return [_generate(target, drafter, head, p, max_new, stop, tally, generator) for p in prompts]
    outs = []
    for s in range(0, len(prompts), tally.batch_size):
        chunk = prompts[s : s + tally.batch_size]
        tally.largest_batch = max(tally.largest_batch, len(chunk))
        t0 = time.perf_counter()
        specs = speculative_generate_batch(target, drafter, head, chunk, max_new, stop)
        t1 = time.perf_counter()
        plains = greedy_generate_batch(target, chunk, max_new, stop)
        t2 = time.perf_counter()
        for p, spec, plain in zip(chunk, specs, plains, strict=True):
            if spec.tokens != plain:
                tally.singly += 1
                spec = speculative_generate(target, drafter, head, p, max_new, stop)
                plain = greedy_generate(target, p, max_new, stop)
            tally.add(spec, plain, (t1 - t0) / len(chunk), (t2 - t1) / len(chunk))
            outs.append(spec)
    return outs


def evaluate(
    target: Target,
    drafter: DFlashDrafter,
    head: FrozenHead,
    prompts: Sequence[torch.Tensor],
    max_new: int,
    stop_ids: set[int] | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    batch_size: int = 1,
) -> dict[str, Any]:
    """The `eval` record over token-id prompts: τ, acceptance histogram / per position,
    speed, lossless (greedy; with a temperature, sampled: exact in distribution).
    `batch_size` > 1 (greedy only): that many prompts decoded at once (`_generate_many`)."""
    tally = _Tally(drafter.spec.block_size, temperature, batch_size)
    gen = torch.Generator().manual_seed(seed)
    with _eval_mode(drafter):
        _generate_many(target, drafter, head, prompts, max_new, stop_ids or set(), tally, gen)
    return tally.record(len(prompts))


def evaluate_chat(
    target: Target,
    drafter: DFlashDrafter,
    head: FrozenHead,
    tokenizer: Any,
    prompts: Sequence[Any],
    max_new: int,
    stop_ids: set[int] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    batch_size: int = 1,
) -> dict[str, Any]:
    """The `eval` record over chat prompts (`data.prompt_sets`): each prompt's turns in
    order, each through the chat template after the target's reply to the one before (the
    speculative output, which equals the plain one when lossless), as the reference's
    benchmark does for MT-Bench. With `batch_size` > 1, turn k of every prompt that has one
    is decoded in batches, after every prompt's turn k - 1."""
    tally = _Tally(drafter.spec.block_size, temperature, batch_size)
    gen = torch.Generator().manual_seed(seed)
    histories: list[list[dict[str, str]]] = [[] for _ in prompts]
    # One prompt after another (a sampled eval draws in the same order at any --num-prompts), or
    # with batches every prompt's turn k, then every turn k + 1.
    everyone = [list(range(len(prompts)))] if prompts else []
    groups = [[i] for i in range(len(prompts))] if tally.batch_size <= 1 else everyone
    with _eval_mode(drafter):
        for group, k in ((g, k) for g in groups for k in range(max(len(prompts[i]) for i in g))):
            rows = [i for i in group if k < len(prompts[i])]
            ids = []
            for i in rows:
                histories[i] = [*histories[i], *prompts[i][k]]
                enc = tokenizer.apply_chat_template(
                    histories[i], add_generation_prompt=True, tokenize=True, return_dict=True,
                    **(template_kwargs or {}),
                )  # fmt: skip
                ids.append(torch.tensor(list(enc["input_ids"]), dtype=torch.long))
            specs = _generate_many(target, drafter, head, ids, max_new, stop_ids or set(), tally, gen)
            for i, spec in zip(rows, specs, strict=True):
                reply = tokenizer.decode(spec.tokens, skip_special_tokens=True)
                histories[i] = [*histories[i], {"role": "assistant", "content": reply}]
    return tally.record(len(prompts))


def stop_ids_of(target: Target) -> set[int]:
    """The target's end-of-sequence ids (generation config, then model config)."""
    ids: set[int] = set()
    for cfg in (getattr(target.model, "generation_config", None), target.model.config):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(e) for e in eos)
    return ids


def check_drafter_fits(drafter: DFlashDrafter, target: Target) -> None:
    """A drafter trained for another target must be refused, not silently evaluated."""
    from dflash.errors import CheckpointError

    spec = drafter.spec
    problems = []
    if spec.hidden_size != target.hidden_size:
        problems.append(f"hidden size {spec.hidden_size} vs target {target.hidden_size}")
    if spec.vocab_size != target.vocab_size:
        problems.append(f"vocab size {spec.vocab_size} vs target {target.vocab_size}")
    if spec.num_target_layers != target.num_layers:
        problems.append(f"trained on a {spec.num_target_layers}-layer target, this one has {target.num_layers}")
    if problems:
        msg = "drafter does not fit this target: " + "; ".join(problems)
        raise CheckpointError(msg)


def require_eval_prompts(cfg: Any, also: str = "") -> None:
    """Chat prompts are needed (files data, or eval.prompts set) and must exist; cheap, so
    callers check before loading any model. `also`: another way out, for the message."""
    if (cfg.data.source == "files" or cfg.eval.prompts) and not cfg.heldout_prompts.is_file():
        from dflash.errors import DataError

        msg = f"eval prompts not found: {cfg.heldout_prompts} (run `dflash regen` first, or set eval.prompts{also})"
        raise DataError(msg)


def eval_prompts(cfg: Any, target: Target, tokenizer: Any, mask_id: int) -> list[torch.Tensor]:
    """Held-out prompts as token ids: random ones for synthetic or random data, else the chat
    prompts of `eval.prompts` (default: the held-out file regen wrote), through the chat template."""
    from dflash.data.synthetic import draw_prompts

    n = cfg.eval.num_prompts
    if cfg.data.source != "files" and not cfg.eval.prompts:
        return draw_prompts(cfg.data, target.vocab_size, n, cfg.run.seed + 104_729, mask_id)
    from dflash.data.prompts import jsonl_prompts
    from dflash.errors import DataError

    if tokenizer is None:
        msg = "eval on chat prompts needs a target with a tokenizer (target.kind = 'hf' or 'gguf')"
        raise DataError(msg)
    require_eval_prompts(cfg)
    out = []
    for p in jsonl_prompts(cfg.heldout_prompts)[:n]:
        enc = tokenizer.apply_chat_template(
            p, add_generation_prompt=True, tokenize=True, return_dict=True, **cfg.data.chat_template_kwargs
        )
        out.append(torch.tensor(list(enc["input_ids"]), dtype=torch.long))
    return out


def stop_ids(target: Target, tokenizer: Any) -> set[int]:
    """The tokenizer's end-of-turn id when there is a tokenizer (GGUF metadata can be off)."""
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return {int(tokenizer.eos_token_id)}
    return stop_ids_of(target)


def run_eval(
    cfg: Any, drafter_path: Any, prompt_sets: Sequence[str] = (), limit: int | None = None
) -> list[dict[str, Any]]:
    """`dflash eval`: load the config's target and a drafter (export or checkpoint folder),
    evaluate on each prompt set (`data.prompt_sets`: mtbench, humaneval, heldout, a file;
    none: the run's held-out or random prompts, `eval.num_prompts` of them). One `eval`
    record per set, with `prompt_set`. `limit`: at most this many prompts per set."""
    from dflash.eval.prompts import load_prompt_set
    from dflash.model.export import load_drafter
    from dflash.model.loading import load_tokenizer
    from dflash.model.target import load_target
    from dflash.runtime.devices import check_device

    t_dev = check_device(cfg.pipeline.target_devices[0], "pipeline.target_devices[0]")
    d_dev = check_device(cfg.pipeline.drafter_devices[0], "pipeline.drafter_devices[0]")
    sets = [load_prompt_set(name, cfg.heldout_prompts if cfg.eval.prompts or cfg.data.source == "files" else None)
            for name in prompt_sets]  # fmt: skip
    drafter = load_drafter(drafter_path, d_dev)
    if not sets:
        require_eval_prompts(cfg)
    tcfg = cfg.target.model_copy(update={"layer_ids": drafter.spec.target_layer_ids})
    if cfg.eval.target_dtype != "same":
        tcfg = tcfg.model_copy(update={"dtype": cfg.eval.target_dtype})
    target = load_target(tcfg, t_dev, 1, cfg.data.cache_dir)
    tokenizer = load_tokenizer(cfg.target, cfg.data.cache_dir)
    check_drafter_fits(drafter, target)
    head = FrozenHead(target.embed_weight, target.lm_head_weight).to(d_dev, torch.float32)
    stop, max_new = stop_ids(target, tokenizer), cfg.eval.max_new_tokens
    if not sets:
        prompts = eval_prompts(cfg, target, tokenizer, drafter.spec.mask_token_id)[:limit]
        chat = cfg.data.source == "files" or bool(cfg.eval.prompts)
        record = evaluate(
            target, drafter, head, prompts, max_new, stop, cfg.eval.temperature, cfg.run.seed, cfg.eval.batch_size
        )
        return [{"prompt_set": "heldout" if chat else "random", **record}]
    if tokenizer is None:
        from dflash.errors import DataError

        msg = "--prompts: chat prompt sets need a target with a tokenizer (target.kind = 'hf' or 'gguf')"
        raise DataError(msg)
    records = []
    kwargs = dict(cfg.data.chat_template_kwargs)
    for ps in sets:
        rec = evaluate_chat(
            target, drafter, head, tokenizer, ps.prompts[:limit], max_new, stop,
            template_kwargs=cfg.data.chat_template_kwargs, temperature=cfg.eval.temperature, seed=cfg.run.seed,
            batch_size=cfg.eval.batch_size,
        )  # fmt: skip
        records.append({"prompt_set": ps.name, **rec, "chat_template_kwargs": kwargs})
    return records
