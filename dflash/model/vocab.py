"""The draft vocabulary: the target tokens a pruned drafter can emit (`drafter.draft_vocab_size`).

A drafter's LM head over the whole vocabulary costs as much as a draft layer or more (Qwen3's
151,936 × 4,096 head: ~620 M multiply-adds a drafted position) for tokens it never drafts. A
draft vocabulary keeps the V' target tokens most often supervised in the training data: the
drafter's head is those rows of the target's head (frozen, as the whole head is), and a drafted
row r is target token `d2t[r]`.

The maps are the field's (speculators' `vocab_mapping.py`, vLLM's and llama.cpp's loaders):
`d2t` (V',) int64 holds each draft row's target id, the rows in ascending target-id order;
`t2d` (V,) bool marks the kept ids. Files and exports store `d2t` as speculators and vLLM do,
as an offset (target id = row + d2t[row]); llama.cpp's GGUF wants the ids themselves
(`export_gguf`). Inside dflash `DraftVocab.ids` are the ids.

The run folder keeps the run's map (`draft_vocab.safetensors`: `freqs`, `d2t`, `t2d`); a resumed
run takes its checkpoint's; `drafter.vocab_mapping` takes one made elsewhere: ours, or
speculators' `d2t-N.npy` (its `t2d-N.npy` beside it is read when present). The counts are of the
data's tokens where the loss mask is 1 (with `loss.labels = "target"` on regen's replies, the
target's own greedy tokens: the same).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash.config import Config
from dflash.errors import CheckpointError, ConfigError

__all__ = ["FILE", "DraftVocab", "check_same", "count_supervised", "for_run", "missing"]

FILE = "draft_vocab.safetensors"  # in the run folder


def count_supervised(samples: Iterable[object], vocab_size: int) -> torch.Tensor:
    """(V,) int64: how often each token is a supervised label (loss mask 1) in `samples`."""
    freqs = torch.zeros(vocab_size, dtype=torch.int64)
    for s in samples:  # one pass; memory of the vocabulary's size, not the data's
        ids = s.input_ids[s.loss_mask.bool()].long()  # type: ignore[attr-defined]
        freqs += torch.bincount(ids.clamp(0, vocab_size - 1), minlength=vocab_size)
    return freqs


@dataclass(frozen=True)
class DraftVocab:
    """`ids` (V',) int64 the target id of each draft row, ascending; `vocab_size` V, the target's;
    `freqs` (V,) the counts it was chosen by (None for a map made elsewhere)."""

    ids: torch.Tensor
    vocab_size: int
    freqs: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.ids.numel()

    @property
    def t2d(self) -> torch.Tensor:
        """(V,) bool: the target ids the drafter can emit."""
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[self.ids] = True
        return mask

    @property
    def offsets(self) -> torch.Tensor:
        """`d2t` as speculators and vLLM store it: target id − draft row."""
        return self.ids - torch.arange(self.size)

    def index(self) -> torch.Tensor:
        """(V,) int64: each target id's draft row, −1 for the ids outside."""
        out = torch.full((self.vocab_size,), -1, dtype=torch.int64)
        out[self.ids] = torch.arange(self.size)
        return out

    def coverage(self) -> float:  # no-sync: host counts
        """The share of counted (supervised) tokens the draft vocabulary holds (1.0 without counts)."""
        if self.freqs is None or int(self.freqs.sum()) == 0:  # no-sync: host counts
            return 1.0
        return float(self.freqs[self.ids].sum() / self.freqs.sum())  # no-sync: host counts

    @classmethod
    def most_frequent(  # no-sync: host counts
        cls, freqs: torch.Tensor, size: int, keep: Iterable[int] = ()
    ) -> DraftVocab:
        """The `size` most frequent ids (ties: the lower id), `keep` always among them; fewer
        counted ids than `size`: the lowest unused ids fill the rest (as speculators does)."""
        V = freqs.numel()
        if not 0 < size <= V:
            msg = f"drafter.draft_vocab_size ({size}) must be between 1 and the vocabulary's {V}"
            raise ConfigError(msg)
        must = sorted({int(k) for k in keep if 0 <= int(k) < V})
        if len(must) > size:
            msg = f"drafter.draft_vocab_size ({size}) is smaller than the {len(must)} tokens the drafter must emit"
            raise ConfigError(msg)
        score = freqs.to(torch.float64).clone()
        score[must] = float("inf")
        # stable descending sort by count, ties broken by the lower id
        order = torch.sort(-score, stable=True).indices
        counted = order[: size]
        return cls(torch.sort(counted).values.to(torch.int64), V, freqs.to(torch.int64))

    @classmethod
    def identity(cls, vocab_size: int) -> DraftVocab:
        return cls(torch.arange(vocab_size, dtype=torch.int64), vocab_size)

    # -- files ----------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        from dflash.store.atomic import atomic_path

        tensors = {"d2t": self.offsets.contiguous(), "t2d": self.t2d}
        if self.freqs is not None:
            tensors["freqs"] = self.freqs.contiguous()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(Path(path)) as tmp:
            save_file(tensors, str(tmp), metadata={"vocab_size": str(self.vocab_size)})
        return Path(path)

    @classmethod
    def load(cls, path: str | Path, vocab_size: int) -> DraftVocab:  # no-sync: a host file
        """Ours (safetensors: `d2t` offsets, `t2d`, optional `freqs`) or speculators' `d2t-N.npy`
        (with `t2d-N.npy` beside it when there is one). Checked against the target's `vocab_size`."""
        p = Path(path).expanduser()
        if not p.is_file():
            msg = f"drafter.vocab_mapping: {p} is not a file"
            raise ConfigError(msg)
        try:
            d2t, t2d, freqs = _read(p)
        except (OSError, ValueError, KeyError, RuntimeError) as err:
            msg = f"drafter.vocab_mapping: {p} is not a draft vocabulary map ({' '.join(str(err).split())[:160]})"
            raise ConfigError(msg) from None
        if d2t.dim() != 1 or not d2t.numel() or d2t.is_floating_point() or d2t.dtype == torch.bool:
            msg = f"drafter.vocab_mapping: {p}: d2t must be one non-empty row of integer offsets"
            raise ConfigError(msg)
        ids = d2t.to(torch.int64) + torch.arange(d2t.numel())
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            msg = f"drafter.vocab_mapping: {p} maps to ids outside the target's vocabulary of {vocab_size}"
            raise ConfigError(msg)
        if not bool((ids[1:] > ids[:-1]).all()):
            msg = f"drafter.vocab_mapping: {p}: d2t's target ids must be unique and ascending"
            raise ConfigError(msg)
        if t2d is not None and (t2d.dim() != 1 or t2d.numel() != vocab_size
                                or not torch.equal(t2d.bool().nonzero().flatten(), ids)):  # fmt: skip
            msg = f"drafter.vocab_mapping: {p}: t2d does not match d2t (or the target's vocabulary of {vocab_size})"
            raise ConfigError(msg)
        if freqs is not None and freqs.numel() != vocab_size:
            freqs = None
        return cls(ids, vocab_size, freqs)


def _read(p: Path) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    if p.suffix == ".npy":
        import numpy as np

        d2t = torch.from_numpy(np.load(p, allow_pickle=False))
        twin = p.with_name(p.name.replace("d2t", "t2d", 1))
        t2d = torch.from_numpy(np.load(twin, allow_pickle=False)) if twin != p and twin.is_file() else None
        return d2t, t2d, None
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(p))
    except Exception as err:  # safetensors raises its own error type for a bad header
        raise ValueError(str(err)) from None
    return tensors["d2t"], tensors.get("t2d"), tensors.get("freqs")


def for_run(
    cfg: Config,
    vocab_size: int,
    samples: Iterable[object],
    keep: Iterable[int],
    write: bool = True,
    resumed: torch.Tensor | None = None,
) -> DraftVocab | None:
    """The run's draft vocabulary, its counts always those of the `samples`' supervised tokens
    (the share they hold: `coverage`): `drafter.vocab_mapping`'s; else, with
    `drafter.draft_vocab_size`, a resumed checkpoint's (`resumed`: its `d2t`) when it has that
    size, else the most frequent with `keep` (end-of-turn, mask) always in, written to the run
    folder (`write`: this process writes the run's files). None: the whole vocabulary (a size or
    a map covering every id too)."""
    d = cfg.drafter
    if not d.vocab_mapping and not d.draft_vocab_size:
        return None
    freqs = count_supervised(samples, vocab_size)
    if d.vocab_mapping:
        vocab = dataclasses.replace(DraftVocab.load(d.vocab_mapping, vocab_size), freqs=freqs)
        if d.draft_vocab_size and d.draft_vocab_size != vocab.size:
            msg = (
                f"drafter.draft_vocab_size ({d.draft_vocab_size}) differs from drafter.vocab_mapping's "
                f"{vocab.size} rows"
            )
            raise ConfigError(msg)
    elif resumed is not None and resumed.numel() == d.draft_vocab_size:
        vocab = DraftVocab(resumed.to(torch.int64) + torch.arange(resumed.numel()), vocab_size, freqs)
    else:
        vocab = DraftVocab.most_frequent(freqs, d.draft_vocab_size, keep)
    if vocab.size == vocab_size:
        return None
    if write:
        vocab.save(cfg.run_dir / FILE)
    return vocab


def missing(vocab: DraftVocab, tokens: Iterable[int]) -> list[int]:  # no-sync: set-up
    """The `tokens` (end-of-turn, mask) a map made elsewhere leaves out: the drafter never drafts them."""
    t2d = vocab.t2d
    return sorted(t for t in {int(x) for x in tokens} if 0 <= t < vocab.vocab_size and not t2d[t])


def check_same(model_d2t: torch.Tensor, vocab: DraftVocab, where: object) -> None:  # no-sync: set-up
    """A checkpoint's draft vocabulary must be the run's (same rows, same ids)."""
    if not torch.equal(model_d2t.cpu(), vocab.offsets):
        msg = f"{where}: the checkpoint's draft vocabulary differs from this run's ({FILE} or drafter.vocab_mapping)"
        raise CheckpointError(msg)
