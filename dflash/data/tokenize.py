"""Chat datasets → tokenized `Sample`s: chat template, assistant-only loss mask, mixing, cache.

`load_samples(cfg, tokenizer)` is the one entry point. Per `[[data.files]]` entry it reads
conversations (`formats.py`), renders each with the tokenizer's own chat template and
supervises only what the assistant says (`chat_template.py`), cuts or drops what is too
long, and mixes the files by weight. Each file's tokenized samples are cached before
weighting (`token_cache.py`), so changing a weight costs nothing.

**Length.** A sequence longer than ``data.max_seq_len`` is cut to it (``overlong =
"truncate"``, counted in ``truncated``) or dropped (``"drop"``, counted in
``dropped_overlong``). A sample with no supervised token left is invalid: a DataError, or
skipped and counted in ``skipped_invalid`` when ``data.skip_invalid`` is set.

**Mixing with weights.** A file with weight w whose tokenization yields n samples
contributes ``round(w × n)`` samples to every epoch (rounded half up): sample
``k · n // round(w × n)`` for k = 0, 1, …. So w < 1 keeps an evenly spaced, deterministic
subset, w > 1 repeats every sample ⌊w⌋ or ⌈w⌉ times, w = 1 keeps each once. Every entry,
repeats included, gets its own ``sample_id`` (0..N-1 in file order, then record order),
so ids are unique and the same for the same inputs; repeats share their tensors.

**Conversations continued later.** A record whose conversation a later record of the same
file continues (regen writes each turn as a record: turn k's messages are a prefix of turn
k+1's) is learnt there, once, and counted in ``continued``. A template that rewrites earlier
turns makes a conversation one sample per assistant turn (``chat_template.py``).

Stats returned: ``records`` (read, valid or not), ``skipped_invalid``, ``truncated``,
``dropped_overlong``, ``continued`` count records before weighting; ``samples``, ``tokens``,
``supervised_tokens`` describe one epoch after weighting; ``cache_hit`` is 1 when every
file came from the cache.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dflash import logs
from dflash.config import DataConfig, DataFile
from dflash.data.chat_template import tokenize_conversation, tokenize_many
from dflash.data.conversation import Conversation, InvalidRecord, Message
from dflash.data.formats import count_records, iter_records
from dflash.data.prompts import prompt_key
from dflash.data.samples import SampleTable
from dflash.data.token_cache import (
    CACHE_VERSION,
    FileSamples,
    cache_key,
    read_cache,
    tokenizer_fingerprint,
    write_cache,
)
from dflash.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["CACHE_VERSION", "load_samples", "tokenize_conversation", "weighted_indices"]

_CHUNK = 256  # conversations rendered and encoded together (one batched tokenizer call)


# --- one file ----------------------------------------------------------------------------


class _FileTokens:
    """One file's samples as they are tokenized (records in chunks of `_CHUNK`), and its counts.

    A record whose whole conversation a later record of the file continues (regen writes a
    conversation's turns one record each: turn k's messages are a prefix of turn k+1's) is
    dropped once that later record is read: the longer one supervises the same replies, so
    each reply is learnt once (`continued` counts them)."""

    def __init__(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        self.counts = {"records": 0, "skipped_invalid": 0, "truncated": 0, "dropped_overlong": 0, "continued": 0}
        self.first_skipped: str | None = None
        self.ids_parts: list[torch.Tensor | None] = []
        self.mask_parts: list[torch.Tensor | None] = []
        self.pending: list[Conversation] = []
        self.parts_of: dict[str, list[int]] = {}  # a conversation's key -> its samples' places in the parts
        self.continued: set[str] = set()  # keys of conversations a record read so far continues

    def add(self, item: Conversation | InvalidRecord) -> None:
        self.counts["records"] += 1
        if isinstance(item, InvalidRecord):
            self.flush()  # earlier records first, so the first bad record is the one reported
            self.invalid(item.where, item.reason)
            return
        self.pending.append(item)
        if len(self.pending) >= _CHUNK:
            self.flush()

    def invalid(self, where: str, reason: str) -> None:
        if not self.cfg.skip_invalid:
            msg = f"{where}: {reason}"
            raise DataError(msg)
        self.counts["skipped_invalid"] += 1
        if self.first_skipped is None:
            self.first_skipped = f"{where}: {reason}"

    def flush(self) -> None:
        """The pending conversations through the chat template, in one batched call."""
        results = tokenize_many(
            self.tokenizer,
            [c.messages for c in self.pending],
            self.cfg.chat_template_kwargs,
            [c.tools for c in self.pending],
        )
        for conv, got in zip(self.pending, results, strict=True):
            if isinstance(got, str):
                self.invalid(conv.where, got)
                continue
            key = prompt_key(conv.messages)
            if key in self.continued:  # a record read earlier continues it: already learnt there
                self.counts["continued"] += 1
                continue
            kept = [p for ids, mask in got if (p := self._keep(conv, ids, mask)) is not None]
            if len(kept) == len(got):  # whole: the records it continues go (one dropped keeps them)
                self._continues(conv.messages)
            self.parts_of[key] = kept
        self.pending.clear()

    def _continues(self, messages: list[Message]) -> None:
        """The conversations this one continues (its prefixes through an earlier assistant
        turn): their samples go, later ones are not kept."""
        for j, m in enumerate(messages[:-1]):
            if m["role"] != "assistant":
                continue
            key = prompt_key(messages[: j + 1])
            self.continued.add(key)
            parts = self.parts_of.pop(key, None)
            if parts is not None:
                self.counts["continued"] += 1
                for p in parts:
                    self.ids_parts[p] = self.mask_parts[p] = None

    def _keep(self, conv: Conversation, ids: list[int], mask: list[bool]) -> int | None:
        """One tokenized sample, cut to data.max_seq_len or dropped (`data.overlong`); its place."""
        limit = self.cfg.max_seq_len
        if len(ids) > limit:
            if self.cfg.overlong == "drop":
                self.counts["dropped_overlong"] += 1
                return None
            if not any(mask[:limit]):
                first = mask.index(True)
                self.invalid(
                    conv.where,
                    f"no assistant token within max_seq_len = {limit} tokens (the conversation has "
                    f"{len(ids)} tokens, the first assistant token is at {first})",
                )
                return None
            self.counts["truncated"] += 1
            ids, mask = ids[:limit], mask[:limit]
        self.ids_parts.append(torch.tensor(ids, dtype=torch.int32))
        self.mask_parts.append(torch.tensor(mask, dtype=torch.bool))
        return len(self.ids_parts) - 1

    def samples(self) -> FileSamples:
        ids_parts = [t for t in self.ids_parts if t is not None]
        mask_parts = [t for t in self.mask_parts if t is not None]
        lengths = torch.tensor([0] + [ids.numel() for ids in ids_parts], dtype=torch.int64)
        return FileSamples(
            ids=torch.cat(ids_parts) if ids_parts else torch.zeros(0, dtype=torch.int32),
            mask=torch.cat(mask_parts) if mask_parts else torch.zeros(0, dtype=torch.bool),
            offsets=torch.cumsum(lengths, 0),
            counts=self.counts,
            first_skipped=self.first_skipped,
        )


def _tokenize_file(file: DataFile, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, progress: bool) -> FileSamples:
    tokens = _FileTokens(cfg, tokenizer)
    bar = logs.progress(f"tokenizing {file.path}", unit=" rec") if progress else None
    if bar is not None and not bar.disable:  # counting reads the file: only for a bar that shows
        bar.reset(total=count_records(file))
    try:
        for item in iter_records(file):
            if bar is not None:
                bar.update()
            tokens.add(item)
        tokens.flush()
    finally:
        if bar is not None:
            bar.close()
    return tokens.samples()


# --- mixing and the entry point ------------------------------------------------------------


def weighted_indices(n: int, weight: float) -> list[int]:
    """Which of a file's n samples make up its share of an epoch, in order: round(w·n)
    entries (half up), evenly spaced; w > 1 repeats samples, w < 1 subsamples."""
    total = math.floor(weight * n + 0.5)
    return [k * n // total for k in range(total)]


def _default_cache_dir(cfg: DataConfig) -> Path:
    return Path(cfg.cache_dir or "~/.cache/dflash").expanduser() / "tokenized"


def _check_tokenizer(tokenizer: PreTrainedTokenizerBase) -> None:
    if not getattr(tokenizer, "chat_template", None):
        msg = (
            "the tokenizer has no chat template; chat datasets need one to render conversations "
            "(set tokenizer.chat_template, or use the instruct model's tokenizer)"
        )
        raise DataError(msg)


def _file_samples(
    file: DataFile,
    cfg: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    tokenizer_fp: str,
    cache_dir: Path,
    progress: bool,
) -> tuple[FileSamples, bool]:
    key = cache_key(file, cfg, tokenizer_fp)  # also raises for a missing file
    cached = read_cache(cache_dir, key)
    if cached is not None:
        return cached, True
    fs = _tokenize_file(file, cfg, tokenizer, progress)
    if fs.n == 0:
        c = fs.counts
        msg = (
            f"{file.path}: no usable samples ({c['records']} records, {c['skipped_invalid']} invalid, "
            f"{c['dropped_overlong']} longer than max_seq_len = {cfg.max_seq_len} and dropped)"
        )
        raise DataError(msg)
    write_cache(cache_dir, key, fs, str(file.path), len(tokenizer))
    return read_cache(cache_dir, key) or fs, False  # mapped: the tokenized copy in memory goes


def load_samples(
    cfg: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    cache_dir: Path | None = None,
    progress: bool = True,
) -> tuple[SampleTable, dict[str, int]]:
    """Every `cfg.files` entry read, tokenized with the chat template, masked to assistant
    tokens, length-limited and mixed by weight: the samples of one epoch, with ids 0..N-1,
    and the stats (see the module docstring). `cache_dir` defaults to
    ``<data.cache_dir or ~/.cache/dflash>/tokenized``; `progress` shows a bar on a terminal."""
    if not cfg.files:
        msg = "no chat datasets: add at least one [[data.files]] entry with a path"
        raise DataError(msg)
    _check_tokenizer(tokenizer)
    cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else _default_cache_dir(cfg)
    tokenizer_fp = tokenizer_fingerprint(tokenizer)

    stats = dict.fromkeys(("records", "skipped_invalid", "truncated", "dropped_overlong", "continued"), 0)
    all_hit = True
    files, picks = [], []
    for file in cfg.files:
        fs, hit = _file_samples(file, cfg, tokenizer, tokenizer_fp, cache_dir, progress)
        all_hit &= hit
        for k, v in fs.counts.items():
            stats[k] += v
        if fs.first_skipped is not None:
            warnings.warn(
                f"{file.path}: skipped {fs.counts['skipped_invalid']} invalid record(s); first: {fs.first_skipped}",
                stacklevel=2,
            )
        files.append((fs.ids, fs.mask, fs.offsets))
        picks.append(weighted_indices(fs.n, file.weight))
    samples = SampleTable(files, picks)  # views made on demand: no Python object per sample
    if not len(samples):
        msg = "no samples after weighting: every file's round(weight x samples) is 0; raise the weights"
        raise DataError(msg)
    stats["samples"] = len(samples)
    stats["tokens"] = int(samples.lengths.sum())
    stats["supervised_tokens"] = samples.supervised_tokens()
    stats["cache_hit"] = int(all_hit)
    return samples, stats
