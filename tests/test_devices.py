"""The device layer's rules, checked on CPU: every cross-stream hand-off goes through
`Device.run(uses=...)` (or `Device.hold` in the optimizer), pinned D2H buffers are reused
only after their last reader, and the sync debug mode is off exactly during named syncs."""

from __future__ import annotations

import asyncio
import time

import pytest
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
    # every parameter's gradient of both replicas, plus each contribution's three sums
    assert held["optimizer"][Stage.GRAD_REDUCE] >= steps * 2 * 4
    assert held["optimizer"][Stage.METRICS_SYNC] == 4 * steps  # loss, grad norm, the loss's parts, per-slot correct


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


def test_the_reduce_sums_the_contributions_and_every_replica_gets_the_sum():
    """`reduce_step` over three CPU replicas, of which replica 0 sent nothing this step (its
    leftover gradient must not count) and replica 2 has a parameter without a gradient: each
    gradient is the sum of the contributions', on the first replica's device, in replica
    order, and Σ w, Σ loss and the per-slot tallies are theirs; every gradient and sum read
    is held for the optimizer (`Device.hold`). With no contribution at all the gradient is
    still whole, zeros (what a rank without data all-reduces). `update_everywhere` hands the
    first replica the sum itself and every other one a copy of it."""
    from dflash.train.reduce import reduce_step, update_everywhere
    from tests import reduce_ranks

    reps = reduce_ranks.replicas(3)
    reduce_ranks.fill_grads(reps[0], 100.0)
    reduce_ranks.fill_grads(reps[1], 1.0)
    reduce_ranks.fill_grads(reps[2], 2.0)
    reps[2].params[0].grad = None
    contribs = [reduce_ranks.contribution(reps[1], 0), reduce_ranks.contribution(reps[2], 1)]
    device = devices.Device("cpu", "optimizer")
    try:
        sums = reduce_step(device, reps, contribs, None)
        held = device.held[Stage.GRAD_REDUCE]
        none = reduce_step(device, reps, [], None)
        got: dict[int, list[torch.Tensor]] = {}
        events = update_everywhere(device, reps, sums.grads, lambda r, g: got.setdefault(r.index, g))
    finally:
        device.close()
    params = reps[0].params
    assert len(sums.grads) == len(params)
    for i, (g, p) in enumerate(zip(sums.grads, params, strict=True)):
        want = reduce_ranks.grad(p, 1.0) + (reduce_ranks.grad(p, 2.0) if i > 0 else 0)
        assert torch.equal(g, want) and g.device == reps[0].device, i
    assert sums.weight == 3.0 + 4.0 and torch.equal(sums.loss, torch.tensor(30.0))
    assert torch.equal(sums.correct, 2 * torch.arange(4.0) + 1) and sums.count.tolist() == [5, 5, 5, 5]
    assert sums.read(torch.tensor(True)) == (True, 7.0) and not sums.ranks
    assert held == len(params) + (2 * len(params) - 1) + 2 * 2  # replica 0's leftovers too, though not summed
    assert len(none.grads) == len(params) and all(not g.any() for g in none.grads)
    assert none.weight == 0 and none.count.tolist() == [0, 0, 0, 0]
    assert events == {} and sorted(got) == [0, 1, 2]
    assert all(a is b for a, b in zip(got[0], sums.grads, strict=True))
    for r in (1, 2):
        assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in zip(got[r], sums.grads, strict=True))


@pytest.mark.slow
def test_a_rank_without_data_still_all_reduces_a_whole_gradient(tmp_path):
    """Two processes in a real gloo group, two CPU replicas each: rank 0's both contribute,
    rank 1 has no data this step (leftover gradients in its replicas). `reduce_step` with the
    `World` gives both ranks the same step: rank 0's gradient sum (in several buckets), the
    global Σ w with the per-slot counts from the step's one host read, Σ loss and tallies."""
    from tests import reduce_ranks
    from tests.conftest import CLI_TIMEOUT_S, forked_context

    init = f"file://{tmp_path / 'store'}"
    procs = [forked_context().Process(target=reduce_ranks.rank_main_reporting, args=(r, 2, init, str(tmp_path)))
             for r in (0, 1)]  # fmt: skip
    deadline = time.monotonic() + CLI_TIMEOUT_S
    try:
        for proc in procs:
            proc.start()
        for proc in procs:  # the timeout is a hang guard only
            proc.join(max(0.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    for r, proc in enumerate(procs):
        err = tmp_path / f"rank{r}.err"
        assert proc.exitcode == 0, f"rank {r}: exit {proc.exitcode}\n" + (err.read_text() if err.exists() else "")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    params = reduce_ranks.replicas(1)[0].params
    for got in ranks:
        assert len(got["grads"]) == len(params)
        for g, p in zip(got["grads"], params, strict=True):
            assert torch.equal(g, reduce_ranks.grad(p, 1.0) + reduce_ranks.grad(p, 2.0))
        assert got["ok"] and got["weight"] == 7.0 and got["count"].tolist() == [5, 5, 5, 5]
        assert got["loss"].item() == 30.0 and torch.equal(got["correct"], 2 * torch.arange(4.0) + 1)
        assert got["scale"].item() == pytest.approx(1 / 7) and got["buckets"] > 1
