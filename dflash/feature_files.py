"""Feature files: the target features `dflash regen` computes anyway, kept for training.

While regen generates a reply, the target runs over the prompt (prefill) and then over each
reply token it feeds back: the chosen layers' outputs at every one of those positions are
exactly the features training would compute again with a full forward (equal to float
rounding). With `regen.save_features`, regen keeps them: a folder beside its JSONL
(`regen.jsonl` → `regen.features/`), one safetensors file per batch of replies,
`part-NNNNN.safetensors`, written atomically after the batch's replies; for reply j of
the batch:

- `j.ids` (S,) int32: the token ids of the conversation *as training tokenizes it* (chat
  template, the reply as written to the JSONL),
- `j.features` (S, k·H) bfloat16: the chosen layers' outputs there (the end-of-turn tokens
  after the reply, never fed while generating, are zeros: they are only context for
  blocks that start after the conversation ends, which carry no loss),
- `j.next` (S,) int32, greedy regen only: the target's greedy next token at each position
  of the reply (the next reply token; after the last one, what the target generated next:
  its end of turn, or the token after a reply cut at `max_new_tokens`) — the labels of
  `train.labels = "target"`; elsewhere the next data token (never a label: no loss there).

Where re-tokenizing the written reply does not give back the generated tokens (a few
percent: whitespace stripped, merges across the reply's end), regen runs the target once
more over the training tokenization of that conversation: every stored entry matches
training token for token.

The header's metadata names what made them (format, target, dtype, layer ids, feature
width, whether `next` is there). Training (`dflash run`) finds the folder beside each data
file and, when the metadata matches its own target, seeds the feature cache with every
sample whose token ids equal a stored entry's (a truncated sample: its prefix), so the
first epoch skips the target as later ones do. Nothing here unpickles anything.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dflash.atomic import atomic_path
from dflash.data.samples import Sample
from dflash.feature_cache import FeatureCache

__all__ = [
    "FORMAT",
    "Entry",
    "FeatureMeta",
    "folder_for",
    "next_part_index",
    "read_folder",
    "read_meta",
    "seed_cache",
    "write_part",
]

FORMAT = "dflash-features/1"


@dataclass(frozen=True)
class FeatureMeta:
    """What made a folder's features; training uses them only when all of it matches."""

    target: str  # the target's name (its config's _name_or_path)
    dtype: str  # the target's dtype while generating, e.g. "float32"
    layer_ids: list[int]
    width: int  # k·H
    greedy: bool  # `next` holds the target's greedy tokens (regen.temperature = 0)

    @classmethod
    def of(cls, target: Any, greedy: bool = True) -> FeatureMeta:
        """The metadata of features `target` (a `Target`) makes."""
        width = len(target.layer_ids) * target.hidden_size
        return cls(target.name, target.dtype_name, list(target.layer_ids), width, greedy)

    def to_header(self) -> dict[str, str]:
        return {"format": FORMAT, "meta": json.dumps(asdict(self))}

    @classmethod
    def from_header(cls, header: dict[str, str] | None, where: Path) -> FeatureMeta:
        if not header or header.get("format") != FORMAT:
            msg = f"{where}: not a dflash feature file (format {None if not header else header.get('format')!r})"
            raise ValueError(msg)
        try:
            return cls(**json.loads(header["meta"]))
        except (KeyError, TypeError, ValueError) as err:
            msg = f"{where}: malformed feature-file metadata: {err}"
            raise ValueError(msg) from None

    def differs_from(self, other: FeatureMeta) -> str:
        """'' when `other` (the run's target) can use these features, else what differs."""
        for name in ("target", "dtype", "layer_ids", "width"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"made with {name} {mine!r}, this run has {theirs!r}"
        return ""


@dataclass(frozen=True)
class Entry:
    ids: torch.Tensor  # (S,) int64
    features: torch.Tensor  # (S, k·H) bfloat16
    next: torch.Tensor | None  # (S,) int64, greedy regen only


def folder_for(data_file: Path) -> Path:
    """Where the feature files of a data file live: `regen.jsonl` → `regen.features`."""
    return data_file.with_suffix(".features")


def write_part(folder: Path, index: int, entries: Sequence[Entry], meta: FeatureMeta) -> Path:
    """One batch's entries as `part-{index:05d}.safetensors`, atomically; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for j, e in enumerate(entries):
        tensors[f"{j}.ids"] = e.ids.to(torch.int32).contiguous()
        tensors[f"{j}.features"] = e.features.to(torch.bfloat16).contiguous()
        if e.next is not None:
            tensors[f"{j}.next"] = e.next.to(torch.int32).contiguous()
    dest = folder / f"part-{index:05d}.safetensors"
    with atomic_path(dest, durable=False) as tmp:  # a cache: atomic, a power cut may lose it
        save_file(tensors, str(tmp), metadata=meta.to_header())
    return dest


def next_part_index(folder: Path) -> int:
    """The index the next part written to `folder` takes (a resumed regen appends)."""
    if not folder.is_dir():
        return 0
    taken = [int(p.stem.split("-")[1]) for p in folder.glob("part-*.safetensors") if p.stem.split("-")[1].isdigit()]
    return max(taken, default=-1) + 1


def read_meta(folder: Path) -> FeatureMeta | None:
    """The metadata of the folder's first part, or None (no folder, no part, unreadable)."""
    parts = sorted(folder.glob("part-*.safetensors")) if folder.is_dir() else []
    if not parts:
        return None
    try:
        with safe_open(str(parts[0]), framework="pt") as f:
            return FeatureMeta.from_header(f.metadata(), parts[0])
    except (SafetensorError, OSError, ValueError):
        return None


def read_folder(folder: Path) -> Iterator[tuple[FeatureMeta, Entry]]:
    """Every entry of every part in `folder`, in part order. Raises ValueError naming the file
    on a malformed one."""
    for path in sorted(folder.glob("part-*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = FeatureMeta.from_header(f.metadata(), path)
                keys = set(f.keys())
                j = 0
                while f"{j}.ids" in keys:
                    nxt = f.get_tensor(f"{j}.next").long() if f"{j}.next" in keys else None
                    entry = Entry(f.get_tensor(f"{j}.ids").long(), f.get_tensor(f"{j}.features"), nxt)
                    if entry.features.shape[0] != entry.ids.shape[0] or entry.features.shape[-1] != meta.width:
                        msg = f"{path}: entry {j}: features {tuple(entry.features.shape)} do not fit its ids"
                        raise ValueError(msg)
                    yield meta, entry
                    j += 1
        except (SafetensorError, OSError) as err:
            msg = f"{path}: unreadable feature file: {err}"
            raise ValueError(msg) from None


def seed_cache(
    cache: FeatureCache,
    samples: Sequence[Sample],
    folders: Sequence[Path],
    want: FeatureMeta,
    teacher_topk: int,
    max_len: int,
    warn: list[str],
) -> dict[str, int]:
    """Put into `cache` the stored features of every sample that has them; returns counts.

    `want`: the run's target (its `greedy` is ignored). `teacher_topk`: 0 (features only) or
    1 (target labels: greedy `next` needed); more (distillation's top-k) cannot be served
    from feature files. `max_len`: data.max_seq_len (a sample that long may be a stored
    entry's prefix). Folders that cannot serve this run are named in `warn` and skipped."""
    stats = {"feature_files_samples": 0, "feature_files_entries": 0}
    if teacher_topk > 1:
        if folders:
            warn.append(f"feature files {folders[0]} not used: train.distill needs the target's top-k logits")
        return stats
    by_ids: dict[tuple[int, ...], Entry] = {}
    for folder in folders:
        try:
            for meta, entry in read_folder(folder):
                why = meta.differs_from(want)
                if not why and teacher_topk and not meta.greedy:
                    why = "made by sampled regen (temperature > 0): no greedy labels for train.labels = 'target'"
                if why:
                    warn.append(f"feature files {folder} not used: {why}")
                    break
                by_ids[tuple(entry.ids.tolist())] = entry
                stats["feature_files_entries"] += 1
        except ValueError as err:
            warn.append(f"feature files not used: {err}")
    if not by_ids:
        return stats
    cut: dict[tuple[int, ...], Entry] | None = None  # entries cut at max_len: truncated samples
    for s in samples:
        key = tuple(s.input_ids.tolist())
        entry = by_ids.get(key)
        if entry is None and len(key) == max_len:  # a sample truncated at data.max_seq_len
            if cut is None:
                cut = {k[:max_len]: e for k, e in by_ids.items() if len(k) > max_len}
            entry = cut.get(key)
        if entry is None:
            continue
        n = len(key)
        teacher = None
        if teacher_topk:
            assert entry.next is not None  # greedy checked above
            teacher = (torch.zeros(n, 1), entry.next[:n, None])  # top-1: the ids; its logit is never read
        if not cache.seed(s.sample_id, entry.features[:n], teacher):
            break  # the cache's budget is spent
        stats["feature_files_samples"] += 1
    return stats
