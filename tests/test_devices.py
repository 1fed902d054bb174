"""The device layer's rules, checked on CPU: every cross-stream hand-off goes through
`Device.run(uses=...)` (or `Device.hold` in the optimizer), pinned D2H buffers are reused
only after their last reader, and the sync debug mode is off exactly during named syncs."""

from __future__ import annotations

import asyncio

import torch

from dflash import Coordinator
from dflash.runtime import devices
from dflash.runtime.profiler import Stage


def test_every_hand_off_is_held_by_its_consumer(tiny_config):
    """A pipeline run: pack takes over the target's layer outputs, the D2H copy the packed
    buffer, the optimizer every replica's gradients and sums, metrics.sync the step results.
    (On CPU `hold` only counts; on CUDA the same call is `record_stream`.)"""
    cfg = tiny_config(**{"pipeline.drafter_devices": '["cpu", "cpu"]', "data.num_samples": 16})
    records: list[dict] = []
    coord = Coordinator(cfg, log=False)
    coord.subscribe(records.append)
    asyncio.run(coord.run())
    start = next(r for r in records if r["event"] == "setup")
    layers = len(start["target_layers"])
    held = {d.name: d.held for d in coord._topology.devices}
    batches = held["target0"][Stage.TARGET_D2H]
    assert batches >= 2
    assert held["target0"][Stage.TARGET_PACK] == layers * batches
    steps = coord.steps
    assert steps >= 1
    # every parameter's gradient of both replicas, plus each contribution's two sums
    assert held["optimizer"][Stage.GRAD_REDUCE] >= steps * 2 * 3
    assert held["optimizer"][Stage.METRICS_SYNC] == 3 * steps  # loss, grad norm, per-slot correct


class _Event:
    def __init__(self, done: bool) -> None:
        self.done = done
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True


def test_pinned_pool_reuses_a_buffer_only_after_its_reader():
    """A pinned buffer goes back to the pool with the event of its last reader and is handed
    out again only after waiting for it; with every buffer out a one-off is made, and a
    buffer too small for the next request is replaced."""
    made: list[int] = []

    def alloc(n: int) -> torch.Tensor:
        made.append(n)
        return torch.empty(n, dtype=torch.uint8)

    pool = devices.PinnedPool(2, alloc)
    shape = torch.Size([2, 3, 4])
    a, release_a = pool.take(shape, torch.bfloat16)
    assert a.shape == shape and a.dtype == torch.bfloat16 and made == [48]
    _b, release_b = pool.take(torch.Size([2, 3]), torch.float32)
    assert pool.made == 2
    _c, _ = pool.take(shape, torch.bfloat16)  # both out: a one-off buffer, not pooled
    assert pool.extra == 1 and len(made) == 3
    pending = _Event(done=False)
    release_a(pending)
    a2, _ = pool.take(torch.Size([2, 3]), torch.bfloat16)  # smaller: fits in a's buffer
    assert pending.waited, "reused before its last upload was done"
    assert a2.data_ptr() == a.data_ptr() and pool.reused == 1 and len(made) == 3
    release_b(None)
    big, _ = pool.take(torch.Size([64]), torch.float32)  # b's buffer is too small: replaced
    assert len(made) == 4 and made[-1] == 256 and pool.made == 2
    assert big.numel() == 64


def test_sync_debug_is_off_exactly_inside_named_syncs(monkeypatch):
    """With the sync debug mode on, a named sync lifts it ("default") and restores "error" on
    leaving, nested ones leave it alone; with the mode off, named syncs change nothing."""
    modes: list[str] = []
    monkeypatch.setattr(devices, "_set_mode", modes.append)
    devices.set_sync_debug(True)
    assert modes == ["error"]
    with devices.named_sync():
        assert modes[-1] == "default"
        with devices.named_sync():  # nested (another thread's named sync): no change
            pass
        assert modes[-1] == "default"
    assert modes[-1] == "error"
    devices.set_sync_debug(False)
    assert modes[-1] == "default"
    n = len(modes)
    with devices.named_sync():  # debug mode off: named syncs touch nothing
        pass
    assert len(modes) == n


def test_host_sync_is_named_and_an_event_wait_leaves_the_check_armed(monkeypatch):
    """`host_sync` (a blocking copy, which torch's sync debug mode flags) lifts the mode while
    it copies; waiting for an event (which the mode does not flag) leaves it armed for the
    other threads."""
    modes: list[str] = []
    monkeypatch.setattr(devices, "_set_mode", modes.append)
    devices.set_sync_debug(True)
    try:
        assert devices.host_sync(torch.ones(2)).sum() == 2
        ev = _Event(done=False)
        d = devices.Device("cpu", "t")
        asyncio.run(d.synchronize(ev))
        d.close()
        assert ev.waited
    finally:
        devices.set_sync_debug(False)
    assert modes == ["error", "default", "error", "default"]


def test_upload_leaves_a_tensor_already_there():
    """upload() to the device a tensor is on returns that tensor: no copy."""
    t = torch.arange(4)
    assert devices.upload(t, torch.device("cpu")) is t


def test_multi_gpu_reduce_takes_every_replica_even_without_gradients(monkeypatch):
    """Replicas on distinct GPUs (faked on CPU): torch's reduce gets one input per replica —
    zeros for one that sent nothing (reduce_add needs an input on the destination; a rank
    with no data still all-reduces a whole gradient) — and the result goes back to all."""
    from types import SimpleNamespace

    from dflash.train import reduce as optimizer

    calls: list[int] = []

    class FakeComm:
        @staticmethod
        def reduce_add_coalesced(inputs, destination):  # type: ignore[no-untyped-def]
            calls.append(len(inputs))
            assert len({len(x) for x in inputs}) == 1
            return tuple(sum(ts) for ts in zip(*inputs, strict=True))

        @staticmethod
        def broadcast_coalesced(tensors, devices):  # type: ignore[no-untyped-def]
            return [list(tensors)] + [[t.clone() for t in tensors] for _ in devices[1:]]

    monkeypatch.setattr(optimizer, "comm", FakeComm)
    monkeypatch.setattr(optimizer, "_multi_gpu", lambda replicas: True)
    cpu = torch.device("cpu")
    def replica(i: int) -> SimpleNamespace:
        return SimpleNamespace(index=i, device=cpu, params=[torch.nn.Parameter(torch.zeros(3)) for _ in range(2)])

    reps = [replica(i) for i in range(3)]
    reps[1].params[0].grad = torch.ones(3)
    reps[2].params[1].grad = torch.full((3,), 2.0)
    got = optimizer._reduced(reps, {1, 2}, torch.device("cpu"))  # replica 0 sent nothing
    assert calls == [3] and torch.equal(got[0], torch.ones(3)) and torch.equal(got[1], torch.full((3,), 2.0))
    none = optimizer._reduced(reps, set(), torch.device("cpu"))  # no replica of this rank has data
    assert len(none) == 2 and all(torch.equal(g, torch.zeros(3)) for g in none)
    spread = optimizer._spread(devices.Device("cpu", "optimizer"), reps, got)
    assert len(spread) == 3 and all(torch.equal(s[1], got[1]) for s in spread)
