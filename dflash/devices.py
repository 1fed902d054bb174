"""Device: a torch device, its own worker thread, and (on CUDA) one stream per stage.

Compute never runs on the event-loop thread. `await device.run(stage, fn, *args)` runs
`fn` in the device's single worker thread (which also keeps per-device order), times it
under `stage`, and on CUDA runs it on the stage's own stream between two timing events.
It returns `(result, ready)`, where `ready` is the CUDA event that marks the end of the
work (None on CPU): a consumer on another stream passes it as `wait_for` so that its
stream waits on the device, not the host. `await device.synchronize(ready)` waits for it
from a helper thread (needed before the host reads a pinned buffer).

The orchestration benchmarks bring their own subclass (`synthetic.SimDevice`, a simulated
in-order device queue); this module does not know it exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from dflash.errors import ConfigError
from dflash.profile import Profiler

__all__ = ["Device", "check_device", "host_sync", "upload"]

R = TypeVar("R")


def check_device(spec: str, key: str) -> torch.device:
    dev = torch.device(spec)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            msg = f"{key}: {spec!r} requested but CUDA is not available on this machine"
            raise ConfigError(msg)
        index = dev.index or 0
        if index >= torch.cuda.device_count():
            msg = f"{key}: {spec!r} but only {torch.cuda.device_count()} CUDA devices exist"
            raise ConfigError(msg)
        dev = torch.device("cuda", index)
    return dev


def host_sync(t: torch.Tensor) -> torch.Tensor:
    """The hot path's one way to read a device value on the host: a blocking copy, i.e. a
    host sync point. Call it only inside a `Device.span` named for the sync
    (`drafter.grad_norm_sync`, `metrics.sync`), so that the profiler times it."""
    return t.to("cpu")  # sync: the named one


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host → device without a host sync: from pinned memory with `non_blocking=True`. The
    caching host allocator keeps a pinned block alive until the copy that reads it is done."""
    if device.type != "cuda":
        return t
    return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)  # no-sync: pinned source


class Device:
    def __init__(
        self,
        spec: str,
        name: str,
        profiler: Profiler | None = None,
    ) -> None:
        self.device = torch.device(spec)
        self.name = name
        self.profiler = profiler
        self.is_cuda = self.device.type == "cuda"
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"dflash-{name}")
        self._streams: dict[str, Any] = {}
        if self.is_cuda and profiler is not None:
            profiler.add_cuda_device(self.device.index or 0)

    def __repr__(self) -> str:
        return f"Device({self.name} on {self.device})"

    def stream(self, stage: str) -> Any:
        s = self._streams.get(stage)
        if s is None:
            s = self._streams[stage] = torch.cuda.Stream(device=self.device)
        return s

    @contextlib.contextmanager
    def span(self, stage: str | None) -> Iterator[None]:
        """Time a piece of work under `stage` (in the worker thread; None: untimed).

        On CUDA the span is bracketed by timing events on the current stream, resolved
        later by the profiler; no synchronize here.
        """
        if stage is None or self.profiler is None:
            yield
            return
        t0 = time.perf_counter()
        if not self.is_cuda:
            yield
            self.profiler.record(stage, time.perf_counter() - t0, worker=self.name)
            return
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self.profiler.record(stage, time.perf_counter() - t0, (start, end), worker=self.name)

    def _call(
        self,
        stage: str | None,
        fn: Callable[..., R],
        args: tuple[Any, ...],
        wait_for: Sequence[Any],
    ) -> tuple[R, Any]:
        if not self.is_cuda:
            with self.span(stage):
                out = fn(*args)
            return out, None
        # Current device and stream are thread-local: set them inside the worker thread.
        torch.cuda.set_device(self.device)
        stream = self.stream(stage or "default")
        with torch.cuda.stream(stream):
            for ev in wait_for:
                if ev is not None:
                    stream.wait_event(ev)
            with self.span(stage):
                out = fn(*args)
            end = torch.cuda.Event()
            end.record(stream)
        return out, end

    async def run(
        self, stage: str | None, fn: Callable[..., R], *args: Any, wait_for: Sequence[Any] = ()
    ) -> tuple[R, Any]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._call, stage, fn, args, wait_for)

    async def synchronize(self, ready: Any) -> None:
        """Wait (off the loop, GIL released) until the CUDA work behind `ready` is done: the
        named host sync for an event (the D2H copy before the host reads its buffer)."""
        if ready is not None and not ready.query():
            await asyncio.to_thread(ready.synchronize)

    def close(self, wait: bool = True) -> None:
        self._executor.shutdown(wait=wait, cancel_futures=True)
