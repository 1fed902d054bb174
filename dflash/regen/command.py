"""Self-distillation: the target writes the assistant turns for a prompt set.

This is how production drafters are trained — on the target's own outputs, which is
exactly what the drafter must predict at inference — and it makes a small prompt set
enough. `dflash regen CONFIG` reads prompts (the chatterbot-corpus package, or a chat
file whose conversations are cut before their first assistant turn; or several such sets,
answered one after the other), keeps `holdout` of the first set aside for eval, and
generates replies in batches (greedy, or sampled) in a seeded random order, like lengths
batched together so that padding stays low. Output is JSONL `{"id", "messages"}`, appended
batch by batch and flushed: an interrupted regen resumes where it stopped. Who writes the
replies is a `Replier` (`dflash/regen/replier.py`, picked by `open_replier` here): the
target's own loop (`regen/local.py`), or with `regen.server` an OpenAI-compatible server (vLLM,
SGLang, llama.cpp; `regen/server.py`), or with `regen.engine = "vllm"` vLLM's offline API in
this process (`regen/vllm.py`): same prompts, split, order and records.
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
from dflash.data.prompts import Messages, Prompts, load_prompts, prompt_key
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


def _queue(todo: Todo, source: list[str], batch_size: int, seed: int) -> collections.deque[Todo]:
    """The batches to answer, set by set (a batch window spanning two would answer the next
    set's prompts first)."""
    by_set = itertools.groupby(todo, key=lambda item: source[item[0]])
    return collections.deque(b for _, part in by_set for b in _batches(list(part), batch_size, seed))


class _OutputFile:
    """The output file as a replier's `Output`: each reply appended as a `{"id", "messages"}`
    record, counted (by prompt set, and its new tokens) on the progress bar; feature entries
    go to the feature parts."""

    def __init__(
        self, out: IO[str], cfg: Config, tokenizer: Any, prompts: Prompts, bar: Any, features: _FeatureParts | None
    ) -> None:
        self.out, self.tokenizer, self.bar, self.features = out, tokenizer, bar, features
        self.template_kwargs = cfg.data.chat_template_kwargs
        self.train, self.source = prompts.train, prompts.source_of()
        self.per_set = dict.fromkeys((src for src, _ in prompts.sets), 0)  # replies written, by prompt set
        self.new_tokens = self.written = 0

    def prompt(self, i: int) -> Messages:
        return self.train[i]

    def write_ids(self, i: int, ids: list[int]) -> Messages:
        return self.write_text(i, self.tokenizer.decode(ids, skip_special_tokens=True), len(ids))

    def write_text(self, i: int, text: str, tokens: int | None) -> Messages:
        text = text.strip()
        if tokens is None:
            tokens = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        msgs = [*self.train[i], {"role": "assistant", "content": text}]
        record: dict[str, Any] = {"id": i, "messages": msgs}
        if self.template_kwargs:  # the prompt's rendering depends on them: keep them with the reply
            record["chat_template_kwargs"] = self.template_kwargs
        self.out.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.per_set[self.source[i]] += 1
        self.written += 1
        self.new_tokens += tokens
        if self.bar is not None:
            self.bar.set_postfix_str(f"{self.new_tokens} new tokens", refresh=False)
            self.bar.update(1)
        return msgs

    def write_features(self, entries: list[Entry | None]) -> None:
        if self.features is not None:
            self.features.write(entries)

    def flush(self) -> None:
        self.out.flush()


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
    done = _done_prompts(out_path, cfg.data.chat_template_kwargs)
    _check_held_out(out_path, done, prompts.held)
    write_jsonl(cfg.regen_heldout, [{"id": i, "messages": p} for i, p in enumerate(prompts.held)])
    todo, too_long = _unanswered(cfg, tokenizer, prompts.train, done)
    already = len(prompts.train) - len(todo) - too_long
    t0 = time.perf_counter()
    features = _FeatureParts(out_path, target, cfg.regen.temperature == 0) if cfg.regen.save_features else None
    out_path.parent.mkdir(parents=True, exist_ok=True)
    r = cfg.regen
    budget_s = 60 * r.max_minutes if r.max_minutes else math.inf
    total = len(prompts.train) - too_long
    bar = logs.progress("regen", total, "prompt", already) if progress else contextlib.nullcontext()
    with out_path.open("a", encoding="utf-8") as f, bar as shown:
        out = _OutputFile(f, cfg, tokenizer, prompts, shown, features)
        replier.answer_all(_queue(todo, out.source, r.batch_size, r.seed), out, budget_s)
    el = time.perf_counter() - t0
    start_s = replier.start_s  # an engine's start (vLLM's load): not in tok/s
    return {
        "output": str(out_path),
        "heldout": str(cfg.regen_heldout),
        "prompts": len(prompts.train),
        "generated": out.written,
        "generated_per_set": out.per_set,
        "resumed_from": already,
        "unanswered": len(todo) - out.written - replier.refused,
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
