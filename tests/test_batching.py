"""Batching: buckets, token budget, packing, shuffling, resume cursor, padding, collate."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

from dflash.config import DataConfig
from dflash.data.batching import BatchPlan, Sample, batch_padding_fraction, collate, length_buckets
from dflash.errors import CheckpointError, DataError


def make_samples(n: int, lengths: list[int] | None = None, lo: int = 1, hi: int = 64, seed: int = 0) -> list[Sample]:
    """`n` samples of random lengths (or the given ones); ids 1000 + 3i so that a sample's id
    is never its index, and random loss masks so that masks are told apart."""
    rng = random.Random(seed)
    lengths = lengths or [rng.randint(lo, hi) for _ in range(n)]
    g = torch.Generator().manual_seed(seed)
    return [
        Sample(
            sample_id=1000 + 3 * i,
            input_ids=torch.randint(0, 500, (k,), generator=g),
            loss_mask=torch.rand(k, generator=g) < 0.5,
        )
        for i, k in enumerate(lengths)
    ]


def skewed_lengths(n: int, seed: int = 0) -> list[int]:
    """Mostly short samples and a long tail, as chat data has."""
    rng = random.Random(seed)
    return [rng.randint(200, 400) if rng.random() < 0.1 else rng.randint(8, 32) for _ in range(n)]


# Configurations exercised by the invariant tests: (kwargs for BatchPlan beyond the basics).
CONFIGS = {
    "default": {},
    "buckets": {"num_buckets": 4},
    "budget": {"token_budget": 256, "max_seq_len": 128},
    "budget+buckets": {"token_budget": 200, "num_buckets": 3, "max_seq_len": 128},
    "pack": {"pack": True, "max_seq_len": 128},
    "pack+budget": {"pack": True, "token_budget": 512, "max_seq_len": 128},
    "pack+budget<row": {"pack": True, "token_budget": 48, "max_seq_len": 128},
    "pack+buckets+budget": {"pack": True, "num_buckets": 4, "token_budget": 400, "max_seq_len": 128},
    "no-shuffle+buckets+budget": {"shuffle": False, "num_buckets": 2, "token_budget": 150, "max_seq_len": 128},
}


def plan_of(samples: list[Sample], config: str, epochs: int = 3, seed: int = 5, batch_size: int = 6) -> BatchPlan:
    kw = dict(CONFIGS[config])
    shuffle = kw.pop("shuffle", True)
    return BatchPlan(samples, batch_size, epochs, seed, shuffle, **kw)


def ids(rows: list[list[Sample]]) -> list[list[int]]:
    return [[s.sample_id for s in row] for row in rows]


def run_of(plan: BatchPlan) -> list[tuple[int, int, list[list[int]]]]:
    return [(i, e, ids(rows)) for i, e, rows in plan]


def run_of_from(plan: BatchPlan, cursor: dict) -> list[tuple[int, int, list[list[int]]]]:
    return [(i, e, ids(rows)) for i, e, rows in plan.iter_from(cursor)]


@pytest.mark.parametrize("config", CONFIGS)
def test_every_sample_once_per_epoch(config):
    """Every sample appears exactly once in every epoch, for every configuration."""
    samples = make_samples(97, hi=120, seed=1)
    plan = plan_of(samples, config, epochs=4)
    seen: dict[int, list[int]] = {}
    for _, epoch, rows in plan:
        seen.setdefault(epoch, []).extend(s.sample_id for row in rows for s in row)
    assert sorted(seen) == [0, 1, 2, 3]
    for got in seen.values():
        assert sorted(got) == sorted(s.sample_id for s in samples)


@pytest.mark.parametrize("config", CONFIGS)
def test_batches_within_budget_and_batch_size(config):
    """R ≤ batch_size, and with a budget R × T ≤ budget unless one document alone exceeds it."""
    rng = random.Random(2)  # mostly short, some up to max_seq_len: over the small budgets
    lengths = [rng.randint(1, 40) if rng.random() < 0.8 else rng.randint(40, 128) for _ in range(120)]
    samples = make_samples(120, lengths=lengths)
    plan = plan_of(samples, config)
    budget = CONFIGS[config].get("token_budget", 0)
    for _, _, rows in plan:
        batch = collate(rows, 0, 0)
        rows_, width = batch.input_ids.shape  # (R, T)
        assert rows_ <= plan.batch_size
        if budget:
            lone = rows_ == 1 and len(rows[0]) == 1 and width > budget
            assert rows_ * width <= budget or lone, (rows_, width, budget)


def test_oversized_sample_forms_a_batch_alone():
    """A sample longer than the token budget (but within max_seq_len) is a batch on its own."""
    samples = make_samples(30, lengths=[10] * 29 + [90])
    for pack in (False, True):
        plan = BatchPlan(samples, 8, 1, 0, token_budget=40, max_seq_len=128, pack=pack)
        alone = [rows for _, _, rows in plan if any(s.length == 90 for row in rows for s in row)]
        assert len(alone) == 1 and ids(alone[0]) == [[samples[-1].sample_id]]


def test_sample_longer_than_max_seq_len_is_refused():
    """A sample over max_seq_len is a DataError naming it (data.overlong should have handled it)."""
    samples = make_samples(5, lengths=[10, 10, 200, 10, 10])
    with pytest.raises(DataError, match=r"sample 1006 has 200 tokens.*max_seq_len \(128\)"):
        BatchPlan(samples, 4, 1, 0, max_seq_len=128)


def test_bad_samples_are_refused():
    """Duplicate ids and masks of another length than the ids are DataErrors up front."""
    a, b = make_samples(2, lengths=[4, 5])
    with pytest.raises(DataError, match="used twice"):
        BatchPlan([a, Sample(a.sample_id, b.input_ids, b.loss_mask)], 2, 1, 0)
    with pytest.raises(DataError, match="same, non-zero length"):
        BatchPlan([Sample(1, a.input_ids, b.loss_mask)], 2, 1, 0)


@pytest.mark.parametrize("config", [c for c in CONFIGS if "pack" in c])
def test_packed_rows_hold_whole_documents_within_capacity(config):
    """Packed rows hold whole documents, contiguous, within the row capacity."""
    samples = make_samples(150, hi=100, seed=4)
    plan = plan_of(samples, config)
    by_id = {s.sample_id: s for s in samples}
    multi = 0
    for _, _, rows in plan:
        batch = collate(rows, 0, 0)
        for r, row in enumerate(rows):
            fill = sum(s.length for s in row)
            assert fill <= plan.row_capacity or len(row) == 1
            multi += len(row) > 1
            doc = batch.doc_ids[r].tolist()
            for s in row:  # every token of the document in this row, one contiguous run
                cols = [c for c, d in enumerate(doc) if d == s.sample_id]
                assert len(cols) == by_id[s.sample_id].length
                assert cols == list(range(cols[0], cols[0] + len(cols)))
    assert multi > 0  # packing did pack


def test_rows_per_batch_follow_budget_over_capacity():
    """With packing and a budget, a batch has at most min(batch_size, budget // capacity) rows."""
    samples = make_samples(200, hi=30, seed=6)
    plan = BatchPlan(samples, 16, 1, 0, token_budget=300, max_seq_len=64, pack=True)
    assert plan.row_capacity == 64 and plan.rows_per_batch == 4
    counts = [len(rows) for _, _, rows in plan]
    assert max(counts) == 4 and all(c <= 4 for c in counts)
    small = BatchPlan(samples, 16, 1, 0, token_budget=40, max_seq_len=64, pack=True)
    assert small.row_capacity == 40 and small.rows_per_batch == 1


def reference_collate(rows: list[list[Sample]]) -> dict[str, list[list]]:
    """The plain-Python meaning of collate: one token at a time."""
    T = max(sum(s.length for s in row) for row in rows)
    out = {k: [] for k in ("input_ids", "loss_mask", "doc_ids", "positions")}
    for row in rows:
        ids_, mask, doc, pos = [], [], [], []
        for s in row:
            for t in range(s.length):
                ids_.append(int(s.input_ids[t]))
                mask.append(bool(s.loss_mask[t]))
                doc.append(s.sample_id)
                pos.append(t)
        pad = T - len(ids_)
        out["input_ids"].append(ids_ + [0] * pad)
        out["loss_mask"].append(mask + [False] * pad)
        out["doc_ids"].append(doc + [-1] * pad)
        out["positions"].append(pos + [0] * pad)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_collate_matches_python_loop(seed):
    """Packed collate equals a per-token Python loop: ids, loss mask, doc ids, positions."""
    rng = random.Random(seed)
    samples = make_samples(40, hi=20, seed=seed)
    rng.shuffle(samples)
    rows, k = [], 0
    while k < len(samples):
        n = rng.randint(1, 5)
        rows.append(samples[k : k + n])
        k += n
    batch = collate(rows, 7, 2)
    ref = reference_collate(rows)
    for key, want in ref.items():
        assert getattr(batch, key).tolist() == want, key
    assert batch.index == 7 and batch.epoch == 2
    assert batch.input_ids.dtype == batch.doc_ids.dtype == batch.positions.dtype == torch.long
    assert batch.loss_mask.dtype == torch.bool
    assert batch.num_tokens == sum(s.length for s in samples) and batch.num_samples == len(samples)


def test_collate_flat_list_is_one_document_per_row():
    """The older form, a flat list of samples, collates as one document per row."""
    samples = make_samples(5, seed=7)
    a, b = collate(samples, 0, 0), collate([[s] for s in samples], 0, 0)
    for key in ("input_ids", "loss_mask", "doc_ids", "positions"):
        assert torch.equal(getattr(a, key), getattr(b, key)), key
    assert a.input_ids.shape == (5, max(s.length for s in samples))


def test_loss_masks_carried_per_document():
    """In a packed row each document keeps its own loss mask; padding is never supervised."""
    a = Sample(1, torch.arange(4), torch.tensor([False, False, True, True]))
    b = Sample(2, torch.arange(3), torch.tensor([True, False, True]))
    c = Sample(3, torch.arange(2), torch.tensor([True, True]))
    batch = collate([[a, b], [c]], 0, 0)
    assert batch.loss_mask.tolist() == [
        [False, False, True, True, True, False, True],
        [True, True, False, False, False, False, False],
    ]
    assert batch.positions.tolist() == [[0, 1, 2, 3, 0, 1, 2], [0, 1, 0, 0, 0, 0, 0]]
    assert batch.doc_ids.tolist() == [[1, 1, 1, 1, 2, 2, 2], [3, 3, -1, -1, -1, -1, -1]]


def test_buckets_are_length_quantiles():
    """Buckets split at length quantiles: about equal sizes, ordered lengths, ties together."""
    rng = random.Random(8)
    lengths = [rng.randint(1, 1000) for _ in range(1000)]
    buckets = length_buckets(lengths, 4)
    assert len(buckets) == 4 and all(200 <= len(b) <= 300 for b in buckets)
    for lo, hi in itertools.pairwise(buckets):
        assert max(lengths[i] for i in lo) < min(lengths[i] for i in hi)
    assert length_buckets([5] * 10 + [9] * 10, 8) == [list(range(10)), list(range(10, 20))]


def test_batches_form_within_a_bucket():
    """Every batch's samples come from one length bucket."""
    samples = make_samples(200, lengths=skewed_lengths(200, seed=9))
    plan = BatchPlan(samples, 8, 2, 0, num_buckets=4)
    bucket_of = {samples[i].sample_id: b for b, members in enumerate(plan.buckets) for i in members}
    for _, _, rows in plan:
        assert len({bucket_of[s.sample_id] for row in rows for s in row}) == 1


@pytest.mark.parametrize("budget", [0, 512, 2048])
def test_buckets_reduce_padding_on_skewed_lengths(budget):
    """On a skewed length mix, 8 buckets pad clearly less than one bucket."""
    samples = make_samples(600, lengths=skewed_lengths(600, seed=10))
    one = BatchPlan(samples, 16, 2, 0, token_budget=budget, max_seq_len=400)
    eight = BatchPlan(samples, 16, 2, 0, token_budget=budget, num_buckets=8, max_seq_len=400)
    assert eight.padding_fraction() < one.padding_fraction() - 0.1, (eight.padding_fraction(), one.padding_fraction())


@pytest.mark.parametrize("config", ["budget", "pack+buckets+budget"])
def test_padding_fraction_matches_collated_batches(config):
    """plan.padding_fraction(epoch) equals the padded share of the collated batches."""
    samples = make_samples(80, hi=100, seed=11)
    plan = plan_of(samples, config, epochs=2)
    batches = [collate(rows, i, e) for i, e, rows in plan]
    for epoch in (0, 1):
        mine = [b for b in batches if b.epoch == epoch]
        slots = sum(b.input_ids.numel() for b in mine)
        want = 1 - sum(b.num_tokens for b in mine) / slots
        assert plan.padding_fraction(epoch) == pytest.approx(want)
    slots = sum(b.input_ids.numel() for b in batches)
    assert plan.padding_fraction() == pytest.approx(1 - sum(b.num_tokens for b in batches) / slots)
    b = batches[0]
    assert batch_padding_fraction(b) == pytest.approx(1 - b.num_tokens / b.input_ids.numel())


@pytest.mark.parametrize("config", CONFIGS)
def test_same_seed_same_batches_other_epoch_other_order(config):
    """Same inputs and seed give the same batches; another epoch or seed gives another order."""
    samples = make_samples(90, hi=120, seed=12)
    a, b = run_of(plan_of(samples, config)), run_of(plan_of(samples, config))
    assert a == b
    if CONFIGS[config].get("shuffle", True):
        per_epoch = [[row for i, e, rows in a if e == epoch for row in rows] for epoch in range(3)]
        assert per_epoch[0] != per_epoch[1] != per_epoch[2]
        assert run_of(plan_of(samples, config, seed=6)) != a


def test_no_shuffle_keeps_sample_order_like_before():
    """Defaults without shuffling: batch_size consecutive samples per batch, one per row, every epoch."""
    samples = make_samples(21, seed=13)
    plan = BatchPlan(samples, 4, 2, 0, False)
    assert len(plan) == 12 and plan.batches_per_epoch == 6
    want = [[[s.sample_id] for s in samples[k : k + 4]] for k in range(0, 21, 4)]
    got = run_of(plan)
    assert [rows for _, _, rows in got] == want * 2
    assert [(i, e) for i, e, _ in got] == [(i, i // 6) for i in range(12)]


@pytest.mark.parametrize("config", CONFIGS)
def test_len_and_indices_are_exact(config):
    """len(plan) is the number of batches served; indices run 0..len-1; epochs are in order."""
    samples = make_samples(70, hi=120, seed=14)
    plan = plan_of(samples, config)
    got = [(i, e) for i, e, _ in plan]
    assert [i for i, _ in got] == list(range(len(plan)))
    assert [e for _, e in got] == sorted(e for _, e in got)
    assert plan.batches_per_epoch == sum(1 for _, e in got if e == 0) == plan.batches_in(0)


@pytest.mark.parametrize("config", CONFIGS)
def test_cursor_resume_mid_epoch_and_across_epochs(config):
    """A fresh plan resumed at cursor_after(k-1) serves exactly the batches that followed k."""
    samples = make_samples(60, hi=120, seed=15)
    full = run_of(plan_of(samples, config))
    per_epoch = plan_of(samples, config).batches_in(0)
    n = len(full)
    for k in sorted({1, 2, per_epoch - 1, per_epoch, per_epoch + 1, n // 2, n - 1, n} - {0}):
        first = run_of(plan_of(samples, config))[:k]
        cursor = json.loads(json.dumps(plan_of(samples, config).cursor_after(k - 1)))  # through a checkpoint
        fresh = plan_of(samples, config)
        assert first + run_of_from(fresh, cursor) == full, k
        assert BatchPlan(
            samples, 6, 3, 5, CONFIGS[config].get("shuffle", True),
            **{key: v for key, v in CONFIGS[config].items() if key != "shuffle"}, start=cursor,
        ).start_index == k  # fmt: skip
    at_boundary = plan_of(samples, config).cursor_after(per_epoch - 1)
    assert (at_boundary["epoch"], at_boundary["position"], at_boundary["index"]) == (1, 0, per_epoch)


def test_start_cursor_equals_iter_from():
    """BatchPlan(..., start=cursor) iterates like plan.iter_from(cursor)."""
    samples = make_samples(50, seed=16)
    plan = BatchPlan(samples, 4, 2, 3, token_budget=100, max_seq_len=64, num_buckets=2)
    cursor = plan.cursor_after(17)
    resumed = BatchPlan(samples, 4, 2, 3, token_budget=100, max_seq_len=64, num_buckets=2, start=cursor)
    assert run_of(resumed) == run_of_from(plan, cursor)
    assert run_of(resumed)[0][0] == 18 and len(resumed) == len(plan)


def test_cursor_from_another_plan_is_refused():
    """A cursor taken on other samples, seed or batching settings is a CheckpointError."""
    samples = make_samples(40, seed=17)
    cursor = BatchPlan(samples, 4, 2, 0).cursor_after(3)
    with pytest.raises(CheckpointError, match="another plan"):
        BatchPlan(samples, 4, 2, 1, start=cursor)
    with pytest.raises(CheckpointError, match="another plan"):
        BatchPlan(samples, 5, 2, 0).iter_from(cursor).__next__()
    with pytest.raises(CheckpointError, match="outside"):
        BatchPlan(samples, 4, 2, 0, start={"epoch": 3, "position": 0})
    # More epochs keep epoch e identical, so a cursor survives extending the run.
    assert BatchPlan(samples, 4, 5, 0, start=cursor).start_index == 4


def test_from_config_uses_every_data_field():
    """BatchPlan.from_config reads batch_size, token_budget, num_buckets, pack, shuffle, max_seq_len."""
    samples = make_samples(100, hi=60, seed=18)
    cfg = DataConfig(batch_size=5, token_budget=256, num_buckets=3, pack=True, shuffle=False, max_seq_len=64)
    plan = BatchPlan.from_config(samples, cfg, epochs=2, seed=9)
    assert (plan.batch_size, plan.token_budget, plan.num_buckets, plan.pack, plan.shuffle, plan.max_seq_len) == (
        5, 256, 3, True, False, 64,
    )  # fmt: skip
    assert (plan.epochs, plan.seed, plan.rows_per_batch, len(plan.buckets)) == (2, 9, 4, 3)
    explicit = BatchPlan(samples, 5, 2, 9, False, token_budget=256, num_buckets=3, pack=True, max_seq_len=64)
    assert run_of(plan) == run_of(explicit)
    default = BatchPlan.from_config(samples, DataConfig(), epochs=1, seed=0)
    assert all(len(row) == 1 for _, _, rows in default for row in rows)
    assert default.batches_per_epoch == 13
