"""The feature store: target features kept on disk for training, read back with bounded memory.

`dflash regen` (with `regen.save_features`) and `dflash features` write the target's features
beside a data file (`regen.jsonl` → `regen.features/`) as **shards**: one safetensors file per
batch of samples, `part-NNNNN.safetensors`, each written atomically (a temporary file renamed
into place: a run killed mid-write leaves the store as it was, and a rerun writes the part
again). A shard holds its samples back to back:

- `ids` (N,) int32: the token ids of every sample *as training tokenizes it* (chat template,
  the reply as written to the JSONL), sample after sample,
- `features` (N, k·H) bfloat16: the chosen layers' outputs there (the end-of-turn tokens
  after a regen reply, never fed while generating, are zeros: they are only context for
  blocks that start after the conversation ends, which carry no loss),
- `next` (N,) int32, greedy only: the target's greedy next token at each position of a reply
  (the labels of `loss.labels = "target"`; elsewhere the next data token),
- `offsets` (n+1,) int64: sample j is rows `offsets[j]:offsets[j+1]`,
- `keys` (n, 16) uint8: each sample's `ids_key` (16 bytes of BLAKE2b over its int32 ids).

The header's metadata names what made them (format, target, dtype, layer ids, feature width,
whether `next` is there).

**The index**, `index.safetensors` in the same folder, is flat: five columns sorted by key
(the key's two 64-bit halves, part, row offset, length), one row per stored sample (and one
more for each sample longer than `data.max_seq_len`: its prefix, which is what a truncated
training sample holds). It is memory-mapped and searched with `numpy.searchsorted`; no
Python object per sample exists anywhere. It is rebuilt from the shards' `keys` (a few bytes
a sample, never the features) whenever the parts it lists differ from the folder's, or it was
built for another `max_seq_len`.

Training (`FeatureStore`, the `target.feature_store_read` stage) looks up each batch's
documents by key and reads their rows with `pread` at the byte offsets the index recorded:
nothing is loaded at set-up, and memory does not grow with the store. A folder of the earlier per-sample format
(`dflash-features/1`) is refused in one line naming `dflash features CONFIG --upgrade`, which
rewrites it. Nothing here unpickles anything.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from dflash.errors import DataError
from dflash.features.cache import doc_spans
from dflash.runtime.messages import Batch, Teacher
from dflash.store.atomic import atomic_path
from dflash.store.mapped import map_safetensors, tensor_starts

__all__ = [
    "FORMAT",
    "Entry",
    "FeatureMeta",
    "FeatureStore",
    "build_index",
    "folder_for",
    "ids_key",
    "next_part_index",
    "read_folder",
    "read_meta",
    "upgrade_folder",
    "write_part",
]

FORMAT = "dflash-features/2"
OLD_FORMAT = "dflash-features/1"  # one tensor triple per sample: `dflash features --upgrade` rewrites it
INDEX = "index.safetensors"
INDEX_FORMAT = "dflash-feature-index/1"
UPGRADE = "dflash features CONFIG --upgrade"


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
        fmt = None if not header else header.get("format")
        if fmt == OLD_FORMAT:
            msg = f"{where}: feature files in an earlier format (one entry a sample); rewrite them with `{UPGRADE}`"
            raise DataError(msg)
        if not header or fmt != FORMAT:
            msg = f"{where}: not a dflash feature file (format {fmt!r})"
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
    ids: torch.Tensor  # (S,) int
    features: torch.Tensor  # (S, k·H) bfloat16
    next: torch.Tensor | None  # (S,) int, greedy only


def ids_key(ids: torch.Tensor | Sequence[int]) -> bytes:
    """A token-id sequence's key in the feature store: 16 bytes of BLAKE2b over its int32 ids
    (a tuple of Python ints would cost ~36 bytes a token in memory)."""
    t = ids if isinstance(ids, torch.Tensor) else torch.tensor(list(ids), dtype=torch.int32)
    return hashlib.blake2b(t.to(torch.int32).contiguous().numpy().tobytes(), digest_size=16).digest()


def _halves(key: bytes) -> tuple[int, int]:
    hi, lo = np.frombuffer(key, dtype="<i8")
    return int(hi), int(lo)


def folder_for(data_file: Path) -> Path:
    """Where the features of a data file live: `regen.jsonl` → `regen.features`."""
    return data_file.with_suffix(".features")


def _parts(folder: Path) -> list[Path]:
    return sorted(folder.glob("part-*.safetensors")) if folder.is_dir() else []


def write_part(folder: Path, index: int, entries: Sequence[Entry], meta: FeatureMeta) -> Path:
    """One batch's entries as the shard `part-{index:05d}.safetensors`, atomically; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = [e.ids.to(torch.int32).reshape(-1) for e in entries]
    lengths = torch.tensor([0, *(len(i) for i in ids)], dtype=torch.int64)
    keys = torch.tensor(np.frombuffer(b"".join(ids_key(i) for i in ids), dtype=np.uint8).reshape(len(ids), 16))
    tensors = {
        "ids": torch.cat(ids),
        "features": torch.cat([e.features.to(torch.bfloat16) for e in entries]).contiguous(),
        "offsets": torch.cumsum(lengths, 0),
        "keys": keys,
    }
    if all(e.next is not None for e in entries):
        tensors["next"] = torch.cat([e.next.to(torch.int32).reshape(-1) for e in entries])  # type: ignore[union-attr]
    dest = folder / f"part-{index:05d}.safetensors"
    with atomic_path(dest, durable=False) as tmp:  # a cache: atomic; a power cut may lose it
        save_file(tensors, str(tmp), metadata=meta.to_header())
    return dest


def next_part_index(folder: Path) -> int:
    """The index the next part written to `folder` takes (a resumed regen appends)."""
    taken = [int(p.stem.split("-")[1]) for p in _parts(folder) if p.stem.split("-")[1].isdigit()]
    return max(taken, default=-1) + 1


def read_meta(folder: Path) -> FeatureMeta | None:
    """The metadata of the folder's first part, or None (no folder, no part, unreadable).
    Raises DataError for a folder of the earlier format (it needs `--upgrade` first)."""
    parts = _parts(folder)
    if not parts:
        return None
    try:
        meta, _ = map_safetensors(parts[0])
        return FeatureMeta.from_header(meta, parts[0])
    except (OSError, ValueError):
        return None


def _open_part(path: Path) -> tuple[FeatureMeta, dict[str, torch.Tensor]]:
    """A shard's metadata and its tensors, mapped, shapes checked. ValueError names the file."""
    try:
        header, t = map_safetensors(path)
    except OSError as err:
        msg = f"{path}: unreadable feature file: {err.strerror or err}"
        raise ValueError(msg) from None
    meta = FeatureMeta.from_header(header, path)
    need = ["ids", "features", "offsets", "keys", *(["next"] if meta.greedy else [])]
    missing = [k for k in need if k not in t]
    if missing:
        msg = f"{path}: malformed feature file: no {', '.join(missing)}"
        raise ValueError(msg)
    ids, feats, offs, keys = t["ids"], t["features"], t["offsets"], t["keys"]
    n, rows = len(offs) - 1, len(ids)
    ok = (
        ids.ndim == 1 and feats.shape == (rows, meta.width) and offs.ndim == 1 and n >= 0
        and keys.shape == (n, 16) and ("next" not in t or t["next"].shape == ids.shape)
        and (n == 0 or (int(offs[0]) == 0 and int(offs[-1]) == rows and bool((offs[1:] >= offs[:-1]).all())))
    )  # fmt: skip
    if not ok:
        shapes = {k: tuple(v.shape) for k, v in t.items()}
        msg = f"{path}: malformed feature file: shapes do not fit ({shapes}, width {meta.width})"
        raise ValueError(msg)
    return meta, t


def read_part(path: Path) -> tuple[FeatureMeta, list[Entry]]:
    """A shard's entries, copied out of the file."""
    meta, t = _open_part(path)
    offs = t["offsets"].tolist()
    out = []
    for a, b in itertools.pairwise(offs):
        nxt = t["next"][a:b].long() if "next" in t else None
        out.append(Entry(t["ids"][a:b].long(), t["features"][a:b].clone(), nxt))
    return meta, out


def read_folder(folder: Path) -> Iterator[tuple[FeatureMeta, Entry]]:
    """Every entry of every part in `folder`, in part order. Raises ValueError naming the file
    on a malformed one."""
    for path in _parts(folder):
        meta, entries = read_part(path)
        for e in entries:
            yield meta, e


# ---- the earlier format, read only to rewrite it ------------------------------------------


def _old_entries(path: Path) -> tuple[FeatureMeta, list[Entry]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        header = dict(f.metadata() or {})
        header["format"] = FORMAT
        meta = FeatureMeta.from_header(header, path)
        keys, out = set(f.keys()), []
        while f"{len(out)}.ids" in keys:
            j = len(out)
            nxt = f.get_tensor(f"{j}.next") if f"{j}.next" in keys else None
            out.append(Entry(f.get_tensor(f"{j}.ids"), f.get_tensor(f"{j}.features"), nxt))
    return meta, out


def upgrade_folder(folder: Path) -> int:
    """Rewrite every part of `folder` still in the earlier format as a shard of this one, part
    by part (one part in memory at a time; each replaced atomically); returns how many."""
    done = 0
    for path in _parts(folder):
        try:
            header, _ = map_safetensors(path)
        except (OSError, ValueError):
            continue
        if header.get("format") != OLD_FORMAT:
            continue
        try:
            meta, entries = _old_entries(path)
        except Exception as err:  # safetensors' own errors: one line naming the part
            msg = f"{path}: unreadable feature file: {str(err).splitlines()[0]}"
            raise DataError(msg) from None
        write_part(folder, int(path.stem.split("-")[1]), entries, meta)
        done += 1
    return done


# ---- the index -----------------------------------------------------------------------------


@dataclass
class _Index:
    """One folder's flat index: columns sorted by (hi, lo), and its parts."""

    folder: Path
    hi: np.ndarray  # (M,) int64
    lo: np.ndarray
    part: np.ndarray  # (M,) int32, into `names`
    offset: np.ndarray  # (M,) int64, the sample's first row in its part
    length: np.ndarray  # (M,) int32, rows it holds
    names: list[str]
    metas: list[dict[str, Any] | None]  # each part's FeatureMeta as a dict, None: unreadable
    starts: list[dict[str, int]]  # each part's tensors: where their bytes start in the file
    counts: list[int]  # samples in each part
    problems: dict[str, str]  # part name -> why it could not be indexed

    def find(self, key: bytes) -> list[int]:
        """The rows of `key` (a sample stored in several parts: each, earlier parts first)."""
        hi, lo = _halves(key)
        i = int(np.searchsorted(self.hi, hi))
        rows = []
        while i < len(self.hi) and int(self.hi[i]) == hi:
            if int(self.lo[i]) == lo:
                rows.append(i)
            i += 1
        return rows


def _listing(folder: Path) -> list[list[Any]]:
    return [[p.name, p.stat().st_size] for p in _parts(folder)]


def build_index(folder: Path, max_len: int, write: bool = True) -> _Index:
    """`folder`'s index built from its shards' keys (a sample longer than `max_len` also under
    its first `max_len` ids), written atomically as `index.safetensors` when `write` (a folder
    that cannot be written keeps it in memory only). An unreadable part is left out and named
    in `problems`; a part of the earlier format raises DataError naming `--upgrade`."""
    listing = _listing(folder)
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("hi", "lo", "part", "offset", "length")}
    metas: list[dict[str, Any] | None] = []
    starts: list[dict[str, int]] = []
    counts: list[int] = []
    problems: dict[str, str] = {}
    for pi, (name, _) in enumerate(listing):
        path = folder / name
        try:
            meta, t = _open_part(path)
        except ValueError as err:
            metas.append(None)
            starts.append({})
            counts.append(0)
            problems[name] = str(err).splitlines()[0].removeprefix(f"{path}: ")
            continue
        metas.append(asdict(meta))
        starts.append({k: v for k, v in tensor_starts(path).items() if k in ("ids", "features", "next")})
        counts.append(len(t["offsets"]) - 1)
        offs = t["offsets"].numpy()
        keys = t["keys"].numpy().view("<i8").reshape(-1, 2)
        lengths = np.diff(offs)
        long = np.flatnonzero(lengths > max_len) if max_len else np.empty(0, dtype=np.int64)
        cut = [np.frombuffer(ids_key(t["ids"][offs[j] : offs[j] + max_len]), dtype="<i8") for j in long]
        cut_keys = np.stack(cut) if cut else np.empty((0, 2), dtype=np.int64)
        cols["hi"] += [keys[:, 0], cut_keys[:, 0]]
        cols["lo"] += [keys[:, 1], cut_keys[:, 1]]
        cols["part"].append(np.full(len(keys) + len(long), pi, dtype=np.int32))
        cols["offset"] += [offs[:-1], offs[long]]
        cols["length"] += [lengths.astype(np.int32), np.full(len(long), max_len, dtype=np.int32)]
    flat = {k: np.concatenate(v) if v else np.empty(0, dtype=np.int64) for k, v in cols.items()}
    order = np.lexsort((flat["lo"], flat["hi"]))  # stable: of two equal keys, the earlier part's first
    flat = {k: np.ascontiguousarray(v[order]) for k, v in flat.items()}
    flat["part"] = flat["part"].astype(np.int32)
    flat["length"] = flat["length"].astype(np.int32)
    flat["offset"] = flat["offset"].astype(np.int64)
    header = {"format": INDEX_FORMAT, "max_len": str(max_len), "parts": json.dumps(listing),
              "metas": json.dumps(metas), "starts": json.dumps(starts), "counts": json.dumps(counts),
              "problems": json.dumps(problems)}  # fmt: skip
    if write and listing:
        try:
            with atomic_path(folder / INDEX, durable=False) as tmp:
                save_file({k: torch.from_numpy(v) for k, v in flat.items()}, str(tmp), metadata=header)
        except OSError:
            pass  # a read-only folder: the index lives in memory for this run
    names = [name for name, _ in listing]
    cols_ = (flat["hi"], flat["lo"], flat["part"], flat["offset"], flat["length"])
    return _Index(folder, *cols_, names, metas, starts, counts, problems)


def _read_index(folder: Path, max_len: int) -> _Index | None:
    """The folder's written index when it is current (its parts and max_len), else None."""
    path = folder / INDEX
    if not path.is_file():
        return None
    try:
        header, t = map_safetensors(path)
        if header.get("format") != INDEX_FORMAT or int(header["max_len"]) != max_len:
            return None
        listing = json.loads(header["parts"])
        if listing != _listing(folder):
            return None
        cols = {k: t[k].numpy() for k in ("hi", "lo", "part", "offset", "length")}
        n = len(cols["hi"])
        if any(c.ndim != 1 or len(c) != n for c in cols.values()):
            return None
        metas, starts, counts, problems = (json.loads(header[k]) for k in ("metas", "starts", "counts", "problems"))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # unreadable or foreign: built again
    names = [name for name, _ in listing]
    cols_ = (cols["hi"], cols["lo"], cols["part"], cols["offset"], cols["length"])
    return _Index(folder, *cols_, names, metas, starts, counts, problems)


def open_index(folder: Path, max_len: int) -> _Index:
    """`folder`'s current index: the written one, or built (and written) now."""
    return _read_index(folder, max_len) or build_index(folder, max_len)


# ---- training's reader ---------------------------------------------------------------------


class FeatureStore:
    """The stored features of the folders' parts that can serve a run, read by token-id key.

    `want`: the run's target (its `greedy` is ignored). `teacher_topk`: 0 (features only) or 1
    (target labels: greedy `next` needed); more (distillation's top-k) cannot be served.
    `max_len`: data.max_seq_len (a sample that long may be a stored entry's prefix). A part
    that cannot serve this run (another target layout, sampled with target labels, unreadable)
    is left out with one `warn` line per reason, naming the first such part."""

    OPEN_PARTS = 256  # parts kept open (LRU of file descriptors)

    def __init__(
        self, folders: Sequence[Path], want: FeatureMeta, teacher_topk: int, max_len: int, warn: list[str]
    ) -> None:
        self.teacher_topk = teacher_topk
        self.indexes = [open_index(f, max_len) for f in folders]
        self.width = want.width
        self.hits = self.misses = 0
        self.cpu_s = 0.0
        skipped: dict[str, str] = {}  # why -> first part skipped for it
        self._usable: list[np.ndarray] = []
        for ix in self.indexes:
            ok = np.zeros(len(ix.names), dtype=bool)
            for pi, (name, m) in enumerate(zip(ix.names, ix.metas, strict=True)):
                why = f"unreadable ({ix.problems.get(name, '?')})" if m is None else FeatureMeta(**m).differs_from(want)
                if not why and teacher_topk and m is not None and not m["greedy"]:
                    why = "made by sampled regen (temperature > 0): no greedy labels for loss.labels = 'target'"
                if why:
                    skipped.setdefault(why, str(ix.folder / name))
                ok[pi] = not why
            self._usable.append(ok)
        for why, path in skipped.items():
            warn.append(f"feature files {path} (and any like it) not used: {why}")
        pairs = zip(self.indexes, self._usable, strict=True)
        self.entries = sum(n for ix, ok in pairs for n, o in zip(ix.counts, ok, strict=True) if o)  # serving samples
        self._open: OrderedDict[tuple[int, int], int] = OrderedDict()  # (folder, part) -> file descriptor
        self._lock = threading.Lock()  # several target chains read from their own threads

    def find(self, ids: torch.Tensor) -> tuple[int, int] | None:
        """(folder, index row) of a sample whose token ids are `ids`, or None."""
        return self._find(ids_key(ids), len(ids))

    def _find(self, key: bytes, n: int) -> tuple[int, int] | None:
        for f, (ix, ok) in enumerate(zip(self.indexes, self._usable, strict=True)):
            for row in ix.find(key):  # the first copy that can serve this run
                if ok[ix.part[row]] and int(ix.length[row]) >= n:
                    return f, row
        return None

    def covered(self, samples: Sequence[Any]) -> int:
        """How many of `samples` have stored features."""
        return sum(self.find(s.input_ids) is not None for s in samples)

    def _fd(self, folder: int, part: int) -> int:
        """An open descriptor of the part (LRU: at most OPEN_PARTS open). With `_lock` held:
        no descriptor is closed while another thread reads through it."""
        fd = self._open.get((folder, part))
        if fd is not None:
            self._open.move_to_end((folder, part))
            return fd
        ix = self.indexes[folder]
        path = ix.folder / ix.names[part]
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as err:
            msg = f"{path}: {err.strerror or err}; its index {ix.folder / INDEX} names it (delete it to rebuild it)"
            raise DataError(msg) from None
        self._open[(folder, part)] = fd
        while len(self._open) > self.OPEN_PARTS:
            os.close(self._open.popitem(last=False)[1])
        return fd

    def _pread(self, folder: int, part: int, name: str, at: int, dest: Any) -> None:
        """Fill `dest` (a writable buffer) from tensor `name` of a part, from its byte `at`, at
        the place the index recorded (no header parsed, nothing mapped: the page cache serves
        repeats); a read that ends early is retried from where it stopped (large reads, network
        file systems), one that reads nothing is a truncated part."""
        ix = self.indexes[folder]
        view = memoryview(dest).cast("B")
        done = 0
        with self._lock:
            fd = self._fd(folder, part)
            while done < len(view):
                got = os.preadv(fd, [view[done:]], ix.starts[part][name] + at + done)
                if got <= 0:
                    path = ix.folder / ix.names[part]
                    msg = f"{path}: truncated ({name} ends before byte {at + len(view)}); delete {INDEX} to rebuild"
                    raise DataError(msg)
                done += got

    def _bytes(self, folder: int, part: int, name: str, at: int, size: int) -> bytearray:
        """`size` bytes of tensor `name` of a part from its byte `at`."""
        buf = bytearray(size)
        self._pread(folder, part, name, at, buf)
        return buf

    def _read_into(self, folder: int, part: int, name: str, at: int, dest: np.ndarray) -> None:
        """Tensor `name` of a part from its byte `at` into `dest` (contiguous), in place."""
        self._pread(folder, part, name, at, dest)

    def close(self) -> None:
        with self._lock:
            for fd in self._open.values():
                os.close(fd)
            self._open.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def read(
        self, batch: Batch, dtype: torch.dtype, alloc: Callable[..., torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, Teacher | None] | None:
        """(R, T, k·H) features (and with target labels the top-1 teacher) of a batch whose
        every document is stored, else None; in buffers from `alloc(shape, dtype)` when given.
        Raises DataError naming the part when it no longer holds what the index says."""
        t0 = time.thread_time()
        try:
            return self._read(batch, dtype, alloc)
        finally:
            with self._lock:
                self.cpu_s += time.thread_time() - t0

    def _read(
        self, batch: Batch, dtype: torch.dtype, alloc: Callable[..., torch.Tensor] | None
    ) -> tuple[torch.Tensor, Teacher | None] | None:
        """`read` (which times it): the documents located, read in place, converted to `dtype`."""
        spans = doc_spans(batch)
        located = self._locate(batch, spans)
        if located is None:
            return None
        R, T = batch.input_ids.shape
        # The parts' bytes land straight in a bf16 buffer (one pread a document, no copy), laid
        # out as the batch: every row its documents back to back, then padding, zeroed. In the
        # target's dtype and memory (`alloc`: pinned on a GPU) with one conversion, or none.
        direct = dtype == torch.bfloat16 and alloc is not None
        shape = (R, T, self.width)
        raw_feats = alloc(shape, dtype) if direct else torch.empty(shape, dtype=torch.bfloat16)
        staging = raw_feats.view(torch.uint8).numpy()  # (R, T, 2·width) bytes
        nxt = np.empty((R, T), dtype=np.int32) if self.teacher_topk else None
        self._fill(spans, *located, staging, nxt)
        out = raw_feats if direct or dtype == torch.bfloat16 else _converted(raw_feats, staging, dtype, alloc)
        return out, _top1_teacher(nxt, alloc)

    def _locate(
        self, batch: Batch, spans: list[tuple[int, int, int, int]]
    ) -> tuple[list[tuple[int, int]], list[bytes]] | None:
        """(folder, index row) and token-id bytes of each of the batch's documents, or None (a
        miss) when one is not stored; counts the hit or the miss."""
        ids32 = batch.input_ids.to(torch.int32).numpy()
        found, raws = [], []
        for r, s, e, _ in spans:
            raw = ids32[r, s:e].tobytes()  # what the key hashes, and what the part must hold
            hit = self._find(hashlib.blake2b(raw, digest_size=16).digest(), e - s)
            if hit is None:
                with self._lock:
                    self.misses += 1
                return None
            found.append(hit)
            raws.append(raw)
        with self._lock:
            self.hits += 1
        return found, raws

    def _fill(
        self,
        spans: list[tuple[int, int, int, int]],
        found: list[tuple[int, int]],
        raws: list[bytes],
        staging: np.ndarray,
        nxt: np.ndarray | None,
    ) -> None:
        """Each document's features (and next tokens) into its place in `staging` (`nxt`), the
        padding after each row's documents zeroed; refuses a part whose ids are not the
        document's."""
        filled = [0] * len(staging)
        for r, _, e, _ in spans:
            filled[r] = max(filled[r], e)
        for r, end in enumerate(filled):
            staging[r, end:] = 0
            if nxt is not None:
                nxt[r, end:] = 0
        for (r, s, e, _), (f, row), raw in zip(spans, found, raws, strict=True):
            ix = self.indexes[f]
            part, a, n = int(ix.part[row]), int(ix.offset[row]), e - s
            if self._bytes(f, part, "ids", a * 4, n * 4) != raw:
                msg = (
                    f"{ix.folder / INDEX} does not match {ix.folder / ix.names[part]} (rows {a}..{a + n} hold other "
                    "tokens); delete the index to rebuild it"
                )
                raise DataError(msg)
            self._read_into(f, part, "features", a * 2 * self.width, staging[r, s:e])
            if nxt is not None:
                self._read_into(f, part, "next", a * 4, nxt[r, s:e])

    def stats(self) -> dict[str, float]:
        """Batches served and not; `cpu_s`: the reads' own CPU time (their spans in the profile
        also count waiting for a core or the GIL)."""
        return {"hits": self.hits, "misses": self.misses, "cpu_s": round(self.cpu_s, 3)}


def _converted(
    raw_feats: torch.Tensor, staging: np.ndarray, dtype: torch.dtype, alloc: Callable[..., torch.Tensor] | None
) -> torch.Tensor:
    """The bf16 features `raw_feats` (their bytes: `staging`) in `dtype`, in a buffer from `alloc`
    when given."""
    shape = tuple(raw_feats.shape)
    out = torch.empty(shape, dtype=dtype) if alloc is None else alloc(shape, dtype)
    if dtype == torch.float32:  # bf16 -> f32 is the bits shifted up: numpy, one thread (torch's
        # copy would wake its intra-op pool, which the training stages keep busy)
        bits = out.view(torch.int32).numpy().view(np.uint32)
        np.left_shift(staging.view(np.uint16), 16, out=bits, dtype=np.uint32)
    else:
        out.copy_(raw_feats)
    return out


def _top1_teacher(nxt: np.ndarray | None, alloc: Callable[..., torch.Tensor] | None) -> Teacher | None:
    """The stored next tokens (R, T) as a top-1 teacher: the labels; its logit is never read."""
    if nxt is None:
        return None
    R, T = nxt.shape
    vals = torch.zeros((R, T, 1)) if alloc is None else alloc((R, T, 1), torch.float32).zero_()
    ids = torch.from_numpy(nxt).to(torch.int64)[..., None]
    return vals, ids if alloc is None else alloc((R, T, 1), torch.int64).copy_(ids)
