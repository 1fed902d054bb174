"""The stream checker (dflash/runtime/checked.py) over the real stage code: it passes the code as
it is, and fails, naming the stage and the tensor, when any one `wait_for` or `hold` of pack,
transfer, drafter, optimizer or metrics is taken away.

Two topologies cover the CUDA-only paths: one virtual GPU for the target and the replica
(features stay on the device: pack → drafter by event), and the target on GPU 0 with replicas
on GPUs 0 and 1 (copies to pinned host buffers from the pool, the optimizer's own stream on
GPU 1, the event of the update there)."""

from __future__ import annotations

import pytest
import torch
from checked_run import checked_run

from dflash.errors import StageError
from dflash.runtime import devices
from dflash.runtime.checked import CheckedDevice, Rules, VStream

ONE_GPU = (0,)
TWO_GPUS = (0, 1)


# The pipeline's stages on a GPU (dflash/stages/), each as the work the checker sees run (a stage's name, or
# the function a stage runs when that times its own parts). Prefetch runs on the host: it
# collates into pinned memory and the target forward's stream uploads it.
CARD = {
    "target forward": "target.model_forward",
    "pack": "target.pack_hidden",
    "D2H copy": "target.d2h_copy",
    "drafter prepare (H2D)": "MicroStep.prepare",
    "drafter forward/backward": "Accumulator.compute",
    "grad norm / optimizer": "apply_step",
}


def stage_streams(rules: Rules) -> dict[str, set[str]]:
    """Per pipeline stage, the streams its work ran on."""
    return {stage: {s for s, work in rules.work_on.items() if w in work} for stage, w in CARD.items()}


def shared_streams(rules: Rules) -> list[str]:
    """Every stream on which the work of two pipeline stages ran."""
    return sorted(s for s, work in rules.work_on.items() if len(work & set(CARD.values())) > 1)


EXPECTED = {
    ONE_GPU: {  # features stay on the GPU: no D2H copy
        "target forward": {"target0/target.model_forward@gpu0"},
        "pack": {"target0/target.pack_hidden@gpu0"},
        "D2H copy": set(),
        "drafter prepare (H2D)": {"drafter0/drafter.prepare@gpu0"},
        "drafter forward/backward": {"drafter0/drafter.forward@gpu0"},
        "grad norm / optimizer": {"optimizer/drafter.optimizer_step@gpu0"},
    },
    TWO_GPUS: {
        "target forward": {"target0/target.model_forward@gpu0"},
        "pack": {"target0/target.pack_hidden@gpu0"},
        "D2H copy": {"target0/target.d2h_copy@gpu0"},
        "drafter prepare (H2D)": {"drafter0/drafter.prepare@gpu0", "drafter1/drafter.prepare@gpu1"},
        "drafter forward/backward": {"drafter0/drafter.forward@gpu0", "drafter1/drafter.forward@gpu1"},
        "grad norm / optimizer": {"optimizer/drafter.optimizer_step@gpu0"},
    },
}


@pytest.mark.parametrize("gpus", [ONE_GPU, TWO_GPUS], ids=["one_gpu", "two_gpus"])
def test_the_real_code_keeps_every_rule_each_stage_on_its_own_stream(tiny_config, gpus):
    records, rules = checked_run(tiny_config, gpus)
    steps = [r for r in records if r["event"] == "train_step"]
    assert len(steps) == 4 and all(r["loss"] is not None for r in steps)
    assert rules.ops > 1000  # the work ran on virtual GPUs, op by op
    assert stage_streams(rules) == EXPECTED[gpus]
    assert shared_streams(rules) == []
    if gpus == TWO_GPUS:  # the optimizer's own stream on the second GPU, for that replica's update
        assert "optimizer/drafter.optimizer_step@gpu1" in rules.stream_names


def test_prepare_ahead_prepares_on_its_own_stream_while_the_optimizer_steps(tiny_config):
    """With `prepare_ahead` the next batch's uploads go on the prepare stream, apart from the
    forward/backward, and every rule still holds."""
    records, rules = checked_run(tiny_config, ONE_GPU, **{"pipeline.prepare_ahead": "true"})
    assert len([r for r in records if r["event"] == "train_step"]) == 4
    assert stage_streams(rules) == EXPECTED[ONE_GPU] and shared_streams(rules) == []


def test_two_stages_on_one_stream_are_caught(tiny_config, monkeypatch):
    """The check can fail: prepare sent to the forward's stream is reported as shared."""
    from dflash.runtime.profiler import Stage

    monkeypatch.setattr(Stage, "DRAFTER_PREPARE", Stage.DRAFTER_FORWARD)
    _, rules = checked_run(tiny_config, ONE_GPU)
    assert shared_streams(rules) == ["drafter0/drafter.forward@gpu0"]


# (topology, work whose wait or hold is dropped, "wait_for" (all, or "@" only on some streams) | "hold",
# what the failure names). Target labels: prepare reads the target's top-k on the device.
MUTATIONS = [
    (ONE_GPU, "target.pack_hidden", "wait_for", "unordered read: aten.cat.default on target0/target.pack_hidden"),
    (ONE_GPU, "target.pack_hidden", "hold", "no hold: aten.cat.default on target0/target.pack_hidden"),
    (ONE_GPU, "MicroStep.prepare", "wait_for", "last written on target0/target.model_forward@gpu0, not waited for"),
    (ONE_GPU, "MicroStep.prepare", "hold", "allocated on target0/target.model_forward@gpu0 without Device.hold"),
    (ONE_GPU, "Accumulator.compute", "hold", "allocated on drafter0/drafter.prepare@gpu0 without Device.hold"),
    (ONE_GPU, "Accumulator.compute", "wait_for@prepare", "last written on drafter0/drafter.prepare@gpu0, not waited"),
    (ONE_GPU, "Accumulator.compute", "wait_for@optimizer", "written on optimizer/drafter.optimizer_step@gpu0, not"),
    (ONE_GPU, "apply_step", "wait_for", "last written on drafter0/drafter.forward@gpu0, not waited for"),
    (ONE_GPU, "drafter.grad_reduce", "hold", "allocated on drafter0/drafter.forward@gpu0 without Device.hold"),
    (ONE_GPU, "metrics.sync", "wait_for", "optimizer metrics.sync: unordered read"),
    (ONE_GPU, "metrics.sync", "hold", "optimizer metrics.sync: no hold"),
    (TWO_GPUS, "target.d2h_copy", "wait_for", "target0 target.d2h_copy: unordered read"),
    (TWO_GPUS, "target.d2h_copy", "hold", "target0 target.d2h_copy: no hold"),
    (TWO_GPUS, "drafter.optimizer_step", "wait_for", "last written on drafter1/drafter.forward@gpu1, not waited for"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("gpus", "work", "kind", "named"), MUTATIONS, ids=[f"{len(m[0])}gpu-{m[1]}-{m[2]}" for m in MUTATIONS]
)
def test_a_removed_wait_or_hold_fails_naming_stage_and_tensor(tiny_config, gpus, work, kind, named):
    labels = {"loss.labels": '"target"'} if work == "MicroStep.prepare" else {}
    with pytest.raises(StageError) as err:
        checked_run(tiny_config, gpus, drop={(work, kind)}, **labels)
    msg = str(err.value)
    assert "CudaRuleError" in msg and named in msg, msg
    assert "float32[" in msg or "int64[" in msg  # the tensor: its dtype and shape


@pytest.mark.slow
def test_a_pinned_buffer_reused_before_its_upload_is_done_fails(tiny_config, monkeypatch):
    """The pool hands a D2H buffer out again only after the event of its last upload; a
    release without that event lets the next copy overwrite what a replica still reads."""
    take = devices.PinnedPool.take

    def careless(self, shape, dtype):  # type: ignore[no-untyped-def]
        buf, release = take(self, shape, dtype)
        return buf, lambda ready: release(None)

    monkeypatch.setattr(devices.PinnedPool, "take", careless)
    with pytest.raises(StageError) as err:
        checked_run(tiny_config, TWO_GPUS)
    assert "unordered write: aten.copy_.default on target0/target.d2h_copy@gpu0" in str(err.value)
    assert "may still read" in str(err.value)


@pytest.mark.slow
def test_reading_a_host_buffer_before_its_copy_lands_fails(tiny_config, monkeypatch):
    """Without the transfer stage's wait for its D2H event, the drafters' upload reads a pinned
    buffer whose copy may still be in flight."""

    async def no_wait(self, ready):  # type: ignore[no-untyped-def]
        return None

    monkeypatch.setattr(CheckedDevice, "synchronize", no_wait)
    with pytest.raises(StageError) as err:
        checked_run(tiny_config, TWO_GPUS)
    assert "last written on target0/target.d2h_copy@gpu0, not waited for" in str(err.value)


def test_vector_clocks_fold_as_cuda_events_do():
    """The model's core: an event records a stream's clock; a stream that waits on it (or is
    launched after the host waited on it) is ordered after everything before the record."""
    rules = Rules()
    a, b = VStream("a", 0), VStream("b", 0)
    rules.launch(a, [])
    ev = rules.record(a)
    assert not ev.query()  # the host has not waited: the model never finishes work by itself
    rules.launch(b, [])
    assert b.clock.get("a", 0) < ev.clock["a"]
    b.wait_event(ev)
    assert b.clock["a"] >= ev.clock["a"]
    ev.synchronize()
    assert ev.query()
    c = VStream("c", 0)
    rules.launch(c, [])  # launched after the host waited: ordered without an event
    assert c.clock["a"] >= ev.clock["a"]


def test_places_follow_tensors_not_their_addresses():
    """A freed device tensor's memory reused by a host tensor is not taken for the old one."""
    rules = Rules()
    t = torch.ones(1024)
    rules.place([t], 0)
    assert rules.where(t) == 0
    ptr = t.untyped_storage().data_ptr()
    del t
    u = torch.zeros(1024)
    assert u.untyped_storage().data_ptr() != ptr or rules.where(u) is None
    assert rules.where(u) is None
