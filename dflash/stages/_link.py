"""What every stage shares: how it is linked to its channels, and the relay loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

from dflash.channel import Channel, ChannelClosed

__all__ = ["linked", "relay"]

In = TypeVar("In")
Out = TypeVar("Out")


@contextlib.contextmanager
def linked(inboxes: Sequence[Channel[Any]], outboxes: Sequence[Channel[Any]]) -> Iterator[None]:
    """Ends a stage's link to its channels, whatever way the stage ends.

    - normal end, or downstream left (ChannelClosed): detach from inboxes quietly;
    - failure: detach with the error, so upstream producers raise ConsumerDied at once;
    - always: close the outboxes, so downstream consumers drain and end.
    """
    try:
        yield
    except ChannelClosed:
        for ch in inboxes:
            ch.detach()
    except BaseException as e:
        err = None if isinstance(e, asyncio.CancelledError) else e
        for ch in inboxes:
            ch.detach(err)
        raise
    else:
        for ch in inboxes:
            ch.detach()
    finally:
        for ch in outboxes:
            ch.close()


async def relay(inbox: Channel[In], outbox: Channel[Out], step: Callable[[In], Awaitable[Out]]) -> None:
    """Take, transform, put — until the inbox ends or the outbox's consumers leave."""
    with linked([inbox], [outbox]):
        async for item in inbox:
            await outbox.put(await step(item))
