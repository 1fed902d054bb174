"""What every stage shares: how it is linked to its channels, the relay loop, and how its
failure is named (`stage_task`) and told apart from the echoes it causes (`root_error`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import torch

from dflash.errors import StageError
from dflash.runtime.channel import Channel, ChannelClosed, ConsumerDied

__all__ = ["linked", "relay", "root_error", "stage_task"]

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


def _flatten(eg: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for e in eg.exceptions:
        out.extend(_flatten(e) if isinstance(e, BaseExceptionGroup) else [e])
    return out


def root_error(eg: BaseExceptionGroup) -> BaseException:
    """The cause, not its echoes: a KeyboardInterrupt first, then a stage's own error over
    the ConsumerDied / ChannelClosed its neighbours saw."""
    errors = _flatten(eg)
    for e in errors:
        if not isinstance(e, Exception):
            return e
    stage_errors = [e for e in errors if isinstance(e, StageError)]
    for e in stage_errors:
        if not isinstance(e.cause, ConsumerDied | ChannelClosed):
            return e
    return stage_errors[0] if stage_errors else errors[0]


async def stage_task(name: str, coro: Coroutine[Any, Any, Any]) -> Any:
    """A stage's exception becomes a StageError naming it (out of memory: with a hint)."""
    try:
        return await coro
    except (asyncio.CancelledError, StageError):
        raise
    except torch.OutOfMemoryError as e:
        hint = (
            "lower data.token_budget or data.batch_size"
            if name.startswith(("target.", "data."))
            else "lower drafter.max_anchors, data.token_budget or loss.chunk"
        )
        raise StageError(name, MemoryError(f"out of memory ({hint})")) from e
    except Exception as e:
        raise StageError(name, e) from e
