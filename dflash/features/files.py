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
  `loss.labels = "target"`; elsewhere the next data token (in the prompt never a label;
  after the end-of-turn token, the template's "\n": the one label that is the data's).

Where re-tokenizing the written reply does not give back the generated tokens (whitespace
stripped, merges across the reply's end), regen runs the target once more over the
training tokenization of that conversation: every stored entry matches training token for
token.

The header's metadata names what made them (format, target, dtype, layer ids, feature
width, whether `next` is there). Training (`dflash run`) finds the folder beside each data
file and, when the metadata matches its own target, seeds the feature cache with every
sample whose token ids equal a stored entry's (a truncated sample: its prefix), so the
first epoch skips the target as later ones do. Nothing here unpickles anything.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dflash.data.samples import Sample
from dflash.features.cache import FeatureCache
from dflash.store.atomic import atomic_path

__all__ = [
    "FORMAT",
    "Entry",
    "FeatureMeta",
    "folder_for",
    "ids_key",
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


def ids_key(ids: torch.Tensor | Sequence[int]) -> bytes:
    """A token-id sequence's key in the feature indexes: 16 bytes of BLAKE2b over its int32
    ids (a tuple of Python ints would cost ~36 bytes a token in memory)."""
    t = ids if isinstance(ids, torch.Tensor) else torch.tensor(list(ids), dtype=torch.int32)
    return hashlib.blake2b(t.to(torch.int32).contiguous().numpy().tobytes(), digest_size=16).digest()


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


def _check(path: Path, j: int, ids: torch.Tensor, features: torch.Tensor, nxt: torch.Tensor | None, width: int) -> None:
    n = ids.shape[0] if ids.ndim == 1 else -1
    if n < 0 or features.ndim != 2 or features.shape != (n, width) or (nxt is not None and nxt.shape != ids.shape):
        got = [tuple(t.shape) if t is not None else None for t in (ids, features, nxt)]
        msg = f"{path}: entry {j}: shapes do not fit (ids, features, next: {got}; width {width})"
        raise ValueError(msg)


def _part_ids(path: Path) -> tuple[FeatureMeta, list[torch.Tensor]]:
    """A part's metadata and its entries' ids (features stay on disk)."""
    with safe_open(str(path), framework="pt") as f:
        meta = FeatureMeta.from_header(f.metadata(), path)
        keys = set(f.keys())
        ids = []
        while f"{len(ids)}.ids" in keys:
            j = len(ids)
            entry_ids = f.get_tensor(f"{j}.ids")
            if entry_ids.ndim != 1 or f"{j}.features" not in keys or (meta.greedy and f"{j}.next" not in keys):
                shape = tuple(entry_ids.shape)
                msg = f"{path}: entry {j}: malformed (ids of shape {shape}, or features / next missing)"
                raise ValueError(msg)
            ids.append(entry_ids.long())
        return meta, ids


def _load(path: Path, js: Sequence[int], width: int) -> dict[int, Entry]:
    """Entries `js` of one part, whole, shapes checked."""
    out = {}
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        for j in js:
            ids, feats = f.get_tensor(f"{j}.ids").long(), f.get_tensor(f"{j}.features")
            nxt = f.get_tensor(f"{j}.next").long() if f"{j}.next" in keys else None
            _check(path, j, ids, feats, nxt, width)
            out[j] = Entry(ids, feats, nxt)
    return out


def read_folder(folder: Path) -> Iterator[tuple[FeatureMeta, Entry]]:
    """Every entry of every part in `folder`, in part order. Raises ValueError naming the file
    on a malformed one."""
    for path in sorted(folder.glob("part-*.safetensors")):
        try:
            meta, ids = _part_ids(path)
            entries = _load(path, range(len(ids)), meta.width)
        except (SafetensorError, OSError) as err:
            msg = f"{path}: unreadable feature file: {err}"
            raise ValueError(msg) from None
        for j in range(len(ids)):
            yield meta, entries[j]


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
    entry's prefix). First only the ids are read (an index: key -> part, entry); features are
    loaded for matched samples only, part by part, until the cache's budget is spent. A part
    that cannot serve this run (another target layout, sampled with target labels, malformed,
    unreadable) is skipped with a `warn` line naming it; the others still serve."""
    stats = {"feature_files_samples": 0, "feature_files_entries": 0}
    if teacher_topk > 1:
        if folders:
            warn.append(f"feature files {folders[0]} not used: loss.distill needs the target's top-k logits")
        return stats
    index = _index_parts(folders, want, teacher_topk, warn, max_len)
    stats["feature_files_entries"] = index.entries
    if not index.where:
        return stats
    matched = _match(samples, index, max_len)
    stats["feature_files_samples"] = _seed(cache, matched, index.widths, teacher_topk, warn)
    return stats


@dataclass
class _PartIndex:
    """The entries of the parts that can serve a run, by the keys of their token ids
    (`ids_key`; features stay on disk)."""

    where: dict[bytes, tuple[Path, int]] = field(default_factory=dict)  # key -> (part, entry)
    cut: dict[bytes, tuple[Path, int]] = field(default_factory=dict)  # entries longer than max_len, cut there
    widths: dict[Path, int] = field(default_factory=dict)  # part -> feature width
    entries: int = 0  # entries in those parts, repeats included


def _index_parts(
    folders: Sequence[Path], want: FeatureMeta, teacher_topk: int, warn: list[str], max_len: int = 0
) -> _PartIndex:
    """Every part of `folders` that can serve this run, indexed; one `warn` line per reason a
    part could not (naming the first such part). An entry longer than `max_len` is also
    indexed by its first `max_len` ids (a sample truncated at data.max_seq_len)."""
    index = _PartIndex()
    skipped: dict[str, str] = {}  # why -> first part skipped for it
    for path in (p for folder in folders for p in sorted(folder.glob("part-*.safetensors"))):
        try:
            meta, ids = _part_ids(path)
        except (SafetensorError, OSError, ValueError) as err:
            skipped.setdefault(f"unreadable ({str(err).splitlines()[0]})", str(path))
            continue
        why = meta.differs_from(want)
        if not why and teacher_topk and not meta.greedy:
            why = "made by sampled regen (temperature > 0): no greedy labels for loss.labels = 'target'"
        if why:
            skipped.setdefault(why, str(path))
            continue
        index.widths[path] = meta.width
        for j, entry_ids in enumerate(ids):
            index.where[ids_key(entry_ids)] = (path, j)
            if max_len and len(entry_ids) > max_len:
                index.cut[ids_key(entry_ids[:max_len])] = (path, j)
        index.entries += len(ids)
    for why, path in skipped.items():
        warn.append(f"feature files {path} (and any like it) not used: {why}")
    return index


def _match(samples: Sequence[Sample], index: _PartIndex, max_len: int) -> dict[Path, list[tuple[int, int, int]]]:
    """The samples that have a stored entry, by part: [(entry, sample id, length)]."""
    matched: dict[Path, list[tuple[int, int, int]]] = {}
    for s in samples:
        n, key = len(s.input_ids), ids_key(s.input_ids)
        hit = index.where.get(key)
        if hit is None and n == max_len:  # a sample truncated at data.max_seq_len: a stored prefix
            hit = index.cut.get(key)
        if hit is not None:
            matched.setdefault(hit[0], []).append((hit[1], s.sample_id, n))
    return matched


def _seed(
    cache: FeatureCache,
    matched: dict[Path, list[tuple[int, int, int]]],
    widths: dict[Path, int],
    teacher_topk: int,
    warn: list[str],
) -> int:
    """The matched entries into `cache`, part by part, until its budget is spent; returns how
    many samples it took. A part that fails to load is skipped with a `warn` line."""
    seeded = 0
    for path, wants in matched.items():
        try:
            entries = _load(path, sorted({j for j, _, _ in wants}), widths[path])
        except (SafetensorError, OSError, ValueError) as err:
            warn.append(f"feature files {path} not used: {str(err).splitlines()[0]}")
            continue
        for j, sample_id, n in wants:
            e = entries[j]
            teacher = None
            if teacher_topk:
                assert e.next is not None  # greedy parts only, checked above
                teacher = (torch.zeros(n, 1), e.next[:n, None])  # top-1: the ids; its logit is never read
            if not cache.seed(sample_id, e.features[:n], teacher):
                return seeded  # the cache's budget is spent
            seeded += 1
    return seeded
