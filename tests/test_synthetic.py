"""Synthetic stages run through the real coordinator (for the orchestration benchmark)."""

from __future__ import annotations

import asyncio
import time

from dflash import Coordinator
from dflash.synthetic import StageCost, SyntheticSpec, calibrate, work


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
    records: list[dict] = []
    coord = Coordinator(cfg, log=False, synthetic=spec)
    coord.subscribe(records.append)
    asyncio.run(coord.run())
    steps = [r for r in records if r["event"] == "train_step"]
    assert len(steps) == 10 and sum(s["samples"] for s in steps) == 30
    assert records[-1]["event"] == "run_end" and records[-1]["export_dir"] is None
