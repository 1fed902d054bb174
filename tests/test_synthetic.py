"""Synthetic stages run through the real coordinator (for the orchestration benchmark)."""

from __future__ import annotations

import time

import pytest
import simulated
import torch
from simulated import SimEvent, StageCost, SyntheticSpec, Timeline, calibrate, work

from tests.conftest import run_records


class FakeTime:
    """Stands in for the `time` module inside simulated: the clock moves only by
    `sleep` (which records what was slept) or when a test moves it."""

    def __init__(self) -> None:
        self.t = 1000.0
        self.sleeps: list[float] = []

    def perf_counter(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s


@pytest.fixture
def fake_time(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    # A known loop rate instead of calibrate()'s, which measures real time: host_ms is a
    # known number of iterations.
    monkeypatch.setattr(simulated, "_ITERS_PER_MS", 2000.0)
    assert calibrate() == 2000.0
    fake = FakeTime()
    monkeypatch.setattr(simulated, "time", fake)
    return fake


def test_device_part_sleeps_and_host_part_burns_this_threads_cpu(fake_time: FakeTime):
    """Without a Timeline, work() sleeps device_ms (one sleep, GIL released) and spends
    host_ms in a counted loop on this thread's CPU, in proportion to host_ms (calibrated
    iterations per ms): CPU time, not wall time, so other work on a busy machine does not
    inflate it."""
    work(StageCost(host_ms=0, device_ms=20))
    assert fake_time.sleeps == [pytest.approx(0.020)]
    cpu = []
    for host_ms in (20, 80):
        c0 = time.thread_time()
        work(StageCost(host_ms=host_ms, device_ms=0))
        cpu.append(time.thread_time() - c0)
    assert fake_time.sleeps == [pytest.approx(0.020)]  # no device part, no sleep
    assert fake_time.t == 1000.0 + 0.020  # nor any other wait
    assert cpu[1] > 2 * cpu[0] > 0  # this thread works, 4x the asked time 4x as much (2x at the least)


def test_timeline_runs_device_work_in_order_after_its_events(fake_time: FakeTime):
    """Async model: launch returns at once; work queues behind earlier work and the events
    it waits for; a synchronize waits until the work is done."""
    tl = Timeline()
    t0 = fake_time.t
    with tl.launching([SimEvent(t0 + 0.05)]):
        work(StageCost(host_ms=0, device_ms=10))
        work(StageCost(host_ms=0, device_ms=10))
    assert fake_time.sleeps == []  # launched, not waited for
    ev = tl.event()
    assert ev.t == pytest.approx(t0 + 0.07) and not ev.query()  # after the event, then in order
    ev.synchronize()
    assert fake_time.sleeps == [pytest.approx(0.07)] and ev.query()
    fake_time.t += 1.0  # the device idles: new work starts now, not where the queue ended
    with tl.launching([]):
        work(StageCost(host_ms=0, device_ms=10))
        tl.drained().synchronize()  # what host_sync does on a SimDevice: waits for its own work
    assert fake_time.sleeps[1:] == [pytest.approx(0.01)] and tl.event().t == pytest.approx(t0 + 1.08)


def test_sim_device_syncs_where_host_sync_is_called(fake_time: FakeTime):
    """The simulated device waits exactly where the real code syncs: `host_sync` in its worker
    thread waits for its queue, and for the events the current launch waits on."""
    import asyncio

    from simulated import SimDevice

    from dflash.runtime.devices import host_sync

    dev = SimDevice("cpu", "sim")
    t0 = fake_time.t

    def launch_then_read() -> float:
        work(StageCost(host_ms=0, device_ms=30))
        host_sync(torch.ones(()))
        return fake_time.t

    def launch_only() -> None:
        work(StageCost(host_ms=0, device_ms=30))

    async def main() -> None:
        await dev.run(None, launch_only)
        assert fake_time.sleeps == []  # launched, nobody read: no wait
        after, _ = await dev.run(None, launch_then_read, wait_for=[SimEvent(t0 + 0.5)])
        assert after == pytest.approx(t0 + 0.5 + 0.03)  # waits for the event, then its own work

    try:
        asyncio.run(main())
    finally:
        dev.close()


def test_synthetic_5_plus_3_topology_runs_every_batch(tiny_config):
    """5 target chains and 3 replicas with synthetic compute: every batch becomes part of a step."""
    cfg = tiny_config(
        **{
            "pipeline.target_devices": '["cpu","cpu","cpu","cpu","cpu"]',
            "pipeline.drafter_devices": '["cpu","cpu","cpu"]',
        }
    )
    spec = SyntheticSpec(StageCost(0.2, 2), StageCost(0.1, 1), StageCost(0.1, 0.5), batches=30)
    cfg, training = simulated.prepare(cfg, spec)
    records = run_records(cfg, training=training, make_device=simulated.device_factory(spec))
    steps = [r for r in records if r["event"] == "train_step"]
    assert len(steps) == 10 and sum(s["samples"] for s in steps) == 30
    assert records[-1]["event"] == "run_end" and records[-1]["export_dir"] is None


def test_synthetic_async_device_model_overlaps_host_and_device(tiny_config, monkeypatch):
    """CUDA semantics through the real coordinator: every batch is trained, and the target
    does the host work of its next batch while the device still runs the previous one: at
    some launch the target's simulated device queue is still busy (a host that waited for
    its device after every batch would always find it idle)."""
    backlog: list[float] = []
    launch = Timeline.launch

    def observed(self: Timeline, device_ms: float) -> None:
        if device_ms == 50:  # the target's device work (the other stages' is 1 ms or less)
            backlog.append(self.busy_until - time.perf_counter())
        launch(self, device_ms)

    monkeypatch.setattr(Timeline, "launch", observed)
    spec = SyntheticSpec(StageCost(1, 50), StageCost(0.1, 1), StageCost(0.1, 0.5), batches=12, device_model="async")
    cfg, training = simulated.prepare(tiny_config(), spec)
    records = run_records(cfg, training=training, make_device=simulated.device_factory(spec))
    steps = [r for r in records if r["event"] == "train_step"]
    assert sum(s["samples"] for s in steps) == 12
    assert len(backlog) == 12 and any(b > 0 for b in backlog), backlog


def test_random_data_source_trains_without_generating(tiny_config):
    """data.source = "random": random ids with the loss on the last gen_len tokens, no target
    generation; the run trains on them end to end (the real-size GPU benchmark's data)."""
    from dflash.data.synthetic import random_samples

    cfg = tiny_config(
        **{
            "data.source": '"random"',
            "data.num_samples": 24,
            "train.max_steps": 3,
            "eval.num_prompts": 1,
            "eval.max_new_tokens": 8,
        }
    )  # a short end-of-run eval
    a = random_samples(cfg.data, 100, seed=1, exclude_token=99)
    b = random_samples(cfg.data, 100, seed=1, exclude_token=99)
    assert len(a) == 24 and all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(a, b, strict=True))
    for s in a:
        n = s.input_ids.numel()
        assert int(s.loss_mask.sum()) == cfg.data.gen_len and bool(s.loss_mask[-cfg.data.gen_len :].all())
        assert n - cfg.data.gen_len >= cfg.data.prompt_len // 2 and int(s.input_ids.max()) < 99
    records = run_records(cfg)
    assert records[-1]["event"] == "run_end" and records[-1]["steps"] == 3
