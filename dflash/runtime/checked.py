"""A CPU model of CUDA's rules: the real stage code on virtual GPUs, checked for host syncs and
for races between streams, op by op — inside our code and everything it calls (transformers,
flex attention, the loss).

`Rules` watches every op that a checked device's work runs (a `TorchDispatchMode`, entered in
the device's worker thread for each piece of work) and keeps, per tensor storage, where it
lives (a virtual GPU or the host), which stream allocated it, which streams hold it
(`Device.hold`), and its last writer and readers as (stream, clock). Each stage's work runs on
a virtual stream with a vector clock; recording an event snapshots the clock, waiting on one
folds it in (`wait_for`), and the host's clock takes in what the host waited for (`host_sync`,
`Device.synchronize`); work launched after that is ordered after it, as on CUDA.

A run fails (`CudaRuleError`, in the stage whose work broke the rule, naming the op or tensor
and the Python frame that issued it) on:

- **sync**: an op that makes the host wait for a GPU — `.item()`, `bool()`/`int()`/`float()` of
  a tensor (`_local_scalar_dense`, `is_nonzero`), `nonzero`, `masked_select`, boolean-mask
  indexing, `unique`, `repeat_interleave` without `output_size`, `equal`, a blocking copy to
  the host — on a device tensor, outside `named_sync`;
- **unordered read**: a read of a tensor last written on another stream that the reading
  stream has not waited for (nor the host before launching it);
- **unordered write**: a write to memory that another stream may still be reading or
  writing (a pinned buffer reused before its upload's event, an update racing a forward);
- **no hold**: a device tensor used on a stream other than the one that allocated it,
  without `Device.hold` (its memory could be reused while the stream still reads it);
- **host read in flight**: the host reads a buffer that an asynchronous copy still writes.

Devices are made through the pipeline's device seam:
`Coordinator(cfg, training=training, make_device=rules.factory({"target0": 0, "drafter0": 1}))`
with `rules.place(module_or_tensors, gpu)` for the weights set-up put there. Tensors are CPU
tensors throughout: the checker sees the order of the work, not its speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dflash.runtime.devices import Device, DeviceFactory, in_named_sync, stream_of
from dflash.runtime.profiler import Profiler

__all__ = ["CheckedDevice", "CudaRuleError", "Rules"]

aten = torch.ops.aten


def _ops(*names: str) -> frozenset[Any]:
    out = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(aten, packet, None)
        if op is not None:
            out.extend(getattr(op, o) for o in ([overload] if overload else op.overloads()) if hasattr(op, o))
    return frozenset(out)


# Ops whose result size or value the host must know: on CUDA each waits for the device.
SYNC_OPS = _ops(
    "_local_scalar_dense", "is_nonzero", "nonzero", "masked_select", "equal", "_unique", "_unique2", "unique_dim",
    "unique_consecutive", "bincount",
)  # fmt: skip
_REPEAT = _ops("repeat_interleave.Tensor", "repeat_interleave.self_Tensor")
_INDEX = _ops("index.Tensor", "index_put.default", "index_put_.default", "_index_put_impl_.default")
_COPY = _ops("copy_.default")

_HERE = os.path.dirname(os.path.abspath(__file__))
_SKIP = (os.sep + "torch" + os.sep, os.path.join(_HERE, "checked.py"), os.path.join(_HERE, "devices.py"), "contextlib")


class CudaRuleError(AssertionError):
    """Code that would sync the host or race between streams on a GPU."""


def _frame() -> str:
    """The innermost Python frame outside torch and this checker: who issued the op."""
    f = sys._getframe(2)
    while f is not None and any(s in f.f_code.co_filename for s in _SKIP):
        f = f.f_back
    if f is None:
        return "?"
    path = f.f_code.co_filename
    for root in sys.path[1:]:
        if root and path.startswith(root.rstrip(os.sep) + os.sep):
            path = path[len(root.rstrip(os.sep)) + 1 :]
            break
    return f"{path}:{f.f_lineno} in {f.f_code.co_name}"


def _non_blocking(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """`copy_(dst, src, non_blocking)`'s flag."""
    return bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))


def _desc(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


Clock = dict[str, int]


def _covers(clock: Clock, stamp: tuple[str, int]) -> bool:
    return clock.get(stamp[0], 0) >= stamp[1]


def _join(a: Clock, b: Clock) -> None:
    for k, v in b.items():
        if a.get(k, 0) < v:
            a[k] = v


class VStream:
    """A virtual stream: its name, its GPU and its vector clock."""

    def __init__(self, name: str, gpu: int) -> None:
        self.name, self.gpu = name, gpu
        self.clock: Clock = {name: 0}

    def __repr__(self) -> str:
        return self.name

    @property
    def now(self) -> tuple[str, int]:
        return self.name, self.clock[self.name]

    def wait_event(self, ev: VEvent) -> None:
        _join(self.clock, ev.clock)


class VEvent:
    """A virtual CUDA event: the clock of its stream when recorded. `query` is true once the
    host has waited for it (or for something after it): the model never finishes work on
    its own, so every wait the code relies on must be in it."""

    def __init__(self, rules: Rules, clock: Clock, stream: str = "") -> None:
        self.rules, self.clock, self.stream = rules, dict(clock), stream

    def query(self) -> bool:
        host = _host()
        return all(host.get(k, 0) >= v for k, v in self.clock.items())

    def synchronize(self) -> None:
        _join(_host(), self.clock)


@dataclass
class Mem:
    """What the checker knows of one storage."""

    gpu: int | None  # None: host memory
    desc: str
    ref: Any  # a weak reference to the storage: an entry whose storage was freed is stale
    alloc: str | None = None  # the stream it was allocated on (None: set-up, or the host)
    writer: tuple[str, int] | None = None  # the last write: (stream, its clock then)
    reads: Clock = field(default_factory=dict)  # per stream: its clock at its last read
    holds: set[str] = field(default_factory=set)


_local = threading.local()  # .ctx: (work's name, {gpu: this thread's current stream there}); .host; .paused


def _host() -> Clock:
    """This thread's host clock: the work it knows to be done (what it waited for, and what
    the threads it heard from knew: through the event loop, `CheckedDevice.run`)."""
    clock = getattr(_local, "host", None)
    if clock is None:
        clock = _local.host = {}
    return clock


def _storage(t: torch.Tensor) -> Any:
    if t.numel() == 0 or t.device.type != "cpu":
        return None
    return t.untyped_storage()  # one Python object per live storage (torch keeps it with the storage)


class Rules:
    """The checker's state: storages, streams, the host's clock."""

    def __init__(self, syncs: bool = True, streams: bool = True) -> None:
        self.syncs, self.streams = syncs, streams  # which rules are checked
        self.lock = threading.RLock()
        self.mem: dict[int, Mem] = {}
        self._streams: dict[tuple[str, int], VStream] = {}
        self.ops = 0  # ops seen on virtual GPUs
        self.work_on: dict[str, set[str]] = {}  # per stream name: the work (stage or function) that ran on it
        # Mutation tests: (work, "wait_for" | "hold") pairs whose waits or holds are dropped, as
        # if the code did not pass them; work is a stage name or a function's qualified name.
        # ("wait_for@NAME": only its waits on events recorded on streams whose name has NAME.)
        self.drop: set[tuple[str, str]] = set()

    # -- set-up -------------------------------------------------------------------------------

    def factory(self, gpus: dict[str, int | None], default: int | None = 0) -> DeviceFactory:
        """The pipeline's device seam: device `name` ("data", "target0", "drafter1",
        "optimizer") on virtual GPU `gpus[name]` (None: the host); "data" is the host, the
        optimizer shares the first drafter's GPU, any other name gets `default`."""

        def make(spec: str, name: str, profiler: Profiler | None = None) -> Device:
            if name in gpus:
                gpu = gpus[name]
            elif name == "data":
                gpu = None
            elif name == "optimizer":
                gpu = gpus.get("drafter0", default)
            else:
                gpu = default
            return CheckedDevice(spec, name, profiler, rules=self, gpu=gpu)

        return make

    def place(self, what: torch.nn.Module | Iterable[torch.Tensor], gpu: int) -> None:
        """Set-up put these on virtual GPU `gpu` (written before any stream ran: set-up ends
        with a device fence)."""
        tensors = [*what.parameters(), *what.buffers()] if isinstance(what, torch.nn.Module) else list(what)
        with self.lock:
            for t in tensors:
                s = _storage(t)
                if s is not None:
                    self.mem[s.data_ptr()] = Mem(gpu, _desc(t), weakref.ref(s))

    def _get(self, t: torch.Tensor) -> Mem | None:
        s = _storage(t)
        if s is None:
            return None
        m = self.mem.get(s.data_ptr())
        return m if m is not None and m.ref() is s else None  # else: memory since reused

    def where(self, t: torch.Tensor) -> int | None:
        m = self._get(t)
        return m.gpu if m is not None else None

    @property
    def stream_names(self) -> set[str]:
        """Every virtual stream work ran on, e.g. "target0/target.pack_hidden@gpu0"."""
        return {s.name for s in self._streams.values()}

    def stream(self, name: str, gpu: int) -> VStream:
        with self.lock:
            s = self._streams.get((name, gpu))
            if s is None:
                s = self._streams[(name, gpu)] = VStream(f"{name}@gpu{gpu}", gpu)
            return s

    # -- what a checked device's work does --------------------------------------------------

    def launch(self, stream: VStream, wait_for: Sequence[Any]) -> None:
        """Work is queued on `stream` now: after all the host has seen done, and `wait_for`."""
        with self.lock:
            _join(stream.clock, _host())
            for ev in wait_for:
                if isinstance(ev, VEvent):
                    stream.wait_event(ev)
            stream.clock[stream.name] += 1

    @contextlib.contextmanager
    def working(self, stage: str, stream: VStream | None, wait_for: Sequence[Any]) -> Iterator[None]:
        """A piece of work launched on `stream` (None: host work) by this thread: after what
        the host has waited for and after `wait_for`; every op in it is watched."""
        prev = getattr(_local, "ctx", None)
        if stream is not None:
            self.launch(stream, wait_for)
        _local.ctx = (stage, {stream.gpu: stream} if stream is not None else {}, stream)
        try:
            with _HostReads(self), _Watch(self):
                yield
        finally:
            _local.ctx = prev

    def current(self, gpu: int | None) -> VStream | None:
        ctx = getattr(_local, "ctx", None)
        return ctx[1].get(gpu) if ctx is not None and gpu is not None else None

    def set_current(self, stream: VStream) -> None:
        ctx = getattr(_local, "ctx", None)
        if ctx is not None:
            ctx[1][stream.gpu] = stream

    def record(self, stream: VStream) -> VEvent:
        with self.lock:
            ev = VEvent(self, stream.clock, stream.name)
            stream.clock[stream.name] += 1  # what the stream does next is after the event
            return ev

    def hold(self, t: torch.Tensor, stream: VStream) -> None:
        with self.lock:
            m = self._get(t)
            if m is not None:
                m.holds.add(stream.name)

    def upload(self, t: torch.Tensor, gpu: int) -> torch.Tensor:
        """H2D: a copy on this thread's stream of `gpu`."""
        stream = self.current(gpu)
        with _paused():
            out = t.clone()
        if stream is None:  # not in a checked device's work: a set-up copy
            self.place([out], gpu)
            return out
        with self.lock:
            self._read(t, stream, "upload")
            self._fresh(out, stream)
        return out

    def copy(self, t: torch.Tensor, gpu: int) -> torch.Tensor:
        """A copy between GPUs, on this thread's current streams of both."""
        src, dst = self._stream_on(self.where(t), "copy"), self._stream_on(gpu, "copy")  # type: ignore[arg-type]
        with _paused():
            out = t.clone()
        with self.lock:
            self._read(t, src, "copy between GPUs")
            self._fresh(out, dst)
        return out

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A blocking copy to the host on the tensor's current stream: the host waits for it."""
        gpu = self.where(t)
        stream = self.current(gpu)
        with _paused():
            out = t.clone()
        if stream is None:
            return out
        with self.lock:
            self._read(t, stream, "copy to host")
            self._host_waits(stream)
            self._fresh(out, None)
        return out

    def made_on_device(self, t: torch.Tensor) -> None:
        """A factory's tensor, made with an explicit device by this thread's work: its stream's."""
        ctx = getattr(_local, "ctx", None)
        if ctx is not None and ctx[2] is not None and isinstance(t, torch.Tensor):
            with self.lock:
                self._fresh(t, ctx[2])

    def _host_waits(self, stream: VStream) -> None:
        """The host waited for `stream`'s work so far; what the stream does next is after."""
        _join(_host(), stream.clock)
        stream.clock[stream.name] += 1

    # -- the rules --------------------------------------------------------------------------

    def race(self, what: str) -> None:
        """A broken stream rule (checked when `streams`)."""
        if self.streams:
            self.fail(what)

    def fail(self, what: str) -> None:
        ctx = getattr(_local, "ctx", None)
        stage = ctx[0] if ctx is not None else "?"
        raise CudaRuleError(f"{stage}: {what} (at {_frame()})")

    def _read(self, t: torch.Tensor, stream: VStream | None, op: str) -> None:
        m = self._get(t)
        if m is None:
            return
        if stream is None:  # the host
            if m.writer is not None and not _covers(_host(), m.writer):
                self.race(f"host read in flight: {op} reads {m.desc} while {m.writer[0]} may still write it")
            return
        if m.writer is not None and m.writer[0] != stream.name and not _covers(stream.clock, m.writer):
            self.race(f"unordered read: {op} on {stream} reads {m.desc} last written on {m.writer[0]}, not waited for")
        if m.gpu is not None and m.alloc is not None and m.alloc != stream.name and stream.name not in m.holds:
            self.race(f"no hold: {op} on {stream} uses {m.desc} allocated on {m.alloc} without Device.hold")
        m.reads[stream.name] = stream.clock[stream.name]

    def _write(self, t: torch.Tensor, stream: VStream | None, op: str, to_host: bool = False) -> None:
        m = self._get(t)
        if m is None:
            s = _storage(t)
            if stream is not None and s is not None:
                # Host memory a copy to the host lands in; else memory made by a factory with
                # an explicit device (a kernel cannot write pageable host memory).
                gpu, alloc = (None, None) if to_host else (stream.gpu, stream.name)
                self.mem[s.data_ptr()] = Mem(gpu, _desc(t), weakref.ref(s), alloc=alloc, writer=stream.now)
            return
        clock = _host() if stream is None else stream.clock
        who = "the host" if stream is None else str(stream)
        foreign = stream is not None and m.gpu is not None and m.alloc not in (None, stream.name)
        if foreign and stream.name not in m.holds:  # type: ignore[union-attr]
            self.race(f"no hold: {op} on {stream} writes {m.desc} allocated on {m.alloc} without Device.hold")
        for other, at in m.reads.items():
            if (stream is None or other != stream.name) and clock.get(other, 0) < at:
                self.race(f"unordered write: {op} on {who} writes {m.desc} that {other} may still read")
        if m.writer is not None and (stream is None or m.writer[0] != stream.name) and not _covers(clock, m.writer):
            self.race(f"unordered write: {op} on {who} writes {m.desc} that {m.writer[0]} may still write")
        if stream is not None:
            m.writer, m.reads = stream.now, {}
        elif m.gpu is None:
            self._fresh(t, None)  # host memory the host now owns again

    def _fresh(self, t: torch.Tensor, stream: VStream | None) -> None:
        s = _storage(t)
        if s is None:
            return
        if stream is None:
            self.mem.pop(s.data_ptr(), None)  # host memory (maybe where a freed device tensor was)
        else:
            self.mem[s.data_ptr()] = Mem(stream.gpu, _desc(t), weakref.ref(s), alloc=stream.name, writer=stream.now)

    def op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """After `func` ran: the rules it is subject to, and what it wrote."""
        ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        outs = [a for a in tree_flatten(out)[0] if isinstance(a, torch.Tensor)]
        with self.lock:
            gpus = {g for g in (self.where(t) for t in ins) if g is not None}
            copy_out = func in _COPY and gpus and self.where(args[0]) is None  # device → host
            if self.syncs and gpus and not in_named_sync():
                self._check_sync(func, args, kwargs, bool(copy_out))
            stream = None
            if gpus:
                self.ops += 1
                stream = self._stream_on(min(gpus), func)
            written = self._written(func, args, kwargs)
            for st in self._streams_here():  # queued now: after all this thread has seen done
                _join(st.clock, _host())
            # Each tensor on the thread's current stream of its own GPU (a copy between GPUs
            # is ordered on both); host memory that a stream op touches (a pinned buffer a
            # copy lands in) on the op's stream.
            for t in ins:
                if all(t is not w for w in written):
                    self._read(t, self._stream_of(t, stream, func), str(func))
            for t in written:
                self._write(t, self._stream_of(t, stream, func), str(func), bool(copy_out))
            if copy_out and stream is not None and not _non_blocking(args, kwargs):
                self._host_waits(stream)  # a blocking copy
            in_storages = [_storage(t) for t in ins]
            for t in outs:
                s = _storage(t)
                if s is not None and all(s is not x for x in in_storages):
                    self._fresh(t, stream)

    def _streams_here(self) -> list[VStream]:
        ctx = getattr(_local, "ctx", None)
        return list(ctx[1].values()) if ctx is not None else []

    def _stream_on(self, gpu: int, func: Any) -> VStream:
        stream = self.current(gpu)
        if stream is None:  # CUDA would run it on that GPU's legacy stream, ordered with nothing
            self.race(f"no stream: {func} uses a tensor on gpu{gpu}, where this work has no stream (Device.stream_for)")
        return stream  # type: ignore[return-value]

    def _stream_of(self, t: torch.Tensor, stream: VStream | None, func: Any) -> VStream | None:
        gpu = self.where(t)
        return stream if gpu is None or stream is None or gpu == stream.gpu else self._stream_on(gpu, func)

    def _written(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """The tensors `func` writes in place (its schema's mutable arguments)."""
        out: list[torch.Tensor] = []
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            v = args[i] if i < len(args) else kwargs.get(arg.name)
            out.extend(x for x in tree_flatten(v)[0] if isinstance(x, torch.Tensor))
        return out

    def _check_sync(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], copy_out: bool) -> None:
        if func in SYNC_OPS:
            self.fail(f"sync: {func} of a device tensor makes the host wait for the GPU")
        if func in _REPEAT and kwargs.get("output_size") is None:
            self.fail(f"sync: {func} without output_size makes the host wait for the GPU")
        if func in _INDEX:
            idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx or ()):
                self.fail(f"sync: {func} with a boolean mask makes the host wait for the GPU (its size)")
        if copy_out and not _non_blocking(args, kwargs):
            self.fail(f"sync: {func}, a blocking copy of a device tensor to the host")


class _Watch(TorchDispatchMode):
    """Every op of a checked device's work, after it ran, to `Rules.op`."""

    def __init__(self, rules: Rules) -> None:
        super().__init__()
        self.rules = rules

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not getattr(_local, "paused", False):
            self.rules.op(func, args, kwargs, out)
        return out


# Copies to the host that reach no op on CPU (the tensor is already there): seen at the
# Python level instead.
_TO_HOST = frozenset({torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.__array__})


# Factories: with an explicit device (other than the string "cpu") inside a device's work,
# their tensor is that device's (on CPU the dispatched op cannot tell it from a host one).
_FACTORIES = frozenset({
    torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.tensor, torch.rand, torch.randn,
    torch.randint, torch.linspace, torch.eye, torch.empty_strided, torch.as_tensor,
})  # fmt: skip


def _to_host_copy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this Python-level call copies its tensor to the host and waits for it."""
    if func in _TO_HOST:
        return True
    if func is not torch.Tensor.to or kwargs.get("non_blocking") or (len(args) > 3 and args[3]):
        return False
    to = kwargs.get("device", args[1] if len(args) > 1 else None)
    if isinstance(to, torch.Tensor):
        return False  # `.to(other)`: where `other` lives decides; the dispatch mode sees the copy
    # Only the string: under the checker every torch.device is "cpu", the GPUs' too.
    return isinstance(to, str) and to.split(":")[0] == "cpu"


class _HostReads(TorchFunctionMode):
    """`.tolist()`, `.numpy()`, `.cpu()`, `.to("cpu")` of a device tensor: a blocking copy to
    the host (on CPU no op is dispatched for them: the dispatch mode cannot see them); and
    factories given a device, whose tensors are the device's."""

    def __init__(self, rules: Rules) -> None:
        super().__init__()
        self.rules = rules

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        rules, watched = self.rules, not getattr(_local, "paused", False)
        copies = watched and args and isinstance(args[0], torch.Tensor) and _to_host_copy(func, args, kwargs)
        if copies and rules.syncs and not in_named_sync() and rules.where(args[0]) is not None:
            rules.fail(f"sync: Tensor.{func.__name__} of a device tensor is a blocking copy to the host")
        out = func(*args, **kwargs)
        if watched and func in _FACTORIES and kwargs.get("device") not in (None, "cpu"):
            rules.made_on_device(out)
        return out


@contextlib.contextmanager
def _paused() -> Iterator[None]:
    """The checker's own copies are not the code's ops."""
    before = getattr(_local, "paused", False)
    _local.paused = True
    try:
        yield
    finally:
        _local.paused = before


def _name(fn: Any) -> str:
    """A function's qualified name (through `functools.partial`)."""
    while hasattr(fn, "func"):
        fn = fn.func
    return getattr(fn, "__qualname__", repr(fn))


class CheckedDevice(Device):
    """A CPU `Device` that is virtual GPU `gpu` (None: the host) under `rules`: the stages take
    their CUDA paths (features kept on the device or copied into pinned buffers, events,
    holds), and every op of its work is checked."""

    def __init__(
        self, spec: str, name: str, profiler: Profiler | None = None, *, rules: Rules, gpu: int | None
    ) -> None:
        super().__init__(spec, name, profiler)
        self.rules, self._gpu = rules, gpu

    def __repr__(self) -> str:
        return f"CheckedDevice({self.name} on {'host' if self._gpu is None else f'gpu{self._gpu}'})"

    @property
    def accelerated(self) -> bool:
        return self._gpu is not None

    @property
    def gpu(self) -> int | None:
        return self._gpu

    def on_device(self, t: torch.Tensor) -> bool:
        return self.rules.where(t) is not None

    def upload(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        where = self.rules.where(t)
        if self._gpu is None or where == self._gpu:
            return t
        if where is not None:  # on another GPU: a copy between the two
            return self.rules.copy(t, self._gpu)
        return self.rules.upload(t, self._gpu)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return self.rules.to_host(t) if self.rules.where(t) is not None else t

    def pinned(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def stream(self, stage: str, on: torch.device | None = None) -> VStream:
        assert self._gpu is not None, f"{self.name}: the host has no streams"
        return self.rules.stream(f"{self.name}/{stage}", self._gpu)

    def gpu_of(self, t: torch.Tensor) -> int | None:
        return self.rules.where(t)

    def copy_to(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        gpu = self.rules.where(like)
        if gpu is None or gpu == self.rules.where(t):
            return t.clone()
        return self.rules.copy(t, gpu)

    def event(self, like: torch.Tensor | None = None) -> Any:
        stream = self.rules.current(self._gpu if like is None else self.rules.where(like))
        return self.rules.record(stream) if stream is not None else None

    def stream_for(self, like: torch.Tensor, stage: str, wait: Any = None) -> Any:
        gpu = self.rules.where(like)
        if gpu is None or gpu == self._gpu:
            return self.rules.current(self._gpu)
        stream = self.rules.stream(f"{self.name}/{stage}", gpu)
        if (stage, "wait_for") in self.rules.drop:
            wait = None
        self.rules.launch(stream, [wait])
        self.rules.set_current(stream)
        return stream

    def hold(self, stage: str | None, uses: Iterable[torch.Tensor], stream: Any) -> None:
        n = 0
        if (stage or "untimed", "hold") in self.rules.drop:
            uses = ()
        for t in uses:
            if isinstance(stream, VStream):
                self.rules.hold(t, stream)
            n += 1
        if n:
            self.held[stage or "untimed"] += n

    async def run(
        self,
        stage: str | None,
        fn: Callable[..., Any],
        *args: Any,
        wait_for: Sequence[Any] = (),
        uses: Sequence[torch.Tensor] = (),
        stream: str | None = None,
    ) -> tuple[Any, Any]:
        """`Device.run`, passing host clocks through the event loop, as the code's own
        happens-before goes: the work knows what the loop knew when it was sent, and the loop
        learns what the work's thread waited for when it returns."""
        sent = dict(_host())
        loop = asyncio.get_running_loop()
        call = (stage, fn, args, wait_for, uses, stream)
        out, ready, seen = await loop.run_in_executor(self._executor, self._sent, sent, *call)
        _join(_host(), seen)
        return out, ready

    def _sent(self, sent: Clock, *call: Any) -> tuple[Any, Any, Clock]:
        _join(_host(), sent)
        out, ready = self._call(*call)
        return out, ready, dict(_host())

    async def synchronize(self, ready: Any) -> None:
        """The event's wait, in the loop's own thread (a virtual event is waited for at once)."""
        if ready is not None:
            ready.synchronize()

    def _call(
        self,
        stage: str | None,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        wait_for: Sequence[Any],
        uses: Sequence[torch.Tensor] = (),
        stream_name: str | None = None,
    ) -> tuple[Any, Any]:
        name = stage or _name(fn)
        if self._gpu is not None:
            with self.rules.lock:
                self.rules.work_on.setdefault(self.stream(stream_of(stage, stream_name)).name, set()).add(name)
        if (name, "wait_for") in self.rules.drop:
            wait_for = ()
        for work, kind in self.rules.drop:
            if work == name and kind.startswith("wait_for@"):
                wait_for = [ev for ev in wait_for if not (isinstance(ev, VEvent) and kind[9:] in ev.stream)]
        if (name, "hold") in self.rules.drop:
            uses = ()
        stream = self.stream(stream_of(stage, stream_name)) if self._gpu is not None else None
        with self.rules.working(f"{self.name} {name}", stream, wait_for):
            if stream is not None:
                self.hold(stream_of(stage, stream_name), uses, stream)
            with self.span(stage):
                out = fn(*args)
        return out, (self.rules.record(stream) if stream is not None else None)
