"""`dflash eval --engine vllm|llamacpp` on multi-turn chat sets: rounds by turn depth, each turn
asked after the engine's own reply to the one before, the rounds' records merged with τ per turn.
The engines are stood in for by a fake that answers from the prompt (the real engines' rounds
are the same calls the single-turn engine tests make)."""

from __future__ import annotations

from typing import Any

import pytest

from dflash.config import Config
from dflash.eval import engine_turns


class _Tok:
    """A tokenizer stand-in: one id per word, a chat template that joins the turns."""

    def __init__(self) -> None:
        self.words: dict[str, int] = {}

    def id(self, w: str) -> int:
        return self.words.setdefault(w, len(self.words) + 1)

    def apply_chat_template(self, messages: list[dict[str, str]], **kw: Any) -> dict[str, list[int]]:
        text = " ".join(f"{m['role']}: {m['content']}" for m in messages) + " assistant:"
        return {"input_ids": [self.id(w) for w in text.split()]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        by_id = {v: k for k, v in self.words.items()}
        return " ".join(by_id[i] for i in ids)


def test_every_turn_is_asked_after_the_engines_own_reply_and_the_rounds_merge(monkeypatch: pytest.MonkeyPatch):
    tok = _Tok()
    asked: list[dict[str, list[str]]] = []

    def engine(cfg, target, drafter, path, sets, settings, kwargs, *rest):
        outputs = rest[-1]
        asked.append({name: [tok.decode(p.tolist()) for p in prompts] for name, prompts in sets.items()})
        records = []
        for name, prompts in sets.items():
            outputs[name] = [[tok.id(f"reply{len(asked)}")] for _ in prompts]
            n, turn = len(prompts), len(asked)
            records.append({
                "prompt_set": name, "engine": "llamacpp", "prompts": n, "tau": 1.5 + turn / 10, "verify_steps": 10 * n,
                "accepted_tokens": int(10 * n * (0.5 + turn / 10)), "accept_per_position": [0.5, 0.25],
                "dflash_tau": 1.4, "dflash_verify_steps": 10 * n, "identical_to_llamacpp_greedy": n,
                "identical_to_dflash_greedy": n, "lossless": True, "llamacpp_tokens_per_s": 100.0 * turn,
            })  # fmt: skip
        return records

    monkeypatch.setattr(engine_turns, "evaluate_in_llamacpp", engine)
    user = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    chats = {"mt": [[user("one"), user("two")], [user("three")]], "single": [[user("four")]]}
    got = engine_turns.evaluate_engine_turns(Config(), "llamacpp", None, tok, None, None, chats, None, {})  # type: ignore[arg-type]
    assert asked[0] == {"mt": ["user: one assistant:", "user: three assistant:"], "single": ["user: four assistant:"]}
    assert asked[1] == {"mt": ["user: one assistant: reply1 user: two assistant:"]}  # the engine's own reply
    mt, single = got
    assert (mt["turns"], mt["generations"], mt["prompts"]) == (2, 3, 2)
    assert mt["tau_per_turn"] == [1.6, 1.7] and mt["verify_steps"] == 30
    assert mt["tau"] == round(1 + (12 + 7) / 30, 4)  # over every verify step of both turns
    assert mt["identical_to_llamacpp_greedy"] == 3 and mt["lossless"]
    assert mt["llamacpp_tokens_per_s"] == round((100 * 2 + 200 * 1) / 3, 4)
    assert (single["turns"], single["tau_per_turn"], single["tau"]) == (1, [1.6], 1.6)
