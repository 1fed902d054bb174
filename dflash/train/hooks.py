"""What happens around each optimizer step, the same in the pipeline and in the serial loop.

`StepBook` is the one place that keeps where training stands (`Progress`: the last step
applied, the data cursor, and whether an update is in progress), counts non-finite steps,
turns step results into `train_step` records (one host sync per `log_every` steps,
`metrics.sync`), and calls the step hooks between steps — eval and checkpoints are hooks,
not arguments of the optimizer stage. Hooks run while every replica waits for the step's
reply, so they read settled weights; their device work goes through the optimizer's
`Device` and waits on the step's `ready` event.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from dflash.eval.decode import EvalStopped
from dflash.runtime.devices import Device, host_sync, named_sync, set_sync_debug
from dflash.runtime.profiler import Profiler, Stage

__all__ = ["EvalHook", "Progress", "StepBook", "StepContext", "StepHook", "StepResult", "SyncDebugHook", "to_records"]

Record = dict[str, Any]
R = TypeVar("R")


@dataclass
class StepResult:
    step: int
    loss: torch.Tensor  # () device
    grad_norm: torch.Tensor  # () device
    lr: float
    correct: torch.Tensor  # (B,) device
    count: torch.Tensor  # (B,) host
    tokens: int
    samples: int
    weight_sum: float
    skipped: bool = False  # non-finite loss or gradient: nothing was updated
    parts: torch.Tensor | None = None  # (3,) device: the loss's CE, distillation and family-term parts
    updated: dict[int, Any] = field(default_factory=dict)  # replica on another GPU -> event of its update


@dataclass
class Progress:
    """Where training stands. After a crash the emergency checkpoint trusts it only when no
    update was in progress (a half-applied update leaves weights and optimizer apart)."""

    step: int  # last optimizer step finished (applied, or skipped as non-finite)
    last_batch: int = -1  # every batch up to this index was consumed by steps up to `step`
    ahead: frozenset[int] = frozenset()  # and these after it (drafters take batches as they arrive)
    updating: bool = False  # set by apply_step before it changes any state, cleared when it is done
    ready: Any = None  # CUDA event: the update of `step` is done

    def finish(self, step: int, last_batch: int, consumed: Iterable[int] = ()) -> None:
        """Step `step` is done (applied or skipped): weights, optimizer state and data cursor
        agree again. `last_batch`: every batch up to it is done (several processes: the
        world's cursor); `consumed`: the step's batches, in any order — the cursor moves over
        those that close the gap after it, the others wait in `ahead`. Called by the update
        itself, in its worker thread, so that a run cancelled right after it still knows
        where it stands."""
        mark = max(self.last_batch, last_batch)
        ahead = set(self.ahead).union(consumed)
        while mark + 1 in ahead:
            mark += 1
        after = frozenset(i for i in ahead if i > mark)
        self.step, self.last_batch, self.ahead, self.updating = step, mark, after, False  # one statement


@dataclass(frozen=True)
class StepContext:
    step: int
    last_batch: int
    ready: Any  # CUDA event: the step's update is done (None on CPU)
    device: Device  # the optimizer's device: hooks run their work through it
    ahead: frozenset[int] = frozenset()  # batches after `last_batch` consumed already

    async def read(self, stage: str | None, fn: Callable[..., R], *args: Any) -> R:
        """Hook work that reads the device on purpose (eval, a checkpoint's copy, a checksum):
        in the optimizer's worker after the step's update, inside a named sync — only there:
        while a hook awaits, the sync check stays armed for every other stage."""

        def named() -> R:
            with named_sync(), self.device.span(stage):
                return fn(*args)

        # On the optimizer's own stream, in order after the update: it may read any state the
        # update made (AdamW's moments) with no hand-off to another stream.
        out, _ = await self.device.run(None, named, wait_for=[self.ready], stream=Stage.OPTIMIZER_STEP)
        return out


class StepHook(Protocol):
    async def after_step(self, ctx: StepContext) -> None: ...

    async def at_end(self, ctx: StepContext) -> None: ...


def to_records(results: list[StepResult]) -> list[Record]:
    """One host sync for a batch of steps: every metric comes over together. Non-finite
    values become null (JSON has no NaN; `jq` must always parse the log)."""
    if not results:
        return []
    def parts_of(r: StepResult) -> torch.Tensor:
        return r.parts.float() if r.parts is not None else torch.full((3,), math.nan, device=r.loss.device)

    rows = [torch.cat([r.loss.float()[None], r.grad_norm.float()[None], parts_of(r), r.correct.float()])
            for r in results]  # fmt: skip
    packed = host_sync(torch.stack(rows))  # once per log interval (metrics.sync)
    out = []
    for r, row in zip(results, packed.tolist(), strict=True):  # no-sync: a host tensor now
        loss, gnorm, parts, correct = row[0], row[1], row[2:5], row[5:]
        count = r.count.tolist()  # no-sync: counted on the host
        first = 0 if count[0] else 1  # slot 0 drafts only in DSpark (the anchor's next token)
        acc = [c / n if n else 0.0 for c, n in zip(correct[first:], count[first:], strict=True)]
        tau, run = 1.0, 1.0
        for a in acc:
            run *= a
            tau += run
        out.append(
            {
                "step": r.step,
                "loss": round(loss, 6) if math.isfinite(loss) else None,
                "lr": r.lr,
                "grad_norm": round(gnorm, 6) if math.isfinite(gnorm) else None,
                "skipped": r.skipped,
                "tokens": r.tokens,
                "samples": r.samples,
                "acc": [round(a, 4) for a in acc],
                "tau_sim": round(tau, 4),
            }
        )
        if r.parts is not None and all(map(math.isfinite, [loss, *parts])):  # CE always; the others where they apply
            named = zip(("ce", "distill", "family"), parts, strict=True)
            out[-1]["loss_parts"] = {k: round(v, 6) for i, (k, v) in enumerate(named) if i == 0 or v != 0.0}
    return out


class StepBook:
    """Bookkeeping between optimizer steps: `next_step` and `progress` go to the update,
    `end()` after it, `close()` once at the end of training (last metrics, hooks' `at_end`)."""

    def __init__(
        self,
        device: Device,
        profiler: Profiler,
        emit: Callable[..., None],
        *,
        start_step: int,
        start_batch: int = 0,
        done_ahead: Iterable[int] = (),
        log_every: int,
        max_bad_steps: int,
        hooks: Sequence[StepHook] = (),
    ) -> None:
        self.device = device
        self.profiler = profiler
        self.emit = emit
        self.log_every = log_every
        self.max_bad_steps = max_bad_steps
        self.hooks = list(hooks)
        self.progress = Progress(start_step, start_batch - 1, frozenset(done_ahead))  # a resumed run's cursor
        self._warm_at = start_step + 2  # profile windows before the second step are warm-up
        self.tokens = 0  # tokens of the steps reported so far
        self.last: Record | None = None  # the last train_step record
        self._pending: list[StepResult] = []
        self._bad = 0  # consecutive skipped steps
        self._t_flush = time.perf_counter()  # tokens/s over the interval since the last records

    @property
    def next_step(self) -> int:
        return self.progress.step + 1

    async def end(self, result: StepResult, ready: Any) -> None:
        """The update of `result.step` is done (or skipped; it advanced `progress` itself):
        record it, run the hooks."""
        self.progress.ready = ready
        self._pending.append(result)
        if result.skipped:
            self._bad += 1
            self.emit("bad_step", step=result.step, consecutive=self._bad)
            if self._bad >= self.max_bad_steps:
                msg = (
                    f"{self._bad} optimizer steps in a row had a non-finite loss or gradient "
                    f"(train.max_bad_steps = {self.max_bad_steps}); lower optimizer.lr or check the data"
                )
                raise FloatingPointError(msg)
        else:
            self._bad = 0
        self.profiler.count("steps", 1)
        self.profiler.count("samples", result.samples)
        if result.step == self._warm_at:
            self.profiler.mark_warm()
        if len(self._pending) >= self.log_every:
            await self._flush()
        for hook in self.hooks:  # their device reads are named (`StepContext.read`)
            await hook.after_step(self._context())

    async def close(self) -> None:
        if self._pending:
            await self._flush()
        for hook in self.hooks:
            await hook.at_end(self._context())

    def _context(self) -> StepContext:
        p = self.progress
        return StepContext(p.step, p.last_batch, p.ready, self.device, p.ahead)

    async def _flush(self) -> None:
        results, ready = list(self._pending), self.progress.ready
        uses = [t for r in results for t in (r.loss, r.grad_norm, r.correct, r.parts) if isinstance(t, torch.Tensor)]
        records, _ = await self.device.run(Stage.METRICS_SYNC, to_records, results, wait_for=[ready], uses=uses)
        self._pending.clear()
        now = time.perf_counter()
        rate = round(sum(r["tokens"] for r in records) / max(now - self._t_flush, 1e-9), 1)
        self._t_flush = now
        for r in records:
            self.tokens += r["tokens"]
            self.last = r
            self.emit("train_step", **r, tokens_per_s=rate)


class SyncDebugHook:
    """`pipeline.sync_debug`: from step `start` on (compiles and warm-up done), a host sync
    outside the named ones fails the run in the stage that made it (CUDA only)."""

    def __init__(self, start: int) -> None:
        self.start = start

    async def after_step(self, ctx: StepContext) -> None:
        if ctx.step >= self.start:
            set_sync_debug(True)

    async def at_end(self, ctx: StepContext) -> None:
        set_sync_debug(False)


class EvalHook:
    """Speculative-decoding eval every `every` steps (`eval.every_steps`), between steps. A stop
    (`should_stop()` true) ends one in progress at its next decoding step, with a warning record."""

    def __init__(
        self,
        every: int,
        evaluate: Callable[..., Record],
        emit: Callable[..., None],
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        self.every = every
        self.evaluate = evaluate
        self.emit = emit
        self.should_stop = should_stop

    async def after_step(self, ctx: StepContext) -> None:
        if not self.every or ctx.step % self.every:
            return
        try:
            record = await ctx.read(Stage.EVAL, self.evaluate, ctx.step, self.should_stop)
        except EvalStopped:
            self.emit("warning", message=f"the eval at step {ctx.step} stopped: a stop was asked")
            return
        self.emit("eval", **record)

    async def at_end(self, ctx: StepContext) -> None:
        return None
