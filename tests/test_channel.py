"""Channel: the bounded, closable queue between pipeline stages, on a real asyncio loop."""

from __future__ import annotations

import asyncio

import pytest

import dflash.runtime.channel
from dflash.runtime.channel import Channel, ChannelClosed, ConsumerDied, EndOfStream


async def blocked(task: asyncio.Task) -> bool:
    """True if `task` is still waiting after the loop ran every callback ready to run
    (event order, not a timer: a task that could finish has finished by then)."""
    for _ in range(5):
        await asyncio.sleep(0)
    return not task.done()


class FakeTime:
    """Stands in for the `time` module inside dflash.runtime.channel: its clock moves only when a
    test moves it, so waits and depth-over-time are exact on any machine."""

    def __init__(self) -> None:
        self.t = 1000.0

    def perf_counter(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(dflash.runtime.channel, "time", fake)
    return fake


def test_items_come_out_in_fifo_order() -> None:
    """get returns items in the order they were put."""

    async def main() -> list[int]:
        ch: Channel[int] = Channel("t", 8)
        for i in range(6):
            await ch.put(i)
        return [(await ch.get())[0] for _ in range(6)]

    assert asyncio.run(main()) == [0, 1, 2, 3, 4, 5]


def test_fifo_order_holds_across_back_pressure() -> None:
    """A producer faster than its consumer on a small channel still delivers in order."""

    async def main() -> list[int]:
        ch: Channel[int] = Channel("t", 2)

        async def produce() -> None:
            for i in range(20):
                await ch.put(i)
            ch.close()

        async def consume() -> list[int]:
            out = []
            async for item in ch:
                out.append(item)
                await asyncio.sleep(0)
            return out

        _, out = await asyncio.wait_for(asyncio.gather(produce(), consume()), timeout=30)
        return out

    assert asyncio.run(main()) == list(range(20))


def test_put_waits_while_full_until_a_get(clock: FakeTime) -> None:
    """A put on a full channel waits, completes once a get makes room, and returns the
    seconds it waited."""

    async def main() -> None:
        ch: Channel[str] = Channel("t", 2)
        await ch.put("a")
        await ch.put("b")
        task = asyncio.create_task(ch.put("c"))
        assert await blocked(task)
        assert len(ch) == 2
        clock.t += 2.5
        item, _ = await ch.get()
        assert item == "a"
        waited = await asyncio.wait_for(task, timeout=10)
        assert waited == 2.5
        assert len(ch) == 2
        assert [(await ch.get())[0] for _ in range(2)] == ["b", "c"]

    asyncio.run(main())


def test_put_with_room_does_not_wait(clock: FakeTime) -> None:
    """put on a channel with room completes without ever yielding to the loop, and reports
    a wait of zero."""

    async def main() -> None:
        ch: Channel[int] = Channel("t", 3)
        for i in range(3):
            put = ch.put(i)
            with pytest.raises(StopIteration) as done:
                put.send(None)  # one step runs it to the end: it never suspended
            assert done.value.value == 0.0
        assert len(ch) == 3

    asyncio.run(main())


def test_get_waits_on_empty_until_a_put(clock: FakeTime) -> None:
    """get on an empty open channel waits until an item arrives, then returns it with the
    seconds it waited."""

    async def main() -> None:
        ch: Channel[int] = Channel("t", 4)
        task = asyncio.create_task(ch.get())
        assert await blocked(task)
        clock.t += 3.0
        await ch.put(7)
        item, waited = await asyncio.wait_for(task, timeout=10)
        assert item == 7
        assert waited == 3.0

    asyncio.run(main())


def test_close_lets_consumers_drain_then_end() -> None:
    """After the producer closes, buffered items are still delivered, then EndOfStream."""

    async def main() -> None:
        ch: Channel[int] = Channel("t", 4)
        await ch.put(1)
        await ch.put(2)
        ch.close()
        assert ch.closed
        assert (await ch.get())[0] == 1
        assert (await ch.get())[0] == 2
        with pytest.raises(EndOfStream):
            await asyncio.wait_for(ch.get(), timeout=10)
        with pytest.raises(EndOfStream):  # stays ended
            await asyncio.wait_for(ch.get(), timeout=10)

    asyncio.run(main())


def test_close_wakes_a_waiting_consumer() -> None:
    """A consumer blocked on an empty channel gets EndOfStream when the producer closes."""

    async def main() -> None:
        ch: Channel[int] = Channel("t", 4)
        task = asyncio.create_task(ch.get())
        assert await blocked(task)
        ch.close()
        with pytest.raises(EndOfStream):
            await asyncio.wait_for(task, timeout=10)

    asyncio.run(main())


def test_async_for_ends_when_closed_and_drained() -> None:
    """`async for` over a channel yields every item and stops after close."""

    async def main() -> list[int]:
        ch: Channel[int] = Channel("t", 8)
        for i in range(3):
            await ch.put(i)
        ch.close()

        async def collect() -> list[int]:
            return [item async for item in ch]

        return await asyncio.wait_for(collect(), timeout=10)

    assert asyncio.run(main()) == [0, 1, 2]


def test_put_after_all_producers_closed_is_an_error() -> None:
    """put after every producer closed is a programming error (RuntimeError)."""

    async def main() -> None:
        ch: Channel[int] = Channel("t", 4)
        ch.close()
        with pytest.raises(RuntimeError):
            await ch.put(1)

    asyncio.run(main())


def test_channel_ends_only_after_every_producer_closed() -> None:
    """With 2 producers, one close is not the end: consumers wait for the second."""

    async def main() -> None:
        ch: Channel[str] = Channel("t", 4, producers=2)
        await ch.put("x")
        ch.close()
        assert not ch.closed
        assert (await ch.get())[0] == "x"
        task = asyncio.create_task(ch.get())
        assert await blocked(task)
        await ch.put("y")  # the second producer is still open
        assert (await asyncio.wait_for(task, timeout=10))[0] == "y"
        task = asyncio.create_task(ch.get())
        assert await blocked(task)
        ch.close()
        assert ch.closed
        with pytest.raises(EndOfStream):
            await asyncio.wait_for(task, timeout=10)

    asyncio.run(main())


def test_two_concurrent_producers_deliver_everything() -> None:
    """Items from two producers all arrive, each producer's in its own order."""

    async def main() -> list[tuple[str, int]]:
        ch: Channel[tuple[str, int]] = Channel("t", 2, producers=2)

        async def produce(name: str) -> None:
            try:
                for i in range(10):
                    await ch.put((name, i))
                    await asyncio.sleep(0)
            finally:
                ch.close()

        async def consume() -> list[tuple[str, int]]:
            return [item async for item in ch]

        *_, out = await asyncio.wait_for(asyncio.gather(produce("a"), produce("b"), consume()), timeout=30)
        return out

    out = asyncio.run(main())
    assert sorted(out) == sorted([(n, i) for n in "ab" for i in range(10)])
    for name in "ab":
        assert [i for n, i in out if n == name] == list(range(10))


def test_min_ready_holds_gets_until_enough_items_or_close() -> None:
    """With min_ready=3, get waits for 3 buffered items, or for close (then drains)."""

    async def main() -> None:
        ch: Channel[int] = Channel("t", 4, min_ready=3)
        await ch.put(1)
        await ch.put(2)
        task = asyncio.create_task(ch.get())
        assert await blocked(task)
        await ch.put(3)
        assert (await asyncio.wait_for(task, timeout=10))[0] == 1
        # two left: below min_ready again, so the next get waits ...
        task = asyncio.create_task(ch.get())
        assert await blocked(task)
        # ... until the producer closes, after which the rest drains.
        ch.close()
        assert (await asyncio.wait_for(task, timeout=10))[0] == 2
        assert (await asyncio.wait_for(ch.get(), timeout=10))[0] == 3
        with pytest.raises(EndOfStream):
            await asyncio.wait_for(ch.get(), timeout=10)

    asyncio.run(main())


def test_detach_by_every_consumer_stops_a_waiting_producer() -> None:
    """When all consumers detach cleanly, a blocked put raises ChannelClosed."""

    async def main() -> None:
        ch: Channel[int] = Channel("t", 1)
        await ch.put(1)
        task = asyncio.create_task(ch.put(2))
        assert await blocked(task)
        ch.detach()
        with pytest.raises(ChannelClosed):
            await asyncio.wait_for(task, timeout=10)

    asyncio.run(main())


def test_put_after_every_consumer_detached_raises_channel_closed() -> None:
    """A put after all consumers left raises ChannelClosed at once (even with room)."""

    async def main() -> None:
        ch: Channel[int] = Channel("t", 4)
        ch.detach()
        with pytest.raises(ChannelClosed):
            await asyncio.wait_for(ch.put(1), timeout=10)

    asyncio.run(main())


def test_producer_keeps_going_while_one_consumer_remains() -> None:
    """With 2 consumers, one clean detach does not stop producers; the second does."""

    async def main() -> None:
        ch: Channel[int] = Channel("t", 1, consumers=2)
        await ch.put(1)
        task = asyncio.create_task(ch.put(2))
        ch.detach()
        assert await blocked(task)
        assert (await ch.get())[0] == 1
        await asyncio.wait_for(task, timeout=10)
        ch.detach()
        with pytest.raises(ChannelClosed):
            await asyncio.wait_for(ch.put(3), timeout=10)

    asyncio.run(main())


def test_detach_with_error_fails_a_blocked_producer_promptly() -> None:
    """detach(error) makes a blocked put raise ConsumerDied, chained to the error."""

    async def main() -> None:
        ch: Channel[int] = Channel("t", 1, consumers=2)
        await ch.put(1)
        task = asyncio.create_task(ch.put(2))
        assert await blocked(task)
        boom = ValueError("boom")
        ch.detach(boom)  # one of two consumers failing is enough
        with pytest.raises(ConsumerDied) as info:
            await asyncio.wait_for(task, timeout=10)
        assert info.value.__cause__ is boom
        assert "boom" in str(info.value)
        with pytest.raises(ConsumerDied):  # and every later put fails too
            await asyncio.wait_for(ch.put(3), timeout=10)

    asyncio.run(main())


def test_consumer_died_wins_over_clean_detach() -> None:
    """If any consumer failed, producers see ConsumerDied rather than ChannelClosed."""

    async def main() -> None:
        ch: Channel[int] = Channel("t", 4, consumers=2)
        ch.detach()
        ch.detach(RuntimeError("late failure"))
        with pytest.raises(ConsumerDied):
            await asyncio.wait_for(ch.put(1), timeout=10)

    asyncio.run(main())


def test_detach_drops_buffered_items() -> None:
    """Once every consumer has left, buffered items are dropped (depth 0)."""

    async def main() -> None:
        ch: Channel[int] = Channel("t", 4)
        await ch.put(1)
        await ch.put(2)
        ch.detach()
        assert len(ch) == 0
        assert ch.snapshot().depth == 0

    asyncio.run(main())


def test_snapshot_reports_window_and_resets(clock: FakeTime) -> None:
    """snapshot() reports depth, time-weighted mean depth, max depth, puts, gets and waits,
    then starts a new window."""

    async def main() -> None:
        ch: Channel[int] = Channel("t", 4)
        for i in range(3):
            await ch.put(i)
        clock.t += 1.0  # 3 items for 1 s ...
        await ch.get()
        clock.t += 1.0  # ... then 2 items for 1 s
        s = ch.snapshot()
        assert s.depth == 2
        assert s.max_depth == 3
        assert s.capacity == 4
        assert (s.puts, s.gets) == (3, 1)
        assert s.put_wait_s == 0
        assert s.get_wait_s == 0
        assert s.mean_depth == 2.5

        s2 = ch.snapshot()  # an empty window: its mean is the current depth
        assert (s2.puts, s2.gets) == (0, 0)
        assert s2.depth == 2
        assert s2.max_depth == 2  # the new window starts at the current depth
        assert s2.mean_depth == 2
        assert s2.put_wait_s == 0
        assert s2.get_wait_s == 0

    asyncio.run(main())


def test_snapshot_without_reset_keeps_the_window() -> None:
    """snapshot(reset=False) reads the counters without clearing them."""

    async def main() -> None:
        ch: Channel[int] = Channel("t", 4)
        await ch.put(1)
        assert ch.snapshot(reset=False).puts == 1
        assert ch.snapshot(reset=False).puts == 1
        assert ch.snapshot().puts == 1
        assert ch.snapshot().puts == 0

    asyncio.run(main())


def test_snapshot_measures_producer_and_consumer_waits(clock: FakeTime) -> None:
    """Time a blocked put or get spends waiting adds up in put_wait_s / get_wait_s."""

    async def main() -> None:
        ch: Channel[int] = Channel("t", 1)
        ch.snapshot()
        getter = asyncio.create_task(ch.get())
        assert await blocked(getter)
        clock.t += 1.5
        await ch.put(1)
        await asyncio.wait_for(getter, timeout=10)
        await ch.put(2)
        putter = asyncio.create_task(ch.put(3))
        assert await blocked(putter)
        clock.t += 0.5
        await ch.get()
        await asyncio.wait_for(putter, timeout=10)
        s = ch.snapshot()
        assert s.get_wait_s == 1.5
        assert s.put_wait_s == 0.5
        assert (s.puts, s.gets) == (3, 2)

    asyncio.run(main())


def test_mean_depth_is_time_weighted(clock: FakeTime) -> None:
    """mean_depth weighs each depth by how long the channel held it, not by how often it
    changed, nor by the last or largest depth."""

    async def main() -> None:
        ch: Channel[int] = Channel("t", 4)
        ch.snapshot()
        await ch.put(1)
        await ch.put(2)
        clock.t += 3.0  # depth 2 for 3 s
        await ch.get()
        clock.t += 1.0  # depth 1 for 1 s
        await ch.get()
        clock.t += 4.0  # depth 0 for 4 s
        s = ch.snapshot()
        assert s.depth == 0
        assert s.max_depth == 2
        assert s.mean_depth == (2 * 3 + 1 * 1 + 0 * 4) / 8

    asyncio.run(main())


def test_ordered_items_leave_in_key_order_whatever_order_they_came_in() -> None:
    """`order`: two producers putting keys out of order; a consumer sees 0, 1, 2, ... and an
    early key is not ready (even with room) until the ones before it came."""

    async def main() -> None:
        ch: Channel[int] = Channel("ordered", 4, producers=2, order=lambda k: k)
        await ch.put(1)
        await ch.put(2)
        getter = asyncio.ensure_future(ch.get())
        assert await blocked(getter) and len(ch) == 2  # held: 0 has not come
        await ch.put(0)
        assert (await getter)[0] == 0
        assert [(await ch.get())[0] for _ in range(2)] == [1, 2]
        ch.close()
        await ch.put(4)  # the other producer: 3 never comes, 4 is held...
        ch.close()  # ...until every producer closed: nothing is lost
        assert (await ch.get())[0] == 4
        with pytest.raises(EndOfStream):
            await ch.get()

    asyncio.run(main())


def test_a_full_ordered_channel_still_takes_the_next_key() -> None:
    """Full of early keys, the channel still lets the next expected key in (it frees the
    others) while a later one waits for room: no deadlock; a key put twice is an error."""

    async def main() -> None:
        ch: Channel[int] = Channel("ordered", 2, producers=3, order=lambda k: k)
        await ch.put(1)
        await ch.put(2)
        late = asyncio.ensure_future(ch.put(4))
        assert await blocked(late)
        await ch.put(0)  # full, but its turn: in at once
        assert len(ch) == 3 and await blocked(late)
        assert [(await ch.get())[0] for _ in range(2)] == [0, 1]
        await late  # room again: in, held until 3 comes
        getter = asyncio.ensure_future(asyncio.gather(ch.get(), ch.get()))
        await ch.put(3)
        assert [item for item, _ in await getter] == [2, 3]
        assert (await ch.get())[0] == 4
        with pytest.raises(RuntimeError, match="key 2 came twice"):
            await ch.put(2)

    asyncio.run(main())


def test_an_ordered_channel_keeps_its_back_pressure() -> None:
    """In-order keys with nobody taking: the producer waits at `maxsize`, as without `order`
    (only a channel whose consumers can take nothing lets the next key past full)."""

    async def main() -> None:
        ch: Channel[int] = Channel("ordered", 2, producers=2, order=lambda k: k)
        await ch.put(0)
        await ch.put(1)
        third = asyncio.ensure_future(ch.put(2))
        assert await blocked(third) and len(ch) == 2
        assert (await ch.get())[0] == 0
        await third
        assert len(ch) == 2

    asyncio.run(main())
