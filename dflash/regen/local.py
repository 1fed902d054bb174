"""regen's own loop: the target in this process answers a batch at a time through Hugging
Face's `generate` (greedy, or sampled), each batch's replies written and flushed before the
next starts, and with `regen.save_features` the features the target computed while
generating kept for the feature files. `regen.max_minutes` cuts the last batch that fits
(`_rows_that_fit`) rather than skipping it.
"""

from __future__ import annotations

import collections
import contextlib
import time
from typing import Any

import torch

from dflash.config import Config
from dflash.data.chat_template import tokenize_many
from dflash.data.prompts import Messages
from dflash.data.samples import Sample, collate
from dflash.features.files import Entry
from dflash.model.hf_compat import cache_kwarg, output_cache, plain_kv_cache
from dflash.regen.replier import Output, Todo, until_eos

__all__ = ["LocalReplier", "feature_entries"]

_RAW: dict[str, Any] = {
    "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_new_tokens": 0, "suppress_tokens": None,
    "begin_suppress_tokens": None, "bad_words_ids": None, "sequence_bias": None,
}  # fmt: skip

_MIN_ROWS = 8  # a smaller batch than this is not worth its prefill and per-step overhead
_MIN_PREFIX = 4  # a shorter prefix shared by a batch's prompts is fed with the rest


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


class _Budget:
    """regen.max_minutes: how much of the next batch fits the time left, judged by the last
    batch (`_rows_that_fit`)."""

    def __init__(self, batch_size: int) -> None:
        self.t0 = time.perf_counter()
        self.budget_s = 0.0
        self.batch_size = batch_size
        self.last_s = 0.0  # the last batch, judging the next: kept from call to call (regen's rounds)
        self.last_rows = 0

    def start(self, budget_s: float) -> None:
        """A call's budget: `budget_s` seconds from now."""
        self.t0, self.budget_s = time.perf_counter(), budget_s

    def take(self, queue: collections.deque[Todo], first: bool) -> Todo | None:
        """The next batch, cut to what fits (`first`: it runs whole); None when
        what fits is not worth a batch: then the queue keeps it."""
        batch = queue.popleft()
        if first:
            return batch
        left_s = self.budget_s - (time.perf_counter() - self.t0)
        rows = _rows_that_fit(left_s, self.last_s, self.last_rows, len(batch))
        if rows >= len(batch):
            return batch
        if rows < _MIN_ROWS:
            queue.appendleft(batch)
            return None
        queue.appendleft(batch[rows:])
        return batch[:rows]

    def observe(self, rows: int, seconds: float) -> None:
        """A batch of `rows` took `seconds`; a small one (a few outliers) does not judge the next."""
        if rows >= min(_MIN_ROWS, self.batch_size) or not self.last_rows:
            self.last_s, self.last_rows = seconds, rows


def _common_prefix(rows: list[list[int]]) -> int:
    """The length of the token prefix all `rows` share, leaving each at least one token."""
    n = min(len(row) for row in rows) - 1
    first = rows[0]
    for row in rows[1:]:
        k = 0
        while k < n and row[k] == first[k]:
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
    own = [row[shared:] for row in rows]
    L = max(len(row) for row in own)
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


def feature_entries(
    target: Any,
    tokenizer: Any,
    convs: list[Messages],
    fed: list[list[int]],
    after: list[int],
    feats: list[torch.Tensor],
    template_kwargs: dict[str, Any],
    greedy: bool,
    tools: list[list[Any] | None] | None = None,
) -> list[Entry | None]:
    """The feature-file entries of one batch of replies (see dflash/features/files.py).

    `convs`: each conversation as written (`tools`: its function schemas); `fed[r]`: the token
    ids the target ran over while generating it (prompt, then reply); `feats[r]` (len(fed[r]), k·H): its features there;
    `after[r]`: the token it generated after the last one fed. The entry is for the training
    sample that ends with the reply (the conversation's last). One whose tokenization does
    not start with `fed[r]` gets its features from one more target forward
    over that tokenization; one training would skip (invalid) gets None."""
    tokenized = tokenize_many(tokenizer, convs, template_kwargs, tools)
    entries: list[Entry | None] = [None] * len(convs)
    redo: list[tuple[int, list[int]]] = []
    for r, result in enumerate(tokenized):
        if isinstance(result, str):  # training skips it: no entry
            continue
        ids, f = result[-1][0], fed[r]  # the sample that ends with this reply
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
        layers, top = target.of_batch(collate(rows, 0, 0), 1 if greedy else 0)
        x_all = torch.cat(layers, dim=-1).cpu()
        for j, (r, ids) in enumerate(redo):
            n = len(ids)
            nxt = top[1][j, :n, 0].cpu() if top is not None else None
            entries[r] = Entry(torch.tensor(ids), x_all[j, :n].to(torch.bfloat16), nxt)
    return entries


class LocalReplier:
    """The target's own loop: batch after batch through `generate`, each batch's replies
    written and flushed, then (regen.save_features) its features."""

    engine = "hf"
    server = None
    start_s = 0.0
    refused = 0

    def __init__(self, cfg: Config, target: Any, tokenizer: Any) -> None:
        self.regen, self.target, self.tokenizer = cfg.regen, target, tokenizer
        self.template_kwargs = cfg.data.chat_template_kwargs
        self.target_dtype: str | None = getattr(target, "dtype_name", None)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos = tokenizer.eos_token_id
        self.generator = None if target is None else torch.Generator(device=target.device).manual_seed(cfg.regen.seed)
        self.budget = _Budget(cfg.regen.batch_size)

    @torch.no_grad()
    def answer_all(self, queue: collections.deque[Todo], out: Output, budget_s: float) -> None:
        """The queued batches in order, until the queue or the time budget runs out."""
        budget = self.budget
        budget.start(budget_s)
        while queue:
            batch = budget.take(queue, first=not budget.last_rows)  # regen's first batch runs whole
            if batch is None:
                break
            t_batch = time.perf_counter()
            self._answer(batch, out)
            budget.observe(len(batch), time.perf_counter() - t_batch)

    def close(self) -> None:
        pass

    def _generate_kwargs(self) -> dict[str, Any]:
        # Greedy is the raw argmax, as greedy verification computes it: the model's own
        # generation settings that bend it (penalties, banned tokens) are off.
        kwargs: dict[str, Any] = {"do_sample": self.regen.temperature > 0, **_RAW}
        if self.regen.temperature > 0:
            kwargs["temperature"] = self.regen.temperature
            torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=self.generator)))
        return kwargs

    def _answer(self, batch: Todo, out: Output) -> None:
        """One batch: generated, its replies written and flushed, then its features."""
        max_new, saving = self.regen.max_new_tokens, self.regen.save_features
        # Saving features: one token more than the reply keeps, so the last reply token is
        # fed too (its features) and the target's next token after it is known (its label).
        steps = max_new + saving
        kwargs = self._generate_kwargs()
        res, recorded = _generate(self.target, [ids for _, ids in batch], self.pad, self.eos, steps, kwargs, saving)
        convs: list[Messages] = []
        tools: list[list[Any] | None] = []
        fed: list[list[int]] = []
        after: list[int] = []
        feats: list[torch.Tensor] = []
        for r, (i, toks) in enumerate(batch):
            reply = until_eos(res[r, :max_new].tolist(), self.eos)
            if recorded is not None:
                fed.append([*toks, *reply])
                after.append(int(res[r, len(reply)]))
                feats.append(recorded[r][: len(toks) + len(reply)])
            convs.append(out.write_ids(i, reply))
            tools.append(out.tools(i))
        out.flush()
        if recorded is not None:  # after the replies: a part without its replies is never read
            greedy = self.regen.temperature == 0
            out.write_features(
                feature_entries(
                    self.target, self.tokenizer, convs, fed, after, feats, self.template_kwargs, greedy, tools
                )
            )
