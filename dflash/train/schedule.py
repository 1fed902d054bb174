"""What changes over a run's steps, and what ends it: the learning-rate schedule
(`[schedule]`), the noise schedule (`loss.noise_reveal_start` → `loss.noise_reveal_end`), the
time budget (`train.max_minutes`) and the step limits (`StepPlan`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from dflash.config import ScheduleConfig
from dflash.model.loss import LossSpec

__all__ = ["GlobalBatch", "StepPlan", "TimeBudget", "lr_lambda", "lr_schedule", "reveal_prob"]


class TimeBudget:
    """`train.max_minutes`: the share of a training time budget spent, counted from `start()`
    (the first step's start, after setup) in this process. The clock is read once per step
    (`tick`, at the start of the update), so that every replica's schedule, and the stop
    check after the step, see the same reading."""

    _now = staticmethod(time.monotonic)  # tests bring their own clock

    def __init__(self, minutes: float) -> None:
        self.seconds = 60.0 * minutes
        self._t0: float | None = None
        self._frac = 0.0

    def start(self) -> None:
        if self._t0 is None:
            self._t0 = self._now()

    def tick(self) -> float:
        if self._t0 is not None:
            self._frac = min(1.0, (self._now() - self._t0) / self.seconds)
        return self._frac

    def fraction(self) -> float:
        """The share spent at the last `tick`."""
        return self._frac

    @property
    def spent(self) -> bool:
        return self._frac >= 1.0


@dataclass(frozen=True)
class GlobalBatch:
    """Batches per optimizer step, over the whole run: processes × replicas per process ×
    `grad_accum`. Step s reads the global batch indices [s·n, (s+1)·n) of the plan's fixed
    order whatever the three factors are, so a checkpoint resumes on another number of
    processes with the same steps when the product is kept."""

    processes: int = 1
    replicas: int = 1
    grad_accum: int = 1

    @property
    def per_step(self) -> int:
        return self.processes * self.replicas * self.grad_accum

    def __str__(self) -> str:
        p, r = self.processes, self.replicas
        how = f"{p} process{'es' if p != 1 else ''} × {r} replica{'s' if r != 1 else ''} × grad_accum {self.grad_accum}"
        return f"{self.per_step} batches a step ({how})"


@dataclass(frozen=True)
class StepPlan:
    """What one optimizer step takes and what ends training: `grad_accum` micro-batches from
    each replica (`train.grad_accum`), at most `max_steps` steps (`train.max_steps`), and the
    time `budget` (`train.max_minutes`; None: no limit)."""

    grad_accum: int = 1
    max_steps: int | None = None
    budget: TimeBudget | None = None

    def at_max_steps(self, step: int) -> bool:
        return self.max_steps is not None and step >= self.max_steps

    def ended(self, step: int) -> bool:
        """Training ends after `step`: the last planned step is done, or the budget was spent
        at the update's clock reading."""
        return self.at_max_steps(step) or (self.budget is not None and self.budget.spent)


def lr_lambda(
    total_steps: int,
    warmup_ratio: float,
    min_ratio: float,
    kind: str = "cosine",
    decay_ratio: float = 0.2,
    clock: Callable[[], float] | None = None,
) -> Callable[[float], float]:
    """LR factor after `step` optimizer steps: linear warmup, then `cosine` decay to
    `min_ratio` over the rest, or `wsd` (warmup-stable-decay): constant, then a linear decay to
    `min_ratio` over the last `decay_ratio` of the steps. With a `clock` (the share of a time
    budget spent, 0..1) the schedule is at whichever is further along, the steps or the time:
    a run cut by its budget still ends decayed."""
    warmup = max(1, round(total_steps * warmup_ratio)) if warmup_ratio > 0 else 0
    decay = max(1, round(total_steps * decay_ratio))

    def f(step: float) -> float:  # step = number of optimizer steps already taken
        if clock is not None:
            step = max(step, clock() * total_steps)
        if step < warmup:
            return min(1.0, (step + 1) / warmup)
        if kind == "wsd":
            into = step - (total_steps - decay)
            return 1.0 if into <= 0 else max(min_ratio, 1 - (1 - min_ratio) * min(1.0, into / decay))
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def lr_schedule(cfg: ScheduleConfig, total_steps: int, budget: TimeBudget | None = None) -> Callable[[float], float]:
    """The `[schedule]` section's LR factor over `total_steps`, following the time budget's
    clock too when there is one."""
    clock = budget.fraction if budget is not None else None
    return lr_lambda(total_steps, cfg.warmup_ratio, cfg.min_lr_ratio, cfg.kind, cfg.decay_ratio, clock)


def reveal_prob(spec: LossSpec, step: int, total_steps: int) -> float:
    """The noise schedule: the chance a block slot shows its true token at `step`, linear
    from `spec.noise_reveal_start` (step 0) to `spec.noise_reveal_end` (the last step)."""
    frac = min(1.0, step / max(1, total_steps - 1))
    return spec.noise_reveal_start + (spec.noise_reveal_end - spec.noise_reveal_start) * frac
