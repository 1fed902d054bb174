"""Prompt sets: conversations cut before their first assistant turn, from the chatterbot
corpus, a chat JSONL, or any file the data loader reads; `load_prompts` splits regen's sets
into training prompts (answered in order) and held-out ones (for eval)."""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import warnings
from pathlib import Path
from typing import NamedTuple

from dflash.config import Config
from dflash.errors import DataError
from dflash.store.packages import package_folder

__all__ = ["Messages", "Prompts", "chatterbot_prompts", "file_prompts", "jsonl_prompts", "load_prompts", "prompt_key"]

Messages = list[dict[str, str]]


def chatterbot_prompts(language: str = "english") -> list[Messages]:
    """Every distinct utterance of the chatterbot corpus, as a one-turn user prompt."""
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
    return [[{"role": "user", "content": u}] for u in seen]


def _before_reply(messages: Messages) -> Messages:
    """A conversation's messages before its first assistant turn: what regen prompts with."""
    return list(itertools.takewhile(lambda m: m["role"] != "assistant", messages))


def jsonl_prompts(path: Path) -> list[Messages]:
    """Conversations from a chat JSONL (`messages` or ShareGPT `conversations`), cut before
    their first assistant turn."""
    if not path.is_file():
        msg = f"regen.prompts: file not found: {path}"
        raise DataError(msg)
    roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
             "model": "assistant", "system": "system"}  # fmt: skip
    out = []
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw.decode("utf-8"))
                turns = rec.get("messages") or rec.get("conversations")
                msgs = [
                    {"role": roles[t.get("role", t.get("from"))], "content": str(t.get("content", t.get("value")))}
                    for t in turns
                ]
            except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, TypeError) as err:
                msg = f"{path}:{n}: not a chat record ({type(err).__name__}: {err})"
                raise DataError(" ".join(msg.split())) from None
            prompt = _before_reply(msgs)
            if any(m["role"] == "user" for m in prompt):
                out.append(prompt)
    if not out:
        msg = f"{path}: no prompts (no conversation with a user turn)"
        raise DataError(msg)
    return out


class Prompts(NamedTuple):
    """regen's prompts: `train` in the order regen answers them, `held` kept for eval, and
    `sets`: (source, how many of `train` come from it), in `train`'s order."""

    train: list[Messages]
    held: list[Messages]
    sets: list[tuple[str, int]]

    def source_of(self) -> list[str]:
        """The source of each training prompt, by its index."""
        return [src for src, n in self.sets for _ in range(n)]


def file_prompts(source: str, skip_invalid: bool = False) -> list[Messages]:
    """A prompt set from a file (pkg:PACKAGE/FILE too), each conversation cut before its first
    assistant turn. A `.json` file (a JSON array such as ShareGPT's, or lines), parquet or a
    `datasets` folder goes through the data loader: invalid records (a dump cut short ends in
    one) are skipped with `skip_invalid` and counted in a warning, else an error. Any other
    name is JSONL, read strictly by `jsonl_prompts`."""
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
        messages = rec.prompt if isinstance(rec, InvalidRecord) else rec.messages  # no assistant turn: all prompt
        prompt = _before_reply(messages or [])
        if any(m["role"] == "user" and m["content"].strip() for m in prompt):
            out.append(prompt)
    if skipped:  # as the data loader reports them
        first = skipped[0]
        warnings.warn(
            f"{source}: skipped {len(skipped)} invalid record(s); first: {first.where}: {first.reason}", stacklevel=2
        )
    if not out:
        msg = f"regen.prompts: {source}: no prompts (no conversation with a user turn)"
        raise DataError(msg)
    return out


def load_prompts(cfg: Config) -> Prompts:
    """Training and held-out prompts, in a fixed shuffled order: the held-out ones are the
    first set's first `regen.holdout`; training takes the rest of the first set, then each
    further set's prompts (each set shuffled on its own), every prompt once and none that is
    held out."""
    sources = cfg.regen.prompt_sources
    sets: list[list[Messages]] = []
    for i, src in enumerate(sources):
        got = chatterbot_prompts() if src == "chatterbot" else file_prompts(src, cfg.data.skip_invalid)
        random.Random(cfg.regen.seed if i == 0 else f"{cfg.regen.seed}/{i}").shuffle(got)
        sets.append(got)
    held = sets[0][: cfg.regen.holdout]  # as the first set splits alone: adding sets keeps its held-out prompts
    seen = {prompt_key(p) for p in held}
    train: list[Messages] = []
    counts = []
    for j, got in enumerate(sets):
        fresh = []
        for p in got[cfg.regen.holdout :] if j == 0 else got:
            if (k := prompt_key(p)) not in seen:
                seen.add(k)
                fresh.append(p)
        if cfg.regen.max_prompts:
            fresh = fresh[: max(0, cfg.regen.max_prompts - len(train))]
        train += fresh
        counts.append(len(fresh))
    return Prompts(train, held, list(zip(sources, counts, strict=True)))


def prompt_key(messages: Messages) -> str:
    """A prompt's key in regen's sets of prompts answered or held out: 32 hex digits of
    BLAKE2b over its canonical JSON (not the JSON itself: the sets stay small)."""
    canonical = json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()
    return hashlib.blake2b(canonical, digest_size=16).hexdigest()
