"""Prompt sets: conversations from the chatterbot corpus, a chat JSONL, or any file the data
loader reads, as their turns (`turns_of`: the messages added before each assistant reply the
target writes); `load_prompts` splits regen's sets into training conversations (the sets
interleaved by weight) and held-out prompts (for eval)."""

from __future__ import annotations

import collections
import hashlib
import json
import random
import warnings
from pathlib import Path
from typing import Any, NamedTuple

from dflash.config import Config
from dflash.errors import DataError
from dflash.store.packages import package_folder

__all__ = [
    "Chat",
    "Messages",
    "Prompts",
    "chatterbot_prompts",
    "file_prompts",
    "interleave",
    "jsonl_prompts",
    "load_prompts",
    "next_due",
    "prompt_key",
    "turns_of",
]

Messages = list[dict[str, Any]]


class Chat(list):  # type: ignore[type-arg]
    """A conversation's turns (`turns_of`), with its `tools` (function schemas, or None)."""

    def __init__(self, turns: list[Messages], tools: list[Any] | None = None) -> None:
        super().__init__(turns)
        self.tools = tools


def chatterbot_prompts(language: str = "english") -> list[Chat]:
    """Every distinct utterance of the chatterbot corpus, as a one-turn user prompt (its turns)."""
    package = package_folder("chatterbot_corpus")
    if package is None:
        msg = "regen.prompts = 'chatterbot' needs the package: pip install chatterbot-corpus==1.3.3 pyyaml"
        raise DataError(msg)
    import yaml

    folder = package / "data" / language
    seen: dict[str, None] = {}
    for f in sorted(folder.glob("*.yml")):
        try:
            doc = yaml.safe_load(f.read_text(encoding="utf-8")) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as err:
            msg = f"{f}: unreadable corpus file: {err}".splitlines()[0]
            raise DataError(msg) from None
        for conv in doc.get("conversations") or []:
            for utt in conv or []:
                if isinstance(utt, str) and utt.strip():
                    seen.setdefault(utt.strip(), None)
    return [Chat([[{"role": "user", "content": u}]]) for u in seen]


def _is_reply(m: dict[str, Any]) -> bool:
    """An assistant turn the target writes again: text, not a tool call (tool calls and their
    results are context, passed through as the source has them)."""
    return m["role"] == "assistant" and not m.get("tool_calls")


def turns_of(messages: Messages) -> list[Messages]:
    """A conversation's turns: per assistant reply the target writes, the messages the source
    adds before it (system, user, tool calls and their results; the source's own replies
    dropped, the target's take their place). A reply with no new message before it, or a
    turn with no user or tool message, ends the conversation there."""
    turns: list[Messages] = []
    added: Messages = []
    for m in messages:
        if not _is_reply(m):
            added.append(m)
            continue
        if not any(x["role"] in ("user", "tool") for x in added):
            break
        turns.append(added)
        added = []
    else:
        if any(x["role"] in ("user", "tool") for x in added):
            turns.append(added)
    return turns


def _asks(turns: list[Messages]) -> bool:
    """A conversation regen can answer: its first turn has a user message with text."""
    return bool(turns) and any(
        m["role"] == "user" and isinstance(m.get("content"), str) and m["content"].strip() for m in turns[0]
    )


def jsonl_prompts(path: Path) -> list[Chat]:
    """Conversations from a chat JSONL (`messages` or ShareGPT `conversations`, read as the data
    loader reads them: tools too), as their turns (`turns_of`)."""
    from dflash.data.conversation import normalize_record, record_tools

    if not path.is_file():
        msg = f"regen.prompts: file not found: {path}"
        raise DataError(msg)
    out = []
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
                got, tools = normalize_record(record), record_tools(record)
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                got = tools = f"{type(err).__name__}: {err}"
            for why in (got, tools):
                if isinstance(why, str):
                    msg = f"{path}:{n}: not a chat record ({why})"
                    raise DataError(" ".join(msg.split()))
            turns = turns_of(got)  # type: ignore[arg-type]
            if _asks(turns):
                out.append(Chat(turns, tools))  # type: ignore[arg-type]
    if not out:
        msg = f"{path}: no prompts (no conversation with a user turn)"
        raise DataError(msg)
    return out


class Prompts(NamedTuple):
    """regen's prompts: `train`, each conversation's turns (`turns_of`) in the order regen
    answers them (the sets interleaved by weight); `source`, each one's prompt set; `held`,
    the held-out conversations' turns, kept for eval; `sets`: (source, how many of `train`
    come from it)."""

    train: list[Chat]
    held: list[Chat]
    sets: list[tuple[str, int]]
    source: list[str]


def file_prompts(source: str, skip_invalid: bool = False) -> list[Chat]:
    """A prompt set from a file (pkg:PACKAGE/FILE too), each conversation as its turns. A
    `.json` file (a JSON array such as ShareGPT's, or lines), parquet or a `datasets` folder
    goes through the data loader: invalid records (a dump cut short ends in one) are skipped
    with `skip_invalid` and counted in a warning, else an error. Any other name is JSONL, read
    strictly by `jsonl_prompts`."""
    from dflash.config import DataFile
    from dflash.data.conversation import InvalidRecord
    from dflash.data.formats import iter_records
    from dflash.store.packages import local_path

    try:
        path = local_path(source)
    except LookupError as err:
        raise DataError(f"regen.prompts: {err}") from None
    if not (path.is_dir() or path.name.lower().endswith((".json", ".parquet", ".pq"))):
        return jsonl_prompts(path)  # .jsonl, and any other name: strict JSONL
    if not path.exists():
        msg = f"regen.prompts: file not found: {path}"
        raise DataError(msg)
    out = []
    skipped: list[InvalidRecord] = []
    for rec in iter_records(DataFile(path=source)):
        if isinstance(rec, InvalidRecord) and rec.prompt is None:
            if skip_invalid:
                skipped.append(rec)
                continue
            msg = f"regen.prompts: {rec.where}: {rec.reason} (data.skip_invalid = true skips such records)"
            raise DataError(msg)
        turns = turns_of((rec.prompt if isinstance(rec, InvalidRecord) else rec.messages) or [])
        if _asks(turns):
            out.append(Chat(turns, rec.tools))
    if skipped:  # as the data loader reports them
        first = skipped[0]
        warnings.warn(
            f"{source}: skipped {len(skipped)} invalid record(s); first: {first.where}: {first.reason}", stacklevel=2
        )
    if not out:
        msg = f"regen.prompts: {source}: no prompts (no conversation with a user turn)"
        raise DataError(msg)
    return out


def next_due(taken: list[int], weights: list[float], live: list[int]) -> int:
    """Of the sets `live` (indices), the one whose next prompt is due soonest by weight:
    (n + 1/2) / weight, n its prompts taken so far; ties to the earlier set."""
    return min(live, key=lambda j: ((taken[j] + 0.5) / weights[j], j))


def interleave(sizes: list[int], weights: list[float]) -> list[tuple[int, int]]:
    """(set, index in it) in the order regen answers them: at every point each set's count is
    as close to its weight's share as whole prompts allow (`next_due`); a set that runs out
    leaves the rest to the others."""
    taken = [0] * len(sizes)
    order = []
    for _ in range(sum(sizes)):
        j = next_due(taken, weights, [j for j in range(len(sizes)) if taken[j] < sizes[j]])
        order.append((j, taken[j]))
        taken[j] += 1
    return order


def load_prompts(cfg: Config) -> Prompts:
    """Training and held-out conversations, in a fixed shuffled order: the held-out ones are
    the first set's first `regen.holdout`; training interleaves the sets by weight (each set
    shuffled on its own; every conversation once, none whose first turn is held out or seen
    already). `regen.turns = "first"` keeps each conversation's first turn only."""
    r = cfg.regen
    sets: list[list[Chat]] = []
    for i, src in enumerate(r.prompt_sources):
        got = chatterbot_prompts() if src == "chatterbot" else file_prompts(src, cfg.data.skip_invalid)
        random.Random(r.seed if i == 0 else f"{r.seed}/{i}").shuffle(got)
        sets.append([Chat(t[:1], t.tools) for t in got] if r.turns == "first" else got)
    held = sets[0][: r.holdout]  # as the first set splits alone: adding sets keeps its held-out prompts
    seen = {prompt_key(p[0]) for p in held}
    fresh: list[list[Chat]] = []
    for j, got in enumerate(sets):
        fresh.append([])
        for p in got[r.holdout :] if j == 0 else got:
            if (k := prompt_key(p[0])) not in seen:
                seen.add(k)
                fresh[-1].append(p)
    order = interleave([len(f) for f in fresh], r.prompt_weights)
    if r.max_prompts:
        order = order[: r.max_prompts]
    names = r.prompt_sources
    counts = collections.Counter(j for j, _ in order)
    return Prompts(
        [fresh[j][k] for j, k in order],
        held,
        [(n, counts[j]) for j, n in enumerate(names)],
        [names[j] for j, _ in order],
    )


def prompt_key(messages: Messages) -> str:
    """A prompt's key in regen's sets of prompts answered or held out: 32 hex digits of
    BLAKE2b over its canonical JSON (not the JSON itself: the sets stay small)."""
    canonical = json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()
    return hashlib.blake2b(canonical, digest_size=16).hexdigest()
