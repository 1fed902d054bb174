"""Every assistant turn regenerated on-policy and supervised as a server renders it.

A tiny random Qwen3 target with a word-level tokenizer whose chat template behaves like
Qwen3's (written for these tests): with `enable_thinking` the generation prompt opens a
`<think>` block, the current turn's reply is rendered as written, and earlier assistant turns
lose their reasoning (everything up to `</think>`, and the opener). Tool calls and results
render from the OpenAI schema, the conversation's `tools` in a header. Regen answers every
turn (the target's own earlier replies in context), resumes mid-conversation, mixes prompt
sets by weight; training reads one sample per turn where the template rewrites earlier turns.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash.config import Config, DataConfig, load_config
from dflash.data.chat_template import prompt_ids, tokenize_many
from dflash.data.prompts import interleave, load_prompts, turns_of
from dflash.data.tokenize import load_samples
from dflash.regen import command as regen
from dflash.regen import regenerate
from tests.conftest import run_records
from tests.test_regen_files import _tokenizer as word_tokenizer

THINKING = (
    "{%- set ns = namespace(last=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- if tools -%}{{ '<|im_start|>system\n' }}{%- for t in tools -%}{{ t.function.name + ' ' }}{%- endfor -%}"
    "{{ '<|im_end|>\n' }}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}{{ '<|im_start|>assistant\n' }}"
    "{%- if m.tool_calls -%}{{ 'call ' + m.tool_calls[0].function.name }}"
    "{%- elif loop.index0 > ns.last -%}{{ ('<think>\n' if enable_thinking else '') + m.content }}"
    "{%- else -%}{{ m.content.split('</think>')[-1] | trim }}{%- endif -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking -%}{{ '<think>\n' }}{%- endif -%}{%- endif -%}"
)
WORDS = (
    "system user assistant tool you are terse hi hello there how is it going fine thanks bye ok call weather "
    "tell me about the cat dog sun moon sea sky tree red blue green one two three what why please sure yes no"
)
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}]
THINK = {"enable_thinking": True}


def _tokenizer() -> Any:
    return word_tokenizer(WORDS, THINKING, ("<think>", "</think>"))


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _conversations() -> list[dict[str, Any]]:
    """16 chats of one to three user turns (the source's replies are the target's to write);
    every fourth one an agent's: a tool call and its result before the reply."""
    out = []
    for i, subject in enumerate(
        f"{a} {s}" for a in ("red", "blue", "green", "one") for s in ("cat", "dog", "sun", "sea")
    ):
        msgs: list[dict[str, Any]] = [_user(f"tell me about the {subject}")]
        if i % 4 == 3:
            call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
            msgs += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "c1", "content": "sun"}]  # fmt: skip
        for k, more in enumerate(("why", "please tell me more")[: i % 3]):
            msgs += [{"role": "assistant", "content": "fine thanks"}, _user(more if k else f"why the {subject}")]
        msgs.append({"role": "assistant", "content": "ok"})
        out.append({"messages": msgs, **({"tools": TOOLS} if i % 4 == 3 else {})})
    return out


@dataclass
class Env:
    root: Path
    config: Path
    prompts: Path
    tokenizer: Any
    target: Any

    def cfg(self, name: str, *overrides: str) -> Config:
        return load_config(self.config, [f'run.name="{name}"', *overrides])


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Env:
    import tomli_w
    from transformers.utils import logging as hf_logging

    from dflash.config import TinyTargetConfig
    from dflash.model.loading import load_tokenizer
    from dflash.model.target import build_tiny, load_target

    root = tmp_path_factory.mktemp("regen_turns")
    tok = _tokenizer()
    hf_logging.disable_progress_bar()
    build_tiny(TinyTargetConfig(vocab_size=len(tok))).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    prompts = root / "chats.jsonl"
    prompts.write_text("".join(json.dumps(c) + "\n" for c in _conversations()), encoding="utf-8")
    runs = root / "runs"
    config = {
        "run": {"name": "main", "output_dir": str(runs), "seed": 0},
        "target": {"kind": "hf", "path": str(root / "model"), "stop_token": "<|im_end|>"},
        "regen": {"prompts": str(prompts), "holdout": 2, "max_new_tokens": 6, "batch_size": 3},
        "data": {
            "source": "files", "files": [{"path": str(runs / "main" / "regen.jsonl")}],
            "cache_dir": str(root / "cache"), "batch_size": 4, "max_seq_len": 128, "chat_template_kwargs": THINK,
        },
        "drafter": {"num_layers": 1, "block_size": 4, "max_anchors": 8,
                    "mask_token_id": tok.convert_tokens_to_ids("<|mask|>")},
        "train": {"epochs": 1, "log_every": 1}, "eval": {"at_end": False}, "profile": {"interval_s": 5.0},
    }  # fmt: skip
    path = root / "regen.toml"
    path.write_text(tomli_w.dumps(config), encoding="utf-8")
    cfg = load_config(path)
    tokenizer = load_tokenizer(cfg.target, cfg.data.cache_dir)
    target = load_target(cfg.target, torch.device("cpu"), cfg.drafter.num_layers, cfg.data.cache_dir)
    return Env(root, path, prompts, tokenizer, target)


def _records(cfg: Config) -> list[dict[str, Any]]:
    return [json.loads(line) for line in cfg.regen_output.read_text(encoding="utf-8").splitlines()]


def _by_turn(records: list[dict[str, Any]]) -> dict[tuple[int, int], dict[str, Any]]:
    return {(r["id"], r["turn"]): r for r in records}


# -- turns, and the order of the sets ------------------------------------------------------


def test_a_conversations_turns_keep_its_system_user_and_tool_messages():
    """The source's replies go (the target writes them); system, user, tool calls and tool
    results stay, each before the reply they lead to."""
    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "weather"}}]}
    result = {"role": "tool", "content": "sun"}
    msgs = [{"role": "system", "content": "terse"}, _user("a"), {"role": "assistant", "content": "x"},
            _user("b"), call, result, {"role": "assistant", "content": "y"}, _user("c")]  # fmt: skip
    assert turns_of(msgs) == [[msgs[0], msgs[1]], [msgs[3], call, result], [msgs[7]]]
    assert turns_of([{"role": "assistant", "content": "x"}, _user("a")]) == []  # no user before the first reply


@pytest.mark.parametrize("weights", [(1.0, 1.0), (0.3, 0.7), (0.2, 0.5, 0.3)])
def test_sets_are_drawn_in_their_shares_wherever_regen_stops(weights):
    """Any stopping point past 100 conversations: each set within ±5 % of its weight's share
    (here within one conversation); a set that runs out leaves the rest to the others."""
    sizes = [2000] * len(weights)
    order = interleave(sizes, list(weights))
    share = [w / sum(weights) for w in weights]
    counts = [0] * len(weights)
    for n, (j, _) in enumerate(order[:3000], 1):
        counts[j] += 1
        if n >= 100:
            assert all(abs(c / n - s) <= 0.05 for c, s in zip(counts, share, strict=True)), (n, counts)
    short = interleave([5, 100], [1.0, 1.0])
    assert [j for j, _ in short[:10]] == [0, 1] * 5 and [j for j, _ in short[10:]] == [1] * 95


def test_regen_prompts_take_weights_and_mix_the_sets(env):
    first = env.root / "first.jsonl"
    first.write_text("".join(json.dumps({"messages": [_user(f"hi {w}")]}) + "\n" for w in WORDS.split()[:30]))
    entries = f'regen.prompts=[{{source = "{first}", weight = 1.0}}, {{source = "{env.prompts}", weight = 0.5}}]'
    got = load_prompts(env.cfg("mix", entries, "regen.holdout=0"))
    assert got.source[:6] == [str(first), str(env.prompts), str(first), str(first), str(env.prompts), str(first)]
    assert [n for _, n in got.sets] == [30, 16]


# -- supervised as served ---------------------------------------------------------------------


def test_a_reasoning_templates_turns_are_one_sample_each_exactly_as_served(env, tmp_path):
    """The template strips past reasoning, so the whole conversation is no rendering any turn
    was asked in: one sample per assistant turn, its ids exactly render(messages[:k], gen) +
    reply + end-of-turn, the mask exactly on reply and end-of-turn; no DataError."""
    tok = env.tokenizer
    msgs = [_user("hi"), {"role": "assistant", "content": "<think> why </think> hello there"},
            _user("how is it going"), {"role": "assistant", "content": "<think> yes no </think> fine thanks"},
            _user("bye"), {"role": "assistant", "content": "ok"}]  # fmt: skip
    (samples,) = tokenize_many(tok, [msgs], THINK)
    assert isinstance(samples, list) and len(samples) == 3
    for k, (ids, mask) in zip((1, 3, 5), samples, strict=True):
        before = prompt_ids(tok, msgs[:k], THINK)
        reply = tok(msgs[k]["content"] + "<|im_end|>\n", add_special_tokens=False)["input_ids"]
        assert ids == before + reply and mask == [False] * len(before) + [True] * len(reply)
    full = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, **THINK)["input_ids"]
    assert full[: len(samples[0][0])] != samples[0][0]  # the whole rendering rewrote turn 1: not prefix-stable
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": msgs}) + "\n")
    got, stats = load_samples(
        DataConfig(source="files", files=[{"path": str(path)}], chat_template_kwargs=THINK), tok,
        cache_dir=tmp_path / "cache", progress=False,
    )  # fmt: skip
    assert len(got) == 3 and stats["skipped_invalid"] == 0
    assert [s.input_ids.tolist() for s in got] == [ids for ids, _ in samples]


def test_a_prefix_stable_conversation_stays_one_sample_and_its_earlier_turns_records_go(env, tmp_path):
    """Without thinking the template is prefix-stable: turn 2's record holds turn 1's, so the
    file's turn-1 record is learnt there (`continued`) and turn 2's is one sample with both
    replies supervised: the target runs over the conversation once."""
    turn1 = [_user("hi"), {"role": "assistant", "content": "hello there"}]
    turn2 = [*turn1, _user("bye"), {"role": "assistant", "content": "ok"}]
    path = tmp_path / "r.jsonl"
    path.write_text(
        "".join(json.dumps({"id": 0, "turn": k, "messages": m}) + "\n" for k, m in ((1, turn1), (2, turn2)))
    )
    off = {"enable_thinking": False}
    got, stats = load_samples(
        DataConfig(source="files", files=[{"path": str(path)}], chat_template_kwargs=off), env.tokenizer,
        cache_dir=tmp_path / "cache", progress=False,
    )  # fmt: skip
    assert (len(got), stats["records"], stats["continued"]) == (1, 2, 1)
    text = env.tokenizer.decode(got[0].input_ids[got[0].loss_mask].tolist())
    assert text.split() == ["hello", "there", "<|im_end|>", "ok", "<|im_end|>"]


def test_a_continuing_record_dropped_as_too_long_keeps_the_records_it_continues(env, tmp_path):
    """data.overlong = "drop": turn 2's record is over max_seq_len and goes, so turn 1's record,
    which it would have continued, is learnt itself."""
    turn1 = [_user("hi"), {"role": "assistant", "content": "hello there"}]
    turn2 = [*turn1, _user("bye " * 40), {"role": "assistant", "content": "ok"}]
    path = tmp_path / "r.jsonl"
    path.write_text(
        "".join(json.dumps({"id": 0, "turn": k, "messages": m}) + "\n" for k, m in ((1, turn1), (2, turn2)))
    )
    got, stats = load_samples(
        DataConfig(source="files", files=[{"path": str(path)}], max_seq_len=32, overlong="drop",
                   chat_template_kwargs={"enable_thinking": False}),
        env.tokenizer, cache_dir=tmp_path / "cache", progress=False,
    )  # fmt: skip
    assert (len(got), stats["dropped_overlong"], stats["continued"]) == (1, 1, 0)


# -- regen, every turn ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def full(env) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    cfg = env.cfg("main")
    stats = regenerate(cfg, env.target, env.tokenizer, progress=False)
    return stats, _records(cfg)


def test_regen_answers_every_turn_with_its_own_replies_in_context(env, full):
    """Turn k's prompt: the source's messages up to it, the target's replies to the turns
    before; tools carried in the record; the stats per set count prompts and turns."""
    stats, records = full
    prompts = load_prompts(env.cfg("main"))
    turns = sum(len(t) for t in prompts.train)
    assert turns > len(prompts.train) and stats["generated"] == turns == len(records)
    assert stats["per_set"] == {str(env.prompts): {"prompts": len(prompts.train), "turns": turns, "too_long": 0}}
    by_turn = _by_turn(records)
    for (i, k), r in by_turn.items():
        chat = prompts.train[i]
        expect = [m for j in range(k) for m in (*chat[j], *([by_turn[i, j + 1]["messages"][-1]] if j < k - 1 else []))]
        assert r["messages"][:-1] == expect
        assert r.get("tools") == chat.tools and r["chat_template_kwargs"] == THINK
    assert any(r.get("tools") for r in records) and any(k == 3 for _, k in by_turn)


def test_an_interrupted_regen_resumes_mid_conversation(env, full, monkeypatch):
    """Ctrl-C after a few batches (turns of a round): a second regen answers the rest —
    nothing lost, nothing answered twice, the same records as one regen without a stop."""
    _, whole = full
    cfg = env.cfg("stopped")
    answer, batches = regen.open_replier(cfg, env.target, env.tokenizer)._answer.__func__, []  # type: ignore[attr-defined]

    def interrupted(self: Any, batch: Any, out: Any) -> None:
        if len(batches) == 6:  # the first round is 5 batches: inside the second
            raise KeyboardInterrupt
        batches.append(batch)
        answer(self, batch, out)

    from dflash.regen.local import LocalReplier

    with monkeypatch.context() as m:
        m.setattr(LocalReplier, "_answer", interrupted)
        with pytest.raises(KeyboardInterrupt):
            regenerate(cfg, env.target, env.tokenizer, progress=False)
    part = _records(cfg)
    assert 0 < len(part) < len(whole) and any(r["turn"] > 1 for r in part)  # stopped inside a conversation
    again = regenerate(cfg, env.target, env.tokenizer, progress=False)
    assert (again["resumed_from"], again["generated"]) == (len(part), len(whole) - len(part))
    after = _records(cfg)
    assert len(_by_turn(after)) == len(after)  # no turn twice
    strip = lambda rs: {k: r["messages"] for k, r in _by_turn(rs).items()}  # noqa: E731
    assert strip(after) == strip(whole)


def test_later_turns_over_max_context_tokens_are_skipped_with_the_rest_of_their_conversation(env, full):
    _, whole = full
    longest_first = max(
        len(prompt_ids(env.tokenizer, r["messages"][:-1], THINK, r.get("tools"))) for r in whole if r["turn"] == 1
    )
    stats = regenerate(
        env.cfg("capped", f"regen.max_context_tokens={longest_first}"), env.target, env.tokenizer, progress=False
    )
    assert stats["too_long"] > 0 and stats["generated"] + stats["too_long"] <= len(whole)
    asked = [prompt_ids(env.tokenizer, r["messages"][:-1], THINK, r.get("tools")) for r in _records(env.cfg("capped"))]
    assert all(len(ids) <= longest_first for ids in asked)
    first_only = regenerate(env.cfg("first", 'regen.turns="first"'), env.target, env.tokenizer, progress=False)
    assert first_only["generated"] == len([r for r in whole if r["turn"] == 1])


def test_regen_output_trains_one_sample_per_turn_with_thinking_on(env, full):
    """The reasoning template's multi-turn records train without a DataError: every turn a
    sample (`continued` drops the records a later one holds)."""
    _, records = full
    cfg = env.cfg("main")
    samples, stats = load_samples(cfg.data, env.tokenizer, progress=False)
    assert stats["skipped_invalid"] == 0 and len(samples) == len(records)
    assert stats["continued"] == len(records) - len({r["id"] for r in records})
    got = run_records(cfg, timeout_s=300)
    steps = [r for r in got if r["event"] == "train_step"]
    assert steps and all(torch.isfinite(torch.tensor(r["loss"])) for r in steps)
    assert not [r for r in got if r["event"] in ("warning", "run_failed")]


def test_a_stopped_regen_has_answered_each_set_in_its_share(env, tmp_path):
    """Two sets weighted 0.3 / 0.7, a third of the second's first turns over max_prompt_tokens
    (skipped, the set's next conversation in their place): wherever the output is cut past 100
    prompts, each set's share of the prompts answered is within 5 % of its weight."""
    words = WORDS.split()
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    short = ({"messages": [_user(f"hi {w} {v}")]} for w in words[:20] for v in words[:9])
    a.write_text("".join(json.dumps(c) + "\n" for c in short))
    b.write_text("".join(
        json.dumps({"messages": [_user(f"tell me {w} {v}" + (" sea" * 30 if j % 3 == 0 else ""))]}) + "\n"
        for j, (w, v) in enumerate((w, v) for w in words[20:40] for v in words[:15])
    ))  # fmt: skip
    sets = f'regen.prompts=[{{source = "{a}", weight = 0.3}}, {{source = "{b}", weight = 0.7}}]'
    cfg = env.cfg("shares", sets, "regen.max_prompt_tokens=20", "regen.max_new_tokens=1", "regen.batch_size=32")
    stats = regenerate(cfg, env.target, env.tokenizer, progress=False)
    assert stats["per_set"][str(b)]["too_long"] == 100
    mine = {json.dumps(p, sort_keys=True): src for p, src in ((json.loads(x)["messages"], s) for s in (a, b)
            for x in s.read_text().splitlines())}  # fmt: skip
    order = [mine[json.dumps(r["messages"][:-1], sort_keys=True)] for r in _records(cfg) if r["turn"] == 1]
    assert len(order) > 250
    for n in range(100, 250):
        share = order[:n].count(a) / n
        assert abs(share - 0.3) <= 0.05, (n, share)


@pytest.mark.parametrize(
    ("entry", "says"),
    [('{source = "chatterbot", weight = 0}', "entry 0 ({'source': 'chatterbot', 'weight': 0}): weight:"),
     ('{source = "chatterbot", wieght = 1}', "wieght: Extra inputs are not permitted"),
     ('"chatterbot", {source = "chatterbot"}', "a prompt set is named twice")],
)  # fmt: skip
def test_a_bad_prompt_set_entry_is_one_line_naming_it(env, entry, says):
    from dflash.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        env.cfg("bad", f"regen.prompts=[{entry}]")
    assert says in str(err.value) and "\n" not in str(err.value)
