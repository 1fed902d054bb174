"""The feature cache: later epochs read cached target features instead of running the target."""

from __future__ import annotations

import asyncio

import pytest
import torch

from dflash.data.batching import Sample, collate
from dflash.features.cache import FeatureCache
from tests.conftest import run_records


def _samples() -> list[Sample]:
    return [Sample(i, torch.arange(n), torch.ones(n, dtype=torch.bool)) for i, n in enumerate([5, 3, 7])]


def test_get_returns_what_put_stored_in_any_row_layout():
    """Features stored from one batch layout come back for the same documents in another."""
    s = _samples()
    first = collate([s[0], s[1]], 0, 0)
    hidden = torch.randn(2, first.doc_ids.shape[1], 6)
    cache = FeatureCache(1 << 20)
    cache.put(first, hidden)
    assert cache.get(collate([s[1], s[2]], 1, 0), torch.float32) is None  # sample 2 unseen
    again = collate([s[1], s[0]], 2, 1)  # other order, other padding
    hit = cache.get(again, torch.float32)
    assert hit is not None and hit[1] is None  # no teacher stored
    got = hit[0]
    assert got.shape == (2, 5, 6)
    torch.testing.assert_close(got[0, :3], hidden[1, :3].to(torch.bfloat16).float())
    torch.testing.assert_close(got[1, :5], hidden[0, :5].to(torch.bfloat16).float())
    assert cache.hits == 1 and cache.misses == 1


def test_teacher_top_k_is_kept_beside_the_features():
    """With target labels or distillation the target's top-k comes back with the features."""
    s = _samples()
    first = collate([s[0], s[2]], 0, 0)
    R, T = first.doc_ids.shape
    vals, idx = torch.randn(R, T, 3), torch.randint(0, 1000, (R, T, 3))
    cache = FeatureCache(1 << 20)
    cache.put(first, torch.randn(R, T, 6), (vals, idx))
    hit = cache.get(collate([s[2], s[0]], 1, 0), torch.float32)
    assert hit is not None and hit[1] is not None
    got_vals, got_idx = hit[1]
    assert got_idx.dtype == torch.int64
    torch.testing.assert_close(got_vals[0, :7], vals[1, :7])
    torch.testing.assert_close(got_idx[1, :5], idx[0, :5])


def test_budget_bounds_memory():
    """Nothing is stored past the byte budget."""
    s = _samples()
    cache = FeatureCache(5 * 6 * 2)  # room for sample 0 only (5 tokens × 6 features × bf16)
    b = collate(s, 0, 0)
    cache.put(b, torch.randn(3, 7, 6))
    assert len(cache) == 1 and cache.bytes <= cache.max_bytes


@pytest.mark.parametrize("mode", ["pipeline", "serial"])
def test_later_epochs_hit_the_cache(tiny_config, monkeypatch, mode):
    """With data.feature_cache_mb, every batch is looked up once; a hit skips the target
    (it runs once per miss). Once the first epoch's features are stored, every later batch
    hits: the second epoch's lookups wait for that here (the pipeline's target may otherwise
    run ahead of the stage that stores them; the serial loop stores before it looks up)."""
    from dflash.stages import target_forward, transfer

    features, host_features = target_forward.features, transfer.host_features
    per_epoch = 4  # 32 samples, batch 8
    stored = asyncio.Event()  # every batch of the first epoch is in the cache
    stored_epoch0 = 0
    waited: list[int] = []  # Batch.index of the lookups that had to wait

    async def after_first_epoch(target, device, batch, *args, **kwargs):
        if batch.epoch > 0 and not stored.is_set():
            waited.append(batch.index)
            await asyncio.wait_for(stored.wait(), 60)  # a hang guard only
        return await features(target, device, batch, *args, **kwargs)

    async def counted(*args, **kwargs):
        nonlocal stored_epoch0
        out = await host_features(*args, **kwargs)
        if out.batch.epoch == 0:
            stored_epoch0 += 1
            if stored_epoch0 == per_epoch:
                stored.set()
        return out

    monkeypatch.setattr(target_forward, "features", after_first_epoch)
    monkeypatch.setattr(transfer, "host_features", counted)
    cfg = tiny_config(**{"train.epochs": 3, "data.feature_cache_mb": 16, "eval.at_end": "false",
                         "data.source": '"random"', "pipeline.mode": f'"{mode}"'})  # fmt: skip
    records = run_records(cfg, timeout_s=120)
    stats = records[-1]["feature_cache"]
    profiles = [r for r in records if r["event"] == "profile"]
    forwards = sum(p["stages"].get("target.model_forward", {}).get("count", 0) for p in profiles)
    assert stats["samples"] == 32
    assert (stats["misses"], stats["hits"]) == (per_epoch, 2 * per_epoch)  # the first epoch's batches miss
    assert forwards == stats["misses"]
    if mode == "serial":
        assert waited == []
