"""Self-distillation: the target writes the assistant turns for a prompt set.

This is how production drafters are trained — on the target's own outputs, which is
exactly what the drafter must predict at inference — and it makes a small prompt set
enough. `dflash regen CONFIG` reads prompts (the chatterbot-corpus package, or a chat
file whose conversations are cut before their first assistant turn; or several such sets,
answered one after the other), keeps `holdout` of the first set aside for eval, and
generates replies in batches (greedy, or sampled) in a seeded random order, like lengths
batched together so that padding stays low. Output is JSONL `{"id", "messages"}`, appended
batch by batch and flushed: an interrupted regen resumes where it stopped. With
`regen.server`, an OpenAI-compatible server (vLLM, SGLang, llama.cpp) writes the replies
instead of the target running here (`_ServerReplier`); with `regen.engine = "vllm"`, vLLM's
offline API in this process does (`_VllmReplier`): same prompts, split, order and records.
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
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path
from typing import IO, Any

import structlog
import torch

from dflash.config import Config
from dflash.data.chat_template import prompt_ids, tokenize_many
from dflash.data.prompts import Messages, Prompts, load_prompts, prompt_key
from dflash.data.samples import Sample, collate
from dflash.engines import replies
from dflash.engines.server import ChatServer, RequestPool, ServerError
from dflash.errors import DataError
from dflash.features.files import Entry, FeatureMeta, folder_for, next_part_index, read_meta, write_part
from dflash.model.hf_compat import cache_kwarg, output_cache, plain_kv_cache
from dflash.model.loading import model_folder
from dflash.model.target import resolve_dtype
from dflash.store.atomic import atomic_path

__all__ = ["regenerate", "write_jsonl"]

Todo = list[tuple[int, list[int]]]  # prompts to answer: (index among the training prompts, its token ids)
Asked = Future[tuple[str, int | None]]  # a server's reply to come: its text and token count


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    """`records` as a JSONL file, in place at once: a kill leaves the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


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
    tokenized = tokenize_many(tokenizer, convs, template_kwargs)
    entries: list[Entry | None] = [None] * len(convs)
    redo: list[tuple[int, list[int]]] = []
    for r, result in enumerate(tokenized):
        if isinstance(result, str):  # training skips it: no entry
            continue
        ids, f = result[0], fed[r]
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


def _batches(items: Todo, size: int, seed: int = 0) -> Iterator[Todo]:
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
        out: list[Todo] = [[]]
        for item in chunk:
            if out[-1] and (len(out[-1]) == size or (len(out[-1]) + 1) * len(item[1]) > cap):
                out.append([])
            out[-1].append(item)
        rng.shuffle(out)
        yield from out


_MIN_PREFIX = 4  # a shorter prefix shared by a batch's prompts is fed with the rest


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

    `progress`: a live line on a terminal; otherwise one line every 30 s on stderr. With
    `regen.server` or `regen.engine = "vllm"`, the server or vLLM answers and `target` may be
    None (only `tokenizer` is used); a server that does not answer GET /v1/models, or a
    Python without vLLM, fails here, before anything is written."""
    r = cfg.regen
    if r.engine == "vllm":
        replies.require_vllm_for_regen()
    server = ChatServer(r.server, r.server_model, r.server_timeout_s).connect() if r.server else None
    with _exclusive(cfg.regen_output):
        return _regenerate(cfg, target, tokenizer, progress, prompts, server)


def _check_held_out(out_path: Path, done: set[str], held: list[Messages]) -> None:
    """A prompt answered for training must not be held out for eval now."""
    answered = done & {prompt_key(p) for p in held}
    if answered:
        msg = (
            f"{out_path} already answers {len(answered)} prompts that are now held out "
            "(regen.seed, holdout or prompts changed); use a new regen.output"
        )
        raise DataError(msg)


def _unanswered(cfg: Config, tokenizer: Any, train: list[Messages], done: set[str]) -> tuple[Todo, int]:
    """The training prompts not yet in the output, as token ids, and how many more were left
    out as longer than regen.max_prompt_tokens."""
    todo: Todo = []
    too_long = 0
    cap = cfg.regen.max_prompt_tokens or math.inf
    for i, p in enumerate(train):
        if prompt_key(p) in done:
            continue
        ids = prompt_ids(tokenizer, p, cfg.data.chat_template_kwargs)
        if len(ids) > cap:
            too_long += 1
            continue
        todo.append((i, ids))
    return todo, too_long


class _FeatureParts:
    """regen.save_features: the folder beside the output, the metadata of what this regen
    writes there, the next part's index and the megabytes written."""

    def __init__(self, out_path: Path, target: Any, greedy: bool) -> None:
        self.folder = folder_for(out_path)
        self.meta = FeatureMeta.of(target, greedy)
        self.part = next_part_index(self.folder)
        self.mb = 0.0
        made = read_meta(self.folder)
        why = made.differs_from(self.meta) if made is not None else ""
        if made is not None and not why and made.greedy != self.meta.greedy:
            kind = {True: "greedy", False: "sampled"}
            why = f"made by {kind[made.greedy]} regen, this one is {kind[self.meta.greedy]}"
        if why:
            msg = f"{self.folder}: {why} (regen.save_features); use a new regen.output, or delete that folder"
            raise DataError(msg)

    def write(self, entries: list[Entry | None]) -> None:
        kept = [e for e in entries if e is not None]
        if kept:
            path = write_part(self.folder, self.part, kept, self.meta)
            self.part += 1
            self.mb += path.stat().st_size / 2**20


class _Budget:
    """regen.max_minutes: how much of the next batch fits the time left, judged by the last
    batch (`_rows_that_fit`)."""

    def __init__(self, minutes: float, batch_size: int, t0: float) -> None:
        self.t0 = t0
        self.budget_s = 60 * minutes if minutes else math.inf
        self.batch_size = batch_size
        self.last_s = 0.0
        self.last_rows = 0

    def take(self, queue: collections.deque[Todo], first: bool) -> Todo | None:
        """The next batch, cut to what fits (the first batch of a call runs whole); None when
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


class _ProgressLine:
    """A live line on a terminal; otherwise one line every 30 s (and after the first batch)."""

    def __init__(self, enabled: bool, t0: float, already: int, total: int) -> None:
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()
        self.t0 = self.last = t0
        self.already, self.total = already, total

    def update(self, first: bool, written: int, new_tokens: int, now: float) -> None:
        if not self.enabled or not (self.tty or now - self.last >= 30 or first):
            return
        self.last = now
        el = now - self.t0
        line = f"regen {self.already + written}/{self.total} prompts, {new_tokens / el:.0f} tok/s, {el:.0f}s"
        print("\r" + line if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def restart(self, now: float) -> None:
        """The rate counted from `now` (after an engine's start)."""
        self.t0 = self.last = now

    def end(self, any_batch: bool) -> None:
        if self.tty and any_batch:
            print(file=sys.stderr)


class _Replier:
    """Generates one regen's replies batch by batch, appends them to the output (and their
    features to the feature files), and counts them."""

    def __init__(self, cfg: Config, target: Any, tokenizer: Any, prompts: Prompts) -> None:
        self.regen, self.target, self.tokenizer = cfg.regen, target, tokenizer
        self.template_kwargs = cfg.data.chat_template_kwargs
        self.train, self.source = prompts.train, prompts.source_of()
        self.per_set = dict.fromkeys((src for src, _ in prompts.sets), 0)  # replies written, by prompt set
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos = tokenizer.eos_token_id
        self.generator = None if target is None else torch.Generator(device=target.device).manual_seed(cfg.regen.seed)
        self.features: _FeatureParts | None = None
        self.new_tokens = self.written = 0

    def queue(self, todo: Todo) -> collections.deque[Todo]:
        """The batches to answer, set by set (a batch window spanning two would answer the next
        set's prompts first)."""
        by_set = itertools.groupby(todo, key=lambda item: self.source[item[0]])
        seed = self.regen.seed
        return collections.deque(b for _, part in by_set for b in _batches(list(part), self.regen.batch_size, seed))

    def _generate_kwargs(self) -> dict[str, Any]:
        # Greedy is the raw argmax, as greedy verification computes it: the model's own
        # generation settings that bend it (penalties, banned tokens) are off.
        kwargs: dict[str, Any] = {"do_sample": self.regen.temperature > 0, **_RAW}
        if self.regen.temperature > 0:
            kwargs["temperature"] = self.regen.temperature
            torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=self.generator)))
        return kwargs

    def answer(self, batch: Todo, out: IO[str]) -> None:
        """One batch: generated, its replies appended to `out` and flushed, then its features."""
        max_new, saving = self.regen.max_new_tokens, self.features is not None
        # Saving features: one token more than the reply keeps, so the last reply token is
        # fed too (its features) and the target's next token after it is known (its label).
        steps = max_new + saving
        kwargs = self._generate_kwargs()
        res, recorded = _generate(self.target, [ids for _, ids in batch], self.pad, self.eos, steps, kwargs, saving)
        convs: list[Messages] = []
        fed: list[list[int]] = []
        after: list[int] = []
        feats: list[torch.Tensor] = []
        for r, (i, toks) in enumerate(batch):
            reply = res[r, :max_new].tolist()
            if self.eos in reply:
                reply = reply[: reply.index(self.eos)]
            if recorded is not None:
                fed.append([*toks, *reply])
                after.append(int(res[r, len(reply)]))
                feats.append(recorded[r][: len(toks) + len(reply)])
            convs.append(self._write(out, i, reply))
        out.flush()
        if self.features is not None:  # after the replies: a part without its replies is never read
            greedy = self.regen.temperature == 0
            self.features.write(
                _feature_entries(self.target, self.tokenizer, convs, fed, after, feats, self.template_kwargs, greedy)
            )
        self.written += len(batch)

    def _write(self, out: IO[str], i: int, reply: list[int]) -> Messages:
        """Training prompt i with its reply, as written to `out`."""
        self.new_tokens += len(reply)
        return self._write_text(out, i, self.tokenizer.decode(reply, skip_special_tokens=True).strip())

    def _write_text(self, out: IO[str], i: int, text: str) -> Messages:
        """Training prompt i with its reply's text, as written to `out`."""
        self.per_set[self.source[i]] += 1
        msgs = [*self.train[i], {"role": "assistant", "content": text}]
        record: dict[str, Any] = {"id": i, "messages": msgs}
        if self.template_kwargs:  # the prompt's rendering depends on them: keep them with the reply
            record["chat_template_kwargs"] = self.template_kwargs
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
        return msgs


class _ServerReplier(_Replier):
    """regen.server: an OpenAI-compatible server writes the replies, `batch_size` requests in
    flight (the prompts in the local loop's order), each written as soon as those before it
    are; the output is flushed whenever the next reply is still pending. An error (a request
    failing after its tries, anywhere in flight), Ctrl-C or regen.max_minutes ends the regen at
    once: the replies already back are written, in any order, the requests in flight cancelled
    (a later regen asks them again). A server's tokens come back as text: the record holds that text,
    stripped, like the local loop's decoded reply (training tokenizes it with the target's chat
    template, as any chat file); its token count is the server's usage.completion_tokens, else
    the text re-tokenized. Greedy is asked as the local loop's raw argmax: temperature 0,
    repetition_penalty 1 (a server would otherwise apply the model's generation config); each
    request's seed is regen.seed + the prompt's index, so sampled replies do not depend on the
    requests in flight. A prompt the server refuses (a 4xx about it, e.g. longer than its
    context) is skipped with a `warning` record; a later regen asks it again."""

    def __init__(self, cfg: Config, tokenizer: Any, prompts: Prompts, server: ChatServer) -> None:
        super().__init__(cfg, None, tokenizer, prompts)
        self.server = server
        self.refused = 0
        r = cfg.regen
        self.options: dict[str, Any] = {
            "max_tokens": r.max_new_tokens, "temperature": r.temperature, "repetition_penalty": 1.0,
        }  # fmt: skip
        if self.template_kwargs:
            self.options["chat_template_kwargs"] = self.template_kwargs

    def ask(self, pool: RequestPool, i: int) -> Asked:
        """Training prompt i's reply from the server, asked from a worker thread."""
        return pool.submit(self.train[i], {**self.options, "seed": self.regen.seed + i})

    def answer_all(self, queue: collections.deque[Todo], out: IO[str], deadline: float, line: _ProgressLine) -> None:
        """The queued prompts, until the queue runs out or `deadline` (perf_counter) passes:
        then the requests still pending are cancelled, the replies already back written."""
        items = (i for batch in queue for i, _ in batch)
        ahead = 4 * self.regen.batch_size  # requests queued: the workers never wait on a slow head
        pending: collections.deque[tuple[int, Asked]] = collections.deque()
        pool = RequestPool(self.server, self.regen.batch_size)
        try:
            while True:
                while len(pending) < ahead and time.perf_counter() < deadline and (i := next(items, None)) is not None:
                    pending.append((i, self.ask(pool, i)))
                if not pending:
                    return
                if not pending[0][1].done():
                    out.flush()
                if not _wait_head(pending, deadline):  # regen.max_minutes: what is back is kept, the rest asked later
                    self._write_finished(pending, out)
                    return
                i, reply = pending.popleft()
                self._take(out, i, reply)
                line.update(self.written == 1, self.written, self.new_tokens, time.perf_counter())
        except BaseException:  # an error or Ctrl-C: the replies already back are kept too
            self._write_finished(pending, out)
            raise
        finally:
            out.flush()
            pool.close()

    def _take(self, out: IO[str], i: int, reply: Asked) -> None:
        """Training prompt i's reply written, or its refusal a warning record."""
        try:
            text, tokens = reply.result()
        except ServerError as err:
            if not err.refused:
                raise
            self._refuse(i, err)
            return
        text = text.strip()
        if tokens is None:
            tokens = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        self.new_tokens += tokens
        self._write_text(out, i, text)
        self.written += 1

    def _refuse(self, i: int, err: ServerError) -> None:
        """A warning record naming the prompt and the server's message; but when every
        prompt asked so far was refused (at least `_REFUSED_FIRST`), the server refuses them
        all (a request option it does not take, ...): one line."""
        self.refused += 1
        if not self.written and self.refused >= _REFUSED_FIRST:
            msg = f"{err}; the first {self.refused} prompts were all refused: no prompt is answered, stopping"
            raise ServerError(msg, err.status)
        words = " ".join(_last_user_text(self.train[i]).split())
        about = words[:60] + ("..." if len(words) > 60 else "")
        message = f"regen: prompt {i} ({about!r}) skipped, {err}; a later regen asks it again"
        structlog.get_logger("dflash").info("warning", message=message, prompt_id=i)

    def _write_finished(self, pending: collections.deque[tuple[int, Asked]], out: IO[str]) -> None:
        """The replies already back among `pending`, written whatever their order; refusals and
        failures are left for a later regen."""
        for i, reply in pending:
            if reply.done() and not reply.cancelled() and reply.exception() is None:
                self._take(out, i, reply)
        pending.clear()


_REFUSED_FIRST = 8  # refusals before any reply that stop a server regen


def _failed(reply: Asked) -> bool:
    """A reply that failed for good, not a refusal of its prompt alone."""
    if not reply.done() or reply.cancelled():
        return False
    err = reply.exception()
    return err is not None and not (isinstance(err, ServerError) and err.refused)


def _wait_head(pending: collections.deque[tuple[int, Asked]], deadline: float) -> bool:
    """Waits for the first pending reply until `deadline` (perf_counter): True when it is back.
    A request failing for good meanwhile, wherever it is in the queue, raises its error at
    once (the server is down or broken: no use waiting for the others)."""
    head = pending[0][1]
    waiting = []
    for _, reply in pending:
        if _failed(reply):
            reply.result()
        if not reply.done():
            waiting.append(reply)
    while not head.done():
        left = deadline - time.perf_counter()
        if left <= 0:
            return False
        done, not_done = futures.wait(waiting, None if math.isinf(left) else left, futures.FIRST_COMPLETED)
        for reply in done:
            if _failed(reply):
                reply.result()
        waiting = list(not_done)
    return True


def _last_user_text(messages: Messages) -> str:
    """The last user message's text (the prompt a warning names)."""
    for m in reversed(messages):
        if m.get("role") == "user" and isinstance(m.get("content"), str):
            return m["content"]
    return ""


class _VllmReplier(_Replier):
    """regen.engine = "vllm": vLLM's offline API writes the replies (`ReplyEngine`), the prompts
    fed in the local loop's order as the engine's slots free up, each reply written as soon as
    it finishes (the output flushed after every engine step that finished one). The reply is
    the generated token ids cut at the eos, decoded like the local loop's. regen.max_minutes is
    a deadline from the engine's start (its load is not counted, as the target's is not in the
    local loop): past the first slots' worth, no prompt starts whose reply would end after it,
    and those started are answered. An error, Ctrl-C or SIGTERM drops the requests still
    running and ends the engine's process; a later regen asks them again."""

    def __init__(self, cfg: Config, tokenizer: Any, prompts: Prompts) -> None:
        super().__init__(cfg, None, tokenizer, prompts)
        r = cfg.regen
        self.folder = model_folder(cfg.target, cfg.data.cache_dir)
        self.dtype = str(resolve_dtype(cfg.target.dtype, torch.device(replies.vllm_device()))).removeprefix("torch.")
        sampling = replies.hf_sampling(self.folder) if r.temperature > 0 else ()
        self.settings = replies.ReplySettings(r.max_new_tokens, self.eos, r.temperature, r.seed, sampling)
        self.start_s = 0.0

    def answer_all(self, queue: collections.deque[Todo], out: IO[str], budget_s: float, line: _ProgressLine) -> None:
        """The queued prompts, until they are answered or `budget_s` seconds after the engine's start."""
        items = [item for batch in queue for item in batch]
        if not items:
            return
        max_len = replies.model_len(self.folder, max(len(ids) for _, ids in items), self.regen.max_new_tokens)
        with replies.sigterm_as_interrupt():
            t0 = time.perf_counter()
            engine = replies.ReplyEngine(self.folder, self.dtype, max_len, self.settings)
            self.start_s = time.perf_counter() - t0
            line.restart(time.perf_counter())
            try:
                self._answer(engine, iter(items), out, time.perf_counter() + budget_s, line)
            finally:
                out.flush()
                engine.close()

    def _answer(self, engine: replies.ReplyEngine, feed: Iterator[tuple[int, list[int]]], out: IO[str], deadline: float,
                line: _ProgressLine) -> None:  # fmt: skip
        """The engine's steps until what `feed` holds and the engine takes by `deadline` is answered."""
        while True:
            engine.add(itertools.islice(feed, engine.room(deadline)))
            if not engine.running:
                return
            finished = engine.step()
            for i, generated in finished:
                self._take_ids(out, i, generated)
            if finished:
                out.flush()
                line.update(self.written == len(finished), self.written, self.new_tokens, time.perf_counter())

    def _take_ids(self, out: IO[str], i: int, generated: list[int]) -> None:
        """Training prompt i's generated ids, cut at the eos as the local loop cuts them, written."""
        reply = generated[: self.regen.max_new_tokens]
        if self.eos in reply:
            reply = reply[: reply.index(self.eos)]
        self._write(out, i, reply)
        self.written += 1


def _answer_all(
    replier: _Replier, queue: collections.deque[Todo], out: IO[str], budget: _Budget, line: _ProgressLine
) -> None:
    """The queued batches in order, until the queue or the time budget runs out."""
    first = True
    while queue:
        batch = budget.take(queue, first)
        if batch is None:
            break
        t_batch = time.perf_counter()
        replier.answer(batch, out)
        now = time.perf_counter()
        budget.observe(len(batch), now - t_batch)
        line.update(first, replier.written, replier.new_tokens, now)
        first = False


def _replier(cfg: Config, target: Any, tokenizer: Any, prompts: Prompts, server: ChatServer | None) -> _Replier:
    """Who answers: the server, vLLM here, or the target's own loop."""
    if server is not None:
        return _ServerReplier(cfg, tokenizer, prompts, server)
    if cfg.regen.engine == "vllm":
        return _VllmReplier(cfg, tokenizer, prompts)
    return _Replier(cfg, target, tokenizer, prompts)


def _regenerate(
    cfg: Config,
    target: Any,
    tokenizer: Any,
    progress: bool,
    prompts: Prompts | None,
    server: ChatServer | None,
) -> dict[str, Any]:
    out_path = cfg.regen_output
    prompts = prompts if prompts is not None else load_prompts(cfg)
    _drop_torn_tail(out_path)
    done = _done_prompts(out_path, cfg.data.chat_template_kwargs)
    _check_held_out(out_path, done, prompts.held)
    write_jsonl(cfg.regen_heldout, [{"id": i, "messages": p} for i, p in enumerate(prompts.held)])
    todo, too_long = _unanswered(cfg, tokenizer, prompts.train, done)
    already = len(prompts.train) - len(todo) - too_long
    replier = _replier(cfg, target, tokenizer, prompts, server)
    t0 = time.perf_counter()
    if cfg.regen.save_features:
        replier.features = _FeatureParts(out_path, target, cfg.regen.temperature == 0)
    line = _ProgressLine(progress, t0, already, len(prompts.train) - too_long)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    budget = _Budget(cfg.regen.max_minutes, cfg.regen.batch_size, t0)
    with out_path.open("a", encoding="utf-8") as out:
        if isinstance(replier, _ServerReplier):
            replier.answer_all(replier.queue(todo), out, t0 + budget.budget_s, line)
        elif isinstance(replier, _VllmReplier):
            replier.answer_all(replier.queue(todo), out, budget.budget_s, line)
        else:
            _answer_all(replier, replier.queue(todo), out, budget, line)
    line.end(bool(todo))
    el = time.perf_counter() - t0
    start_s = replier.start_s if isinstance(replier, _VllmReplier) else 0.0  # vLLM's load: not in tok/s
    features = replier.features
    refused = replier.refused if isinstance(replier, _ServerReplier) else 0
    return {
        "output": str(out_path),
        "heldout": str(cfg.regen_heldout),
        "prompts": len(prompts.train),
        "generated": replier.written,
        "generated_per_set": replier.per_set,
        "resumed_from": already,
        "unanswered": len(todo) - replier.written - refused,
        "refused": refused,
        "too_long": too_long,
        "engine": "server" if server is not None else cfg.regen.engine,
        "target_dtype": replier.dtype if isinstance(replier, _VllmReplier) else getattr(target, "dtype_name", None),
        "server": f"{server.model} at {server.url}" if server is not None else None,
        "features": str(features.folder) if features is not None else None,
        "features_mb": round(features.mb if features is not None else 0.0, 2),
        "new_tokens": replier.new_tokens,
        "engine_start_s": round(start_s, 2),
        "wall_s": round(el, 2),
        "tokens_per_s": round(replier.new_tokens / (el - start_s), 1) if el > start_s else 0.0,
    }
