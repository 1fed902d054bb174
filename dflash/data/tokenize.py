"""Chat datasets → tokenized `Sample`s: chat template, assistant-only loss mask, mixing, cache.

`load_samples(cfg, tokenizer)` is the one entry point. Per `[[data.files]]` entry it reads
conversations (`formats.py`), renders each with the tokenizer's own chat template, and
supervises only what the assistant says — the drafter must learn to predict the target's
answers, not the user's questions or the template's scaffolding.

**Loss mask by incremental rendering.** Templates such as ChatML (SmolLM2, Qwen) carry no
``{% generation %}`` markers, so the mask is computed from prefixes: for each assistant
message i, the tokens between ``render(messages[:i], add_generation_prompt=True)`` and
``render(messages[:i+1])`` are supervised — the assistant's content and the template's
end-of-turn text (ChatML: ``<|im_end|>`` and the newline after it), but not the
``<|im_start|>assistant\\n`` header. This is only correct if each shorter rendering's token
ids are a prefix of the longer one's; that is checked for every record, and a template that
rewrites earlier turns (e.g. strips past reasoning) is reported as a DataError rather than
trained on with a shifted mask. An assistant turn that opens a conversation has no prompt
to render, so it is context, not supervised. Cost: O(turns²) tokens per record, fine for
chat data.

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

**Cache.** Tokenizing is the slow part, so each file's tokenized samples (before weighting,
so changing a weight costs nothing) are stored under ``cache_dir`` as one safetensors file
(flat int32 ids, bool mask, int64 offsets) plus a JSON sidecar with the counts — never a
pickle. The key hashes the file's absolute path, size and mtime_ns (every file's, for a
`datasets` folder), the tokenizer (vocabulary, chat template, special tokens) and the
config fields that change tokenization (max_seq_len, overlong, skip_invalid). Files are
written to a temporary name and renamed, the sidecar last, so a reader never sees half a
cache; a cache that fails any check is treated as a miss and rewritten.

Stats returned: ``records`` (read, valid or not), ``skipped_invalid``, ``truncated``,
``dropped_overlong`` count records before weighting; ``samples``, ``tokens``,
``supervised_tokens`` describe one epoch after weighting; ``cache_hit`` is 1 when every
file came from the cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflash.config import DataConfig, DataFile
from dflash.data.batching import Sample
from dflash.data.formats import Conversation, InvalidRecord, Message, count_records, iter_records, resolve_format
from dflash.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["CACHE_VERSION", "load_samples", "tokenize_conversation", "weighted_indices"]

# Bump when anything below changes what a cached file would contain.
CACHE_VERSION = 1
_CHUNK = 256  # conversations rendered and encoded together (one batched tokenizer call)
_PLAIN_PROGRESS_EVERY = 1000  # records between progress lines when tqdm is not installed


# --- one conversation --------------------------------------------------------------------


class _Invalid(Exception):
    """A record-level problem found while tokenizing; the message is the reason."""


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[Message], gen: bool) -> str:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    except Exception as err:  # jinja's raise_exception (roles must alternate, ...) and the like
        detail = " ".join(str(err).split()) or type(err).__name__
        msg = f"chat template refused the conversation: {detail}"
        raise _Invalid(msg) from None
    assert isinstance(text, str)
    return text


def _plan(tokenizer: PreTrainedTokenizerBase, messages: list[Message]) -> list[tuple[int, str, str]]:
    """Per supervised assistant message i: (i, prompt text up to its header, text through it)."""
    return [
        (i, _render(tokenizer, messages[:i], gen=True), _render(tokenizer, messages[: i + 1], gen=False))
        for i, m in enumerate(messages)
        if m["role"] == "assistant" and i > 0  # an opening assistant turn has no prompt to render
    ]


def _mask(full: list[int], spans: list[tuple[int, list[int], list[int]]]) -> list[bool]:
    mask = [False] * len(full)
    for i, before, through in spans:
        # The prefix property: without it the span below would not line up with `full`.
        if through[: len(before)] != before or full[: len(through)] != through:
            msg = (
                f"the chat template is not prefix-stable at message {i}: rendering the conversation "
                "up to an assistant turn does not give a prefix (in token ids) of the longer rendering, "
                "so an assistant-only loss mask cannot be computed by incremental rendering"
            )
            raise _Invalid(msg)
        mask[len(before) : len(through)] = [True] * (len(through) - len(before))
    if not any(mask):
        msg = "no assistant token to supervise (an assistant turn that opens a conversation is context)"
        raise _Invalid(msg)
    return mask


def _encode(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> dict[str, list[int]]:
    # add_special_tokens=False: the template already wrote every special token it wants
    # (this is what apply_chat_template(tokenize=True) does too).
    unique = list(dict.fromkeys(texts))
    ids = tokenizer(unique, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    return dict(zip(unique, ids, strict=True))


def _tokenize_many(
    tokenizer: PreTrainedTokenizerBase, conversations: Sequence[list[Message]]
) -> list[tuple[list[int], list[bool]] | str]:
    """(ids, loss mask) per conversation, or the reason it cannot be used; one batched
    encode for all of them."""
    plans: list[tuple[str, list[tuple[int, str, str]]] | str] = []
    for messages in conversations:
        try:
            plans.append((_render(tokenizer, messages, gen=False), _plan(tokenizer, messages)))
        except _Invalid as err:
            plans.append(str(err))
    texts = [t for p in plans if not isinstance(p, str) for t in (p[0], *(x for s in p[1] for x in s[1:]))]
    enc = _encode(tokenizer, texts) if texts else {}
    out: list[tuple[list[int], list[bool]] | str] = []
    for p in plans:
        if isinstance(p, str):
            out.append(p)
            continue
        full = enc[p[0]]
        try:
            out.append((full, _mask(full, [(i, enc[a], enc[b]) for i, a, b in p[1]])))
        except _Invalid as err:
            out.append(str(err))
    return out


def tokenize_conversation(tokenizer: PreTrainedTokenizerBase, messages: list[Message]) -> tuple[list[int], list[bool]]:
    """Token ids of one conversation rendered with the tokenizer's chat template, and its
    loss mask (True on assistant content and end-of-turn tokens only). Raises DataError
    with the reason if it cannot be done. No length limit is applied."""
    (got,) = _tokenize_many(tokenizer, [messages])
    if isinstance(got, str):
        raise DataError(got)
    return got


# --- one file ----------------------------------------------------------------------------


@dataclass
class _FileSamples:
    """One file's samples, flat, in record order (before weighting)."""

    ids: torch.Tensor  # (N,) int32, every sample's ids back to back
    mask: torch.Tensor  # (N,) bool
    offsets: torch.Tensor  # (n+1,) int64; sample j is [offsets[j], offsets[j+1])
    counts: dict[str, int] = field(default_factory=dict)  # records, skipped_invalid, truncated, dropped_overlong
    first_skipped: str | None = None

    @property
    def n(self) -> int:
        return self.offsets.numel() - 1


class _Progress:
    """tqdm on a terminal; plain stderr lines every N records without tqdm; else nothing."""

    def __init__(self, enabled: bool, label: str, total: int | None) -> None:
        self._bar: Any = None
        self._plain = False
        self._label = label
        self._n = 0
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            self._plain = True
            return
        self._bar = tqdm(total=total, desc=f"tokenizing {label}", unit=" rec", file=sys.stderr, leave=False)

    def update(self) -> None:
        self._n += 1
        if self._bar is not None:
            self._bar.update(1)
        elif self._plain and self._n % _PLAIN_PROGRESS_EVERY == 0:
            print(f"tokenizing {self._label}: {self._n} records", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _tokenize_file(file: DataFile, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, progress: bool) -> _FileSamples:
    counts = {"records": 0, "skipped_invalid": 0, "truncated": 0, "dropped_overlong": 0}
    first_skipped: list[str] = []
    ids_parts: list[torch.Tensor] = []
    mask_parts: list[torch.Tensor] = []
    pending: list[Conversation] = []
    limit = cfg.max_seq_len

    def invalid(where: str, reason: str) -> None:
        if not cfg.skip_invalid:
            msg = f"{where}: {reason}"
            raise DataError(msg)
        counts["skipped_invalid"] += 1
        if not first_skipped:
            first_skipped.append(f"{where}: {reason}")

    def flush() -> None:
        results = _tokenize_many(tokenizer, [c.messages for c in pending])
        for conv, got in zip(pending, results, strict=True):
            if isinstance(got, str):
                invalid(conv.where, got)
                continue
            ids, mask = got
            if len(ids) > limit:
                if cfg.overlong == "drop":
                    counts["dropped_overlong"] += 1
                    continue
                if not any(mask[:limit]):
                    first = mask.index(True)
                    invalid(
                        conv.where,
                        f"no assistant token within max_seq_len = {limit} tokens (the conversation has "
                        f"{len(ids)} tokens, the first assistant token is at {first})",
                    )
                    continue
                counts["truncated"] += 1
                ids, mask = ids[:limit], mask[:limit]
            ids_parts.append(torch.tensor(ids, dtype=torch.int32))
            mask_parts.append(torch.tensor(mask, dtype=torch.bool))
        pending.clear()

    show = progress and _stderr_is_tty()
    bar = _Progress(show, file.path, count_records(file) if show else None)
    try:
        for item in iter_records(file):
            counts["records"] += 1
            bar.update()
            if isinstance(item, InvalidRecord):
                flush()  # earlier records first, so the first bad record is the one reported
                invalid(item.where, item.reason)
                continue
            pending.append(item)
            if len(pending) >= _CHUNK:
                flush()
        flush()
    finally:
        bar.close()

    lengths = torch.tensor([0] + [t.numel() for t in ids_parts], dtype=torch.int64)
    return _FileSamples(
        ids=torch.cat(ids_parts) if ids_parts else torch.zeros(0, dtype=torch.int32),
        mask=torch.cat(mask_parts) if mask_parts else torch.zeros(0, dtype=torch.bool),
        offsets=torch.cumsum(lengths, 0),
        counts=counts,
        first_skipped=first_skipped[0] if first_skipped else None,
    )


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


# --- cache -------------------------------------------------------------------------------


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
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


def _cache_key(file: DataFile, cfg: DataConfig, tokenizer_fp: str) -> str:
    path, fmt = resolve_format(file)
    return _hash(
        {
            "version": CACHE_VERSION,
            "path": str(path.resolve()),
            "format": fmt,
            "file": _file_identity(path),
            "tokenizer": tokenizer_fp,
            # Weights are applied after the cache, so they are not part of the key.
            "data": {"max_seq_len": cfg.max_seq_len, "overlong": cfg.overlong, "skip_invalid": cfg.skip_invalid},
        }
    )


def _read_cache(cache_dir: Path, key: str) -> _FileSamples | None:
    """The cached samples for `key`, or None if absent or not exactly as written."""
    tensors_path, meta_path = cache_dir / f"{key}.safetensors", cache_dir / f"{key}.json"
    if not meta_path.exists():
        return None
    # Any failure below — unreadable, truncated, foreign or inconsistent — means "rebuild".
    try:
        from safetensors import safe_open

        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta.get("version") != CACHE_VERSION or meta.get("key") != key:
            return None
        if tensors_path.stat().st_size != meta["bytes"]:
            return None
        with safe_open(str(tensors_path), framework="pt") as f:
            if (f.metadata() or {}).get("key") != key:
                return None
            ids, mask, offsets = f.get_tensor("ids"), f.get_tensor("mask"), f.get_tensor("offsets")
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
        counts = {k: int(meta[k]) for k in ("records", "skipped_invalid", "truncated", "dropped_overlong")}
        return _FileSamples(ids, mask, offsets, counts, meta.get("first_skipped"))
    except Exception:
        return None


def _atomic_write(dest: Path, write: Any) -> None:
    """`write(tmp_path)` then rename onto `dest`: readers see the old file or the new one."""
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write_cache(cache_dir: Path, key: str, fs: _FileSamples, source: str, vocab_size: int) -> None:
    from safetensors.torch import save_file

    tensors_path, meta_path = cache_dir / f"{key}.safetensors", cache_dir / f"{key}.json"
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tensors = {"ids": fs.ids.contiguous(), "mask": fs.mask.contiguous(), "offsets": fs.offsets.contiguous()}
        _atomic_write(tensors_path, lambda tmp: save_file(tensors, tmp, metadata={"key": key}))
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
        # The sidecar goes last: it is what makes the entry visible to `_read_cache`.
        _atomic_write(meta_path, lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=1), encoding="utf-8"))
    except OSError as err:
        # A cache that cannot be written costs time on the next run, never this run.
        warnings.warn(
            f"tokenization cache not written to {cache_dir}: {err.strerror or err}", RuntimeWarning, stacklevel=3
        )


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
) -> tuple[_FileSamples, bool]:
    key = _cache_key(file, cfg, tokenizer_fp)  # also raises for a missing file
    cached = _read_cache(cache_dir, key)
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
    _write_cache(cache_dir, key, fs, str(file.path), len(tokenizer))
    return fs, False


def _split(fs: _FileSamples) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    sizes = (fs.offsets[1:] - fs.offsets[:-1]).tolist()
    # One int64 buffer per file; samples are views into it (no per-sample copies).
    ids = torch.split(fs.ids.to(torch.int64), sizes)
    mask = torch.split(fs.mask, sizes)
    return zip(ids, mask, strict=True)


def load_samples(
    cfg: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    cache_dir: Path | None = None,
    progress: bool = True,
) -> tuple[list[Sample], dict[str, int]]:
    """Every `cfg.files` entry read, tokenized with the chat template, masked to assistant
    tokens, length-limited and mixed by weight: the samples of one epoch, with ids 0..N-1,
    and the stats (see the module docstring). `cache_dir` defaults to
    ``<data.cache_dir or ~/.cache/dflash>/tokenized``; `progress` shows a bar on a terminal."""
    if not cfg.files:
        msg = "no chat datasets: add at least one [[data.files]] entry with a path"
        raise DataError(msg)
    _check_tokenizer(tokenizer)
    cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else _default_cache_dir(cfg)
    tokenizer_fp = _tokenizer_fingerprint(tokenizer)

    stats = dict.fromkeys(("records", "skipped_invalid", "truncated", "dropped_overlong"), 0)
    all_hit = True
    samples: list[Sample] = []
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
        pieces = list(_split(fs))
        for j in weighted_indices(fs.n, file.weight):
            ids, mask = pieces[j]
            samples.append(Sample(sample_id=len(samples), input_ids=ids, loss_mask=mask))
    if not samples:
        msg = "no samples after weighting: every file's round(weight x samples) is 0; raise the weights"
        raise DataError(msg)
    stats["samples"] = len(samples)
    stats["tokens"] = sum(s.input_ids.numel() for s in samples)
    stats["supervised_tokens"] = sum(int(s.loss_mask.sum()) for s in samples)
    stats["cache_hit"] = int(all_hit)
    return samples, stats
