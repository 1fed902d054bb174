"""The tokenization cache: one file's tokenized samples, stored as safetensors + a JSON sidecar.

Tokenizing is the slow part, so each file's tokenized samples (before weighting, so
changing a weight costs nothing) are stored under ``cache_dir`` as one safetensors file
(flat int32 ids, bool mask, int64 offsets) plus a JSON sidecar with the counts — never a
pickle. A cache is read memory-mapped (`dflash/store/mapped.py`): training's samples are
views of its pages, so a billion tokens cost page cache, not process memory. The key hashes
the file's absolute path, size and mtime_ns (every file's, for a `datasets` folder), the
tokenizer (vocabulary, chat template, special tokens) and the config fields that change
tokenization (max_seq_len, overlong, skip_invalid). Both files go through `atomic_path`, the
sidecar last, so a reader never sees half a cache; a cache that fails any check is treated
as a miss and rewritten. A cache that cannot be written is a warning, never an error.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflash.config import DataConfig, DataFile
from dflash.data.formats import resolve_format
from dflash.store.atomic import atomic_path
from dflash.store.mapped import map_safetensors

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["CACHE_VERSION", "FileSamples", "cache_key", "read_cache", "tokenizer_fingerprint", "write_cache"]

# Bump when anything here, in chat_template.py or in tokenize.py changes what a cached file
# would contain.
CACHE_VERSION = 2


@dataclass
class FileSamples:
    """One file's samples, flat, in record order (before weighting)."""

    ids: torch.Tensor  # (N,) int32, every sample's ids back to back
    mask: torch.Tensor  # (N,) bool
    offsets: torch.Tensor  # (n+1,) int64; sample j is [offsets[j], offsets[j+1])
    counts: dict[str, int] = field(
        default_factory=dict
    )  # records, skipped_invalid, truncated, dropped_overlong, continued
    first_skipped: str | None = None

    @property
    def n(self) -> int:
        return self.offsets.numel() - 1


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # The full serialized tokenizer (vocab, merges, normalizer, added tokens) when there is
    # one: two tokenizers of equal vocab size can still split text differently.
    model = backend.to_str() if backend is not None else sorted(tokenizer.get_vocab().items())
    return _hash(
        {
            "class": type(tokenizer).__name__,
            "vocab_size": len(tokenizer),
            "chat_template": tokenizer.chat_template,
            "special_tokens": tokenizer.special_tokens_map,
            "added_tokens": {i: str(t) for i, t in tokenizer.added_tokens_decoder.items()},
            "model": hashlib.sha256(str(model).encode()).hexdigest(),
        }
    )


def _file_identity(path: Path) -> dict[str, Any]:
    if path.is_dir():
        # A `datasets` folder: any file in it changing (a re-save) must invalidate.
        files = sorted(p for p in path.rglob("*") if p.is_file())
        return {
            "files": [[str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns] for p in files],
        }
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def cache_key(file: DataFile, cfg: DataConfig, tokenizer_fp: str) -> str:
    path, fmt = resolve_format(file)
    return _hash(
        {
            "version": CACHE_VERSION,
            "path": str(path.resolve()),
            "format": fmt,
            "file": _file_identity(path),
            "tokenizer": tokenizer_fp,
            **({"max_records": file.max_records} if file.max_records else {}),
            # Weights are applied after the cache, so they are not part of the key.
            "data": {
                "max_seq_len": cfg.max_seq_len,
                "overlong": cfg.overlong,
                "skip_invalid": cfg.skip_invalid,
                **({"chat_template_kwargs": cfg.chat_template_kwargs} if cfg.chat_template_kwargs else {}),
            },
        }
    )


def read_cache(cache_dir: Path, key: str) -> FileSamples | None:
    """The cached samples for `key`, or None if absent or not exactly as written."""
    tensors_path, meta_path = cache_dir / f"{key}.safetensors", cache_dir / f"{key}.json"
    if not meta_path.exists():
        return None
    # Any failure below — unreadable, truncated, foreign or inconsistent — means "rebuild".
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta.get("version") != CACHE_VERSION or meta.get("key") != key:
            return None
        if tensors_path.stat().st_size != meta["bytes"]:
            return None
        header, t = map_safetensors(tensors_path)
        if header.get("key") != key:
            return None
        ids, mask, offsets = t["ids"], t["mask"], t["offsets"]
        n = int(meta["samples"])
        ok = (
            ids.dtype == torch.int32
            and mask.dtype == torch.bool
            and offsets.dtype == torch.int64
            and ids.dim() == mask.dim() == offsets.dim() == 1
            and ids.shape == mask.shape
            and offsets.numel() == n + 1
            and int(offsets[0]) == 0
            and int(offsets[-1]) == ids.numel()
            and bool((offsets[1:] > offsets[:-1]).all())
            and (ids.numel() == 0 or (int(ids.min()) >= 0 and int(ids.max()) < int(meta["vocab_size"])))
        )
        if not ok:
            return None
        counts = {
            k: int(meta.get(k, 0)) for k in ("records", "skipped_invalid", "truncated", "dropped_overlong", "continued")
        }
        return FileSamples(ids, mask, offsets, counts, meta.get("first_skipped"))
    except Exception:
        return None


def write_cache(cache_dir: Path, key: str, fs: FileSamples, source: str, vocab_size: int) -> None:
    from safetensors.torch import save_file

    tensors_path, meta_path = cache_dir / f"{key}.safetensors", cache_dir / f"{key}.json"
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tensors = {"ids": fs.ids.contiguous(), "mask": fs.mask.contiguous(), "offsets": fs.offsets.contiguous()}
        with atomic_path(tensors_path, durable=False) as tmp:
            save_file(tensors, str(tmp), metadata={"key": key})
        meta = {
            "version": CACHE_VERSION,
            "key": key,
            "source": source,
            "bytes": tensors_path.stat().st_size,
            "samples": fs.n,
            "vocab_size": vocab_size,
            **fs.counts,
            "first_skipped": fs.first_skipped,
        }
        # The sidecar goes last: it is what makes the entry visible to `read_cache`.
        with atomic_path(meta_path, durable=False) as tmp:
            tmp.write_text(json.dumps(meta, indent=1), encoding="utf-8")
    except OSError as err:
        # A cache that cannot be written costs time on the next run, never this run.
        warnings.warn(
            f"tokenization cache not written to {cache_dir}: {err.strerror or err}", RuntimeWarning, stacklevel=3
        )
