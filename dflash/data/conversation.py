"""One chat record → a normalised conversation, or the one-line reason it cannot be used.

Every supported layout (``formats.py``) hands its records here, so all of them become the
same thing — a list of ``{"role", "content"}`` messages with roles ``system`` / ``user`` /
``assistant`` / ``tool`` — with where the record came from and the record's ``tools`` (the
function schemas the chat template renders). Role spellings ``human``/``user`` → user,
``gpt``/``assistant``/``model`` → assistant, ``system`` and ``tool`` are accepted in both shapes
(OpenAI ``messages`` and ShareGPT ``conversations``); any other role is an error, because
silently dropping a turn would train on a conversation the model never saw. Agent data in the
OpenAI schema is read whole: an assistant message's ``tool_calls`` (its content may then be
null) and a tool message's ``tool_call_id`` / ``name`` are kept for the template; content given
as a list of parts is its text parts joined (any other part is an error). A record that cannot
be used is an ``InvalidRecord``, not an exception: whether it may be skipped is the caller's
decision (``data.skip_invalid``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from dflash.errors import DataError

__all__ = [
    "ROLE_ALIASES",
    "Conversation",
    "InvalidRecord",
    "Message",
    "normalize_record",
    "parse_record",
    "record_tools",
]

Message = dict[str, Any]

# One table for both shapes: a ShareGPT file that says "user" or an OpenAI file that says
# "gpt" is still unambiguous, and refusing it would only annoy.
ROLE_ALIASES: dict[str, str] = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
    "tool": "tool",
}
_KEPT = ("tool_calls", "tool_call_id", "name")  # what a template reads of agent messages, kept as given


@dataclass(frozen=True)
class Conversation:
    """One usable record: normalised messages, with where it came from."""

    path: str
    index: int  # JSONL: 1-based line; parquet / datasets: 0-based row
    unit: Literal["line", "row", "item"]
    messages: list[Message]
    tools: list[Any] | None = None  # the record's function schemas, for the chat template

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
    tools: list[Any] | None = None  # that prompt's function schemas

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
        message = _message(canonical, content, turn, f"'{key}'[{i}]", content_key)
        if isinstance(message, str):
            return message
        out.append(message)
    if not out:
        return f"'{key}' is empty"
    return out


def _message(role: str, content: Any, turn: dict[str, Any], where: str, content_key: str) -> Message | str:
    """One normalised message, or the reason it cannot be read."""
    calls = turn.get("tool_calls")
    if calls is not None and (role != "assistant" or not isinstance(calls, list)):
        return f"{where}.tool_calls: a list, on an assistant message only"
    if content is None and calls:
        content = ""
    if isinstance(content, list):  # OpenAI content parts: the text ones
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            return f"{where}.{content_key}: only text parts can be read ({{'type': 'text', 'text': ...}})"
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        return f"{where}.{content_key} must be a string, got {_type_name(content)}"
    return {"role": role, "content": content, **{k: turn[k] for k in _KEPT if turn.get(k) is not None}}


def record_tools(record: Any) -> list[Any] | str | None:
    """A record's `tools` (OpenAI function schemas), None without, or the reason it is unusable."""
    tools = record.get("tools") if isinstance(record, dict) else None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            return "'tools' must be a list of objects, got a string"
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        return f"'tools' must be a list of objects, got {_type_name(tools)}"
    return tools


def parse_record(
    path: str, index: int, unit: Literal["line", "row", "item"], record: Any
) -> Conversation | InvalidRecord:
    got = normalize_record(record)
    if isinstance(got, str):
        return InvalidRecord(path, index, unit, got)
    tools = record_tools(record)
    if isinstance(tools, str):
        return InvalidRecord(path, index, unit, tools)
    if not any(m["role"] == "assistant" for m in got):  # nothing to supervise: the loss mask would be all zeros
        return InvalidRecord(path, index, unit, "conversation has no assistant turn", prompt=got, tools=tools)
    return Conversation(path, index, unit, got, tools)
