"""Synthetic stages: the real coordinator, channels, devices and profiler, with the compute
replaced by work of known cost — for measuring the orchestration itself.

Each stage does `host_ms` of Python work that holds the GIL (a counted loop, calibrated
once: a spin on the clock would finish on time even while another thread holds the lock,
and hide the GIL limit) and then `device_ms` of device work, in one of two models:

- "sync": the worker thread waits `device_ms` without the GIL (`time.sleep`), as if every
  stage synchronized its device — the pessimistic model: host and device never overlap.
- "async": CUDA semantics. Each device is a `SimDevice`, with a `Timeline`: a simulated
  in-order device queue. The host part runs on the worker thread; the device part is *launched*: it starts
  when the queue and the events it waits for (`wait_for`) are done, and the worker thread
  goes on at once, as after a kernel launch. The stage returns a `SimEvent` as its `ready`
  event; hosts wait only where the real code synchronizes (the D2H copy before the host
  reads, the optimizer's grad-norm sync), so host work overlaps device work as on a GPU.

`prepare(cfg, spec)` gives the config and the `Training` of stand-ins to run with
`Coordinator(cfg, training=t, make_device=device_factory(spec))`: the coordinator, topology, stages and devices are the
production ones and know nothing of this module. Used by `bench/orchestration.py` and its
test.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from dflash.features.cache import FeatureCache
from dflash.model.loss import LossParts, LossSpec
from dflash.runtime.devices import Device, DeviceFactory, host_sync
from dflash.runtime.profiler import Stage
from dflash.train.step import MicroStep

__all__ = [
    "SimDevice", "SimEvent", "StageCost", "SyntheticSpec", "SyntheticStep", "Timeline", "calibrate", "device_factory",
    "prepare", "work",
]  # fmt: skip

_ITERS_PER_MS: float | None = None


def calibrate() -> float:
    """Loop iterations per millisecond of this interpreter (best of a few tries)."""
    global _ITERS_PER_MS
    if _ITERS_PER_MS is None:
        best = 0.0
        for _ in range(5):
            n = 200_000
            t0 = time.perf_counter()
            x = 0
            for i in range(n):
                x += i
            best = max(best, n / ((time.perf_counter() - t0) * 1000))
        _ITERS_PER_MS = best
    return _ITERS_PER_MS


@dataclass(frozen=True)
class StageCost:
    host_ms: float
    device_ms: float


class SimEvent:
    """Marks the end of simulated device work; quacks like `torch.cuda.Event` where the
    coordinator uses one (`query`, `synchronize`)."""

    __slots__ = ("t",)

    def __init__(self, t: float) -> None:
        self.t = t  # perf_counter time at which the device work is done

    def query(self) -> bool:
        return time.perf_counter() >= self.t

    def synchronize(self) -> None:
        wait = self.t - time.perf_counter()
        if wait > 0:
            time.sleep(wait)  # releases the GIL, like cudaEventSynchronize


_local = threading.local()


class Timeline:
    """One simulated device's in-order work queue (used by one worker thread at a time)."""

    def __init__(self) -> None:
        self.busy_until = 0.0
        self._after = 0.0

    @contextlib.contextmanager
    def launching(self, wait_for: Sequence[Any]) -> Iterator[None]:
        """Work launched inside starts after these events (like `stream.wait_event`)."""
        self._after = max((e.t for e in wait_for if isinstance(e, SimEvent)), default=0.0)
        _local.timeline = self
        try:
            yield
        finally:
            _local.timeline = None

    def launch(self, device_ms: float) -> None:
        start = max(time.perf_counter(), self.busy_until, self._after)
        self.busy_until = start + device_ms / 1000

    def event(self) -> SimEvent:
        return SimEvent(self.busy_until)

    def drained(self) -> SimEvent:
        """When the queue is done with what is launched, and with what the current launch
        waits for."""
        return SimEvent(max(self.busy_until, self._after))


def _host(ms: float) -> None:
    x = 0
    for i in range(int(ms * calibrate())):  # holds the GIL: counted, not timed
        x += i


def work(cost: StageCost) -> None:
    """`host_ms` of GIL-holding work, then `device_ms` on the device: waited for here
    (sync model), or launched on the current Timeline (async model: the host waits only
    where the real code syncs, through `host_sync` or `Device.synchronize`)."""
    _host(cost.host_ms)
    timeline: Timeline | None = getattr(_local, "timeline", None)
    if timeline is None:
        if cost.device_ms > 0:
            time.sleep(cost.device_ms / 1000)  # releases the GIL, like waiting on a device
        return
    timeline.launch(cost.device_ms)


@dataclass(frozen=True)
class SyntheticSpec:
    target: StageCost  # per batch, on a target chain (forward + pack)
    drafter: StageCost  # per micro-batch, on a drafter replica (forward + backward)
    optimizer: StageCost  # per optimizer step (reduce, grad norm, step)
    batches: int = 200
    block_size: int = 4
    device_model: Literal["sync", "async"] = "sync"


class SyntheticTarget:
    """Stands in for `Target` in the target_forward stage."""

    def __init__(self, cost: StageCost) -> None:
        self.cost = cost
        self.device = torch.device("cpu")
        self.embed_weight = torch.zeros(1)
        self.dtype_name = "float32"
        self.name = "synthetic"
        self.layer_ids = [0]
        self.teacher_topk = 0  # no distillation

    def of_batch(self, batch: Any, teacher_topk: int = 0) -> tuple[list[torch.Tensor], None]:
        work(self.cost)
        return [torch.zeros(batch.input_ids.shape[0], batch.input_ids.shape[1], 1)], None


@dataclass
class SyntheticReplica:
    """Stands in for `DrafterReplica` (no weights: the optimizer's work is simulated too)."""

    index: int
    device: torch.device
    params: tuple[()] = ()
    seq_group: None = None  # never in a sequence-parallel group
    seq_rank: int = 0


class SimDevice(Device):
    """A CPU `Device` whose work launches on a simulated in-order device queue: the host part
    runs in the worker thread, the device part starts after the events it waits for, and
    the returned `ready` is a `SimEvent` that flows where CUDA events flow."""

    def __init__(self, spec: str, name: str, profiler: Any = None) -> None:
        super().__init__(spec, name, profiler)
        self.timeline = Timeline()

    def _call(
        self,
        stage: str | None,
        fn: Any,
        args: tuple[Any, ...],
        wait_for: Sequence[Any],
        uses: Sequence[Any] = (),
        stream_name: str | None = None,
    ) -> tuple[Any, Any]:
        self.hold(stream_name or stage, uses, None)
        with self.timeline.launching(wait_for), self.span(stage):
            out = fn(*args)
        return out, self.timeline.event()

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """`host_sync` in this worker: wait for the simulated queue (and what it waits on),
        as a blocking device-to-host copy waits for its stream."""
        self.timeline.drained().synchronize()
        return super().to_host(t)


@dataclass(frozen=True)
class SyntheticStep(MicroStep):
    """A micro-step of known cost: prepare hands the features on, compute works `drafter`."""

    cost: StageCost = StageCost(0.0, 0.0)

    def prepare(self, rep: Any, device: Any, feats: Any, step: int) -> Any:
        return feats  # a HostFeatures carries the batch, all that compute and the accumulator read

    def compute(self, rep: Any, device: Any, prepared: Any) -> LossParts:
        with device.span(Stage.DRAFTER_FORWARD):
            work(self.cost)
        B = self.loss.block_size
        return LossParts(torch.zeros(()), 1.0, torch.zeros(B), torch.zeros(B, dtype=torch.long))


def device_factory(spec: SyntheticSpec) -> DeviceFactory:
    """The `Device` the pipeline runs the stand-ins on: `Coordinator(cfg, training=t,
    make_device=device_factory(spec))`."""
    return SimDevice if spec.device_model == "async" else Device


def _apply_step(spec: SyntheticSpec) -> Any:
    from dflash.train.hooks import StepResult

    def apply(contribs: Any, device: Any, step: int, progress: Any) -> StepResult:
        with device.span(Stage.OPTIMIZER_STEP):
            work(spec.optimizer)
        with device.span(Stage.GRAD_NORM_SYNC):  # the real step's one host sync, through the same function
            host_sync(torch.ones(()))
        progress.finish(step, -1, [i for c in contribs for i in c.batches])
        B = spec.block_size
        return StepResult(
            step=step, loss=torch.zeros(()), grad_norm=torch.zeros(()), lr=0.0, correct=torch.zeros(B),
            count=torch.zeros(B, dtype=torch.long), tokens=sum(c.tokens for c in contribs),
            samples=sum(c.samples for c in contribs), weight_sum=1.0,
        )  # fmt: skip

    return apply


def prepare(cfg: Any, spec: SyntheticSpec) -> tuple[Any, Any]:
    """(config, `Training`) of stand-ins for targets, data and replicas; the stages, channels
    and devices that run them are the real ones. Stand-ins have no weights: the config
    asks for no checkpoint, export or eval."""
    from dflash.data.batching import BatchPlan, Sample
    from dflash.model.drafter import DrafterSpec
    from dflash.train.build import Training
    from dflash.train.schedule import StepPlan

    targets = [SyntheticTarget(spec.target) for _ in cfg.pipeline.target_devices]
    replicas = [SyntheticReplica(i, torch.device("cpu")) for i in range(len(cfg.pipeline.drafter_devices))]
    ids, mask = torch.zeros(8, dtype=torch.long), torch.ones(8, dtype=torch.bool)
    samples = [Sample(i, ids, mask) for i in range(spec.batches)]
    dspec = DrafterSpec(
        hidden_size=1, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2, intermediate_size=1, vocab_size=1,
        rms_norm_eps=1e-6, rope_theta=1.0, target_layer_ids=[0], num_target_layers=1,
        block_size=spec.block_size, mask_token_id=0, layer_types=["full_attention"], sliding_window=1,
    )  # fmt: skip
    micro = SyntheticStep(LossSpec(block_size=spec.block_size), cfg.run.seed, cost=spec.drafter)

    off = {
        "checkpoint": cfg.checkpoint.model_copy(update={"at_end": False, "every_steps": 0, "export_final": False}),
        "eval": cfg.eval.model_copy(update={"at_end": False, "every_steps": 0}),
    }
    return cfg.model_copy(update=off), Training(
        targets=targets,  # type: ignore[arg-type]
        replicas=replicas,  # type: ignore[arg-type]
        plan=BatchPlan(samples, 1, 1, cfg.run.seed, False),
        spec=dspec,
        micro=micro,
        apply=_apply_step(spec),
        steps=StepPlan(cfg.train.fresh_grad_accum, cfg.train.max_steps),
        total_steps=-(-spec.batches // len(replicas)),
        padding_fraction=0.0,
        cache=FeatureCache.from_config(cfg.data.feature_cache_mb),
    )
