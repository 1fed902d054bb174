"""Synthetic stages: the real coordinator, channels, devices and profiler, with the compute
replaced by work of known cost — for measuring the orchestration itself.

Each stage does `host_ms` of Python work that holds the GIL (a counted loop, calibrated
once: a spin on the clock would finish on time even while another thread holds the lock,
and hide the GIL limit) and then `device_ms` of waiting without the GIL (`time.sleep`,
like a thread waiting on a GPU). Used by `bench/orchestration.py` and its test.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from dflash.model.loss import LossParts
from dflash.profile import Stage

__all__ = ["StageCost", "SyntheticSpec", "calibrate", "work"]

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


def work(cost: StageCost) -> None:
    x = 0
    for i in range(int(cost.host_ms * calibrate())):  # holds the GIL: counted, not timed
        x += i
    if cost.device_ms > 0:
        time.sleep(cost.device_ms / 1000)  # releases the GIL, like waiting on a device


@dataclass(frozen=True)
class SyntheticSpec:
    target: StageCost  # per batch, on a target chain (forward + pack)
    drafter: StageCost  # per micro-batch, on a drafter replica (forward + backward)
    optimizer: StageCost  # per optimizer step (reduce, grad norm, step)
    batches: int = 200
    block_size: int = 4


class SyntheticTarget:
    """Stands in for `Target` in the target_forward stage."""

    def __init__(self, cost: StageCost) -> None:
        self.cost = cost
        self.device = torch.device("cpu")
        self.embed_weight = torch.zeros(1)
        self.name = "synthetic"
        self.layer_ids = [0]

    def capture(self, ids: torch.Tensor, docs: torch.Tensor, pos: torch.Tensor) -> list[torch.Tensor]:
        work(self.cost)
        return [torch.zeros(ids.shape[0], ids.shape[1], 1)]


@dataclass
class SyntheticReplica:
    """Stands in for `DrafterReplica` (no weights: the optimizer's work is simulated too)."""

    index: int
    device: torch.device


def drafter_step(spec: SyntheticSpec) -> Any:
    def step(rep: Any, device: Any, feats: Any, **_: Any) -> LossParts:
        with device.span(Stage.DRAFTER_FORWARD):
            work(spec.drafter)
        B = spec.block_size
        return LossParts(torch.zeros(()), 1.0, torch.zeros(B), torch.zeros(B, dtype=torch.long))

    return step


def apply_step(spec: SyntheticSpec) -> Any:
    from dflash.stages.optimizer import StepResult

    def apply(replicas: Any, contribs: Any, device: Any, grad_clip: float, step: int) -> StepResult:
        with device.span(Stage.OPTIMIZER_STEP):
            work(spec.optimizer)
        B = spec.block_size
        return StepResult(
            step=step, loss=torch.zeros(()), grad_norm=torch.zeros(()), lr=0.0, correct=torch.zeros(B),
            count=torch.zeros(B, dtype=torch.long), tokens=sum(c.tokens for c in contribs),
            samples=sum(c.samples for c in contribs), weight_sum=1.0,
        )  # fmt: skip

    return apply
