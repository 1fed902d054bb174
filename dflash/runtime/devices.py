"""Device: a torch device, its own worker thread, and (on CUDA) one stream per stage.

Compute never runs on the event-loop thread. `await device.run(stage, fn, *args)` runs
`fn` in the device's single worker thread (which also keeps per-device order), times it
under `stage`, and on CUDA runs it on the stage's own stream between two timing events.
It returns `(result, ready)`, where `ready` is the CUDA event that marks the end of the
work (None on CPU).

The hand-off rule, the one way a tensor crosses from one stream to another:

1. **Order.** The consumer passes the producer's `ready` event as `wait_for`: its stream
   waits on the event (on the device; the host does not wait).
2. **Memory.** The consumer names the device tensors it reads from the other stream as
   `uses`; `Device.run` calls `record_stream` on each for the consuming stream (`hold`).
   The caching allocator then keeps a tensor's memory from reuse, after the last
   reference to it is dropped anywhere, until the work queued on the consuming stream up
   to that point is done. (Chosen over "hold a reference until an event": it needs no
   bookkeeping of who drops what, and the producer's next work can never overwrite it.)
3. **Host memory.** Pinned host buffers are read by the device only through `upload`
   (H2D, non_blocking from pinned memory; torch's caching host allocator keeps the block
   until that copy is done) or written by a D2H copy the host waits for with
   `synchronize` before it reads. Reused D2H buffers (`PinnedPool`) go back to the pool
   with the event after their last reader's upload, and are reused only after it.

Host syncs: `host_sync` (read a device value) and `Device.synchronize` (wait for an event)
are the hot path's only ones, each inside a span named for it. `set_sync_debug(True)` makes
every other sync on CUDA an error (torch's sync debug mode), for checks. That mode is
process-wide, so while one thread is inside `named_sync` the others go unchecked; hooks
name only their own work (`StepContext.read`), and waiting for an event needs no name.

Where tensors live and the CUDA-only choices (features kept on the device, pinned buffers,
per-GPU streams, events across GPUs) are `Device` methods (`accelerated`, `gpu`, `gpu_of`,
`on_device`, `upload`, `to_host`, `pinned`, `event`, `stream_for`, `copy_to`), and the free
functions `upload`, `host_sync` and `on_device` ask the worker's device. Subclasses plug in
through the pipeline's `DeviceFactory`: the orchestration benchmarks' simulated device queue
(`bench/simulated.py`) and the checked device of `runtime/checked.py`, which runs the real
stages on virtual GPUs over CPU tensors and checks every op against CUDA's rules; this module
knows neither.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from dflash.errors import ConfigError
from dflash.runtime.profiler import Profiler

__all__ = [
    "Device", "DeviceFactory", "PinnedPool", "check_device", "host_sync", "in_named_sync", "named_sync", "on_device",
    "set_sync_debug", "stream_of", "upload",
]  # fmt: skip

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


_sync_lock = threading.Lock()
_sync_debug = False
_named_syncs = 0  # named syncs in progress (in any thread): the debug mode is off meanwhile


def _set_mode(mode: str) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode(mode)


def set_sync_debug(on: bool) -> None:
    """On CUDA, make every host sync outside `named_sync` an error (torch's sync debug mode
    "error"). The mode is process-wide: while a named sync runs in one thread, the others
    go unchecked — a check with blind spots, never a false alarm."""
    global _sync_debug
    with _sync_lock:
        _sync_debug = on
        if _named_syncs == 0:
            _set_mode("error" if on else "default")


_named_here = threading.local()  # .depth: named syncs in progress in this thread


def in_named_sync() -> bool:
    """Whether this thread is inside `named_sync` (a checker's sync rule is per thread)."""
    return getattr(_named_here, "depth", 0) > 0


@contextlib.contextmanager
def named_sync() -> Iterator[None]:
    """Around an intended host sync: exempt from the sync debug mode."""
    global _named_syncs
    _named_here.depth = getattr(_named_here, "depth", 0) + 1
    with _sync_lock:
        _named_syncs += 1
        if _sync_debug and _named_syncs == 1:
            _set_mode("default")
    try:
        yield
    finally:
        _named_here.depth -= 1
        with _sync_lock:
            _named_syncs -= 1
            if _sync_debug and _named_syncs == 0:
                _set_mode("error")


_worker = threading.local()  # .device: the Device whose worker thread this is


def _worker_device() -> Device | None:
    """The `Device` whose worker thread this is, or None (the event loop, a plain thread)."""
    return getattr(_worker, "device", None)


def host_sync(t: torch.Tensor) -> torch.Tensor:
    """The hot path's one way to read a device value on the host: a blocking copy, i.e. a
    host sync point. Call it only inside a `Device.span` named for the sync
    (`drafter.grad_norm_sync`, `metrics.sync`), so that the profiler times it. In a device's
    worker thread the device makes the copy (`Device.to_host`: from a GPU into pinned memory,
    then an event wait in this thread alone; a simulated device first waits for its queue, a
    checked one folds its clocks)."""
    with named_sync():
        device = _worker_device()
        if device is not None:
            return device.to_host(t)
        return t.to("cpu")  # sync: the named one


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host → device without a host sync: from pinned memory with `non_blocking=True`. The
    caching host allocator keeps a pinned block alive until the copy that reads it is done.
    A tensor already on `device` is returned as it is. In a device's worker thread the
    device makes the copy (`Device.upload`)."""
    worker = _worker_device()
    if worker is not None:
        return worker.upload(t, device)
    return _upload(t, device)


def _upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda" or t.device == device:
        return t
    if t.device.type == "cuda":  # on another GPU: a copy between the two
        return t.to(device, non_blocking=True)  # no-sync: device to device
    return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)  # no-sync: pinned source


def on_device(t: torch.Tensor) -> bool:
    """Whether `t` lives in an accelerator's memory (asked of the worker's device: a checked
    device answers for its virtual GPUs)."""
    worker = _worker_device()
    return worker.on_device(t) if worker is not None else t.device.type == "cuda"


class PinnedPool:
    """At most `size` reused pinned host buffers for D2H copies: bounded host memory, no
    pinned allocation (a device-wide sync in CUDA) in the steady state.

    `take(shape, dtype)` gives a buffer and a `release(ready)` callback; its last reader
    calls it with the event after its last read was queued (the H2D upload), and the pool
    hands the buffer out again only after that event. When all `size` buffers are out, a
    buffer from torch's caching host allocator is used once (counted in `extra`)."""

    def __init__(self, size: int, alloc: Callable[[int], torch.Tensor] | None = None) -> None:
        self.size = size
        self._alloc = alloc or (lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True))
        self._free: list[tuple[torch.Tensor, Any]] = []  # (flat byte buffer, event of its last reader)
        self._lock = threading.Lock()
        self.made = self.extra = self.reused = 0

    def take(self, shape: torch.Size, dtype: torch.dtype) -> tuple[torch.Tensor, Callable[[Any], None]]:
        nbytes = shape.numel() * dtype.itemsize
        with self._lock:
            fit = [i for i, (b, _) in enumerate(self._free) if b.numel() >= nbytes]
            if fit:  # the smallest that fits, preferring one whose last reader is done
                done = [i for i in fit if self._free[i][1] is None or self._free[i][1].query()]
                buf, ready = self._free.pop(min(done or fit, key=lambda i: self._free[i][0].numel()))
                self.reused += 1
            elif self.made < self.size:
                buf, ready = self._alloc(nbytes), None
                self.made += 1
            elif self._free:  # all too small for this shape: replace the smallest (torch frees it safely)
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i][0].numel()))
                buf, ready = self._alloc(nbytes), None
            else:
                self.extra += 1
                return self._alloc(nbytes)[:nbytes].view(dtype).view(shape), lambda _ready: None
        if ready is not None and not ready.query():
            ready.synchronize()  # sync: the last upload from this buffer must be done (an event: see `_wait`)

        def release(ready: Any) -> None:
            with self._lock:
                self._free.append((buf, ready))

        return buf[:nbytes].view(dtype).view(shape), release


def _wait(ready: Any) -> None:
    # No named_sync: torch's sync debug mode does not flag an event's synchronize (it checks
    # copies and stream/device synchronizes), so the check stays armed meanwhile for every
    # other thread; turning it off here, process-wide, would blind it while the host waits.
    ready.synchronize()  # sync: named by the caller's span or record


def stream_of(stage: str | None, stream: str | None) -> str:
    """The name of the stream a piece of work runs on: its own, else its stage's."""
    name = stream or stage
    if name is None:
        msg = "device work needs a stage or a stream name"
        raise ValueError(msg)
    return name


# How the pipeline makes its devices: `(spec, name, profiler) -> Device`. `Device` itself by
# default; a `Device` subclass plugs in here to run the real stages on other semantics (the
# orchestration benchmarks' simulated device queue, `bench/simulated.py`). Passed as
# `Coordinator(cfg, make_device=...)`.
DeviceFactory = Callable[[str, str, "Profiler | None"], "Device"]


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
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"dflash-{name}", initializer=self._adopt_worker
        )
        self._streams: dict[tuple[str, int], Any] = {}
        self.held: collections.Counter[str] = collections.Counter()  # per stage: tensors taken over (`hold`)
        if self.is_cuda and profiler is not None:
            profiler.add_cuda_device(self.device.index or 0)

    def __repr__(self) -> str:
        return f"Device({self.name} on {self.device})"

    def _adopt_worker(self) -> None:
        _worker.device = self

    # -- where tensors live, and the CUDA-only choices: a checked device (dflash/runtime/checked.py)
    # answers these for virtual GPUs over CPU tensors, so the real stage code takes its CUDA paths.

    @property
    def accelerated(self) -> bool:
        """Device memory apart from the host's, streams and events (CUDA)."""
        return self.is_cuda

    @property
    def gpu(self) -> int | None:
        """Which GPU this device is (None: the host)."""
        return (self.device.index or 0) if self.is_cuda else None

    def on_device(self, t: torch.Tensor) -> bool:
        return t.device.type == "cuda"

    def gpu_of(self, t: torch.Tensor) -> int | None:
        """The GPU `t` lives on (None: the host)."""
        return (t.device.index or 0) if t.device.type == "cuda" else None

    def copy_to(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A copy of `t` on the device of `like`, queued on this thread's streams (GPU to GPU:
        no host sync)."""
        return t.to(like.device, copy=True, non_blocking=True)  # no-sync: device to device

    def upload(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        return _upload(t, device)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """`host_sync`'s blocking copy, in this device's worker thread (a simulated device
        first waits for its simulated queue, so it syncs exactly where the real one does).
        From a GPU: into pinned memory, then this thread waits on an event. A blocking copy
        into pageable memory would also hold back the other threads' CUDA calls until the
        stream drains (on one GPU the drafter's next batch waited on the grad-norm sync)."""
        if not t.is_cuda:
            return t.to("cpu")  # sync: the named one (host_sync)
        out = self.pinned(t.shape, t.dtype)
        out.copy_(t, non_blocking=True)
        self.event(t).synchronize()  # sync: the named one (host_sync); this thread alone waits
        return out

    def pinned(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An empty host buffer the device can copy into and out of asynchronously."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.is_cuda)

    def event(self, like: torch.Tensor | None = None) -> Any:
        """An event recorded now on this thread's current stream (on the GPU of `like`)."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(like.device if like is not None else None))
        return ev

    def stream_for(self, like: torch.Tensor, stage: str, wait: Any = None) -> Any:
        """The stream this thread's work on the GPU of `like` runs on: the current one on this
        device's own GPU; on another GPU, `stage`'s stream there, after `wait`, made this
        thread's current stream there (the optimizer's work on other replicas' GPUs). None
        off CUDA. Setting a stream also makes its GPU the thread's current device: the caller
        sets its own back (`reduce._take_over`)."""
        dev = like.device
        if dev.type != "cuda":
            return None
        if dev == self.device:
            return torch.cuda.current_stream(dev)
        stream = self.stream(stage, on=dev)
        if wait is not None:
            stream.wait_event(wait)
        torch.cuda.set_stream(stream)
        return stream

    def stream(self, stage: str, on: torch.device | None = None) -> Any:
        """The stream of `stage` on this device, or on GPU `on` (the optimizer's work on the
        GPUs of other replicas)."""
        dev = on if on is not None else self.device
        key = (stage, dev.index or 0)
        s = self._streams.get(key)
        if s is None:
            s = self._streams[key] = torch.cuda.Stream(device=dev)
        return s

    def hold(self, stage: str | None, uses: Iterable[torch.Tensor], stream: Any) -> None:
        """Rule 2 of the module docstring: the memory of `uses` (device tensors from another
        stream) stays reserved until `stream`'s work queued so far is done. Counted per stage."""
        n = 0
        for t in uses:
            if stream is not None and t.device.type == "cuda" and t.device == stream.device:
                t.record_stream(stream)
            n += 1
        if n:
            self.held[stage or "untimed"] += n

    def flops(self, stage: str, flops: float, where: torch.device | None = None) -> None:
        """Counted work of a `stage` span on this device (or `where`), for the profile's
        TFLOP/s and MFU (`roofline.flops`: from shapes, no sync)."""
        if self.profiler is not None:
            self.profiler.add_flops(stage, flops, str(where or self.device))

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
        uses: Sequence[torch.Tensor] = (),
        stream_name: str | None = None,
    ) -> tuple[R, Any]:
        if not self.is_cuda:
            self.hold(stream_name or stage, uses, None)
            with self.span(stage):
                out = fn(*args)
            return out, None
        # Current device and stream are thread-local: set them inside the worker thread.
        torch.cuda.set_device(self.device)
        stream = self.stream(stream_of(stage, stream_name))
        with torch.cuda.stream(stream):
            for ev in wait_for:
                if ev is not None:
                    stream.wait_event(ev)
            self.hold(stream_of(stage, stream_name), uses, stream)
            with self.span(stage):
                out = fn(*args)
            end = torch.cuda.Event()
            end.record(stream)
        return out, end

    async def run(
        self,
        stage: str | None,
        fn: Callable[..., R],
        *args: Any,
        wait_for: Sequence[Any] = (),
        uses: Sequence[torch.Tensor] = (),
        stream: str | None = None,
    ) -> tuple[R, Any]:
        """`wait_for`: events of the work that produced what `fn` reads; `uses`: the device
        tensors it reads from other streams (the hand-off rule of the module docstring);
        `stream`: the stream's name when it is not `stage` (work that times its own parts)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._call, stage, fn, args, wait_for, uses, stream)

    async def synchronize(self, ready: Any) -> None:
        """Wait (off the loop, GIL released) until the CUDA work behind `ready` is done: the
        named host sync for an event (the D2H copy before the host reads its buffer)."""
        if ready is not None and not ready.query():
            await asyncio.to_thread(_wait, ready)

    def close(self, wait: bool = True) -> None:
        self._executor.shutdown(wait=wait, cancel_futures=True)

    def join(self, timeout_s: float) -> list[str]:
        """After `close(False)`: the worker thread waited for (its call in hand ends it) for at
        most `timeout_s`; the names of the threads still running then (a call that hangs)."""
        deadline = time.monotonic() + timeout_s
        threads = list(getattr(self._executor, "_threads", ()))
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in threads if t.is_alive()]
