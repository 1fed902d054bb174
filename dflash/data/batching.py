"""Batching: which samples train together, in which order, and how they become tensors.

`BatchPlan` decides the run's sequence of batches; `collate` (`samples.py`) turns one
batch into padded `(R, T)` tensors; `packing.py` forms each epoch's rows and batches for
the plan. The plan exists so that the expensive part of a step (the target and
drafter forwards over `R × T` slots) is spent on real tokens, and so that a run is exactly
reproducible and resumable:

- **Length buckets** (`num_buckets`): samples are split by length quantiles, and batches
  form within one bucket, so that rows of like length pad little.
- **Token budget** (`token_budget`): a batch's padded size `R × T` stays within the budget
  (and `R ≤ batch_size`), so long and short batches cost about the same memory.
- **Packing** (`pack`): several whole documents share a row of `max_seq_len` tokens;
  `doc_ids` (global sample id per token) and `positions` (restarting at 0 per document)
  keep them apart for the mask, anchors and labels downstream.
- **Deterministic shuffling** from `(seed, epoch)` only: the order inside each bucket and
  the order of batches across buckets. Every sample appears exactly once per epoch.
- **Resumable cursor**: `cursor_after(index)` is a small JSON-able dict; a fresh plan from
  the same inputs started at it (`BatchPlan(..., start=cursor)` or `iter_from(cursor)`)
  serves exactly the batches that would have followed.

With the defaults (`num_buckets=1`, `token_budget=0`, `pack=False`) every row is one
document and batches are `batch_size` consecutive samples of the epoch's order.

All of it is `BatchPlan`: its input checks, epoch counts, cursor and cost share the plan's
fingerprint and lengths, so they stay in one class.
"""

from __future__ import annotations

import hashlib
import json
import math
from array import array
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

import torch

from dflash.data.packing import EpochLayout, epoch_seed, group_rows, layout_epoch, length_buckets, pack_rows
from dflash.data.samples import Rows, Sample, SampleTable, batch_padding_fraction, collate
from dflash.errors import CheckpointError, DataError

if TYPE_CHECKING:
    from dflash.config import DataConfig

__all__ = [
    "BatchLimits",
    "BatchPlan",
    "Cursor",
    "Rows",
    "Sample",
    "batch_padding_fraction",
    "collate",
    "length_buckets",
]


class BatchLimits(TypedDict, total=False):
    """`BatchPlan`'s keywords that limit a batch beyond `batch_size`; each is off when left out."""

    token_budget: int  # R × T at most this (0: no budget)
    num_buckets: int  # batches form within this many length-quantile buckets (1: one)
    pack: bool  # whole documents share rows
    max_seq_len: int | None  # the longest sample allowed, and a packed row's capacity


# A resume point: {"epoch": e, "position": batches of epoch e already served,
# "index": global index of the next batch, "plan": fingerprint of the plan's inputs}.
Cursor = dict[str, Any]


class BatchPlan:
    """The run's sequence of batches: `epochs` passes over `samples`, each shuffled from
    `(seed, epoch)`; iterating yields `(index, epoch, rows)` for `collate(rows, index, epoch)`.

    Limits per batch (R rows, T = the longest row, padded size R × T):

    - `R ≤ batch_size` always.
    - `token_budget > 0`: R × T ≤ token_budget. A sample longer than the budget cannot meet
      it and forms a batch of its own; that is allowed only because it is ≤ `max_seq_len`
      (longer samples are refused up front: `data.overlong` should have truncated or
      dropped them).
    - `pack`: whole documents fill rows of capacity `max_seq_len` tokens (the longest
      sample when `max_seq_len` is None), or `token_budget` when that is smaller (then a
      document longer than the budget is a row and a batch of its own). Rows per batch:
      `batch_size`, and with a budget `min(batch_size, max(1, budget // capacity))`.
      A document is never split across rows.

    `num_buckets > 1` forms batches (and packed rows) within length-quantile buckets.
    With packing, buckets usually raise padding instead (long documents cannot be topped
    up with short ones), so keep `num_buckets = 1` when packing.
    The number of batches per epoch is fixed when `token_budget = 0` and not packing;
    otherwise it depends on the shuffled order and may differ by a few between epochs:
    `len(plan)` is exact, `batches_per_epoch` is epoch 0's.
    """

    def __init__(
        self,
        samples: list[Sample],
        batch_size: int,
        epochs: int,
        seed: int,
        shuffle: bool = True,
        *,
        start: Cursor | None = None,
        **limits: Unpack[BatchLimits],
    ) -> None:
        unknown = limits.keys() - BatchLimits.__annotations__.keys()
        if unknown:
            msg = f"BatchPlan.__init__() got an unexpected keyword argument {min(unknown)!r}"  # as Python says it
            raise TypeError(msg)
        self.samples = samples
        self.batch_size = batch_size
        self.epochs = epochs
        self.seed = seed
        self.shuffle = shuffle
        self.token_budget: int = limits.get("token_budget", 0)
        self.num_buckets: int = limits.get("num_buckets", 1)
        self.pack: bool = limits.get("pack", False)
        self.max_seq_len: int | None = limits.get("max_seq_len")
        self._check_settings()
        self.lengths: list[int] = self._check_samples(samples, self.max_seq_len)
        # Row capacity in tokens (packing only) and the most rows in one batch.
        self.row_capacity, self.rows_per_batch = self._row_shape()
        self.buckets: list[list[int]] = length_buckets(self.lengths, self.num_buckets)
        self._bucket_members = [torch.tensor(b, dtype=torch.long) for b in self.buckets]  # (n_b,) each
        self.fingerprint: str = self._fingerprint()
        # Every epoch laid out stays cached (~8 bytes per sample): `len()` lays out the
        # order-dependent kinds in the caller's (set-up) thread, so that iterating on the
        # event loop only slices. The default kind is vectorized and cheap to lay out late.
        self._layouts: dict[int, EpochLayout] = {}
        self._counts: dict[int, int] = {}
        self.start: Cursor = self._resolve(start) if start is not None else self._cursor(0, 0)

    @classmethod
    def from_config(
        cls, samples: list[Sample], data_cfg: DataConfig, epochs: int, seed: int, *, start: Cursor | None = None,
        shared_by: int = 1,
    ) -> BatchPlan:
        """The plan that `[data]` describes: batch_size, token_budget, num_buckets, pack,
        shuffle and max_seq_len. `shared_by`: the replicas that train each batch together
        (`pipeline.sequence_parallel`): their budget is that many times a replica's, and a sample
        longer than it fits no group (one line; alone, a longer sample is a batch of its own)."""
        plan = cls(
            samples,
            data_cfg.batch_size,
            epochs,
            seed,
            data_cfg.shuffle,
            token_budget=data_cfg.token_budget * shared_by,
            num_buckets=data_cfg.num_buckets,
            pack=data_cfg.pack,
            max_seq_len=data_cfg.max_seq_len,
            start=start,
        )
        longest = max(plan.lengths)
        if shared_by > 1 and plan.token_budget and longest > plan.token_budget:
            budget, i = data_cfg.token_budget, plan.lengths.index(longest)
            msg = (
                f"data: sample {i} has {longest} tokens, more than a sequence-parallel group's token budget "
                f"(pipeline.sequence_parallel × data.token_budget = {shared_by} × {budget} = {plan.token_budget}): it "
                f"fits no group; raise pipeline.sequence_parallel to {-(-longest // budget)} (replicas permitting) or "
                f"data.token_budget to {-(-longest // shared_by)}"
            )
            raise DataError(msg)
        return plan

    # -- inputs -------------------------------------------------------------------------
    def _check_settings(self) -> None:
        if not self.samples:
            msg = "data: no samples to batch"
            raise DataError(msg)
        if self.batch_size < 1 or self.epochs < 1 or self.num_buckets < 1 or self.token_budget < 0:
            msg = (
                f"BatchPlan: batch_size ({self.batch_size}), epochs ({self.epochs}) and num_buckets "
                f"({self.num_buckets}) must be >= 1 and token_budget ({self.token_budget}) >= 0"
            )
            raise ValueError(msg)
        if self.max_seq_len is not None and self.max_seq_len < 1:
            msg = f"BatchPlan: max_seq_len must be >= 1 (got {self.max_seq_len})"
            raise ValueError(msg)

    def _row_shape(self) -> tuple[int, int]:
        """(row capacity in tokens, rows per batch): a packed row holds `max_seq_len` tokens (the
        longest sample without one), or the budget when that is smaller."""
        capacity = self.max_seq_len if self.max_seq_len is not None else max(self.lengths)
        if self.pack and self.token_budget:
            capacity = min(capacity, self.token_budget)
            return capacity, min(self.batch_size, max(1, self.token_budget // capacity))
        return capacity, self.batch_size

    @staticmethod
    def _check_samples(samples: list[Sample], max_seq_len: int | None) -> list[int]:
        """Lengths of the samples; refuse what would make wrong batches later, naming it."""
        if isinstance(samples, SampleTable):  # well-formed by construction: ids 0..N-1, 1-D, non-empty
            longest = int(samples.lengths.max())
            if max_seq_len is not None and longest > max_seq_len:
                i = int(samples.lengths.argmax())
                msg = (
                    f"data: sample {i} has {longest} tokens, more than data.max_seq_len ({max_seq_len}); "
                    "data.overlong should have truncated or dropped it"
                )
                raise DataError(msg)
            return samples.lengths.tolist()
        lengths: list[int] = []
        seen: set[int] = set()
        for s in samples:
            n = s.input_ids.numel()
            if s.input_ids.dim() != 1 or s.loss_mask.shape != s.input_ids.shape or n == 0:
                msg = (
                    f"data: sample {s.sample_id} needs 1-D input_ids and loss_mask of the same, non-zero "
                    f"length (got {tuple(s.input_ids.shape)} and {tuple(s.loss_mask.shape)})"
                )
                raise DataError(msg)
            if max_seq_len is not None and n > max_seq_len:
                msg = (
                    f"data: sample {s.sample_id} has {n} tokens, more than data.max_seq_len ({max_seq_len}); "
                    "data.overlong should have truncated or dropped it"
                )
                raise DataError(msg)
            if s.sample_id < 0 or s.sample_id in seen:
                # doc ids are the sample ids: a repeat would merge two documents in a row.
                msg = f"data: sample id {s.sample_id} is negative or used twice; ids must be unique and >= 0"
                raise DataError(msg)
            seen.add(s.sample_id)
            lengths.append(n)
        return lengths

    def _fingerprint(self) -> str:
        """What a cursor must agree with: sample ids and lengths, and every knob that shapes
        an epoch's batches (not `epochs`: epoch e is the same whatever the run's length)."""
        h = hashlib.blake2b(digest_size=8)
        knobs = [self.batch_size, self.seed, self.shuffle, self.token_budget, self.num_buckets, self.pack]
        h.update(json.dumps([*knobs, self.max_seq_len]).encode())
        ids = range(len(self.samples)) if isinstance(self.samples, SampleTable) else [s.sample_id for s in self.samples]
        h.update(array("q", ids).tobytes())
        h.update(array("q", self.lengths).tobytes())
        return h.hexdigest()

    # -- one epoch ----------------------------------------------------------------------
    def _layout(self, epoch: int) -> EpochLayout:
        layout = self._layouts.get(epoch)
        if layout is None:
            # One generator per epoch: the layout depends on (inputs, seed, epoch) only,
            # never on what ran before.
            g = torch.Generator().manual_seed(epoch_seed(self.seed, epoch)) if self.shuffle else None
            simple = not self.pack and not self.token_budget
            layout = layout_epoch(self._bucket_members, g, self.batch_size, None if simple else self._form)
            self._layouts[epoch] = layout
            self._counts[epoch] = len(layout)
        return layout

    def _form(self, members: list[int]) -> list[list[list[int]]]:
        """One bucket's shuffled members as batches of rows (packed, or one per row)."""
        if self.pack:
            return pack_rows(members, self.lengths, self.row_capacity, self.rows_per_batch)
        return group_rows(members, self.lengths, self.batch_size, self.token_budget)

    def batches_in(self, epoch: int) -> int:
        """How many batches epoch `epoch` has."""
        if not 0 <= epoch < self.epochs:
            msg = f"epoch {epoch} is outside 0..{self.epochs - 1}"
            raise IndexError(msg)
        if epoch not in self._counts:
            if not self.pack and not self.token_budget:  # order-independent: no need to lay it out
                self._counts[epoch] = sum(math.ceil(len(b) / self.batch_size) for b in self.buckets)
            else:
                self._layout(epoch)
        return self._counts[epoch]

    @property
    def batches_per_epoch(self) -> int:
        """Batches in epoch 0 (later epochs may differ by a few with a budget or packing)."""
        return self.batches_in(0)

    def __len__(self) -> int:
        """Batches over all epochs, exactly."""
        return sum(self.batches_in(e) for e in range(self.epochs))

    # -- iteration and resume -----------------------------------------------------------
    def _cursor(self, epoch: int, position: int) -> Cursor:
        index = sum(self.batches_in(e) for e in range(epoch)) + position
        return {"epoch": epoch, "position": position, "index": index, "plan": self.fingerprint}

    def _resolve(self, cursor: Cursor) -> Cursor:
        """Check a cursor against this plan; normalize an epoch's end to the next epoch's start."""
        try:
            epoch, position = int(cursor["epoch"]), int(cursor["position"])
        except (KeyError, TypeError, ValueError):
            msg = f"batch cursor {cursor!r}: needs integer 'epoch' and 'position'"
            raise CheckpointError(msg) from None
        if cursor.get("plan", self.fingerprint) != self.fingerprint:
            msg = (
                f"batch cursor is for another plan ({cursor['plan']}, this one is {self.fingerprint}): "
                "the samples or the [data] batching settings or the seed changed since it was taken"
            )
            raise CheckpointError(msg)
        if not 0 <= epoch <= self.epochs or position < 0 or (epoch == self.epochs and position):
            msg = f"batch cursor {cursor!r}: outside this plan's {self.epochs} epochs"
            raise CheckpointError(msg)
        if epoch < self.epochs:
            count = self.batches_in(epoch)
            if position > count:
                msg = f"batch cursor {cursor!r}: epoch {epoch} has only {count} batches"
                raise CheckpointError(msg)
            if position == count:
                epoch, position = epoch + 1, 0
        out = self._cursor(epoch, position)
        if "index" in cursor and int(cursor["index"]) != out["index"]:
            msg = f"batch cursor {cursor!r}: index disagrees with this plan (expected {out['index']})"
            raise CheckpointError(msg)
        done = cursor.get("done", [])
        total = len(self) if done else 0  # (lays out every epoch: only when there is a list to check)
        if not isinstance(done, list) or not all(isinstance(i, int) and out["index"] < i < total for i in done):
            msg = f"batch cursor {cursor!r}: 'done' must list batch indices after {out['index']} of this plan"
            raise CheckpointError(msg)
        if done:
            out["done"] = sorted(done)
        return out

    def cursor_after(self, index: int, done: Iterable[int] = ()) -> Cursor:
        """The resume point once batch `index` (global, 0-based; -1: none) and every batch
        before it have been consumed, and the batches `done` after it (drafters that take
        batches as they arrive leave gaps): JSON-serializable `{"epoch", "position", "index",
        "plan"}`, and `"done"` when there are such batches — a resume serves the others."""
        total = len(self)
        if not -1 <= index < total:
            msg = f"batch {index} is outside 0..{total - 1}"
            raise IndexError(msg)
        rest, epoch = index + 1, 0
        while epoch < self.epochs and rest >= self.batches_in(epoch):
            rest -= self.batches_in(epoch)
            epoch += 1
        out = self._cursor(epoch, rest)
        after = sorted(i for i in done if i > index)
        if after:
            out["done"] = after
        return out

    @property
    def start_index(self) -> int:
        """Global index of the first batch this plan serves (0 unless started at a cursor)."""
        return int(self.start["index"])

    @property
    def done_ahead(self) -> list[int]:
        """Batches after `start_index` that a resumed run had consumed already (not served)."""
        return list(self.start.get("done", ()))

    def iter_from(self, cursor: Cursor) -> Iterator[tuple[int, int, Rows]]:
        """Yields `(index, epoch, rows)` from `cursor` to the end of the last epoch."""
        start = self._resolve(cursor)
        index, done = start["index"], set(start.get("done", ()))
        for epoch in range(start["epoch"], self.epochs):
            layout = self._layout(epoch)
            for b in range(start["position"] if epoch == start["epoch"] else 0, len(layout)):
                if index not in done:  # consumed before the resume, out of order
                    yield index, epoch, [[self.samples[i] for i in row] for row in layout.rows(b)]
                index += 1

    def __iter__(self) -> Iterator[tuple[int, int, Rows]]:
        """Yields `(index, epoch, rows)` from `start`; rows are lists of whole documents."""
        return self.iter_from(self.start)

    # -- cost ---------------------------------------------------------------------------
    def batch_shape(self, epoch: int = 0) -> dict[str, float]:
        """One epoch's mean batch: rows, padded row length (slots / rows) and real tokens —
        what `dflash plan --calibrate` models a batch as."""
        batches = rows = slots = tokens = 0
        layout = self._layout(epoch)
        for b in range(len(layout)):
            fills = [sum(self.lengths[i] for i in row) for row in layout.rows(b)]
            batches += 1
            rows += len(fills)
            slots += len(fills) * max(fills)
            tokens += sum(fills)
        if not batches:
            return {"rows": 0.0, "row_length": 0.0, "real_tokens": 0.0}
        return {"rows": round(rows / batches, 3), "row_length": round(slots / rows, 2),
                "real_tokens": round(tokens / batches, 1)}  # fmt: skip

    def padding_fraction(self, epoch: int | None = None) -> float:
        """Share of padded slots, Σ(R·T − tokens) / Σ R·T, over one epoch or (None) the run."""
        slots = tokens = 0
        for e in range(self.epochs) if epoch is None else [epoch]:
            layout = self._layout(e)
            for b in range(len(layout)):
                fills = [sum(self.lengths[i] for i in row) for row in layout.rows(b)]
                slots += len(fills) * max(fills)
                tokens += sum(fills)
        return 1.0 - tokens / slots
