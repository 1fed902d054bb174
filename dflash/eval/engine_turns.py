"""`dflash eval --engine vllm|llamacpp` on chat prompt sets: every turn, as dflash's own eval.

A multi-turn prompt (MT-Bench) is decoded in rounds by turn depth: every prompt's first turn in
the engine, then every second turn with the engine's own reply to the first in its context,
and so on — each round one `evaluate_in_vllm` / `evaluate_in_llamacpp` call (its engines start
again: a round's prompts depend on the last round's replies). The rounds' records are merged
into one per prompt set: counts summed, τ and acceptance per position over all verify steps,
lossless when every round is, and `tau_per_turn` the τ of each turn depth.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dflash.config import Config
from dflash.data.chat_template import prompt_ids
from dflash.eval.engine import evaluate_in_llamacpp, evaluate_in_vllm
from dflash.eval.prompts import Turns
from dflash.eval.tally import DecodeSettings
from dflash.model.drafter import DFlashDrafter
from dflash.model.target import Target

__all__ = ["evaluate_engine_turns", "merged"]

_SUMMED = (
    "verify_steps", "accepted_tokens", "dflash_verify_steps", "identical_to_vllm_greedy",
    "identical_to_llamacpp_greedy", "identical_to_dflash_greedy",
)  # fmt: skip


def _weighted(rounds: list[dict[str, Any]], key: str, weight: str) -> float | None:
    total = sum(r[weight] or 0 for r in rounds)
    if any(r.get(key) is None for r in rounds) or not total:
        return rounds[0].get(key)
    return round(sum(r[key] * (r[weight] or 0) for r in rounds) / total, 4)


def merged(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One prompt set's record from its rounds' (turn 1, 2, ...)."""
    out = {**rounds[0], "turns": len(rounds), "generations": sum(r["prompts"] for r in rounds)}
    out["tau_per_turn"] = [r["tau"] for r in rounds]
    if len(rounds) == 1:
        return out
    for key in _SUMMED:
        if out.get(key) is not None:
            out[key] = sum(r[key] for r in rounds)
    steps = out["verify_steps"]
    out["tau"] = round(1.0 + out["accepted_tokens"] / steps, 4) if steps else 1.0
    width = max(len(r["accept_per_position"]) for r in rounds)
    out["accept_per_position"] = [
        round(sum(r["accept_per_position"][j] * r["verify_steps"] for r in rounds if j < len(r["accept_per_position"]))
              / steps, 4) if steps else 0.0
        for j in range(width)
    ]  # fmt: skip
    out["dflash_tau"] = _weighted(rounds, "dflash_tau", "dflash_verify_steps")
    out["lossless"] = all(r["lossless"] for r in rounds)
    for key in [k for k in out if k.endswith("tokens_per_s")]:
        out[key] = _weighted(rounds, key, "prompts")  # by generations: each round's rate, its share
    return out


def evaluate_engine_turns(
    cfg: Config,
    engine: str,
    target: Target,
    tokenizer: Any,
    drafter: DFlashDrafter,
    drafter_path: Path,
    chats: Mapping[str, Sequence[Turns]],
    settings: DecodeSettings,
    template_kwargs: dict[str, Any],
    tensor_parallel: int = 1,
) -> list[dict[str, Any]]:
    """The `eval` records of chat prompt sets (name → each prompt's turns) in `engine`."""
    histories = {name: [[] for _ in prompts] for name, prompts in chats.items()}
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in chats}
    depth = max((len(p) for prompts in chats.values() for p in prompts), default=0)
    for k in range(depth):
        rows = {name: [i for i, p in enumerate(prompts) if k < len(p)] for name, prompts in chats.items()}
        sets: dict[str, list[torch.Tensor]] = {}
        for name, idx in ((n, idx) for n, idx in rows.items() if idx):
            for i in idx:
                histories[name][i] = [*histories[name][i], *chats[name][i][k]]
            sets[name] = [torch.tensor(prompt_ids(tokenizer, histories[name][i], template_kwargs)) for i in idx]
        outputs: dict[str, list[list[int]]] = {}
        if engine == "llamacpp":
            records = evaluate_in_llamacpp(cfg, target, drafter, drafter_path, sets, settings, template_kwargs, outputs)
        else:
            records = evaluate_in_vllm(
                cfg, target, drafter, drafter_path, sets, settings, template_kwargs, tensor_parallel, outputs
            )
        for rec in records:
            rounds[rec["prompt_set"]].append(rec)
        for name, idx in ((n, idx) for n, idx in rows.items() if n in outputs):
            for i, out in zip(idx, outputs[name], strict=True):
                reply = {"role": "assistant", "content": tokenizer.decode(out, skip_special_tokens=True)}
                histories[name][i] = [*histories[name][i], reply]
    return [merged(rounds[name]) for name in chats if rounds[name]]
