"""Synthetic stages run through the real coordinator (for the orchestration benchmark)."""

from __future__ import annotations

import asyncio
import time

import torch

from dflash import Coordinator
from dflash.synthetic import SimEvent, StageCost, SyntheticSpec, Timeline, calibrate, work
from tests.conftest import run_records


def test_counted_work_takes_about_the_asked_time():
    """work() spends host_ms in a counted loop and device_ms asleep (within generous bounds)."""
    calibrate()
    t0 = time.perf_counter()
    work(StageCost(host_ms=20, device_ms=20))
    assert 0.03 < time.perf_counter() - t0 < 0.5


def test_synthetic_5_plus_3_topology_runs_every_batch(tiny_config):
    """5 target chains and 3 replicas with synthetic compute: every batch becomes part of a step."""
    cfg = tiny_config(
        **{
            "pipeline.target_devices": '["cpu","cpu","cpu","cpu","cpu"]',
            "pipeline.drafter_devices": '["cpu","cpu","cpu"]',
        }
    )
    spec = SyntheticSpec(StageCost(0.2, 2), StageCost(0.1, 1), StageCost(0.1, 0.5), batches=30)
    records = run_records(cfg, synthetic=spec)
    steps = [r for r in records if r["event"] == "train_step"]
    assert len(steps) == 10 and sum(s["samples"] for s in steps) == 30
    assert records[-1]["event"] == "run_end" and records[-1]["export_dir"] is None


def test_timeline_runs_device_work_in_order_after_its_events():
    """Async model: launch returns at once; work queues behind earlier work and waited-for events."""
    tl = Timeline()
    t0 = time.perf_counter()
    with tl.launching([SimEvent(t0 + 0.05)]):
        work(StageCost(host_ms=0, device_ms=10))
        work(StageCost(host_ms=0, device_ms=10))
    assert time.perf_counter() - t0 < 0.03  # launched, not waited for
    ev = tl.event()
    assert abs(ev.t - (t0 + 0.07)) < 0.01 and not ev.query()
    ev.synchronize()
    assert ev.query() and time.perf_counter() >= t0 + 0.07


def test_synthetic_async_device_model_overlaps_host_and_device(tiny_config):
    """CUDA semantics through the real coordinator: every batch is trained, and a target whose
    host and device parts overlap finishes well under the sum of their times."""
    spec = SyntheticSpec(StageCost(10, 10), StageCost(0.1, 1), StageCost(0.1, 0.5), batches=12, device_model="async")
    records: list[dict] = []
    coord = Coordinator(tiny_config(), log=False, synthetic=spec)
    coord.subscribe(records.append)
    t0 = time.perf_counter()
    asyncio.run(coord.run())
    elapsed = time.perf_counter() - t0
    steps = [r for r in records if r["event"] == "train_step"]
    assert sum(s["samples"] for s in steps) == 12
    assert elapsed < 12 * 0.020  # serial host + device would be 12 × 20 ms at the least


def test_random_data_source_trains_without_generating(tiny_config):
    """data.source = "random": random ids with the loss on the last gen_len tokens, no target
    generation; the run trains on them end to end (the real-size GPU benchmark's data)."""
    from dflash.data.synthetic import random_samples

    cfg = tiny_config(**{"data.source": '"random"', "data.num_samples": 24, "train.max_steps": 3})
    a = random_samples(cfg.data, 100, seed=1, exclude_token=99)
    b = random_samples(cfg.data, 100, seed=1, exclude_token=99)
    assert len(a) == 24 and all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(a, b, strict=True))
    for s in a:
        n = s.input_ids.numel()
        assert int(s.loss_mask.sum()) == cfg.data.gen_len and bool(s.loss_mask[-cfg.data.gen_len :].all())
        assert n - cfg.data.gen_len >= cfg.data.prompt_len // 2 and int(s.input_ids.max()) < 99
    records = run_records(cfg)
    assert records[-1]["event"] == "run_end" and records[-1]["steps"] == 3
