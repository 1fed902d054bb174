"""One chat record → a normalised conversation, or the one-line reason it cannot be used.

Every supported layout (``formats.py``) hands its records here, so all of them become the
same thing — a list of ``{"role", "content"}`` messages with roles ``system`` / ``user`` /
``assistant`` — with where the record came from. Role spellings ``human``/``user`` → user,
``gpt``/``assistant``/``model`` → assistant and ``system`` are accepted in both shapes
(OpenAI ``messages`` and ShareGPT ``conversations``); any other role is an error, because
silently dropping (say) a ``tool`` turn would train on a conversation the model never saw.
A record that cannot be used is an ``InvalidRecord``, not an exception: whether it may be
skipped is the caller's decision (``data.skip_invalid``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from dflash.errors import DataError

__all__ = ["ROLE_ALIASES", "Conversation", "InvalidRecord", "Message", "normalize_record", "parse_record"]

Message = dict[str, str]

# One table for both shapes: a ShareGPT file that says "user" or an OpenAI file that says
# "gpt" is still unambiguous, and refusing it would only annoy.
ROLE_ALIASES: dict[str, str] = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
}


@dataclass(frozen=True)
class Conversation:
    """One usable record: normalised messages, with where it came from."""

    path: str
    index: int  # JSONL: 1-based line; parquet / datasets: 0-based row
    unit: Literal["line", "row", "item"]
    messages: list[Message]

    @property
    def where(self) -> str:
        return _where(self.path, self.unit, self.index)


@dataclass(frozen=True)
class InvalidRecord:
    """A record that cannot be used, and why; `error()` is the one-line DataError."""

    path: str
    index: int
    unit: Literal["line", "row", "item"]
    reason: str
    prompt: list[Message] | None = None  # a record whose one fault is no assistant turn: a prompt (regen)

    @property
    def where(self) -> str:
        return _where(self.path, self.unit, self.index)

    def error(self) -> DataError:
        return DataError(f"{self.where}: {self.reason}")


def _where(path: str, unit: str, index: int) -> str:
    # "file:12" for lines (clickable in editors and terminals); "file, row 12" otherwise.
    return f"{path}:{index}" if unit == "line" else f"{path}, {unit} {index}"


def _type_name(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", type(None): "null", bool: "a boolean"}.get(
        type(v), type(v).__name__
    )


def normalize_record(record: Any) -> list[Message] | str:
    """The record's messages as ``[{"role", "content"}]`` with canonical roles, or the
    reason (one line) it cannot be read. Whether it has an assistant turn to train on is
    `parse_record`'s question (a prompt needs none)."""
    if not isinstance(record, dict):
        return f"expected a JSON object with 'messages' or 'conversations', got {_type_name(record)}"
    if "messages" in record:
        key, role_key, content_key = "messages", "role", "content"
    elif "conversations" in record:
        key, role_key, content_key = "conversations", "from", "value"
    else:
        keys = ", ".join(sorted(map(str, record))) or "none"
        return f"record has neither 'messages' nor 'conversations' (keys: {keys})"
    return _normalize_messages(record[key], key, role_key, content_key)


def _normalize_messages(turns: Any, key: str, role_key: str, content_key: str) -> list[Message] | str:
    if isinstance(turns, str):
        # Some exports store the list as a JSON string (a parquet column of strings).
        try:
            turns = json.loads(turns)
        except json.JSONDecodeError:
            return f"'{key}' must be a list of {{{role_key}, {content_key}}} objects, got a string"
    if not isinstance(turns, list):
        return f"'{key}' must be a list of {{{role_key}, {content_key}}} objects, got {_type_name(turns)}"
    out: list[Message] = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return f"'{key}'[{i}] must be an object with '{role_key}' and '{content_key}', got {_type_name(turn)}"
        role, content = turn.get(role_key), turn.get(content_key)
        if not isinstance(role, str):
            return f"'{key}'[{i}].{role_key} must be a string, got {_type_name(role)}"
        canonical = ROLE_ALIASES.get(role.strip().lower())
        if canonical is None:
            allowed = ", ".join(ROLE_ALIASES)
            return f"'{key}'[{i}]: unknown role {role!r} (allowed: {allowed})"
        if not isinstance(content, str):
            return f"'{key}'[{i}].{content_key} must be a string, got {_type_name(content)}"
        out.append({"role": canonical, "content": content})
    if not out:
        return f"'{key}' is empty"
    return out


def parse_record(
    path: str, index: int, unit: Literal["line", "row", "item"], record: Any
) -> Conversation | InvalidRecord:
    got = normalize_record(record)
    if isinstance(got, str):
        return InvalidRecord(path, index, unit, got)
    if not any(m["role"] == "assistant" for m in got):  # nothing to supervise: the loss mask would be all zeros
        return InvalidRecord(path, index, unit, "conversation has no assistant turn", prompt=got)
    return Conversation(path, index, unit, got)
