"""Self-distillation: the target writes the assistant turns for a prompt set.

This is how production drafters are trained — on the target's own outputs, which is
exactly what the drafter must predict at inference — and it makes a small prompt set
enough. `dflash regen CONFIG` reads conversations (the chatterbot-corpus package, or chat
files; several sets are drawn interleaved by weight), keeps `holdout` of the first set aside
for eval, and has the target write every assistant turn (`regen.turns = "all"`): turn k is
asked with the source's system, user and tool messages up to it and the target's own replies
to the turns before, as a server would be asked it. Conversations are answered in windows
(8 batches of them, in the drawn order): the window's first turns, then its second turns,
and so on, so that wherever a budget stops, the sets are answered in their shares. Greedy or
sampled. Output is JSONL `{"id", "turn", "messages"}` (one record per turn: the conversation
through that reply), appended batch by batch and flushed: an interrupted regen resumes at each
conversation's next turn. Who writes the replies is a `Replier` (`dflash/regen/replier.py`,
picked by `open_replier` here): the target's own loop (`regen/local.py`), or with
`regen.server` an OpenAI-compatible server (vLLM, SGLang, llama.cpp; `regen/server.py`), or
with `regen.engine = "vllm"` vLLM's offline API in this process (`regen/vllm.py`): same
prompts, split, order and records.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import math
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from dflash import logs
from dflash.config import Config
from dflash.data.chat_template import prompt_ids
from dflash.data.prompts import Messages, Prompts, load_prompts, next_due, prompt_key
from dflash.errors import DataError
from dflash.features.files import Entry, FeatureMeta, folder_for, next_part_index, read_meta, write_part
from dflash.regen.replier import Replier, Todo
from dflash.store.atomic import atomic_path

__all__ = ["open_replier", "regenerate", "write_jsonl"]


def open_replier(cfg: Config, target: Any, tokenizer: Any) -> Replier:
    """Who answers, from the config: `regen.server` (checked to answer GET /v1/models),
    `regen.engine = "vllm"` (checked to be installed) or the target's own loop. Called before
    anything is written, so that a server that is down or a Python without vLLM fails first."""
    if cfg.regen.server:
        from dflash.regen.server import ServerReplier

        return ServerReplier.connect(cfg)
    if cfg.regen.engine == "vllm":
        from dflash.regen.vllm import VllmReplier

        return VllmReplier(cfg, tokenizer)
    from dflash.regen.local import LocalReplier

    return LocalReplier(cfg, target, tokenizer)


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


def _answered(path: Path, template_kwargs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The turns already answered in the output file: each prompt's key (the messages before
    the reply) -> the reply.

    Matched by content, not position: a resume after changing the seed, holdout or prompt
    file never mistakes one prompt's reply for another's. Replies written under other chat
    template options (`data.chat_template_kwargs`, kept in each record) are refused: the
    target answered other prompts' renderings, and the file would mix them.
    """
    done: dict[str, dict[str, Any]] = {}
    if not path.is_file():
        return done
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                record = json.loads(raw)
                done[prompt_key(record["messages"][:-1])] = record["messages"][-1]
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


def regenerate(
    cfg: Config,
    target: Any,
    tokenizer: Any,
    *,
    progress: bool = True,
    prompts: Prompts | None = None,
) -> dict[str, Any]:
    """Generate replies for every training prompt not yet in the output; returns stats.

    `progress`: a bar on stderr when it is a terminal (`logs.progress`). With `regen.server`
    or `regen.engine = "vllm"`, the server or vLLM answers and `target` may be None (only
    `tokenizer` is used); a server that does not answer GET /v1/models, or a Python without
    vLLM, fails here, before anything is written."""
    replier = open_replier(cfg, target, tokenizer)
    try:
        with _exclusive(cfg.regen_output):
            return _regenerate(cfg, target, tokenizer, progress, prompts, replier)
    finally:
        replier.close()


def _check_held_out(out_path: Path, done: dict[str, Any], held: list[list[Messages]]) -> None:
    """A prompt answered for training must not be held out for eval now."""
    answered = done.keys() & {prompt_key(p[0]) for p in held}
    if answered:
        msg = (
            f"{out_path} already answers {len(answered)} prompts that are now held out "
            "(regen.seed, holdout or prompts changed); use a new regen.output"
        )
        raise DataError(msg)


class _Chat:
    """One training conversation on its way: `messages`, the prompt of its next turn (the
    source's messages up to it, the target's replies to the turns before); `k`, that turn's
    index; `ended`, no turn is asked any more (all answered, or one was too long); `left`, its
    turn went unanswered (the engine refused it): a later regen asks it again."""

    __slots__ = ("ended", "ids", "index", "k", "left", "messages", "source", "tools", "turns")

    def __init__(self, index: int, turns: list[Messages], source: str, done: dict[str, dict[str, Any]]) -> None:
        self.index, self.turns, self.source = index, turns, source
        self.tools: list[Any] | None = getattr(turns, "tools", None)
        self.k, self.messages, self.ended = 0, list(turns[0]), False
        self.left = False  # asked and not answered (refused): left for a later regen
        self.ids: list[int] | None = None  # the next turn's prompt ids, once rendered
        while not self.ended and (reply := done.get(prompt_key(self.messages))) is not None:
            self.answered(reply)  # answered by an earlier regen: its reply is the context now

    def answered(self, reply: dict[str, Any]) -> None:
        self.k, self.ids = self.k + 1, None
        if self.k < len(self.turns):
            self.messages = [*self.messages, reply, *self.turns[self.k]]
        else:
            self.ended = True

    @property
    def open_turns(self) -> int:
        return 0 if self.ended else len(self.turns) - self.k


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


class _OutputFile:
    """The output file as a replier's `Output`: each reply appended as a `{"id", "turn",
    "messages"}` record (and `tools`, where the conversation has them; the conversation moves
    on to its next turn), counted by prompt set and
    on the progress bar; feature entries go to the feature parts. A turn is asked under a
    slot number (`ask`), the index the replier is handed."""

    def __init__(self, out: IO[str], cfg: Config, prompts: Prompts, bar: Any, features: _FeatureParts | None) -> None:
        self.out, self.bar, self.features = out, bar, features
        self.template_kwargs = cfg.data.chat_template_kwargs
        self.slots: list[_Chat] = []
        self.per_set = {src: {"prompts": 0, "turns": 0, "too_long": 0} for src, _ in prompts.sets}
        self.new_tokens = self.written = 0
        self.tokenizer: Any = None

    def ask(self, chat: _Chat) -> int:
        self.slots.append(chat)
        return len(self.slots) - 1

    def prompt(self, i: int) -> Messages:
        return self.slots[i].messages

    def where(self, i: int) -> tuple[int, int]:
        return self.slots[i].index, self.slots[i].k + 1

    def tools(self, i: int) -> list[Any] | None:
        return self.slots[i].tools

    def write_ids(self, i: int, ids: list[int]) -> Messages:
        return self.write_text(i, self.tokenizer.decode(ids, skip_special_tokens=True), len(ids))

    def write_text(self, i: int, text: str, tokens: int | None) -> Messages:
        text = text.strip()
        if tokens is None:
            tokens = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        chat = self.slots[i]
        reply = {"role": "assistant", "content": text}
        msgs = [*chat.messages, reply]
        record: dict[str, Any] = {"id": chat.index, "turn": chat.k + 1, "messages": msgs}
        if chat.tools:
            record["tools"] = chat.tools
        if self.template_kwargs:  # the prompt's rendering depends on them: keep them with the reply
            record["chat_template_kwargs"] = self.template_kwargs
        self.out.write(json.dumps(record, ensure_ascii=False) + "\n")
        counts = self.per_set[chat.source]
        counts["prompts"] += chat.k == 0
        counts["turns"] += 1
        chat.answered(reply)
        self.written += 1
        self.new_tokens += tokens
        if self.bar is not None:
            self.bar.set_postfix_str(f"{self.new_tokens} new tokens", refresh=False)
            self.bar.update(1)
        return msgs

    def too_long(self, chat: _Chat) -> None:
        """A turn over its cap: skipped with the conversation's later turns (they need its reply)."""
        self.per_set[chat.source]["too_long"] += 1
        if self.bar is not None and self.bar.total is not None:
            self.bar.total -= chat.open_turns
            self.bar.refresh()
        chat.ended = True

    def write_features(self, entries: list[Entry | None]) -> None:
        if self.features is not None:
            self.features.write(entries)

    def flush(self) -> None:
        self.out.flush()


class _Rounds:
    """The conversations answered window by window (8 batches of them, in the drawn order):
    each window's next turns in rounds — its conversations' first open turns, then the turns
    after them — until the window is done, the time budget is spent or the replier leaves
    work behind (`regen.max_minutes`). Conversations are drawn from the sets by weight among
    those whose first turn fits `regen.max_prompt_tokens` (`_drawn`): the sets' shares hold
    for the prompts answered, not only for the prompts asked."""

    def __init__(self, cfg: Config, tokenizer: Any, replier: Replier, out: _OutputFile) -> None:
        self.cfg, self.tokenizer, self.replier, self.out = cfg, tokenizer, replier, out
        r = cfg.regen
        self.caps = (r.max_prompt_tokens or math.inf, r.max_context_tokens or math.inf)  # turn 1, later turns
        self.window = 8 * r.batch_size

    def _ids(self, chat: _Chat) -> list[int]:
        if chat.ids is None:
            chat.ids = prompt_ids(self.tokenizer, chat.messages, self.cfg.data.chat_template_kwargs, chat.tools)
        return chat.ids

    def _drawn(self, chats: list[_Chat]) -> Iterator[_Chat]:
        """The conversations with a turn left, each set's in its order, the set whose next one
        is due soonest by weight first ((n + 1/2) / weight, n: its conversations drawn so far,
        answered ones of an earlier regen included); a first turn over its cap is skipped
        (`too_long`) and does not count, so the set's next one takes its place."""
        r = self.cfg.regen
        left = [collections.deque(c for c in chats if c.source == src) for src in r.prompt_sources]
        taken, weights = [0] * len(left), r.prompt_weights
        while live := [j for j, chats_left in enumerate(left) if chats_left]:
            j = next_due(taken, weights, live)
            chat = left[j].popleft()
            if chat.k == 0 and not chat.ended and len(self._ids(chat)) > self.caps[0]:
                self.out.too_long(chat)
                continue
            taken[j] += 1
            if not chat.ended:
                yield chat

    def answer(self, chats: list[_Chat], budget_s: float) -> None:
        t0, first = time.perf_counter(), True
        drawn_chats = self._drawn(chats)
        while window := list(itertools.islice(drawn_chats, self.window)):
            drawn = True  # the window's first round: batches in the drawn order (the sets' shares)
            while batch := self._round(window):
                left = budget_s - (time.perf_counter() - t0 - self.replier.start_s)
                if left <= 0 and not first:
                    return
                queue = self._queue(batch, drawn)
                asked = [(self.out.slots[i], self.out.slots[i].k) for i, _ in batch]
                self.replier.answer_all(queue, self.out, left if not first else max(left, 0.0))
                if queue or budget_s - (time.perf_counter() - t0 - self.replier.start_s) <= 0:
                    return  # the budget ran out inside the round: what was not answered is asked later
                for chat, k in asked:
                    chat.left |= chat.k == k
                first = drawn = False

    def _round(self, window: list[_Chat]) -> Todo:
        """The window's open turns as token ids, each over its cap skipped (`too_long`)."""
        todo: Todo = []
        for chat in window:
            if chat.ended or chat.left:
                continue
            ids = self._ids(chat)
            if len(ids) > self.caps[chat.k > 0]:
                self.out.too_long(chat)
                continue
            todo.append((self.out.ask(chat), ids))
        return todo

    def _queue(self, todo: Todo, drawn: bool) -> collections.deque[Todo]:
        r = self.cfg.regen
        if drawn:
            return collections.deque(todo[s : s + r.batch_size] for s in range(0, len(todo), r.batch_size))
        return collections.deque(_batches(todo, r.batch_size, r.seed))


def _regenerate(
    cfg: Config,
    target: Any,
    tokenizer: Any,
    progress: bool,
    prompts: Prompts | None,
    replier: Replier,
) -> dict[str, Any]:
    out_path = cfg.regen_output
    prompts = prompts if prompts is not None else load_prompts(cfg)
    _drop_torn_tail(out_path)
    done = _answered(out_path, cfg.data.chat_template_kwargs)
    _check_held_out(out_path, done, prompts.held)
    write_jsonl(cfg.regen_heldout, [{"id": i, "messages": _held_out(p)} for i, p in enumerate(prompts.held)])
    chats = [
        _Chat(i, turns, src, done) for i, (turns, src) in enumerate(zip(prompts.train, prompts.source, strict=True))
    ]
    already = sum(c.k for c in chats)
    t0 = time.perf_counter()
    features = _FeatureParts(out_path, target, cfg.regen.temperature == 0) if cfg.regen.save_features else None
    out_path.parent.mkdir(parents=True, exist_ok=True)
    r = cfg.regen
    budget_s = 60 * r.max_minutes if r.max_minutes else math.inf
    total = already + sum(c.open_turns for c in chats)
    bar = logs.progress("regen", total, "turn", already) if progress else contextlib.nullcontext()
    with out_path.open("a", encoding="utf-8") as f, bar as shown:
        out = _OutputFile(f, cfg, prompts, shown, features)
        out.tokenizer = tokenizer
        _Rounds(cfg, tokenizer, replier, out).answer(chats, budget_s)
    el = time.perf_counter() - t0
    start_s = replier.start_s  # an engine's start (vLLM's load): not in tok/s
    too_long = sum(s["too_long"] for s in out.per_set.values())
    return {
        "output": str(out_path),
        "heldout": str(cfg.regen_heldout),
        "prompts": len(prompts.train),
        "generated": out.written,
        "generated_per_set": {src: s["turns"] for src, s in out.per_set.items()},
        "per_set": out.per_set,
        "resumed_from": already,
        "unanswered": sum(c.open_turns for c in chats if not c.left),  # the budget's: refused ones apart
        "refused": replier.refused,
        "too_long": too_long,
        "engine": replier.engine,
        "target_dtype": replier.target_dtype,
        "server": replier.server,
        "features": str(features.folder) if features is not None else None,
        "features_mb": round(features.mb if features is not None else 0.0, 2),
        "new_tokens": out.new_tokens,
        "engine_start_s": round(start_s, 2),
        "wall_s": round(el, 2),
        "tokens_per_s": round(out.new_tokens / (el - start_s), 1) if el > start_s else 0.0,
    }


def _held_out(turns: list[Messages]) -> Messages:
    """A held-out conversation as eval reads it back (`turns_of`): its turns, each user turn
    followed by an empty assistant stand-in so that the turns stay apart."""
    out: Messages = []
    for k, turn in enumerate(turns):
        if k:
            out.append({"role": "assistant", "content": ""})
        out += turn
    return out
