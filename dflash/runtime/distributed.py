"""Several processes, one drafter: torch.distributed, launched by torchrun.

One process per node runs the coordinator over its own target chains and drafter
replicas; `join(cfg)` makes it a rank of one process group when torchrun (or anything that
sets `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) launched more than one process —
NCCL when the drafters are on CUDA, gloo on CPU — and returns None otherwise (then nothing
in the run changes). Every collective runs in the optimizer's worker thread, never on the
event loop, and each rank calls them in the same order:

1. `World.agree`, before each step's update, on a gloo group: does any rank still have
   data (a rank whose shard ended contributes zeros, so no rank waits in vain; when no rank
   has data, all end at the same step), was any rank asked to stop (all stop after this
   step), and every rank's data cursor.
2. `World.all_reduce`, inside the update (`drafter.allreduce` in the profile): the in-node
   gradient sum and the step's sums (Σ loss weight, Σ loss, per-slot counts, tokens),
   summed across ranks in buckets of `distributed.bucket_mb`. The update divides by the
   global Σ w, so it does not depend on how samples fall on ranks. With NCCL the call only
   queues the collective on the GPU: `collective_event` marks its end, and `World.wait`
   polls that mark before the step's host sync, with the same deadline as a collective
   (a lost peer would otherwise hang that sync with no deadline of ours).
3. `World.check_same` every `distributed.check_every` steps: a checksum of the weights,
   compared across ranks (a clear error if replicas ever differ).

Data: rank r takes the batches of the run's fixed global order whose index is r modulo the
world size (`shard`): with the same total number of replicas, W processes see per step the
batches one process would, and a checkpoint resumes on another number of processes (see
dflash/train/checkpoint.py). Faults: a heartbeat per rank in the rendezvous store lets a
survivor whose collective failed or timed out (`distributed.timeout_s`) name the rank it
lost, in one error line. NCCL's own watchdog is a backstop only: its deadline is
`NCCL_BACKSTOP_S` later than ours, so that `World.wait` names the lost rank and the run
writes its emergency checkpoint before the watchdog would take the process down.
"""

from __future__ import annotations

import datetime
import gc
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dflash.errors import ConfigError, DFlashError
from dflash.runtime.ranks import launched

if TYPE_CHECKING:
    from dflash.config import Config

__all__ = ["Agreement", "DistributedError", "SameWeights", "World", "join", "launched", "shard"]

HEARTBEAT_S = 0.5
POLL_S = (0.0001, 0.005)  # `World.wait`: the first and the longest sleep between polls
NCCL_BACKSTOP_S = 60.0  # NCCL's watchdog deadline, past distributed.timeout_s (see `join`)


class DistributedError(DFlashError):
    """A rank was lost or the ranks disagree; raised on every survivor."""


def shard(items: Iterable[tuple[int, Any, Any]], rank: int, size: int) -> Iterator[tuple[int, Any, Any]]:
    """The items of `(index, ...)` whose index is `rank` modulo `size`."""
    return (it for it in items if it[0] % size == rank)


@dataclass(frozen=True)
class Agreement:
    any_data: bool  # some rank contributes to this step
    all_complete: bool  # every rank has every replica's full contribution
    stop: bool  # some rank was asked to stop: every rank stops after this step
    cursors: list[int]  # per rank: the highest batch index it has consumed


def _launch_warnings() -> list[str]:
    """What in torchrun's settings can hang this job later. With `--max-restarts`, the agents'
    shared TCPStore (torch's default) keeps the previous round's keys, and a restarted group's
    rendezvous can read a dead process's address and hang (pytorch/pytorch#135712)."""
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    except ValueError:
        restarts = 0
    if shared and restarts > 0:
        return [
            "torchrun --max-restarts with the agents' shared TCPStore: a restart can hang joining the new "
            "group (pytorch/pytorch#135712); set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment"
        ]
    return []


class World:
    """This process's place in the process group, and the collectives of a run."""

    def __init__(self, rank: int, size: int, backend: str, timeout_s: float, bucket_mb: float) -> None:
        import torch.distributed as dist

        self.rank, self.size, self.backend = rank, size, backend
        self.timeout_s = timeout_s
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.cursor = -1  # the highest batch index any rank has consumed (the data cursor)
        self.cursors = [-1] * size  # per rank
        self._dist = dist
        # Control messages always go over gloo (CPU tensors), whatever carries the gradients.
        self.control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)) \
            if backend != "gloo" else dist.group.WORLD  # fmt: skip
        self._store = dist.distributed_c10d._get_default_store()
        self._beat = 0
        self._closing = threading.Event()
        self._closed = False  # after close(): a collective is an error, never the default group
        self._heart = threading.Thread(target=self._heartbeat, name="dflash-heartbeat", daemon=True)
        self._heart.start()
        self.warnings = _launch_warnings()  # emitted as `warning` records by the run

    def __repr__(self) -> str:
        return f"World(rank {self.rank} of {self.size}, {self.backend})"

    @property
    def is_writer(self) -> bool:
        """Rank 0 writes checkpoints and the export, runs evals and prints the summary."""
        return self.rank == 0

    # -- the step's collectives -------------------------------------------------------
    def agree(self, step: int, has_data: bool, stop: bool, last_batch: int, complete: bool) -> Agreement:
        """One small all-gather before step `step`'s update (see the module docstring);
        keeps the global data cursor (`cursor`, `cursors`) for the update and checkpoints."""
        self._store_set(f"dflash/at/{self.rank}", str(step))
        mine = torch.tensor([int(has_data), int(complete), int(stop), last_batch, step], dtype=torch.int64)
        rows = [torch.empty_like(mine) for _ in range(self.size)]
        self._collective(f"step {step}'s agreement", lambda: self._dist.all_gather(rows, mine, group=self.control))
        table = torch.stack(rows).tolist()  # no-sync: host tensors
        if any(r[4] != step for r in table):  # e.g. resumed from different checkpoints
            where = ", ".join(f"rank {i} at step {r[4]}" for i, r in enumerate(table))
            msg = f"the ranks are at different steps ({where}); did they resume from the same checkpoint?"
            raise DistributedError(msg)
        self.cursors = [r[3] for r in table]
        self.cursor = max(self.cursor, *self.cursors)
        return Agreement(
            any(r[0] for r in table), all(r[1] or not r[0] for r in table), any(r[2] for r in table), self.cursors
        )

    def all_reduce(self, tensors: list[torch.Tensor], what: str) -> None:
        """Σ over ranks, in place, in buckets of consecutive tensors of one dtype and device
        (one collective per bucket, in the same order on every rank)."""
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        for bucket in self._buckets(tensors):
            flat = _flatten_dense_tensors(bucket)
            self._collective(what, lambda flat=flat: self._dist.all_reduce(flat))
            for t, f in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                t.copy_(f)

    def collective_event(self, device: torch.device) -> Any:
        """A mark of the end of the collectives just issued on `device` (a CUDA event on its
        current stream, after them), for `wait`; None where they ended inside the call
        (gloo: nothing to wait for)."""
        if self.backend != "nccl" or device.type != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))
        return ev

    def wait(self, ready: Any, what: str) -> None:
        """Return once `ready` (a `collective_event`; None: at once) is done. NCCL's
        `all_reduce` returns before its collective ends, so a lost peer would otherwise surface
        in the next host sync, which has no deadline (NCCL's watchdog then ends the process:
        no diagnosis, no emergency checkpoint). Here the wait polls, the GIL free, with the
        deadline of a collective (`distributed.timeout_s`); past it, it raises one line naming
        the lost rank and aborts the queued NCCL work, so that nothing after it hangs."""
        if ready is None:
            return
        t0 = time.monotonic()
        pause = POLL_S[0]
        while not ready.query():
            waited = time.monotonic() - t0
            if waited >= self.timeout_s:
                msg = f"rank {self.rank}: {what}: not done after {waited:.0f} s: {self._diagnose()}"
                self._abort_nccl()
                raise DistributedError(msg)
            time.sleep(pause)
            pause = min(2 * pause, POLL_S[1])

    def _buckets(self, tensors: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
        bucket: list[torch.Tensor] = []
        size = 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            other = bucket and (t.dtype, t.device) != (bucket[0].dtype, bucket[0].device)
            if bucket and (size + nbytes > self.bucket_bytes or other):
                yield bucket
                bucket, size = [], 0
            bucket.append(t)
            size += nbytes
        if bucket:
            yield bucket

    def check_same(self, step: int, params: list[torch.Tensor]) -> None:  # sync: a step hook, every check_every steps
        """The weights' checksum, compared across ranks: every rank applied the same updates."""
        with torch.no_grad():
            local = torch.stack([p.detach().double().sum() for p in params]).sum().cpu()
        local = torch.stack([local, torch.tensor(float(self.rank))])
        rows = [torch.empty_like(local) for _ in range(self.size)]
        self._collective(f"step {step}'s weight check", lambda: self._dist.all_gather(rows, local, group=self.control))
        sums = [float(r[0]) for r in rows]
        if any(s != sums[0] for s in sums):
            shown = ", ".join(f"rank {i}: {s:.17g}" for i, s in enumerate(sums))
            msg = f"drafter weights differ across ranks after step {step} ({shown}); the ranks' updates diverged"
            raise DistributedError(msg)

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (picklable; for benchmarks and diagnostics, not the hot path)."""
        out: list[Any] = [None] * self.size
        self._collective("a gather", lambda: self._dist.all_gather_object(out, obj, group=self.control))
        return out

    # -- faults ---------------------------------------------------------------------------
    def _collective(self, what: str, fn: Callable[[], Any]) -> None:
        if self._closed:
            msg = f"rank {self.rank}: {what} after this process left the process group"
            raise DistributedError(msg)
        t0 = time.monotonic()
        try:
            fn()
        except Exception as err:  # gloo / NCCL errors, timeouts
            waited = time.monotonic() - t0
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            first = re.sub(r"^\[[^\]]*\]\s*", "", first)[:160]  # gloo's source location
            msg = f"rank {self.rank}: {what} failed after {waited:.0f} s: {self._diagnose()} ({first})"
            raise DistributedError(msg) from None

    def _abort_nccl(self) -> None:
        """Abort the default group's NCCL communicator (best effort): its kernels stuck on a
        lost peer end, and the GPU's streams drain. The run is over; the control group
        (gloo) is untouched."""
        if self.backend != "nccl":
            return
        try:
            self._dist.group.WORLD._get_backend(torch.device("cuda")).abort()
        except Exception:  # an older torch, or already gone: the watchdog is the backstop
            pass

    def _heartbeat(self) -> None:
        while not self._closing.wait(HEARTBEAT_S):
            self._beat += 1
            if not self._store_set(f"dflash/hb/{self.rank}", str(self._beat)):
                return

    def _store_set(self, key: str, value: str) -> bool:
        try:
            self._store.set(key, value)
            return True
        except Exception:  # the store is gone (its host died): the collectives will say so
            return False

    def _read(self, key: str) -> str | None:
        if not self._store.check([key]):
            return None
        return self._store.get(key).decode()

    def _diagnose(self) -> str:
        """Which rank is lost: one whose heartbeat stopped, else the one(s) behind."""
        others = [r for r in range(self.size) if r != self.rank]
        try:
            before = {r: self._read(f"dflash/hb/{r}") for r in others}
            time.sleep(4 * HEARTBEAT_S)
            after = {r: self._read(f"dflash/hb/{r}") for r in others}
            dead = [r for r in others if after[r] is None or after[r] == before[r]]
            if dead:
                return f"lost rank {', '.join(map(str, dead))} (it stopped: no heartbeat)"
            steps = {r: self._read(f"dflash/at/{r}") for r in range(self.size)}
            lag = [r for r in others if steps[r] != steps[self.rank]]
            if lag:
                where = ", ".join(f"rank {r} at step {steps[r]}" for r in lag)
                ranks = ", ".join(map(str, lag))
                return f"rank {ranks} is alive but behind ({where}; this rank: step {steps[self.rank]})"
            return "every rank is alive; the collective itself failed"
        except Exception:
            return "lost the rendezvous store (its host, rank 0 or the torchrun agent, is gone)"

    def close(self, clean: bool) -> None:
        """Stop the heartbeat (joined: a thread inside a store call at interpreter exit
        aborts the process) and, after a clean run, leave the process group."""
        self._closing.set()
        self._heart.join(timeout=5)
        if clean and self._dist.is_initialized():
            try:
                self._dist.destroy_process_group()
            except Exception:  # leaving anyway
                pass
        # The last references to the groups and the store (rank 0 hosts its server): freed
        # here, while the interpreter is whole, not in its teardown, where a C++ thread still
        # owned by a dying object aborts the process ("terminate called without an active
        # exception") after a run that finished.
        self.control = self._store = None
        self._closed = True
        gc.collect()


def join(cfg: Config) -> World | None:
    """Join the process group torchrun set up (blocking: run it in a thread); None when
    this process runs alone."""
    env = launched()
    if env is None:
        return None
    import torch.distributed as dist

    rank, size = env
    cuda = all(d.startswith("cuda") for d in cfg.pipeline.drafter_devices)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    devices = [*cfg.pipeline.target_devices, *cfg.pipeline.drafter_devices]
    if per_node > 1 and any(d.startswith("cuda") for d in devices):
        msg = (
            f"{per_node} processes on this node would share the GPUs the config lists: run one process "
            "per node (torchrun --nproc-per-node 1); its config lists the node's GPUs"
        )
        raise ConfigError(msg)
    backend = "nccl" if cuda else "gloo"
    if cfg.pipeline.mode == "serial":
        msg = "pipeline.mode = 'serial' runs in one process; launch it without torchrun"
        raise ConfigError(msg)
    # NCCL's watchdog ends the process at its deadline: later than ours (`World.wait`).
    limit = cfg.distributed.timeout_s + (NCCL_BACKSTOP_S if backend == "nccl" else 0.0)
    if not dist.is_initialized():
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=limit))
        except (RuntimeError, ValueError) as err:
            first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
            msg = f"rank {rank} of {size}: joining the process group ({backend}) failed: {first}"
            raise DistributedError(msg) from None
    return World(rank, size, backend, cfg.distributed.timeout_s, cfg.distributed.bucket_mb)


class SameWeights:
    """A step hook: after the first step and every `every` steps, the weights' checksum is
    compared across ranks (`World.check_same`): replicas on all ranks must stay identical."""

    def __init__(self, world: World, params: list[torch.Tensor], every: int) -> None:
        self.world, self.params, self.every = world, params, every
        self._first = True

    async def after_step(self, ctx: Any) -> None:
        if self._first or ctx.step % self.every == 0:
            self._first = False
            await ctx.read(None, self.world.check_same, ctx.step, self.params)

    async def at_end(self, ctx: Any) -> None:
        return None
