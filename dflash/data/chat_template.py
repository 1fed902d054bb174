"""One conversation → token ids and an assistant-only loss mask, by the tokenizer's chat template.

The drafter must learn to predict the target's answers, not the user's questions or the
template's scaffolding, so only what the assistant says is supervised.

**Loss mask by incremental rendering.** Templates such as ChatML (SmolLM2, Qwen) carry no
``{% generation %}`` markers, so the mask is computed from prefixes: for each assistant
message i, the tokens between ``render(messages[:i], add_generation_prompt=True)`` and
``render(messages[:i+1])`` are supervised — the assistant's content and the template's
end-of-turn text (ChatML: ``<|im_end|>`` and the newline after it), but not the
``<|im_start|>assistant\\n`` header. An assistant turn that opens a conversation has no prompt
to render, so it is context, not supervised.

**One sample, or one per turn: as a server renders it.** Where the template is prefix-stable —
each turn's rendering is a token prefix of the whole conversation's — the conversation is one
sample with every reply supervised (the target runs over it once). A template that rewrites
earlier turns (Qwen3's strips past ``<think>`` blocks) is not: a server asked turn i renders
``messages[:i]`` its own way, and the reply follows that. Such a conversation becomes one sample
per assistant turn, each exactly ``render(messages[:i], add_generation_prompt=True)`` followed
by the reply and the end-of-turn (``render(messages[:i+1])``), supervised on the reply and
end-of-turn only. A template for which even that is not a prefix is a DataError. Cost: O(turns²)
tokens per record, fine for chat data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dflash.data.conversation import Message
from dflash.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["prompt_ids", "tokenize_conversation", "tokenize_many"]


class _Invalid(Exception):
    """A record-level problem found while tokenizing; the message is the reason."""


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[Message], gen: bool, kwargs: dict[str, Any]) -> str:
    """`kwargs`: the template's options, and the conversation's `tools` where it has them."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kwargs)
    except Exception as err:  # jinja's raise_exception (roles must alternate, ...) and the like
        detail = " ".join(str(err).split()) or type(err).__name__
        msg = f"chat template refused the conversation: {detail}"
        raise _Invalid(msg) from None
    assert isinstance(text, str)
    return text


def _plan(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], kw: dict[str, Any]
) -> list[tuple[int, str, str]]:
    """Per supervised assistant message i: (i, prompt text up to its header, text through it)."""
    return [
        (i, _render(tokenizer, messages[:i], gen=True, kwargs=kw), _render(tokenizer, messages[: i + 1], False, kw))
        for i, m in enumerate(messages)
        if m["role"] == "assistant" and i > 0 and not m.get("tool_calls")  # an opening turn has no prompt
    ]


def _not_prefix(i: int) -> _Invalid:
    return _Invalid(
        f"the chat template is not prefix-stable at message {i}: rendering the conversation up to an "
        "assistant turn with its generation prompt does not give a prefix (in token ids) of the rendering "
        "through that turn, so an assistant-only loss mask cannot be computed by incremental rendering"
    )


def _samples(full: list[int], spans: list[tuple[int, list[int], list[int]]]) -> list[tuple[list[int], list[bool]]]:
    """The conversation as one sample when every turn's rendering is a prefix of `full`, else one
    sample per assistant turn (`through`, supervised past `before`)."""
    for i, before, through in spans:
        if through[: len(before)] != before:
            raise _not_prefix(i)
    if not spans:
        msg = "no assistant token to supervise (an assistant turn that opens a conversation is context)"
        raise _Invalid(msg)
    if all(full[: len(through)] == through for _, _, through in spans):
        mask = [False] * len(full)
        for _, before, through in spans:
            mask[len(before) : len(through)] = [True] * (len(through) - len(before))
        return [(full, mask)]
    return [(through, [False] * len(before) + [True] * (len(through) - len(before))) for _, before, through in spans]


def _encode(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> dict[str, list[int]]:
    # add_special_tokens=False: the template already wrote every special token it wants
    # (this is what apply_chat_template(tokenize=True) does too).
    unique = list(dict.fromkeys(texts))
    ids = tokenizer(unique, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    return dict(zip(unique, ids, strict=True))


def tokenize_many(
    tokenizer: PreTrainedTokenizerBase,
    conversations: Sequence[list[Message]],
    template_kwargs: dict[str, Any] | None = None,
    tools: Sequence[list[Any] | None] | None = None,
) -> list[list[tuple[list[int], list[bool]]] | str]:
    """Per conversation its samples — (ids, loss mask): one, or one per assistant turn where the
    template rewrites earlier turns (the module docstring) — or the reason it cannot be used;
    one batched encode for all of them. `template_kwargs`: the chat template's options
    (`data.chat_template_kwargs`, e.g. enable_thinking); `tools`: each conversation's function
    schemas (or None), rendered by the template."""
    plans: list[tuple[str, list[tuple[int, str, str]]] | str] = []
    for j, messages in enumerate(conversations):
        kw = _with_tools(template_kwargs, tools[j] if tools is not None else None)
        try:
            plans.append((_render(tokenizer, messages, False, kw), _plan(tokenizer, messages, kw)))
        except _Invalid as err:
            plans.append(str(err))
    texts = [t for p in plans if not isinstance(p, str) for t in (p[0], *(x for s in p[1] for x in s[1:]))]
    enc = _encode(tokenizer, texts) if texts else {}
    out: list[list[tuple[list[int], list[bool]]] | str] = []
    for p in plans:
        if isinstance(p, str):
            out.append(p)
            continue
        try:
            out.append(_samples(enc[p[0]], [(i, enc[a], enc[b]) for i, a, b in p[1]]))
        except _Invalid as err:
            out.append(str(err))
    return out


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], template_kwargs: dict[str, Any] | None = None
) -> tuple[list[int], list[bool]]:
    """Token ids of one conversation rendered with the tokenizer's chat template, and its
    loss mask (True on assistant content and end-of-turn tokens only): its last sample, which
    holds its last reply (`tokenize_many`). Raises DataError with the reason if it cannot be
    done. No length limit is applied."""
    (got,) = tokenize_many(tokenizer, [messages], template_kwargs)
    if isinstance(got, str):
        raise DataError(got)
    return got[-1]


def _with_tools(template_kwargs: dict[str, Any] | None, tools: list[Any] | None) -> dict[str, Any]:
    return {**(template_kwargs or {}), **({"tools": tools} if tools else {})}


def prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    template_kwargs: dict[str, Any] | None = None,
    tools: list[Any] | None = None,
) -> list[int]:
    """Token ids of a prompt as the target is asked it: the chat template with the assistant's
    turn opened (`add_generation_prompt`), as regen and eval feed it (`tools`: the
    conversation's function schemas)."""
    enc = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, **_with_tools(template_kwargs, tools)
    )
    return list(enc["input_ids"])
