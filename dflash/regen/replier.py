"""Who writes `dflash regen`'s replies, behind one face (`Replier`): the target's own generate
loop here (`regen/local.py`), vLLM's offline API in this process (`regen/vllm.py`), or an
OpenAI-compatible server (`regen/server.py`). `command.open_replier` picks one from the config,
once.

A replier is handed the prompts to answer as batches (in the order regen wants them
answered), an `Output` to write each reply to, and a time budget; it writes replies as they
come back and leaves what it did not answer for a later regen. What a record holds, the
resume, the held-out split and the feature files' folder are regen's, not a replier's.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Protocol

from dflash.data.prompts import Messages

if TYPE_CHECKING:
    from dflash.features.files import Entry

__all__ = ["Output", "Replier", "Todo", "seed_number", "until_eos"]

Todo = list[tuple[int, list[int]]]  # prompts to answer: (its number in this regen, its token ids)


class Output(Protocol):
    """Where a replier writes: each reply becomes a record, in the order it is handed over."""

    def prompt(self, i: int) -> Messages:
        """Prompt i: the conversation its reply continues (the turn's prompt)."""
        ...

    def tools(self, i: int) -> list[Any] | None:
        """Prompt i's conversation's function schemas (rendered with it), or None."""
        ...

    def where(self, i: int) -> tuple[int, int]:
        """Prompt i's conversation (its index among the training conversations) and turn (1, 2, ...)."""
        ...

    def write_ids(self, i: int, ids: list[int]) -> Messages:
        """Training prompt i's reply as the target's token ids (cut at the eos), decoded and
        written; returns the conversation written."""
        ...

    def write_text(self, i: int, text: str, tokens: int | None) -> Messages:
        """Training prompt i's reply as text and the tokens it took (None: count them), written;
        returns the conversation written."""
        ...

    def write_features(self, entries: list[Entry | None]) -> None:
        """The feature-file entries of the replies just written (`regen.save_features`)."""
        ...

    def flush(self) -> None:
        """What is written so far, on disk: a regen killed now resumes after it."""
        ...


class Replier(Protocol):
    """One regen's answering engine. `engine`, `target_dtype`, `server`, `start_s` and
    `refused` are what the `regen` record says of it."""

    engine: str  # "hf", "vllm" or "server"
    target_dtype: str | None  # the dtype the target ran in, where it ran in this process
    server: str | None  # "MODEL at URL" for a server
    start_s: float  # seconds the engine took to start inside `answer_all`: not counted in tok/s
    refused: int  # prompts the engine refused: skipped, a later regen asks them again

    def answer_all(self, queue: collections.deque[Todo], out: Output, budget_s: float) -> None:
        """The queued batches' prompts answered into `out`, until the queue runs out or
        `budget_s` seconds pass (math.inf: no budget)."""
        ...

    def close(self) -> None:
        """What the replier holds open (a server's connections), released."""
        ...


def until_eos(ids: list[int], eos: int) -> list[int]:
    """A reply's token ids up to (not including) the first eos."""
    return ids[: ids.index(eos)] if eos in ids else ids


_TURN_STRIDE = 1_000_003  # seed numbers of a conversation's later turns: apart from every first turn's


def seed_number(out: Output, i: int) -> int:
    """Prompt i's number for a sampled reply's seed (regen.seed + it): its conversation's index,
    offset per turn, so that a resumed regen draws what an uninterrupted one would."""
    conversation, turn = out.where(i)
    return conversation + _TURN_STRIDE * (turn - 1)
