"""Channel: the bounded, closable queue that links two pipeline stages.

Python 3.11's asyncio.Queue cannot be closed (Queue.shutdown is 3.13+), so stages are
linked by this small channel instead:

- `put` waits while the channel is full (back-pressure) and raises `ChannelClosed` once
  every consumer has left cleanly (the run is stopping: the producer should end quietly)
  or `ConsumerDied` when a consumer failed (the producer must fail loudly, never hang).
- `get` waits until `min_ready` items are buffered (`pipeline.hs_min_ready`) or every
  producer has closed, and raises `EndOfStream` once closed and drained.
- Each producer calls `close()` once when done; each consumer calls `detach()` once.
- `order` (optional): items carry consecutive keys 0, 1, 2, ... and leave in key order
  whatever order several producers put them in. An early item waits, held, until the ones
  before it came. A full channel still lets the next expected item in when consumers cannot
  take anything yet (fewer than `min_ready` items may leave): it is what frees the others.
  So the channel holds at most `maxsize + min_ready` items and never deadlocks.
- Depth (now / time-weighted mean / max) and the time producers and consumers spent
  waiting are kept per window for the profiler (`snapshot()` reads and resets them).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["Channel", "ChannelClosed", "ChannelStats", "ConsumerDied", "EndOfStream"]

T = TypeVar("T")


class EndOfStream(Exception):
    """get() on a channel whose producers have all closed and which is drained."""


class ChannelClosed(Exception):
    """put() on a channel whose consumers have all left: stop producing, cleanly."""


class ConsumerDied(Exception):
    """put() on a channel whose consumer raised: the producer fails too."""


@dataclass(frozen=True)
class ChannelStats:
    depth: int
    mean_depth: float
    max_depth: int
    capacity: int
    put_wait_s: float
    get_wait_s: float
    puts: int
    gets: int


class Channel(Generic[T]):
    """All methods run on the event-loop thread; close/detach are synchronous so that they
    can run in `finally` blocks of cancelled tasks."""

    def __init__(
        self,
        name: str,
        maxsize: int,
        *,
        producers: int = 1,
        consumers: int = 1,
        min_ready: int = 1,
        order: Callable[[T], int] | None = None,
    ) -> None:
        assert maxsize >= 1 and 1 <= min_ready <= maxsize and producers >= 1 and consumers >= 1
        self.name = name
        self.maxsize = maxsize
        self.min_ready = min_ready
        self._items: collections.deque[T] = collections.deque()  # in the order they leave
        self._order = order
        self._held: dict[int, T] = {}  # `order`: items that came early (keys before theirs missing), by key
        self._next = 0  # `order`: the key of the next item to leave
        self._open_producers = producers
        self._open_consumers = consumers
        self._failure: BaseException | None = None
        self._waiters: list[asyncio.Future[None]] = []
        self._reset_window(time.perf_counter())

    def __len__(self) -> int:
        return len(self._items) + len(self._held)

    @property
    def closed(self) -> bool:
        """True once every producer has closed (items may still be buffered)."""
        return self._open_producers == 0

    # -- waiting: every state change wakes every waiter, which re-checks its condition ---
    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    async def _wait(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        await fut

    # -- statistics ---------------------------------------------------------------------
    def _reset_window(self, now: float) -> None:
        self._win_start = now
        self._last_change = now
        self._depth_area = 0.0
        self._max_depth = len(self)
        self._put_wait = 0.0
        self._get_wait = 0.0
        self._puts = 0
        self._gets = 0

    def _depth_changed(self, before: int) -> None:
        now = time.perf_counter()
        self._depth_area += before * (now - self._last_change)
        self._last_change = now
        self._max_depth = max(self._max_depth, len(self))

    def snapshot(self, reset: bool = True) -> ChannelStats:
        now = time.perf_counter()
        depth = len(self)
        area = self._depth_area + depth * (now - self._last_change)
        span = now - self._win_start
        mean_depth = area / span if span > 0 else float(depth)
        # In ChannelStats' field order: depth now / mean / max, capacity, then waits and counts.
        stats = ChannelStats(
            depth, mean_depth, self._max_depth, self.maxsize, self._put_wait, self._get_wait, self._puts, self._gets
        )
        if reset:
            self._reset_window(now)
        return stats

    # -- producer side ------------------------------------------------------------------
    def _check_put(self) -> None:
        if self._failure is not None:
            msg = f"consumer of channel {self.name!r} died: {self._failure!r}"
            raise ConsumerDied(msg) from self._failure
        if self._open_consumers == 0:
            msg = f"channel {self.name!r}: every consumer has left"
            raise ChannelClosed(msg)
        if self._open_producers == 0:
            msg = f"put on channel {self.name!r} after all producers closed"
            raise RuntimeError(msg)

    async def put(self, item: T) -> float:
        """Put an item, waiting while full. Returns the seconds spent waiting."""
        self._check_put()
        t0 = time.perf_counter()
        key = self._order(item) if self._order is not None else None
        while len(self) >= self.maxsize and (key != self._next or len(self._items) >= self.min_ready):
            await self._wait()
            self._check_put()
        waited = time.perf_counter() - t0
        self._put_wait += waited
        before = len(self)
        if key is None:
            self._items.append(item)
        else:
            self._admit(key, item)
        self._puts += 1
        self._depth_changed(before)
        self._wake()
        return waited

    def _admit(self, key: int, item: T) -> None:
        """`order`: hold `item` until every key before it came; then it leaves after them,
        followed by every held item that now has no gap before it."""
        if key < self._next or key in self._held:
            msg = f"channel {self.name!r}: key {key} came twice (next expected: {self._next})"
            raise RuntimeError(msg)
        self._held[key] = item
        while self._next in self._held:
            self._items.append(self._held.pop(self._next))
            self._next += 1

    def close(self) -> None:
        """One producer is done. When all are, consumers drain what is left, then end (items
        still held for a key that never came leave too, in key order: nothing is lost)."""
        if self._open_producers > 0:
            self._open_producers -= 1
        if self._open_producers == 0 and self._held:
            self._items.extend(self._held[k] for k in sorted(self._held))
            self._held.clear()
        self._wake()

    # -- consumer side ------------------------------------------------------------------
    def _ready(self) -> bool:
        return len(self._items) >= self.min_ready or (self.closed and bool(self._items))

    async def get(self) -> tuple[T, float]:
        """Take an item; returns (item, seconds waited). Raises EndOfStream at the end."""
        t0 = time.perf_counter()
        while not self._ready():
            if self.closed and not self._items:
                self._get_wait += time.perf_counter() - t0
                msg = f"channel {self.name!r} is closed and drained"
                raise EndOfStream(msg)
            await self._wait()
        waited = time.perf_counter() - t0
        self._get_wait += waited
        before = len(self)
        item = self._items.popleft()
        self._gets += 1
        self._depth_changed(before)
        self._wake()
        return item, waited

    def detach(self, error: BaseException | None = None) -> None:
        """A consumer leaves. With `error`, producers raise ConsumerDied at once."""
        if error is not None and self._failure is None:
            self._failure = error
        if self._open_consumers > 0:
            self._open_consumers -= 1
        if self._open_consumers == 0 or self._failure is not None:
            before = len(self)
            self._items.clear()  # nobody will read them; free the memory now
            self._held.clear()
            self._depth_changed(before)
        self._wake()

    def __aiter__(self) -> Channel[T]:
        return self

    async def __anext__(self) -> T:
        try:
            item, _ = await self.get()
        except EndOfStream:
            raise StopAsyncIteration from None
        return item
