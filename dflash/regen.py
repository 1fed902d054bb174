"""Self-distillation: the target writes the assistant turns for a prompt set.

This is how production drafters are trained — on the target's own outputs, which is
exactly what the drafter must predict at inference — and it makes a small prompt set
enough. `dflash regen CONFIG` reads prompts (the chatterbot-corpus package, or a chat
file whose conversations are cut before their first assistant turn; or several such sets,
answered one after the other), keeps `holdout` of the first set aside for eval, and
generates replies in batches (greedy, or sampled) in a seeded random order, like lengths
batched together so that padding stays low. Output is JSONL `{"id", "messages"}`, appended
batch by batch and flushed: an interrupted regen resumes where it stopped.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import math
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dflash.config import Config
from dflash.data.chat_template import tokenize_many
from dflash.data.prompts import Messages, Prompts, load_prompts, prompt_key
from dflash.data.samples import Sample, collate
from dflash.errors import DataError
from dflash.features.files import Entry, FeatureMeta, folder_for, next_part_index, read_meta, write_part
from dflash.model.hf_compat import cache_kwarg, output_cache, plain_kv_cache
from dflash.pipeline.stages import target_forward

__all__ = ["regenerate", "write_jsonl"]

def write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    tmp.replace(path)


def _drop_torn_tail(path: Path) -> None:
    """An interrupted append can leave a last line without its newline: drop it (that prompt
    is generated again), so that no half record counts and appends start on a clean line."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


def _done_prompts(path: Path, template_kwargs: dict[str, Any]) -> set[str]:
    """The prompts (messages before the reply) already answered in the output file.

    Matched by content, not position: a resume after changing the seed, holdout or prompt
    file never mistakes one prompt's reply for another's. Replies written under other chat
    template options (`data.chat_template_kwargs`, kept in each record) are refused: the
    target answered other prompts' renderings, and the file would mix them.
    """
    done: set[str] = set()
    if not path.is_file():
        return done
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                record = json.loads(raw)
                done.add(prompt_key(record["messages"][:-1]))
                written = record.get("chat_template_kwargs", {})
            except (ValueError, KeyError, TypeError, IndexError, AttributeError):
                msg = f"{path}:{n}: not a regen record; remove the line (or the file) and run regen again"
                raise DataError(msg) from None
            if written != template_kwargs:
                msg = (
                    f"{path}:{n}: written with data.chat_template_kwargs = {written}, the config now has "
                    f"{template_kwargs}; use a new regen.output"
                )
                raise DataError(msg)
    return done


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """One regen per output file: two appending at once would answer prompts twice."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.with_name(path.name + ".lock")
    with lock.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            msg = f"{path}: another `dflash regen` is writing it; wait for it to end (or use a new regen.output)"
            raise DataError(msg) from None
        yield


def _feature_entries(
    target: Any,
    tokenizer: Any,
    convs: list[Messages],
    fed: list[list[int]],
    after: list[int],
    feats: list[torch.Tensor],
    template_kwargs: dict[str, Any],
    greedy: bool,
) -> list[Entry | None]:
    """The feature-file entries of one batch of replies (see dflash/features/files.py).

    `convs`: each conversation as written; `fed[r]`: the token ids the target ran over while
    generating it (prompt, then reply); `feats[r]` (len(fed[r]), k·H): its features there;
    `after[r]`: the token it generated after the last one fed. A conversation whose training
    tokenization does not start with `fed[r]` gets its features from one more target forward
    over that tokenization; one training would skip (invalid) gets None."""
    toks = tokenize_many(tokenizer, convs, template_kwargs)
    entries: list[Entry | None] = [None] * len(convs)
    redo: list[tuple[int, list[int]]] = []
    for r, t in enumerate(toks):
        if isinstance(t, str):
            continue
        ids, f = t[0], fed[r]
        if ids[: len(f)] != f:
            redo.append((r, ids))
            continue
        x = torch.zeros(len(ids), feats[r].shape[-1], dtype=torch.bfloat16)
        x[: len(f)] = feats[r]
        nxt = None
        if greedy:  # the next token at each position; after the last fed one, the target's own
            nxt = torch.tensor([*ids[1:], ids[-1]])
            nxt[len(f) - 1] = after[r]
        entries[r] = Entry(torch.tensor(ids), x, nxt)
    if redo:  # the training tokenization itself through the target: the training forward
        rows = [Sample(j, torch.tensor(ids), torch.ones(len(ids), dtype=torch.bool)) for j, (_, ids) in enumerate(redo)]
        layers, top = target_forward.forward(target, collate(rows, 0, 0), 1 if greedy else 0)
        x_all = torch.cat(layers, dim=-1).cpu()
        for j, (r, ids) in enumerate(redo):
            n = len(ids)
            nxt = top[1][j, :n, 0].cpu() if top is not None else None
            entries[r] = Entry(torch.tensor(ids), x_all[j, :n].to(torch.bfloat16), nxt)
    return entries


_RAW: dict[str, Any] = {
    "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_new_tokens": 0, "suppress_tokens": None,
    "begin_suppress_tokens": None, "bad_words_ids": None, "sequence_bias": None,
}  # fmt: skip


_MIN_ROWS = 8  # a smaller batch than this is not worth its prefill and per-step overhead


def _rows_that_fit(left_s: float, last_s: float, last_rows: int, rows: int) -> int:
    """How many of a batch's `rows` fit in `left_s` seconds, judged by the last batch (`last_s`
    for `last_rows` rows). A batch's time is modelled as a quarter fixed (weights read each
    step, whatever the rows) and three quarters per row: on a CPU 64 rows take ~0.63 of 128's
    time. So the last batch of a budget is cut to fit rather than skipped: `regen.max_minutes`
    is spent, not left a batch short (on a loaded machine that batch can be half the budget)."""
    if last_s <= 0 or last_rows <= 0:
        return rows
    frac = left_s / last_s  # of the last batch's time
    if frac >= 0.25 + 0.75 * rows / last_rows:
        return rows
    return max(0, min(rows, int(last_rows * (frac - 0.25) / 0.75)))


def _batches(items: list[tuple[int, list[int]]], size: int, seed: int = 0) -> Iterator[list[tuple[int, list[int]]]]:
    """Batches in the items' (shuffled) order, so a run cut short has answered a random sample
    of the prompts, like the held-out ones (shortest first would train on one-word prompts and
    test on the rest). Within a window of 8 batches, like lengths go together (little padding)
    and the batches then come in a seeded random order (a run cut inside a window has not
    answered only its shortest prompts); a batch holds at most `size` rows of the window's
    median length × 2 in tokens: a few long outliers share a smaller batch instead of padding
    128 rows to their length."""
    window = 8 * size
    rng = random.Random(seed)
    for w in range(0, len(items), window):
        chunk = sorted(items[w : w + window], key=lambda x: len(x[1]))
        cap = size * 2 * len(chunk[len(chunk) // 2][1])
        out: list[list[tuple[int, list[int]]]] = [[]]
        for item in chunk:
            if out[-1] and (len(out[-1]) == size or (len(out[-1]) + 1) * len(item[1]) > cap):
                out.append([])
            out[-1].append(item)
        rng.shuffle(out)
        yield from out


_MIN_PREFIX = 4  # a shorter prefix shared by a batch's prompts is fed with the rest


def _common_prefix(rows: list[list[int]]) -> int:
    """The length of the token prefix all `rows` share, leaving each at least one token."""
    n = min(len(t) for t in rows) - 1
    first = rows[0]
    for t in rows[1:]:
        k = 0
        while k < n and t[k] == first[k]:
            k += 1
        n = k
    return max(n, 0)


@torch.no_grad()
def _generate(
    target: Any, rows: list[list[int]], pad: int, eos: int, steps: int, kwargs: dict[str, Any], record: bool
) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """One batch through `generate`: `(R, steps)` new tokens on the host and, with `record`,
    each row's features at the positions it fed (its prompt, then its new tokens but the last).

    The prefix the prompts share (the chat template's system turn: 24 of a chatterbot prompt's
    ~40 tokens) runs once, for one row, and its KV cache is copied to every row; the padding
    sits between it and each prompt's own tokens, where the attention mask hides it (position
    ids count only real tokens). So the batch computes the shared tokens once, not once a row.
    Only for targets whose every layer is full attention over a plain KV cache
    (`plain_kv_cache`): a sliding window is applied by cache slot, so padding mid-sequence
    would narrow it."""
    model, dev = target.model, target.device
    shared = _common_prefix(rows) if len(rows) > 1 and plain_kv_cache(model) else 0
    extra: dict[str, Any] = {}
    head: torch.Tensor | None = None
    if shared >= _MIN_PREFIX:
        with target.recording() if record else contextlib.nullcontext([]) as rec:
            out = model(input_ids=torch.tensor([rows[0][:shared]], device=dev), use_cache=True)
        cache = output_cache(out)
        try:
            cache.batch_repeat_interleave(len(rows))
        except (AttributeError, NotImplementedError, TypeError):  # a cache that cannot be copied: feed it all
            shared = 0
        else:
            extra[cache_kwarg(model)] = cache
            head = rec[0][0].cpu() if record else None
    else:
        shared = 0
    own = [t[shared:] for t in rows]
    L = max(len(t) for t in own)
    ids = torch.full((len(rows), shared + L), pad, dtype=torch.long)
    attn = torch.zeros((len(rows), shared + L), dtype=torch.long)
    ids[:, :shared] = torch.tensor(rows[0][:shared])
    attn[:, :shared] = 1
    for r, toks in enumerate(own):  # padded on the left of its own tokens: generation continues at the end
        ids[r, shared + L - len(toks) :] = torch.tensor(toks)
        attn[r, shared + L - len(toks) :] = 1
    with target.recording() if record else contextlib.nullcontext([]) as rec:
        res = model.generate(
            input_ids=ids.to(dev), attention_mask=attn.to(dev), max_new_tokens=steps, pad_token_id=pad,
            eos_token_id=eos, **extra, **kwargs,
        )  # fmt: skip
    new = res[:, shared + L :].cpu()  # one copy of the batch's tokens (and features) to the host, not one a row
    if new.shape[1] < steps:  # every row stopped early: the rest is padding
        new = torch.cat([new, new.new_full((len(rows), steps - new.shape[1]), pad)], dim=1)
    if not record:
        return new, None
    got = rec[0].cpu()
    feats = [got[r, L - len(toks) :] for r, toks in enumerate(own)]
    if head is not None:
        feats = [torch.cat([head, f]) for f in feats]
    return new, feats


@torch.no_grad()
def regenerate(
    cfg: Config,
    target: Any,
    tokenizer: Any,
    *,
    progress: bool = True,
    prompts: Prompts | None = None,
) -> dict[str, Any]:
    """Generate replies for every training prompt not yet in the output; returns stats.

    `progress`: a live line on a terminal; otherwise one line every 30 s on stderr."""
    with _exclusive(cfg.regen_output):
        return _regenerate(cfg, target, tokenizer, progress, prompts)


def _regenerate(
    cfg: Config,
    target: Any,
    tokenizer: Any,
    progress: bool,
    prompts: Prompts | None,
) -> dict[str, Any]:
    out_path = cfg.regen_output
    prompts = prompts if prompts is not None else load_prompts(cfg)
    train, held = prompts.train, prompts.held
    source = prompts.source_of()
    per_set = dict.fromkeys((src for src, _ in prompts.sets), 0)  # replies written, by prompt set
    _drop_torn_tail(out_path)
    template_kwargs = cfg.data.chat_template_kwargs
    done = _done_prompts(out_path, template_kwargs)
    held_keys = {prompt_key(p) for p in held}
    if done & held_keys:
        msg = (
            f"{out_path} already answers {len(done & held_keys)} prompts that are now held out "
            "(regen.seed, holdout or prompts changed); use a new regen.output"
        )
        raise DataError(msg)
    write_jsonl(cfg.regen_heldout, [{"id": i, "messages": p} for i, p in enumerate(held)])
    todo = []
    too_long = 0
    cap = cfg.regen.max_prompt_tokens or math.inf
    for i, p in enumerate(train):
        if prompt_key(p) in done:
            continue
        ids = tokenizer.apply_chat_template(
            p, add_generation_prompt=True, tokenize=True, return_dict=True, **cfg.data.chat_template_kwargs
        )
        if len(ids["input_ids"]) > cap:
            too_long += 1
            continue
        todo.append((i, list(ids["input_ids"])))
    already = len(train) - len(todo) - too_long
    dev = target.device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    gen = torch.Generator(device=dev).manual_seed(cfg.regen.seed)
    t0 = last_line = time.perf_counter()
    tty = progress and sys.stderr.isatty()
    new_tokens = written = 0
    last_batch_s = 0.0
    budget_s = 60 * cfg.regen.max_minutes if cfg.regen.max_minutes else math.inf
    greedy = cfg.regen.temperature == 0
    max_new = cfg.regen.max_new_tokens
    features = folder_for(out_path) if cfg.regen.save_features else None
    meta = FeatureMeta.of(target, greedy)
    part = 0
    if features is not None:
        part = next_part_index(features)
        made = read_meta(features)
        why = made.differs_from(meta) if made is not None else ""
        if made is not None and not why and made.greedy != meta.greedy:
            kind = {True: "greedy", False: "sampled"}
            why = f"made by {kind[made.greedy]} regen, this one is {kind[meta.greedy]}"
        if why:
            msg = f"{features}: {why} (regen.save_features); use a new regen.output, or delete that folder"
            raise DataError(msg)
    feature_mb = 0.0
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with out_path.open("a", encoding="utf-8") as out:
        # Set by set (a batch window spanning two would answer the next set's prompts first).
        by_set = itertools.groupby(todo, key=lambda item: source[item[0]])
        queue = collections.deque(
            b for _, part in by_set for b in _batches(list(part), cfg.regen.batch_size, cfg.regen.seed)
        )
        b = -1
        last_rows = 0
        while queue:
            batch = queue.popleft()
            b += 1
            if b:  # at least one batch a call; then only what the last batch's time says fits the budget
                rows = _rows_that_fit(budget_s - (time.perf_counter() - t0), last_batch_s, last_rows, len(batch))
                if rows < len(batch):
                    if rows < _MIN_ROWS:
                        queue.appendleft(batch)
                        break
                    queue.appendleft(batch[rows:])
                    batch = batch[:rows]
            t_batch = time.perf_counter()
            # Greedy is the raw argmax, as greedy verification computes it: the model's own
            # generation settings that bend it (penalties, banned tokens) are off.
            kwargs: dict[str, Any] = {"do_sample": cfg.regen.temperature > 0, **_RAW}
            if cfg.regen.temperature > 0:
                kwargs["temperature"] = cfg.regen.temperature
                torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
            # Saving features: one token more than the reply keeps, so the last reply token is
            # fed too (its features) and the target's next token after it is known (its label).
            steps = max_new + (features is not None)
            res, recorded = _generate(target, [t for _, t in batch], pad, eos, steps, kwargs, features is not None)
            convs: list[Messages] = []
            fed: list[list[int]] = []
            after: list[int] = []
            feats: list[torch.Tensor] = []
            for r, (i, toks) in enumerate(batch):
                reply = res[r, :max_new].tolist()
                if eos in reply:
                    reply = reply[: reply.index(eos)]
                if features is not None:
                    fed.append([*toks, *reply])
                    after.append(int(res[r, len(reply)]))
                    feats.append(recorded[r][: len(toks) + len(reply)])
                new_tokens += len(reply)
                per_set[source[i]] += 1
                text = tokenizer.decode(reply, skip_special_tokens=True).strip()
                msgs = [*train[i], {"role": "assistant", "content": text}]
                convs.append(msgs)
                record: dict[str, Any] = {"id": i, "messages": msgs}
                if template_kwargs:  # the prompt's rendering depends on them: keep them with the reply
                    record["chat_template_kwargs"] = template_kwargs
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
            out.flush()
            if features is not None:  # after the replies: a part without its replies is never read
                entries = _feature_entries(target, tokenizer, convs, fed, after, feats, template_kwargs, greedy)
                kept = [e for e in entries if e is not None]
                if kept:
                    path = write_part(features, part, kept, meta)
                    part += 1
                    feature_mb += path.stat().st_size / 2**20
            written += len(batch)
            now = time.perf_counter()
            if len(batch) >= min(_MIN_ROWS, cfg.regen.batch_size) or not last_rows:  # not from a few outliers
                last_batch_s, last_rows = now - t_batch, len(batch)
            if progress and (tty or now - last_line >= 30 or b == 0):
                last_line = now
                done_n = already + written
                el = now - t0
                line = f"regen {done_n}/{len(train) - too_long} prompts, {new_tokens / el:.0f} tok/s, {el:.0f}s"
                print("\r" + line if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)
    if tty and todo:
        print(file=sys.stderr)
    el = time.perf_counter() - t0
    left = len(todo) - written
    return {
        "output": str(out_path),
        "heldout": str(cfg.regen_heldout),
        "prompts": len(train),
        "generated": written,
        "generated_per_set": per_set,
        "resumed_from": already,
        "unanswered": left,
        "too_long": too_long,
        "target_dtype": target.dtype_name,
        "features": str(features) if features is not None else None,
        "features_mb": round(feature_mb, 2),
        "new_tokens": new_tokens,
        "wall_s": round(el, 2),
        "tokens_per_s": round(new_tokens / el, 1) if el > 0 else 0.0,
    }
